"""The cgroupfs system service on this machine's real cgroups, as root.

Every behaviour test starts real processes as a real non-root slot account inside
real cgroups and checks what the kernel reports or enforces. Each test run uses its
own base cgroup name, and teardown removes every cgroup it made even on failure.
"""

from __future__ import annotations

import contextlib
import json
import os
import pwd
import secrets
import select
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import msgspec
import pytest

from ficc.execution.host.errors import HostError
from ficc.execution.host.service import (
    CgroupfsService,
    DeviceRule,
    ServiceHandle,
    ServiceLimits,
    ServiceSpec,
    bpfdevices,
    cgroups,
)
from ficc.execution.host.service.cgroups import Hierarchy, Layout
from service_support import (
    DAEMONIZER,
    FORKER,
    NULL,
    OPENER,
    SLEEPERS,
    SOAK,
    all_nodes_gone,
    py,
    status,
    wait_for,
)

if os.geteuid() != 0:
    pytest.skip("the cgroupfs service tests need root (real cgroups)", allow_module_level=True)


# --- fixtures and helpers -------------------------------------------------------------


@pytest.fixture(scope="module")
def slot() -> Iterator[tuple[int, int]]:
    """A real system account of our own, so parallel runs never see each other's tasks."""
    name = f"ficc-t-s{os.getpid()}"
    _account("useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", name)
    entry = pwd.getpwnam(name)
    try:
        yield entry.pw_uid, entry.pw_gid
    finally:
        _account("userdel", name)


def _account(*command: str) -> None:
    """Run useradd/userdel, retrying while another process holds /etc/passwd's lock."""
    deadline = time.monotonic() + 30
    while (
        result := subprocess.run(command, check=False, capture_output=True, text=True)
    ).returncode:
        assert time.monotonic() < deadline, f"{command}: {result.stderr}"
        time.sleep(0.1)


@pytest.fixture
def service() -> Iterator[CgroupfsService]:
    base = f"ficc-t-svc-{os.getpid()}-{secrets.token_hex(3)}"
    backend = CgroupfsService(base, stop_timeout=15.0)
    try:
        yield backend
    finally:
        _purge(backend, base)


def _purge(backend: CgroupfsService, base: str) -> None:
    """Stop and remove every service under the test's base, then the base itself."""
    names = set()
    for hierarchy in backend.layout.hierarchies:
        top = os.path.join(hierarchy.mount, base)
        if os.path.isdir(top):
            names |= {e.name for e in os.scandir(top) if e.is_dir(follow_symlinks=False)}
    for name in names:
        handle = backend.adopt(name)
        if handle is not None:
            backend.stop(handle)
            backend.remove(handle)
    for hierarchy in backend.layout.hierarchies:
        top = os.path.join(hierarchy.mount, base)
        if os.path.isdir(top):
            os.rmdir(top)


def make_spec(
    tmp_path: Path,
    slot: tuple[int, int],
    argv: list[str],
    *,
    name: str = "attempt-1",
    devices: list[DeviceRule] | None = None,
    **limits: int,
) -> ServiceSpec:
    values = {
        "cpu_millis": 500,
        "memory_bytes": 64 << 20,
        "swap_bytes": 0,
        "processes": 32,
        "nofile": 1024,
    }
    values.update(limits)
    return ServiceSpec(
        name=name,
        argv=argv,
        uid=slot[0],
        gid=slot[1],
        cwd="/",
        environment={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"},
        limits=ServiceLimits(**values),
        devices=[NULL] if devices is None else devices,
        stdout=str(tmp_path / f"{name}.out"),
        stderr=str(tmp_path / f"{name}.err"),
    )


def member_count_is(
    service: CgroupfsService, handle: ServiceHandle, count: int
) -> Callable[[], bool]:
    return lambda: len(service.members(handle)) == count


def slot_tasks(uid: int) -> list[int]:
    """Live (non-zombie) processes of `uid`; PID 1 here reaps orphans lazily."""
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            fields = status(int(entry))
        except FileNotFoundError:
            continue
        if fields["Uid"].split()[0] == str(uid) and not fields["State"].startswith("Z"):
            found.append(int(entry))
    return found


def node(handle: ServiceHandle, key: str) -> Path:
    return Path(handle.cgroups[key])


#: dash opens /dev/null for background jobs, so most tests allow exactly that device.


# --- behaviour on real cgroups --------------------------------------------------------


def test_members_are_the_whole_tree_running_as_the_slot_account(
    service: CgroupfsService, slot: tuple[int, int], tmp_path: Path
) -> None:
    handle = service.create(make_spec(tmp_path, slot, SLEEPERS))
    wait_for(lambda: len(service.members(handle)) == 3)
    members = service.members(handle)
    assert handle.main_pid in members
    for pid in members:
        fields = status(pid)
        assert fields["Uid"].split() == [str(slot[0])] * 4
        assert fields["Gid"].split() == [str(slot[1])] * 4
        assert fields["Groups"] == ""
    for hierarchy in service.layout.hierarchies:
        leaf = node(handle, hierarchy.key) / "supervisor" / "cgroup.procs"
        assert {int(p) for p in leaf.read_text().split()} == members
    assert not service.is_idle(handle, slot[0])
    service.stop(handle)
    assert service.members(handle) == set()
    assert service.exit_status(handle) == -signal.SIGKILL
    service.remove(handle)
    assert all_nodes_gone(handle)


def test_limits_read_back_from_the_kernel(
    service: CgroupfsService, slot: tuple[int, int], tmp_path: Path
) -> None:
    spec = make_spec(
        tmp_path,
        slot,
        SLEEPERS,
        cpu_millis=250,
        memory_bytes=48 << 20,
        swap_bytes=16 << 20,
        processes=7,
        nofile=512,
        devices=[DeviceRule("/dev/null", 1, 3)],
    )
    handle = service.create(spec)
    controls = service.controls(handle)
    assert (controls.memory_bytes, controls.swap_bytes) == (48 << 20, 16 << 20)
    assert (controls.processes, controls.cpu_millis) == (7, 250)
    assert [(d.kind, d.major, d.minor, d.access) for d in controls.devices or []] == [
        ("c", None, None, "m"),
        ("b", None, None, "m"),
        ("c", 1, 3, "rwm"),
    ]
    memory, cpu = node(handle, "memory"), node(handle, "cpu")
    assert (memory / "memory.limit_in_bytes").read_text().strip() == str(48 << 20)
    assert (memory / "memory.memsw.limit_in_bytes").read_text().strip() == str(64 << 20)
    assert (node(handle, "pids") / "pids.max").read_text().strip() == "7"
    assert (cpu / "cpu.cfs_quota_us").read_text().strip() == "25000"
    assert (cpu / "cpu.cfs_period_us").read_text().strip() == "100000"
    leaf_devices = node(handle, "devices") / "supervisor" / "devices.list"
    assert leaf_devices.read_text().splitlines() == ["c *:* m", "b *:* m", "c 1:3 rwm"]
    limits = Path(f"/proc/{handle.main_pid}/limits").read_text()
    assert [line.split()[4:6] for line in limits.splitlines() if "core file" in line] == [
        ["0", "0"]
    ]
    assert [line.split()[3:5] for line in limits.splitlines() if "open files" in line] == [
        ["512", "512"]
    ]
    service.stop(handle)
    service.remove(handle)


def test_memory_limit_oom_kills(
    service: CgroupfsService, slot: tuple[int, int], tmp_path: Path
) -> None:
    code = "import os; b = bytearray(256 << 20); os.write(1, b'survived')"
    spec = make_spec(tmp_path, slot, py(code), memory_bytes=64 << 20, swap_bytes=0)
    handle = service.create(spec)
    wait_for(lambda: service.exit_status(handle) is not None)
    assert service.exit_status(handle) == -signal.SIGKILL
    assert Path(spec.stdout).read_bytes() == b""
    # The kernel counts the kill in the memory cgroup of the killed task (the leaf).
    oom_control = node(handle, "memory") / "supervisor" / "memory.oom_control"
    oom = dict(line.split() for line in oom_control.open())
    assert int(oom["oom_kill"]) >= 1
    peak = int((node(handle, "memory") / "memory.max_usage_in_bytes").read_text())
    assert 32 << 20 < peak <= 64 << 20
    service.stop(handle)
    service.remove(handle)


def test_pids_limit_blocks_forks(
    service: CgroupfsService, slot: tuple[int, int], tmp_path: Path
) -> None:
    spec = make_spec(tmp_path, slot, py(FORKER), processes=5)
    handle = service.create(spec)
    wait_for(lambda: service.exit_status(handle) is not None)
    assert service.exit_status(handle) == 0
    assert json.loads(Path(spec.stdout).read_text()) == {"ok": 4, "failed": 16}
    events = (node(handle, "pids") / "supervisor" / "pids.events").read_text().split()
    assert events[0] == "max"
    assert int(events[1]) >= 16
    service.stop(handle)
    service.remove(handle)


def test_device_policy_allows_exactly_the_prepared_devices(
    service: CgroupfsService, slot: tuple[int, int], tmp_path: Path
) -> None:
    assert os.stat("/dev/zero").st_mode & 0o004, "the test needs a world-readable /dev/zero"
    spec = make_spec(tmp_path, slot, py(OPENER), devices=[DeviceRule("/dev/null", 1, 3)])
    handle = service.create(spec)
    wait_for(lambda: service.exit_status(handle) is not None)
    assert service.exit_status(handle) == 0, Path(spec.stderr).read_text()
    assert json.loads(Path(spec.stdout).read_text()) == {"null": "ok", "zero": "EPERM"}
    service.stop(handle)
    service.remove(handle)


def test_a_whole_major_rule_needs_the_class_directory(
    service: CgroupfsService, slot: tuple[int, int], tmp_path: Path
) -> None:
    spec = make_spec(tmp_path, slot, SLEEPERS, devices=[DeviceRule("/dev/null", 136, None)])
    with pytest.raises(HostError) as refused:
        service.create(spec)
    assert refused.value.code == "service_devices"
    assert service.adopt(spec.name) is None


def test_device_rule_must_name_that_exact_node(
    service: CgroupfsService, slot: tuple[int, int], tmp_path: Path
) -> None:
    spec = make_spec(tmp_path, slot, SLEEPERS, devices=[DeviceRule("/dev/null", 1, 5)])
    with pytest.raises(HostError) as refused:
        service.create(spec)
    assert refused.value.code == "service_devices"
    assert service.adopt(spec.name) is None


def test_stop_kills_a_daemonized_grandchild(
    service: CgroupfsService, slot: tuple[int, int], tmp_path: Path
) -> None:
    spec = make_spec(tmp_path, slot, py(DAEMONIZER))
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


def test_is_idle_sees_slot_processes_outside_the_service(
    service: CgroupfsService, slot: tuple[int, int], tmp_path: Path
) -> None:
    handle = service.create(make_spec(tmp_path, slot, SLEEPERS))
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
    service: CgroupfsService, slot: tuple[int, int], tmp_path: Path
) -> None:
    """A zombie cannot run code or hold resources; PID 1 here reaps orphans lazily."""
    handle = service.create(make_spec(tmp_path, slot, ["/bin/true"]))
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
    service: CgroupfsService, slot: tuple[int, int], tmp_path: Path
) -> None:
    original = service.create(make_spec(tmp_path, slot, SLEEPERS, name="adopted"))
    wait_for(lambda: len(service.members(original)) == 3)
    before = service.members(original)
    base = Path(original.cgroups["memory"]).parent.name
    restarted = CgroupfsService(base)
    adopted = restarted.adopt("adopted")
    assert adopted is not None
    assert adopted.cgroups == original.cgroups
    assert adopted.main_pid is None
    assert restarted.members(adopted) == before
    assert restarted.exit_status(adopted) is None
    restarted.stop(adopted)
    assert restarted.members(adopted) == set()
    restarted.remove(adopted)
    assert restarted.adopt("adopted") is None
    assert service.adopt("never-created") is None
    service.stop(original)  # reaps the zombie main process of the "old daemon"


def test_remove_refuses_a_non_empty_service(
    service: CgroupfsService, slot: tuple[int, int], tmp_path: Path
) -> None:
    handle = service.create(make_spec(tmp_path, slot, SLEEPERS))
    with pytest.raises(HostError) as refused:
        service.remove(handle)
    assert refused.value.code == "service_not_empty"
    assert handle.main_pid in service.members(handle)
    service.stop(handle)
    service.remove(handle)
    assert all_nodes_gone(handle)


def test_stop_and_remove_cover_the_runtime_cgroups_under_the_supervisor_path(
    service: CgroupfsService, slot: tuple[int, int], tmp_path: Path
) -> None:
    """What Podman does with --cgroup-parent: nested cgroups holding the payload."""
    handle = service.create(make_spec(tmp_path, slot, SLEEPERS))
    parent = service.supervisor_cgroup(handle)
    assert parent == f"/{Path(handle.cgroups['memory']).parent.name}/{handle.name}/payload"
    wait_for(lambda: len(service.members(handle)) == 3)
    payload = max(service.members(handle) - {handle.main_pid})
    for hierarchy in service.layout.hierarchies:
        container = Path(hierarchy.mount + parent) / "libpod-test"
        container.mkdir(parents=True)
        if "cpuset" in hierarchy.controllers:
            for name in ("cpuset.cpus", "cpuset.mems"):
                value = (container.parent.parent / name).read_text()
                (container.parent / name).write_text(value)
                (container / name).write_text(value)
        (container / "cgroup.procs").write_text(str(payload))
    assert payload in service.members(handle)
    assert f"{parent}/libpod-test" in Path(f"/proc/{payload}/cgroup").read_text()
    service.stop(handle)
    assert service.members(handle) == set()
    service.remove(handle)
    assert all_nodes_gone(handle)


def test_create_refuses_an_existing_name(
    service: CgroupfsService, slot: tuple[int, int], tmp_path: Path
) -> None:
    handle = service.create(make_spec(tmp_path, slot, SLEEPERS))
    (tmp_path / "second").mkdir()
    with pytest.raises(HostError) as refused:
        service.create(make_spec(tmp_path / "second", slot, SLEEPERS))
    assert refused.value.code == "service_exists"
    assert handle.main_pid in service.members(handle)
    assert all(os.path.isdir(p) for p in handle.cgroups.values())
    service.stop(handle)
    service.remove(handle)


def test_a_refused_start_leaves_nothing_behind(
    service: CgroupfsService, slot: tuple[int, int], tmp_path: Path
) -> None:
    hard = int(Path("/proc/self/limits").read_text().split("Max open files")[1].split()[1])
    spec = make_spec(tmp_path, slot, SLEEPERS, nofile=hard + 1)
    with pytest.raises(HostError) as refused:
        service.create(spec)
    assert refused.value.code == "service_start"
    assert service.adopt(spec.name) is None
    assert slot_tasks(slot[0]) == []


def test_output_files_are_never_opened_through_a_symlink(
    service: CgroupfsService, slot: tuple[int, int], tmp_path: Path
) -> None:
    target = tmp_path / "elsewhere"
    target.write_text("")
    spec = make_spec(tmp_path, slot, SLEEPERS)
    Path(spec.stdout).symlink_to(target)
    with pytest.raises(HostError) as refused:
        service.create(spec)
    assert refused.value.code == "service_output"
    assert service.adopt(spec.name) is None


def test_output_files_are_root_private(
    service: CgroupfsService, slot: tuple[int, int], tmp_path: Path
) -> None:
    spec = make_spec(tmp_path, slot, ["/bin/sh", "-c", "echo out; echo err >&2"])
    handle = service.create(spec)
    wait_for(lambda: service.exit_status(handle) is not None)
    for path, text in ((spec.stdout, "out\n"), (spec.stderr, "err\n")):
        info = os.stat(path)
        assert (info.st_uid, info.st_mode & 0o777) == (0, 0o600)
        assert Path(path).read_text() == text
    service.stop(handle)
    service.remove(handle)


def test_environment_is_exactly_the_spec(
    service: CgroupfsService, slot: tuple[int, int], tmp_path: Path
) -> None:
    os.environ["FICC_T_SVC_LEAK"] = "daemon-secret"
    try:
        spec = make_spec(tmp_path, slot, ["/usr/bin/env"])
        handle = service.create(spec)
        wait_for(lambda: service.exit_status(handle) is not None)
    finally:
        del os.environ["FICC_T_SVC_LEAK"]
    shown = dict(line.split("=", 1) for line in Path(spec.stdout).read_text().splitlines())
    assert shown == spec.environment
    service.stop(handle)
    service.remove(handle)


FORK_STORM = """
import os
while True:
    try:
        if os.fork() == 0:
            os._exit(0)
        os.wait()
    except OSError:
        pass
"""


def test_stop_without_cgroup_kill_freezes_and_kills_a_fork_storm(
    service: CgroupfsService, slot: tuple[int, int], tmp_path: Path
) -> None:
    """Members outside the unified subtree are out of cgroup.kill's reach: the v1
    freezer path must still empty the tree while its members keep forking."""
    handle = service.create(make_spec(tmp_path, slot, py(FORK_STORM), processes=64))
    unified = Path(next(h.mount for h in service.layout.hierarchies if h.key == "unified"))
    assert handle.cgroups["unified"].startswith(str(unified))
    (unified / "cgroup.procs").write_text(str(handle.main_pid))  # out of the subtree
    wait_for(lambda: service.members(handle) - {handle.main_pid})  # it is forking
    assert Path(handle.cgroups["unified"], "supervisor", "cgroup.procs").read_text() == ""
    service.stop(handle)
    assert service.members(handle) == set()
    assert service.exit_status(handle) == -signal.SIGKILL
    service.remove(handle)


def test_adopted_service_left_frozen_by_a_crashed_daemon_is_stopped(
    service: CgroupfsService, slot: tuple[int, int], tmp_path: Path
) -> None:
    handle = service.create(make_spec(tmp_path, slot, SLEEPERS))
    wait_for(lambda: len(service.members(handle)) == 3)
    freezer = node(handle, "freezer") / "freezer.state"
    freezer.write_text("FROZEN")
    wait_for(lambda: freezer.read_text().strip() == "FROZEN")
    base = Path(handle.cgroups["memory"]).parent.name
    restarted = CgroupfsService(base)
    adopted = restarted.adopt(handle.name)
    assert adopted is not None
    restarted.stop(adopted)
    assert restarted.members(adopted) == set()
    assert freezer.read_text().strip() == "THAWED"
    restarted.remove(adopted)
    service.stop(handle)  # reaps the old main process


def test_stop_thaws_a_runtime_frozen_child_cgroup(
    service: CgroupfsService, slot: tuple[int, int], tmp_path: Path
) -> None:
    """A paused container (its own frozen freezer cgroup) must still be emptied."""
    handle = service.create(make_spec(tmp_path, slot, SLEEPERS))
    wait_for(lambda: len(service.members(handle)) == 3)
    paused = node(handle, "freezer") / "payload" / "paused"
    paused.mkdir(parents=True)
    sleeper = max(service.members(handle) - {handle.main_pid})
    (paused / "cgroup.procs").write_text(str(sleeper))
    (paused / "freezer.state").write_text("FROZEN")
    wait_for(lambda: (paused / "freezer.state").read_text().strip() == "FROZEN")
    service.stop(handle)
    assert service.members(handle) == set()
    service.remove(handle)
    assert all_nodes_gone(handle)


def test_parallel_creates_from_threads_stay_separate(
    service: CgroupfsService, slot: tuple[int, int], tmp_path: Path
) -> None:
    specs = [make_spec(tmp_path, slot, SLEEPERS, name=f"parallel-{i}") for i in range(4)]
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


def test_the_program_gets_exactly_three_descriptors(
    service: CgroupfsService, slot: tuple[int, int], tmp_path: Path
) -> None:
    """No gate pipe or daemon descriptor leaks into the program (ls's own dir fd is 3)."""
    spec = make_spec(tmp_path, slot, ["/bin/ls", "/proc/self/fd"])
    handle = service.create(spec)
    wait_for(lambda: service.exit_status(handle) is not None)
    assert Path(spec.stdout).read_text().split() == ["0", "1", "2", "3"]
    service.stop(handle)
    service.remove(handle)


def test_a_foreign_handle_is_refused(
    service: CgroupfsService, slot: tuple[int, int], tmp_path: Path
) -> None:
    handle = service.create(make_spec(tmp_path, slot, SLEEPERS))
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


def test_a_failed_duplicate_create_keeps_the_original_service(
    service: CgroupfsService, slot: tuple[int, int], tmp_path: Path
) -> None:
    handle = service.create(make_spec(tmp_path, slot, ["/bin/sh", "-c", "exit 7"]))
    wait_for(lambda: service.exit_status(handle) is not None)
    (tmp_path / "second").mkdir()
    with pytest.raises(HostError):
        service.create(make_spec(tmp_path / "second", slot, SLEEPERS))
    assert service.exit_status(handle) == 7
    service.stop(handle)
    service.remove(handle)


def test_root_is_refused_unless_the_backend_allows_a_root_supervisor(
    service: CgroupfsService, slot: tuple[int, int], tmp_path: Path
) -> None:
    spec = msgspec.structs.replace(make_spec(tmp_path, slot, SLEEPERS), uid=0)
    with pytest.raises(HostError) as refused:
        service.create(spec)
    assert refused.value.code == "service_spec"
    assert service.adopt(spec.name) is None


def test_a_missing_working_directory_is_a_start_refusal(
    service: CgroupfsService, slot: tuple[int, int], tmp_path: Path
) -> None:
    spec = msgspec.structs.replace(
        make_spec(tmp_path, slot, SLEEPERS), cwd=str(tmp_path / "absent")
    )
    with pytest.raises(HostError) as refused:
        service.create(spec)
    assert refused.value.code == "service_create"
    assert service.adopt(spec.name) is None


def test_a_program_that_cannot_be_executed_is_a_start_refusal(
    service: CgroupfsService, slot: tuple[int, int], tmp_path: Path
) -> None:
    spec = make_spec(tmp_path, slot, ["/nonexistent/program"])
    with pytest.raises(HostError) as refused:
        service.create(spec)
    assert refused.value.code == "service_start"
    assert "No such file" in refused.value.message
    assert service.adopt(spec.name) is None
    assert slot_tasks(slot[0]) == []


#: What runc 1.1 writes into every container's device cgroup; a v1 child can never
#: allow more than its parent, so the enclosing service must allow at least this.
RUNC_BASELINE = [
    DeviceRule("/dev/null", 1, 3),
    DeviceRule("/dev/zero", 1, 5),
    DeviceRule("/dev/full", 1, 7),
    DeviceRule("/dev/random", 1, 8),
    DeviceRule("/dev/urandom", 1, 9),
    DeviceRule("/dev/tty", 5, 0),
    DeviceRule("/dev/ptmx", 5, 2),
    DeviceRule("/dev/net/tun", 10, 200),
    DeviceRule("/dev/pts", 136, None),
]


@pytest.fixture(scope="module")
def busybox_image(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A registry-free image: static busybox imported as a rootfs tarball."""
    root = tmp_path_factory.mktemp("rootfs")
    (root / "bin").mkdir()
    (root / "bin" / "busybox").write_bytes(Path("/usr/bin/busybox").read_bytes())
    (root / "bin" / "busybox").chmod(0o755)
    tarball = root.parent / "rootfs.tar"
    subprocess.run(["tar", "-C", str(root), "-cf", str(tarball), "."], check=True)
    name = f"localhost/ficc-t-svc:{os.getpid()}"
    subprocess.run(["podman", "import", "--quiet", str(tarball), name], check=True)
    try:
        yield name
    finally:
        subprocess.run(["podman", "rmi", "--force", name], check=False, capture_output=True)


def test_podman_payload_lands_in_the_supervisor_cgroup_and_stop_empties_it(
    slot: tuple[int, int], tmp_path: Path, busybox_image: str
) -> None:
    """The real runtime, rootful as the design's recipe runs it, under --cgroup-parent."""
    base = f"ficc-t-svc-{os.getpid()}-{secrets.token_hex(3)}"
    backend = CgroupfsService(base, root_supervisor=True, stop_timeout=15.0)
    container = f"ficc-t-svc-{os.getpid()}"
    try:
        spec = make_spec(tmp_path, slot, ["/bin/true"], name="podman", devices=RUNC_BASELINE)
        handle_name = spec.name
        parent = f"/{base}/{handle_name}/payload"
        argv = ["/usr/bin/podman", "run", "--rm", "--name", container, "--runtime", "runc"]
        argv += ["--cgroup-manager=cgroupfs", f"--cgroup-parent={parent}", "--network=none"]
        argv += ["--ulimit", "nofile=1024:1024", "--ulimit", "nproc=1024:1024"]
        argv += [busybox_image, "/bin/busybox", "sleep", "1000"]
        environment = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"}
        spec = msgspec.structs.replace(
            spec, argv=argv, uid=0, gid=0, environment=environment, limits=LIMITS_4K
        )
        handle = backend.create(spec)
        assert backend.supervisor_cgroup(handle) == parent

        def payload() -> int | None:
            for pid in backend.members(handle):
                with contextlib.suppress(FileNotFoundError):
                    if Path(f"/proc/{pid}/cmdline").read_bytes().startswith(b"/bin/busybox"):
                        return pid
            assert backend.exit_status(handle) is None, Path(spec.stderr).read_text()
            return None

        wait_for(payload, timeout=60)
        pid = payload()
        assert pid is not None
        lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
        assert len(lines) == len(backend.layout.hierarchies)
        assert all(line.split(":", 2)[2].startswith(parent + "/") for line in lines)
        backend.stop(handle)
        assert backend.members(handle) == set()
        backend.remove(handle)
        assert all_nodes_gone(handle)
    finally:
        subprocess.run(["podman", "rm", "--force", container], check=False, capture_output=True)
        _purge(backend, base)


@pytest.mark.soak
def test_create_stop_remove_cycles_leave_no_trace(
    service: CgroupfsService, slot: tuple[int, int], tmp_path: Path
) -> None:
    for index in range(200 if SOAK else 5):
        spec = make_spec(tmp_path, slot, SLEEPERS, name=f"cycle-{index}")
        handle = service.create(spec)
        wait_for(member_count_is(service, handle, 3))
        service.stop(handle)
        service.remove(handle)
        assert all_nodes_gone(handle)
        assert service.is_idle(handle, slot[0])


BPF_OPENER = "import sys; sys.stdin.read(1)\n" + OPENER


def test_v2_device_filter_allows_exactly_the_prepared_devices(
    slot: tuple[int, int], tmp_path: Path
) -> None:
    """The cgroup v2 policy (an eBPF program) on this machine's unified tree, where
    the v1 device cgroup of the process allows everything: only the filter denies."""
    unified = next(h.mount for h in cgroups.discover().hierarchies if h.key == "unified")
    group = Path(unified) / f"ficc-t-bpf-{os.getpid()}-{secrets.token_hex(3)}"
    group.mkdir()
    child = None
    try:
        bpfdevices.attach(str(group), [NULL])
        assert bpfdevices.attached(str(group)) == [cgroups.expected_devices([NULL])]
        child = subprocess.Popen(
            py(BPF_OPENER),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env={},
            user=slot[0],
            group=slot[1],
            extra_groups=[],
        )
        (group / "cgroup.procs").write_text(str(child.pid))
        v1_devices = _proc_line(child.pid, "devices")
        assert "a *:* rwm" in Path(f"/sys/fs/cgroup/devices{v1_devices}/devices.list").read_text()
        out, _ = child.communicate(b"g", timeout=60)
        assert json.loads(out) == {"null": "ok", "zero": "EPERM"}
    finally:
        if child is not None and child.poll() is None:
            child.kill()
            child.wait()
        group.rmdir()


def _proc_line(pid: int, controller: str) -> str:
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if controller in controllers.split(","):
            return path
    raise AssertionError(f"{controller} missing from /proc/{pid}/cgroup")


def test_v2_without_usable_controllers_refuses_and_leaves_nothing(
    slot: tuple[int, int], tmp_path: Path
) -> None:
    """Pretend this machine's controller-less unified tree had controllers: the kernel
    refuses to delegate them, and create must clean up its nodes."""
    unified = next(h.mount for h in cgroups.discover().hierarchies if h.key == "unified")
    root = Path(unified) / f"ficc-t-v2-{os.getpid()}-{secrets.token_hex(3)}"
    root.mkdir()
    try:
        claimed = frozenset({"memory", "pids", "cpu"})
        layout = Layout(2, (Hierarchy("unified", str(root), 2, claimed),))
        backend = CgroupfsService("ficc-t-v2", layout=layout)
        with pytest.raises(HostError) as refused:
            backend.create(make_spec(tmp_path, slot, SLEEPERS))
        assert refused.value.code == "service_create"
        assert backend.adopt("attempt-1") is None
    finally:
        for leftover in sorted(root.rglob("*"), reverse=True):
            if leftover.is_dir():
                leftover.rmdir()
        root.rmdir()


# --- pure logic -----------------------------------------------------------------------

MOUNTINFO = """\
31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
32 31 0:29 / /sys/fs/cgroup/cpu,cpuacct rw,relatime - cgroup cgroup rw,cpuacct,cpu
35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory
36 31 0:33 / /sys/fs/cgroup/devices rw,relatime - cgroup cgroup rw,devices
37 31 0:34 / /sys/fs/cgroup/freezer rw,relatime - cgroup cgroup rw,freezer
39 31 0:36 / /sys/fs/cgroup/pids rw,relatime - cgroup cgroup rw,pids
40 31 0:37 / /sys/fs/cgroup/systemd rw,relatime - cgroup cgroup rw,xattr,name=systemd
41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw
42 23 0:39 / /mnt/odd\\040dir rw - cgroup cgroup rw,blkio
"""


def test_mountinfo_names_each_hierarchy_by_its_controllers() -> None:
    found = {h.key: h for h in cgroups.parse_mountinfo(MOUNTINFO)}
    assert set(found) == {
        "cpu,cpuacct",
        "memory",
        "devices",
        "freezer",
        "pids",
        "name=systemd",
        "unified",
        "blkio",
    }
    assert found["cpu,cpuacct"].controllers == {"cpu", "cpuacct"}
    assert found["blkio"].mount == "/mnt/odd dir"
    assert found["unified"].version == 2


def test_layout_prefers_v2_only_with_its_controllers() -> None:
    hierarchies = cgroups.parse_mountinfo(MOUNTINFO)
    assert cgroups.choose_layout(hierarchies, frozenset()).version == 1
    v1 = cgroups.choose_layout(hierarchies, frozenset({"memory", "pids"}))
    assert v1.version == 1
    assert v1.hierarchies[-1].key == "unified"
    v2 = cgroups.choose_layout(hierarchies, frozenset({"memory", "pids", "cpu", "io"}))
    assert v2.version == 2
    assert [h.key for h in v2.hierarchies] == ["unified"]
    no_freezer = [h for h in hierarchies if h.key != "freezer"]
    with pytest.raises(HostError) as refused:
        cgroups.choose_layout(no_freezer, frozenset())
    assert refused.value.code == "service_unsupported"
    assert "freezer" in refused.value.message


LIMITS_4K = ServiceLimits(
    cpu_millis=1000, memory_bytes=512 << 20, swap_bytes=0, processes=256, nofile=4096
)
LIMITS = ServiceLimits(
    cpu_millis=1500, memory_bytes=(1 << 30) + 123, swap_bytes=1 << 20, processes=64, nofile=64
)


def test_v1_writes_memory_before_memsw_and_rounds_to_pages() -> None:
    writes = cgroups.v1_writes(LIMITS, memsw=True)
    assert writes[:2] == [
        ("memory", "memory.limit_in_bytes", str(1 << 30)),
        ("memory", "memory.memsw.limit_in_bytes", str((1 << 30) + (1 << 20))),
    ]
    assert ("cpu", "cpu.cfs_quota_us", "150000") in writes
    assert [w for w in cgroups.v1_writes(LIMITS, memsw=False) if "memsw" in w[1]] == []
    devices = [DeviceRule("/dev/null", 1, 3), DeviceRule("/dev/pts", 136, None)]
    assert cgroups.v1_device_writes(devices) == [
        ("devices.deny", "a"),
        ("devices.allow", "c *:* m"),
        ("devices.allow", "b *:* m"),
        ("devices.allow", "c 1:3 rwm"),
        ("devices.allow", "c 136:* rwm"),
    ]


def test_v2_writes_and_readback_parsers() -> None:
    assert cgroups.v2_writes(LIMITS) == [
        ("memory.max", str(1 << 30)),
        ("memory.swap.max", str(1 << 20)),
        ("pids.max", "64"),
        ("cpu.max", "150000 100000"),
    ]
    assert cgroups.parse_limit("max\n") is None
    assert cgroups.parse_limit("9223372036854771712\n") is None
    assert cgroups.parse_limit("4096\n") == 4096
    assert cgroups.parse_cpu("max", "100000") is None
    assert cgroups.parse_cpu("-1", "100000") is None
    assert cgroups.parse_cpu("150000", "100000") == 1500
    parsed = cgroups.parse_devices("c 1:3 rwm\na *:* rwm\n")
    assert [(d.kind, d.major, d.minor, d.access) for d in parsed] == [
        ("c", 1, 3, "rwm"),
        ("a", None, None, "rwm"),
    ]


def test_spec_refuses_what_the_service_cannot_run_safely(tmp_path: Path) -> None:
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


def test_device_filter_program_round_trips_and_refuses_foreign_code() -> None:
    rules = [NULL, DeviceRule("/dev/pts", 136, None), DeviceRule("/dev/nvidia0", 195, 0)]
    raw = bpfdevices.encode(bpfdevices.program(rules))
    assert bpfdevices.decode(raw) == cgroups.expected_devices(rules)
    assert bpfdevices.decode(bpfdevices.encode(bpfdevices.program([]))) == (
        cgroups.expected_devices([])
    )
    tampered = bytearray(raw)
    tampered[-12] ^= 1  # the last rule's allow becomes something else
    assert bpfdevices.decode(bytes(tampered)) is None
    assert bpfdevices.decode(raw[:-1]) is None


def test_membership_check_names_v2_by_its_empty_controller_field() -> None:
    text = "2:cpu,cpuacct:/b/a/supervisor\n1:memory:/b/a/supervisor\n0::/b/a/supervisor\n"
    memberships = cgroups.parse_proc_cgroup(text)
    v2 = Layout(2, (Hierarchy("unified", "/sys/fs/cgroup", 2, frozenset({"memory", "cpu"})),))
    assert cgroups.hierarchies_not_at(v2, memberships, "/b/a/supervisor") == []
    v1 = cgroups.choose_layout(cgroups.parse_mountinfo(MOUNTINFO), frozenset())
    assert cgroups.hierarchies_not_at(v1, memberships, "/b/a/supervisor") == [
        "devices",
        "freezer",
        "pids",
        "name=systemd",
        "blkio",
    ]
