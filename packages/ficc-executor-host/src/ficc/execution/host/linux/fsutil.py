"""Confined file operations relative to directory file descriptors.

The daemon runs as root inside directories that other accounts may be able to write
(slot filesystems, attempt directories). A path string is re-resolved by the kernel
on every use, so an attacker who can plant a symlink or swap a directory between a
check and a use wins. These helpers therefore resolve a path once, component by
component, never following a symlink, and then work only with `*at` calls on the
resulting directory fd with single-component names.

Every refusal is a `HostError` with a stable code:

- `unsafe_path`: a symlink where a directory or file was expected, a name that is not
  a single plain component, or a path that is not absolute and normalized.
- `not_found`: a component does not exist.
- `not_directory`: a component exists but is not a directory.
- `not_regular_file`: a FIFO, device, socket or directory where a file was expected.
- `hard_link_refused`: a regular file with more than one link (it may be an alias of a
  file somewhere the daemon did not intend to touch).
- `wrong_owner`: a file or directory owned by an unexpected account.
- `file_exists`: an exclusive create found something at the name.
- `file_too_large`: a bounded read found more bytes than allowed.
- `io_error`: any other operating-system failure; the message carries the errno text.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import stat
from collections.abc import Callable

from ficc.execution.errors import ErrorCode
from ficc.execution.host.core.codes import HostCode
from ficc.execution.host.core.errors import HostError
from ficc.execution.provider import FileIdentity

__all__ = [
    "FileIdentity",
    "atomic_replace",
    "bounded_read",
    "check_name",
    "create_exclusive",
    "fsync_dir",
    "identity_of",
    "open_dir",
    "open_dir_at",
    "open_regular_at",
    "require_owner",
    "write_all",
]

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# O_NONBLOCK makes opening a planted FIFO return at once instead of hanging the
# daemon; it has no effect on regular files, which are all we accept.
_FILE_FLAGS = os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NOCTTY | os.O_NONBLOCK
_READ_CHUNK = 1 << 20


def identity_of(source: int | os.stat_result) -> FileIdentity:
    """The identity of an open fd or of a stat result already taken."""
    st = os.fstat(source) if isinstance(source, int) else source
    return FileIdentity(
        device=st.st_dev,
        inode=st.st_ino,
        mode=st.st_mode,
        bytes=st.st_size,
        mtime_ns=st.st_mtime_ns,
    )


def check_name(name: str) -> None:
    """Refuse anything but one plain path component."""
    if not name or name in {".", ".."} or "/" in name or "\0" in name:
        raise HostError(
            ErrorCode.UNSAFE_PATH,
            f"{name!r} is not a single plain file name; use a name without '/', NUL, '.' or '..'",
        )


def _lstat_at(dir_fd: int, name: str) -> os.stat_result | None:
    try:
        return os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except OSError:
        return None


def _refusal(dir_fd: int, name: str, error: OSError, where: str) -> HostError:
    """Turn a failed open of `name` into the most precise stable refusal."""
    st = _lstat_at(dir_fd, name)
    if st is not None and stat.S_ISLNK(st.st_mode):
        return HostError(
            ErrorCode.UNSAFE_PATH,
            f"{where} is a symbolic link; the daemon never follows links it did not "
            "create: replace it with a real directory or file",
        )
    if error.errno == errno.ENOENT:
        return HostError(ErrorCode.NOT_FOUND, f"{where} does not exist; create it or fix the path")
    if error.errno == errno.ENOTDIR:
        return HostError(HostCode.NOT_DIRECTORY, f"{where} is not a directory")
    if error.errno == errno.EEXIST:
        return HostError(
            HostCode.FILE_EXISTS, f"{where} already exists; remove it or pick a new name"
        )
    return HostError(ErrorCode.IO_ERROR, f"{where}: {error.strerror or error}")


def open_dir_at(dir_fd: int, name: str) -> int:
    """Open the directory `name` inside `dir_fd` without following a symlink."""
    check_name(name)
    try:
        return os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
    except OSError as error:
        raise _refusal(dir_fd, name, error, f"directory {name!r}") from error


def open_dir_below(dir_fd: int, name: str) -> int:
    """`open_dir_at`, refused (`storage_unverified`) unless the directory is on the same
    filesystem as `dir_fd`: checked on the opened descriptor, before anything is
    written there. Below a slot, another filesystem is a mount over the host's own
    directories (a tmpfs over `ficc/`, a host directory over `ficc-staging/`), where
    the slot's disk bound would not hold for what the host writes."""
    fd = open_dir_at(dir_fd, name)
    found, parent = os.fstat(fd).st_dev, os.fstat(dir_fd).st_dev
    if found != parent:
        os.close(fd)
        raise HostError(
            HostCode.STORAGE_UNVERIFIED,
            f"directory {name!r} is another filesystem mounted inside the slot (device"
            f" {os.major(found)}:{os.minor(found)}, the slot's is {os.major(parent)}:"
            f"{os.minor(parent)}); nothing is written there: unmount it, then retry",
        )
    return fd


def open_dir(
    path: str,
    *,
    open_child: Callable[[int, str, str], int] | None = None,
    check: Callable[[int, str], None] | None = None,
) -> int:
    """Open an absolute directory path, refusing a symlink in any component.

    The walk starts at `/` and opens each component relative to the previous one, so
    no component is ever resolved by path again after it has been checked. A caller
    with stricter rules (config/trusted.py: root-owned all the way down) keeps the walk and
    brings its own: `open_child(parent_fd, name, walked)` opens one component (by
    default with O_NOFOLLOW, refused as described above), and `check(fd, walked)` may
    refuse each directory opened, `/` included. The caller owns the returned fd.
    """
    if not path.startswith("/") or os.path.normpath(path) != path or "//" in path or "\0" in path:
        raise HostError(
            ErrorCode.UNSAFE_PATH,
            f"{path!r} is not an absolute normalized path; write it without '.', '..', "
            "repeated or trailing '/'",
        )
    opener = open_child or _open_component
    fd = os.open("/", _DIR_FLAGS)
    try:
        if check is not None:
            check(fd, "/")
        walked = ""
        for part in [p for p in path.split("/") if p]:
            walked += "/" + part
            child = opener(fd, part, walked)
            os.close(fd)
            fd = child
            if check is not None:
                check(fd, walked)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _open_component(parent_fd: int, name: str, walked: str) -> int:
    try:
        return os.open(name, _DIR_FLAGS, dir_fd=parent_fd)
    except OSError as error:
        raise _refusal(parent_fd, name, error, f"{walked!r}") from error


def require_owner(st: os.stat_result, uid: int, where: str) -> None:
    """Refuse a file or directory not owned by `uid`."""
    if st.st_uid != uid:
        raise HostError(
            ErrorCode.WRONG_OWNER,
            f"{where} is owned by uid {st.st_uid}, expected uid {uid}; fix its ownership",
        )


def _check_regular(st: os.stat_result, where: str, owner_uid: int | None) -> None:
    if not stat.S_ISREG(st.st_mode):
        raise HostError(
            ErrorCode.NOT_REGULAR_FILE,
            f"{where} is not a regular file (mode {stat.filemode(st.st_mode)}); "
            "replace it with a regular file",
        )
    if st.st_nlink != 1:
        raise HostError(
            ErrorCode.HARD_LINK_REFUSED,
            f"{where} has {st.st_nlink} hard links; a file the daemon trusts must have "
            "exactly one: remove the other links",
        )
    if owner_uid is not None:
        require_owner(st, owner_uid, where)


def open_regular_at(
    dir_fd: int, name: str, flags: int = os.O_RDONLY, *, owner_uid: int | None = None
) -> int:
    """Open an existing regular, singly linked file in `dir_fd` (optionally owned by `owner_uid`).

    The checks run on the opened fd, so what is checked is what is used.
    """
    check_name(name)
    where = f"file {name!r}"
    try:
        fd = os.open(name, flags | _FILE_FLAGS, dir_fd=dir_fd)
    except OSError as error:
        raise _refusal(dir_fd, name, error, where) from error
    try:
        _check_regular(os.fstat(fd), where, owner_uid)
    except BaseException:
        os.close(fd)
        raise
    return fd


def create_exclusive(dir_fd: int, name: str, mode: int, flags: int = os.O_RDWR) -> int:
    """Create a new file that did not exist, with exactly `mode` (the umask is undone).

    O_EXCL also refuses a planted symlink at the name, whatever it points to.
    """
    check_name(name)
    try:
        fd = os.open(name, flags | os.O_CREAT | os.O_EXCL | _FILE_FLAGS, mode, dir_fd=dir_fd)
    except OSError as error:
        raise _refusal(dir_fd, name, error, f"file {name!r}") from error
    try:
        os.fchmod(fd, mode)
    except BaseException:
        os.close(fd)
        raise
    return fd


def fsync_dir(dir_fd: int) -> None:
    """Make the directory's entries (creates, renames, unlinks) durable."""
    os.fsync(dir_fd)


def atomic_replace(dir_fd: int, name: str, data: bytes, mode: int = 0o600) -> None:
    """Replace `name` in `dir_fd` with `data` so a crash leaves either the old or the new file.

    Write a fresh temporary, fsync it, rename it over the name, fsync the directory.
    """
    check_name(name)
    temporary = f".{name}.tmp-{secrets.token_hex(8)}"
    fd = create_exclusive(dir_fd, temporary, mode, os.O_WRONLY)
    try:
        try:
            write_all(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(temporary, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary, dir_fd=dir_fd)
        raise
    fsync_dir(dir_fd)


def write_all(fd: int, data: bytes) -> None:
    """Write every byte of `data`: os.write may write less than it was given."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def bounded_read(fd: int, limit: int) -> bytes:
    """Read a whole file from offset 0, refusing one longer than `limit` bytes.

    Reads with pread, so the fd's position does not matter, and never holds more
    than `limit + 1` bytes however large the file has become.
    """
    parts: list[bytes] = []
    offset = 0
    while offset <= limit:
        block = os.pread(fd, min(_READ_CHUNK, limit + 1 - offset), offset)
        if not block:
            return b"".join(parts)
        parts.append(block)
        offset += len(block)
    raise HostError(
        HostCode.FILE_TOO_LARGE,
        f"the file is longer than the allowed {limit} bytes; shorten it",
    )


def storage_refusal(what: str, error: OSError, failed_code: str) -> HostError:
    """A write to a slot that failed: `slot_full` when the filesystem (or the quota)
    is full, else `failed_code`; either way the attempt cannot start."""
    if error.errno in {errno.ENOSPC, errno.EDQUOT}:
        return HostError(
            ErrorCode.SLOT_FULL,
            f"the slot filesystem is full while writing {what}; the attempt cannot start: "
            "release it and free space on the slot",
        )
    return HostError(
        failed_code,
        f"writing {what} failed ({error.strerror or error}); the attempt cannot start: "
        "release it and check the slot's disk",
    )


def exists_at(dir_fd: int, name: str) -> bool:
    """Whether anything is at `name` in `dir_fd` (a link counts; it is not followed)."""
    try:
        os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    return True
