"""The host lock: a non-blocking exclusive OS lock on the open `host.lock` descriptor.

Linux: `flock(LOCK_EX | LOCK_NB)`. It belongs to the open file description, so a
second open of `host.lock` (in this or any process) is refused, and it is released
when the last descriptor closes, including by the kernel when a process is killed.
Windows (development only): `LockFileEx(LOCKFILE_EXCLUSIVE_LOCK |
LOCKFILE_FAIL_IMMEDIATELY)` through ctypes, on one byte far past the marker, so
readers of the marker are not blocked (Windows byte-range locks are mandatory). The
system releases it when the handle closes or the process ends. Kernel locks on Linux
are advisory: only writers that take this lock are excluded.
"""

from __future__ import annotations

import ctypes
import sys
from collections.abc import Callable
from typing import Any

from .errors import Locked, Unsupported

_WINDOWS_LOCK_OFFSET = 0x7FFF_FFF0
LOCKFILE_FAIL_IMMEDIATELY = 0x1
LOCKFILE_EXCLUSIVE_LOCK = 0x2
ERROR_LOCK_VIOLATION = 33
ERROR_IO_PENDING = 997


class OVERLAPPED(ctypes.Structure):
    """The Win32 OVERLAPPED (x64 and x86 layout): the lock's offset lives here."""

    _fields_ = (
        ("Internal", ctypes.c_size_t),
        ("InternalHigh", ctypes.c_size_t),
        ("Offset", ctypes.c_uint32),
        ("OffsetHigh", ctypes.c_uint32),
        ("hEvent", ctypes.c_void_p),
    )


def bind_lock_file_ex(kernel32: Any) -> Callable[..., int]:
    """`kernel32.LockFileEx` with its exact prototype: BOOL LockFileEx(HANDLE hFile,
    DWORD dwFlags, DWORD dwReserved, DWORD nNumberOfBytesToLockLow, DWORD
    nNumberOfBytesToLockHigh, LPOVERLAPPED lpOverlapped)."""
    function = kernel32.LockFileEx
    function.argtypes = (
        ctypes.c_void_p,
        ctypes.c_uint32,
        ctypes.c_uint32,
        ctypes.c_uint32,
        ctypes.c_uint32,
        ctypes.POINTER(OVERLAPPED),
    )
    function.restype = ctypes.c_int
    return function  # type: ignore[no-any-return]


def lock_file_ex(handle: int, lock_file: Callable[..., int], last_error: Callable[[], int]) -> None:
    """Lock one byte at `_WINDOWS_LOCK_OFFSET` of `handle` exclusively, without waiting.

    Raises BlockingIOError when another handle holds it (ERROR_LOCK_VIOLATION, or
    ERROR_IO_PENDING on a handle opened for overlapped I/O), OSError otherwise.
    """
    overlapped = OVERLAPPED()
    overlapped.Offset = _WINDOWS_LOCK_OFFSET & 0xFFFFFFFF
    overlapped.OffsetHigh = _WINDOWS_LOCK_OFFSET >> 32
    flags = LOCKFILE_EXCLUSIVE_LOCK | LOCKFILE_FAIL_IMMEDIATELY
    if lock_file(handle, flags, 0, 1, 0, ctypes.byref(overlapped)):
        return
    error = last_error()
    if error in (ERROR_LOCK_VIOLATION, ERROR_IO_PENDING):
        raise BlockingIOError(error, "the lock is held by another handle")
    raise OSError(error, f"LockFileEx failed with Windows error {error}")


def check_platform() -> None:
    """Refuse any system without a lock and durability path we have implemented."""
    if not (sys.platform.startswith("linux") or sys.platform == "win32"):
        raise Unsupported(
            f"ficc-hoststate supports Linux (and Windows for development), not"
            f" {sys.platform}; run it on the Linux host"
        )


def lock_exclusive(fd: int, path: str) -> None:
    """Take the host lock on `fd` without waiting; raise Locked if someone holds it."""
    try:
        _lock(fd)
    except BlockingIOError as exc:
        raise Locked(
            f"{path}/host.lock is held by another session; only one runner per host may"
            " hold it. Wait for it to close; never delete host.lock to get past this"
        ) from exc


if sys.platform == "win32":
    import msvcrt

    _LOCK_FILE_EX = bind_lock_file_ex(ctypes.WinDLL("kernel32", use_last_error=True))

    def _lock(fd: int) -> None:
        lock_file_ex(msvcrt.get_osfhandle(fd), _LOCK_FILE_EX, ctypes.get_last_error)

else:
    import fcntl

    def _lock(fd: int) -> None:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
