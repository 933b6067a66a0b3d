"""What every system-service test module shares: the slot account, both backends
(each cleaned up after its test), specs, the programs the tests run as the slot
account, and small helpers that read the live result.

The fixtures (`slot`, `prefix`, `busybox_image`) are defined once, here, and each
service test module binds the ones it uses to a module name (`slot =
service_support.slot`), which is how pytest finds them without a conftest. The modules:
test_service_behaviour.py (the shared behaviour suite, parametrized over both
backends), test_service_cgroupfs.py and test_service_systemd.py (what only one
backend has). tools/systemd/run.py copies this module next to the suites it runs
under real systemd, where FICC_SYSTEMD_REQUIRED=1 turns a would-be skip into a
failure (checked when this module is imported).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from ficc.execution.host.service import (
    CgroupfsService,
    DeviceRule,
    ServiceHandle,
    ServiceLimits,
    ServiceSpec,
)
from ficc.execution.host.service.systemd import SystemdService
from ficc.execution.host.service.units import parse_show
from ficc_testkit.accounts import temporary_account
from ficc_testkit.services import purge_cgroups

PYTHON = "/usr/bin/python3"
SYSTEMCTL = "/usr/bin/systemctl"
SOAK = os.environ.get("FICC_SOAK") == "1"
#: dash opens /dev/null for background jobs, so most tests allow exactly that device.
NULL = DeviceRule("/dev/null", 1, 3)
SLEEPERS = ["/bin/sh", "-c", "sleep 1000 & sleep 1000 & wait"]

Backend = CgroupfsService | SystemdService


# --- where the systemd backend can run --------------------------------------------------


def pid1_is_systemd() -> bool:
    try:
        return Path("/proc/1/comm").read_text().strip() == "systemd"
    except OSError:
        return False


UNDER_SYSTEMD = os.geteuid() == 0 and pid1_is_systemd()
SYSTEMD_REASON = (
    "needs root and systemd as PID 1; run `python tools/systemd/run.py`, which boots "
    "systemd in a privileged Podman container and runs these tests there"
)
if os.environ.get("FICC_SYSTEMD_REQUIRED") == "1" and not UNDER_SYSTEMD:
    raise RuntimeError("FICC_SYSTEMD_REQUIRED=1 but this is not root under systemd as PID 1")
needs_systemd = pytest.mark.skipif(not UNDER_SYSTEMD, reason=SYSTEMD_REASON)


# --- fixtures -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def slot() -> Iterator[tuple[int, int]]:
    """A real system account of our own, so parallel runs never see each other's tasks."""
    with temporary_account("ficc-t-") as account:
        yield account.uid, account.gid


@pytest.fixture
def prefix() -> str:
    """A unique service-name prefix (unit names are global on the host)."""
    return f"ficc-work-t{secrets.token_hex(3)}"


@pytest.fixture(scope="module")
def busybox_image(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A registry-free image: static busybox imported as a rootfs tarball."""
    root = tmp_path_factory.mktemp("rootfs")
    (root / "bin").mkdir()
    (root / "bin" / "busybox").write_bytes(Path("/usr/bin/busybox").read_bytes())
    (root / "bin" / "busybox").chmod(0o755)
    tarball = root.parent / "rootfs.tar"
    subprocess.run(["tar", "-C", str(root), "-cf", str(tarball), "."], check=True)
    name = f"localhost/ficc-t-svc:{os.getpid()}-{secrets.token_hex(3)}"
    subprocess.run(["podman", "import", "--quiet", str(tarball), name], check=True)
    try:
        yield name
    finally:
        subprocess.run(["podman", "rmi", "--force", name], check=False, capture_output=True)


# --- the backends, cleaned up after each test -------------------------------------------


@contextlib.contextmanager
def cgroupfs_backend() -> Iterator[CgroupfsService]:
    """A cgroupfs backend under a base of its own; on exit every service under that
    base is stopped and removed, then the base itself."""
    base = f"ficc-t-svc-{os.getpid()}-{secrets.token_hex(3)}"
    backend = CgroupfsService(base, stop_timeout=15.0)
    try:
        yield backend
    finally:
        purge_cgroups(backend, base)


@contextlib.contextmanager
def systemd_backend(prefix: str) -> Iterator[SystemdService]:
    """A systemd backend (not bound to a unit: the tests are not one); on exit every
    unit whose name starts with `prefix` is stopped and removed."""
    backend = SystemdService(bind_to_own_unit=False, stop_timeout=15.0)
    try:
        yield backend
    finally:
        purge_units(prefix)


def purge_units(prefix: str) -> None:
    """Stop and remove every unit of ours whose name starts with `prefix`."""
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


def restarted(service: Backend, *, root_supervisor: bool = False) -> Backend:
    """A new backend object over the same base or slice, as after a daemon restart
    (optionally allowing a root supervisor, for a rootful runtime)."""
    if isinstance(service, SystemdService):
        return SystemdService(
            bind_to_own_unit=False, stop_timeout=15.0, root_supervisor=root_supervisor
        )
    base = service.planned_supervisor_cgroup("x").split("/")[1]
    return CgroupfsService(base, stop_timeout=15.0, root_supervisor=root_supervisor)


# --- specs and observations -----------------------------------------------------------


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


def member_count_is(service: Backend, handle: ServiceHandle, count: int) -> Callable[[], bool]:
    return lambda: len(service.members(handle)) == count


def py(code: str) -> list[str]:
    return [PYTHON, "-I", "-S", "-c", code]


def status(pid: int) -> dict[str, str]:
    lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    return {k: v.strip() for k, _, v in (line.partition(":") for line in lines)}


def slot_tasks(uid: int) -> list[int]:
    """Live (non-zombie) processes of `uid`; PID 1 may reap orphans lazily."""
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            fields = status(int(entry))
        except FileNotFoundError:
            continue
        if fields["Uid"].split()[0] == str(uid) and not fields["State"].startswith("Z"):
            found.append(int(entry))
    return found


def all_nodes_gone(handle: ServiceHandle) -> bool:
    return not any(os.path.exists(p) for p in handle.cgroups.values())


def node(handle: ServiceHandle, controller: str) -> Path:
    """The service's node in the hierarchy that holds `controller`."""
    return Path(next(p for k, p in handle.cgroups.items() if controller in k.split(",")))


def show(unit: str, *keys: str) -> dict[str, str]:
    """What `systemctl show` reports for `unit`."""
    argv = [SYSTEMCTL, "show", unit, *(f"--property={k}" for k in keys)]
    result = subprocess.run(argv, capture_output=True, text=True, check=False)
    return parse_show(result.stdout)


def loaded(name: str) -> bool:
    return show(f"{name}.service", "LoadState")["LoadState"] == "loaded"


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
    DeviceRule("/dev/pts", 136, None),
]


# --- programs run as the slot account ---------------------------------------------------

# Tries 20 forks; prints how many succeeded and how many the pids limit refused.
FORKER = """
import json, os
r, w = os.pipe()
ok = failed = 0
for _ in range(20):
    try:
        pid = os.fork()
    except BlockingIOError:
        failed += 1
        continue
    if pid == 0:
        os.close(w)
        os.read(r, 1)
        os._exit(0)
    ok += 1
os.write(1, json.dumps({"ok": ok, "failed": failed}).encode())
os.close(w)
for _ in range(ok):
    os.wait()
"""


# Opens /dev/null and /dev/zero; prints what the device policy allowed.
OPENER = """
import json, os
result = {}
for name, flags in (("null", os.O_WRONLY), ("zero", os.O_RDONLY)):
    try:
        os.close(os.open("/dev/" + name, flags))
        result[name] = "ok"
    except OSError as error:
        result[name] = __import__("errno").errorcode[error.errno]
os.write(1, json.dumps(result).encode())
"""


# Double-forks a setsid grandchild (prints its PID) that outlives its parent.
DAEMONIZER = """
import os, time
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        os.write(1, b"%d\\n" % os.getpid())
        time.sleep(1000)
    os._exit(0)
os.wait()
time.sleep(1000)
"""
