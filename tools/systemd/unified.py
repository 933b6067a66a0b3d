"""Boot Debian's systemd as PID 1 in UNIFIED cgroup mode; test or capture its device programs.

    python tools/systemd/unified.py [-- PYTEST ARGS]   # the unified-mode tests
    python tools/systemd/unified.py --capture          # rewrite the captured test vectors

This machine is a v1/v2 hybrid, so `run.py`'s container boots systemd in hybrid mode,
where device policies are v1 `devices.list` files. To see what systemd does on a pure
cgroup v2 host (a BPF_PROG_TYPE_CGROUP_DEVICE program per unit), the container here
starts with an entrypoint that replaces the v1 mounts Podman set up at /sys/fs/cgroup
by a cgroup2 mount and then execs /sbin/init, which then finds a unified hierarchy.

Why that is safe on the host: the container has a private cgroup namespace, and
runc (cgroup v1 mode, cgroupfs manager) puts it in libpod_parent/libpod-<id> of the
host's v2 tree too, so the container's v2 root is that dedicated sub-cgroup, never
the host's v2 root (checked before the container starts: `check_own_v2_root`). The v2 tree has
no controllers here (all are bound to v1), which does not matter for device programs:
they attach to any v2 cgroup and the kernel enforces them. Memory, pids and CPU
limits cannot be read back in this container, so the tests exercise the device
read-back directly (systemd_devices.read_back), not a whole SystemdService.create.

Everything else is `run.py`'s: its wheelhouse, install, flock (one container at a
time), stale-container removal and cleanup, which removes libpod-<id> (with the
init.scope, system.slice... systemd made below it) from every hierarchy.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time

import rootfs  # sibling scripts, not a package
import run

ROOT = run.ROOT
TESTS = ["packages/ficc-executor-host/tests/service/test_systemd_devices_unified.py"]
VECTORS = ROOT / "packages/ficc-executor-host/tests/vectors/systemd_devices.json"
LABEL = "ficc-systemd-unified-test"
INSIDE = run.INSIDE
ENTRYPOINT = [
    "/bin/sh",
    "-c",
    "umount -R /sys/fs/cgroup && mount -t cgroup2 -o nsdelegate cgroup2 /sys/fs/cgroup "
    "&& exec /sbin/init",
]

# Runs inside the container (its venv has ficc-executor-host): one transient unit per
# case with the backend's device properties, its program read back from the kernel.
CAPTURE = """
import json, subprocess, sys
from ficc.execution.host.service import bpfdevices
from ficc.execution.host.service.interface import DeviceRule
from ficc.execution.host.service.units import device_allow, parse_proc_devices

classes = parse_proc_devices(open("/proc/devices").read())
cases = json.loads(sys.argv[1])
for case in cases:
    unit = "ficc-capture-" + case["name"] + ".service"
    rules = [DeviceRule(**d) for d in case["devices"]]
    case["device_allow"] = device_allow(rules, classes)
    argv = ["systemd-run", "--quiet", "--unit", unit, "-p", "Slice=ficc.slice",
            "-p", "Delegate=yes", "-p", "DevicePolicy=strict",
            "-p", "StandardInput=file:/etc/hostname"]
    argv += ["--property=DeviceAllow=" + value for value in case["device_allow"]]
    subprocess.run(argv + ["--", "/bin/sleep", "600"], check=True)
    try:
        flags, ids = bpfdevices.query("/sys/fs/cgroup/ficc.slice/" + unit)
        assert len(ids) == 1, (unit, ids)
        prog_type, raw = bpfdevices.xlated(ids[0])
        case.update(attach_flags=flags, prog_type=prog_type, xlated=raw.hex())
    finally:
        subprocess.run(["systemctl", "stop", unit], check=True)
version = subprocess.run(["systemctl", "--version"], capture_output=True, text=True).stdout
print(json.dumps({"systemd": version.splitlines()[0], "cases": cases}))
"""

# What is captured: the backend's DeviceAllow= for these prepared devices.
CASES = [
    {"name": "mknod-only", "devices": []},
    {"name": "null", "devices": [{"path": "/dev/null", "major": 1, "minor": 3}]},
    {
        "name": "null-zero-pts",
        "devices": [
            {"path": "/dev/null", "major": 1, "minor": 3},
            {"path": "/dev/zero", "major": 1, "minor": 5},
            {"path": "/dev/pts", "major": 136, "minor": None},
        ],
    },
    {
        "name": "many",
        "devices": [
            {"path": "/dev/null", "major": 1, "minor": 3},
            {"path": "/dev/zero", "major": 1, "minor": 5},
            {"path": "/dev/full", "major": 1, "minor": 7},
            {"path": "/dev/random", "major": 1, "minor": 8},
            {"path": "/dev/urandom", "major": 1, "minor": 9},
            {"path": "/dev/tty", "major": 5, "minor": 0},
            {"path": "/dev/pts", "major": 136, "minor": None},
        ],
    },
]


def _log(message: str) -> None:
    print(f"systemd-unified: {message}", file=sys.stderr, flush=True)


def boot(image: str, name: str) -> None:
    """`run.boot`'s container with the unified entrypoint. It is created and initialised
    (runc has put its first process in its cgroups) but only started once
    `check_own_v2_root` has confirmed where its v2 root is."""
    argv = [*run.PODMAN, "create", "--name", name, "--label", LABEL, "--privileged"]
    argv += ["--cgroupns=private", "--systemd=always", "--network=none"]
    argv += ["--volume=/var/lib/containers", "--stop-signal=SIGRTMIN+3"]
    argv += ["--ulimit", "nofile=4096:4096", "--ulimit", "nproc=4096:4096"]
    argv += ["--entrypoint", json.dumps(ENTRYPOINT), image]
    subprocess.run(argv, check=True, stdout=subprocess.DEVNULL)
    subprocess.run([*run.PODMAN, "init", name], check=True, stdout=subprocess.DEVNULL)
    check_own_v2_root(name)
    subprocess.run([*run.PODMAN, "start", name], check=True, stdout=subprocess.DEVNULL)
    state = run._wait_for_boot(name)
    if state not in {"running", "degraded"}:
        raise SystemExit(f"systemd in {name} did not boot in unified mode: state {state!r}")
    fs_type = _inside(name, "stat", "-f", "-c", "%T", "/sys/fs/cgroup").strip()
    if fs_type != "cgroup2fs":
        raise SystemExit(f"{name}: /sys/fs/cgroup is {fs_type}, not cgroup2: not unified")


def check_own_v2_root(name: str) -> None:
    """The container's first process is in a v2 cgroup named for the container, which
    its private cgroup namespace makes the root systemd will see: never the host's."""
    pid = subprocess.run(
        [*run.PODMAN, "inspect", "--format", "{{.State.Pid}}", name],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    lines = pathlib.Path(f"/proc/{pid}/cgroup").read_text().splitlines()
    v2 = next((line.split(":", 2)[2] for line in lines if line.startswith("0::")), "/")
    if run._container_id(name) not in v2.rsplit("/", 1)[-1]:
        raise SystemExit(f"{name}: its v2 cgroup is {v2}, not its own; refusing to boot it")
    _log(f"the container's v2 root is the host's {v2}")


def _inside(name: str, *argv: str) -> str:
    command = [*run.PODMAN, "exec", name, *argv]
    return subprocess.run(command, check=True, capture_output=True, text=True).stdout


def install_tests(name: str) -> None:
    target = f"{INSIDE}/unified"
    _inside(name, "mkdir", "-p", f"{target}/vectors", f"{target}/service")
    for test in TESTS:  # in service/, as in the repository: it reads ../vectors
        subprocess.run(
            [*run.PODMAN, "cp", str(ROOT / test), f"{name}:{target}/service/"], check=True
        )
    subprocess.run([*run.PODMAN, "cp", str(VECTORS), f"{name}:{target}/vectors/"], check=True)


def run_tests(name: str, pytest_args: list[str]) -> int:
    command = [*run.PODMAN, "exec", "--env", "FICC_SYSTEMD_UNIFIED_REQUIRED=1"]
    command += ["--workdir", INSIDE, name, f"{INSIDE}/venv/bin/pytest", "-q", "-ra"]
    command += ["-p", "no:cacheprovider", f"{INSIDE}/unified", *pytest_args]
    return subprocess.run(command, check=False).returncode


def capture(name: str) -> None:
    """Rewrite VECTORS from the programs this container's systemd generates."""
    python = f"{INSIDE}/venv/bin/python"
    captured = json.loads(_inside(name, python, "-I", "-c", CAPTURE, json.dumps(CASES)))
    captured["kernel"] = os.uname().release
    captured["regenerate"] = "python tools/systemd/unified.py --capture (as root)"
    VECTORS.parent.mkdir(parents=True, exist_ok=True)
    VECTORS.write_text(json.dumps(captured, indent=1) + "\n")
    _log(f"wrote {len(captured['cases'])} captured programs to {VECTORS}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--capture", action="store_true", help="rewrite the test vectors")
    parser.add_argument("pytest_args", nargs="*", help="extra pytest arguments (after --)")
    args = parser.parse_args()
    started = time.monotonic()
    code = 0
    with tempfile.TemporaryDirectory(prefix="ficc-systemd-unified-") as scratch:
        wheelhouse = pathlib.Path(scratch) / "wheels"
        run.build_wheelhouse(wheelhouse)
        name = f"ficc-systemd-unified-{hashlib.sha256(os.urandom(8)).hexdigest()[:8]}"
        with run._one_at_a_time():
            image = rootfs.ensure_image()
            _remove_stale()
            before = run.systemd_tree_units()
            try:
                boot(image, name)
                _log(f"booted after {time.monotonic() - started:.1f}s")
                run.install(name, wheelhouse)
                if args.capture:
                    capture(name)
                else:
                    install_tests(name)
                    code = run_tests(name, args.pytest_args)
            finally:
                run.remove_container(name, before)
                shutil.rmtree(wheelhouse, ignore_errors=True)
    _log(f"total {time.monotonic() - started:.1f}s (exit {code})")
    return code


def _remove_stale() -> None:
    listed = subprocess.run(
        [*run.PODMAN, "ps", "--all", "--filter", f"label={LABEL}", "--format", "{{.Names}}"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.split()
    for stale in listed:
        _log(f"removing container {stale} left by an earlier run")
        run.remove_container(stale)


if __name__ == "__main__":
    sys.exit(main())
