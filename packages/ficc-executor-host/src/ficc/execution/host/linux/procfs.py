"""Evidence about a live process, read from /proc/PID.

The payload gate (gate/checks.py) must judge the process that is really running, not
what a provider says about it. The `Evidence` record is in `evidence`, the pure parsers
over bytes (unit-tested on recorded samples) in `procparse`; this module holds the
careful reads of each /proc file, and gate/reader.py reads them all into one
`Evidence`.

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

import msgspec

from ficc.execution.host.core.codes import HostCode
from ficc.execution.host.core.errors import HostError
from ficc.execution.host.linux.evidence import (
    MAX_FDS,
    MAX_PATH_COMPONENTS,
    MAX_PROC_FILE_BYTES,
    NAMESPACE_KINDS,
    CgroupEntry,
    DeviceAccess,
    Exe,
    FdEntry,
    FileIdentity,
    Mount,
    Stat,
    malformed,
    process_changed,
)
from ficc.execution.host.linux.procparse import (
    file_kind,
    parse_devices_list,
    parse_fdinfo,
    parse_mountinfo,
    parse_namespace_link,
    parse_stat,
)

# ---------------------------------------------------------------- pure parsers


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
