"""cgroup v1/v2 facts: which hierarchies exist, what to write, how to read it back.

The pure part (parsing mountinfo, choosing the cgroup version, turning limits into
file writes, parsing device lists) is separated from the few file operations so it
can be unit-tested without a kernel. The file operations never follow symlinks:
cgroup filesystems have none, so meeting one means something is wrong.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Literal

from ficc.execution.host.core.codes import HostCode
from ficc.execution.host.core.errors import HostError
from ficc.execution.host.service.interface import (
    Controls,
    DeviceAccess,
    DeviceRule,
    ServiceLimits,
    ServiceSpec,
    device_key,
)

#: v1 controllers the cgroupfs backend needs; without all of them it refuses to run.
V1_REQUIRED = frozenset({"memory", "pids", "cpu", "devices", "freezer"})
#: v2 controllers needed in `cgroup.controllers` to prefer the unified hierarchy.
V2_REQUIRED = frozenset({"memory", "pids", "cpu"})
UNIFIED = "unified"
CPU_PERIOD_US = 100_000
MKNOD_KINDS: tuple[Literal["c", "b"], ...] = ("c", "b")
_MAX_CONTROL_FILE = 1 << 20


@dataclass(frozen=True)
class Hierarchy:
    """One mounted cgroup hierarchy; `key` names it in handles (`memory`, `unified`)."""

    key: str
    mount: str
    version: Literal[1, 2]
    controllers: frozenset[str]


@dataclass(frozen=True)
class Layout:
    """The hierarchies an attempt's tree spans and the version whose limits apply."""

    version: Literal[1, 2]
    hierarchies: tuple[Hierarchy, ...]

    def by_controller(self, controller: str) -> Hierarchy:
        for hierarchy in self.hierarchies:
            if controller in hierarchy.controllers:
                return hierarchy
        raise HostError(HostCode.SERVICE_UNSUPPORTED, f"no cgroup hierarchy has {controller!r}")


_NOT_CONTROLLERS = frozenset({"rw", "ro", "xattr", "clone_children", "noprefix", "cpuset_v2_mode"})


def _unescape(field: str) -> str:
    """mountinfo escapes space, tab, newline and backslash as octal `\\NNN`."""
    out, i = [], 0
    while i < len(field):
        code = field[i + 1 : i + 4]
        if field[i] == "\\" and len(code) == 3 and code.isdigit():
            out.append(chr(int(code, 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


def _v1_names(super_options: str) -> list[str]:
    """Controllers (sorted) then `name=` of a v1 mount, e.g. ['cpu', 'cpuacct']."""
    options = super_options.split(",")
    controllers = sorted(o for o in options if "=" not in o and o not in _NOT_CONTROLLERS)
    return controllers + sorted(o for o in options if o.startswith("name="))


def parse_mountinfo(text: str) -> list[Hierarchy]:
    """All cgroup (v1) and cgroup2 mounts of /proc/self/mountinfo, first mount wins."""
    found: dict[str, Hierarchy] = {}
    for line in text.splitlines():
        left, sep, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if not sep or len(fields) < 5 or len(tail) < 3:
            continue
        fstype, mount = tail[0], _unescape(fields[4])
        if fstype == "cgroup2":
            found.setdefault(UNIFIED, Hierarchy(UNIFIED, mount, 2, frozenset()))
        elif fstype == "cgroup" and (names := _v1_names(tail[2])):
            key = ",".join(names)
            found.setdefault(key, Hierarchy(key, mount, 1, frozenset(names)))
    return list(found.values())


def choose_layout(hierarchies: list[Hierarchy], v2_controllers: frozenset[str]) -> Layout:
    """Prefer cgroup v2 when its controllers are usable, else the v1 hierarchies.

    In v1 mode the tree is created in every v1 hierarchy (so no process of the attempt
    is left in the daemon's cgroup anywhere) and in the unified tree when one is
    mounted, because `cgroup.kill` there empties a whole subtree atomically.
    """
    unified = [h for h in hierarchies if h.version == 2]
    if unified and v2_controllers >= V2_REQUIRED:
        only = unified[0]
        return Layout(2, (Hierarchy(only.key, only.mount, 2, v2_controllers),))
    v1 = [h for h in hierarchies if h.version == 1]
    present = frozenset().union(*(h.controllers for h in v1)) if v1 else frozenset()
    missing = V1_REQUIRED - present
    if missing:
        raise HostError(
            HostCode.SERVICE_UNSUPPORTED,
            "this host has neither usable cgroup v2 controllers (memory, pids, cpu) nor "
            f"the cgroup v1 hierarchies {sorted(missing)}; mount them or use the "
            "systemd supervisor",
        )
    return Layout(1, tuple(v1 + unified[:1]))


def discover() -> Layout:
    """Read this host's cgroup mounts and choose the layout (see `choose_layout`)."""
    with open("/proc/self/mountinfo", encoding="utf-8") as handle:
        hierarchies = parse_mountinfo(handle.read(_MAX_CONTROL_FILE))
    controllers: frozenset[str] = frozenset()
    for hierarchy in hierarchies:
        if hierarchy.version == 2:
            try:
                controllers = frozenset(
                    read_text(os.path.join(hierarchy.mount, "cgroup.controllers")).split()
                )
            except OSError:
                controllers = frozenset()
    return choose_layout(hierarchies, controllers)


# --- what to write, and how to read it back ----------------------------------------


def page_floor(value: int) -> int:
    """The kernel stores memory limits in whole pages, rounding down."""
    page = os.sysconf("SC_PAGE_SIZE")
    return value // page * page


def cpu_quota_us(cpu_millis: int) -> int:
    """CFS quota for `cpu_millis` thousandths of a CPU per `CPU_PERIOD_US`."""
    return cpu_millis * CPU_PERIOD_US // 1000


def v1_writes(limits: ServiceLimits, memsw: bool) -> list[tuple[str, str, str]]:
    """(controller, file, value) in the order v1 accepts them.

    memory.limit_in_bytes first: memsw may never be set below the memory limit.
    """
    writes = [("memory", "memory.limit_in_bytes", str(page_floor(limits.memory_bytes)))]
    if memsw:
        total = page_floor(limits.memory_bytes) + page_floor(limits.swap_bytes)
        writes.append(("memory", "memory.memsw.limit_in_bytes", str(total)))
    writes += [
        ("pids", "pids.max", str(limits.processes)),
        ("cpu", "cpu.cfs_period_us", str(CPU_PERIOD_US)),
        ("cpu", "cpu.cfs_quota_us", str(cpu_quota_us(limits.cpu_millis))),
    ]
    return writes


def _minor(device: DeviceRule) -> str:
    return "*" if device.minor is None else str(device.minor)


def v1_device_writes(devices: list[DeviceRule]) -> list[tuple[str, str]]:
    """Close the policy, allow mknod only (see DeviceRule), then the prepared devices."""
    writes = [("devices.deny", "a")]
    writes += [("devices.allow", f"{kind} *:* m") for kind in MKNOD_KINDS]
    writes += [("devices.allow", f"c {d.major}:{_minor(d)} rwm") for d in devices]
    return writes


def v2_writes(limits: ServiceLimits) -> list[tuple[str, str]]:
    """(file, value) for the unified hierarchy; swap is separate from memory there."""
    return [
        ("memory.max", str(page_floor(limits.memory_bytes))),
        ("memory.swap.max", str(page_floor(limits.swap_bytes))),
        ("pids.max", str(limits.processes)),
        ("cpu.max", f"{cpu_quota_us(limits.cpu_millis)} {CPU_PERIOD_US}"),
    ]


def parse_limit(text: str, unlimited_at: int = 2**62) -> int | None:
    """`max` or a huge v1 value (PAGE_COUNTER_MAX in bytes) means unlimited."""
    value = text.strip()
    if value == "max":
        return None
    number = int(value)
    return None if number >= unlimited_at else number


def parse_cpu(quota: str, period: str) -> int | None:
    """CPU limit in millis from a quota/period pair (quota -1 or `max`: unlimited)."""
    if quota.strip() in {"-1", "max"}:
        return None
    return int(quota) * 1000 // int(period)


def parse_devices(text: str) -> list[DeviceAccess]:
    """Parse v1 `devices.list` (`c 1:3 rwm`, `a *:* rwm`)."""
    rules = []
    for line in text.splitlines():
        if not line.strip():
            continue
        kind, numbers, access = line.split()
        major, minor = numbers.split(":")
        if kind not in {"a", "b", "c"}:
            raise HostError(HostCode.SERVICE_LIMITS, f"unexpected device rule {line!r}")
        rules.append(
            DeviceAccess(
                kind=kind,  # type: ignore[arg-type]  # checked just above
                major=None if major == "*" else int(major),
                minor=None if minor == "*" else int(minor),
                access=access,
            )
        )
    return rules


def expected_devices(devices: list[DeviceRule]) -> list[DeviceAccess]:
    """The v1 `devices.list` that `v1_device_writes` must produce."""
    mknod = [DeviceAccess(kind, None, None, "m") for kind in MKNOD_KINDS]
    return mknod + [DeviceAccess("c", d.major, d.minor, "rwm") for d in devices]


def parse_proc_cgroup(text: str) -> dict[frozenset[str], str]:
    """/proc/PID/cgroup as {controller set: path}; the unified tree is frozenset()."""
    paths = {}
    for line in text.splitlines():
        _, controllers, path = line.split(":", 2)
        paths[frozenset(controllers.split(",")) if controllers else frozenset()] = path
    return paths


def hierarchies_not_at(
    layout: Layout, memberships: dict[frozenset[str], str], expected: str
) -> list[str]:
    """Keys of the layout's hierarchies in which the process is not at `expected`.

    /proc/PID/cgroup names v1 hierarchies by their controllers and the v2 one by an
    empty controller field, whatever controllers it has.
    """
    wrong = []
    for hierarchy in layout.hierarchies:
        key = frozenset() if hierarchy.version == 2 else hierarchy.controllers
        if memberships.get(key) != expected:
            wrong.append(hierarchy.key)
    return wrong


def check_device_node(device: DeviceRule) -> None:
    """The rule's path must be that exact character device, not a link to another
    (or, for a whole-major rule, a real directory such as /dev/pts)."""
    try:
        info = os.lstat(device.path)
    except OSError as error:
        raise HostError(
            HostCode.SERVICE_DEVICES, f"device {device.path} cannot be inspected: {error}"
        ) from error
    if device.minor is None:
        if not stat.S_ISDIR(info.st_mode):
            raise HostError(
                HostCode.SERVICE_DEVICES,
                f"{device.path} must be the directory of device class {device.major}:*",
            )
        return
    if not stat.S_ISCHR(info.st_mode):
        raise HostError(HostCode.SERVICE_DEVICES, f"{device.path} is not a character device node")
    actual = (os.major(info.st_rdev), os.minor(info.st_rdev))
    if actual != (device.major, device.minor):
        raise HostError(
            HostCode.SERVICE_DEVICES,
            f"{device.path} is device {actual[0]}:{actual[1]}, not the prepared "
            f"{device.major}:{device.minor}; fix the provider's device list",
        )


def host_has_swap() -> bool:
    with open("/proc/swaps", encoding="ascii") as handle:
        return len(handle.read(_MAX_CONTROL_FILE).splitlines()) > 1


# --- file operations ---------------------------------------------------------------


def read_text(path: str) -> str:
    """Read a small control file without following a symlink."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        return os.read(fd, _MAX_CONTROL_FILE).decode("ascii")
    finally:
        os.close(fd)


def write_text(path: str, value: str) -> None:
    """Write one value to a control file in a single write(2), as the kernel expects."""
    fd = os.open(path, os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        os.write(fd, value.encode("ascii"))
    finally:
        os.close(fd)


def is_real_dir(path: str) -> bool:
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except FileNotFoundError:
        return False


def make_dir(path: str, exclusive: bool) -> bool:
    """mkdir a cgroup with mode 0755; returns True if it was created now. Refuses a
    non-directory.

    The mode is set after mkdir because the daemon's umask (UMask=0077 in its unit)
    would leave 0700, and the slot account's rootless runtime must traverse the
    attempt's cgroups to reach its own. A shared parent that already exists gets the
    mode too: an earlier daemon may have made it 0700."""
    try:
        os.mkdir(path, 0o755)
        created = True
    except FileExistsError:
        if exclusive or not is_real_dir(path):
            raise
        created = False
    os.chmod(path, 0o755, follow_symlinks=False)  # noqa: S103  (traverse and read only)
    return created


def walk_nodes(top: str) -> Iterator[str]:
    """Every cgroup directory at or below `top`, deepest first (the rmdir order)."""
    if not is_real_dir(top):
        return
    for root, _dirs, _files in os.walk(top, topdown=False, followlinks=False):
        yield root


def node_pids(node: str) -> set[int]:
    try:
        text = read_text(os.path.join(node, "cgroup.procs"))
    except FileNotFoundError:
        return set()
    except OSError as error:
        if error.errno == errno.ENODEV:  # the cgroup was removed while reading
            return set()
        raise
    return {int(line) for line in text.split()}


def populated(node: str) -> bool:
    """Whether a v2 cgroup's subtree holds a live process (`populated 1` in its
    `cgroup.events`): one read for what `tree_pids` walks every node for. False when
    the node is gone or says 0."""
    try:
        text = read_text(os.path.join(node, "cgroup.events"))
    except FileNotFoundError:
        return False
    except OSError as error:
        if error.errno == errno.ENODEV:  # the cgroup was removed while reading
            return False
        raise
    return "populated 1" in text.splitlines()


def tree_pids(top: str) -> set[int]:
    """Every PID in the cgroup subtree rooted at `top` (empty if it does not exist)."""
    pids: set[int] = set()
    for node in walk_nodes(top):
        pids |= node_pids(node)
    return pids


def remove_tree(top: str) -> None:
    """rmdir the subtree deepest first; a missing node is already removed."""
    for node in walk_nodes(top):
        with contextlib.suppress(FileNotFoundError):
            os.rmdir(node)


def planned_controls(spec: ServiceSpec, swap: bool) -> dict[str, object]:
    """The controls the kernel should report for `spec` (`swap`: swap is limited)."""
    limits = spec.limits
    return {
        "memory_bytes": page_floor(limits.memory_bytes),
        "swap_bytes": page_floor(limits.swap_bytes) if swap else None,
        "processes": limits.processes,
        "cpu_millis": limits.cpu_millis,
        "devices": sorted(device_key(d) for d in expected_devices(spec.devices)),
    }


def kernel_controls(controls: Controls) -> dict[str, object]:
    """The controls the kernel reports, in the shape of `planned_controls`."""
    return {
        "memory_bytes": controls.memory_bytes,
        "swap_bytes": controls.swap_bytes,
        "processes": controls.processes,
        "cpu_millis": controls.cpu_millis,
        "devices": None
        if controls.devices is None
        else sorted(device_key(d) for d in controls.devices),
    }


def mismatches(planned: Mapping[str, object], actual: Mapping[str, object]) -> list[str]:
    """Every planned control that reads back otherwise, as `key: planned X, read Y`."""
    return [
        f"{key}: planned {value!r}, read {actual.get(key)!r}"
        for key, value in planned.items()
        if actual.get(key) != value
    ]
