"""Evidence about a live process, read from /proc/PID.

The payload gate (gate.py) must judge the process that is really running, not what a
provider says about it. This module holds the `Evidence` record, pure parsers over
bytes (unit-tested on recorded samples) and the careful reads of each /proc file;
gate_reader.py reads them all into one `Evidence`.

The reader is careful because the process belongs to someone else's job:
- /proc/PID is opened once as a directory fd and every file is read relative to it with
  O_NOFOLLOW, so nothing we read can be redirected by a link. The only links followed
  are the kernel's own magic links `exe`, `root` and `fd/N`, on purpose, to stat what
  they point at (their identity is the evidence).
- Every read is bounded; an oversized file is malformed evidence, not a bigger buffer.
- The PID can die or be reused while we read: the start time (stat field 22) is read
  first and last, and a change, a zombie or a vanished process is `gate_process_changed`.
"""

from __future__ import annotations

import errno
import functools
import os
import re
import stat
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


# ---------------------------------------------------------------- pure parsers


def _text(data: bytes, what: str) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise malformed(what, "not UTF-8") from exc


def _status_fields(data: bytes) -> dict[str, str]:
    fields: dict[str, str] = {}
    for line in _text(data, "status").splitlines():
        key, sep, value = line.partition(":")
        if sep:
            fields[key] = value.strip()
    return fields


def _int_list(value: str, what: str) -> tuple[int, ...]:
    try:
        numbers = tuple(int(part) for part in value.split())
    except ValueError as exc:
        raise malformed("status", f"{what} is not a list of integers") from exc
    if any(number < 0 for number in numbers):
        raise malformed("status", f"{what} has a negative id")
    return numbers


def _ids(fields: dict[str, str], key: str) -> Ids:
    numbers = _int_list(fields.get(key, ""), key)
    if len(numbers) != 4:
        raise malformed("status", f"{key} has {len(numbers)} fields, expected 4")
    return Ids(*numbers)


def _hex(fields: dict[str, str], key: str) -> int:
    value = fields.get(key)
    if value is None or not re.fullmatch(r"[0-9a-f]{1,16}", value):
        raise malformed("status", f"{key} is missing or not a hex mask")
    return int(value, 16)


def _decimal(fields: dict[str, str], key: str) -> int:
    value = fields.get(key)
    if value is None or not value.isdigit():
        raise malformed("status", f"{key} is missing or not a number")
    return int(value)


def parse_status(data: bytes) -> Status:
    """Parse /proc/PID/status; every field the gate needs must be present."""
    fields = _status_fields(data)
    return Status(
        uid=_ids(fields, "Uid"),
        gid=_ids(fields, "Gid"),
        groups=_int_list(fields.get("Groups", ""), "Groups"),
        capabilities=Capabilities(
            effective=_hex(fields, "CapEff"),
            permitted=_hex(fields, "CapPrm"),
            bounding=_hex(fields, "CapBnd"),
            inheritable=_hex(fields, "CapInh"),
            ambient=_hex(fields, "CapAmb"),
        ),
        no_new_privs=_decimal(fields, "NoNewPrivs"),
        seccomp=_decimal(fields, "Seccomp"),
        seccomp_filters=(
            _decimal(fields, "Seccomp_filters") if "Seccomp_filters" in fields else None
        ),
    )


def parse_stat(data: bytes) -> Stat:
    """Parse state and start time (field 22) of /proc/PID/stat.

    The command name (field 2) is in parentheses and may itself contain ") " and
    spaces, so the fields after it are found from the LAST ')'.
    """
    close = data.rfind(b")")
    if close < 0 or b"(" not in data[:close]:
        raise malformed("stat", "no command name in parentheses")
    rest = data[close + 1 :].split()
    # rest[0] is field 3 (state); field 22 (starttime) is rest[19].
    if len(rest) < 20 or not rest[19].isdigit():
        raise malformed("stat", "too few fields after the command name")
    return Stat(state=_text(rest[0], "stat"), start_time=int(rest[19]))


def parse_cgroup(data: bytes) -> tuple[CgroupEntry, ...]:
    """Parse every line of /proc/PID/cgroup (v1 hierarchies and the v2 line)."""
    entries = []
    for line in _text(data, "cgroup").splitlines():
        if not line:
            continue
        hierarchy, sep1, rest = line.partition(":")
        controllers, sep2, path = rest.partition(":")
        if not (sep1 and sep2 and hierarchy.isdigit() and path.startswith("/")):
            raise malformed("cgroup", f"line {line!r}")
        entries.append(
            CgroupEntry(
                hierarchy_id=int(hierarchy),
                controllers=tuple(controllers.split(",")) if controllers else (),
                path=path,
            )
        )
    if not entries:
        raise malformed("cgroup", "no lines")
    return tuple(entries)


def parse_namespace_link(kind: str, link: str) -> int:
    """`mnt:[4026531840]` -> 4026531840 (the nsfs inode)."""
    match = re.fullmatch(rf"{re.escape(kind)}:\[([0-9]+)\]", link)
    if match is None:
        raise malformed("namespaces", f"{kind} link is {link!r}")
    return int(match.group(1))


_LIMIT_LINE = re.compile(r"(Max [a-z ]+?)\s{2,}(\S+)\s+(\S+)(?:\s+\S+)?\s*")


def _limit_value(value: str) -> int | None:
    if value == "unlimited":
        return None
    if not value.isdigit():
        raise malformed("limits", f"value {value!r}")
    return int(value)


def parse_limits(data: bytes) -> tuple[Rlimit, ...]:
    """Parse /proc/PID/limits; an unknown limit label is malformed (fail closed)."""
    lines = _text(data, "limits").splitlines()
    if not lines or not lines[0].startswith("Limit"):
        raise malformed("limits", "missing header")
    limits = []
    for line in lines[1:]:
        match = _LIMIT_LINE.fullmatch(line)
        if match is None or match.group(1) not in RLIMIT_LABELS:
            raise malformed("limits", f"line {line!r}")
        limits.append(
            Rlimit(
                name=RLIMIT_LABELS[match.group(1)],
                soft=_limit_value(match.group(2)),
                hard=_limit_value(match.group(3)),
            )
        )
    return tuple(limits)


_OCTAL_ESCAPE = re.compile(rb"\\([0-7]{3})")


def unescape_mount_field(field: bytes) -> str:
    r"""Undo the kernel's octal escapes (`\040` space, `\011`, `\012`, `\134`)."""
    raw = _OCTAL_ESCAPE.sub(lambda m: bytes([int(m.group(1), 8) & 0xFF]), field)
    return _text(raw, "mountinfo")


def _parse_mount_line(line: bytes) -> Mount:
    fields = line.split(b" ")
    try:
        separator = fields.index(b"-", 6)
    except ValueError as exc:
        raise malformed("mountinfo", "no ' - ' separator") from exc
    if separator + 4 != len(fields):
        raise malformed("mountinfo", "wrong number of fields after the separator")
    mount_id, parent_id, device = fields[0], fields[1], fields[2]
    major, colon, minor = device.partition(b":")
    if not (colon and all(x.isdigit() for x in (mount_id, parent_id, major, minor))):
        raise malformed("mountinfo", "bad ids or device")
    return Mount(
        mount_id=int(mount_id),
        parent_id=int(parent_id),
        major=int(major),
        minor=int(minor),
        root=unescape_mount_field(fields[3]),
        mount_point=unescape_mount_field(fields[4]),
        mount_options=tuple(_text(fields[5], "mountinfo").split(",")),
        optional_fields=tuple(_text(f, "mountinfo") for f in fields[6:separator]),
        fs_type=unescape_mount_field(fields[separator + 1]),
        source=unescape_mount_field(fields[separator + 2]),
        super_options=tuple(unescape_mount_field(fields[separator + 3]).split(",")),
    )


def parse_mountinfo(data: bytes) -> tuple[Mount, ...]:
    """Parse /proc/PID/mountinfo (see proc(5)); paths are unescaped, strict UTF-8."""
    lines = [line for line in data.split(b"\n") if line]
    if len(lines) > MAX_MOUNTS:
        raise malformed("mountinfo", f"more than {MAX_MOUNTS} mounts")
    return tuple(_parse_mount_line(line) for line in lines)


def find_mount(data: bytes, mount_id: int) -> Mount | None:
    """The entry of /proc/PID/mountinfo with this mount ID, parsing no other line (a
    line elsewhere that is not UTF-8 does not matter to the one asked for)."""
    prefix = b"%d " % mount_id
    for line in data.split(b"\n"):
        if line.startswith(prefix):
            return _parse_mount_line(line)
    return None


def parse_fdinfo(data: bytes) -> tuple[int | None, int | None]:
    """(flags, mnt_id) from /proc/PID/fdinfo/N; flags are octal in the kernel text."""
    flags = mnt_id = None
    for line in _text(data, "fdinfo").splitlines():
        key, _, value = line.partition(":")
        value = value.strip()
        if key == "flags" and re.fullmatch(r"[0-7]+", value):
            flags = int(value, 8)
        elif key == "mnt_id" and value.isdigit():
            mnt_id = int(value)
    return flags, mnt_id


def _device_number(value: str) -> int | None:
    if value == "*":
        return None
    if not value.isdigit():
        raise malformed("devices.list", f"device number {value!r}")
    return int(value)


def parse_devices_list(data: bytes) -> tuple[DeviceAccess, ...]:
    """Parse a cgroup v1 devices.list: `TYPE MAJOR:MINOR ACCESS` per line."""
    rules = []
    for line in _text(data, "devices.list").splitlines():
        parts = line.split(" ")
        major, colon, minor = parts[1].partition(":") if len(parts) == 3 else ("", "", "")
        if not colon:
            raise malformed("devices.list", f"line {line!r}")
        try:
            rules.append(
                DeviceAccess(parts[0], _device_number(major), _device_number(minor), parts[2])
            )
        except ValueError as exc:
            raise malformed("devices.list", f"line {line!r}") from exc
    return tuple(rules)


def file_kind(mode: int) -> str:
    kinds = (
        (stat.S_ISREG, "file"),
        (stat.S_ISDIR, "dir"),
        (stat.S_ISCHR, "chr"),
        (stat.S_ISBLK, "blk"),
        (stat.S_ISFIFO, "fifo"),
        (stat.S_ISSOCK, "socket"),
        (stat.S_ISLNK, "link"),
    )
    return next((name for test, name in kinds if test(mode)), "other")


# ---------------------------------------------------------------- the reader

_VANISHED = (errno.ENOENT, errno.ESRCH)


def _os_error(pid: int, what: str, exc: OSError) -> HostError:
    if exc.errno in _VANISHED:
        return process_changed(pid, f"vanished (reading {what})")
    return HostError(
        HostCode.GATE_EVIDENCE,
        f"cannot read {what} of process {pid} ({exc.strerror}); the payload is not "
        "released: the daemon must run as root with /proc mounted",
    )


def read_bounded(dir_fd: int, name: str, pid: int) -> bytes:
    """Read a whole /proc file relative to `dir_fd`, never following a link."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError as exc:
        raise _os_error(pid, name, exc) from exc
    try:
        chunks = []
        size = 0
        while chunk := os.read(fd, 65536):
            size += len(chunk)
            if size > MAX_PROC_FILE_BYTES:
                raise malformed(name, f"larger than {MAX_PROC_FILE_BYTES} bytes")
            chunks.append(chunk)
        return b"".join(chunks)
    except OSError as exc:
        raise _os_error(pid, name, exc) from exc
    finally:
        os.close(fd)


def open_process_dir(pid: int) -> int:
    """A directory fd on /proc/PID; reads through it fail once that process is gone."""
    if pid <= 0:
        raise HostError(HostCode.GATE_EVIDENCE, f"invalid process id {pid}")
    try:
        return os.open(f"/proc/{pid}", os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        raise _os_error(pid, f"/proc/{pid}", exc) from exc


def read_stat(dir_fd: int, pid: int) -> Stat:
    """Read stat and refuse a process that has already exited (zombie or dead)."""
    parsed = parse_stat(read_bounded(dir_fd, "stat", pid))
    if parsed.state in ("Z", "X", "x"):
        raise process_changed(pid, "exited")
    return parsed


def read_namespaces(dir_fd: int, pid: int) -> dict[str, int]:
    namespaces = {}
    for kind in NAMESPACE_KINDS:
        try:
            link = os.readlink(f"ns/{kind}", dir_fd=dir_fd)
        except OSError as exc:
            raise _os_error(pid, f"ns/{kind}", exc) from exc
        namespaces[kind] = parse_namespace_link(kind, link)
    return namespaces


def reference_namespaces() -> dict[str, tuple[int, ...]]:
    """The daemon's own namespaces, plus PID 1's when readable, per kind.

    The payload must differ from the daemon's (the spec's rule). PID 1 is added as a
    stricter reference for a daemon that itself runs in a container; its namespaces
    are unreadable when PID 1 is outside our reach (EACCES), and then only the
    daemon's own are used.
    """
    found: dict[str, list[int]] = {kind: [] for kind in NAMESPACE_KINDS}
    for pid in (os.getpid(), 1):
        dir_fd = open_process_dir(pid)
        try:
            namespaces = read_namespaces(dir_fd, pid)
        except HostError:
            if pid == 1:
                continue
            raise
        finally:
            os.close(dir_fd)
        for kind, inode in namespaces.items():
            if inode not in found[kind]:
                found[kind].append(inode)
    return {kind: tuple(inodes) for kind, inodes in found.items()}


def _printable(link: str) -> str:
    """A link text safe to encode as JSON: undecodable bytes become `\\xNN`."""
    return link.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")


def _identity(result: os.stat_result) -> FileIdentity:
    return FileIdentity(dev=result.st_dev, ino=result.st_ino)


def _fd_entry(pid_fd: int, fd_dir: int, name: str, pid: int) -> FdEntry:
    try:
        target = os.readlink(name, dir_fd=fd_dir)
        # Following fd/N is the point: we want the identity of the open file.
        result = os.stat(name, dir_fd=fd_dir)
    except OSError as exc:
        if exc.errno in _VANISHED:
            # Closed between listing and stat: unknown is refused by the gate.
            return FdEntry(int(name), "", "unknown", None, None, None, None, None)
        raise _os_error(pid, f"fd/{name}", exc) from exc
    try:
        flags, mnt_id = parse_fdinfo(read_bounded(pid_fd, f"fdinfo/{name}", pid))
    except HostError as exc:
        if exc.code != HostCode.GATE_PROCESS_CHANGED:
            raise
        # Closed after stat: the process itself is re-checked by the start time.
        flags = mnt_id = None
    return FdEntry(
        fd=int(name),
        target=_printable(target),
        kind=file_kind(result.st_mode),
        dev=result.st_dev,
        ino=result.st_ino,
        rdev=result.st_rdev,
        flags=flags,
        mnt_id=mnt_id,
    )


def read_fds(pid_fd: int, pid: int) -> tuple[FdEntry, ...]:
    try:
        fd_dir = os.open(
            "fd", os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=pid_fd
        )
    except OSError as exc:
        raise _os_error(pid, "fd", exc) from exc
    try:
        names: list[str] = []
        with os.scandir(fd_dir) as entries:
            for entry in entries:
                if len(names) == MAX_FDS:
                    raise HostError(
                        HostCode.GATE_FD,
                        f"process {pid} has more than {MAX_FDS} open descriptors; "
                        "the payload is not released",
                    )
                if not entry.name.isdigit():
                    raise malformed("fd", f"entry {entry.name!r}")
                names.append(entry.name)
        entries_read = [_fd_entry(pid_fd, fd_dir, name, pid) for name in names]
    except OSError as exc:
        raise _os_error(pid, "fd", exc) from exc
    finally:
        os.close(fd_dir)
    return tuple(sorted(entries_read, key=lambda entry: entry.fd))


def mount_point_identity(root_fd: int, mount_point: str) -> FileIdentity | None:
    """stat a mount point below the process root, one component at a time, no links.

    None when the path cannot be walked strictly (a link, a vanished or hidden path):
    the gate then refuses any mount whose identity it must confirm.
    """
    parts = [part for part in mount_point.split("/") if part]
    if len(parts) > MAX_PATH_COMPONENTS or any(part in (".", "..") for part in parts):
        return None
    current = root_fd
    try:
        for part in parts:
            following = os.open(part, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=current)
            if current != root_fd:
                os.close(current)
            current = following
        return _identity(os.fstat(current))
    except OSError:
        return None
    finally:
        if current != root_fd:
            os.close(current)


def read_mounts(pid_fd: int, pid: int) -> tuple[Mount, ...]:
    mounts = parse_mountinfo(read_bounded(pid_fd, "mountinfo", pid))
    try:
        # The process's root directory (a magic link, followed on purpose).
        root_fd = os.open("root", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=pid_fd)
    except OSError as exc:
        raise _os_error(pid, "root", exc) from exc
    try:
        return tuple(
            msgspec.structs.replace(
                mount, identity=mount_point_identity(root_fd, mount.mount_point)
            )
            for mount in mounts
        )
    finally:
        os.close(root_fd)


def read_exe(pid_fd: int, pid: int) -> Exe:
    try:
        target = _printable(os.readlink("exe", dir_fd=pid_fd))
        # Following exe is the point: its device and inode identify the binary.
        return Exe(identity=_identity(os.stat("exe", dir_fd=pid_fd)), target=target)
    except OSError as exc:
        if exc.errno == errno.ENOENT:
            return Exe(identity=None, target="")
        raise _os_error(pid, "exe", exc) from exc


def own_mounts(pid: int) -> tuple[Mount, ...]:
    """The daemon's own mount table, read now (`pid`: the process the caller reads
    evidence of, for the error). It is parsed only when its bytes changed since the
    last read: every start reads it twice, and it rarely changes."""
    own = open_process_dir(os.getpid())
    try:
        return _own_mount_table(read_bounded(own, "mountinfo", pid))
    finally:
        os.close(own)


@functools.lru_cache(maxsize=1)
def _own_mount_table(data: bytes) -> tuple[Mount, ...]:
    return parse_mountinfo(data)


def _devices_mount(pid: int) -> str | None:
    """Where the daemon sees the v1 devices hierarchy (its own mountinfo), if anywhere."""
    for mount in own_mounts(pid):
        if mount.fs_type == "cgroup" and "devices" in mount.super_options and mount.root == "/":
            return mount.mount_point
    return None


def read_devices(cgroups: tuple[CgroupEntry, ...], pid: int) -> tuple[DeviceAccess, ...] | None:
    """devices.list of the process's v1 devices cgroup, reached without following links."""
    entry = next((e for e in cgroups if e.hierarchy_id and "devices" in e.controllers), None)
    mount_point = _devices_mount(pid) if entry is not None else None
    if entry is None or mount_point is None:
        return None
    parts = [part for part in entry.path.split("/") if part]
    if any(part in (".", "..") for part in parts):
        raise malformed("cgroup", f"devices path {entry.path!r}")
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        current = os.open(mount_point, flags)
        for part in parts:
            following = os.open(part, flags, dir_fd=current)
            os.close(current)
            current = following
    except OSError as exc:
        raise HostError(
            HostCode.GATE_EVIDENCE,
            f"cannot open the devices cgroup {entry.path!r} of process {pid} "
            f"({exc.strerror}); the payload is not released",
        ) from exc
    try:
        return parse_devices_list(read_bounded(current, "devices.list", pid))
    finally:
        os.close(current)


def confirm_unchanged(pid: int, start_time: int) -> None:
    """Re-open /proc/PID by number: a reused PID shows a different start time."""
    pid_fd = open_process_dir(pid)
    try:
        current = read_stat(pid_fd, pid)
    finally:
        os.close(pid_fd)
    if current.start_time != start_time:
        raise process_changed(pid, "was replaced by another process")


# --- a service's first process, as the service backends check it ---------------------


SMALL_FILE_BYTES = 8192
"""Enough for a process's status, stat or limits file."""


def _small_file(path: str) -> str:
    """A small /proc file as text, never through a link; OSError if it cannot be read."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        return os.read(fd, SMALL_FILE_BYTES).decode("utf-8", "replace")
    finally:
        os.close(fd)


def status_fields(pid: int) -> dict[str, str]:
    """/proc/PID/status as {field: value}, every field as the kernel prints it."""
    fields = {}
    for line in _small_file(f"/proc/{pid}/status").splitlines():
        key, _, value = line.partition(":")
        fields[key] = value.strip()
    return fields


def start_ticks(pid: int) -> int:
    """Field 22 of /proc/PID/stat: with the PID it names one process (PIDs are reused)."""
    return int(_small_file(f"/proc/{pid}/stat").rpartition(")")[2].split()[19])


def limit_fields(pid: int) -> dict[str, tuple[str, str]]:
    """/proc/PID/limits as {label: (soft, hard)}; labels are the fixed kernel ones."""
    limits = {}
    for line in _small_file(f"/proc/{pid}/limits").splitlines()[1:]:
        name, values = line[:26].strip(), line[26:].split()
        if len(values) >= 2:
            limits[name] = (values[0], values[1])
    return limits
