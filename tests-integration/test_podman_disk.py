"""Hostile payloads against the disk, through the real daemon and real rootless Podman.

A slot is a finite filesystem of its own, so disk is enforced by the kernel. A payload
that fills its slot (bytes, inodes, or a flood of stdout) must fail its own job and
nothing else: its usage never goes past the slot, the host's root filesystem is not
touched, the attempt's row says that storage ran out (and whether a log was cut short),
release succeeds although the slot is full, and the next job in that slot runs.

The world here has small slots (see `SLOT_BYTES`) so filling one takes a moment; like
the end-to-end suite it runs with `cgroupfs` here and with `systemd` inside the
systemd container (tools/systemd/run.py).
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from ficc.execution.wire import AttemptRow
from ficc_testkit.podman import PodmanWorld
from ficc_testkit.units import MIB
from podman_support import BACKENDS, NEEDS_PODMAN, each_test, podman_world

pytestmark = NEEDS_PODMAN

SLOT_BYTES = 96 * MIB
SLOT_INODES = 3_000
LINE = "x" * 1023
"""`yes` writes this (1 KiB a line) until the slot is full; /dev/zero is not an allowed
device of the payload."""
ROOT_SLACK = 48 * MIB
"""The root filesystem may move by this much while a slot fills (logs, the ledger); a
payload writing through to it would move it by at least SLOT_BYTES."""


@pytest.fixture(scope="module", params=BACKENDS)
def world(request: pytest.FixtureRequest) -> Iterator[PodmanWorld]:
    with podman_world(request.param, slot_bytes=SLOT_BYTES, slot_inodes=SLOT_INODES) as built:
        yield built


@pytest.fixture
def disk(request: pytest.FixtureRequest, world: PodmanWorld) -> Iterator[PodmanWorld]:
    yield from each_test(request, world)


def _root_free() -> int:
    st = os.statvfs("/")
    return st.f_bavail * st.f_frsize


def _fill(world: PodmanWorld, script: str) -> tuple[AttemptRow, int]:
    """Run `script` to its end in a slot; the settled row and the root filesystem's
    drop in free bytes meanwhile."""
    before = _root_free()
    plan = world.plan(script)
    world.run_to_running(plan)
    row = world.wait_settled(plan)
    if row.reason != "storage_exhausted":
        stderr = world.collect(plan, "stderr").data[-2000:]
        raise AssertionError(f"the slot did not fill: {row}\nstderr: {stderr!r}")
    return row, before - _root_free()


def _released_and_next_runs(world: PodmanWorld, full: AttemptRow) -> None:
    """Release the full slot (no provider space needed), then the next job there runs."""
    plan = world.plans[-1]
    slot = world.slot_path(full.slot)
    released = world.release(plan)
    assert (released.state, released.outcome) == ("released", "failed"), released
    st = os.statvfs(slot)
    assert st.f_bavail * st.f_frsize > SLOT_BYTES // 2, "release left the slot full"
    assert st.f_favail > SLOT_INODES // 2, "release left the slot without inodes"
    after = world.plan("echo next-job-ran")
    world.prepare(after)
    row = world.wait_ready(after)
    assert row.slot == full.slot, f"the next job went to {row.slot}, not {full.slot}"
    world.start(after)
    done = world.wait_settled(after)
    assert (done.state, done.exit_code) == ("succeeded", 0), done
    assert world.collect(after, "stdout").data == b"next-job-ran\n"
    assert getattr(done, "storage_exhausted", None) is not True


def _usage_within_slot(world: PodmanWorld, row: AttemptRow) -> None:
    st = os.statvfs(world.slot_path(row.slot))
    used = (st.f_blocks - st.f_bfree) * st.f_frsize
    assert used <= st.f_blocks * st.f_frsize
    assert st.f_bavail * st.f_frsize < 2 * MIB or st.f_favail < 32, "the slot did not fill"


def test_a_payload_filling_its_slot_with_bytes_fails_only_its_own_job(disk: PodmanWorld) -> None:
    row, root_drop = _fill(disk, f"yes {LINE} > /work/fill; echo after")
    assert (row.state, row.outcome, row.reason) == ("failed", "failed", "storage_exhausted"), row
    assert row.storage_exhausted is True, row
    assert row.log_cut_short is True, row
    assert row.exit_code is not None, "the exit status was lost on the full slot"
    assert root_drop < ROOT_SLACK, f"the root filesystem lost {root_drop} bytes"
    _usage_within_slot(disk, row)
    _released_and_next_runs(disk, row)


def test_a_payload_exhausting_its_slots_inodes_fails_only_its_own_job(disk: PodmanWorld) -> None:
    script = "i=0; while mkdir /work/d$i 2>/dev/null; do i=$((i+1)); done; echo made $i"
    row, root_drop = _fill(disk, script)
    assert (row.state, row.outcome, row.reason) == ("failed", "failed", "storage_exhausted"), row
    assert row.storage_exhausted is True, row
    assert row.log_cut_short is not True, "inodes ran out, not bytes: the logs could grow"
    assert root_drop < ROOT_SLACK, f"the root filesystem lost {root_drop} bytes"
    made = disk.collect(disk.plans[-1], "stdout").data
    assert made.startswith(b"made "), made
    assert int(made.split()[1]) > SLOT_INODES // 2
    _released_and_next_runs(disk, row)


def test_a_stdout_flood_of_twice_the_slot_is_cut_short_and_reported(disk: PodmanWorld) -> None:
    row, root_drop = _fill(disk, f"yes {LINE} | head -c {2 * SLOT_BYTES}")
    assert (row.state, row.outcome, row.reason) == ("failed", "failed", "storage_exhausted"), row
    assert row.storage_exhausted is True, row
    assert row.log_cut_short is True, row
    assert SLOT_BYTES // 2 < row.stdout_bytes < SLOT_BYTES, row
    assert root_drop < ROOT_SLACK, f"the root filesystem lost {root_drop} bytes"
    _released_and_next_runs(disk, row)
