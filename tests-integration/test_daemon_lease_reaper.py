"""Leases hold without the daemon (reliability target R8), with supervisor=cgroupfs.

An attempt with a 10 s lease is started and held as a live process of the slot
account (the test provider's barrier, `FICC_TEST_PROVIDER_HOLD`); then the daemon is
SIGKILLed, or separately SIGSTOPped, or stopped cleanly (SIGTERM). Nothing of the
daemon enforces the lease any more: the lease reaper (service/reaper.py) must stop the
service, so that no process of the slot account is left 5 s after the deadline. After
a restart the attempt is `expired` or `unknown`, after SIGCONT always `expired`, and
the provider's `start` ran exactly once.

The same test under supervisor=systemd, with the daemon as its shipped unit, is in
tools/systemd/tests/test_daemon_unit.py.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
from collections.abc import Callable, Iterator
from pathlib import Path

import msgspec
import psutil
import pytest

from ficc.execution.host.service import cgroups
from ficc.execution.plan import Payload, Plan
from ficc.execution.protocol import RenewRequest
from ficc.execution.wire import ErrorReply
from ficc_testkit.daemons import DaemonProcess
from ficc_testkit.driver import attempt, renewal, rows
from ficc_testkit.host import Daemon
from ficc_testkit.plans import new_id
from ficc_testkit.waits import now_ms, wait_for

LEASE_MS = 10_000
GRACE_MS = 5_000
SETTLED = {"expired", "unknown"}


def slot_processes(daemon: Daemon) -> list[int]:
    """Live (non-zombie) processes of either slot account."""
    uids = {daemon.accounts["slot0"].uid, daemon.accounts["slot1"].uid}
    found = []
    for process in psutil.process_iter(["uids", "status"]):
        try:
            if process.info["uids"].real in uids and process.info["status"] != "zombie":
                found.append(process.pid)
        except (psutil.Error, AttributeError):
            continue
    return found


def held_plan(daemon: Daemon) -> Plan:
    plan = daemon.plan()
    held = Payload(argv=["/bin/true"], environment={"FICC_TEST_PROVIDER_HOLD": "1"})
    return msgspec.structs.replace(plan, job=msgspec.structs.replace(plan.job, payload=held))


def start_held(daemon: Daemon) -> tuple[Plan, int]:
    """Start a held attempt with a 10 s lease; returns it and the latest possible
    deadline (wall-clock ms)."""
    plan = held_plan(daemon)
    rows(daemon.prepare([plan], expires_in_ms=LEASE_MS))
    deadline = now_ms() + LEASE_MS
    ready = daemon.wait_state(plan, lambda r: r.ready or r.state != "prepared", "readiness")
    assert (ready.state, ready.ready) == ("prepared", True), ready
    attempt(daemon.start_attempt(plan))
    # The service (and its slot process) exists before the provider's start is called.
    wait_for(lambda: daemon.layout.provider_calls("start", plan.attempt_id) == 1, "provider start")
    wait_for(lambda: slot_processes(daemon), "the held barrier of the slot account")
    assert daemon.observe(plan).state == "starting"
    return plan, deadline


def _killed(daemon: Daemon) -> Callable[[], None]:
    daemon.process.kill()

    def restart() -> None:
        daemon.process = DaemonProcess.of(daemon.layout, daemon.provider)
        daemon.start()

    return restart


def _terminated(daemon: Daemon) -> Callable[[], None]:
    """A clean stop (SIGTERM): with supervisor=cgroupfs the services outlive it."""
    assert daemon.process.stop() == 0

    def restart() -> None:
        daemon.process = DaemonProcess.of(daemon.layout, daemon.provider)
        daemon.start()

    return restart


def _stopped(daemon: Daemon) -> Callable[[], None]:
    assert daemon.process.process is not None
    pid = daemon.process.process.pid
    os.kill(pid, signal.SIGSTOP)
    return lambda: os.kill(pid, signal.SIGCONT)


@pytest.mark.parametrize(
    "disrupt", [_killed, _stopped, _terminated], ids=["sigkill", "sigstop", "sigterm"]
)
def test_a_dead_or_hung_daemon_still_stops_the_payload_at_its_deadline(
    daemon: Daemon, disrupt: Callable[[Daemon], Callable[[], None]]
) -> None:
    plan, deadline = start_held(daemon)
    resume = disrupt(daemon)
    try:
        # The deadline is seconds away: the payload still runs without the daemon.
        assert now_ms() < deadline - LEASE_MS // 2, "the start took too long for this test"
        assert slot_processes(daemon), "the service died with the daemon, not at its deadline"
        remaining = (deadline + GRACE_MS - now_ms()) / 1000
        wait_for(lambda: not slot_processes(daemon), "the reaper's stop", timeout=remaining)
    finally:
        resume()
    settled = daemon.wait_state(plan, lambda r: r.state in SETTLED, "expired or unknown")
    assert settled.state in SETTLED, settled
    if disrupt is _stopped:
        # The same daemon wakes to an emptied service and a lease that is over: the
        # reaper's work at the deadline, so an expiry (a restarted one cannot know).
        assert (settled.state, settled.reason) == ("expired", "lease_expired"), settled
    daemon.wait_state(plan, lambda r: r.cleanup_confirmed, "confirmed cleanup")
    assert daemon.layout.provider_calls("start", plan.attempt_id) == 1  # ran once
    assert attempt(daemon.release(plan)).state == "released"
    assert not slot_processes(daemon)
    assert daemon.layout.provider_calls("start", plan.attempt_id) == 1


def _procs(node: Path) -> list[int]:
    return [int(pid) for pid in (node / "cgroup.procs").read_text().split()]


@contextlib.contextmanager
def unit_cgroup(pid: int) -> Iterator[list[Path]]:
    """`pid` moved into a cgroup of its own in each hierarchy where systemd keeps a
    unit's processes and finds them when it stops the unit: the unified tree, and on a
    hybrid host also its own v1 hierarchy (`name=systemd`). Whatever is left in it is
    killed and the cgroup removed at the end."""
    mounts = cgroups.parse_mountinfo(Path("/proc/self/mountinfo").read_text())
    tracked = [Path(h.mount) for h in mounts if h.version == 2 or "name=systemd" in h.controllers]
    name = f"ficc-t-unit-{os.getpid()}-{new_id()[:8]}"
    made: list[Path] = []
    try:
        for mount in tracked:
            node = mount / name
            node.mkdir()
            made.append(node)
            (node / "cgroup.procs").write_text(str(pid))
        yield made
    finally:
        for node in made:
            for left in _procs(node):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(left, signal.SIGKILL)
            wait_for(lambda node=node: not _procs(node), f"{node} to empty")
            node.rmdir()


def test_a_stop_of_the_daemons_unit_leaves_the_lease_reaper_enforcing(daemon: Daemon) -> None:
    """With supervisor=cgroupfs under the shipped unit, `systemctl stop` sends SIGTERM to
    the daemon, then SIGKILLs whatever is left in the unit's cgroup (`KillMode=mixed`).
    The lease reaper is not there: the daemon moved it into `<base>/lease-reaper` in
    every hierarchy, systemd's own included, so it goes on enforcing the deadline the
    daemon left. Emulated: the daemon in a unit-like cgroup of its own, stopped that way."""
    assert daemon.process.process is not None
    with unit_cgroup(daemon.process.process.pid) as unit:
        plan, deadline = start_held(daemon)
        assert daemon.process.stop() == 0  # SIGTERM to the main process
        for node in unit:  # then SIGKILL to every process left in the unit's cgroup
            for pid in _procs(node):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        assert now_ms() < deadline - LEASE_MS // 2, "the start took too long for this test"
        assert slot_processes(daemon), "the service died with the unit, not at its deadline"
        remaining = (deadline + GRACE_MS - now_ms()) / 1000
        wait_for(lambda: not slot_processes(daemon), "the reaper's stop", timeout=remaining)
    daemon.process = DaemonProcess.of(daemon.layout, daemon.provider)
    daemon.start()
    _settles_once_and_releases(daemon, plan)


def _settles_once_and_releases(daemon: Daemon, plan: Plan) -> None:
    """After the reaper's stop: expired or unknown, cleanup confirmed, started once,
    released."""
    settled = daemon.wait_state(plan, lambda r: r.state in SETTLED, "expired or unknown")
    assert settled.state in SETTLED, settled
    daemon.wait_state(plan, lambda r: r.cleanup_confirmed, "confirmed cleanup")
    assert daemon.layout.provider_calls("start", plan.attempt_id) == 1
    assert attempt(daemon.release(plan)).state == "released"


def _reaper_deadline(daemon: Daemon, plan: Plan) -> int:
    """The boot-clock deadline the reaper holds for the attempt's service (0: none)."""
    name = f"ficc-work-{daemon.layout.installation_id}-{plan.attempt_id}.deadline"
    try:
        document = json.loads((daemon.layout.state_dir / "deadlines" / name).read_text())
    except FileNotFoundError:
        return 0
    return int(document["deadline_boottime_ns"])


def test_a_renewal_moves_the_deadline_the_reaper_enforces(daemon: Daemon) -> None:
    """The reaper's copy of the deadline follows a renewal, so a daemon hung after the
    renewal stops the payload at the renewed deadline, not at the first one."""
    plan, first_deadline = start_held(daemon)
    held = _reaper_deadline(daemon, plan)
    assert held > 0
    renewed = now_ms() + 2 * LEASE_MS
    assert daemon.renew(plan, 2, renewed).state == "starting"
    wait_for(lambda: _reaper_deadline(daemon, plan) > held, "the reaper's deadline to move")
    assert (_reaper_deadline(daemon, plan) - held) // 1_000_000 >= LEASE_MS // 2
    resume = _stopped(daemon)
    try:
        remaining = (renewed + GRACE_MS - now_ms()) / 1000
        wait_for(lambda: not slot_processes(daemon), "the reaper's stop", timeout=remaining)
        # Stopped at the renewed deadline: well after the first one had passed.
        assert now_ms() > first_deadline + LEASE_MS // 2
    finally:
        resume()
    _settles_once_and_releases(daemon, plan)


def test_a_renewal_reaches_the_reaper_before_it_is_answered(daemon: Daemon) -> None:
    """A renewal that shortens the lease, followed at once by a hung daemon: the
    reaper already holds the shorter deadline, so the payload is stopped then, well
    before the first deadline."""
    plan, first_deadline = start_held(daemon)
    held = _reaper_deadline(daemon, plan)
    shortened = now_ms() + LEASE_MS // 5
    assert daemon.renew(plan, 2, shortened).state == "starting"
    resume = _stopped(daemon)
    try:
        moved = _reaper_deadline(daemon, plan)
        assert 0 < moved < held - (LEASE_MS // 2) * 1_000_000, (held, moved)
        remaining = (shortened + GRACE_MS - now_ms()) / 1000
        wait_for(lambda: not slot_processes(daemon), "the reaper's stop", timeout=remaining)
        assert now_ms() < first_deadline, "stopped at the first deadline, not the renewed one"
    finally:
        resume()
    _settles_once_and_releases(daemon, plan)


def test_a_renewal_the_reaper_cannot_get_is_refused_until_it_can(daemon: Daemon) -> None:
    """The reaper's deadline file cannot be written (here a directory planted where its
    temporary file goes; on a real host, a full `state_dir`): the renewal is recorded
    but refused (`lease_reaper_unavailable`), for the reaper would still stop the
    payload at the old deadline. The same renewal sent again once the file can be
    written is answered, and the reaper holds the new deadline."""
    plan, _ = start_held(daemon)
    held = _reaper_deadline(daemon, plan)
    name = f"ficc-work-{daemon.layout.installation_id}-{plan.attempt_id}"
    planted = daemon.layout.state_dir / "deadlines" / f".{name}.tmp"
    planted.mkdir()
    renewed = now_ms() + 2 * LEASE_MS
    request = RenewRequest(version=1, id=new_id(), leases=[renewal(plan, 2, renewed)])
    try:
        reply = daemon.as_transport(request)
        assert isinstance(reply, ErrorReply), reply
        assert reply.error.code == "lease_reaper_unavailable"
        assert "send the same renewal again" in reply.error.message
        assert _reaper_deadline(daemon, plan) == held
    finally:
        planted.rmdir()
    assert daemon.renew(plan, 2, renewed).state == "starting"
    assert _reaper_deadline(daemon, plan) > held  # written before the answer
    daemon.stop_attempt(plan)
    daemon.wait_state(plan, lambda r: r.cleanup_confirmed, "confirmed cleanup")
    assert attempt(daemon.release(plan)).state == "released"
