"""The VM lane: a production host (Debian 12, systemd as PID 1, one unified cgroup v2
tree with every controller) under qemu, deployed by the docs, tested, rebooted and
power-cut.

    python tools/vm/run.py [--suites ARGS | --ci] [--cuts N] [--seed S]

1. `image.py` gives the cached disk image, kernel and initramfs; the project's wheels,
   their dependencies and the test image are built here (the guest has no network).
2. Boot 1 (`lane`): the guest checks its cgroup tree, runs the pytest suites asked
   for (`--suites`, inside the guest against real v2 controllers; their daemons are
   the shipped unit, so they run before the deployment), deploys the daemon exactly
   as docs/operations.md says (wheels, accounts, `provision-slot --persist unit`, the
   configuration, the shipped unit, `systemctl enable --now`, `smoke-test`), sets up
   attempts in each state (admitted with a partly staged input, running, finished,
   released) and reboots with `systemctl reboot`.
3. Boot 2 (`verify-churn`): the guest checks what boot 1 acknowledged (every
   admission and input offset is there, the running attempt is `unknown`, cleanup is
   confirmed, the slots were mounted before the daemon started, the next job in each
   slot runs), sets the state up again and churns jobs and ficc-hoststate transitions;
   at a seeded random moment the host kills qemu: a power cut.
4. Each further boot checks the cut before it; `--cuts N` repeats the cut N times.
   The last boot (`verify`) checks and powers off.

Everything the guest acknowledged reaches the host on the serial console as
`FICC-ACK` lines the moment the reply arrives, and the next boot is handed them; the
guest's checks print `FICC-FAIL` lines. The console of each boot is kept in the run
directory (printed at the end). Every wait is bounded (`--boot-timeout`,
`--phase-timeout`: the guest runs Python about 20 times slower than this machine);
a timeout fails the lane with a message saying which boot and phase. qemu is always
killed at the end and nothing is mounted on the host.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import pathlib
import random
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from types import ModuleType
from typing import TextIO

import image

ROOT = pathlib.Path(__file__).resolve().parents[2]
QEMU = "qemu-system-x86_64"


def _load(path: pathlib.Path, name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


SYSTEMD_RUN = _load(ROOT / "tools" / "systemd" / "run.py", "ficc_systemd_run")
GUEST_FILES = [
    *SYSTEMD_RUN.E2E_FILES,
    "tools/vm/guest/driver.sh",
    "tools/vm/guest/phases.sh",
    "tools/vm/guest/deploy.sh",
    "tools/vm/guest/write_config.py",
    "tools/vm/guest/scenario.py",
    "tools/vm/guest/hoststate_loop.py",
    "tools/vm/guest/console.py",
    "tools/systemd/tests/test_daemon_unit.py",
    "tools/vm/tests/test_v2_enforcement.py",
    "tests-integration/test_podman_usage.py",
    "tests-integration/test_crash_daemon.py",
]
DEFAULT_SUITES = " ".join([
    "tools/vm/tests/test_v2_enforcement.py",
    "tests-integration/test_podman_usage.py",
    "tests-integration/test_podman_e2e.py",
    "tests-integration/test_podman_disk.py",
    "tools/systemd/tests/test_daemon_unit.py",
])  # fmt: skip
"""What a production host must prove, each on both backends: the limits enforced and
read back (and refused when changed behind the host's back), the usage figures read
from v2 files, the Podman end-to-end and disk suites, and the daemon as its shipped
unit (watchdog, SIGKILL and SIGSTOP of the daemon, `systemctl freeze`, which systemd
252 refuses on a hybrid tree, the lease reaper's own unit, the crash loop)."""
CI_SUITES = " ".join([
    "tools/vm/tests/test_v2_enforcement.py",
    "tests-integration/test_podman_e2e.py::"
    "test_an_allowed_device_opens_and_an_unlisted_one_is_refused",
    "tools/systemd/tests/test_daemon_unit.py::"
    "test_a_limit_raised_behind_the_hosts_back_is_refused_by_the_gate[systemd]",
    "tools/systemd/tests/test_daemon_unit.py::"
    "test_a_frozen_daemon_unit_leaves_the_lease_reaper_enforcing",
])  # fmt: skip
"""The part of DEFAULT_SUITES that CI runs (`--ci`, with `supervisor=systemd` only, the
production host's): every kernel limit, the gate's v2 checks (the device programs of
the live payload's cgroup, a limit raised behind the host's back) and the frozen
daemon. The rest takes most of an hour in the guest; it runs on this machine's host and
in the systemd container in CI, and in the guest with `nox -s vm`."""
GUEST_REQUIREMENTS = ["prometheus_client>=0.17"]
"""The guest's test venv needs, beyond the daemon's wheelhouse (the usage suite parses
the metrics text as Prometheus would)."""


PODMAN_CPU_US = 12_000_000
"""What Podman's own CPU time in a job's service may be under software emulation
(measured at 5 to 7 s a run; 0.25 s on the host), for the usage suite's bound."""

PAYLOAD_SLACK_US = 2_000_000
"""What a payload's own cgroup may count beyond its processes' `times` under software
emulation (the shell's start and the barrier's last polls; 0.04 s on the host), for
the usage suite's bound."""

LEASE_MS = 60_000
"""The held attempt's lease in the daemon unit's reaper test (its start takes seconds
here)."""

CRASH_KILLS = 10
"""SIGKILLs of the daemon unit's crash loop in the guest (50 on the hosts of CI: each
restart of the daemon takes seconds here)."""


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def _log(message: str) -> None:
    print(f"vm: {message}", file=sys.stderr, flush=True)


@dataclass
class Boot:
    """One boot of the guest: its console, what it acknowledged and what failed."""

    number: int
    phase: str
    lines: list[str] = field(default_factory=list)
    acks: list[str] = field(default_factory=list)
    torn: list[str] = field(default_factory=list)
    """ACK lines the power cut tore (incomplete, so never acknowledged to the host)."""
    figures: list[dict[str, object]] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    exit_code: int | None = None
    cut: bool = False
    seconds: float = 0.0


class Guest:
    """qemu on the run's disk; one `boot` at a time, each ending in qemu's exit."""

    def __init__(self, cache: pathlib.Path, work: pathlib.Path, args: argparse.Namespace) -> None:
        self.cache = cache
        self.work = work
        self.args = args
        self.disk = work / "disk.img"
        self.inputs = work / "inputs"
        self.boots: list[Boot] = []

    def inputs_image(self, acks: list[str]) -> pathlib.Path:
        (self.inputs / "acks.jsonl").write_text("".join(line + "\n" for line in acks))
        archive = self.work / "inputs.tar"
        with tarfile.open(archive, "w") as tar:
            tar.add(self.inputs, arcname=".")
        size = archive.stat().st_size
        with archive.open("ab") as file:  # a disk is whole sectors
            file.write(b"\0" * (-size % 4096 + 4096))
        return archive

    def command(self, phase: str, inputs: pathlib.Path) -> list[str]:
        append = "console=ttyS0 root=/dev/vda rw systemd.unified_cgroup_hierarchy=1 quiet"
        return [
            QEMU, "-accel", "tcg,thread=multi", "-smp", str(self.args.smp),
            "-m", str(self.args.memory),
            "-kernel", str(self.cache / "vmlinuz"), "-initrd", str(self.cache / "initrd.img"),
            "-append", f"{append} ficc.phase={phase}",
            "-drive", f"file={self.disk},format=raw,if=virtio",
            "-drive", f"file={inputs},format=raw,if=virtio,readonly=on",
            "-nic", "none", "-display", "none", "-monitor", "none", "-serial", "stdio",
            "-no-reboot",
        ]  # fmt: skip

    def boot(self, phase: str, acks: list[str], cut_after: Callable[[], float] | None) -> Boot:
        """Boot with `phase`; with `cut_after`, kill qemu that many seconds after the
        guest opens its cut window (a power cut)."""
        record = Boot(len(self.boots) + 1, phase)
        self.boots.append(record)
        inputs = self.inputs_image(acks)
        log = (self.work / f"console-{record.number}-{phase}.log").open("w")
        started = time.monotonic()
        qemu = subprocess.Popen(
            self.command(phase, inputs), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True, errors="replace", bufsize=1,
        )  # fmt: skip
        window = threading.Event()
        reader = threading.Thread(target=self._read, args=(qemu, record, log, window, started))
        reader.start()
        try:
            limit = self.args.boot_timeout + self.args.phase_timeout
            if cut_after is not None:
                while not window.wait(1.0):
                    if qemu.poll() is not None or time.monotonic() - started > limit:
                        raise LaneError(record, "the guest never opened its cut window")
                delay = cut_after()
                _log(f"boot {record.number}: cutting the power {delay:.1f} s into the window")
                time.sleep(delay)  # the cut's moment is the point, not a race to win
                qemu.kill()
                record.cut = True
            try:
                qemu.wait(timeout=max(1.0, limit - (time.monotonic() - started)))
            except subprocess.TimeoutExpired:
                raise LaneError(record, f"no power-off within {limit:.0f} s") from None
        finally:
            if qemu.poll() is None:
                qemu.kill()
                qemu.wait()
            reader.join()
            log.close()
            record.seconds = time.monotonic() - started
        _log(f"boot {record.number} ({phase}) ended after {record.seconds:.0f} s"
             f"{' (power cut)' if record.cut else ''}, phase exit {record.exit_code}")  # fmt: skip
        return record

    @staticmethod
    def _read(
        qemu: subprocess.Popen[str],
        record: Boot,
        log: TextIO,
        window: threading.Event,
        started: float,
    ) -> None:
        """Keep the console (each line stamped with the seconds since qemu started) and
        pick out the markers."""
        assert qemu.stdout is not None
        for raw in qemu.stdout:
            line = raw.rstrip("\r\n")
            log.write(f"{time.monotonic() - started:8.1f} {line}\n")
            record.lines.append(line)
            if line.startswith("FICC-ACK "):
                ack = line.removeprefix("FICC-ACK ")
                (record.acks if _is_json(ack) else record.torn).append(ack)
                continue
            print(f"vm[{record.number}]| {line}", flush=True)
            if line.startswith("FICC-FIGURE "):
                record.figures.append(json.loads(line.removeprefix("FICC-FIGURE ")))
            elif line.startswith("FICC-FAIL "):
                record.failures.append(line.removeprefix("FICC-FAIL "))
            elif line.startswith("FICC-VM cut-window"):
                window.set()
            elif line.startswith(f"FICC-VM phase {record.phase} exit "):
                record.exit_code = int(line.rsplit(" ", 1)[1])


class LaneError(Exception):
    def __init__(self, boot: Boot, message: str) -> None:
        super().__init__(f"boot {boot.number} ({boot.phase}): {message}")


def prepare_inputs(target: pathlib.Path, args: argparse.Namespace) -> None:
    """The wheels, the test image, the guest's scripts and tests, the suites to run."""
    wheels = target / "wheels"
    SYSTEMD_RUN.build_wheelhouse(wheels)
    download = [sys.executable, "-m", "pip", "download", "-q", "--only-binary=:all:"]
    subprocess.run([*download, "--dest", str(wheels), *GUEST_REQUIREMENTS], check=True)
    subprocess.run(
        [sys.executable, "-m", "hatchling", "build", "-t", "wheel", "-d", str(wheels)],
        cwd=ROOT / "packages" / "ficc-hoststate", check=True, stdout=subprocess.DEVNULL,
    )  # fmt: skip
    built = subprocess.run(
        [sys.executable, str(ROOT / "tools/testimage/build.py"), "--out", str(target / "image")],
        check=True, capture_output=True, text=True,
    ).stdout  # fmt: skip
    _log(f"test image {built.strip()}")
    for name in GUEST_FILES:
        destination = target / name
        destination.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, destination)
    (target / "pytest-args").write_text(args.suites + "\n" if args.suites else "")
    (target / "pytest-env").write_text(
        f"FICC_E2E_BACKENDS={args.backends} FICC_TEST_PODMAN_CPU_US={PODMAN_CPU_US}"
        f" FICC_TEST_PAYLOAD_SLACK_US={PAYLOAD_SLACK_US}"
        f" FICC_TEST_LEASE_MS={LEASE_MS} FICC_CRASH_KILLS={CRASH_KILLS}"
        f" FICC_CRASH_TESTS={image.GUEST_DIR}/tests-integration/test_crash_daemon.py\n"
    )


def run_lane(args: argparse.Namespace) -> int:
    started = time.monotonic()
    cache = image.ensure()
    _log(f"image ready ({cache}) after {time.monotonic() - started:.0f} s")
    work = pathlib.Path(tempfile.mkdtemp(prefix="ficc-vm-", dir=args.workdir))
    guest = Guest(cache, work, args)
    subprocess.run(["cp", "--sparse=always", str(cache / "root.img"), str(guest.disk)], check=True)
    prepare_inputs(guest.inputs, args)
    _log(f"inputs ready after {time.monotonic() - started:.0f} s; run directory {work}")
    rng = random.Random(args.seed)
    failures: list[str] = []
    try:
        boot = guest.boot("lane", [], None)
        failures += _judge(boot, expect_exit=True)
        acks = boot.acks
        for cut in range(args.cuts):
            boot = guest.boot("verify-churn", acks, lambda: rng.uniform(0, args.window))
            failures += _judge(boot, expect_exit=False)
            _log(f"cut {cut + 1}/{args.cuts}: checked {len(acks)} acknowledged items before it;"
                 f" {len(boot.acks)} acknowledged in this boot before the cut,"
                 f" {len(boot.torn)} torn by it")  # fmt: skip
            acks = boot.acks
        boot = guest.boot("verify", acks, None)
        failures += _judge(boot, expect_exit=True)
    except LaneError as error:
        failures.append(str(error))
    finally:
        _summary(guest, failures, time.monotonic() - started)
        if not args.keep:  # the consoles stay: they are the run's record
            guest.disk.unlink(missing_ok=True)
            (work / "inputs.tar").unlink(missing_ok=True)
            shutil.rmtree(guest.inputs, ignore_errors=True)
    return 1 if failures else 0


def _judge(boot: Boot, *, expect_exit: bool) -> list[str]:
    found = [f"boot {boot.number} ({boot.phase}): {f}" for f in boot.failures]
    if expect_exit and boot.exit_code != 0:
        found.append(f"boot {boot.number} ({boot.phase}): phase exit {boot.exit_code}")
    if not expect_exit and not boot.cut:
        found.append(f"boot {boot.number} ({boot.phase}): ended before the power cut")
    if len(boot.torn) > (1 if boot.cut else 0):  # only the cut may tear, and one line
        found.append(f"boot {boot.number} ({boot.phase}): torn ACK lines {boot.torn}")
    return found


def _summary(guest: Guest, failures: list[str], seconds: float) -> None:
    _log(f"lane time {seconds:.0f} s; run directory {guest.work} (consoles)")
    for boot in guest.boots:
        for figure in boot.figures:
            _log(f"boot {boot.number} figure: {json.dumps(figure)}")
    cuts = sum(1 for b in guest.boots if b.cut)
    _log(f"boots {len(guest.boots)}, power cuts {cuts}, failures {len(failures)}")
    _log(_totals([f for boot in guest.boots for f in boot.figures]))
    for failure in failures:
        _log(f"FAILED: {failure}")


def _totals(figures: list[dict[str, object]]) -> str:
    """What every boot's checks covered, summed (the guest's FICC-FIGURE lines)."""
    sums: dict[str, int] = {}
    for figure in figures:
        flat = {**figure, **_dict(figure.get("verify")), **_dict(figure.get("hoststate"))}
        for key in ("attempts", "unacknowledged", "failures", "inputs_checked",
                    "next_jobs_succeeded", "slots", "acknowledged", "lost"):  # fmt: skip
            value = flat.get(key)
            if isinstance(value, int):
                sums[key] = sums.get(key, 0) + value
    return (
        f"checked after the boots: {sums.get('attempts', 0)} acknowledged attempts"
        f" ({sums.get('failures', 0)} failures), {sums.get('unacknowledged', 0)} admitted"
        f" but unacknowledged, {sums.get('inputs_checked', 0)} input offsets,"
        f" next jobs {sums.get('next_jobs_succeeded', 0)}/{sums.get('slots', 0)};"
        f" hoststate {sums.get('acknowledged', 0)} acknowledged operations,"
        f" {sums.get('lost', 0)} lost"
    )


def _dict(value: object) -> dict[str, object]:
    return value if isinstance(value, dict) else {}


def _stop(number: int, _frame: object) -> None:
    raise SystemExit(f"stopped by signal {number}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--suites", default=DEFAULT_SUITES, help="pytest arguments for the guest")
    parser.add_argument("--ci", action="store_true",
                        help="CI's part: CI_SUITES, with supervisor=systemd only")  # fmt: skip
    parser.add_argument("--backends", default="systemd,cgroupfs", help="FICC_E2E_BACKENDS")
    parser.add_argument("--cuts", type=int, default=1, help="power cuts (default 1)")
    parser.add_argument("--seed", type=int, default=int.from_bytes(os.urandom(4), "big"))
    parser.add_argument("--window", type=float, default=30.0,
                        help="the cut falls this many seconds into the churn, at most")  # fmt: skip
    parser.add_argument("--memory", type=int, default=2048, help="guest MiB")
    parser.add_argument("--smp", type=int, default=2,
                        help="guest CPUs")  # fmt: skip
    parser.add_argument("--boot-timeout", type=float,
                        default=float(os.environ.get("FICC_VM_BOOT_TIMEOUT", "600")))  # fmt: skip
    parser.add_argument("--phase-timeout", type=float,
                        default=float(os.environ.get("FICC_VM_PHASE_TIMEOUT", "5400")))  # fmt: skip
    parser.add_argument("--workdir", default="/var/tmp")
    parser.add_argument("--keep", action="store_true", help="keep the run's disk image and inputs")
    args = parser.parse_args()
    if args.ci:
        args.suites, args.backends = CI_SUITES, "systemd"
    if shutil.which(QEMU) is None:
        raise SystemExit(f"{QEMU} is missing: apt-get install qemu-system-x86")
    _log(f"seed {args.seed}")
    # A stopped lane (SIGTERM, or SIGINT even when started in the background) still
    # kills qemu and prints what its boots checked so far.
    for number in (signal.SIGTERM, signal.SIGINT):
        signal.signal(number, _stop)
    return run_lane(args)


if __name__ == "__main__":
    sys.exit(main())
