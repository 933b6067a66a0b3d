"""A slot is a finite filesystem of its own, bound by identity, run by its own account.

Disk is enforced by the kernel, not counted: a payload can write only where its slot's
filesystem ends, so a slot must BE a filesystem, not a directory on a shared one. The
checks here are what makes that true, and they fail closed:

- the slot path is the root of a mount (the directory is the top of its filesystem,
  not a directory inside one, not a bind of a subdirectory), on a device no other slot,
  `state_dir` or `/` uses;
- the filesystem is ext2/3/4 or xfs (overwriting a file in place needs no free space
  there, which the exit status of a job that filled its slot depends on; copy-on-write
  filesystems such as btrfs give none of the guarantees below);
- the mount is `nodev,nosuid`;
- the filesystem holds at least the configured `storage_bytes` (counted as what an
  unprivileged writer may use) and `storage_inodes`;
- its UUID equals the configured `filesystem_uuid`. This binding is what catches a
  mount that failed at boot (an empty directory on the root filesystem is left in its
  place) or another filesystem mounted there; it is checked at startup and again
  before each attempt's storage is used.

The slot account must exist with the configured UID and GID, use a shell that cannot
log in, have that group as its own (no other account's primary group, no members) and
belong to no other group.

A slot on a loop device is backed by an image file, which must be root's alone (its
directory trusted like the configuration's, the file 0600 with one link) and allocated
in full: a hole in it (`fstrim` punches them) would let a payload that fills its slot
take the room from the filesystem the image lives on, so holes are allocated again,
at startup and before each attempt.

The UUID is read with the FS_IOC_GETFSUUID ioctl where the kernel has it (Linux 6.9
and later), else from the superblock on the mount's block device.

Only the mount table line of the slot's own mount is parsed, so a strange mount
elsewhere (a user's FUSE mount with a name that is not UTF-8) cannot refuse a slot.

`usage` reads how full a slot is; the pipeline uses it to tell that a payload ran its
slot out of space or inodes. `in_use` reads what is in use, for an attempt's usage.
"""

from __future__ import annotations

import errno
import fcntl
import grp
import os
import pwd
import stat
import uuid
from collections.abc import Callable, Iterable
from typing import Final, NamedTuple, Protocol

from ficc.execution.host.core.codes import HostCode
from ficc.execution.host.core.errors import HostError
from ficc.execution.host.linux import evidence as evidencelib
from ficc.execution.host.linux import procparse

NOLOGIN_SHELLS: Final = frozenset(
    {"/usr/sbin/nologin", "/sbin/nologin", "/usr/bin/nologin", "/bin/false", "/usr/bin/false"}
)
FILESYSTEM_TYPES: Final = frozenset({"ext2", "ext3", "ext4", "xfs"})
OpenParent = Callable[[str, str], int]
"""Opens a directory path trusted like the configuration's (`config.open_image_parent`)."""
FULL_BYTES: Final = 1 << 20
"""Less than this left to an unprivileged writer counts as a full slot."""
FULL_INODES: Final = 16
"""Fewer free inodes than this counts as a full slot."""

_FS_IOC_GETFSUUID: Final = (2 << 30) | (17 << 16) | (0x15 << 8)
"""_IOR(0x15, 0, struct fsuuid2 {u8 len; u8 uuid[16];})"""
_DIR_FLAGS: Final = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class SlotSpec(Protocol):
    """The slot fields the checks need (the configuration's `Slot` fits)."""

    @property
    def id(self) -> str: ...
    @property
    def path(self) -> str: ...
    @property
    def uid(self) -> int: ...
    @property
    def gid(self) -> int: ...
    @property
    def storage_bytes(self) -> int: ...
    @property
    def storage_inodes(self) -> int: ...
    @property
    def filesystem_uuid(self) -> str: ...


class Usage(NamedTuple):
    """How much of a slot filesystem an unprivileged writer can still use."""

    free_bytes: int
    free_inodes: int

    @property
    def bytes_exhausted(self) -> bool:
        return self.free_bytes < FULL_BYTES

    @property
    def inodes_exhausted(self) -> bool:
        return self.free_inodes < FULL_INODES


def _refuse(code: str, key: str, problem: str, fix: str) -> HostError:
    return HostError(code, f"{key}: {problem}; {fix}")


# --- the filesystem -------------------------------------------------------------------


def check_filesystem(slot: SlotSpec, key: str, dir_fd: int, open_parent: OpenParent) -> int:
    """Check the open slot directory `dir_fd` is the slot's own filesystem (see module
    docstring); returns its device number. Code `slot_filesystem` on any refusal,
    `slot_identity` for another filesystem."""
    mount = mount_of(dir_fd, key)
    _check_mount_root(slot, key, mount)
    if mount.fs_type not in FILESYSTEM_TYPES:
        raise _refuse(
            HostCode.SLOT_FILESYSTEM,
            key,
            f"{slot.path} is {mount.fs_type}, not one of {', '.join(sorted(FILESYSTEM_TYPES))}",
            "make the slot an ext4 filesystem (`ficc-executor provision-slot`)",
        )
    _check_options(slot, key, dir_fd)
    _check_size(slot, key, dir_fd)
    check_identity(slot, key, dir_fd, mount)
    _check_backing_file(key, mount, open_parent)
    return os.fstat(dir_fd).st_dev


def _check_mount_root(slot: SlotSpec, key: str, mount: evidencelib.Mount) -> None:
    if mount.root != "/" or mount.mount_point != slot.path:
        where = mount.mount_point if mount.root == "/" else f"{mount.root} of {mount.source}"
        raise _refuse(
            HostCode.SLOT_FILESYSTEM,
            key,
            f"{slot.path} is not the root of its own filesystem (it is inside {where})",
            "if its filesystem exists but is not mounted (a mount that failed at boot), mount"
            " it again: `systemctl start` its mount unit, `mount` its /etc/fstab line, or"
            " `ficc-executor provision-slot --remount --image IMAGE --mount PATH`; for a new"
            " slot, make one with `ficc-executor provision-slot` (docs/operations.md)",
        )


def check_identity(
    slot: SlotSpec, key: str, dir_fd: int, mount: evidencelib.Mount | None = None
) -> None:
    """The filesystem at `dir_fd` has the configured UUID (code `slot_identity`)."""
    found = filesystem_uuid(dir_fd, mount if mount is not None else mount_of(dir_fd, key))
    if found != slot.filesystem_uuid:
        raise _refuse(
            HostCode.SLOT_IDENTITY,
            key,
            f"{slot.path} holds filesystem {found or 'without a UUID'}, "
            f"not the configured {slot.filesystem_uuid}",
            "mount the slot's own filesystem there (a mount that failed at boot leaves an "
            "empty directory), or correct filesystem_uuid if the slot was re-made",
        )


def verify(slot: SlotSpec, open_parent: OpenParent) -> None:
    """Before an attempt's storage is used: the slot path is still the root of the
    `nodev,nosuid` filesystem with the configured UUID, its image (if any) still
    allocated in full. Cheap: one open, one ioctl, one mount table line, one fstat."""
    key = f"slot {slot.id}"
    try:
        fd = os.open(slot.path, _DIR_FLAGS)
    except OSError as error:
        raise _refuse(
            HostCode.SLOT_FILESYSTEM,
            key,
            f"cannot open {slot.path}: {error.strerror}",
            "check the mount",
        ) from None
    try:
        mount = mount_of(fd, key)
        _check_mount_root(slot, key, mount)
        _check_options(slot, key, fd)
        _check_writable(slot, key, fd)
        check_identity(slot, key, fd, mount)
        _check_backing_file(key, mount, open_parent)
    except OSError as error:
        raise _refuse(
            HostCode.SLOT_FILESYSTEM, key, f"cannot check {slot.path}: {error}", "check the mount"
        ) from None
    finally:
        os.close(fd)


def check_distinct(devices: Iterable[tuple[str, int]], others: Iterable[tuple[str, int]]) -> None:
    """No two slots share a device, and no slot is on `/`'s or `state_dir`'s device."""
    seen: dict[int, str] = dict((device, key) for key, device in others)
    for key, device in devices:
        if device in seen:
            raise _refuse(
                HostCode.SLOT_FILESYSTEM,
                key,
                f"is on the same filesystem as {seen[device]}",
                "give every slot a filesystem of its own",
            )
        seen[device] = key


def usage(path: str) -> Usage:
    """Free bytes and inodes an unprivileged writer still has on the slot at `path`."""
    st = os.statvfs(path)
    return Usage(free_bytes=st.f_bavail * st.f_frsize, free_inodes=st.f_favail)


def in_use(path: str) -> tuple[int, int]:
    """(bytes, inodes) in use on the slot's filesystem at `path` (what an attempt's usage
    reports: everything on it, the attempt's logs and files included)."""
    st = os.statvfs(path)
    return (st.f_blocks - st.f_bfree) * st.f_frsize, st.f_files - st.f_ffree


def mount_of(dir_fd: int, key: str) -> evidencelib.Mount:
    """The mount `dir_fd` is on, found by the mount ID the kernel reports for the fd."""
    try:
        with open(f"/proc/self/fdinfo/{dir_fd}", "rb") as info:
            _, mount_id = procparse.parse_fdinfo(info.read())
        with open("/proc/self/mountinfo", "rb") as table:
            mount = None if mount_id is None else procparse.find_mount(table.read(), mount_id)
    except (OSError, HostError) as error:
        raise _refuse(
            HostCode.SLOT_FILESYSTEM, key, f"cannot read its mount: {error}", "check /proc"
        ) from None
    if mount is None:
        raise _refuse(
            HostCode.SLOT_FILESYSTEM, key, "its mount is not in the mount table", "check it"
        )
    return mount


def _check_backing_file(key: str, mount: evidencelib.Mount, open_parent: OpenParent) -> None:
    """A loop-mounted slot's image file: root's alone and allocated in full."""
    try:
        with open(f"/sys/dev/block/{mount.major}:{mount.minor}/loop/backing_file") as f:
            image = f.read().rstrip("\n")
    except FileNotFoundError:
        return  # not a loop device: a partition or a logical volume
    parent, name = os.path.split(image)
    if not image.startswith("/") or os.path.normpath(image) != image or not name:
        raise _refuse(
            HostCode.SLOT_FILESYSTEM,
            key,
            f"its loop device is backed by {image!r}, not a file path",
            "mount the slot's image file again (it was deleted or renamed)",
        )
    parent_fd = open_parent(parent, f"{key} image {image}")
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=parent_fd)
    finally:
        os.close(parent_fd)
    try:
        st = os.fstat(fd)
        if (
            not stat.S_ISREG(st.st_mode)
            or st.st_uid != 0
            or stat.S_IMODE(st.st_mode) & 0o077
            or st.st_nlink != 1
        ):
            raise _refuse(
                HostCode.SLOT_FILESYSTEM,
                key,
                f"its image {image} is not a root-owned 0600 file with one link",
                f"chown root:root {image} && chmod 0600 {image}",
            )
        if st.st_blocks * 512 < st.st_size:
            _allocate_holes(fd, st.st_size, key, image)
    finally:
        os.close(fd)


def _allocate_holes(fd: int, size: int, key: str, image: str) -> None:
    """Allocate what `fstrim` (or a sparse copy) punched out of the image again; the
    data in it is left as it is. Reopened for writing through the fd just checked."""
    try:
        writable = os.open(f"/proc/self/fd/{fd}", os.O_WRONLY | os.O_CLOEXEC)
        try:
            os.posix_fallocate(writable, 0, size)
        finally:
            os.close(writable)
    except OSError as error:
        raise _refuse(
            HostCode.SLOT_FILESYSTEM,
            key,
            f"its image {image} has holes and cannot be allocated in full: {error.strerror}",
            "free space on the image's filesystem (the slot's room must be reserved there)",
        ) from None


def _check_options(slot: SlotSpec, key: str, dir_fd: int) -> None:
    flags = os.fstatvfs(dir_fd).f_flag
    missing = [
        name for name, bit in (("nodev", os.ST_NODEV), ("nosuid", os.ST_NOSUID)) if not flags & bit
    ]
    if missing:
        raise _refuse(
            HostCode.SLOT_FILESYSTEM,
            key,
            f"{slot.path} is mounted without {','.join(missing)}",
            "mount it with -o nodev,nosuid (and the same options in /etc/fstab or its mount unit)",
        )


def _check_writable(slot: SlotSpec, key: str, dir_fd: int) -> None:
    """Refuse new work on a slot mounted read-only (ext4 remounts itself so after an
    error with `errors=remount-ro`). Only before an attempt's storage is used: a
    read-only slot at startup does not keep the daemon from recovering the others."""
    if os.fstatvfs(dir_fd).f_flag & os.ST_RDONLY:
        raise _refuse(
            HostCode.SLOT_FILESYSTEM,
            key,
            f"{slot.path} is mounted read-only (after a filesystem error?)",
            "check the filesystem (e2fsck) and mount it read-write again",
        )


def _check_size(slot: SlotSpec, key: str, dir_fd: int) -> None:
    st = os.fstatvfs(dir_fd)
    root_only = st.f_bfree - st.f_bavail
    usable = (st.f_blocks - root_only) * st.f_frsize
    if usable < slot.storage_bytes:
        raise _refuse(
            HostCode.SLOT_FILESYSTEM,
            key,
            f"{slot.path} holds {usable} bytes for the slot account, less than "
            f"storage_bytes {slot.storage_bytes}",
            "make the filesystem larger or lower storage_bytes",
        )
    if st.f_files < slot.storage_inodes:
        raise _refuse(
            HostCode.SLOT_FILESYSTEM,
            key,
            f"{slot.path} has {st.f_files} inodes, fewer than storage_inodes {slot.storage_inodes}",
            "make the filesystem with more inodes (mkfs.ext4 -N) or lower storage_inodes",
        )


# --- the filesystem's UUID ------------------------------------------------------------


def filesystem_uuid(dir_fd: int, mount: evidencelib.Mount) -> str | None:
    """The UUID of the filesystem at `dir_fd` (canonical lowercase), or None if it has
    none this host can read."""
    buffer = bytearray(17)
    try:
        fcntl.ioctl(dir_fd, _FS_IOC_GETFSUUID, buffer)
    except OSError as error:
        if error.errno not in (errno.ENOTTY, errno.EINVAL, errno.EOPNOTSUPP, errno.ENOSYS):
            raise
        return _superblock_uuid(mount)
    length = buffer[0]
    return str(uuid.UUID(bytes=bytes(buffer[1:17]))) if length == 16 else None


_SUPERBLOCKS: Final = (
    # (filesystem types, magic offset, magic bytes, uuid offset)
    (("ext2", "ext3", "ext4"), 1024 + 0x38, b"\x53\xef", 1024 + 0x68),
    (("xfs",), 0, b"XFSB", 32),
    (("btrfs",), 0x10000 + 0x40, b"_BHRfS_M", 0x10000 + 0x20),
)


def _superblock_uuid(mount: evidencelib.Mount) -> str | None:
    """Read the UUID from the superblock of the mount's block device (older kernels)."""
    layout = next((entry[1:] for entry in _SUPERBLOCKS if mount.fs_type in entry[0]), None)
    if layout is None:
        return None
    magic_at, magic, uuid_at = layout
    try:
        # /dev/mapper/NAME is a link: followed, the node's type and number are checked
        fd = os.open(mount.source, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISBLK(st.st_mode) or st.st_rdev != os.makedev(mount.major, mount.minor):
            return None
        if os.pread(fd, len(magic), magic_at) != magic:
            return None
        raw = os.pread(fd, 16, uuid_at)
    finally:
        os.close(fd)
    return str(uuid.UUID(bytes=raw)) if len(raw) == 16 else None


# --- the slot account -----------------------------------------------------------------


def _group_name(gid: int) -> str:
    """A group's name for a refusal (its GID when it has no entry)."""
    try:
        return grp.getgrgid(gid).gr_name
    except KeyError:
        return str(gid)


def check_account(slot: SlotSpec, key: str) -> None:
    """The slot account exists as configured and can do nothing but run slot work."""
    try:
        account = pwd.getpwuid(slot.uid)
    except KeyError:
        raise _refuse(
            HostCode.SLOT_ACCOUNT,
            key,
            f"no account has UID {slot.uid}",
            f"create it with its own group: groupadd --system --gid {slot.gid} NAME &&"
            f" useradd --system --uid {slot.uid} --gid {slot.gid} --no-create-home"
            " --shell /usr/sbin/nologin NAME",
        ) from None
    name = account.pw_name
    if account.pw_gid != slot.gid:
        raise _refuse(
            HostCode.SLOT_ACCOUNT,
            key,
            f"account {name} has primary GID {account.pw_gid}, not the configured {slot.gid}",
            "set gid to the account's own group",
        )
    if account.pw_shell not in NOLOGIN_SHELLS:
        raise _refuse(
            HostCode.SLOT_ACCOUNT,
            key,
            f"account {name} has login shell {account.pw_shell or '(empty: /bin/sh)'}",
            f"usermod --shell /usr/sbin/nologin {name}",
        )
    _check_own_group(slot, key, name)


def _check_own_group(slot: SlotSpec, key: str, name: str) -> None:
    try:
        group = grp.getgrgid(slot.gid)
    except KeyError:
        raise _refuse(
            HostCode.SLOT_ACCOUNT,
            key,
            f"no group has GID {slot.gid}",
            f"groupadd --gid {slot.gid} {name}",
        ) from None
    sharing = [p.pw_name for p in pwd.getpwall() if p.pw_gid == slot.gid and p.pw_uid != slot.uid]
    if sharing or group.gr_mem:
        others = sorted(set(sharing) | set(group.gr_mem))
        raise _refuse(
            HostCode.SLOT_ACCOUNT,
            key,
            f"group {group.gr_name} (GID {slot.gid}) is shared with {', '.join(others)}",
            "give the slot account a group of its own",
        )
    extra = sorted(set(os.getgrouplist(name, slot.gid)) - {slot.gid})
    if extra:
        names = [_group_name(gid) for gid in extra]
        shown = ", ".join(f"{n} (GID {gid})" for n, gid in zip(names, extra, strict=True))
        raise _refuse(
            HostCode.SLOT_ACCOUNT,
            key,
            f"account {name} is also in groups {shown}",
            f"remove it from each: gpasswd -d {name} {names[0]}",
        )
