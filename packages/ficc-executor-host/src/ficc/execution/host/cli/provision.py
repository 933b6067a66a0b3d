"""Provisioning a slot filesystem: `ficc-executor provision-slot`.

A slot must be a filesystem of its own (`slotfs`). On a host with a spare partition or
logical volume, that device is formatted; on a host without one, an image file on an
existing filesystem is allocated in full (never sparse: the slot's room is taken from
that filesystem now, not when the payload writes), formatted and loop-mounted. Either
way the result is an ext4 filesystem made for the slot:

- `-m 0`: no blocks reserved for root, so what `statvfs` reports is what the slot
  account can use, and the configured `storage_bytes` is checked against that;
- `-N storage_inodes`, and the image grown until the mounted filesystem really holds
  `storage_bytes` for the slot account (ext4's own metadata takes a share);
- mounted `nodev,nosuid`, root directory owned by root, mode 0755;
- optionally made persistent with an `/etc/fstab` line or a systemd mount unit, with
  `nofail`: a mount that fails at boot leaves an empty directory, which the daemon
  refuses by the filesystem UUID it prints (`filesystem_uuid` in the configuration).

The functions are also what the project's tests and tools use to make and remove real
slot filesystems, so the shipped tool is the tested one.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import json
import os
import pathlib
import stat
import subprocess
import sys
from dataclasses import dataclass
from typing import Final

from ficc.execution.host.config.trusted import open_trusted_directory
from ficc.execution.host.core.codes import HostCode
from ficc.execution.host.core.errors import HostError
from ficc.execution.host.storage import slotfs

MIB: Final = 1 << 20
MOUNT_OPTIONS: Final = "nodev,nosuid"
_INODE_SIZE: Final = 256
_MAX_TRIES: Final = 6


@dataclass(frozen=True)
class Provisioned:
    """A slot filesystem made and mounted: what the configuration's slot entry needs."""

    mount: str
    source: str
    filesystem_uuid: str
    storage_bytes: int
    storage_inodes: int
    loop: bool


def _run(*argv: str) -> str:
    result = subprocess.run(argv, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        detail = (result.stderr or result.stdout).strip()
        raise HostError(HostCode.PROVISION_FAILED, f"{' '.join(argv)} failed: {detail}")
    return result.stdout


def _first_guess(storage_bytes: int, storage_inodes: int) -> int:
    """Image size: the payload's bytes, the inode table, the journal and ~3% metadata."""
    journal = 4 * MIB if storage_bytes < 512 * MIB else 64 * MIB
    size = storage_bytes + storage_inodes * _INODE_SIZE + journal + storage_bytes // 32 + 2 * MIB
    return -(-size // MIB) * MIB


def _allocate(image: str, size: int) -> None:
    """Give the image all its blocks now: a sparse image would reserve nothing, and a
    slot filling up would then fill the filesystem the image lives on."""
    fd = os.open(image, os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        os.ftruncate(fd, 0)
        os.posix_fallocate(fd, 0, size)
    except OSError as error:
        raise HostError(
            HostCode.PROVISION_FAILED, f"cannot allocate {size} bytes for {image}: {error.strerror}"
        ) from None
    finally:
        os.close(fd)


def _mkfs(source: str, storage_inodes: int, *, force: bool) -> None:
    # -E root_owner: the root directory is root's, whoever runs mkfs; nodiscard: keep an
    # image's allocated blocks (mkfs would punch them out again); lazy_*_init=0: zero the
    # inode tables and journal now, else the kernel zeroes them after the first mount
    # through the loop device, which punches holes into an image on ext4 (measured:
    # about 5 MiB of a 256 MiB slot) and the slot's room is no longer reserved;
    # -F: an image file. mkfs rounds the inode count down to whole block groups: ask
    # for some more.
    inodes = storage_inodes + storage_inodes // 16 + 64
    options = "root_owner=0:0,nodiscard,lazy_itable_init=0,lazy_journal_init=0"
    _run("mkfs.ext4", "-q", *(["-F"] if force else []), "-m", "0", "-N", str(inodes),
         "-E", options, source)  # fmt: skip


def _prepare_mount_point(mount: str) -> None:
    path = pathlib.Path(mount)
    if not path.is_absolute() or os.path.normpath(mount) != mount:
        raise HostError(HostCode.PROVISION_FAILED, f"{mount} is not a normalized absolute path")
    _make_traversable(path)
    if path.is_symlink() or not path.is_dir():
        raise HostError(HostCode.PROVISION_FAILED, f"{mount} is not a directory")
    if os.path.ismount(mount):
        raise HostError(HostCode.PROVISION_FAILED, f"something is already mounted on {mount}")
    if any(path.iterdir()):
        raise HostError(HostCode.PROVISION_FAILED, f"{mount} is not empty; use an empty directory")


def _make_traversable(path: pathlib.Path) -> None:
    """mkdir -p with mode 0755 for each directory made here, whatever the umask (a
    hardened root shell's 0077 would leave them 0700, and the slot accounts must
    traverse them to their slots). Existing directories are left as they are."""
    missing = []
    for directory in (path, *path.parents):
        if directory.exists() or directory.is_symlink():
            break
        missing.append(directory)
    for directory in reversed(missing):
        directory.mkdir(mode=0o755, exist_ok=True)
        os.chmod(directory, 0o755, follow_symlinks=False)  # noqa: S103  (traverse only)


def _fits(mount: str, storage_bytes: int, storage_inodes: int) -> int:
    """How many bytes the mounted filesystem lacks (0 if it holds what the slot needs)."""
    st = os.statvfs(mount)
    usable = (st.f_blocks - (st.f_bfree - st.f_bavail)) * st.f_frsize
    if st.f_files < storage_inodes:
        raise HostError(
            HostCode.PROVISION_FAILED, f"mkfs made {st.f_files} inodes, not {storage_inodes}"
        )
    return max(0, storage_bytes - usable)


def _finish(
    mount: str, source: str, storage_bytes: int, storage_inodes: int, loop: bool
) -> Provisioned:
    os.chown(mount, 0, 0)
    os.chmod(mount, 0o755)  # noqa: S103 (root-owned: the host makes root-private dirs in it)
    fd = os.open(mount, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        found = slotfs.filesystem_uuid(fd, slotfs.mount_of(fd, mount))
    finally:
        os.close(fd)
    if found is None:
        raise HostError(
            HostCode.PROVISION_FAILED, f"cannot read the UUID of the filesystem on {mount}"
        )
    return Provisioned(mount, source, found, storage_bytes, storage_inodes, loop)


def create_image_slot(
    image: str, mount: str, storage_bytes: int, storage_inodes: int
) -> Provisioned:
    """Make `image` (must not exist) an ext4 slot filesystem and loop-mount it on `mount`.

    The image's directory must be root's alone, like the configuration's (the daemon
    checks the same): whoever could replace the image could replace the slot."""
    parent, name = os.path.split(image)
    if not image.startswith("/") or os.path.normpath(image) != image or not name:
        raise HostError(
            HostCode.PROVISION_FAILED, f"{image} is not a normalized absolute file path"
        )
    parent_fd = open_trusted_directory(parent, "--image", HostCode.PROVISION_FAILED)
    try:
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        os.close(os.open(name, flags, 0o600, dir_fd=parent_fd))
    except FileExistsError:
        raise HostError(
            HostCode.PROVISION_FAILED,
            f"{image} already exists. If it is a slot this command made and only its mount"
            f" is missing, mount it again: ficc-executor provision-slot --remount --image"
            f" {image} --mount {mount}; otherwise choose a new file",
        ) from None
    finally:
        os.close(parent_fd)
    _prepare_mount_point(mount)
    size = _first_guess(storage_bytes, storage_inodes)
    try:
        for _ in range(_MAX_TRIES):
            _allocate(image, size)
            _mkfs(image, storage_inodes, force=True)
            _loop_mount(image, mount)
            lacking = _fits(mount, storage_bytes, storage_inodes)
            if not lacking:
                return _finish(mount, image, storage_bytes, storage_inodes, loop=True)
            _run("umount", mount)
            size += -(-(lacking + lacking // 8 + MIB) // MIB) * MIB
        raise HostError(
            HostCode.PROVISION_FAILED, f"could not size {image} for {storage_bytes} bytes"
        )
    except BaseException:
        remove_slot(mount, image)
        raise


def _loop_mount(image: str, mount: str) -> None:
    """`mount -o loop`; where that cannot make a loop device node (a container whose
    /dev is a copy taken when it started), the first free node that exists is used,
    and marked to detach itself when the filesystem is unmounted."""
    result = subprocess.run(
        ["mount", "-t", "ext4", "-o", f"loop,{MOUNT_OPTIONS}", image, mount],
        capture_output=True,
        text=True,
        check=False,
    )
    if result.returncode == 0:
        return
    for node in sorted(glob.glob("/dev/loop[0-9]*"), key=lambda p: int(p[len("/dev/loop") :])):
        attached = subprocess.run(["losetup", node, image], capture_output=True, check=False)
        if attached.returncode != 0:
            continue
        try:
            _run("mount", "-t", "ext4", "-o", MOUNT_OPTIONS, node, mount)
        finally:
            # Clearing a mounted loop device only marks it: it detaches with the unmount.
            subprocess.run(["losetup", "--detach", node], capture_output=True, check=False)
        return
    raise HostError(
        HostCode.PROVISION_FAILED, f"mount -o loop {image} {mount} failed: {result.stderr}"
    )


def create_device_slot(
    device: str, mount: str, storage_bytes: int, storage_inodes: int
) -> Provisioned:
    """Format the block device `device` as an ext4 slot filesystem and mount it."""
    _prepare_mount_point(mount)
    if not os.path.exists(device) or not stat.S_ISBLK(os.stat(device).st_mode):
        raise HostError(HostCode.PROVISION_FAILED, f"{device} is not a block device")
    if _has_signature(device):
        raise HostError(
            HostCode.PROVISION_FAILED,
            f"{device} already holds a filesystem; wipe it first (wipefs -a {device}) "
            "if its data is really unwanted",
        )
    _mkfs(device, storage_inodes, force=False)
    _run("mount", "-t", "ext4", "-o", MOUNT_OPTIONS, device, mount)
    lacking = _fits(mount, storage_bytes, storage_inodes)
    if lacking:
        _run("umount", mount)
        raise HostError(
            HostCode.PROVISION_FAILED, f"{device} lacks {lacking} bytes for storage_bytes"
        )
    return _finish(mount, device, storage_bytes, storage_inodes, loop=False)


def remount_slot(source: str, mount: str, *, loop: bool) -> Provisioned:
    """Mount an existing slot filesystem again (its mount failed at boot, or it was
    unmounted): the same options as when it was made, nothing formatted. The image's
    directory is checked as when it was made; the daemon then checks the filesystem's
    UUID against the configuration, so mounting the wrong one is refused there."""
    if loop:
        parent, name = os.path.split(source)
        if not source.startswith("/") or os.path.normpath(source) != source or not name:
            raise HostError(
                HostCode.PROVISION_FAILED, f"{source} is not a normalized absolute path"
            )
        os.close(open_trusted_directory(parent, "--image", HostCode.PROVISION_FAILED))
        if not os.path.isfile(source) or os.path.islink(source):
            raise HostError(HostCode.PROVISION_FAILED, f"{source} is not an existing image file")
    elif not os.path.exists(source) or not stat.S_ISBLK(os.stat(source).st_mode):
        raise HostError(HostCode.PROVISION_FAILED, f"{source} is not a block device")
    _prepare_mount_point(mount)
    if loop:
        _loop_mount(source, mount)
    else:
        _run("mount", "-t", "ext4", "-o", MOUNT_OPTIONS, source, mount)
    st = os.statvfs(mount)
    usable = (st.f_blocks - (st.f_bfree - st.f_bavail)) * st.f_frsize
    return _finish(mount, source, usable, st.f_files, loop=loop)


def _has_signature(device: str) -> bool:
    result = subprocess.run(["blkid", "-p", device], capture_output=True, check=False)
    return result.returncode != 2  # blkid -p exits 2 only when it finds nothing at all


def remove_slot(mount: str, image: str | None = None) -> None:
    """Unmount `mount` (its loop device detaches with it) and delete `image` if given.
    Quiet about what is already gone: it is what every test's teardown calls."""
    if os.path.ismount(mount):
        subprocess.run(["umount", mount], capture_output=True, check=False)
        if os.path.ismount(mount):
            subprocess.run(["umount", "-l", mount], capture_output=True, check=False)
    if image is not None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(image)


# --- persistence ----------------------------------------------------------------------


def fstab_line(slot: Provisioned) -> str:
    """`X-fstrim.notrim`: `fstrim --fstab` would punch the image's free blocks out (the
    daemon allocates them again, but only at startup and before each attempt)."""
    what = slot.source if slot.loop else f"UUID={slot.filesystem_uuid}"
    options = f"{'loop,' if slot.loop else ''}{MOUNT_OPTIONS},nofail,X-fstrim.notrim"
    return f"{what} {slot.mount} ext4 {options} 0 2\n"


def mount_unit(slot: Provisioned) -> tuple[str, str]:
    """(file name, text) of a systemd mount unit for the slot."""
    name = _run("systemd-escape", "--path", "--suffix=mount", slot.mount).strip()
    what = slot.source if slot.loop else f"/dev/disk/by-uuid/{slot.filesystem_uuid}"
    options = f"{'loop,' if slot.loop else ''}{MOUNT_OPTIONS},nofail"
    text = (
        "[Unit]\n"
        f"Description=ficc slot filesystem {slot.mount}\n"
        "Before=ficc-executor-host.service\n\n"
        "[Mount]\n"
        f"What={what}\nWhere={slot.mount}\nType=ext4\nOptions={options}\n\n"
        "[Install]\nWantedBy=local-fs.target\n"
    )
    return name, text


def _persist(slot: Provisioned, how: str) -> str:
    if how == "fstab":
        line = fstab_line(slot)
        with open("/etc/fstab", "a+", encoding="utf-8") as fstab:
            fstab.seek(0)
            present = fstab.read()
            if line not in present:
                fstab.write(("\n" if present and not present.endswith("\n") else "") + line)
        return f"added to /etc/fstab: {line.strip()}"
    if how == "unit":
        name, text = mount_unit(slot)
        path = pathlib.Path("/etc/systemd/system") / name
        path.write_text(text, encoding="utf-8")
        return f"wrote {path}; run: systemctl daemon-reload && systemctl enable {name}"
    return "not made persistent: mount it again after a reboot before the daemon starts"


# --- the command ----------------------------------------------------------------------


def _size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    scale = units.get(text[-1:].upper(), 1)
    digits = text[:-1] if scale != 1 else text
    if not digits.isdigit() or int(digits) <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size such as 4G, 512M or 1048576")
    return int(digits) * scale


def add_parser(commands: argparse._SubParsersAction, version: str) -> None:  # type: ignore[type-arg]
    """Register `provision-slot` on the `ficc-executor` command."""
    parser = commands.add_parser(
        "provision-slot",
        help="make and mount a slot filesystem (an image file or a block device)",
        description="\n\n".join(__doc__.split("\n\n")[1:3]) if __doc__ else None,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--image", help="image file to create (a host without a spare disk)")
    source.add_argument("--device", help="block device to format (a partition or LV)")
    parser.add_argument("--mount", required=True, help="the slot path (an empty directory)")
    parser.add_argument("--bytes", type=_size, help="storage_bytes, e.g. 20G (to make one)")
    parser.add_argument("--inodes", type=int, help="storage_inodes (to make one)")
    parser.add_argument(
        "--remount", action="store_true",
        help="mount an existing slot filesystem again (its mount failed or was undone);"
        " formats nothing",
    )  # fmt: skip
    parser.add_argument(
        "--persist", choices=("fstab", "unit", "none"), default="none",
        help="make the mount survive a reboot (default: none)",
    )  # fmt: skip
    parser.add_argument(
        "--format", choices=("toml", "json"), default="toml",
        help="the slot entry's format, as your configuration file's (default: toml)",
    )  # fmt: skip
    parser.add_argument("--json", action="store_true", help="print the whole result as JSON")
    parser.add_argument("--version", action="version", version=version)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    try:
        if args.remount:
            slot = remount_slot(args.image or args.device, args.mount, loop=bool(args.image))
            remounted = {"path": slot.mount, "filesystem_uuid": slot.filesystem_uuid}
            if args.json:
                print(json.dumps({"remounted": remounted, "source": slot.source}))
            else:
                print(f"slot filesystem {slot.filesystem_uuid} mounted again on {slot.mount}")
            return 0
        if args.bytes is None or args.inodes is None:
            raise HostError(
                HostCode.PROVISION_FAILED, "--bytes and --inodes are required to make a slot"
            )
        if args.image:
            slot = create_image_slot(args.image, args.mount, args.bytes, args.inodes)
        else:
            slot = create_device_slot(args.device, args.mount, args.bytes, args.inodes)
        persisted = _persist(slot, args.persist)
    except HostError as error:
        print(f"{error.code}: {error.message}", file=sys.stderr)
        return 1
    entry: dict[str, str | int] = {
        "path": slot.mount,
        "storage_bytes": slot.storage_bytes,
        "storage_inodes": slot.storage_inodes,
        "filesystem_uuid": slot.filesystem_uuid,
    }
    if args.json:
        print(json.dumps({"slot": entry, "source": slot.source, "persist": persisted}))
    else:
        print(f"slot filesystem {slot.filesystem_uuid} on {slot.mount} ({slot.source})")
        print(persisted)
        print("slot entry for the configuration (add id, class, generation, uid, gid):")
        print(slot_entry(entry, args.format))
    return 0


def slot_entry(entry: dict[str, str | int], form: str) -> str:
    """The slot entry as the configuration file writes it: a `[[slots]]` table for a
    TOML file (the format docs/configuration.md shows first), an object for JSON, so
    it can be pasted as it is."""
    if form == "json":
        return json.dumps(entry, indent=2)
    lines = ["[[slots]]"]
    lines += [f"{key} = {toml_value(value)}" for key, value in entry.items()]
    return "\n".join(lines)


def toml_value(value: str | int) -> str:
    """A TOML integer or basic string. JSON's string escapes are TOML's too, except
    that TOML also wants DEL escaped."""
    if isinstance(value, int):
        return str(value)
    return json.dumps(value, ensure_ascii=False).replace("\x7f", "\\u007f")
