"""The ledger cannot fill the host: its bounds, and the reserve that keeps it writable.

Records are never deleted, so without a bound the ledger (and whatever else shares
`state_dir`'s filesystem) would grow until the disk is full. Two configured bounds stop
that, and admission is the only door they close:

- `ledger_max_bytes` caps the database. SQLite enforces it as a hard limit
  (`PRAGMA max_page_count`); admission stops an eighth below it (`headroom`), so the
  changes of records already admitted (renew, start, stop, observe, release, cleanup)
  still fit after admission has been refused.
- `state_dir_min_free_bytes` is the free space `state_dir`'s filesystem keeps:
  admission stops before a request would leave less.

Something else may still fill the filesystem to the last byte. For that the ledger
keeps a preallocated reserve file in `state_dir` (`RESERVE_FILE`): when a write
fails because the disk is full, the ledger deletes the reserve and runs that
transaction once more, and it makes the reserve again once there is room.

The arithmetic (`admission_refusal`, `request_bytes`) is pure; the reserve functions
work on the state directory's fd.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Final, NamedTuple

from ficc.execution.host.core.errors import HostError
from ficc.execution.host.linux import fsutil

MIB: Final = 1 << 20
DEFAULT_LEDGER_MAX_BYTES: Final = 1 << 30
DEFAULT_MIN_FREE_BYTES: Final = 64 * MIB
MIN_LEDGER_MAX_BYTES: Final = 1 * MIB
RESERVE_FILE: Final = "ledger.reserve"
RESERVE_BYTES: Final = 8 * MIB
RECORD_BYTES: Final = 1024
"""What one new record costs beyond its plan's bytes: its other columns, its index
entries and its streamed inputs' rows (measured well under this)."""


@dataclass(frozen=True)
class SpaceBounds:
    """The configured bounds of the ledger's space."""

    ledger_max_bytes: int
    min_free_bytes: int
    reserve_bytes: int = RESERVE_BYTES

    @property
    def headroom(self) -> int:
        """What admission leaves below `ledger_max_bytes` for records already admitted."""
        return self.ledger_max_bytes // 8

    @property
    def admission_bytes(self) -> int:
        """The ledger size past which admission is refused."""
        return self.ledger_max_bytes - self.headroom

    def max_page_count(self, page_size: int) -> int:
        """SQLite's hard limit on the database, in pages."""
        return max(1, self.ledger_max_bytes // page_size)


class Space(NamedTuple):
    """What the ledger uses and what its filesystem has left, measured now."""

    ledger_bytes: int
    """The database's size in pages times the page size (what `max_page_count` caps)."""
    free_bytes: int
    """Bytes an unprivileged writer could still allocate on `state_dir`'s filesystem."""


def request_bytes(plan_sizes: Iterable[int]) -> int:
    """What recording new records for plans of these encoded sizes may add, erring high:
    each record's bytes twice, once in the write-ahead log and once in the database."""
    return sum(2 * (size + RECORD_BYTES) for size in plan_sizes)


def admission_refusal(space: Space, wanted: int, bounds: SpaceBounds) -> str | None:
    """Why a request wanting `wanted` more bytes must not be admitted, or None."""
    if space.ledger_bytes + wanted > bounds.admission_bytes:
        return (
            f"the ledger holds {space.ledger_bytes} bytes and this request may add {wanted};"
            f" admission stops at {bounds.admission_bytes} (ledger_max_bytes"
            f" {bounds.ledger_max_bytes} less the eighth kept for admitted work):"
            " raise ledger_max_bytes, or move state_dir to a new ledger"
        )
    if space.free_bytes - wanted < bounds.min_free_bytes:
        return (
            f"state_dir's filesystem has {space.free_bytes} bytes free and this request may"
            f" use {wanted}; state_dir_min_free_bytes keeps {bounds.min_free_bytes} free:"
            " free space on that filesystem"
        )
    return None


def free_bytes(dir_fd: int) -> int:
    """Free bytes for unprivileged writers on the filesystem of `dir_fd` (the root-only
    blocks of ext4 are not counted: they are the last resort of the whole system)."""
    st = os.fstatvfs(dir_fd)
    return st.f_bavail * st.f_frsize


def has_reserve(dir_fd: int, size: int = RESERVE_BYTES) -> bool:
    """Whether the whole reserve is there (a crash while making it can leave it short)."""
    try:
        st = os.stat(RESERVE_FILE, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    return st.st_size >= size


def make_reserve(dir_fd: int, bounds: SpaceBounds) -> bool:
    """Allocate the reserve if it is missing and the filesystem has room for it above the
    floor; whether a reserve is there afterwards. Never raises: a reserve that cannot be
    made (no room, a filesystem error) is only missing, and a half-made one is removed."""
    if has_reserve(dir_fd, bounds.reserve_bytes):
        return True
    drop_reserve(dir_fd)  # a short one, left by a crash while it was made
    if free_bytes(dir_fd) < bounds.reserve_bytes + bounds.min_free_bytes:
        return False
    try:
        fd = fsutil.create_exclusive(dir_fd, RESERVE_FILE, 0o600)
    except HostError:
        return False
    try:
        os.posix_fallocate(fd, 0, bounds.reserve_bytes)
        os.fsync(fd)
    except OSError:
        drop_reserve(dir_fd)
        return False
    finally:
        os.close(fd)
    with contextlib.suppress(OSError):
        fsutil.fsync_dir(dir_fd)
    return True


def drop_reserve(dir_fd: int) -> bool:
    """Delete the reserve, freeing its space; whether there was one."""
    try:
        os.unlink(RESERVE_FILE, dir_fd=dir_fd)
    except OSError:
        return False
    with contextlib.suppress(OSError):
        fsutil.fsync_dir(dir_fd)
    return True


__all__ = [
    "DEFAULT_LEDGER_MAX_BYTES",
    "DEFAULT_MIN_FREE_BYTES",
    "MIN_LEDGER_MAX_BYTES",
    "RESERVE_BYTES",
    "RESERVE_FILE",
    "Space",
    "SpaceBounds",
    "admission_refusal",
    "drop_reserve",
    "free_bytes",
    "has_reserve",
    "make_reserve",
    "request_bytes",
]
