"""The per-attempt layout on real directories: exact owners and modes, safe removal."""

from __future__ import annotations

import os
import socket
import stat
from dataclasses import dataclass
from pathlib import Path

import pytest

from ficc.execution.host.core.errors import HostError
from ficc.execution.host.storage.layout import (
    CONTROL,
    EVIDENCE,
    LOGS,
    PARTS,
    PROVIDER,
    STORAGE,
    Layout,
)
from ficc_testkit.plans import new_id

pytestmark = pytest.mark.root("the layout chowns to a slot account")

SLOT_UID = 61_731  # a non-root numeric account; the kernel needs no passwd entry
SLOT_GID = 61_731


@dataclass(frozen=True)
class Slot:
    path: str
    uid: int = SLOT_UID
    gid: int = SLOT_GID


@pytest.fixture
def layout(tmp_path: Path) -> Layout:
    slot = tmp_path / "slot"
    slot.mkdir(mode=0o755)
    return Layout(Slot(str(slot)))


def test_create_makes_every_part_with_exact_owner_and_mode(layout: Layout) -> None:
    attempt = new_id()
    paths = layout.create(attempt)
    assert paths.root == f"{layout.slot_path}/ficc/{attempt}"
    assert paths.staging == f"{layout.slot_path}/ficc-staging/{attempt}"
    root = os.stat(paths.root)
    assert (root.st_uid, stat.S_IMODE(root.st_mode)) == (0, 0o711)
    for part in PARTS:
        st = os.stat(f"{paths.root}/{part.name}", follow_symlinks=False)
        owner = (SLOT_UID, SLOT_GID) if part.slot_owned else (0, 0)
        assert stat.S_ISDIR(st.st_mode)
        assert (st.st_uid, st.st_gid) == owner, part
        assert stat.S_IMODE(st.st_mode) == part.mode, part
    for log in (paths.stdout, paths.stderr):
        st = os.stat(log, follow_symlinks=False)
        assert stat.S_ISREG(st.st_mode)
        assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (0, 0o600)
        assert st.st_size == 0


def test_create_is_idempotent_and_keeps_content(layout: Layout) -> None:
    attempt = new_id()
    paths = layout.create(attempt)
    Path(paths.stdout).write_bytes(b"hello")
    assert layout.create(attempt) == paths
    assert Path(paths.stdout).read_bytes() == b"hello"


def test_create_refuses_a_part_with_the_wrong_mode(layout: Layout) -> None:
    attempt = new_id()
    paths = layout.create(attempt)
    os.chmod(paths.control, 0o777)
    with pytest.raises(HostError) as caught:
        layout.create(attempt)
    assert caught.value.code == "layout_unsafe"


def test_create_refuses_a_symlinked_attempt_directory(layout: Layout, tmp_path: Path) -> None:
    attempt = new_id()
    layout.create(new_id())  # makes S/ficc
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    os.symlink(elsewhere, layout.attempt_dir(attempt))
    with pytest.raises(HostError) as caught:
        layout.create(attempt)
    assert caught.value.code == "unsafe_path"
    assert list(elsewhere.iterdir()) == []


def test_names_come_only_from_identities(layout: Layout) -> None:
    for bad in ("../etc", "A" * 32, "", "0" * 31, "0" * 32 + "/x"):
        with pytest.raises(HostError) as caught:
            layout.attempt_dir(bad)
        assert caught.value.code == "unsafe_path"


def test_open_part_checks_owner_and_mode(layout: Layout) -> None:
    attempt = new_id()
    paths = layout.create(attempt)
    for part in (PROVIDER, STORAGE, LOGS, CONTROL, EVIDENCE):
        fd = layout.open_part(attempt, part)
        os.close(fd)
    os.chmod(paths.storage, 0o777)  # the payload may change its own storage's mode
    os.close(layout.open_part(attempt, STORAGE))
    os.chown(paths.evidence, SLOT_UID, SLOT_GID)
    with pytest.raises(HostError) as caught:
        layout.open_part(attempt, EVIDENCE)
    assert caught.value.code == "layout_unsafe"


def test_remove_deletes_a_payload_tree_without_following_links(
    layout: Layout, tmp_path: Path
) -> None:
    attempt = new_id()
    paths = layout.create(attempt)
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep").write_bytes(b"keep me")
    storage = Path(paths.storage)
    deep = storage
    for i in range(300):  # deeper than any fd-per-level walk would like
        deep = deep / f"d{i}"
    deep.mkdir(parents=True)
    (deep / "file").write_bytes(b"x")
    (storage / "link-to-outside").symlink_to(outside)
    (deep / "link").symlink_to(outside / "keep")
    os.mkfifo(storage / "fifo")
    with socket.socket(socket.AF_UNIX) as sock:  # bind relative: the absolute path is long
        cwd = os.getcwd()
        os.chdir(storage)
        try:
            sock.bind("sock")
        finally:
            os.chdir(cwd)
    (Path(paths.provider) / "runtime").mkdir()
    (Path(paths.provider) / "runtime" / "image").write_bytes(b"img")
    (Path(paths.evidence) / "gate-evidence.json").write_bytes(b"{}")
    layout.remove(attempt)
    assert not os.path.lexists(paths.root)
    assert (outside / "keep").read_bytes() == b"keep me"
    assert layout.leftovers() == []
    layout.remove(attempt)  # absent is success


def test_remove_refuses_a_device_node_and_keeps_it(layout: Layout) -> None:
    attempt = new_id()
    paths = layout.create(attempt)
    node = Path(paths.storage) / "null"
    os.mknod(node, stat.S_IFCHR | 0o600, os.makedev(1, 3))
    with pytest.raises(HostError) as caught:
        layout.remove(attempt)
    assert caught.value.code == "unexpected_entry"
    assert os.path.lexists(node)


def test_remove_refuses_a_foreign_name_in_the_attempt_directory(layout: Layout) -> None:
    attempt = new_id()
    paths = layout.create(attempt)
    Path(paths.root, "surprise").write_bytes(b"")
    with pytest.raises(HostError) as caught:
        layout.remove(attempt)
    assert caught.value.code == "unexpected_entry"
    assert os.path.exists(paths.root)


def test_remove_refuses_a_directory_in_a_fixed_part(layout: Layout) -> None:
    attempt = new_id()
    paths = layout.create(attempt)
    Path(paths.control, "sub").mkdir()
    with pytest.raises(HostError) as caught:
        layout.remove(attempt)
    assert caught.value.code == "unexpected_entry"


def test_leftovers_lists_attempt_and_staging_directories(layout: Layout) -> None:
    attempt = new_id()
    layout.create(attempt)
    staging = Path(layout.slot_path, "ficc-staging", attempt)
    staging.mkdir(parents=True)
    assert layout.leftovers() == [f"ficc-staging/{attempt}", f"ficc/{attempt}"]
    assert layout.exists(attempt)
    assert not layout.exists(new_id())


# --- a daemon killed between mkdir and fchown/fchmod ----------------------------------------


def _half_create(path: str) -> None:
    """What a SIGKILL right after `mkdir` leaves: an empty root-owned 0700 directory."""
    os.mkdir(path, 0o700)
    os.chmod(path, 0o700)


def test_a_half_created_attempt_directory_is_finished_then_released(layout: Layout) -> None:
    attempt = new_id()
    base = Path(layout.create(new_id()).root).parent  # the attempts base exists
    _half_create(str(base / attempt))
    paths = layout.create(attempt)  # re-prepare after the restart
    st = os.stat(paths.root)
    assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (0, 0o711)
    _half_create(str(base / (other := new_id())))
    layout.remove(other)  # release of an attempt whose creation was cut short
    assert not (base / other).exists()


def test_a_half_created_slot_owned_part_gets_its_owner(layout: Layout) -> None:
    attempt = new_id()
    paths = layout.create(attempt)
    os.rmdir(paths.storage)
    _half_create(paths.storage)
    layout.create(attempt)
    os.close(layout.open_part(attempt, STORAGE))
    assert os.stat(paths.storage).st_gid == SLOT_GID
    for part in PARTS:
        st = os.stat(os.path.join(paths.root, part.name))
        owner = SLOT_UID if part.slot_owned else 0
        assert st.st_uid == owner, part.name


def test_a_root_0700_directory_with_content_is_still_refused(layout: Layout) -> None:
    """Not what a killed mkdir leaves: someone used it, so an operator must look."""
    attempt = new_id()
    paths = layout.create(attempt)
    os.chmod(paths.root, 0o700)
    with pytest.raises(HostError) as caught:
        layout.create(attempt)
    assert caught.value.code == "layout_unsafe"
    with pytest.raises(HostError) as caught:
        layout.remove(attempt)
    assert caught.value.code == "layout_unsafe"


def test_free_payload_data_removes_only_what_the_payload_wrote(layout: Layout) -> None:
    """Release frees the storage tree and the logs first (a full slot), nothing else."""
    attempt = new_id()
    paths = layout.create(attempt)
    for i in range(50):
        (Path(paths.storage) / f"d{i}").mkdir()
        (Path(paths.storage) / f"d{i}" / "f").write_bytes(b"x" * 1000)
    Path(paths.stdout).write_bytes(b"out" * 1000)
    (Path(paths.provider) / "runtime").write_bytes(b"provider state")
    (Path(paths.evidence) / "gate-evidence.json").write_bytes(b"{}")
    layout.free_payload_data(attempt)
    assert not os.path.lexists(paths.storage)
    assert not os.path.lexists(paths.logs)
    assert (Path(paths.provider) / "runtime").read_bytes() == b"provider state"
    assert (Path(paths.evidence) / "gate-evidence.json").exists()
    layout.free_payload_data(attempt)  # again: absent parts are success
    layout.remove(attempt)
    assert not os.path.lexists(paths.root)
    layout.free_payload_data(attempt)  # no attempt directory at all


def test_free_payload_data_refuses_a_storage_part_replaced_by_a_link(
    layout: Layout, tmp_path: Path
) -> None:
    attempt = new_id()
    paths = layout.create(attempt)
    os.rmdir(paths.storage)
    outside = tmp_path / "outside-storage"
    outside.mkdir()
    (outside / "keep").write_bytes(b"keep")
    os.symlink(outside, paths.storage)
    with pytest.raises(HostError) as refused:
        layout.free_payload_data(attempt)
    assert refused.value.code == "unexpected_entry"
    assert (outside / "keep").read_bytes() == b"keep"


def test_a_whiteout_device_any_user_can_make_does_not_block_removal(layout: Layout) -> None:
    """Character device 0:0 (an overlayfs whiteout) needs no privilege to create."""
    attempt = new_id()
    paths = layout.create(attempt)
    os.mknod(Path(paths.storage) / "whiteout", 0o600 | stat.S_IFCHR, os.makedev(0, 0))
    layout.free_payload_data(attempt)
    assert not os.path.lexists(paths.storage)
    layout.remove(attempt)
    assert not os.path.lexists(paths.root)
