"""A broken slot leaves the offer, and comes back once it is repaired.

A real daemon with two real loop-mounted slot filesystems of class `small`; slot `s0`'s
filesystem is unmounted under it (what a failed disk, a mistaken `umount` or an fsck
does). Then `status` and the metrics say the slot is broken and why, a snapshot that asks
(`slots: true`) counts one usable slot of the class and names the broken one, a snapshot
that does not ask is byte for byte what it always was, and a prepare is never admitted
into the broken slot: it goes to the other one, and the next is refused `slot_capacity`
naming the broken slot. Remounted, the slot comes back on the daemon's schedule, or at
once on the administrator's `check-slots` (which the transport may not send). The log
has exactly one line for each transition.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from ficc.execution import wire
from ficc.execution.protocol import CheckSlotsRequest, SnapshotRequest, encode_request
from ficc_testkit.driver import attempt, error_code, frame, raw_exchange, rows
from ficc_testkit.host import Daemon
from ficc_testkit.plans import new_id
from ficc_testkit.waits import wait_for

COMMAND = Path(sys.executable).parent / "ficc-executor"
BROKEN, HEALTHY = "s0", "s1"


def ficc_executor(*argv: str) -> subprocess.CompletedProcess[str]:
    """The installed console command; the timeout is a hang guard, not an assertion."""
    return subprocess.run(
        [str(COMMAND), *argv], capture_output=True, text=True, check=False, timeout=120
    )


def unmount(daemon: Daemon) -> None:
    subprocess.run(["umount", str(daemon.layout.slot_paths[0])], check=True)


def remount(daemon: Daemon) -> None:
    """As docs/operations.md says to: `provision-slot --remount`, which formats nothing."""
    slot = daemon.layout.slot_filesystems[0]
    done = ficc_executor(
        "provision-slot", "--remount", "--image", str(slot.image), "--mount", str(slot.path)
    )
    assert done.returncode == 0, done.stderr


def slots_snapshot(daemon: Daemon, sender: str = "admin") -> wire.SnapshotReply:
    request = SnapshotRequest(version=1, id=new_id(), after=None, slots=True)
    reply = daemon.as_admin(request) if sender == "admin" else daemon.as_transport(request)
    assert isinstance(reply, wire.SnapshotReply), reply
    return reply


def health(daemon: Daemon) -> dict[str, wire.SlotState]:
    slots = slots_snapshot(daemon).slots
    assert isinstance(slots, list)
    return {s.id: s for s in slots}


def broken_now(daemon: Daemon) -> wire.SlotState | None:
    state = health(daemon)[BROKEN]
    return None if state.healthy else state


def healthy_again(daemon: Daemon) -> bool:
    return health(daemon)[BROKEN].healthy


def status_json(daemon: Daemon) -> dict[str, Any]:
    shown = ficc_executor("status", "--config", str(daemon.layout.config_path), "--json")
    assert shown.returncode == 0, shown.stderr
    return json.loads(shown.stdout)  # type: ignore[no-any-return]


def metric_samples(daemon: Daemon) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    shown = ficc_executor("metrics", "--config", str(daemon.layout.config_path))
    assert shown.returncode == 0, shown.stderr
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(shown.stdout)
        for s in family.samples
    }


def transitions(daemon: Daemon) -> list[tuple[str, str]]:
    return [
        (e["event"], e["slot"])
        for e in daemon.process.events()
        if e.get("event") in {"slot_out_of_service", "slot_in_service"}
    ]


def plain_snapshot_keys(daemon: Daemon) -> set[str]:
    """What a client built before `slots` existed receives: the raw reply's keys, and
    the keys of its slot classes."""
    request = SnapshotRequest(version=1, id=new_id(), after=None)
    reply = raw_exchange(daemon.transport, frame(encode_request(request)),
                         daemon.accounts["transport"])["reply"]  # fmt: skip
    document = json.loads(reply)
    classes = {k for c in document["capacity"]["slot_classes"] for k in c}
    return set(document) | classes


def check_broken_everywhere(daemon: Daemon) -> wire.SlotState:
    """Status, metrics and the opted-in snapshot all say `s0` is broken, and why."""
    state = wait_for(lambda: broken_now(daemon), "the scheduled check to find s0 broken")
    assert state.reason == "slot_filesystem", state
    assert state.message is not None
    assert "not the root of its own filesystem" in state.message
    assert "provision-slot --remount" in state.message  # what the administrator does
    shown = status_json(daemon)
    by_id = {s["id"]: s for s in shown["slots"]}
    assert (by_id[BROKEN]["healthy"], by_id[BROKEN]["reason"]) == (False, "slot_filesystem")
    assert by_id[HEALTHY]["healthy"] is True
    text = ficc_executor("status", "--config", str(daemon.layout.config_path)).stdout
    row = next(line.split() for line in text.splitlines() if line.startswith(f"{BROKEN} "))
    assert (row[2], row[-1]) == ("BROKEN", "slot_filesystem"), text
    assert "usable now     small 1 of 2" in text.splitlines(), text
    found = metric_samples(daemon)
    labels = {("slot", BROKEN), ("class", "small"), ("reason", "slot_filesystem")}
    assert found[("ficc_slot_healthy", frozenset(labels))] == 0
    fine = {("slot", HEALTHY), ("class", "small"), ("reason", "")}
    assert found[("ficc_slot_healthy", frozenset(fine))] == 1
    assert found[("ficc_slots_usable", frozenset({("class", "small")}))] == 1
    assert found[("ficc_slots_free", frozenset({("class", "small")}))] == 2  # as it always was
    # a controller asks: one of two slots of the class is usable now
    (small,) = slots_snapshot(daemon, sender="transport").capacity.slot_classes
    assert (small.total, small.free, small.usable) == (2, 2, 1)
    # a controller that does not ask sees no new field at all
    assert not {"slots", "daemon", "usable"} & plain_snapshot_keys(daemon)
    return state


def check_admission_avoids_it(daemon: Daemon) -> None:
    """The first prepare goes to the healthy slot; the next finds no usable slot."""
    first, second = daemon.plan(), daemon.plan()
    (row,) = rows(daemon.prepare([first]))
    assert attempt(row).slot == HEALTHY, row
    (refused,) = rows(daemon.prepare([second]))
    assert isinstance(refused, wire.ErrorRow), refused
    assert refused.error.code == "admission_rejected"
    message = refused.error.message
    assert message.startswith("slot_capacity: ")
    assert f"out of service: {BROKEN} (slot_filesystem)" in message
    daemon.stop_attempt(first)
    daemon.wait_state(first, lambda r: r.cleanup_confirmed, "the stopped attempt's cleanup")
    assert attempt(daemon.release(first)).state == "released"
    daemon.release(second)


@pytest.mark.parametrize("layout", [{"slot_check_seconds": 1}], indirect=True)
def test_an_unmounted_slot_leaves_the_offer_and_comes_back_on_schedule(daemon: Daemon) -> None:
    unmount(daemon)
    check_broken_everywhere(daemon)
    check_admission_avoids_it(daemon)
    remount(daemon)
    wait_for(lambda: healthy_again(daemon), "the scheduled check to bring s0 back")
    (small,) = slots_snapshot(daemon).capacity.slot_classes
    assert small.usable == 2
    plan = daemon.plan()
    assert attempt(rows(daemon.prepare([plan]))[0]).slot == BROKEN  # the first slot again
    assert transitions(daemon) == [("slot_out_of_service", BROKEN), ("slot_in_service", BROKEN)]
    (went,) = [e for e in daemon.process.events() if e.get("event") == "slot_out_of_service"]
    assert (went["level"], went["class"], went["code"]) == ("warning", "small", "slot_filesystem")


@pytest.mark.parametrize("layout", [{"slot_check_seconds": 60}], indirect=True)
def test_the_administrators_check_takes_a_slot_out_and_back_at_once(daemon: Daemon) -> None:
    """With the schedule a minute away, only the administrator's request can have
    noticed; the transport may not send it."""
    config = str(daemon.layout.config_path)
    refused = daemon.as_transport(CheckSlotsRequest(version=1, id=new_id()))
    assert error_code(refused) == "not_authorized"
    assert ficc_executor("check-slots", "--config", config).returncode == 0
    unmount(daemon)
    checked = ficc_executor("check-slots", "--config", config)
    assert checked.returncode == 1, checked
    assert checked.stderr.startswith("slot_filesystem: slot s0: "), checked.stderr
    assert broken_now(daemon) is not None
    remount(daemon)
    assert broken_now(daemon) is not None  # still out until a check passes
    back = ficc_executor("check-slots", "--config", config, "--json")
    assert back.returncode == 0, back.stderr
    assert all(s["healthy"] for s in json.loads(back.stdout)["slots"])
    assert healthy_again(daemon)
    assert transitions(daemon) == [("slot_out_of_service", BROKEN), ("slot_in_service", BROKEN)]


@pytest.mark.parametrize("layout", [{"slot_check_seconds": 60}], indirect=True)
def test_an_attempt_that_meets_the_broken_slot_fails_and_marks_it_at_once(daemon: Daemon) -> None:
    """Between two scheduled checks the first attempt placed in a slot that broke finds
    it (its own check of the slot), fails through the normal path and is released; the
    slot is out of the offer from then on, before any scheduled check."""
    unmount(daemon)
    plan = daemon.plan()
    (row,) = rows(daemon.prepare([plan]))
    assert attempt(row).slot == BROKEN  # nothing had looked yet
    done = daemon.wait_state(plan, lambda r: r.cleanup_confirmed, "the failed attempt's cleanup")
    assert (done.state, done.reason) == ("failed", "slot_filesystem"), done
    assert attempt(daemon.release(plan)).state == "released"
    assert broken_now(daemon) is not None
    following = daemon.plan()
    assert attempt(rows(daemon.prepare([following]))[0]).slot == HEALTHY
    remount(daemon)
