"""What only the systemd system service has: its pure parts, and what real systemd
does with its units.

The behaviour both backends share is tested once, for both, in
test_service_behaviour.py. Here: unit names and properties, parsing what systemctl
prints, binding attempt units to the daemon's unit, units that fail to start or that
someone else created, the start gate under the daemon's umask, and systemd stopping
a unit whose main process failed. The tests marked `needs_systemd` need root and
systemd as PID 1; on this workplace's machines they run inside a privileged Podman
container that boots Debian's systemd (`python tools/systemd/run.py`, which sets
FICC_SYSTEMD_REQUIRED=1 so they cannot skip there). Elsewhere they skip and say why.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import msgspec
import pytest

import service_support
from ficc.execution.host.core.errors import HostError
from ficc.execution.host.service import DeviceRule, reaper, systemd, units
from ficc.execution.host.service.systemd import SystemdService
from ficc_testkit.waits import wait_for
from service_support import (
    NULL,
    SLEEPERS,
    SYSTEMCTL,
    loaded,
    make_spec,
    needs_systemd,
    purge_units,
    show,
    status,
)

pytestmark = pytest.mark.root("the systemd backend runs real units")

# The shared fixtures, defined once in service_support.
slot = service_support.slot
prefix = service_support.prefix


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


def test_unit_and_cgroup_names() -> None:
    assert units.unit_name("ficc-work-i1-a7") == "ficc-work-i1-a7.service"
    assert units.unit_cgroup("ficc.slice", "ficc-work-i1-a7") == (
        "/ficc.slice/ficc-work-i1-a7.service"
    )
    with pytest.raises(HostError) as refused:
        units.unit_name("../escape")
    assert refused.value.code == "service_spec"


def test_cpu_quota_is_exact_to_a_thousandth_of_a_cpu() -> None:
    assert units.cpu_quota(250) == "25%"
    assert units.cpu_quota(1500) == "150%"
    assert units.cpu_quota(255) == "25.5%"
    assert units.cpu_quota(10) == "1%"


def test_proc_devices_character_section_only() -> None:
    classes = units.parse_proc_devices(PROC_DEVICES)
    assert classes[136] == ["pts"]
    assert classes[4] == ["/dev/vc/0", "tty", "ttyS"]
    assert 8 not in classes
    assert 259 not in classes


def test_device_allow_matches_the_cgroupfs_allow_list() -> None:
    classes = units.parse_proc_devices(PROC_DEVICES)
    devices = [NULL, DeviceRule("/dev/dri", 226, None)]
    assert units.device_allow(devices, classes) == [
        "char-* m",
        "block-* m",
        "/dev/null rwm",
        "char-drm rwm",
    ]
    assert units.device_allow([], classes) == ["char-* m", "block-* m"]


@pytest.mark.parametrize("major", [4, 136, 240])
def test_a_whole_major_needs_a_name_of_its_own(major: int) -> None:
    """4 has several names, `pts` also names 241, 240 is not registered at all."""
    classes = units.parse_proc_devices(PROC_DEVICES)
    with pytest.raises(HostError) as refused:
        units.device_allow([DeviceRule("/dev/x", major, None)], classes)
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
    classes = units.parse_proc_devices(PROC_DEVICES)
    v1 = units.run_properties(
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
        "KillSignal=SIGKILL",
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
    v2 = units.run_properties(
        spec,
        slice_name="ficc.slice",
        bind_to=None,
        cgroup_version=2,
        classes=classes,
        stdin_file="/run/g/empty",
    )
    assert f"MemorySwapMax={16 << 20}" in v2
    assert not [p for p in v2 if p.startswith(("BindsTo", "After"))]


INSTALLATION = "0123456789abcdef0123456789abcdef"
DEADLINES = "/var/lib/ficc-executor/deadlines"


def test_the_lease_reaper_is_a_unit_of_its_own_never_bound_to_the_daemon() -> None:
    """One reaper unit per installation, in the attempts' slice, restarted by systemd
    when it fails, forgotten once it has ended (so the daemon can start it again by
    name), and tied to the daemon's unit by nothing: no stop, crash or freeze of the
    daemon reaches it, and a daemon stop never waits for it."""
    unit = units.reaper_unit(INSTALLATION)
    assert unit == f"ficc-lease-reaper-{INSTALLATION}.service"
    with pytest.raises(HostError) as refused:
        units.reaper_unit("../escape")
    assert refused.value.code == "service_spec"
    properties = units.reaper_properties(DEADLINES, slice_name="ficc.slice")
    for expected in [
        "Type=exec",
        "Slice=ficc.slice",
        "Restart=on-failure",
        "CollectMode=inactive-or-failed",
        "StandardError=journal",
        "NoNewPrivileges=yes",
        "UMask=0077",
        f"Description=ficc lease reaper of {DEADLINES}",
    ]:
        assert expected in properties
    capabilities = [p for p in properties if p.startswith("CapabilityBoundingSet=")]
    assert capabilities == ["CapabilityBoundingSet=CAP_KILL CAP_DAC_OVERRIDE CAP_DAC_READ_SEARCH"]
    ties = ("BindsTo", "PartOf", "Requisite", "Requires", "Wants", "After", "Before", "Upholds")
    assert not [p for p in properties if p.startswith(ties)]
    assert not [p for p in properties if p.startswith("RemainAfterExit")]  # no GC otherwise


def test_the_lease_reaper_unit_is_created_with_systemd_run() -> None:
    unit = units.reaper_unit(INSTALLATION)
    command = reaper.command(DEADLINES, "/opt/ficc/venv/bin/python")
    argv = units.reaper_run_argv(unit, command, directory=DEADLINES, slice_name="ficc.slice")
    split = argv.index("--")
    assert argv[:3] == ["/usr/bin/systemd-run", "--quiet", f"--unit={unit}"]
    assert argv[3:split] == [
        f"--property={p}" for p in units.reaper_properties(DEADLINES, slice_name="ficc.slice")
    ]
    assert argv[split + 1 :] == command
    assert command[:3] == ["/opt/ficc/venv/bin/python", "-I", "-S"]
    assert command[3].endswith("/ficc/execution/host/service/reaper.py")
    assert command[4] == DEADLINES
    refused_commands = [
        ["python3", "-I", "-S", command[3], DEADLINES],
        [],
        [*command[:4], "d"],
        [*command[:4], "/var/lib/$STATE/deadlines"],
        [*command[:4], "/var/lib/%i/deadlines"],
    ]
    for relative in refused_commands:
        with pytest.raises(HostError) as refused:
            units.reaper_run_argv(unit, relative, directory=DEADLINES, slice_name="ficc.slice")
        assert refused.value.code == "service_spec"


def test_time_spans_as_systemctl_prints_them() -> None:
    """Values seen from systemd 252 for CPUQuota=1%, 25.5%, 100%, 155.5%, 1000.1%."""
    assert units.parse_usec("10ms") == 10_000
    assert units.parse_usec("255ms") == 255_000
    assert units.parse_usec("1s") == 1_000_000
    assert units.parse_usec("1.555000s") == 1_555_000
    assert units.parse_usec("10.001000s") == 10_001_000
    assert units.parse_usec("7us") == 7
    assert units.parse_usec("infinity") is None
    assert units.parse_usec("1min") is None


def test_show_output_and_exit_status() -> None:
    show = units.parse_show("LoadState=loaded\nExecMainCode=2\nExecMainStatus=9\nX=a=b\n")
    assert show["X"] == "a=b"
    assert units.exit_status_of(show) == -signal.SIGKILL
    assert units.exit_status_of({**show, "ExecMainCode": "1", "ExecMainStatus": "7"}) == 7
    assert units.exit_status_of({**show, "ExecMainCode": "0"}) is None
    assert units.exit_status_of({**show, "LoadState": "not-found"}) is None


def test_own_unit_from_proc_cgroup() -> None:
    v1 = "12:pids:/system.slice/ficc.service\n1:name=systemd:/system.slice/ficc.service\n0::/\n"
    assert units.own_unit(v1) == "ficc.service"
    v2 = "0::/system.slice/ficc-executor-host.service\n"
    assert units.own_unit(v2) == "ficc-executor-host.service"
    assert units.own_unit("0::/user.slice/user-0.slice/session-3.scope\n") is None
    assert units.own_unit("0::/\n") is None


def test_the_shim_survives_systemd_command_line_expansion() -> None:
    """systemd replaces `$NAME` (and may expand `%x`) in ExecStart arguments."""
    assert "$" not in systemd._SHIM
    assert "%" not in systemd._SHIM
    compile(systemd._SHIM, "shim", "exec")


def test_binding_to_the_own_unit_needs_one() -> None:
    """Outside a service unit (a test process), the default binding is refused."""
    own = units.own_unit(Path("/proc/self/cgroup").read_text())
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


@needs_systemd
def test_the_lease_reapers_unit_runs_once_and_leaves_when_nothing_is_left(
    slot: tuple[int, int], prefix: str, tmp_path: Path
) -> None:
    """The keeper starts the reaper as its unit (systemd-run takes every property);
    a second start while it runs is refused (False), not an error; the reaper stops a
    service at its deadline from there; with nothing left it exits 0, which systemd
    does not restart, and systemd forgets the unit, so it can be started again."""
    backend = SystemdService(bind_to_own_unit=False)
    directory = str(tmp_path / "deadlines")
    unit = units.reaper_unit(prefix.removeprefix("ficc-work-"))
    keeper = reaper.Keeper(
        directory, launch=lambda command: backend.start_reaper(unit, command, directory)
    )
    name = f"{prefix}-reaped"
    handle = backend.create(make_spec(tmp_path, slot, SLEEPERS, name=name))
    try:
        wait_for(lambda: len(backend.members(handle)) == 3)
        boot_id = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        now = time.clock_gettime_ns(time.CLOCK_BOOTTIME)
        keeper.set(name, boot_id, now + 10**9, backend.planned_cgroups(name))
        state = show(unit, "ActiveState", "Slice", "Restart", "BindsTo", "MainPID")
        assert state["ActiveState"] == "active", state
        assert (state["Slice"], state["Restart"], state["BindsTo"]) == (
            "ficc.slice",
            "on-failure",
            "",
        )
        wait_for(lambda: reaper.reaper_running(directory))
        assert not backend.start_reaper(unit, reaper.command(directory), directory)
        wait_for(lambda: not backend.members(handle), "the reaper's stop")
        assert reaper.reaped(directory, name)
        keeper.drop(name)
        wait_for(
            lambda: not loaded(unit.removesuffix(".service")),
            "the reaper to leave",
            timeout=reaper.LINGER_SECONDS + 15,
        )
        assert not reaper.reaper_running(directory)
        keeper.ensure()  # started again by the same name
        wait_for(lambda: reaper.reaper_running(directory))
    finally:
        subprocess.run([SYSTEMCTL, "stop", unit], check=False)
        backend.stop(handle)
        backend.remove(handle)


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
        purge_units(f"{prefix}-bound")


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
        purge_units(prefix)


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
        purge_units(prefix)
