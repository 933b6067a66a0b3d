"""Root's file operations in the slot account's files: by descriptor, never by path.

The provider runs as root, and part of what it creates, resets and removes belongs to
the slot account (`<slot>/ficc-podman/...`, `/run/user/<uid>/...`, the attempt's
`provider/run/`). A process of the account (a payload that escaped its container)
can rename anything in its own directories at any moment, for instance swap a
directory with a symbolic link to a root-owned directory elsewhere
(`renameat2(RENAME_EXCHANGE)` in a tight loop). A path is resolved again by the kernel
at every use, and `O_NOFOLLOW` covers only its last component, so root acting on
`<mine>/<theirs>/<x>` may act wherever `<theirs>` points at that instant.

So every operation here starts from a directory descriptor whose parent the account
cannot write (the slot's root, `/run/user`, the attempt's root-owned `provider/`), and
goes down one component at a time, each opened with `O_NOFOLLOW | O_DIRECTORY` and
checked to be on the same filesystem (`openat2` with `RESOLVE_BENEATH |
RESOLVE_NO_SYMLINKS | RESOLVE_NO_XDEV | RESOLVE_NO_MAGICLINKS` resolves a relative path
that way in one call where the kernel has it). A link is never followed: it is removed
as a link, or refused where a directory is needed.

Removal (`remove_entry`) is iterative: it holds one directory descriptor at a time,
climbs back with `..` and checks that it came back to the directory it left, so no
depth of tree exhausts the stack or the descriptors (`shutil.rmtree` recurses and
raises `RecursionError` at about a thousand levels, which `ignore_errors` does not
catch). It never stops at the first failure: everything it could not remove is
reported with its path, and the caller refuses with that list.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import os
import stat
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import cast

from ficc_provider_podman.errors import ProviderError

DIRECTORY = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
MAX_REPORTED = 8
"""How many failed paths a refusal names (the count of the rest is given)."""

_SYS_OPENAT2 = 437  # the same number on every architecture that has it
_RESOLVE = 0x01 | 0x02 | 0x04 | 0x08  # NO_XDEV | NO_MAGICLINKS | NO_SYMLINKS | BENEATH


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


def _libc_syscall() -> Callable[..., int] | None:
    try:
        function = ctypes.CDLL(None, use_errno=True).syscall
    except (OSError, AttributeError):
        return None
    function.restype = ctypes.c_long
    return cast(Callable[..., int], function)


_syscall = _libc_syscall()


def _openat2(dir_fd: int, relative: str) -> int:
    """openat2(2) with the confining resolve flags: a descriptor, or -errno."""
    if _syscall is None:
        return -errno.ENOSYS
    how = _OpenHow(DIRECTORY, 0, _RESOLVE)
    fd = _syscall(
        _SYS_OPENAT2, dir_fd, os.fsencode(relative), ctypes.byref(how), ctypes.sizeof(how)
    )
    return int(fd) if fd >= 0 else -ctypes.get_errno()


@functools.cache
def has_openat2() -> bool:
    """Whether this kernel (and any system-call filter around the daemon) offers
    openat2: asked once, of the root directory."""
    root = os.open("/", DIRECTORY)
    try:
        fd = _openat2(root, ".")
    finally:
        os.close(root)
    if fd < 0:
        return False
    os.close(fd)
    return True


def open_beneath(dir_fd: int, relative: str) -> int:
    """A directory below `dir_fd` by a relative path, no component a link and none on
    another filesystem. `FileNotFoundError` when a component is missing; any other
    refusal is an `OSError` (`ELOOP` for a link, `EXDEV` for another filesystem)."""
    if not has_openat2():
        return _walk(dir_fd, relative)
    fd = _openat2(dir_fd, relative)
    if fd < 0:
        raise OSError(-fd, os.strerror(-fd), relative)
    return fd


def _walk(dir_fd: int, relative: str, *, same_device: bool = True) -> int:
    """`open_beneath` one component at a time (kernels before 5.6); a trusted path
    (`same_device` false) may cross mount points, as into the slot's own."""
    device = os.fstat(dir_fd).st_dev
    fd = os.dup(dir_fd)
    try:
        for component in relative.split("/"):
            if component in ("", ".", ".."):
                raise OSError(errno.EINVAL, "not a plain relative path", relative)
            below = os.open(component, DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = below
            if same_device and os.fstat(fd).st_dev != device:
                raise OSError(errno.EXDEV, "another filesystem is mounted there", relative)
        result, fd = fd, -1
        return result
    finally:
        if fd >= 0:
            os.close(fd)


def open_trusted(path: str) -> int:
    """An absolute path whose every directory belongs to root (the slot's root,
    `/run/user`, an attempt's `provider/`), opened one component at a time without
    following a link: a starting point for `open_beneath` and `ensure_directory`."""
    if not path.startswith("/"):
        raise ValueError(f"{path!r} is not absolute")
    root = os.open("/", DIRECTORY)
    try:
        components = path.strip("/")
        return os.dup(root) if not components else _walk(root, components, same_device=False)
    finally:
        os.close(root)


def ensure_directory(
    parent_fd: int,
    name: str,
    *,
    uid: int,
    gid: int,
    mode: int,
    where: str,
    exact_mode: bool = True,
) -> int:
    """The directory `name` in `parent_fd`, created with that owner and mode if absent
    (chown and chmod through its own descriptor), and refused (`podman_directory`)
    unless it is a directory (never a link) of owner `uid` and mode `mode` (with
    `exact_mode` false: not writable by group or others). Returns its descriptor."""
    created = False
    try:
        os.mkdir(name, 0o700, dir_fd=parent_fd)
        created = True
    except FileExistsError:
        pass
    try:
        fd = os.open(name, DIRECTORY, dir_fd=parent_fd)
    except OSError as error:
        raise ProviderError(
            "podman_directory",
            f"{where} is not a directory ({error.strerror}); remove what is there",
        ) from error
    try:
        if created:
            os.fchown(fd, uid, gid)
            os.fchmod(fd, mode)
        st = os.fstat(fd)
        wrong_mode = stat.S_IMODE(st.st_mode) != mode if exact_mode else st.st_mode & 0o022
        if st.st_uid != uid or wrong_mode or st.st_dev != os.fstat(parent_fd).st_dev:
            raise ProviderError(
                "podman_directory",
                f"{where} must be a directory owned by uid {uid} with mode {mode:04o} "
                f"(found {stat.filemode(st.st_mode)} uid {st.st_uid}); remove or fix it",
            )
    except BaseException:
        os.close(fd)
        raise
    return fd


def unlink_entry(dir_fd: int, name: str) -> bool:
    """Remove the name `name` (never a directory) from `dir_fd`; False if absent."""
    try:
        os.unlink(name, dir_fd=dir_fd)
    except FileNotFoundError:
        return False
    return True


def remove_entry(dir_fd: int, name: str, where: str) -> list[str]:
    """Remove `name` from `dir_fd`, whatever it is (a link or a file as a name, a
    directory with everything below it), and return what could not be removed, each
    with its path (`where` names `name` in messages); empty when it is gone."""
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return []
    except OSError as error:
        return [f"{where}: {error.strerror}"]
    if not stat.S_ISDIR(st.st_mode):
        return _unlinked(dir_fd, name, where)
    if st.st_dev != os.fstat(dir_fd).st_dev:
        return [f"{where}: another filesystem is mounted there"]
    return _Removal(st.st_dev).tree(dir_fd, name, where)


def refuse_leftovers(code: str, problems: list[str], what: str) -> None:
    """Raise `code` naming what could not be removed (at most `MAX_REPORTED` paths)."""
    if not problems:
        return
    shown = "; ".join(problems[:MAX_REPORTED])
    more = len(problems) - MAX_REPORTED
    tail = f" (and {more} more)" if more > 0 else ""
    raise ProviderError(
        code,
        f"{what} could not be removed: {shown}{tail}; remove them by hand (as root, "
        "without following links) and release the slot again",
    )


def _unlinked(dir_fd: int, name: str, where: str) -> list[str]:
    try:
        os.unlink(name, dir_fd=dir_fd)
    except FileNotFoundError:
        pass
    except OSError as error:
        return [f"{where}: {error.strerror}"]
    return []


@dataclass
class _Frame:
    """A directory being emptied: its path for messages, the identity of the directory
    it was entered from, and its subdirectories still to visit."""

    path: str
    parent: tuple[int, int]
    pending: list[str] = field(default_factory=list)


def _key(fd: int) -> tuple[int, int]:
    st = os.fstat(fd)
    return st.st_dev, st.st_ino


class _Removal:
    """One iterative removal on one filesystem, collecting what it could not remove."""

    def __init__(self, device: int) -> None:
        self.device = device
        self.problems: list[str] = []

    def tree(self, parent_fd: int, name: str, where: str) -> list[str]:
        try:
            fd = os.open(name, DIRECTORY, dir_fd=parent_fd)
        except OSError as error:
            return [f"{where}: {error.strerror}"]
        frames = [_Frame(where, _key(parent_fd), self._clear(fd, where))]
        try:
            while frames:
                frame = frames[-1]
                if frame.pending:
                    child = frame.pending.pop()
                    below = self._enter(fd, child, f"{frame.path}/{child}")
                    if below is not None:
                        frames.append(_Frame(f"{frame.path}/{child}", _key(fd)))
                        frames[-1].pending = self._clear(below, frames[-1].path)
                        os.close(fd)
                        fd = below
                    continue
                frames.pop()
                up = os.open("..", DIRECTORY, dir_fd=fd)
                if _key(up) != frame.parent:
                    os.close(up)
                    self.problems.append(f"{frame.path}: moved while it was being removed")
                    return self.problems
                os.close(fd)
                fd = up
                try:
                    os.rmdir(os.path.basename(frame.path), dir_fd=fd)
                except OSError as error:
                    self.problems.append(f"{frame.path}: {error.strerror}")
        finally:
            os.close(fd)
        return self.problems

    def _enter(self, fd: int, name: str, path: str) -> int | None:
        try:
            below = os.open(name, DIRECTORY, dir_fd=fd)
        except OSError as error:
            self.problems.append(f"{path}: {error.strerror}")
            return None
        if os.fstat(below).st_dev != self.device:
            os.close(below)
            self.problems.append(f"{path}: another filesystem is mounted there")
            return None
        return below

    def _clear(self, fd: int, path: str) -> list[str]:
        """Unlink every name in `fd` but its subdirectories, which it returns."""
        subdirectories = []
        try:
            names = os.listdir(fd)
        except OSError as error:
            self.problems.append(f"{path}: {error.strerror}")
            return []
        for name in names:
            try:
                st = os.stat(name, dir_fd=fd, follow_symlinks=False)
            except FileNotFoundError:
                continue
            except OSError as error:
                self.problems.append(f"{path}/{name}: {error.strerror}")
                continue
            if stat.S_ISDIR(st.st_mode):
                subdirectories.append(name)
            else:
                self.problems += _unlinked(fd, name, f"{path}/{name}")
        return subdirectories
