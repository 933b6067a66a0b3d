"""What the payload gate knows about a live process (`Evidence` and its parts), as
frozen msgspec Structs, and the two refusals a reader of it raises."""

from __future__ import annotations

from typing import Annotated

import msgspec

from ficc.execution.host.core.codes import HostCode
from ficc.execution.host.core.errors import HostError
from ficc.execution.host.linux import seccomp

MAX_PROC_FILE_BYTES = 1 << 20
"""Bound for any single /proc file (mountinfo of a busy host stays far below)."""
MAX_FDS = 4096
"""More descriptors than this is not a barrier waiting for release: refuse."""
MAX_MOUNTS = 4096
MAX_PATH_COMPONENTS = 256
NAMESPACE_KINDS = ("mnt", "pid", "net", "ipc", "uts", "user", "cgroup")


# /proc/PID/limits labels -> the RLIMIT_* short names used everywhere else.
RLIMIT_LABELS = {
    "Max cpu time": "cpu",
    "Max file size": "fsize",
    "Max data size": "data",
    "Max stack size": "stack",
    "Max core file size": "core",
    "Max resident set": "rss",
    "Max processes": "nproc",
    "Max open files": "nofile",
    "Max locked memory": "memlock",
    "Max address space": "as",
    "Max file locks": "locks",
    "Max pending signals": "sigpending",
    "Max msgqueue size": "msgqueue",
    "Max nice priority": "nice",
    "Max realtime priority": "rtprio",
    "Max realtime timeout": "rttime",
}


NonNegative = Annotated[int, msgspec.Meta(ge=0)]


class Ids(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The four UID or GID fields of /proc/PID/status."""

    real: NonNegative
    effective: NonNegative
    saved: NonNegative
    filesystem: NonNegative


class Capabilities(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Capability sets as the kernel's 64-bit masks."""

    effective: NonNegative
    permitted: NonNegative
    bounding: NonNegative
    inheritable: NonNegative
    ambient: NonNegative


class Status(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    uid: Ids
    gid: Ids
    groups: tuple[NonNegative, ...]
    capabilities: Capabilities
    no_new_privs: NonNegative
    seccomp: NonNegative
    seccomp_filters: NonNegative | None
    """None on kernels that do not report the filter count."""


class Stat(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    state: str
    start_time: NonNegative
    """Clock ticks after boot; with the PID it identifies one process."""


class CgroupEntry(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    hierarchy_id: NonNegative
    controllers: tuple[str, ...]
    """Empty for the cgroup v2 line (hierarchy 0); `name=systemd` style for named v1."""
    path: str


class Rlimit(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    name: str
    soft: NonNegative | None
    """None means unlimited."""
    hard: NonNegative | None


class FileIdentity(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    dev: NonNegative
    ino: NonNegative


class FdEntry(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    fd: NonNegative
    target: str
    """readlink text, for messages only: identity comes from stat."""
    kind: str
    """One of file, dir, chr, blk, fifo, socket, link, other, unknown."""
    dev: NonNegative | None
    ino: NonNegative | None
    rdev: NonNegative | None
    flags: NonNegative | None
    """Open flags from fdinfo (octal in the kernel text)."""
    mnt_id: NonNegative | None


class Mount(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    mount_id: NonNegative
    parent_id: NonNegative
    major: NonNegative
    minor: NonNegative
    root: str
    mount_point: str
    """As seen from the process's own root directory."""
    mount_options: tuple[str, ...]
    optional_fields: tuple[str, ...]
    fs_type: str
    source: str
    super_options: tuple[str, ...]
    identity: FileIdentity | None = None
    """stat of the mount point reached from /proc/PID/root without following links."""


class DeviceAccess(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One line of a v1 devices.list (`c 1:3 rwm`); None major/minor is `*`."""

    type: str
    major: NonNegative | None
    minor: NonNegative | None
    access: str

    def __post_init__(self) -> None:
        if self.type not in ("a", "b", "c") or not self.access:
            raise ValueError(f"device rule {self.type!r} {self.access!r} is invalid")
        if set(self.access) - set("rwm") or len(set(self.access)) != len(self.access):
            raise ValueError(f"device access {self.access!r} is not a subset of rwm")


class DeviceProgram(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One cgroup v2 device program the kernel runs for the process's cgroup."""

    id: NonNegative
    rules: tuple[DeviceAccess, ...] | None
    """What it allows, decoded from the kernel's copy (the host's own shape or
    systemd's); None for any other program, which the gate cannot read."""


class Exe(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    identity: FileIdentity | None
    target: str


class Evidence(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Everything the gate judges, as read from the live process."""

    pid: Annotated[int, msgspec.Meta(gt=0)]
    start_time: NonNegative
    status: Status
    cgroups: tuple[CgroupEntry, ...]
    namespaces: dict[str, NonNegative]
    reference_namespaces: dict[str, tuple[NonNegative, ...]]
    """The daemon's own (/proc/self) and PID 1's namespace ids, per kind."""
    limits: tuple[Rlimit, ...]
    fds: tuple[FdEntry, ...]
    mounts: tuple[Mount, ...]
    exe: Exe
    devices: tuple[DeviceAccess, ...] | None
    """devices.list of the process's v1 devices cgroup; None without that hierarchy."""
    syscall_filters: seccomp.SeccompFilters | None = None
    """Every seccomp filter, read through ptrace (None: not in mode 2, or unreadable)."""
    syscall_filters_error: str | None = None
    """Why the filters could not be read, when they could not."""
    device_programs: tuple[DeviceProgram, ...] | None = None
    """The effective device programs of the process's cgroup v2 (every program the
    kernel runs for it, its ancestors' included); None without a v2 cgroup."""
    device_programs_error: str | None = None
    """Why the v2 device programs could not be read, when they could not."""


def malformed(what: str, detail: str) -> HostError:
    return HostError(
        HostCode.GATE_EVIDENCE,
        f"cannot parse {what} of the payload process ({detail}); the payload is not "
        "released: report this kernel output to the ficc maintainers",
    )


def process_changed(pid: int, detail: str) -> HostError:
    return HostError(
        HostCode.GATE_PROCESS_CHANGED,
        f"process {pid} {detail} while it was being inspected; the payload is not "
        "released: stop the attempt's service and start the attempt again",
    )
