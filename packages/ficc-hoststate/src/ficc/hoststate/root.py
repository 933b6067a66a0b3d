"""The state directory as a confined root: the Python equivalent of Go's `os.Root`.

The directory is opened once, without following a symlink, and every file operation
is relative to that descriptor with `O_NOFOLLOW`, so renaming or re-pointing the
path afterwards cannot redirect a read or a write. Anything that an untrusted user
could have planted or could still change (a symlink, a FIFO, a hard link, a foreign
owner, group/other write permission, also on any ancestor) is refused rather than used,
and so is any group/other access to the directory or its files (0700 and 0600) and a
directory on network storage (`fstype`).

On Windows there are no directory descriptors; paths are joined and links refused by
`lstat`, and ACLs are the installer's job (development use only, see docs).
"""

from __future__ import annotations

import errno
import os
import secrets
import stat
import sys
from collections.abc import Callable, Sequence

from .errors import Corrupt, InvalidArgument, Unsafe
from .fstype import check_local

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOINHERIT", 0)
_NONBLOCK = getattr(os, "O_NONBLOCK", 0)  # opening a planted FIFO must not hang
_BINARY = getattr(os, "O_BINARY", 0)
_PATH = getattr(os, "O_PATH", os.O_RDONLY)  # walks directories it may not read
_IOV_MAX = 1024

Buffer = bytes | bytearray | memoryview


class Root:
    """An open, verified state directory. Close it when the session ends."""

    def __init__(self, path: str, fd: int | None) -> None:
        self.path = path
        self._fd = fd  # None on Windows

    @classmethod
    def open(cls, directory: str | os.PathLike[str]) -> Root:
        """Open an existing directory; it is never created here."""
        try:
            path = os.fspath(directory)
        except TypeError:
            raise InvalidArgument(
                f"the state directory must be a path, not {type(directory).__name__}"
            ) from None
        if not isinstance(path, str) or not path or "\x00" in path:
            raise InvalidArgument(f"the state directory {path!r} is not a usable path")
        if sys.platform == "win32":
            if os.path.islink(path) or not os.path.isdir(path):
                raise Unsafe(f"state directory {path} is a link or not a directory")
            return cls(path, None)
        fd = _open_directory(path)
        root = cls(path, fd)
        try:
            check_local(fd, f"state directory {path}")
            _check_owner_and_mode(os.fstat(fd), f"state directory {path}", private=0o700)
            _check_ancestors(fd, path)
        except BaseException:
            root.close()
            raise
        return root

    def close(self) -> None:
        """Close the directory descriptor; closing twice does nothing."""
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)

    def open_lock_file(self) -> int:
        """`host.lock` for reading and writing, created (0600) if absent, never truncated."""
        try:
            fd = self._open("host.lock", os.O_RDWR | os.O_CREAT)
        except OSError as exc:  # a read-only or full filesystem
            raise Unsafe(
                f"cannot open host.lock in {self.path} for writing: {exc.strerror}; the"
                " state directory must be on a writable filesystem with free space"
            ) from None
        assert fd is not None  # O_CREAT: absence is impossible
        return fd

    def open_existing(self, name: str) -> int | None:
        """A read-only descriptor of `name`, or None if it does not exist."""
        return self._open(name, os.O_RDONLY)

    def read(self, name: str, limit: int) -> bytes | None:
        """The whole of `name` (at most `limit` bytes), or None if it does not exist."""
        fd = self.open_existing(name)
        if fd is None:
            return None
        try:
            return read_all(fd, name, limit)
        finally:
            os.close(fd)

    def replace(self, name: str, fill: Callable[[int], None]) -> None:
        """Durably replace `name` with what `fill(fd)` writes, atomically.

        Unique private temporary file (0600), fill, fsync, close, rename over `name`,
        fsync the directory. On error the temporary file is removed if it still
        exists; the caller must still treat the outcome as unknown (the rename may
        have happened before the directory sync failed).
        """
        tmp = f"{name}.tmp.{os.getpid()}.{secrets.token_hex(8)}"
        fd = self._open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
        assert fd is not None
        try:
            try:
                fill(fd)
                os.fsync(fd)
            finally:
                os.close(fd)
            if sys.platform == "win32":
                os.replace(os.path.join(self.path, tmp), os.path.join(self.path, name))
            else:
                os.replace(tmp, name, src_dir_fd=self._fd, dst_dir_fd=self._fd)
        except BaseException:
            self._discard(tmp)
            raise
        if sys.platform != "win32":  # Windows: no directory sync; no power-loss promise there
            os.fsync(self._require_fd())

    def _open(self, name: str, flags: int) -> int | None:
        try:
            if sys.platform == "win32":
                path = os.path.join(self.path, name)
                if os.path.islink(path):
                    raise OSError(errno.ELOOP, "is a link", path)
                fd = os.open(path, flags | _BINARY | _CLOEXEC, 0o600)
            else:
                flags |= _NOFOLLOW | _CLOEXEC | _NONBLOCK
                fd = os.open(name, flags, 0o600, dir_fd=self._require_fd())
        except FileNotFoundError:
            if flags & os.O_CREAT:
                raise
            return None
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise Unsafe(
                    f"{name} in {self.path} is a symbolic link; remove the link and restore"
                    " the real file (symlinks are never followed)"
                ) from None
            if exc.errno == errno.EISDIR:
                raise Unsafe(
                    f"{name} in {self.path} is a directory; restore the real file"
                ) from None
            if exc.errno in (errno.EACCES, errno.EPERM):
                raise _denied(self._require_fd(), name, f"{name} in {self.path}") from None
            raise
        try:
            _check_file(os.fstat(fd), f"{name} in {self.path}")
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _discard(self, name: str) -> None:
        try:
            if sys.platform == "win32":
                os.unlink(os.path.join(self.path, name))
            else:
                os.unlink(name, dir_fd=self._require_fd())
        except OSError:
            pass  # best effort: a remnant is harmless, it is never read

    def _require_fd(self) -> int:
        if self._fd is None:
            raise ValueError("root is closed")
        return self._fd


def read_all(fd: int, name: str, limit: int) -> bytes:
    """Read a file that must not exceed `limit` bytes; size is checked before reading."""
    size = os.fstat(fd).st_size
    if size > limit:
        raise Corrupt(f"{name} is {size} bytes, over the {limit}-byte limit")
    parts: list[bytes] = []
    total = 0
    while True:
        part = os.read(fd, min(limit + 1 - total, max(size - total + 1, 1 << 16)))
        if not part:
            return b"".join(parts)
        parts.append(part)
        total += len(part)
        if total > limit:
            raise Corrupt(f"{name} grew over the {limit}-byte limit while being read")


def write_at(fd: int, data: Buffer, offset: int) -> None:
    """Write all of `data` at `offset` (no short writes; fails rather than spins)."""
    with memoryview(data) as view:
        done = 0
        while done < len(view):
            with view[done:] as rest:
                if sys.platform == "win32":
                    os.lseek(fd, offset + done, os.SEEK_SET)
                    n = os.write(fd, rest)
                else:
                    n = os.pwrite(fd, rest, offset + done)
            if n <= 0:
                raise OSError(errno.EIO, "write made no progress")
            done += n


def write_all(fd: int, chunks: Sequence[Buffer], offset: int) -> None:
    """Write the chunks back to back from `offset`, in as few system calls as possible."""
    if sys.platform == "win32" or not hasattr(os, "pwritev"):
        for chunk in chunks:
            write_at(fd, chunk, offset)
            offset += len(chunk)
        return
    pending = [memoryview(c) for c in chunks if len(c)]
    try:
        while pending:
            n = os.pwritev(fd, pending[:_IOV_MAX], offset)
            if n <= 0:
                raise OSError(errno.EIO, "write made no progress")
            offset += n
            while pending and n >= len(pending[0]):
                n -= len(pending.pop(0))
            if n:
                pending[0] = pending[0][n:]
    finally:
        for view in pending:
            view.release()


def write_in_place(fd: int, data: bytes) -> None:
    """Write `data` at offset 0 of an open file and sync it (the marker in host.lock)."""
    write_at(fd, data, 0)
    os.fsync(fd)


def _open_directory(path: str) -> int:
    """Open the state directory one component at a time from `/` (or the working
    directory), never following a symbolic link: neither a trailing `/` nor a link
    anywhere on the way (which whoever owns its directory could re-point) can
    redirect it. The directories on the way are opened with O_PATH, so one this user
    may pass through but not read is no obstacle."""
    absolute = os.path.abspath(path)  # with no link on the way, `..` means the same
    fd = os.open("/", _PATH | os.O_DIRECTORY | _CLOEXEC)
    walked = ""
    try:
        names = [n for n in absolute.split("/") if n]
        for index, name in enumerate(names):
            walked += "/" + name
            last = index == len(names) - 1
            flags = (os.O_RDONLY if last else _PATH) | os.O_DIRECTORY | _NOFOLLOW | _CLOEXEC
            try:
                nxt = os.open(name, flags, dir_fd=fd)
            except OSError as exc:
                raise _open_error(path, exc, walked) from None
            os.close(fd)
            fd = nxt
    except BaseException:
        os.close(fd)
        raise
    return fd


def _denied(dir_fd: int, name: str, what: str) -> Unsafe:
    """A file this user may not open: say whose it is, as the owner check would."""
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except OSError as exc:
        return Unsafe(f"cannot open {what}: {exc.strerror}")
    return Unsafe(
        f"{what} (owner uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):04o}) cannot be"
        f" opened by this user (uid {os.geteuid()}); chown it to root, mode 0600"
    )


def _open_error(path: str, exc: OSError, walked: str | None = None) -> Unsafe:
    if exc.errno == errno.ENOENT:
        return Unsafe(
            f"state directory {path} does not exist; bootstrap must create it (owned by"
            " root, mode 0700): it is never created here"
        )
    if exc.errno in (errno.ELOOP, errno.ENOTDIR):
        where = path if walked is None else walked
        what = "a symbolic link" if os.path.islink(where) else "not a directory"
        on_the_way = "" if where == os.path.abspath(path) else f" ({where} on the way)"
        return Unsafe(
            f"state directory {path}{on_the_way} is {what}; configure the real directory"
            " path (symlinks are never followed, on the way neither)"
        )
    return Unsafe(f"cannot open state directory {path}: {exc.strerror}")


def _check_owner_and_mode(st: os.stat_result, what: str, *, private: int) -> None:
    """Owned by root or this user, and private: no group or other access at all (the
    directory 0700, files 0600); `private` is the mode the chmod advice names."""
    if sys.platform == "win32":
        return
    euid = os.geteuid()
    if st.st_uid not in (0, euid):
        raise Unsafe(
            f"{what} is owned by uid {st.st_uid}, not root or this user (uid {euid});"
            " chown it to root"
        )
    mode = stat.S_IMODE(st.st_mode)
    if mode & 0o077:
        access = "writable" if mode & 0o022 else "readable"
        raise Unsafe(
            f"{what} is {access} by group or others (mode {mode:04o}); run"
            f" `chmod {private:o} {_path_of(what)}` (0700 for the directory, 0600 for"
            " its files)"
        )


def _path_of(what: str) -> str:
    """The path in a `what` of this module ("state directory P" or "NAME in P")."""
    if what.startswith("state directory "):
        return what.removeprefix("state directory ")
    name, _, directory = what.partition(" in ")
    return f"{directory}/{name}" if directory else what


def _check_file(st: os.stat_result, what: str) -> None:
    if not stat.S_ISREG(st.st_mode):
        raise Unsafe(f"{what} is not a regular file; restore the real file")
    if sys.platform != "win32" and st.st_nlink != 1:
        raise Unsafe(f"{what} has {st.st_nlink} hard links; remove the other links")
    _check_owner_and_mode(st, what, private=0o600)


def _check_ancestors(fd: int, path: str) -> None:
    """Refuse a directory that someone else could replace through one of its ancestors.

    An ancestor must be owned by root or this user and not writable by group/others,
    unless it is sticky (like /tmp), where others cannot rename entries they do not own.
    """
    if sys.platform == "win32":
        return
    euid = os.geteuid()
    child = os.fstat(fd)
    current = os.open("..", _PATH | os.O_DIRECTORY | _CLOEXEC, dir_fd=fd)
    try:
        while True:
            st = os.fstat(current)
            if (st.st_dev, st.st_ino) == (child.st_dev, child.st_ino):
                return  # the filesystem root is its own parent
            sticky = bool(st.st_mode & stat.S_ISVTX)
            if st.st_uid not in (0, euid) or (st.st_mode & 0o022 and not sticky):
                raise Unsafe(
                    f"an ancestor directory of {path} (owner uid {st.st_uid}, mode"
                    f" {stat.S_IMODE(st.st_mode):04o}) lets others replace the state"
                    " directory; fix its owner/permissions or move the state directory"
                )
            parent = os.open("..", _PATH | os.O_DIRECTORY | _CLOEXEC, dir_fd=current)
            os.close(current)
            current, child = parent, st
    finally:
        os.close(current)
