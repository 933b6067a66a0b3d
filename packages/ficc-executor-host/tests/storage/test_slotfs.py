"""A slot is a finite filesystem of its own (slotfs.py, provision.py, config.check_host).

Everything here is real: ext4 images made and loop-mounted by the shipped provisioning
code, real system accounts made with useradd, real remounts. Every mount is removed in
the fixtures' teardown, also when a test fails.
"""

from __future__ import annotations

import grp
import json
import os
import pwd
import re
import secrets
import stat
import subprocess
import sys
import tempfile
import tomllib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from dataclasses import replace as replace_fields
from pathlib import Path

import msgspec
import pytest
from msgspec.structs import replace

from ficc.execution.host.cli import provision
from ficc.execution.host.config.host import check_host, open_image_parent
from ficc.execution.host.config.load import parse_config
from ficc.execution.host.config.model import Config, Slot
from ficc.execution.host.core.errors import HostError
from ficc.execution.host.linux import procparse
from ficc.execution.host.storage import slotfs
from ficc.execution.host.storage.slot_files import ReservedSlot
from ficc_testkit.accounts import account_command
from ficc_testkit.units import MIB

pytestmark = pytest.mark.root("slot filesystems need root: they are loop-mounted ext4 images")

BYTES = 24 * MIB
INODES = 2_000


@dataclass
class Host:
    """A root-owned tree under /run: state, sockets, two provisioned slots, two accounts."""

    root: Path
    slots: list[provision.Provisioned]
    accounts: list[pwd.struct_passwd]

    def config(self, **slot_changes: object) -> Config:
        """The configuration of this host; `slot_changes` apply to slot 0."""
        slots = [
            Slot(
                id=f"s{i}",
                slot_class="small",
                generation=1,
                path=made.mount,
                uid=account.pw_uid,
                gid=account.pw_gid,
                storage_bytes=BYTES,
                storage_inodes=INODES,
                filesystem_uuid=made.filesystem_uuid,
            )
            for i, (made, account) in enumerate(zip(self.slots, self.accounts, strict=True))
        ]
        slots[0] = replace(slots[0], **slot_changes)
        return _config(self.root, slots)


def _config(root: Path, slots: list[Slot]) -> Config:
    allowance = {
        "cpu_millis": 1, "memory_bytes": 1, "swap_bytes": 0, "processes": 1,
        "slots": len(slots), "devices": [], "projects": [], "runtimes": ["test"],
    }  # fmt: skip
    document = {
        "installation_id": "a" * 32,
        "deployment_id": "b" * 32,
        "node_id": "c" * 32,
        "mode": "voluntary",
        "transport_uid": 3_999_990,
        "local_owner_uids": [],
        "maximum_lease_seconds": 600,
        "state_dir": str(root / "state"),
        "socket_dir": str(root / "sockets"),
        "supervisor": "cgroupfs",
        "slots": [msgspec.to_builtins(slot) for slot in slots],
        "ceiling": allowance,
        "initial_offer": {**allowance, "control": "active"},
        "providers": [{"id": "test", "package_digest": "sha256:" + "0" * 64}],
    }
    return parse_config(msgspec.json.encode(document), ".json")


def _new_account(name: str, *extra: str) -> pwd.struct_passwd:
    account_command("useradd", "--system", "--user-group", "--no-create-home", *extra, name)
    return pwd.getpwnam(name)


@pytest.fixture(scope="module")
def accounts() -> Iterator[list[pwd.struct_passwd]]:
    names = [f"ficc-t-sfs{i}-{secrets.token_hex(3)}" for i in range(2)]
    made = [_new_account(name, "--shell", "/usr/sbin/nologin") for name in names]
    try:
        yield made
    finally:
        for name in names:
            account_command("userdel", name)


@pytest.fixture
def host(accounts: list[pwd.struct_passwd]) -> Iterator[Host]:
    root = Path(tempfile.mkdtemp(prefix="ficc-t-slotfs-", dir="/run"))
    os.chmod(root, 0o755)
    (root / "state").mkdir(mode=0o700)
    (root / "sockets").mkdir()
    os.chmod(root / "sockets", 0o711)
    (root / "slots").mkdir(mode=0o755)
    (root / "images").mkdir(mode=0o700)
    made: list[provision.Provisioned] = []
    try:
        for i in range(2):
            made.append(
                provision.create_image_slot(
                    str(root / "images" / f"s{i}.img"), str(root / "slots" / f"s{i}"), BYTES, INODES
                )
            )
        yield Host(root, made, accounts)
    finally:
        for i in range(2):
            provision.remove_slot(str(root / "slots" / f"s{i}"))
        for extra in root.glob("extra-*"):
            provision.remove_slot(str(extra / "mnt"))
        subprocess.run(["rm", "-rf", "--one-file-system", str(root)], check=False)


def refusal(call: Callable[[], object]) -> HostError:
    with pytest.raises(HostError) as caught:
        call()
    return caught.value


def _remount(mount: str, options: str) -> None:
    subprocess.run(["mount", "-o", f"remount,{options}", mount], check=True)


# --- the filesystem ---------------------------------------------------------------------


def test_a_provisioned_slot_with_its_own_account_passes_every_check(host: Host) -> None:
    check_host(host.config())
    for made in host.slots:
        st = os.statvfs(made.mount)
        assert (st.f_blocks - (st.f_bfree - st.f_bavail)) * st.f_frsize >= BYTES
        assert st.f_files >= INODES
        assert os.stat(made.mount).st_uid == 0


def test_a_provisioned_image_is_zeroed_whole_so_the_kernel_never_punches_holes_in_it(
    host: Host,
) -> None:
    """mkfs zeroes every inode table and the journal itself: ext4 otherwise zeroes
    them after the first mount, through the loop device, which punches holes into an
    image that lives on ext4 (the slot's room would no longer be reserved)."""
    for i in range(len(host.slots)):
        image = host.root / "images" / f"s{i}.img"
        dump = subprocess.run(
            ["dumpe2fs", str(image)], capture_output=True, text=True, check=True
        ).stdout
        groups = [line for line in dump.splitlines() if re.match(r"Group \d+:", line)]
        assert groups, dump[:400]
        lazy = [line for line in groups if "ITABLE_ZEROED" not in line]
        assert lazy == [], f"inode tables left for the kernel to zero: {lazy[:2]}"
        assert os.stat(image).st_blocks * 512 >= os.stat(image).st_size


def test_a_plain_directory_on_a_shared_filesystem_is_refused(host: Host) -> None:
    plain = host.root / "plain"
    plain.mkdir(mode=0o755)
    error = refusal(lambda: check_host(host.config(path=str(plain))))
    assert error.code == "slot_filesystem"
    assert "is not the root of its own filesystem" in error.message


def test_a_mount_that_failed_at_boot_leaves_an_empty_directory_that_is_refused(
    host: Host,
) -> None:
    mount = host.slots[0].mount
    provision.remove_slot(mount)
    assert os.path.isdir(mount)
    error = refusal(lambda: check_host(host.config()))
    assert error.code == "slot_filesystem"


def test_the_advice_for_a_failed_mount_works_when_followed(host: Host) -> None:
    """The refusal of an unmounted slot names `provision-slot --remount`; following it
    (with the image the slot was made from) mounts the same filesystem again, which then
    passes every check; provision-slot without --remount refuses the existing image and
    names --remount."""
    made = host.slots[0]
    provision.remove_slot(made.mount)
    error = refusal(lambda: check_host(host.config()))
    assert "provision-slot --remount --image IMAGE --mount PATH" in error.message
    fresh = _provision_slot("--image", made.source, "--mount", made.mount,
                            "--bytes", "20M", "--inodes", "1500")  # fmt: skip
    assert fresh.returncode == 1
    assert f"provision-slot --remount --image {made.source} --mount {made.mount}" in fresh.stderr
    previous = os.umask(0o077)  # the root shell of a hardened host
    try:
        again = _provision_slot("--remount", "--image", made.source, "--mount", made.mount,
                                "--json")  # fmt: skip
    finally:
        os.umask(previous)
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout)["remounted"]["filesystem_uuid"] == made.filesystem_uuid
    check_host(host.config())
    twice = _provision_slot("--remount", "--image", made.source, "--mount", made.mount)
    assert twice.returncode == 1
    assert "something is already mounted" in twice.stderr


def test_provision_makes_missing_mount_point_parents_traversable_under_umask_0077(
    host: Host,
) -> None:
    base = host.root / "extra-umask"
    base.mkdir()
    os.chmod(base, 0o755)
    mount = base / "deep" / "slots" / "s9"
    previous = os.umask(0o077)
    try:
        made = provision.create_image_slot(str(host.root / "images" / "s9.img"), str(mount),
                                           BYTES, INODES)  # fmt: skip
    finally:
        os.umask(previous)
    try:
        for directory in (base / "deep", base / "deep" / "slots"):
            assert stat.S_IMODE(directory.stat().st_mode) == 0o755, directory
        assert made.mount == str(mount)
    finally:
        provision.remove_slot(str(mount), made.source)


def _provision_slot(*arguments: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "ficc.execution", "provision-slot", *arguments]
    return subprocess.run(command, capture_output=True, text=True, check=False)


def test_another_filesystem_mounted_in_its_place_is_refused_by_identity(host: Host) -> None:
    mount = host.slots[0].mount
    provision.remove_slot(mount)
    other = host.root / "extra-other"
    other.mkdir()
    provision.create_image_slot(str(other / "img"), mount, BYTES, INODES)
    try:
        error = refusal(lambda: check_host(host.config()))
        assert error.code == "slot_identity"
        assert host.slots[0].filesystem_uuid in error.message
    finally:
        provision.remove_slot(mount)


@pytest.mark.parametrize("options", ["dev", "suid"])
def test_a_slot_mounted_without_nodev_or_nosuid_is_refused(host: Host, options: str) -> None:
    _remount(host.slots[0].mount, options)
    error = refusal(lambda: check_host(host.config()))
    assert error.code == "slot_filesystem"
    assert f"without no{options}" in error.message


def test_a_slot_smaller_than_configured_is_refused(host: Host) -> None:
    error = refusal(lambda: check_host(host.config(storage_bytes=4 * BYTES)))
    assert error.code == "slot_filesystem"
    assert "less than storage_bytes" in error.message
    error = refusal(lambda: check_host(host.config(storage_inodes=100 * INODES)))
    assert error.code == "slot_filesystem"
    assert "inodes" in error.message


def test_a_bind_of_a_subdirectory_is_not_a_slot_filesystem(host: Host) -> None:
    inner = Path(host.slots[1].mount) / "inner"
    inner.mkdir(mode=0o755)
    target = host.root / "extra-bind" / "mnt"
    target.mkdir(parents=True, mode=0o755)
    subprocess.run(["mount", "--bind", "-o", "nodev,nosuid", str(inner), str(target)], check=True)
    error = refusal(lambda: check_host(host.config(path=str(target))))
    assert error.code == "slot_filesystem"


def test_two_slots_on_one_filesystem_are_refused(host: Host) -> None:
    config = host.config()
    both = [config.slots[0], replace(config.slots[1], path=config.slots[0].path)]
    # The pure rules refuse the same path twice before anything is mounted...
    with pytest.raises(HostError):
        _config(host.root, both)
    # ...and a second mount of the same filesystem is caught by its device.
    target = host.root / "extra-twice" / "mnt"
    target.mkdir(parents=True, mode=0o755)
    source = host.slots[0].mount
    subprocess.run(["mount", "--bind", source, str(target)], check=True)
    _remount(str(target), "bind,nodev,nosuid")
    twice = replace(
        config.slots[1], path=str(target), filesystem_uuid=config.slots[0].filesystem_uuid
    )
    with pytest.raises(HostError) as caught:
        _config(host.root, [config.slots[0], twice])
    assert caught.value.code == "config_conflict"  # the same UUID twice, a pure rule
    devices = [("slots[0]", os.stat(source).st_dev), ("slots[1]", os.stat(target).st_dev)]
    error = refusal(lambda: slotfs.check_distinct(devices, [("/", os.stat("/").st_dev)]))
    assert error.code == "slot_filesystem"


def test_verify_before_each_attempt_sees_an_unmount_and_a_replacement(host: Host) -> None:
    slot = host.config().slots[0]
    slotfs.verify(slot, open_image_parent)
    provision.remove_slot(slot.path)
    assert refusal(lambda: slotfs.verify(slot, open_image_parent)).code == "slot_filesystem"
    other = host.root / "extra-replacement"
    other.mkdir()
    provision.create_image_slot(str(other / "img"), slot.path, BYTES, INODES)
    try:
        assert refusal(lambda: slotfs.verify(slot, open_image_parent)).code == "slot_identity"
    finally:
        provision.remove_slot(slot.path)


def test_the_superblock_reader_agrees_with_the_kernel_and_blkid(host: Host) -> None:
    """Older kernels have no FS_IOC_GETFSUUID: the superblock reader must give the same."""
    for made in host.slots:
        fd = os.open(made.mount, os.O_RDONLY | os.O_DIRECTORY)
        try:
            with open("/proc/self/mountinfo", "rb") as table:
                mounts = procparse.parse_mountinfo(table.read())
            mount = next(m for m in reversed(mounts) if m.mount_point == made.mount)
            kernel = slotfs.filesystem_uuid(fd, mount)
        finally:
            os.close(fd)
        blkid = subprocess.run(
            ["blkid", "-o", "value", "-s", "UUID", made.source],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        assert kernel == slotfs._superblock_uuid(mount) == blkid == made.filesystem_uuid


def test_usage_reports_a_full_slot(host: Host) -> None:
    mount = host.slots[0].mount
    assert not slotfs.usage(mount).bytes_exhausted
    filler = Path(mount) / "filler"
    with open(filler, "wb") as out:
        room = os.statvfs(mount)
        os.posix_fallocate(out.fileno(), 0, room.f_bavail * room.f_frsize)
    assert slotfs.usage(mount).bytes_exhausted
    filler.unlink()
    for i in range(os.statvfs(mount).f_favail):
        (Path(mount) / f"i{i}").touch()
    use = slotfs.usage(mount)
    assert use.inodes_exhausted
    assert not use.bytes_exhausted


# --- the slot account ---------------------------------------------------------------------


def test_a_missing_slot_account_is_refused(host: Host) -> None:
    error = refusal(lambda: check_host(host.config(uid=3_999_977)))
    assert error.code == "slot_account"
    assert "no account has UID 3999977" in error.message
    gid = host.config().slots[0].gid  # the fix makes exactly the configured account
    assert f"useradd --system --uid 3999977 --gid {gid} --no-create-home" in error.message


def test_a_slot_account_with_the_wrong_group_is_refused(host: Host) -> None:
    other = grp.getgrnam("nogroup").gr_gid
    error = refusal(lambda: check_host(host.config(gid=other)))
    assert error.code == "slot_account"
    assert f"not the configured {other}" in error.message


def test_a_slot_account_that_can_log_in_is_refused(host: Host) -> None:
    name = host.accounts[0].pw_name
    account_command("usermod", "--shell", "/bin/bash", name)
    try:
        error = refusal(lambda: check_host(host.config()))
    finally:
        account_command("usermod", "--shell", "/usr/sbin/nologin", name)
    assert error.code == "slot_account"
    assert "login shell /bin/bash" in error.message


def test_a_slot_account_in_another_group_is_refused(host: Host) -> None:
    name = host.accounts[0].pw_name
    account_command("usermod", "--append", "--groups", host.accounts[1].pw_name, name)
    try:
        error = refusal(lambda: check_host(host.config()))
    finally:
        account_command("gpasswd", "--delete", name, host.accounts[1].pw_name)
    assert error.code == "slot_account"
    other = host.accounts[1]
    assert f"is also in groups {other.pw_name} (GID {other.pw_gid})" in error.message
    assert error.message.endswith(f"gpasswd -d {name} {other.pw_name}")  # a runnable fix


# --- provisioning -------------------------------------------------------------------------


def test_provision_slot_command_makes_a_slot_the_daemon_accepts(host: Host) -> None:
    base = host.root / "extra-command"
    base.mkdir()
    mount = str(base / "mnt")
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "ficc.execution",
            "provision-slot",
            "--image",
            str(base / "slot.img"),
            "--mount",
            mount,
            "--bytes",
            "20M",
            "--inodes",
            "1500",
            "--json",
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    entry = json.loads(result.stdout)["slot"]
    slot = replace(
        host.config().slots[0],
        path=entry["path"],
        storage_bytes=entry["storage_bytes"],
        storage_inodes=entry["storage_inodes"],
        filesystem_uuid=entry["filesystem_uuid"],
    )
    fd = os.open(mount, os.O_RDONLY | os.O_DIRECTORY)
    try:
        slotfs.check_filesystem(slot, "slots[0]", fd, open_image_parent)
    finally:
        os.close(fd)
    again = subprocess.run(
        [sys.executable, "-m", "ficc.execution", "provision-slot", "--image",
         str(base / "slot.img"), "--mount", mount, "--bytes", "20M", "--inodes", "1500"],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert again.returncode == 1
    assert again.stderr.startswith("provision_failed: "), again.stderr  # code first


def test_provision_slot_prints_a_toml_slot_entry_unless_asked_for_json(host: Host) -> None:
    """The entry printed for the operator is a `[[slots]]` table to paste into a TOML
    configuration (the format docs/configuration.md and the guide use); `--format json`
    prints the same entry as a JSON object."""
    base = host.root / "extra-toml"
    base.mkdir()
    mount = str(base / "mnt")
    made = _provision_slot("--image", str(base / "slot.img"), "--mount", mount,
                           "--bytes", "20M", "--inodes", "1500")  # fmt: skip
    try:
        assert made.returncode == 0, made.stderr
        header = "slot entry for the configuration (add id, class, generation, uid, gid):"
        entry_text = made.stdout.split(header + "\n", 1)[1]
        (entry,) = tomllib.loads(entry_text)["slots"]
        fd = os.open(mount, os.O_RDONLY | os.O_DIRECTORY)
        try:
            uuid = slotfs.filesystem_uuid(fd, slotfs.mount_of(fd, mount))
        finally:
            os.close(fd)
        assert entry == {"path": mount, "storage_bytes": 20 * MIB, "storage_inodes": 1500,
                         "filesystem_uuid": uuid}  # fmt: skip
    finally:
        provision.remove_slot(mount, str(base / "slot.img"))
    assert json.loads(provision.slot_entry(entry, "json")) == entry


def test_persistence_lines_name_the_image_or_the_uuid() -> None:
    loop = provision.Provisioned("/srv/ficc/slots/a", "/var/lib/ficc/a.img", "u" * 4, 1, 1, True)
    assert provision.fstab_line(loop) == (
        "/var/lib/ficc/a.img /srv/ficc/slots/a ext4 loop,nodev,nosuid,nofail,X-fstrim.notrim 0 2\n"
    )
    disk = replace_fields(loop, source="/dev/vg/a", loop=False)
    assert provision.fstab_line(disk).startswith("UUID=uuuu /srv/ficc/slots/a ext4 nodev,nosuid,")


def test_a_filesystem_of_another_type_is_refused(host: Host) -> None:
    """tmpfs (no UUID, memory) and copy-on-write filesystems are not slot filesystems."""
    target = host.root / "extra-tmpfs" / "mnt"
    target.mkdir(parents=True, mode=0o755)
    subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "nodev,nosuid,size=64m,mode=0755", "ficc-t", str(target)],
        check=True,
    )
    error = refusal(lambda: check_host(host.config(path=str(target))))
    assert error.code == "slot_filesystem"
    assert "is tmpfs, not one of ext2, ext3, ext4, xfs" in error.message


def test_holes_punched_in_the_image_are_allocated_again(host: Host) -> None:
    """fstrim makes an image sparse again: the daemon's checks give the room back."""
    image = host.slots[0].source
    size = os.stat(image).st_size
    subprocess.run(["fstrim", host.slots[0].mount], check=False, capture_output=True)
    subprocess.run(
        ["fallocate", "--punch-hole", "--offset", str(size // 2), "--length", str(4 * MIB), image],
        check=True,
    )
    assert os.stat(image).st_blocks * 512 < size
    slotfs.verify(host.config().slots[0], open_image_parent)
    assert os.stat(image).st_blocks * 512 >= size
    subprocess.run(
        ["fallocate", "--punch-hole", "--offset", "0", "--length", str(MIB), image], check=False
    )
    check_host(host.config())
    assert os.stat(image).st_blocks * 512 >= size


def test_an_image_others_could_replace_is_refused(host: Host) -> None:
    image = host.slots[0].source
    os.chmod(image, 0o644)
    error = refusal(lambda: check_host(host.config()))
    assert error.code == "slot_filesystem"
    assert "root-owned 0600" in error.message
    os.chmod(image, 0o600)
    os.chmod(os.path.dirname(image), 0o777)
    try:
        error = refusal(lambda: check_host(host.config()))
    finally:
        os.chmod(os.path.dirname(image), 0o700)
    assert error.code == "slot_filesystem"
    assert "writable by others" in error.message


def test_provision_refuses_an_image_in_a_directory_others_can_write(host: Host) -> None:
    shared = host.root / "extra-shared"
    shared.mkdir()
    os.chmod(shared, 0o1777)
    error = refusal(
        lambda: provision.create_image_slot(str(shared / "s.img"), str(shared / "m"), BYTES, 100)
    )
    assert error.code == "provision_failed"
    assert not (shared / "s.img").exists()


# --- the slot's health check (`SlotFiles.check`) ----------------------------------------


def test_the_health_check_sees_the_account_and_the_host_directories(host: Host) -> None:
    """`ReservedSlot.check()`: `verify()`, the account, and `ficc/` and `ficc-staging/`
    root's, not writable by others, on the slot itself; a directory the host is making
    (root 0700, before its final mode) passes."""
    slot = host.config().slots[0]
    files = ReservedSlot(slot, open_image_parent)
    files.check()
    base = Path(slot.path) / "ficc"
    base.mkdir(mode=0o700)  # the host between its mkdir and its chmod
    files.check()
    os.chmod(base, 0o777)
    assert refusal(files.check).code == "layout_unsafe"
    os.chmod(base, 0o711)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m,mode=0711", "tmpfs", str(base)],
                   check=True)  # fmt: skip
    try:
        assert refusal(files.check).code == "storage_unverified"
    finally:
        subprocess.run(["umount", str(base)], check=True)
    files.check()
    missing = replace(slot, uid=host.accounts[0].pw_uid + 100_000)
    assert refusal(ReservedSlot(missing, open_image_parent).check).code == "slot_account"
    provision.remove_slot(slot.path)
    assert refusal(files.check).code == "slot_filesystem"
