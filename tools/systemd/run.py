"""Boot real systemd as PID 1 in a privileged Podman container and run tests in it.

    python tools/systemd/run.py [-- PYTEST ARGS]

This workplace's machines have no systemd as PID 1, so the
systemd backend's behaviour tests run in a container that boots Debian's systemd:

1. the image comes from `rootfs.py` (debootstrap, cached by its recipe);
2. the project's wheels (and the integration suite's test provider) are built here
   with hatchling, and their dependencies plus pytest are downloaded here as wheels:
   the container has no network (`--network=none`), so it installs them offline
   into a venv (the test kit, ficc-testkit, among them); the integration suite's crash
   loop is copied too;
3. the container boots (`--privileged --cgroupns=private --systemd=always`) and we
   wait for `systemctl is-system-running --wait`: `running`, or `degraded` (some unit
   that needs real hardware failed; the failed units are printed) is accepted;
4. pytest runs inside with FICC_SYSTEMD_REQUIRED=1, so a behaviour test that would
   skip for lack of systemd fails instead;
5. the container is removed, and so are the cgroups its systemd left behind on the
   host: any named for the container (libpod_parent/libpod-<id>) and the unit
   cgroups (init.scope, system.slice, ...) that appeared at the root of the host's
   name=systemd tree during the run (see `systemd_tree_units`).

One such container runs at a time (an flock on LOCK); a container left by a crashed
earlier run (label `ficc-systemd-test`) is removed first. Cleanup runs on failure too.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator

import rootfs  # a sibling script, not a package

ROOT = pathlib.Path(__file__).resolve().parents[2]
INSIDE = "/opt/ficc"
# ficc-testkit: the markers, driver and host the tests use; never released.
PACKAGES = ["ficc-protocol", "ficc-provider-sdk", "ficc-executor-host", "ficc-testkit"]
TEST_FILES = [
    "packages/ficc-executor-host/tests/service/test_service_behaviour.py",
    "packages/ficc-executor-host/tests/service/test_service_systemd.py",
    "tools/systemd/tests/test_daemon_unit.py",
]
# Copied next to the tests: (source in the repository, directory inside the container).
# The unit file comes with the ficc-executor-host wheel (share/ficc-executor-host/).
SUPPORT_FILES = [
    ("packages/ficc-executor-host/tests/service_support.py", "tests"),
    # The crash loop that test_daemon_unit.py runs with supervisor=systemd.
    ("tests-integration/test_crash_daemon.py", "tests-integration"),
]
# The Podman end-to-end suite, run there with supervisor=systemd (the daemon as the
# shipped unit): copied with the integration suite's layout, so its paths hold inside.
E2E_FILES = [
    "tests-integration/conftest.py",
    "tests-integration/podman_support.py",
    "tests-integration/test_podman_e2e.py",
    "tests-integration/test_podman_disk.py",
    "tools/testimage/build.py",
    "packages/ficc-provider-podman/packaging/podman.conf",
    "docs/examples/podman-first-job.json",
]
E2E_TESTS = [
    f"{INSIDE}/tests-integration/test_podman_e2e.py",
    f"{INSIDE}/tests-integration/test_podman_disk.py",
]
LOOP_DEVICES = 64
"""Loop device nodes made on the host before the container starts: a privileged
container gets a copy of the host's /dev as it is then, and the tests inside
loop-mount their slot filesystems."""
TEST_PROVIDER = "tests-integration/providers/ficc-test-provider"
PODMAN_PROVIDER = "packages/ficc-provider-podman"
REQUIREMENTS = [
    "msgspec>=0.23,<1",
    "pybase64>=1.4.1,<2",
    "uvloop>=0.19,<1",
    "psutil>=5.9,<8",
    "pytest>=8",
]
LABEL = "ficc-systemd-test"
LOCK = pathlib.Path("/run/ficc-systemd-run.lock")
PODMAN = rootfs.HOST_PODMAN
UNIT_SUFFIXES = (".scope", ".slice", ".service")


def _host_systemd_tree() -> str | None:
    """/sys/fs/cgroup/systemd when it is a v1 name=systemd mount and PID 1 is not
    systemd (only then can the tree's units be the container's leftovers)."""
    if pathlib.Path("/proc/1/comm").read_text().strip() == "systemd":
        return None
    for line in pathlib.Path("/proc/self/mountinfo").read_text().splitlines():
        fields, _, tail = line.partition(" - ")
        if tail.split()[:1] == ["cgroup"] and "name=systemd" in tail.split()[-1].split(","):
            return fields.split()[4]
    return None


HOST_SYSTEMD_TREE = _host_systemd_tree()
BOOT_TIMEOUT = 120


def _log(message: str) -> None:
    print(f"systemd-run: {message}", file=sys.stderr, flush=True)


def _run(argv: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, text=True, **kwargs)  # type: ignore[call-overload,no-any-return]  # noqa: PLW1510


@contextlib.contextmanager
def _one_at_a_time() -> Iterator[None]:
    with LOCK.open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def build_wheelhouse(target: pathlib.Path) -> None:
    """The project's wheels (hatchling) and their dependencies (pip download)."""
    for name in PACKAGES:
        _run(
            [sys.executable, "-m", "hatchling", "build", "-t", "wheel", "-d", str(target)],
            cwd=ROOT / "packages" / name,
            check=True,
            stdout=subprocess.DEVNULL,
        )
    # The Podman provider's build hook compiles its static barrier: built here, since
    # the container has no compiler (podman_support takes it from FICC_PODMAN_WHEELS).
    for provider in (TEST_PROVIDER, PODMAN_PROVIDER):
        wheel = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation"]
        _run([*wheel, "-w", str(target), str(ROOT / provider)], check=True)
    download = [sys.executable, "-m", "pip", "download", "-q", "--only-binary=:all:"]
    download += ["--dest", str(target), *REQUIREMENTS]
    _run(download, check=True)


def _container_id(name: str) -> str:
    return _run(
        [*PODMAN, "inspect", "--format", "{{.Id}}", name],
        check=True,
        capture_output=True,
    ).stdout.strip()


def remove_container(name: str, before: frozenset[str] | None = None) -> None:
    """podman rm, then the cgroups the container's systemd left on the host: those
    named for the container, and (given the snapshot `before` the boot) the unit
    cgroups it created at the root of the host's name=systemd tree."""
    try:
        ident = _container_id(name)
    except subprocess.CalledProcessError:
        ident = ""
    remove = [*PODMAN, "rm", "--force", "--volumes", "--time", "10", name]
    _run(remove, check=False, capture_output=True)
    left = remove_leftover_cgroups(ident) if ident else []
    if before is not None:
        left += remove_new_units(before)
    if left:
        _log(f"could not remove leftover cgroups (they still hold tasks): {left}")


def systemd_tree_units() -> frozenset[str]:
    """Unit-named directories at the root of the host's name=systemd hierarchy.

    Inside the container that hierarchy is mounted from the host's root (its mount
    root is `/../..`), so the container's systemd creates init.scope, system.slice...
    there. Only meaningful where the host's PID 1 is not systemd; elsewhere these
    are the host's own units and nothing is ever removed.
    """
    if HOST_SYSTEMD_TREE is None:
        return frozenset()
    return frozenset(
        entry.name
        for entry in os.scandir(HOST_SYSTEMD_TREE)
        if entry.is_dir(follow_symlinks=False) and entry.name.endswith(UNIT_SUFFIXES)
    )


def remove_new_units(before: frozenset[str]) -> list[str]:
    if HOST_SYSTEMD_TREE is None:
        return []
    left = []
    for name in sorted(systemd_tree_units() - before):
        top = os.path.join(HOST_SYSTEMD_TREE, name)
        for directory, _subdirs, _files in os.walk(top, topdown=False):
            try:
                os.rmdir(directory)
            except FileNotFoundError:
                pass
            except OSError:
                left.append(directory)
    return left


def remove_leftover_cgroups(ident: str) -> list[str]:
    """rmdir (deepest first) every empty cgroup named for the container, in every
    hierarchy; returns those that could not be removed (they still hold tasks)."""
    mounts = [
        line.split()[4]
        for line in pathlib.Path("/proc/self/mountinfo").read_text().splitlines()
        if line.partition(" - ")[2].split()[:1] in (["cgroup"], ["cgroup2"])
    ]
    left = []
    for mount in mounts:
        for top in _container_dirs(pathlib.Path(mount), ident):
            for directory, _subdirs, _files in os.walk(top, topdown=False):
                try:
                    os.rmdir(directory)
                except FileNotFoundError:
                    pass
                except OSError:
                    left.append(directory)
    return left


def _container_dirs(mount: pathlib.Path, ident: str) -> list[str]:
    """Directories whose name carries the container ID, at most two levels down
    (podman's cgroupfs manager puts them in libpod_parent/libpod-<id>)."""
    found = []
    for depth in ("*", "*/*"):
        for path in mount.glob(depth):
            if ident in path.name and path.is_dir() and not path.is_symlink():
                found.append(str(path))
    return found


def remove_stale() -> None:
    listed = _run(
        [*PODMAN, "ps", "--all", "--filter", f"label={LABEL}", "--format", "{{.Names}}"],
        check=True,
        capture_output=True,
    ).stdout.split()
    for name in listed:
        _log(f"removing container {name} left by an earlier run")
        remove_container(name)


def ensure_loop_devices(count: int = LOOP_DEVICES) -> None:
    """/dev/loop0 .. loop<count-1> on the host (LOOP_CTL_ADD; an existing one is fine)."""
    loop_ctl_add = 0x4C80
    fd = os.open("/dev/loop-control", os.O_RDWR | os.O_CLOEXEC)
    try:
        for index in range(count):
            with contextlib.suppress(FileExistsError):
                fcntl.ioctl(fd, loop_ctl_add, index)
    finally:
        os.close(fd)


def boot(image: str, name: str) -> None:
    ensure_loop_devices()
    _run(
        [
            *PODMAN,
            "run",
            "-d",
            "--name",
            name,
            "--label",
            LABEL,
            "--privileged",
            "--cgroupns=private",
            "--systemd=always",
            "--network=none",
            # Nested Podman's storage cannot be overlay on the container's overlay root.
            "--volume=/var/lib/containers",
            "--stop-signal=SIGRTMIN+3",
            "--ulimit",
            "nofile=4096:4096",
            "--ulimit",
            "nproc=4096:4096",
            image,
        ],
        check=True,
        stdout=subprocess.DEVNULL,
    )
    state = _wait_for_boot(name)
    if state == "degraded":
        failed = _run(
            [*PODMAN, "exec", name, "systemctl", "--failed", "--plain", "--no-legend"],
            check=False,
            capture_output=True,
        ).stdout.strip()
        _log(f"systemd is degraded (accepted); failed units: {failed or 'none listed'}")
    elif state != "running":
        raise SystemExit(f"systemd in {name} did not boot: state {state!r}")


def _wait_for_boot(name: str) -> str:
    """`systemctl is-system-running --wait`, retried while systemd's bus is not up yet
    (right after `podman run` the exec may come before PID 1 listens)."""
    deadline = time.monotonic() + BOOT_TIMEOUT
    wait = [*PODMAN, "exec", name, "timeout", str(BOOT_TIMEOUT)]
    wait += ["systemctl", "is-system-running", "--wait"]
    while True:
        state = _run(wait, check=False, capture_output=True).stdout.strip()
        if state not in {"", "offline", "unknown"} or time.monotonic() >= deadline:
            return state
        time.sleep(0.1)


def install(name: str, wheelhouse: pathlib.Path) -> None:
    _run([*PODMAN, "exec", name, "mkdir", "-p", f"{INSIDE}/tests"], check=True)
    _run([*PODMAN, "cp", str(wheelhouse), f"{name}:{INSIDE}/wheels"], check=True)
    for test in TEST_FILES:
        _run([*PODMAN, "cp", str(ROOT / test), f"{name}:{INSIDE}/tests/"], check=True)
    for source, directory in SUPPORT_FILES:
        inside = f"{INSIDE}/{directory}"
        _run([*PODMAN, "exec", name, "mkdir", "-p", inside], check=True)
        _run([*PODMAN, "cp", str(ROOT / source), f"{name}:{inside}/"], check=True)
    for source in E2E_FILES:
        inside = f"{INSIDE}/{pathlib.PurePath(source).parent}"
        _run([*PODMAN, "exec", name, "mkdir", "-p", inside], check=True)
        _run([*PODMAN, "cp", str(ROOT / source), f"{name}:{inside}/"], check=True)
    _run([*PODMAN, "exec", name, "python3", "-m", "venv", f"{INSIDE}/venv"], check=True)
    pip = [*PODMAN, "exec", name, f"{INSIDE}/venv/bin/pip", "install", "-q", "--no-index"]
    # psutil: the integration suite's conftest (it kills what a failed test left).
    pip += [
        "--find-links",
        f"{INSIDE}/wheels",
        "ficc-executor-host",
        "ficc-testkit",
        "pytest",
        "psutil",
    ]
    _run(pip, check=True)


def run_tests(name: str, pytest_args: list[str]) -> int:
    command = [*PODMAN, "exec", "--env", "FICC_SYSTEMD_REQUIRED=1", "--workdir", INSIDE]
    command += [
        "--env",
        "FICC_E2E_BACKENDS=systemd",
        "--env",
        f"FICC_PODMAN_WHEELS={INSIDE}/wheels",
    ]
    if os.environ.get("FICC_SOAK") == "1":
        command += ["--env", "FICC_SOAK=1"]
    command += [name, f"{INSIDE}/venv/bin/pytest", "-q", "-ra", "-p", "no:cacheprovider"]
    # The marker is declared in each package's pyproject, which is not copied in.
    command += ["-o", "markers=soak: long reliability loops (FICC_SOAK=1)"]
    command += [f"{INSIDE}/tests", *E2E_TESTS, *pytest_args]
    return _run(command, check=False).returncode


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("pytest_args", nargs="*", help="extra pytest arguments (after --)")
    args = parser.parse_args()
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="ficc-systemd-") as scratch:
        wheelhouse = pathlib.Path(scratch) / "wheels"
        build_wheelhouse(wheelhouse)
        _log(f"wheelhouse ready after {time.monotonic() - started:.1f}s")
        suffix = hashlib.sha256(os.urandom(8)).hexdigest()[:8]
        name = f"ficc-systemd-{suffix}"
        with _one_at_a_time():
            image = rootfs.ensure_image()
            _log(f"image {image} ready after {time.monotonic() - started:.1f}s")
            remove_stale()
            before = systemd_tree_units()
            try:
                mark = time.monotonic()
                boot(image, name)
                _log(f"systemd booted in {time.monotonic() - mark:.1f}s")
                install(name, wheelhouse)
                mark = time.monotonic()
                code = run_tests(name, args.pytest_args)
                _log(f"tests took {time.monotonic() - mark:.1f}s (exit {code})")
            finally:
                remove_container(name, before)
                shutil.rmtree(wheelhouse, ignore_errors=True)
    _log(f"total {time.monotonic() - started:.1f}s")
    return code


if __name__ == "__main__":
    sys.exit(main())
