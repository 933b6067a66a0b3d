"""Trusted reads of the administrator's files and directories: opened component by
component without following symlinks, root-owned, not writable by others, bounded."""

from __future__ import annotations

import errno
import os
import posixpath
import stat

from ficc.execution.host.core.codes import HostCode
from ficc.execution.host.core.errors import HostError
from ficc.execution.host.linux import fsutil


def refuse(code: str, key: str, problem: str, fix: str) -> HostError:
    return HostError(code, f"{key}: {problem}; {fix}")


def _check_normalized(path: str, key: str, code: str) -> None:
    if not path.startswith("/") or path.startswith("//") or posixpath.normpath(path) != path:
        raise refuse(code, key, f"{path!r} is not a normalized absolute path", "give one")


def _check_trusted_directory(st: os.stat_result, key: str, where: str, code: str) -> None:
    if st.st_uid != 0:
        raise refuse(code, key, f"directory {where} is owned by UID {st.st_uid}", "chown root")
    if st.st_mode & 0o022:
        mode = stat.S_IMODE(st.st_mode)
        problem = f"directory {where} has mode {mode:04o}, writable by others"
        if st.st_mode & (stat.S_ISVTX | stat.S_IWOTH):  # a shared directory such as /tmp
            raise refuse(code, key, problem, _shared_directory_fix(key))
        raise refuse(code, key, problem, f"chmod go-w {where}")


_USUAL_HOMES = {
    "state_dir": "/var/lib/ficc-executor",
    "socket_dir": "/run/ficc-executor",
    "metrics_textfile": "/var/lib/node_exporter/textfile_collector",
    "--image": "/var/lib/ficc-slots",
}


def _shared_directory_fix(key: str) -> str:
    """Advice for a path below a shared directory such as /tmp: move the path, with the
    usual home of what the key names, and never loosen the shared directory itself."""
    home = "/srv/ficc/slots" if key.startswith("slots[") else _USUAL_HOMES.get(key, "/etc/ficc")
    return f"move it below a directory only root can write (for example {home})"


def _open_unchanged_child(parent_fd: int, name: str, key: str, where: str, code: str) -> int:
    """The directory `name` in `parent_fd`, refused if it is a link or not a directory,
    or if what was opened is not what was looked at."""
    before = os.stat(name, dir_fd=parent_fd, follow_symlinks=False)
    if stat.S_ISLNK(before.st_mode):
        raise refuse(code, key, f"{where} is a symbolic link", "use the real path")
    if not stat.S_ISDIR(before.st_mode):
        raise refuse(code, key, f"{where} is not a directory", "use a directory path")
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open(name, flags, dir_fd=parent_fd)
    try:
        if not os.path.samestat(before, os.fstat(fd)):
            raise refuse(code, key, f"{where} changed while being checked", "retry")
    except BaseException:
        os.close(fd)
        raise
    return fd


def _create_advice(key: str) -> str:
    """What to do about a missing directory: a slot's path is a filesystem of its own,
    which a plain directory would never satisfy."""
    if key.startswith("slots[") and key.endswith("].path"):
        return (
            "a slot is a filesystem of its own: make it with `ficc-executor provision-slot"
            " --image IMAGE --mount PATH --bytes N --inodes N` (or, if provision-slot made it"
            " before, mount it again with `provision-slot --remount`), or fix the path"
        )
    return "create it (owned by root) or fix the path"


def open_trusted_directory(path: str, key: str, code: str, mode: int | None = None) -> int:
    """Open the absolute directory `path` so that nobody but root could have redirected it.

    Every directory from `/` down is opened relative to its parent without following a
    symbolic link, and must be owned by root and not writable by group or others (a
    sticky world-writable directory such as /tmp is refused too). If `mode` is given,
    the final directory must have exactly that mode. The caller owns the returned fd.
    """
    _check_normalized(path, key, code)

    def open_child(parent_fd: int, name: str, where: str) -> int:
        return _open_unchanged_child(parent_fd, name, key, where, code)

    def check(fd: int, where: str) -> None:
        _check_trusted_directory(os.fstat(fd), key, where, code)

    try:
        fd = fsutil.open_dir(path, open_child=open_child, check=check)
    except FileNotFoundError:
        missing = (
            HostCode.HOST_PATH_MISSING
            if code == HostCode.HOST_PATH_UNSAFE
            else HostCode.CONFIG_MISSING
        )
        raise refuse(missing, key, f"{path} does not exist", _create_advice(key)) from None
    except OSError as error:
        fix = (
            "run the command as root" if error.errno in (errno.EACCES, errno.EPERM) else "check it"
        )
        raise refuse(code, key, f"cannot open {path}: {error.strerror}", fix) from None
    actual = stat.S_IMODE(os.fstat(fd).st_mode)
    if mode is not None and actual != mode:
        os.close(fd)
        raise refuse(code, key, f"{path} has mode {actual:04o}", f"chmod {mode:04o} {path}")
    return fd


def read_trusted_file(path: str, limit: int) -> bytes:
    """Read a root-owned 0600 regular file with one link and at most `limit` bytes.

    The checks are made on the opened descriptor (fstat), not on the path, so the file
    that was checked is the file that is read.
    """
    key = path
    parent, name = posixpath.split(path)
    if not path.startswith("/") or not name:
        raise refuse(HostCode.CONFIG_UNSAFE_FILE, key, "is not an absolute file path", "give one")
    parent_fd = open_trusted_directory(parent, key, HostCode.CONFIG_UNSAFE_FILE)
    try:
        return _read_checked_file(parent_fd, name, key, limit)
    finally:
        os.close(parent_fd)


def _read_checked_file(parent_fd: int, name: str, key: str, limit: int) -> bytes:
    code = HostCode.CONFIG_UNSAFE_FILE
    try:
        before = os.stat(name, dir_fd=parent_fd, follow_symlinks=False)
    except FileNotFoundError:
        raise refuse(
            HostCode.CONFIG_MISSING, key, "does not exist", "create it or fix the path"
        ) from None
    except OSError as error:
        raise _unreadable(error, key) from None
    _check_config_stat(before, key, limit)  # refuse FIFOs and devices before opening them
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
    try:
        fd = os.open(name, flags, dir_fd=parent_fd)
    except OSError as error:
        if error.errno == errno.ELOOP:
            raise refuse(code, key, "is a symbolic link", "use the real file") from None
        raise _unreadable(error, key) from None
    try:
        after = os.fstat(fd)
        if not os.path.samestat(before, after):
            raise refuse(code, key, "changed while being checked", "retry")
        _check_config_stat(after, key, limit)
        return _read_bounded(fd, limit, key)
    finally:
        os.close(fd)


def _unreadable(error: OSError, key: str) -> HostError:
    """The file is root's and 0600: a refused read is most often a command run without
    root, which the fix says."""
    if error.errno in (errno.EACCES, errno.EPERM):
        fix = "run the command as root (the configuration is root's alone, mode 0600)"
    else:
        fix = "check the file and the disk it is on"
    return refuse(HostCode.CONFIG_UNREADABLE, key, str(error.strerror), fix)


def _check_config_stat(st: os.stat_result, key: str, limit: int) -> None:
    code = HostCode.CONFIG_UNSAFE_FILE
    if stat.S_ISLNK(st.st_mode):
        raise refuse(code, key, "is a symbolic link", "name the real file")
    if not stat.S_ISREG(st.st_mode):
        raise refuse(code, key, "is not a regular file", "use a plain file")
    if st.st_uid != 0:
        raise refuse(code, key, f"is owned by UID {st.st_uid}", f"chown root:root {key}")
    if stat.S_IMODE(st.st_mode) != 0o600:
        mode = stat.S_IMODE(st.st_mode)
        raise refuse(code, key, f"has mode {mode:04o}", f"chmod 0600 {key}")
    if st.st_nlink != 1:
        raise refuse(
            code, key, f"has {st.st_nlink} hard links", "keep exactly one link (copy the file)"
        )
    if st.st_size > limit:
        raise refuse(code, key, f"is {st.st_size} bytes", f"keep it at most {limit} bytes")


def _read_bounded(fd: int, limit: int, key: str) -> bytes:
    chunks: list[bytes] = []
    total = 0
    while chunk := os.read(fd, limit + 1 - total):
        chunks.append(chunk)
        total += len(chunk)
        if total > limit:
            raise refuse(
                HostCode.CONFIG_UNSAFE_FILE, key, "grew past the size limit", "keep it small"
            )
    return b"".join(chunks)
