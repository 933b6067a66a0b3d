"""Refuse the daemon's state on network or distributed storage (`fstatfs` magic).

The ledger's durability (SQLite WAL, fsync) and the state directory's `flock`, which
keeps a second daemon off the same ledger, hold only on a local filesystem. The type
is read with `fstatfs(2)` from the already open directory descriptor, so neither a
symlink nor a later remount of the path can fool the check. FUSE is refused as a
whole: sshfs, s3fs or a GlusterFS client share its magic with local FUSE filesystems.
"""

from __future__ import annotations

import ctypes
import functools
import os
from typing import Final

from ficc.execution.host.core.codes import HostCode
from ficc.execution.host.core.errors import HostError

NETWORK_FILESYSTEMS: Final[dict[int, str]] = {
    0x6969: "NFS",
    0x517B: "SMB",
    0xFF534D42: "CIFS",
    0xFE534D42: "SMB2/SMB3",
    0x00C36400: "Ceph",
    0x65735546: "FUSE (sshfs, s3fs, GlusterFS and other network clients use it)",
    0x01021997: "9p",
    0x5346414F: "AFS",
    0x6B414653: "kAFS",
    0x73757245: "Coda",
    0x564C: "NCP",
    0x01161970: "GFS2",
    0x7461636F: "OCFS2",
    0x0BD00BD0: "Lustre",
    0x47504653: "GPFS",
    0x20030528: "OrangeFS",
    0xAAD7AAEA: "PanFS",
    0x786F4256: "VirtualBox shared folder",
}
"""`f_type` magic numbers of network, cluster and distributed filesystems."""

_STATFS_BUFFER = 512
"""Larger than `struct statfs` on every Linux ABI; only `f_type`, its first field, is read."""


@functools.cache
def _libc() -> ctypes.CDLL:
    """The C library the interpreter itself is linked with (no library search)."""
    return ctypes.CDLL(None, use_errno=True)


def filesystem_magic(fd: int) -> int:
    """The `f_type` of the filesystem holding the open descriptor `fd`."""
    buffer = ctypes.create_string_buffer(_STATFS_BUFFER)
    if _libc().fstatfs(ctypes.c_int(fd), buffer) != 0:
        error = ctypes.get_errno()
        raise OSError(error, os.strerror(error))
    # f_type is a native long (`__fsword_t`); magics are 32-bit, so mask sign extension.
    return ctypes.c_long.from_buffer(buffer).value & 0xFFFFFFFF


def check_local(fd: int, where: str) -> None:
    """Refuse `where` (open as `fd`) if it is on a network or distributed filesystem."""
    try:
        magic = filesystem_magic(fd)
    except OSError as error:
        raise HostError(
            HostCode.UNSUPPORTED_FILESYSTEM,
            f"cannot tell which filesystem {where} is on ({error.strerror}); put it on a"
            " local filesystem (ext4, xfs, btrfs)",
        ) from None
    name = NETWORK_FILESYSTEMS.get(magic)
    if name is not None:
        raise HostError(
            HostCode.UNSUPPORTED_FILESYSTEM,
            f"{where} is on a network or distributed filesystem ({name}, magic {magic:#x});"
            " the ledger's locking and durability hold only on a local filesystem: move"
            " state_dir to a local filesystem (ext4, xfs, btrfs) of this host",
        )
