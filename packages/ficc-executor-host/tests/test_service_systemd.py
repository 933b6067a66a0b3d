"""The systemd system service: pure parts, and the shared behaviour suite.

The behaviour tests run against BOTH backends (`service` is parametrized with
`cgroupfs` and `systemd`), so the two implement the same contract: real services,
a real non-root slot account, real cgroups, and what the kernel (and systemd)
report or enforce. The `systemd` runs need root and systemd as PID 1; on this
workplace's machines they run inside a privileged Podman container that boots
Debian's systemd (`python tools/systemd/run.py`, which sets FICC_SYSTEMD_REQUIRED=1
so they cannot skip there). Elsewhere they skip and say why.
"""

from __future__ import annotations

import contextlib
import json
import os
import pwd
import secrets
import select
import shutil
import signal
import subprocess
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import msgspec
import pytest

from ficc.execution.host.errors import HostError
from ficc.execution.host.service import CgroupfsService, systemd
from ficc.execution.host.service.interface import (
    DeviceRule,
    ServiceHandle,
    ServiceLimits,
    ServiceSpec,
)
from ficc.execution.host.service.systemd import SystemdService
from service_support import (
    DAEMONIZER,
    FORKER,
    NULL,
    OPENER,
    PYTHON,
    SLEEPERS,
    SOAK,
    all_nodes_gone,
    py,
    status,
    wait_for,
)

SYSTEMCTL = "/usr/bin/systemctl"


def _pid1_is_systemd() -> bool:
    try:
        return Path("/proc/1/comm").read_text().strip() == "systemd"
    except OSError:
        return False


UNDER_SYSTEMD = os.geteuid() == 0 and _pid1_is_systemd()
SYSTEMD_REASON = (
    "needs root and systemd as PID 1; run `python tools/systemd/run.py`, which boots "
    "systemd in a privileged Podman container and runs these tests there"
)
if os.environ.get("FICC_SYSTEMD_REQUIRED") == "1" and not UNDER_SYSTEMD:
    raise RuntimeError("FICC_SYSTEMD_REQUIRED=1 but this is not root under systemd as PID 1")
needs_systemd = pytest.mark.skipif(not UNDER_SYSTEMD, reason=SYSTEMD_REASON)


# --- pure logic -----------------------------------------------------------------------

PROC_DEVICES = """\
Character devices:
  1 mem
  4 /dev/vc/0
  4 tty
  4 ttyS
  5 /dev/tty
136 pts
195 nvidia
226 drm
241 pts

Block devices:
  8 sd
259 blkext
"""


def make_spec(
    tmp_path: Path,
    slot: tuple[int, int],
    argv: list[str],
    *,
    name: str = "ficc-work-t-attempt-1",
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


def test_unit_and_cgroup_names() -> None:
    assert systemd.unit_name("ficc-work-i1-a7") == "ficc-work-i1-a7.service"
    assert systemd.unit_cgroup("ficc.slice", "ficc-work-i1-a7") == (
        "/ficc.slice/ficc-work-i1-a7.service"
    )
    with pytest.raises(HostError) as refused:
        systemd.unit_name("../escape")
    assert refused.value.code == "service_spec"


def test_cpu_quota_is_exact_to_a_thousandth_of_a_cpu() -> None:
    assert systemd.cpu_quota(250) == "25%"
    assert systemd.cpu_quota(1500) == "150%"
    assert systemd.cpu_quota(255) == "25.5%"
    assert systemd.cpu_quota(10) == "1%"


def test_proc_devices_character_section_only() -> None:
    classes = systemd.parse_proc_devices(PROC_DEVICES)
    assert classes[136] == ["pts"]
    assert classes[4] == ["/dev/vc/0", "tty", "ttyS"]
    assert 8 not in classes
    assert 259 not in classes


def test_device_allow_matches_the_cgroupfs_allow_list() -> None:
    classes = systemd.parse_proc_devices(PROC_DEVICES)
    devices = [NULL, DeviceRule("/dev/dri", 226, None)]
    assert systemd.device_allow(devices, classes) == [
        "char-* m",
        "block-* m",
        "/dev/null rwm",
        "char-drm rwm",
    ]
    assert systemd.device_allow([], classes) == ["char-* m", "block-* m"]


@pytest.mark.parametrize("major", [4, 136, 240])
def test_a_whole_major_needs_a_name_of_its_own(major: int) -> None:
    """4 has several names, `pts` also names 241, 240 is not registered at all."""
    classes = systemd.parse_proc_devices(PROC_DEVICES)
    with pytest.raises(HostError) as refused:
        systemd.device_allow([DeviceRule("/dev/x", major, None)], classes)
    assert refused.value.code == "service_devices"


def test_run_properties_carry_every_control(tmp_path: Path) -> None:
    spec = make_spec(
        tmp_path,
        (1234, 1235),
        SLEEPERS,
        cpu_millis=250,
        memory_bytes=(48 << 20) + 5,
        swap_bytes=16 << 20,
        processes=7,
        nofile=512,
    )
    classes = systemd.parse_proc_devices(PROC_DEVICES)
    v1 = systemd.run_properties(
        spec,
        slice_name="ficc.slice",
        bind_to="ficc.service",
        cgroup_version=1,
        classes=classes,
        stdin_file="/run/g/empty",
    )
    for expected in [
        "User=1234",
        "Group=1235",
        "Slice=ficc.slice",
        "KillMode=control-group",
        "Delegate=yes",
        "RemainAfterExit=yes",
        "CPUQuota=25%",
        f"MemoryMax={48 << 20}",
        "TasksMax=7",
        "LimitCORE=0",
        "LimitNOFILE=512:512",
        "DevicePolicy=strict",
        "DeviceAllow=/dev/null rwm",
        "BindsTo=ficc.service",
        "After=ficc.service",
        "UMask=0077",
        "WorkingDirectory=/",
        "StandardInput=file:/run/g/empty",
    ]:
        assert expected in v1
    assert not [p for p in v1 if p.startswith(("MemorySwapMax", "PartOf", "Environment"))]
    v2 = systemd.run_properties(
        spec,
        slice_name="ficc.slice",
        bind_to=None,
        cgroup_version=2,
        classes=classes,
        stdin_file="/run/g/empty",
    )
    assert f"MemorySwapMax={16 << 20}" in v2
    assert not [p for p in v2 if p.startswith(("BindsTo", "After"))]


def test_time_spans_as_systemctl_prints_them() -> None:
    """Values seen from systemd 252 for CPUQuota=1%, 25.5%, 100%, 155.5%, 1000.1%."""
    assert systemd.parse_usec("10ms") == 10_000
    assert systemd.parse_usec("255ms") == 255_000
    assert systemd.parse_usec("1s") == 1_000_000
    assert systemd.parse_usec("1.555000s") == 1_555_000
    assert systemd.parse_usec("10.001000s") == 10_001_000
    assert systemd.parse_usec("7us") == 7
    assert systemd.parse_usec("infinity") is None
    assert systemd.parse_usec("1min") is None


def test_show_output_and_exit_status() -> None:
    show = systemd.parse_show("LoadState=loaded\nExecMainCode=2\nExecMainStatus=9\nX=a=b\n")
    assert show["X"] == "a=b"
    assert systemd.exit_status_of(show) == -signal.SIGKILL
    assert systemd.exit_status_of({**show, "ExecMainCode": "1", "ExecMainStatus": "7"}) == 7
    assert systemd.exit_status_of({**show, "ExecMainCode": "0"}) is None
    assert systemd.exit_status_of({**show, "LoadState": "not-found"}) is None


def test_own_unit_from_proc_cgroup() -> None:
    v1 = "12:pids:/system.slice/ficc.service\n1:name=systemd:/system.slice/ficc.service\n0::/\n"
    assert systemd.own_unit(v1) == "ficc.service"
    v2 = "0::/system.slice/ficc-executor-host.service\n"
    assert systemd.own_unit(v2) == "ficc-executor-host.service"
    assert systemd.own_unit("0::/user.slice/user-0.slice/session-3.scope\n") is None
    assert systemd.own_unit("0::/\n") is None


def test_the_shim_survives_systemd_command_line_expansion() -> None:
    """systemd replaces `$NAME` (and may expand `%x`) in ExecStart arguments."""
    assert "$" not in systemd._SHIM
    assert "%" not in systemd._SHIM
    compile(systemd._SHIM, "shim", "exec")


def test_binding_to_the_own_unit_needs_one() -> None:
    """Outside a service unit (a test process), the default binding is refused."""
    own = systemd.own_unit(Path("/proc/self/cgroup").read_text())
    if own is not None:
        pytest.skip(f"this test process runs in the service unit {own}")
    with pytest.raises(HostError) as refused:
        SystemdService()
    assert refused.value.code == "service_unsupported"


def test_slice_and_bound_unit_names_are_checked() -> None:
    with pytest.raises(HostError):
        SystemdService(slice_name="a-b.slice", bind_to_own_unit=False)
    with pytest.raises(HostError):
        SystemdService(bind_to="ficc.service; rm", bind_to_own_unit=False)


# --- behaviour under a real systemd ---------------------------------------------------


Backend = CgroupfsService | SystemdService


@pytest.fixture(scope="module")
def slot() -> Iterator[tuple[int, int]]:
    """A real system account of our own, so parallel runs never see each other's tasks."""
    if os.geteuid() != 0:
        pytest.skip("the behaviour tests need root (real cgroups and a real slot account)")
    name = f"ficc-t-sd{os.getpid()}"
    subprocess.run(
        ["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", name],
        check=True,
    )
    entry = pwd.getpwnam(name)
    try:
        yield entry.pw_uid, entry.pw_gid
    finally:
        subprocess.run(["userdel", name], check=False)


@pytest.fixture
def prefix() -> str:
    """A unique service-name prefix (unit names are global on the host)."""
    return f"ficc-work-t{secrets.token_hex(3)}"


@pytest.fixture(params=["cgroupfs", "systemd"])
def service(request: pytest.FixtureRequest, prefix: str) -> Iterator[Backend]:
    """Each backend in turn; teardown stops and removes everything the test made."""
    if request.param == "systemd":
        if not UNDER_SYSTEMD:
            pytest.skip(SYSTEMD_REASON)
        unit_backend = SystemdService(bind_to_own_unit=False, stop_timeout=15.0)
        try:
            yield unit_backend
        finally:
            _purge_units(prefix)
        return
    if os.geteuid() != 0:
        pytest.skip("the cgroupfs backend needs root (real cgroups)")
    if _pid1_is_systemd():
        pytest.skip(
            "the cgroupfs backend is for hosts whose PID 1 is not systemd (here systemd "
            "owns the cgroup tree); it runs on such hosts, e.g. outside the container"
        )
    base = f"ficc-t-sd-{os.getpid()}-{secrets.token_hex(3)}"
    files_backend = CgroupfsService(base, stop_timeout=15.0)
    try:
        yield files_backend
    finally:
        _purge_cgroups(files_backend, base)


def _purge_units(prefix: str) -> None:
    listed = subprocess.run(
        [SYSTEMCTL, "list-units", "--all", "--plain", "--no-legend", "--full", f"{prefix}*"],
        capture_output=True,
        text=True,
        check=False,
    ).stdout
    backend = SystemdService(bind_to_own_unit=False)
    units = {w for w in listed.split() if w.startswith(prefix) and w.endswith(".service")}
    for unit in units:
        handle = backend.adopt(unit.removesuffix(".service"))
        if handle is not None:
            backend.stop(handle)
            backend.remove(handle)


def _purge_cgroups(backend: CgroupfsService, base: str) -> None:
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


def restarted(service: Backend, handle: ServiceHandle) -> Backend:
    """A new backend object, as after a daemon restart (same base or slice)."""
    if isinstance(service, SystemdService):
        return SystemdService(bind_to_own_unit=False, stop_timeout=15.0)
    return CgroupfsService(Path(handle.cgroups["memory"]).parent.name, stop_timeout=15.0)


def show(unit: str, *keys: str) -> dict[str, str]:
    argv = [SYSTEMCTL, "show", unit, *(f"--property={k}" for k in keys)]
    result = subprocess.run(argv, capture_output=True, text=True, check=False)
    return systemd.parse_show(result.stdout)


def loaded(name: str) -> bool:
    return show(f"{name}.service", "LoadState")["LoadState"] == "loaded"


def node(handle: ServiceHandle, controller: str) -> Path:
    return Path(next(p for k, p in handle.cgroups.items() if controller in k.split(",")))


def test_members_are_the_whole_tree_running_as_the_slot_account(
    service: Backend, slot: tuple[int, int], prefix: str, tmp_path: Path
) -> None:
    spec = make_spec(tmp_path, slot, SLEEPERS, name=f"{prefix}-a")
    handle = service.create(spec)
    if service.backend == "systemd":
        assert show(f"{spec.name}.service", "MainPID")["MainPID"] == str(handle.main_pid)
    wait_for(lambda: len(service.members(handle)) == 3)
    members = service.members(handle)
    assert handle.main_pid in members
    for pid in members:
        fields = status(pid)
        assert fields["Uid"].split() == [str(slot[0])] * 4
        assert fields["Gid"].split() == [str(slot[1])] * 4
        assert fields["Groups"] in {"", str(slot[1])}  # systemd's User= adds the own GID
    for path in handle.cgroups.values():
        leaf = Path(path) / "supervisor" / "cgroup.procs"
        assert {int(p) for p in leaf.read_text().split()} == members
    assert not service.is_idle(handle, slot[0])
    service.stop(handle)
    assert service.members(handle) == set()
    assert service.exit_status(handle) == -signal.SIGKILL
    service.remove(handle)
    assert not loaded(spec.name) if service.backend == "systemd" else True
    assert all_nodes_gone(handle)
    assert service.is_idle(handle, slot[0])


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
    )
    handle = service.create(spec)
    controls = service.controls(handle)
    assert controls.backend == service.backend
    assert controls.memory_bytes == 48 << 20
    memsw = os.path.exists("/sys/fs/cgroup/memory/memory.memsw.limit_in_bytes")
    swap_counted = memsw or controls.cgroup_version == 2
    assert controls.swap_bytes == (16 << 20 if swap_counted else None)
    assert (controls.processes, controls.cpu_millis) == (7, 250)
    assert sorted(
        (d.kind, str(d.major), str(d.minor), d.access) for d in controls.devices or []
    ) == [("b", "None", "None", "m"), ("c", "1", "3", "rwm"), ("c", "None", "None", "m")]
    if service.backend == "systemd":
        _check_unit_properties(spec.name)
    if controls.cgroup_version == 1:
        assert (node(handle, "memory") / "memory.limit_in_bytes").read_text().strip() == str(
            48 << 20
        )
        assert (node(handle, "pids") / "pids.max").read_text().strip() == "7"
        assert (node(handle, "cpu") / "cpu.cfs_quota_us").read_text().strip() == "25000"
        devices = (node(handle, "devices") / "supervisor" / "devices.list").read_text()
        assert sorted(devices.splitlines()) == ["b *:* m", "c *:* m", "c 1:3 rwm"]
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
    service: Backend, slot: tuple[int, int], prefix: str, tmp_path: Path
) -> None:
    """The child that allocates is OOM-killed; its parent shell survives, reports and
    stays, so the unit's cgroup (with the kernel's OOM counters) is still there:
    systemd removes a unit's cgroups as soon as they are empty."""
    code = "import os; b = bytearray(256 << 20); os.write(1, b'survived')"
    script = f'{PYTHON} -I -S -c "{code}"; echo status=$?; exec sleep 1000'
    spec = make_spec(
        tmp_path, slot, ["/bin/sh", "-c", script], name=f"{prefix}-oom", memory_bytes=64 << 20
    )
    handle = service.create(spec)
    wait_for(lambda: Path(spec.stdout).read_text().endswith("\n"))
    assert Path(spec.stdout).read_text() == f"status={128 + signal.SIGKILL}\n"
    if handle.cgroup_version == 1:
        # The kernel counts the kill in the memory cgroup of the killed task (the leaf).
        oom_control = node(handle, "memory") / "supervisor" / "memory.oom_control"
        oom = dict(line.split() for line in oom_control.open())
        assert int(oom["oom_kill"]) >= 1
        peak = int((node(handle, "memory") / "memory.max_usage_in_bytes").read_text())
        assert 32 << 20 < peak <= 64 << 20
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
        "DevicePolicy",
    )
    assert seen == {
        "MemoryMax": str(48 << 20),
        "TasksMax": "7",
        "CPUQuotaPerSecUSec": "250ms",
        "LimitCORE": "0",
        "LimitNOFILE": "512",
        "KillMode": "control-group",
        "DevicePolicy": "strict",
    }


def test_pids_limit_blocks_forks(
    service: Backend, slot: tuple[int, int], prefix: str, tmp_path: Path
) -> None:
    spec = make_spec(tmp_path, slot, py(FORKER), name=f"{prefix}-pids", processes=5)
    handle = service.create(spec)
    wait_for(lambda: service.exit_status(handle) is not None)
    assert service.exit_status(handle) == 0, Path(spec.stderr).read_text()
    assert json.loads(Path(spec.stdout).read_text()) == {"ok": 4, "failed": 16}
    service.stop(handle)
    service.remove(handle)


def test_device_policy_allows_exactly_the_prepared_devices(
    service: Backend, slot: tuple[int, int], prefix: str, tmp_path: Path
) -> None:
    assert os.stat("/dev/zero").st_mode & 0o004, "the test needs a world-readable /dev/zero"
    spec = make_spec(tmp_path, slot, py(OPENER), name=f"{prefix}-dev")
    handle = service.create(spec)
    wait_for(lambda: service.exit_status(handle) is not None)
    assert service.exit_status(handle) == 0, Path(spec.stderr).read_text()
    assert json.loads(Path(spec.stdout).read_text()) == {"null": "ok", "zero": "EPERM"}
    service.stop(handle)
    service.remove(handle)


def test_stop_kills_a_daemonized_grandchild(
    service: Backend, slot: tuple[int, int], prefix: str, tmp_path: Path
) -> None:
    spec = make_spec(tmp_path, slot, py(DAEMONIZER), name=f"{prefix}-daemonizer")
    handle = service.create(spec)
    wait_for(lambda: Path(spec.stdout).read_text().endswith("\n"))
    grandchild = int(Path(spec.stdout).read_text())
    wait_for(lambda: service.members(handle) == {handle.main_pid, grandchild})
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
    service: Backend, slot: tuple[int, int], prefix: str, tmp_path: Path
) -> None:
    handle = service.create(make_spec(tmp_path, slot, SLEEPERS, name=f"{prefix}-idle"))
    stray = subprocess.Popen(
        ["setpriv", f"--reuid={slot[0]}", f"--regid={slot[1]}", "--clear-groups", "sleep", "1000"]
    )
    try:
        wait_for(lambda: status(stray.pid)["Uid"].split()[0] == str(slot[0]))
        assert stray.pid not in service.members(handle)
        service.stop(handle)
        assert service.members(handle) == set()
        assert not service.is_idle(handle, slot[0])
    finally:
        stray.kill()
        stray.wait()
    assert service.is_idle(handle, slot[0])
    service.remove(handle)


def test_adopt_after_restart_finds_and_stops_the_service(
    service: Backend, slot: tuple[int, int], prefix: str, tmp_path: Path
) -> None:
    name = f"{prefix}-adopted"
    original = service.create(make_spec(tmp_path, slot, SLEEPERS, name=name))
    wait_for(lambda: len(service.members(original)) == 3)
    before = service.members(original)
    again = restarted(service, original)
    adopted = again.adopt(name)
    assert adopted is not None
    assert adopted.cgroups == original.cgroups
    assert adopted.main_pid is None
    assert again.members(adopted) == before
    again.stop(adopted)
    assert again.members(adopted) == set()
    # systemd remembers the status; the cgroupfs backend knows none after a restart.
    expected = -signal.SIGKILL if service.backend == "systemd" else None
    assert again.exit_status(adopted) == expected
    again.remove(adopted)
    assert again.adopt(name) is None
    assert service.adopt(f"{prefix}-never-created") is None
    service.stop(original)  # (cgroupfs) reaps the old daemon's main process


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
    service.stop(handle)
    service.remove(handle)


@needs_systemd
def test_stopping_the_daemon_unit_stops_the_work(
    slot: tuple[int, int], prefix: str, tmp_path: Path
) -> None:
    """BindsTo=: a stopped (or crashed, or restarted) daemon leaves no attempt running,
    and nothing starts it again."""
    daemon = f"{prefix}-daemon.service"
    subprocess.run(["systemd-run", "--quiet", f"--unit={daemon}", "/bin/sleep", "1000"], check=True)
    try:
        bound = SystemdService(bind_to=daemon)
        handle = bound.create(make_spec(tmp_path, slot, SLEEPERS, name=f"{prefix}-bound"))
        wait_for(lambda: len(bound.members(handle)) == 3)
        subprocess.run([SYSTEMCTL, "kill", "--signal=SIGKILL", daemon], check=True)
        wait_for(lambda: bound.members(handle) == set())
        wait_for(lambda: show(f"{handle.name}.service", "ActiveState")["ActiveState"] != "active")
        subprocess.run([SYSTEMCTL, "reset-failed", daemon], check=False)
        assert bound.members(handle) == set()
        bound.stop(handle)
        bound.remove(handle)
    finally:
        subprocess.run([SYSTEMCTL, "stop", daemon], check=False)
        subprocess.run([SYSTEMCTL, "reset-failed", daemon], check=False, capture_output=True)
        _purge_units(f"{prefix}-bound")


def test_outputs_environment_and_descriptors_are_exactly_the_spec(
    service: Backend, slot: tuple[int, int], prefix: str, tmp_path: Path
) -> None:
    os.environ["FICC_T_SVC_LEAK"] = "daemon-secret"
    try:
        script = "env; ls /proc/self/fd >&2"
        spec = make_spec(tmp_path, slot, ["/bin/sh", "-c", script], name=f"{prefix}-env")
        handle = service.create(spec)
        wait_for(lambda: service.exit_status(handle) is not None)
    finally:
        del os.environ["FICC_T_SVC_LEAK"]
    shown = dict(line.split("=", 1) for line in Path(spec.stdout).read_text().splitlines())
    shown.pop("PWD", None)  # the shell adds it
    assert shown == spec.environment
    assert Path(spec.stderr).read_text().split() == ["0", "1", "2", "3"]  # ls's own dir fd
    for path in (spec.stdout, spec.stderr):
        info = os.stat(path)
        assert (info.st_uid, info.st_mode & 0o777) == (0, 0o600)
    service.stop(handle)
    service.remove(handle)


def test_a_program_that_cannot_be_executed_is_a_start_refusal(
    service: Backend, slot: tuple[int, int], prefix: str, tmp_path: Path
) -> None:
    spec = make_spec(tmp_path, slot, ["/nonexistent/program"], name=f"{prefix}-noexec")
    with pytest.raises(HostError) as refused:
        service.create(spec)
    assert refused.value.code == "service_start"
    assert "No such file" in refused.value.message
    assert service.adopt(spec.name) is None


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
    assert not service.is_idle(handle, slot[0])
    service.stop(handle)
    assert service.members(handle) == set()
    service.remove(handle)
    assert service.is_idle(handle, slot[0])


def test_parallel_creates_from_threads_stay_separate(
    service: Backend, slot: tuple[int, int], prefix: str, tmp_path: Path
) -> None:
    specs = [make_spec(tmp_path, slot, SLEEPERS, name=f"{prefix}-p{i}") for i in range(4)]
    with ThreadPoolExecutor(4) as pool:
        handles = list(pool.map(service.create, specs))
    for handle in handles:
        wait_for(lambda handle=handle: len(service.members(handle)) == 3)
    trees = [service.members(h) for h in handles]
    assert len(set().union(*trees)) == 12
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(service.stop, handles))
    for handle in handles:
        assert service.exit_status(handle) == -signal.SIGKILL
        service.remove(handle)
    assert service.is_idle(handles[0], slot[0])


#: What runc 1.1 writes into every container's device cgroup; a v1 child can never
#: allow more than its parent, so the enclosing service must allow at least this.
RUNC_BASELINE = [
    DeviceRule("/dev/null", 1, 3),
    DeviceRule("/dev/zero", 1, 5),
    DeviceRule("/dev/full", 1, 7),
    DeviceRule("/dev/random", 1, 8),
    DeviceRule("/dev/urandom", 1, 9),
    DeviceRule("/dev/tty", 5, 0),
    DeviceRule(os.path.realpath("/dev/ptmx"), 5, 2),  # a link to pts/ptmx in containers
    DeviceRule("/dev/net/tun", 10, 200),
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
    name = f"localhost/ficc-t-sd:{os.getpid()}"
    subprocess.run(["podman", "import", "--quiet", str(tarball), name], check=True)
    try:
        yield name
    finally:
        subprocess.run(["podman", "rmi", "--force", name], check=False, capture_output=True)


def test_podman_payload_lands_under_the_supervisor_cgroup_and_stop_empties_it(
    service: Backend, slot: tuple[int, int], prefix: str, tmp_path: Path, busybox_image: str
) -> None:
    """The real runtime, rootful as the design's recipe runs it, under --cgroup-parent."""
    root_supervisor = restarted_as_root(service)
    container = f"{prefix}-podman"
    spec = make_spec(tmp_path, slot, ["/bin/true"], name=f"{prefix}-podman")
    parent = root_supervisor.planned_supervisor_cgroup(spec.name)
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
        devices=[*RUNC_BASELINE, DeviceRule("/dev/pts", 136, None)],
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
        memberships = systemd.cgroups.parse_proc_cgroup(Path(f"/proc/{pid}/cgroup").read_text())
        for key in handle.cgroups:
            controllers = frozenset() if key == "unified" else frozenset(key.split(","))
            assert memberships[controllers].startswith(parent + "/"), key
        root_supervisor.stop(handle)
        assert root_supervisor.members(handle) == set()
        root_supervisor.remove(handle)
        assert all_nodes_gone(handle)
        assert root_supervisor.adopt(spec.name) is None
    finally:
        subprocess.run(["podman", "rm", "--force", container], check=False, capture_output=True)


def restarted_as_root(service: Backend) -> Backend:
    """The same backend allowing a root supervisor (a rootful runtime)."""
    if isinstance(service, SystemdService):
        return SystemdService(bind_to_own_unit=False, stop_timeout=15.0, root_supervisor=True)
    base = service.planned_supervisor_cgroup("x").split("/")[1]
    return CgroupfsService(base, stop_timeout=15.0, root_supervisor=True)


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


@needs_systemd
def test_a_unit_that_fails_to_start_is_refused_and_cleaned_up(
    slot: tuple[int, int], prefix: str, tmp_path: Path
) -> None:
    """The working directory exists but the slot account cannot enter it: systemd's
    start job fails, and the failed unit must not stay loaded."""
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    backend = SystemdService(bind_to_own_unit=False)
    spec = msgspec.structs.replace(
        make_spec(tmp_path, slot, SLEEPERS, name=f"{prefix}-badcwd"), cwd=str(private)
    )
    try:
        with pytest.raises(HostError) as refused:
            backend.create(spec)
        assert refused.value.code == "service_start"
        assert backend.adopt(spec.name) is None
        assert not loaded(spec.name)
    finally:
        _purge_units(prefix)


@needs_systemd
def test_a_unit_created_by_someone_else_is_never_touched(
    slot: tuple[int, int], prefix: str, tmp_path: Path
) -> None:
    name = f"{prefix}-foreign"
    subprocess.run(
        ["systemd-run", "--quiet", f"--unit={name}.service", "/bin/sleep", "1000"], check=True
    )
    backend = SystemdService(bind_to_own_unit=False)
    try:
        with pytest.raises(HostError) as refused:
            backend.create(make_spec(tmp_path, slot, SLEEPERS, name=name))
        assert refused.value.code == "service_exists"
        with pytest.raises(HostError) as foreign:
            backend.adopt(name)  # so no stop or remove can ever reach it
        assert foreign.value.code == "service_handle"
        assert show(f"{name}.service", "ActiveState")["ActiveState"] == "active"
    finally:
        subprocess.run([SYSTEMCTL, "stop", f"{name}.service"], check=False)


def test_a_fractional_cpu_quota_reads_back_exactly(
    service: Backend, slot: tuple[int, int], prefix: str, tmp_path: Path
) -> None:
    """1.555 CPUs: systemd prints 1.555000s, the kernel holds a 155500 us quota."""
    spec = make_spec(tmp_path, slot, SLEEPERS, name=f"{prefix}-cpu", cpu_millis=1555)
    handle = service.create(spec)
    assert service.controls(handle).cpu_millis == 1555
    service.stop(handle)
    service.remove(handle)


@needs_systemd
def test_the_start_gate_works_under_the_daemons_umask(
    slot: tuple[int, int], prefix: str, tmp_path: Path
) -> None:
    """The shipped unit sets UMask=0077; the gate's directories and socket must still
    let the slot account's shim in (and nobody else list them)."""
    runtime = Path(f"/run/{prefix}")
    backend = SystemdService(bind_to_own_unit=False, runtime_dir=str(runtime / "gates"))
    previous = os.umask(0o077)
    try:
        handle = backend.create(make_spec(tmp_path, slot, SLEEPERS, name=f"{prefix}-umask"))
    finally:
        os.umask(previous)
    try:
        assert handle.main_pid in backend.members(handle)
        for directory in (runtime, runtime / "gates"):
            assert os.stat(directory).st_mode & 0o777 == 0o711
        assert os.listdir(runtime / "gates") == []  # each gate is removed after use
    finally:
        backend.stop(handle)
        backend.remove(handle)
        shutil.rmtree(runtime)


@pytest.mark.soak
def test_create_stop_remove_cycles_leave_no_trace(
    service: Backend, slot: tuple[int, int], prefix: str, tmp_path: Path
) -> None:
    for index in range(200 if SOAK else 5):
        spec = make_spec(tmp_path, slot, SLEEPERS, name=f"{prefix}-cycle-{index}")
        handle = service.create(spec)
        wait_for(lambda handle=handle: len(service.members(handle)) == 3)
        service.stop(handle)
        service.remove(handle)
        assert all_nodes_gone(handle)
        assert service.adopt(spec.name) is None
        assert service.is_idle(handle, slot[0])


@needs_systemd
def test_a_failing_main_process_takes_its_tree_down_under_systemd(
    slot: tuple[int, int], prefix: str, tmp_path: Path
) -> None:
    """A backend difference: a unit whose main process fails is stopped by systemd
    (KillMode=control-group), so its leftovers die at once; the status stays readable."""
    backend = SystemdService(bind_to_own_unit=False)
    script = "sleep 1000 >/dev/null 2>&1 & echo $!; exit 7"
    spec = make_spec(tmp_path, slot, ["/bin/sh", "-c", script], name=f"{prefix}-fails")
    try:
        handle = backend.create(spec)
        wait_for(lambda: backend.exit_status(handle) is not None)
        assert backend.exit_status(handle) == 7
        wait_for(lambda: backend.members(handle) == set())
        leftover = int(Path(spec.stdout).read_text())
        wait_for(
            lambda: not Path(f"/proc/{leftover}").exists() or status(leftover)["State"][0] == "Z"
        )
        assert backend.exit_status(handle) == 7
        backend.stop(handle)
        backend.remove(handle)
        assert backend.adopt(spec.name) is None
    finally:
        _purge_units(prefix)


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
