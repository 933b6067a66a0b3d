"""The behaviour of the system service (service/interface.py), on BOTH backends.

Every test here takes the `service` fixture, parametrized with `cgroupfs` and
`systemd`, so the two backends implement one contract: real services, a real
non-root slot account, real cgroups, and what the kernel (and systemd) report or
enforce. Where the backends genuinely differ, the test says so and asserts each
backend's own behaviour; where systemd can also be asked (`systemctl show`), the
test reads it back too.

The `cgroupfs` runs need root on a host whose PID 1 is not systemd. The `systemd`
runs need root and systemd as PID 1; on this workplace's machines they run inside a
privileged Podman container that boots Debian's systemd (`python
tools/systemd/run.py`, which sets FICC_SYSTEMD_REQUIRED=1 so they cannot skip
there). Elsewhere they skip and say why. What only one backend has is in
test_service_cgroupfs.py and test_service_systemd.py.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import select
import signal
import subprocess
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import msgspec
import pytest

import service_support
from ficc.execution.host.core.errors import HostError
from ficc.execution.host.service import (
    DeviceRule,
    ServiceHandle,
    ServiceLimits,
    ServiceSpec,
    cgroups,
    reaper,
)
from ficc_testkit.waits import wait_for
from service_support import (
    DAEMONIZER,
    FORKER,
    OPENER,
    PYTHON,
    RUNC_BASELINE,
    SLEEPERS,
    SOAK,
    SYSTEMD_REASON,
    UNDER_SYSTEMD,
    Backend,
    all_nodes_gone,
    cgroupfs_backend,
    loaded,
    make_spec,
    member_count_is,
    node,
    pid1_is_systemd,
    py,
    restarted,
    show,
    slot_tasks,
    status,
    systemd_backend,
)

pytestmark = pytest.mark.root("the behaviour tests need real cgroups and a real slot account")

# The shared fixtures, defined once in service_support.
slot = service_support.slot
prefix = service_support.prefix
busybox_image = service_support.busybox_image


@pytest.fixture(params=["cgroupfs", "systemd"])
def service(request: pytest.FixtureRequest, prefix: str) -> Iterator[Backend]:
    """Each backend in turn; teardown stops and removes everything the test made."""
    if request.param == "systemd":
        if not UNDER_SYSTEMD:
            pytest.skip(SYSTEMD_REASON)
        with systemd_backend(prefix) as units:
            yield units
        return
    if pid1_is_systemd():
        pytest.skip(
            "the cgroupfs backend is for hosts whose PID 1 is not systemd (here systemd "
            "owns the cgroup tree); it runs on such hosts, e.g. outside the container"
        )
    with cgroupfs_backend() as files:
        yield files


# --- the tree, its account and its lifetime -------------------------------------------


def test_members_are_the_whole_tree_running_as_the_slot_account(
    service: Backend, slot: tuple[int, int], prefix: str, tmp_path: Path
) -> None:
    spec = make_spec(tmp_path, slot, SLEEPERS, name=f"{prefix}-a")
    handle = service.create(spec)
    if service.backend == "systemd":
        assert show(f"{spec.name}.service", "MainPID")["MainPID"] == str(handle.main_pid)
    else:
        assert set(handle.cgroups) == {h.key for h in service.layout.hierarchies}
    wait_for(member_count_is(service, handle, 3))
    members = service.members(handle)
    assert handle.main_pid in members
    # systemd's User= adds the account's own primary GID as its one supplementary group.
    groups = str(slot[1]) if service.backend == "systemd" else ""
    for pid in members:
        fields = status(pid)
        assert fields["Uid"].split() == [str(slot[0])] * 4
        assert fields["Gid"].split() == [str(slot[1])] * 4
        assert fields["Groups"] == groups
    for path in handle.cgroups.values():
        leaf = Path(path) / "supervisor" / "cgroup.procs"
        assert {int(p) for p in leaf.read_text().split()} == members
    assert not service.is_idle(handle, slot[0])
    assert service.occupied(handle)
    service.stop(handle)
    assert service.members(handle) == set()
    assert not service.occupied(handle)
    assert service.exit_status(handle) == -signal.SIGKILL
    service.remove(handle)
    assert not service.occupied(handle)
    if service.backend == "systemd":
        assert not loaded(spec.name)
    assert all_nodes_gone(handle)
    assert service.is_idle(handle, slot[0])


def test_stop_kills_a_daemonized_grandchild(
    service: Backend, slot: tuple[int, int], prefix: str, tmp_path: Path
) -> None:
    spec = make_spec(tmp_path, slot, py(DAEMONIZER), name=f"{prefix}-daemonizer")
    handle = service.create(spec)
    wait_for(lambda: Path(spec.stdout).read_text().endswith("\n"))
    grandchild = int(Path(spec.stdout).read_text())
    wait_for(lambda: service.members(handle) == {handle.main_pid, grandchild})
    assert int(status(grandchild)["PPid"]) != handle.main_pid
    assert handle.main_pid is not None
    assert os.getsid(grandchild) != os.getsid(handle.main_pid)
    pidfd = os.pidfd_open(grandchild)
    try:
        service.stop(handle)
        assert service.members(handle) == set()
        assert select.select([pidfd], [], [], 0)[0] == [pidfd]  # readable: it exited
    finally:
        os.close(pidfd)
    assert service.exit_status(handle) == -signal.SIGKILL
    service.remove(handle)
    assert all_nodes_gone(handle)


def test_stop_empties_a_runtime_frozen_child_cgroup(
    service: Backend, slot: tuple[int, int], prefix: str, tmp_path: Path
) -> None:
    """A paused container is a frozen v1 freezer cgroup the runtime made under the
    supervisor path. systemd makes no freezer node for a unit (runc does, as here), so
    its backend's stop must find the node itself and thaw it: SIGKILL does not reach
    a frozen task."""
    freezer = next(h.mount for h in service.layout.hierarchies if "freezer" in h.controllers)
    handle = service.create(make_spec(tmp_path, slot, SLEEPERS, name=f"{prefix}-paused"))
    wait_for(member_count_is(service, handle, 3))
    paused = Path(freezer + service.supervisor_cgroup(handle)) / "paused"
    paused.mkdir(parents=True)
    try:
        sleeper = max(service.members(handle) - {handle.main_pid})
        (paused / "cgroup.procs").write_text(str(sleeper))
        (paused / "freezer.state").write_text("FROZEN")
        wait_for(lambda: (paused / "freezer.state").read_text().strip() == "FROZEN")
        service.stop(handle)
        assert service.members(handle) == set()
    finally:
        if paused.exists():  # so that teardown can empty the tree after a failure
            (paused / "freezer.state").write_text("THAWED")
    service.remove(handle)
    assert all_nodes_gone(handle)
    assert not paused.exists()


def test_the_tree_outlives_its_main_process_until_stopped(
    service: Backend, slot: tuple[int, int], prefix: str, tmp_path: Path
) -> None:
    """RemainAfterExit: the exit status stays readable and a leftover process stays in
    the tree (never escapes it) until the host stops the service."""
    script = "sleep 1000 >/dev/null 2>&1 & echo $!"
    spec = make_spec(tmp_path, slot, ["/bin/sh", "-c", script], name=f"{prefix}-left")
    handle = service.create(spec)
    wait_for(lambda: service.exit_status(handle) is not None)
    assert service.exit_status(handle) == 0
    leftover = int(Path(spec.stdout).read_text())
    assert service.members(handle) == {leftover}
    assert service.occupied(handle)  # by the leftover alone
    assert not service.is_idle(handle, slot[0])
    service.stop(handle)
    assert service.members(handle) == set()
    assert not service.occupied(handle)
    service.remove(handle)
    assert service.is_idle(handle, slot[0])


def test_is_idle_sees_slot_processes_outside_the_service(
    service: Backend, slot: tuple[int, int], prefix: str, tmp_path: Path
) -> None:
    handle = service.create(make_spec(tmp_path, slot, SLEEPERS, name=f"{prefix}-idle"))
    stray = subprocess.Popen(
        ["setpriv", f"--reuid={slot[0]}", f"--regid={slot[1]}", "--clear-groups", "sleep", "1000"]
    )
    try:
        wait_for(lambda: status(stray.pid)["Uid"].split()[0] == str(slot[0]))
        assert stray.pid not in service.members(handle)
        assert not service.is_idle(handle, slot[0])
        service.stop(handle)
        assert service.members(handle) == set()
        assert not service.is_idle(handle, slot[0])
    finally:
        stray.kill()
        stray.wait()
    assert service.is_idle(handle, slot[0])
    service.remove(handle)


def test_is_idle_ignores_a_zombie_of_the_slot_account(
    service: Backend, slot: tuple[int, int], prefix: str, tmp_path: Path
) -> None:
    """A zombie cannot run code or hold resources; PID 1 may reap orphans lazily."""
    handle = service.create(make_spec(tmp_path, slot, ["/bin/true"], name=f"{prefix}-zombie"))
    wait_for(lambda: service.exit_status(handle) is not None)
    zombie = subprocess.Popen(
        ["setpriv", f"--reuid={slot[0]}", f"--regid={slot[1]}", "--clear-groups", "true"]
    )
    try:
        wait_for(lambda: status(zombie.pid)["State"].startswith("Z"))
        assert status(zombie.pid)["Uid"].split()[0] == str(slot[0])
        assert service.is_idle(handle, slot[0])
    finally:
        zombie.wait()
    service.stop(handle)
    service.remove(handle)


def test_adopt_after_restart_finds_and_stops_the_service(
    service: Backend, slot: tuple[int, int], prefix: str, tmp_path: Path
) -> None:
    name = f"{prefix}-adopted"
    original = service.create(make_spec(tmp_path, slot, SLEEPERS, name=name))
    wait_for(member_count_is(service, original, 3))
    before = service.members(original)
    again = restarted(service)
    adopted = again.adopt(name)
    assert adopted is not None
    assert adopted.cgroups == original.cgroups
    assert adopted.main_pid is None
    assert again.members(adopted) == before
    # Running (systemd), or unknown after a restart (cgroupfs): no status either way.
    assert again.exit_status(adopted) is None
    again.stop(adopted)
    assert again.members(adopted) == set()
    # systemd remembers the status; the cgroupfs backend knows none after a restart.
    expected = -signal.SIGKILL if service.backend == "systemd" else None
    assert again.exit_status(adopted) == expected
    again.remove(adopted)
    assert again.adopt(name) is None
    assert service.adopt(f"{prefix}-never-created") is None
    service.stop(original)  # (cgroupfs) reaps the old daemon's main process


# --- the lease reaper (service/reaper.py) ----------------------------------------------


def _boot() -> tuple[str, int]:
    boot_id = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    return boot_id, time.clock_gettime_ns(time.CLOCK_BOOTTIME)


def test_the_reaper_kills_a_service_at_its_deadline_and_a_renewal_moves_it(
    service: Backend, slot: tuple[int, int], prefix: str, tmp_path: Path
) -> None:
    """One pass of the reaper, with the boot clock given: before the deadline nothing
    happens; a rewritten (renewed) deadline is the one that counts; at it the whole
    tree dies, the reaper leaves its evidence, and the deadline file stays (the daemon
    drops both) but guards nothing once the tree is empty."""
    name = f"{prefix}-reaped"
    handle = service.create(make_spec(tmp_path, slot, SLEEPERS, name=name))
    wait_for(member_count_is(service, handle, 3))
    directory = tmp_path / "deadlines"
    reaper.prepare_directory(str(directory))
    keeper = reaper.Keeper(str(directory))
    boot_id, now = _boot()
    cgroups_of = service.planned_cgroups(name)
    assert set(handle.cgroups.values()) <= set(cgroups_of)
    reaper.write_deadline(str(directory), name, boot_id, now + 10**9, cgroups_of)
    assert reaper.reap_once(str(directory), boot_id, now) == (1, reaper.POLL_SECONDS)
    assert len(service.members(handle)) == 3
    # A renewal moves the deadline later: the old one no longer kills.
    reaper.write_deadline(str(directory), name, boot_id, now + 3 * 10**9, cgroups_of)
    assert reaper.reap_once(str(directory), boot_id, now + 2 * 10**9)[0] == 1
    assert len(service.members(handle)) == 3
    left = reaper.reap_once(str(directory), boot_id, now + 3 * 10**9)[0]
    wait_for(lambda: not service.members(handle))
    if left:  # the kill was not yet complete on that pass; the next pass finds it empty
        assert reaper.reap_once(str(directory), boot_id, now + 3 * 10**9)[0] == 0
    assert reaper.reaped(str(directory), name)
    assert [p.name for p in directory.glob("*.deadline")] == [f"{name}.deadline"]
    assert not slot_tasks(slot[0])
    keeper.drop(name)
    assert not [p for p in directory.iterdir() if p.name != reaper.LOCK]
    keeper.drop(name)  # idempotent
    service.stop(handle)
    service.remove(handle)


def test_a_spawned_reaper_outlives_its_parent_and_exits_when_nothing_is_left(
    service: Backend, slot: tuple[int, int], prefix: str, tmp_path: Path
) -> None:
    """The reaper as the daemon starts it: its own process and session, holding the
    lock; it stops the service at the deadline, then exits (lock free again)."""
    name = f"{prefix}-deadline"
    handle = service.create(make_spec(tmp_path, slot, SLEEPERS, name=name))
    wait_for(member_count_is(service, handle, 3))
    keeper = reaper.Keeper(str(tmp_path / "deadlines"))
    boot_id, now = _boot()
    keeper.set(name, boot_id, now + 10**9, service.planned_cgroups(name))
    wait_for(lambda: reaper.reaper_running(keeper.directory))
    wait_for(lambda: not service.members(handle))
    assert not slot_tasks(slot[0])
    wait_for(lambda: not reaper.reaper_running(keeper.directory))
    assert reaper.reaped(keeper.directory, name)
    service.stop(handle)
    service.remove(handle)


def test_a_reaper_with_nothing_left_lingers_and_guards_the_next_deadline(
    service: Backend, slot: tuple[int, int], prefix: str, tmp_path: Path
) -> None:
    """A reaper that starts (or is left) with no deadline does not exit at once: a
    deadline written while it lingers is enforced by it, so attempts that follow each
    other do not each start a reaper. It exits when its directory goes."""
    name = f"{prefix}-lingered"
    handle = service.create(make_spec(tmp_path, slot, SLEEPERS, name=name))
    wait_for(member_count_is(service, handle, 3))
    directory = tmp_path / "deadlines"
    reaper.prepare_directory(str(directory))
    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(reaper.run, str(directory), 60.0)
        wait_for(lambda: reaper.reaper_running(str(directory)))
        boot_id, now = _boot()
        reaper.write_deadline(str(directory), name, boot_id, now, service.planned_cgroups(name))
        wait_for(lambda: not service.members(handle))
        wait_for(lambda: reaper.reaped(str(directory), name))
        assert not running.done()
        subprocess.run(["rm", "-rf", str(directory)], check=True)
        assert running.result(timeout=20) == 0
    service.stop(handle)
    service.remove(handle)


def test_a_starting_reaper_takes_its_lock_from_under_a_moment_s_look(tmp_path: Path) -> None:
    """`reaper_running` holds the lock while it looks; a reaper starting right then
    tries again instead of leaving as if another reaper ran."""
    path = tmp_path / reaper.LOCK
    look = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    mine = os.open(path, os.O_RDWR)
    paused: list[float] = []

    def look_ends(seconds: float) -> None:
        paused.append(seconds)
        fcntl.flock(look, fcntl.LOCK_UN)

    try:
        fcntl.flock(look, fcntl.LOCK_EX)
        assert reaper._take_lock(mine, pause=look_ends)
        assert paused, "the lock was free: the look never overlapped the start"
        assert reaper.reaper_running(str(tmp_path))
    finally:
        os.close(mine)
        os.close(look)


def test_a_reaper_leaves_when_another_holds_the_lock_past_a_look(tmp_path: Path) -> None:
    path = tmp_path / reaper.LOCK
    other = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    mine = os.open(path, os.O_RDWR)
    try:
        fcntl.flock(other, fcntl.LOCK_EX)
        assert not reaper._take_lock(mine, patience=0.05)
        assert reaper.run(str(tmp_path)) == 0
    finally:
        os.close(mine)
        os.close(other)


def test_the_keeper_does_not_start_a_second_reaper_while_its_first_comes_up(
    tmp_path: Path,
) -> None:
    """Until a new reaper has taken the lock the lock looks free; the keeper must not
    start another one each time it looks (an interpreter start per look)."""
    slow = tmp_path / "slow-interpreter"
    slow.write_text("#!/bin/sh\nexec sleep 60\n")
    slow.chmod(0o755)
    keeper = reaper.Keeper(str(tmp_path / "deadlines"), interpreter=str(slow))
    boot_id, now = _boot()
    keeper.set("never-locking", boot_id, now + 10**12, [])
    first = keeper._child
    assert first is not None
    try:
        keeper.ensure()
        keeper.ensure()
        assert keeper._child is first
        assert not reaper.reaper_running(keeper.directory)
    finally:
        first.kill()
        first.wait()


class _Unit:
    """A stand-in for the reaper's unit (supervisor=systemd): `answers` are what each
    start answers (False: a unit of that name is still there); `locks_after` starts
    makes a reaper take the lock, as a reaper coming up does."""

    def __init__(self, directory: Path, answers: list[bool], locks_after: int = 0) -> None:
        self.directory = directory
        self.answers = answers
        self.locks_after = locks_after
        self.started: list[list[str]] = []
        self.lock: int | None = None

    def __call__(self, command: list[str]) -> bool:
        self.started.append(command)
        if self.locks_after and len(self.started) == self.locks_after:
            self.take_lock()
        return self.answers.pop(0)

    def take_lock(self) -> None:
        self.lock = os.open(self.directory / reaper.LOCK, os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.flock(self.lock, fcntl.LOCK_EX)

    def close(self) -> None:
        if self.lock is not None:
            os.close(self.lock)


@contextlib.contextmanager
def _unit(directory: Path, answers: list[bool], locks_after: int = 0) -> Iterator[_Unit]:
    reaper.prepare_directory(str(directory))
    unit = _Unit(directory, answers, locks_after)
    try:
        yield unit
    finally:
        unit.close()


def test_the_keeper_starts_the_reapers_unit_only_while_no_reaper_holds_the_lock(
    tmp_path: Path,
) -> None:
    """Under systemd the keeper starts the reaper's unit (the same command as the
    child it spawns otherwise) when the lock is free, and nothing while a reaper holds
    it; it never spawns a child of its own."""
    directory = tmp_path / "deadlines"
    with _unit(directory, [True]) as unit:
        keeper = reaper.Keeper(str(directory), interpreter="/usr/bin/python3", launch=unit)
        boot_id, now = _boot()
        keeper.set("svc", boot_id, now + 10**12, [])
        assert unit.started == [reaper.command(str(directory), "/usr/bin/python3")]
        assert unit.started[0][1:3] == ["-I", "-S"]
        assert unit.started[0][3] == os.path.abspath(reaper.__file__)
        assert keeper._child is None
        unit.take_lock()
        keeper.ensure()
        keeper.set("svc", boot_id, now + 2 * 10**12, [])
        assert len(unit.started) == 1


def test_the_keeper_looks_again_while_the_reapers_unit_is_still_there(tmp_path: Path) -> None:
    """systemd refuses a second unit of the name while the last is there: its reaper
    is coming up, waiting to be restarted or exiting. The keeper looks again until a
    reaper holds the lock (here after the second refusal) or a start succeeds."""
    paused: list[float] = []
    with _unit(tmp_path / "coming-up", [False, False, False], locks_after=2) as unit:
        keeper = reaper.Keeper(unit.directory.as_posix(), launch=unit, pause=paused.append)
        keeper.ensure()
        assert len(unit.started) == 2  # the lock was taken: no third start
        assert len(paused) == 2
    paused.clear()
    with _unit(tmp_path / "exiting", [False, False, True]) as unit:
        keeper = reaper.Keeper(unit.directory.as_posix(), launch=unit, pause=paused.append)
        keeper.ensure()
        assert len(unit.started) == 3  # the old unit went away: a new one started
        assert len(paused) == 2


def test_the_keeper_gives_up_on_a_reapers_unit_that_never_takes_the_lock(
    tmp_path: Path,
) -> None:
    """A unit of the name that stays there while no reaper takes the lock (another
    daemon's, or a reaper that cannot start) is `ReaperUnavailable`, an `OSError`
    like a failed spawn: the start is refused, a renewal `lease_reaper_unavailable`."""
    with _unit(tmp_path / "deadlines", [False] * 100) as unit:
        keeper = reaper.Keeper(
            unit.directory.as_posix(), launch=unit, patience=0.2, pause=time.sleep
        )
        with pytest.raises(reaper.ReaperUnavailable) as refused:
            keeper.ensure()
        assert isinstance(refused.value, OSError)
        assert reaper.LOCK in str(refused.value)
        assert len(unit.started) >= 2


def test_a_deadline_of_another_boot_or_unreadable_is_due_at_once(tmp_path: Path) -> None:
    boot_id, now = _boot()
    assert reaper.due("0" * 8 + boot_id[8:], now + 10**12, boot_id, now) is (boot_id[:8] != "0" * 8)
    assert not reaper.due(boot_id, now + 1, boot_id, now)
    assert reaper.due(boot_id, now, boot_id, now)
    assert reaper.parse('{"boot_id": "x", "deadline_boottime_ns": 1, "cgroups": ["/etc"]}') is None
    assert reaper.parse("not json") is None
    (tmp_path / "x.deadline").write_text("garbage")
    assert reaper.reap_once(str(tmp_path), boot_id, now) == (0, reaper.POLL_SECONDS)
    assert reaper.reaped(str(tmp_path), "x")
    assert (tmp_path / "x.deadline").exists()  # never deleted by the reaper


def test_a_file_the_reaper_cannot_read_is_reported_and_the_others_are_reaped(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """An `OSError` on one deadline file (here: a directory where a file should be)
    is reported and that file stays guarded for the next pass; every other file is
    reaped on the same pass, and no deadline file is ever deleted by the reaper."""
    boot_id, now = _boot()
    (tmp_path / "a.deadline").mkdir()
    reaper.write_deadline(str(tmp_path), "b", boot_id, now, [])
    left, _wait = reaper.reap_once(str(tmp_path), boot_id, now)
    assert left == 1  # "a" is tried again; "b" guards nothing any more
    assert reaper.reaped(str(tmp_path), "b")
    assert not reaper.reaped(str(tmp_path), "a")
    assert (tmp_path / "a.deadline").is_dir()
    assert (tmp_path / "b.deadline").is_file()
    assert "a.deadline" in capfd.readouterr().err


def test_a_renewal_waits_for_a_reaper_deciding_and_gives_up_on_one_that_never_does(
    tmp_path: Path,
) -> None:
    """The daemon moves a deadline while the reaper's intent is there: it waits for the
    decision; an intent that outlasts the patience (a stopped or dead reaper) is
    `ReaperUndecided` (the renewal is then refused `lease_reaper_unavailable`)."""
    boot_id, now = _boot()
    directory = str(tmp_path)
    reaper.write_deadline(directory, "svc", boot_id, now, [])
    intent = tmp_path / f".svc{reaper.INTENT}"
    intent.touch()
    waited: list[float] = []

    def reaper_decides_against(seconds: float) -> None:
        waited.append(seconds)
        intent.unlink()  # the reaper read the new deadline: not due, no kill

    assert reaper.move(directory, "svc", boot_id, now + 10**9, [], pause=reaper_decides_against)
    assert waited
    intent.touch()
    with pytest.raises(reaper.ReaperUndecided):
        reaper.move(directory, "svc", boot_id, now + 2 * 10**9, [], patience=0.0)


def test_remove_refuses_a_non_empty_service(
    service: Backend, slot: tuple[int, int], prefix: str, tmp_path: Path
) -> None:
    handle = service.create(make_spec(tmp_path, slot, SLEEPERS, name=f"{prefix}-busy"))
    with pytest.raises(HostError) as refused:
        service.remove(handle)
    assert refused.value.code == "service_not_empty"
    assert handle.main_pid in service.members(handle)
    service.stop(handle)
    service.remove(handle)
    assert all_nodes_gone(handle)


def test_parallel_creates_from_threads_stay_separate(
    service: Backend, slot: tuple[int, int], prefix: str, tmp_path: Path
) -> None:
    specs = [make_spec(tmp_path, slot, SLEEPERS, name=f"{prefix}-p{i}") for i in range(4)]
    with ThreadPoolExecutor(4) as pool:
        handles = list(pool.map(service.create, specs))
    for handle in handles:
        wait_for(member_count_is(service, handle, 3))
    trees = [service.members(h) for h in handles]
    assert len(set().union(*trees)) == 12
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(service.stop, handles))
    for handle in handles:
        assert service.exit_status(handle) == -signal.SIGKILL
        service.remove(handle)
    assert service.is_idle(handles[0], slot[0])


@pytest.mark.soak
def test_create_stop_remove_cycles_leave_no_trace(
    service: Backend, slot: tuple[int, int], prefix: str, tmp_path: Path
) -> None:
    for index in range(200 if SOAK else 5):
        spec = make_spec(tmp_path, slot, SLEEPERS, name=f"{prefix}-cycle-{index}")
        handle = service.create(spec)
        wait_for(member_count_is(service, handle, 3))
        service.stop(handle)
        service.remove(handle)
        assert all_nodes_gone(handle)
        assert service.adopt(spec.name) is None
        assert service.is_idle(handle, slot[0])


# --- limits ---------------------------------------------------------------------------


def test_limits_read_back_from_the_kernel_and_systemd(
    service: Backend, slot: tuple[int, int], prefix: str, tmp_path: Path
) -> None:
    spec = make_spec(
        tmp_path,
        slot,
        SLEEPERS,
        name=f"{prefix}-limits",
        cpu_millis=250,
        memory_bytes=48 << 20,
        swap_bytes=16 << 20,
        processes=7,
        nofile=512,
        devices=[DeviceRule("/dev/null", 1, 3)],
    )
    handle = service.create(spec)
    controls = service.controls(handle)
    assert controls.backend == service.backend
    assert controls.memory_bytes == 48 << 20
    memsw = os.path.exists("/sys/fs/cgroup/memory/memory.memsw.limit_in_bytes")
    swap_counted = memsw or controls.cgroup_version == 2
    assert controls.swap_bytes == (16 << 20 if swap_counted else None)
    assert (controls.processes, controls.cpu_millis) == (7, 250)
    devices = [(d.kind, d.major, d.minor, d.access) for d in controls.devices or []]
    assert sorted(devices, key=str) == [
        ("b", None, None, "m"),
        ("c", 1, 3, "rwm"),
        ("c", None, None, "m"),
    ]
    if service.backend == "systemd":
        _check_unit_properties(spec.name)
    else:
        assert controls.swap_bytes == 16 << 20  # this kernel accounts swap
        # The order the host wrote them in (systemd writes the listed devices first).
        assert devices == [("c", None, None, "m"), ("b", None, None, "m"), ("c", 1, 3, "rwm")]
    if controls.cgroup_version == 1:
        memory, cpu = node(handle, "memory"), node(handle, "cpu")
        assert (memory / "memory.limit_in_bytes").read_text().strip() == str(48 << 20)
        if memsw:
            memsw_limit = (memory / "memory.memsw.limit_in_bytes").read_text().strip()
            assert memsw_limit == str(64 << 20)
        assert (node(handle, "pids") / "pids.max").read_text().strip() == "7"
        assert (cpu / "cpu.cfs_quota_us").read_text().strip() == "25000"
        assert (cpu / "cpu.cfs_period_us").read_text().strip() == "100000"
        leaf_devices = node(handle, "devices") / "supervisor" / "devices.list"
        listed = leaf_devices.read_text().splitlines()
        assert sorted(listed) == ["b *:* m", "c *:* m", "c 1:3 rwm"]
        if service.backend == "cgroupfs":
            assert listed == ["c *:* m", "b *:* m", "c 1:3 rwm"]
    limits = Path(f"/proc/{handle.main_pid}/limits").read_text()
    assert [line.split()[4:6] for line in limits.splitlines() if "core file" in line] == [
        ["0", "0"]
    ]
    assert [line.split()[3:5] for line in limits.splitlines() if "open files" in line] == [
        ["512", "512"]
    ]
    service.stop(handle)
    service.remove(handle)


def _check_unit_properties(name: str) -> None:
    seen = show(
        f"{name}.service",
        "MemoryMax",
        "TasksMax",
        "CPUQuotaPerSecUSec",
        "LimitCORE",
        "LimitNOFILE",
        "KillMode",
        "KillSignal",
        "DevicePolicy",
    )
    assert seen == {
        "MemoryMax": str(48 << 20),
        "TasksMax": "7",
        "CPUQuotaPerSecUSec": "250ms",
        "LimitCORE": "0",
        "LimitNOFILE": "512",
        "KillMode": "control-group",
        "KillSignal": "9",
        "DevicePolicy": "strict",
    }


def test_a_fractional_cpu_quota_reads_back_exactly(
    service: Backend, slot: tuple[int, int], prefix: str, tmp_path: Path
) -> None:
    """1.555 CPUs: systemd prints 1.555000s, the kernel holds a 155500 us quota."""
    spec = make_spec(tmp_path, slot, SLEEPERS, name=f"{prefix}-cpu", cpu_millis=1555)
    handle = service.create(spec)
    assert service.controls(handle).cpu_millis == 1555
    service.stop(handle)
    service.remove(handle)


def test_memory_limit_oom_kills_the_main_process(
    service: Backend, slot: tuple[int, int], prefix: str, tmp_path: Path
) -> None:
    code = "import os; b = bytearray(256 << 20); os.write(1, b'survived')"
    spec = make_spec(
        tmp_path, slot, py(code), name=f"{prefix}-oom-main", memory_bytes=64 << 20, swap_bytes=0
    )
    handle = service.create(spec)
    wait_for(lambda: service.exit_status(handle) is not None)
    assert service.exit_status(handle) == -signal.SIGKILL
    assert Path(spec.stdout).read_bytes() == b""
    if service.backend == "cgroupfs":
        # systemd stops a unit whose main process was killed and removes its cgroups
        # (and these counters) with it; the next test reads them from a surviving tree.
        assert_oom_counted(handle)
    service.stop(handle)
    service.remove(handle)


def assert_oom_counted(handle: ServiceHandle) -> None:
    """The kernel counted an OOM kill in the memory cgroup of the killed task (the
    supervisor leaf, v1), and the tree's peak stayed within the 64 MiB limit."""
    oom_control = node(handle, "memory") / "supervisor" / "memory.oom_control"
    oom = dict(line.split() for line in oom_control.open())
    assert int(oom["oom_kill"]) >= 1
    peak = int((node(handle, "memory") / "memory.max_usage_in_bytes").read_text())
    assert 32 << 20 < peak <= 64 << 20


def test_usage_counts_the_trees_cpu_memory_processes_and_oom_kills(
    service: Backend, slot: tuple[int, int], prefix: str, tmp_path: Path
) -> None:
    """A child spins for 0.5 s of CPU, three sleepers fork, a 96 MiB child is OOM-killed
    under a 64 MiB limit; the tree stays (the shell sleeps), so both backends still
    have its cgroups. What `usage` reads live is what the kernel counted."""
    spin = "import time; t = time.process_time()\nwhile time.process_time() - t < 0.5: pass"
    hog = "b = bytearray(96 << 20)"
    script = (
        f'{PYTHON} -I -S -c "{spin}"; for i in 1 2 3; do sleep 1000 & done; '
        f'{PYTHON} -I -S -c "{hog}"; echo status=$?; exec sleep 1000'
    )
    spec = make_spec(
        tmp_path, slot, ["/bin/sh", "-c", script], name=f"{prefix}-usage", memory_bytes=64 << 20
    )
    handle = service.create(spec)
    wait_for(lambda: Path(spec.stdout).read_text().endswith("\n"))
    assert Path(spec.stdout).read_text() == f"status={128 + signal.SIGKILL}\n"
    used = service.usage(handle)
    assert used.cpu_user_us is not None
    assert used.cpu_system_us is not None
    assert used.cpu_user_us + used.cpu_system_us >= 500_000, used
    assert used.memory_peak_bytes is not None
    assert 32 << 20 < used.memory_peak_bytes <= 64 << 20
    assert used.oom_kills == 1, used
    peak_file = node(handle, "pids") / "pids.peak"
    if peak_file.exists():  # the kernel keeps it from 6.1 on
        assert used.processes_peak is not None
        assert used.processes_peak >= 5, used
    else:
        assert used.processes_peak is None
    service.stop(handle)
    after = service.usage(handle)
    if service.backend == "cgroupfs":  # the daemon's cgroups stay until remove
        assert after.oom_kills == 1
        assert after.cpu_user_us is not None
        assert after.cpu_user_us >= used.cpu_user_us
    else:  # systemd removes a stopped unit's cgroups: the figures are absent, never guessed
        assert after.oom_kills in (None, 1), after
        assert after.cpu_user_us is None or after.cpu_user_us >= used.cpu_user_us, after
    service.remove(handle)


PAYLOAD_CHILD = """
import signal, sys, time
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
print("ready", flush=True)
signal.sigwait({signal.SIGUSR1})
t = time.process_time()
while time.process_time() - t < 0.3:
    pass
b = bytearray(32 << 20)
print("done", flush=True)
signal.sigwait({signal.SIGUSR1})
"""


def test_the_payload_moved_into_its_own_node_is_counted_apart(
    service: Backend, slot: tuple[int, int], prefix: str, tmp_path: Path
) -> None:
    """`place_payload` moves a process of the service into the service's payload node
    in every hierarchy; what it does from then on is counted there and, as before, in
    the whole service's figures, which hold it and its parent shell."""
    script = f"{PYTHON} -I -S -c '{PAYLOAD_CHILD}' & exec sleep 1000"
    spec = make_spec(tmp_path, slot, ["/bin/sh", "-c", script], name=f"{prefix}-payload")
    handle = service.create(spec)
    wait_for(lambda: Path(spec.stdout).read_text() == "ready\n")
    (child,) = service.members(handle) - {handle.main_pid}
    service.place_payload(handle, child)
    where = [line.split(":", 2) for line in Path(f"/proc/{child}/cgroup").read_text().split()]
    # "/" in a hierarchy the service has no node in (systemd in a container places a
    # unit in some v1 hierarchies only): nothing to move there
    moved = {p for _, controllers, p in where if not controllers.startswith("name=") and p != "/"}
    assert moved == {service.supervisor_cgroup(handle)}, where
    service.place_payload(handle, child)  # already there: nothing to move
    os.kill(child, signal.SIGUSR1)
    wait_for(lambda: Path(spec.stdout).read_text() == "ready\ndone\n")
    used = service.usage(handle)
    assert used.payload_cpu_user_us is not None, used
    assert used.payload_cpu_system_us is not None, used
    own = used.payload_cpu_user_us + used.payload_cpu_system_us
    assert used.cpu_user_us is not None
    assert used.cpu_system_us is not None
    assert 300_000 <= own <= used.cpu_user_us + used.cpu_system_us, used
    assert used.payload_memory_peak_bytes is not None, used
    assert used.memory_peak_bytes is not None, used
    assert 32 << 20 <= used.payload_memory_peak_bytes <= used.memory_peak_bytes, used
    service.stop(handle)
    service.remove(handle)


def test_a_process_outside_the_service_is_never_moved_into_its_payload_node(
    service: Backend, slot: tuple[int, int], prefix: str, tmp_path: Path
) -> None:
    """A PID that is not the service's (a reused one, say) is refused, and no payload
    node is left behind to read zeros from."""
    handle = service.create(make_spec(tmp_path, slot, SLEEPERS, name=f"{prefix}-foreign"))
    before = Path("/proc/self/cgroup").read_text()
    with pytest.raises(HostError) as refused:
        service.place_payload(handle, os.getpid())
    assert refused.value.code == "service_payload"
    assert Path("/proc/self/cgroup").read_text() == before
    assert not any(Path(p, "payload").exists() for p in handle.cgroups.values())
    assert service.usage(handle).payload_cpu_user_us is None
    service.stop(handle)
    service.remove(handle)


def test_memory_limit_oom_kills_a_child_and_the_tree_keeps_the_counters(
    service: Backend, slot: tuple[int, int], prefix: str, tmp_path: Path
) -> None:
    """The child that allocates is OOM-killed; its parent shell survives, reports and
    stays, so the service's cgroups (with the kernel's OOM counters) are still there
    on both backends (systemd removes a unit's cgroups as soon as they are empty)."""
    code = "import os; b = bytearray(256 << 20); os.write(1, b'survived')"
    script = f'{PYTHON} -I -S -c "{code}"; echo status=$?; exec sleep 1000'
    spec = make_spec(
        tmp_path, slot, ["/bin/sh", "-c", script], name=f"{prefix}-oom", memory_bytes=64 << 20
    )
    handle = service.create(spec)
    wait_for(lambda: Path(spec.stdout).read_text().endswith("\n"))
    assert Path(spec.stdout).read_text() == f"status={128 + signal.SIGKILL}\n"
    if handle.cgroup_version == 1:
        assert_oom_counted(handle)
    service.stop(handle)
    service.remove(handle)


def test_pids_limit_blocks_forks(
    service: Backend, slot: tuple[int, int], prefix: str, tmp_path: Path
) -> None:
    spec = make_spec(tmp_path, slot, py(FORKER), name=f"{prefix}-pids", processes=5)
    handle = service.create(spec)
    wait_for(lambda: service.exit_status(handle) is not None)
    assert service.exit_status(handle) == 0, Path(spec.stderr).read_text()
    assert json.loads(Path(spec.stdout).read_text()) == {"ok": 4, "failed": 16}
    if service.backend == "cgroupfs":
        # systemd removes the emptied unit's cgroups (with this counter) once the main
        # process has exited; the fork refusals above are what the limit did.
        events = (node(handle, "pids") / "supervisor" / "pids.events").read_text().split()
        assert events[0] == "max"
        assert int(events[1]) >= 16
    service.stop(handle)
    service.remove(handle)


def test_a_refused_start_leaves_nothing_behind(
    service: Backend, slot: tuple[int, int], prefix: str, tmp_path: Path
) -> None:
    """A nofile limit above the daemon's own hard limit cannot be set on the program."""
    hard = int(Path("/proc/self/limits").read_text().split("Max open files")[1].split()[1])
    spec = make_spec(tmp_path, slot, SLEEPERS, name=f"{prefix}-nofile", nofile=hard + 1)
    with pytest.raises(HostError) as refused:
        service.create(spec)
    assert refused.value.code == "service_start"
    assert service.adopt(spec.name) is None
    assert slot_tasks(slot[0]) == []


# --- devices --------------------------------------------------------------------------


def test_device_policy_allows_exactly_the_prepared_devices(
    service: Backend, slot: tuple[int, int], prefix: str, tmp_path: Path
) -> None:
    assert os.stat("/dev/zero").st_mode & 0o004, "the test needs a world-readable /dev/zero"
    spec = make_spec(
        tmp_path, slot, py(OPENER), name=f"{prefix}-dev", devices=[DeviceRule("/dev/null", 1, 3)]
    )
    handle = service.create(spec)
    wait_for(lambda: service.exit_status(handle) is not None)
    assert service.exit_status(handle) == 0, Path(spec.stderr).read_text()
    assert json.loads(Path(spec.stdout).read_text()) == {"null": "ok", "zero": "EPERM"}
    service.stop(handle)
    service.remove(handle)


def test_a_service_allowed_no_device_at_all_still_starts(
    service: Backend, slot: tuple[int, int], prefix: str, tmp_path: Path
) -> None:
    """stdin is the host's /dev/null, opened outside the closed device policy."""
    script = "cat; echo done; if (: </dev/null); then echo allowed; else echo denied; fi"
    spec = make_spec(tmp_path, slot, ["/bin/sh", "-c", script], name=f"{prefix}-nodev")
    handle = service.create(msgspec.structs.replace(spec, devices=[]))
    wait_for(lambda: service.exit_status(handle) is not None)
    assert Path(spec.stdout).read_text() == "done\ndenied\n", Path(spec.stderr).read_text()
    service.stop(handle)
    service.remove(handle)


def test_a_whole_major_rule_needs_the_class_directory(
    service: Backend, slot: tuple[int, int], prefix: str, tmp_path: Path
) -> None:
    devices = [DeviceRule("/dev/null", 136, None)]
    spec = make_spec(tmp_path, slot, SLEEPERS, name=f"{prefix}-major", devices=devices)
    with pytest.raises(HostError) as refused:
        service.create(spec)
    assert refused.value.code == "service_devices"
    assert service.adopt(spec.name) is None


def test_device_rule_must_name_that_exact_node(
    service: Backend, slot: tuple[int, int], prefix: str, tmp_path: Path
) -> None:
    devices = [DeviceRule("/dev/null", 1, 5)]
    spec = make_spec(tmp_path, slot, SLEEPERS, name=f"{prefix}-node", devices=devices)
    with pytest.raises(HostError) as refused:
        service.create(spec)
    assert refused.value.code == "service_devices"
    assert service.adopt(spec.name) is None


# --- what the program gets: outputs, environment, descriptors -------------------------


def test_output_files_are_never_opened_through_a_symlink(
    service: Backend, slot: tuple[int, int], prefix: str, tmp_path: Path
) -> None:
    target = tmp_path / "elsewhere"
    target.write_text("")
    before = os.stat(target)
    spec = make_spec(tmp_path, slot, SLEEPERS, name=f"{prefix}-link")
    Path(spec.stdout).symlink_to(target)
    with pytest.raises(HostError) as refused:
        service.create(spec)
    assert refused.value.code == "service_output"
    assert service.adopt(spec.name) is None
    after = os.stat(target)
    assert (after.st_uid, after.st_mode, after.st_size) == (0, before.st_mode, 0)


def test_output_files_are_root_private(
    service: Backend, slot: tuple[int, int], prefix: str, tmp_path: Path
) -> None:
    spec = make_spec(
        tmp_path, slot, ["/bin/sh", "-c", "echo out; echo err >&2"], name=f"{prefix}-out"
    )
    handle = service.create(spec)
    wait_for(lambda: service.exit_status(handle) is not None)
    for path, text in ((spec.stdout, "out\n"), (spec.stderr, "err\n")):
        info = os.stat(path)
        assert (info.st_uid, info.st_mode & 0o777) == (0, 0o600)
        assert Path(path).read_text() == text
    service.stop(handle)
    service.remove(handle)


def test_environment_is_exactly_the_spec(
    service: Backend, slot: tuple[int, int], prefix: str, tmp_path: Path
) -> None:
    """Nothing of the daemon's environment (nor systemd's: USER, HOME, INVOCATION_ID...)."""
    os.environ["FICC_T_SVC_LEAK"] = "daemon-secret"
    try:
        spec = make_spec(tmp_path, slot, ["/usr/bin/env"], name=f"{prefix}-env")
        handle = service.create(spec)
        wait_for(lambda: service.exit_status(handle) is not None)
    finally:
        del os.environ["FICC_T_SVC_LEAK"]
    shown = dict(line.split("=", 1) for line in Path(spec.stdout).read_text().splitlines())
    assert shown == spec.environment
    service.stop(handle)
    service.remove(handle)


def test_the_program_gets_exactly_three_descriptors(
    service: Backend, slot: tuple[int, int], prefix: str, tmp_path: Path
) -> None:
    """No gate pipe or socket, no daemon descriptor leaks into the program (ls's own
    directory descriptor is 3), whether it is exec'd directly or from a shell."""
    for index, argv in enumerate(
        (["/bin/ls", "/proc/self/fd"], ["/bin/sh", "-c", "env; ls /proc/self/fd >&2"])
    ):
        spec = make_spec(tmp_path, slot, argv, name=f"{prefix}-fds{index}")
        handle = service.create(spec)
        wait_for(lambda handle=handle: service.exit_status(handle) is not None)
        listing = spec.stdout if index == 0 else spec.stderr
        assert Path(listing).read_text().split() == ["0", "1", "2", "3"]
        service.stop(handle)
        service.remove(handle)


# --- refusals -------------------------------------------------------------------------


def test_create_refuses_an_existing_name(
    service: Backend, slot: tuple[int, int], prefix: str, tmp_path: Path
) -> None:
    name = f"{prefix}-twice"
    handle = service.create(make_spec(tmp_path, slot, SLEEPERS, name=name))
    (tmp_path / "second").mkdir()
    with pytest.raises(HostError) as refused:
        service.create(make_spec(tmp_path / "second", slot, SLEEPERS, name=name))
    assert refused.value.code == "service_exists"
    assert handle.main_pid in service.members(handle)
    assert all(os.path.isdir(p) for p in handle.cgroups.values())
    service.stop(handle)
    service.remove(handle)


def test_a_failed_duplicate_create_keeps_the_original_service(
    service: Backend, slot: tuple[int, int], prefix: str, tmp_path: Path
) -> None:
    name = f"{prefix}-exited"
    handle = service.create(make_spec(tmp_path, slot, ["/bin/sh", "-c", "exit 7"], name=name))
    wait_for(lambda: service.exit_status(handle) is not None)
    (tmp_path / "second").mkdir()
    with pytest.raises(HostError) as refused:
        service.create(make_spec(tmp_path / "second", slot, SLEEPERS, name=name))
    assert refused.value.code == "service_exists"
    assert service.exit_status(handle) == 7
    service.stop(handle)
    service.remove(handle)


def test_a_foreign_handle_is_refused(
    service: Backend, slot: tuple[int, int], prefix: str, tmp_path: Path
) -> None:
    handle = service.create(make_spec(tmp_path, slot, SLEEPERS, name=f"{prefix}-forged"))
    forged = msgspec.structs.replace(
        handle, cgroups={**handle.cgroups, "memory": "/sys/fs/cgroup/memory"}
    )
    for operation in (service.members, service.stop, service.remove, service.controls):
        with pytest.raises(HostError) as refused:
            operation(forged)
        assert refused.value.code == "service_handle"
    assert handle.main_pid in service.members(handle)
    service.stop(handle)
    service.remove(handle)


def test_root_is_refused_unless_the_backend_allows_a_root_supervisor(
    service: Backend, slot: tuple[int, int], prefix: str, tmp_path: Path
) -> None:
    spec = msgspec.structs.replace(
        make_spec(tmp_path, slot, SLEEPERS, name=f"{prefix}-root"), uid=0
    )
    with pytest.raises(HostError) as refused:
        service.create(spec)
    assert refused.value.code == "service_spec"
    assert service.adopt(spec.name) is None


def test_a_missing_working_directory_is_a_create_refusal(
    service: Backend, slot: tuple[int, int], prefix: str, tmp_path: Path
) -> None:
    spec = msgspec.structs.replace(
        make_spec(tmp_path, slot, SLEEPERS, name=f"{prefix}-nocwd"), cwd=str(tmp_path / "absent")
    )
    with pytest.raises(HostError) as refused:
        service.create(spec)
    assert refused.value.code == "service_create"
    assert service.adopt(spec.name) is None


def test_a_program_that_cannot_be_executed_is_a_start_refusal(
    service: Backend, slot: tuple[int, int], prefix: str, tmp_path: Path
) -> None:
    spec = make_spec(tmp_path, slot, ["/nonexistent/program"], name=f"{prefix}-noexec")
    with pytest.raises(HostError) as refused:
        service.create(spec)
    assert refused.value.code == "service_start"
    assert "No such file" in refused.value.message
    assert service.adopt(spec.name) is None
    assert slot_tasks(slot[0]) == []


def test_spec_refuses_what_the_service_cannot_run_safely(tmp_path: Path) -> None:
    """Checked by the spec itself, before any backend sees it."""
    good = make_spec(tmp_path, (1000, 1000), SLEEPERS)
    raw = msgspec.to_builtins(good)
    with pytest.raises(HostError, match="absolute"):
        msgspec.convert({**raw, "argv": ["sleep", "1"]}, ServiceSpec)
    twice = [{"path": "/dev/null", "major": 1, "minor": 3}] * 2
    with pytest.raises(HostError, match="twice"):
        msgspec.convert({**raw, "devices": twice}, ServiceSpec)
    for name in ("../escape", "a/b", ".hidden", ""):
        with pytest.raises(msgspec.ValidationError):
            msgspec.convert({**raw, "name": name}, ServiceSpec)
    with pytest.raises(msgspec.ValidationError):
        msgspec.convert({**raw, "environment": {"BAD=NAME": "x"}}, ServiceSpec)


# --- a real container runtime under the supervisor cgroup ------------------------------


def test_podman_payload_lands_under_the_supervisor_cgroup_and_stop_empties_it(
    service: Backend, slot: tuple[int, int], prefix: str, tmp_path: Path, busybox_image: str
) -> None:
    """The real runtime, rootful as the design's recipe runs it, under --cgroup-parent."""
    root_supervisor = restarted(service, root_supervisor=True)
    container = f"{prefix}-podman"
    spec = make_spec(tmp_path, slot, ["/bin/true"], name=f"{prefix}-podman")
    parent = root_supervisor.planned_supervisor_cgroup(spec.name)
    if service.backend == "cgroupfs":
        base = service.planned_supervisor_cgroup("x").split("/")[1]
        assert parent == f"/{base}/{spec.name}/payload"
    argv = ["/usr/bin/podman", "run", "--rm", "--name", container, "--runtime", "runc"]
    argv += ["--cgroup-manager=cgroupfs", f"--cgroup-parent={parent}", "--network=none"]
    argv += ["--ulimit", "nofile=1024:1024", "--ulimit", "nproc=1024:1024"]
    argv += [busybox_image, "/bin/busybox", "sleep", "1000"]
    limits = ServiceLimits(
        cpu_millis=1000, memory_bytes=512 << 20, swap_bytes=0, processes=256, nofile=4096
    )
    spec = msgspec.structs.replace(
        spec,
        argv=argv,
        uid=0,
        gid=0,
        environment={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"},
        limits=limits,
        devices=RUNC_BASELINE,
    )
    try:
        handle = root_supervisor.create(spec)
        assert root_supervisor.supervisor_cgroup(handle) == parent

        def payload() -> int | None:
            for pid in root_supervisor.members(handle):
                with contextlib.suppress(FileNotFoundError):
                    if Path(f"/proc/{pid}/cmdline").read_bytes().startswith(b"/bin/busybox"):
                        return pid
            assert root_supervisor.exit_status(handle) is None, Path(spec.stderr).read_text()
            return None

        wait_for(payload, timeout=60)
        pid = payload()
        assert pid is not None
        proc_cgroup = Path(f"/proc/{pid}/cgroup").read_text()
        memberships = cgroups.parse_proc_cgroup(proc_cgroup)
        for key in handle.cgroups:
            controllers = frozenset() if key == "unified" else frozenset(key.split(","))
            assert memberships[controllers].startswith(parent + "/"), key
        if service.backend == "cgroupfs":
            # Every hierarchy of the layout, and nothing else, holds the payload there.
            lines = proc_cgroup.splitlines()
            assert len(lines) == len(root_supervisor.layout.hierarchies)
            assert all(line.split(":", 2)[2].startswith(parent + "/") for line in lines)
        root_supervisor.stop(handle)
        assert root_supervisor.members(handle) == set()
        root_supervisor.remove(handle)
        assert all_nodes_gone(handle)
        assert root_supervisor.adopt(spec.name) is None
    finally:
        subprocess.run(["podman", "rm", "--force", container], check=False, capture_output=True)
