"""The host lock: a non-blocking exclusive OS lock on the open `host.lock` descriptor.

Linux: `flock(LOCK_EX | LOCK_NB)`. It belongs to the open file description, so a
second open of `host.lock` (in this or any process) is refused, and it is released
when the last descriptor closes, including by the kernel when a process is killed.
Windows (development only): `msvcrt.locking` (LockFile) on one byte far past the
marker, so readers of the marker are not blocked. Kernel locks are advisory: only
writers that take this lock are excluded.
"""

from __future__ import annotations

import os
import sys

from .errors import Locked, Unsupported

_WINDOWS_LOCK_OFFSET = 0x7FFF_FFF0


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

    def _lock(fd: int) -> None:
        os.lseek(fd, _WINDOWS_LOCK_OFFSET, os.SEEK_SET)
        try:
            msvcrt.locking(fd, msvcrt.LK_NBLCK, 1)
        except OSError as exc:  # EACCES or EDEADLOCK: someone else holds the region
            raise BlockingIOError(exc.errno, exc.strerror) from exc
        os.lseek(fd, 0, os.SEEK_SET)  # the marker is read from the start

else:
    import fcntl

    def _lock(fd: int) -> None:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
