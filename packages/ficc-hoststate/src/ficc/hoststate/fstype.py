"""Refuse a state directory on network or distributed storage (Linux, `fstatfs`).

The lock and the durability promises hold only on a local filesystem: `flock` on NFS
or SMB is emulated (or silently local to one client), and a rename or an fsync there
is only as durable as the server and the protocol make it. The filesystem is
identified by the `f_type` magic number `fstatfs(2)` reports for the open directory
descriptor, so a symlink or a later remount cannot fool the check.

FUSE is refused as a whole: its magic is the same for sshfs, s3fs or a GlusterFS
client as for a local FUSE filesystem, and telling them apart would need trusting
what the FUSE server says about itself.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import os
import sys

from .errors import UnsupportedFilesystem

NETWORK_FILESYSTEMS: dict[int, str] = {
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
"""`f_type` magic numbers (linux/magic.h and the filesystems' own sources) of network,
cluster and distributed filesystems, with the name an operator recognises."""

_STATFS_BUFFER = 512
"""Larger than `struct statfs` on every Linux ABI; only `f_type`, its first field, is read."""


@functools.cache
def _libc() -> ctypes.CDLL:
    """The C library the interpreter itself is linked with (no library search)."""
    return ctypes.CDLL(None, use_errno=True)


def filesystem_magic(fd: int) -> int:
    """The `f_type` of the filesystem holding the open descriptor `fd`."""
    libc = _libc()
    buffer = ctypes.create_string_buffer(_STATFS_BUFFER)
    if libc.fstatfs(ctypes.c_int(fd), buffer) != 0:
        error = ctypes.get_errno()
        raise OSError(error, os.strerror(error or errno.EIO))
    # f_type is a native long (`__fsword_t`); magics are 32-bit, so mask sign extension.
    return ctypes.c_long.from_buffer(buffer).value & 0xFFFFFFFF


def check_local(fd: int, what: str) -> None:
    """Refuse `what` (open as `fd`) if it is on a network or distributed filesystem."""
    if not sys.platform.startswith("linux"):
        return  # Windows (development only): shares are not detected; see the docs
    try:
        magic = filesystem_magic(fd)
    except OSError as exc:
        raise UnsupportedFilesystem(
            f"cannot tell which filesystem {what} is on ({exc.strerror}); put the state"
            " directory on a local filesystem (ext4, xfs, btrfs, tmpfs)"
        ) from None
    name = NETWORK_FILESYSTEMS.get(magic)
    if name is not None:
        raise UnsupportedFilesystem(
            f"{what} is on a network or distributed filesystem ({name}, magic"
            f" {magic:#x}); its locking and durability are not supported: move the state"
            " directory to a local filesystem (ext4, xfs, btrfs) of this host"
        )
