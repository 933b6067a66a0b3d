"""systemd's device program under real systemd 252 in UNIFIED cgroup mode.

tools/systemd/unified.py runs this module inside a container where Debian's systemd is
PID 1 with cgroup2 at /sys/fs/cgroup (FICC_SYSTEMD_UNIFIED_REQUIRED=1 there, so a
missing prerequisite fails instead of skipping). Elsewhere every test skips, saying why.

The units get the device properties of the systemd backend (`device_allow`,
`DevicePolicy=strict`, `Delegate=yes`, the backend's slice); the program systemd
attaches is read back through `systemd_devices.read_back`, and the kernel's
enforcement is observed from inside the unit. That v2 tree has no controllers (they
are bound to v1 on the host), so memory, pids and CPU limits cannot be read back and
the whole backend must refuse to run here, which is tested too.
"""

from __future__ import annotations

import errno
import json
import os
import pwd
import secrets
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ficc.execution.host.core.errors import HostError
from ficc.execution.host.gate import checks as gate
from ficc.execution.host.gate import reader as gate_reader
from ficc.execution.host.linux import evidence as evidencelib
from ficc.execution.host.service import accounting, bpfdevices, cgroups, systemd_devices
from ficc.execution.host.service.interface import (
    DeviceAccess,
    DeviceRule,
    ServiceLimits,
    ServiceSpec,
)
from ficc.execution.host.service.systemd import SystemdService
from ficc.execution.host.service.units import (
    SLICE,
    device_allow,
    parse_proc_devices,
    run_properties,
    unit_name,
)

pytestmark = pytest.mark.root("loading device programs needs root")

REQUIRED = os.environ.get("FICC_SYSTEMD_UNIFIED_REQUIRED") == "1"
VECTORS = json.loads((Path(__file__).parents[1] / "vectors" / "systemd_devices.json").read_text())
CASES = {case["name"]: case for case in VECTORS["cases"]}
NULL = DeviceRule("/dev/null", 1, 3)
ZERO = DeviceRule("/dev/zero", 1, 5)
# Waits for a byte on the FIFO (argv[1]) so the policy is read back first, then opens.
OPENER = """
import json, os, sys
open(sys.argv[1]).read(1)
result = {}
for name, flags in (("null", os.O_WRONLY), ("zero", os.O_RDONLY)):
    try:
        os.close(os.open("/dev/" + name, flags))
        result[name] = "ok"
    except OSError as error:
        result[name] = __import__("errno").errorcode[error.errno]
os.write(1, json.dumps(result).encode())
"""


def _missing() -> str | None:
    """Why this is not systemd in unified mode, or None."""
    if Path("/proc/1/comm").read_text().strip() != "systemd":
        return "PID 1 is not systemd"
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        fields, _, tail = line.partition(" - ")
        if fields.split()[4] == "/sys/fs/cgroup":
            if tail.split()[0] == "cgroup2":
                return None
            return "/sys/fs/cgroup is not a cgroup2 mount (systemd runs in hybrid/legacy mode)"
    return "nothing is mounted at /sys/fs/cgroup"


@pytest.fixture
def units() -> Iterator[list[str]]:
    """Units started by the test, stopped and forgotten afterwards."""
    reason = _missing()
    if reason is not None:
        if REQUIRED:
            pytest.fail(f"unified-mode systemd required: {reason}")
        pytest.skip(
            f"needs systemd as PID 1 in unified cgroup mode ({reason}); run "
            "`python tools/systemd/unified.py`, which boots one in a Podman container"
        )
    started: list[str] = []
    yield started
    for unit in started:
        subprocess.run(["systemctl", "stop", unit], check=False, capture_output=True)
        subprocess.run(["systemctl", "reset-failed", unit], check=False, capture_output=True)


def start(units: list[str], devices: list[DeviceRule], argv: list[str], *extra: str) -> str:
    """A transient unit with the backend's device properties; its v2 cgroup directory."""
    unit = f"ficc-t-unified-{secrets.token_hex(4)}.service"
    classes = parse_proc_devices(Path("/proc/devices").read_text())
    properties = [f"Slice={SLICE}", "Delegate=yes", "Type=exec", "RemainAfterExit=yes"]
    properties += ["DevicePolicy=strict", "StandardInput=file:/etc/hostname", *extra]
    properties += [f"DeviceAllow={value}" for value in device_allow(devices, classes)]
    command = ["systemd-run", "--quiet", f"--unit={unit}"]
    command += [f"--property={p}" for p in properties]
    units.append(unit)
    subprocess.run([*command, "--", *argv], check=True)
    return f"/sys/fs/cgroup/{SLICE}/{unit}"


def release(fifo: Path, deadline: float) -> None:
    """Write the go byte once the unit has the FIFO open (ENXIO until then)."""
    while (go := _open_writer(fifo)) is None:
        assert time.monotonic() < deadline, "the unit never opened its FIFO"
        time.sleep(0.01)
    os.write(go, b"g")
    os.close(go)


def _open_writer(fifo: Path) -> int | None:
    try:
        return os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
    except OSError as error:
        if error.errno != errno.ENXIO:
            raise
        return None


def key(rules: list[DeviceAccess]) -> list[tuple[str, int, int, str]]:
    return sorted(
        (r.kind, -1 if r.major is None else r.major, -1 if r.minor is None else r.minor, r.access)
        for r in rules
    )


def test_systemd_program_reads_back_and_the_kernel_enforces_it(units: list[str]) -> None:
    """The unit gets every property the backend gives an attempt (`run_properties`) for
    a plan allowing /dev/null: systemd's program is the captured one, it reads back as
    exactly the plan, and from inside the unit, as an unprivileged user, the kernel
    lets /dev/null open and refuses /dev/zero."""
    work = Path(f"/run/ficc-t-unified-{secrets.token_hex(4)}")
    work.mkdir(mode=0o755)
    try:
        fifo, out = work / "go", work / "out"
        os.mkfifo(fifo)
        fifo.chmod(0o666)
        argv = ["/usr/bin/python3", "-I", "-S", "-c", OPENER, str(fifo)]
        node = start_attempt(units, argv, out)
        _flags, ids = bpfdevices.query(node)
        assert bpfdevices.xlated(ids[0])[1] == bytes.fromhex(CASES["null"]["xlated"])
        assert key(systemd_devices.read_back(node)) == key(cgroups.expected_devices([NULL]))
        deadline = time.monotonic() + 30
        release(fifo, deadline)
        while not out.exists() or not out.read_text().endswith("}"):
            assert time.monotonic() < deadline, "the unit reported nothing"
            time.sleep(0.01)
        assert json.loads(out.read_text()) == {"null": "ok", "zero": "EPERM"}
    finally:
        for path in (work / "go", work / "out"):
            path.unlink(missing_ok=True)
        work.rmdir()


def start_attempt(units: list[str], argv: list[str], out: Path) -> str:
    """A unit with the backend's `run_properties` for a spec allowing /dev/null, run as
    nobody; only its output goes to `out` (the backend hands the shim its stdio)."""
    nobody = pwd.getpwnam("nobody")
    spec = ServiceSpec(
        name=f"ficc-work-t{secrets.token_hex(4)}",
        argv=argv,
        uid=nobody.pw_uid,
        gid=nobody.pw_gid,
        cwd="/",
        environment={},
        limits=ServiceLimits(
            cpu_millis=500, memory_bytes=64 << 20, swap_bytes=0, processes=32, nofile=1024
        ),
        devices=[NULL],
        stdout=str(out),
        stderr=str(out),
    )
    classes = parse_proc_devices(Path("/proc/devices").read_text())
    properties = run_properties(
        spec,
        slice_name=SLICE,
        bind_to=None,
        cgroup_version=2,
        classes=classes,
        stdin_file="/etc/hostname",
    )
    properties = [p for p in properties if not p.startswith("StandardOutput=")]
    properties.append(f"StandardOutput=file:{out}")
    unit = unit_name(spec.name)
    command = ["systemd-run", "--quiet", f"--unit={unit}"]
    command += [f"--property={p}" for p in properties]
    units.append(unit)
    subprocess.run([*command, "--", *argv], check=True)
    return f"/sys/fs/cgroup/{SLICE}/{unit}"


@pytest.mark.parametrize("case", VECTORS["cases"], ids=lambda case: case["name"])
def test_committed_vectors_are_what_this_systemd_generates(
    units: list[str], case: dict[str, Any]
) -> None:
    devices = [DeviceRule(**d) for d in case["devices"]]
    node = start(units, devices, ["/bin/sleep", "600"])
    flags, ids = bpfdevices.query(node)
    assert (flags, len(ids)) == (2, 1)
    assert bpfdevices.xlated(ids[0]) == (15, bytes.fromhex(case["xlated"]))
    assert key(systemd_devices.read_back(node)) == key(cgroups.expected_devices(devices))


def test_another_allow_list_reads_back_as_what_it_is(units: list[str]) -> None:
    """A unit allowing /dev/zero is not read as the /dev/null plan (the gate compares)."""
    node = start(units, [ZERO], ["/bin/sleep", "600"])
    rules = key(systemd_devices.read_back(node))
    assert rules == key(cgroups.expected_devices([ZERO]))
    assert rules != key(cgroups.expected_devices([NULL]))


def test_an_extra_program_on_the_unit_is_refused(units: list[str]) -> None:
    node = start(units, [NULL], ["/bin/sleep", "600"])
    bpfdevices.attach(node, [NULL])
    with pytest.raises(HostError) as refusal:
        systemd_devices.read_back(node)
    assert refusal.value.code == "service_devices_unenforceable"
    assert "2 device programs" in refusal.value.message


def test_the_backend_refuses_without_v2_controllers(units: list[str]) -> None:
    """No memory/pids/cpu controllers here: limits cannot be enforced or read back, so
    the systemd backend refuses to start at all rather than run unconfined."""
    with pytest.raises(HostError) as refusal:
        SystemdService(bind_to_own_unit=False)
    assert refusal.value.code == "service_unsupported"


def test_the_gate_judges_the_live_payload_cgroup_below_a_unit(units: list[str]) -> None:
    """The payload gate on a pure cgroup v2 host: a process in a child cgroup of the
    unit (where a runtime puts the payload, Delegate=yes) has no v1 devices cgroup;
    its evidence carries the effective device programs of its own cgroup, systemd's
    among them, and the gate accepts them for a plan of /dev/null and refuses them
    for a plan of no device."""
    node = Path(start(units, [NULL], ["/bin/sleep", "1000"]))
    unit = node.name
    pid = int(
        subprocess.run(
            ["systemctl", "show", "-p", "MainPID", "--value", unit],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    )
    (node / "payload").mkdir()
    (node / "payload" / "cgroup.procs").write_text(str(pid))
    evidence = gate_reader.read_evidence(pid)
    assert evidence.devices is None  # no v1 devices hierarchy here
    assert evidence.device_programs, evidence.device_programs_error
    decoded = [p.rules for p in evidence.device_programs if p.rules is not None]
    null = tuple(
        evidencelib.DeviceAccess(r.kind, r.major, r.minor, r.access)
        for r in cgroups.expected_devices([NULL])
    )
    assert any(sorted(map(repr, rules)) == sorted(map(repr, null)) for rules in decoded)

    def expectation(devices: tuple[evidencelib.DeviceAccess, ...]) -> gate.Expectation:
        return gate.Expectation(
            uid=1,
            gid=1,
            barrier=evidencelib.FileIdentity(0, 0),
            cgroups=(gate.CgroupRequirement("", "/"),),
            rlimits=(),
            fds=(),
            mounts=(),
            generated=(),
            devices=devices,
        )

    assert gate.check_devices(evidence, expectation(null)) == []
    refused = gate.check_devices(evidence, expectation(null[:2]))
    assert [failure.code for failure in refused] == ["gate_device"]
    subprocess.run(["systemctl", "kill", "--signal=SIGKILL", unit], check=False)


def test_usage_reads_a_real_v2_units_counters_and_omits_what_its_tree_lacks(
    units: list[str],
) -> None:
    """What a service used, read by `accounting` from a real unit's cgroup2 files: the
    CPU time the kernel keeps in every v2 cgroup; peak memory, OOM kills and peak
    processes only where their controller is enabled (not here: absent, never zero)."""
    spin = "i=0; while [ $i -lt 300000 ]; do i=$((i+1)); done; echo spun; exec sleep 600"
    out = Path(f"/run/ficc-t-usage-{secrets.token_hex(4)}")
    node = start(units, [], ["/bin/sh", "-c", spin], f"StandardOutput=file:{out}")
    layout = cgroups.Layout(2, (cgroups.Hierarchy("unified", "/sys/fs/cgroup", 2, frozenset()),))
    deadline = time.monotonic() + 60
    while not (out.exists() and out.read_text() == "spun\n"):
        assert time.monotonic() < deadline, "the unit never finished spinning"
        time.sleep(0.05)
    try:
        used = accounting.read_usage(layout, {"unified": node})
        user, system = accounting.v2_cpu(Path(node, "cpu.stat").read_text())
        assert used.cpu_user_us is not None
        assert used.cpu_system_us is not None
        assert used.cpu_user_us + used.cpu_system_us >= 100_000, used
        assert user is not None
        assert system is not None
        assert user >= used.cpu_user_us  # the kernel's own file, read after: never less
        assert system >= used.cpu_system_us
        for figure, name in (("memory_peak_bytes", "memory.peak"), ("oom_kills", "memory.events"),
                             ("processes_peak", "pids.peak")):  # fmt: skip
            present = Path(node, name).exists()
            assert (getattr(used, figure) is not None) == present, (figure, used)
    finally:
        out.unlink(missing_ok=True)
