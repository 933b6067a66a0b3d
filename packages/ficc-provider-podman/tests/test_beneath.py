"""Root's file operations in the slot account's files (beneath.py): removals that
always finish and never follow a link, and paths resolved without leaving the tree."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from ficc_provider_podman import beneath
from ficc_provider_podman.errors import ProviderError


@pytest.fixture(params=["openat2", "walk"])
def resolver(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Both ways of resolving below a descriptor: openat2, and the walk of kernels
    without it."""
    if request.param == "walk":
        monkeypatch.setattr(beneath, "has_openat2", lambda: False)
    elif not beneath.has_openat2():
        pytest.skip("this kernel has no openat2 (before Linux 5.6): only the walk applies")
    return request.param


def _chain(top: Path, depth: int) -> None:
    """A directory chain `depth` deep below `top`, with a file at the bottom."""
    fd = os.open(top, beneath.DIRECTORY)
    try:
        for _ in range(depth):
            os.mkdir("d", dir_fd=fd)
            below = os.open("d", beneath.DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = below
        os.close(os.open("f", os.O_CREAT | os.O_WRONLY, 0o600, dir_fd=fd))
    finally:
        os.close(fd)


def _removed(parent: Path, name: str) -> list[str]:
    fd = os.open(parent, beneath.DIRECTORY)
    try:
        return beneath.remove_entry(fd, name, f"{parent}/{name}")
    finally:
        os.close(fd)


def test_a_tree_deeper_than_the_interpreters_recursion_is_removed(tmp_path: Path) -> None:
    (tmp_path / "deep").mkdir()
    _chain(tmp_path / "deep", 5_000)
    assert _removed(tmp_path, "deep") == []
    assert not (tmp_path / "deep").exists()


def test_a_link_is_removed_as_a_link_and_its_target_is_untouched(tmp_path: Path) -> None:
    target = tmp_path / "target"
    (target / "keep").mkdir(parents=True)
    tree = tmp_path / "tree"
    tree.mkdir()
    (tree / "to-target").symlink_to(target)
    (tmp_path / "link").symlink_to(target)
    os.mkfifo(tree / "fifo")
    assert _removed(tmp_path, "link") == []
    assert _removed(tmp_path, "tree") == []
    assert not (tmp_path / "link").is_symlink()
    assert not tree.exists()
    assert (target / "keep").is_dir()


def test_an_absent_name_is_nothing_to_remove(tmp_path: Path) -> None:
    assert _removed(tmp_path, "absent") == []


def test_no_link_is_followed_on_the_way_down(tmp_path: Path, resolver: str) -> None:
    (tmp_path / "real" / "overlay").mkdir(parents=True)
    (tmp_path / "elsewhere" / "overlay").mkdir(parents=True)
    (tmp_path / "swapped").symlink_to(tmp_path / "elsewhere")
    top = os.open(tmp_path, beneath.DIRECTORY)
    try:
        opened = beneath.open_beneath(top, "real/overlay")
        assert os.fstat(opened).st_ino == (tmp_path / "real" / "overlay").stat().st_ino
        os.close(opened)
        with pytest.raises(OSError) as refused:
            beneath.open_beneath(top, "swapped/overlay")
        assert not isinstance(refused.value, FileNotFoundError)
        with pytest.raises(FileNotFoundError):
            beneath.open_beneath(top, "real/absent")
    finally:
        os.close(top)


def test_what_cannot_be_removed_is_named_and_the_rest_goes(tmp_path: Path) -> None:
    """An entry that cannot be removed (here: a directory that will not open) is
    reported by path; its siblings are removed all the same."""
    tree = tmp_path / "tree"
    (tree / "a").mkdir(parents=True)
    (tree / "b").mkdir()
    (tree / "b" / "file").write_bytes(b"x")
    removal = beneath._Removal(os.stat(tmp_path).st_dev)
    real_open = os.open

    def refuse_a(path: str, flags: int, mode: int = 0o777, *, dir_fd: int | None = None) -> int:
        if path == "a":
            raise PermissionError(13, "Permission denied", path)
        return real_open(path, flags, mode, dir_fd=dir_fd)

    parent = os.open(tmp_path, beneath.DIRECTORY)
    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(beneath.os, "open", refuse_a)
            problems = removal.tree(parent, "tree", f"{tmp_path}/tree")
    finally:
        os.close(parent)
    assert problems[0] == f"{tmp_path}/tree/a: Permission denied"
    assert not (tree / "b").exists()
    with pytest.raises(ProviderError) as refused:
        beneath.refuse_leftovers("slot_files_stuck", problems, "the test's files")
    assert refused.value.code == "slot_files_stuck"
    assert f"{tmp_path}/tree/a" in str(refused.value)


@pytest.mark.root("mounts a tmpfs inside the tree")
def test_another_filesystem_inside_the_tree_is_left_and_reported(tmp_path: Path) -> None:
    mount = tmp_path / "tree" / "mnt"
    mount.mkdir(parents=True)
    (tmp_path / "tree" / "file").write_bytes(b"x")
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)], check=True)
    try:
        (mount / "kept").write_bytes(b"x")
        problems = _removed(tmp_path, "tree")
        assert problems[0] == f"{tmp_path}/tree/mnt: another filesystem is mounted there"
        assert (mount / "kept").exists()
        assert not (tmp_path / "tree" / "file").exists()
    finally:
        subprocess.run(["umount", str(mount)], check=True)


def test_a_directory_is_created_through_its_descriptor_and_checked(tmp_path: Path) -> None:
    parent = os.open(tmp_path, beneath.DIRECTORY)
    me = os.getuid()
    try:
        fd = beneath.ensure_directory(
            parent, "made", uid=me, gid=os.getgid(), mode=0o750, where="made"
        )
        os.close(fd)
        assert (tmp_path / "made").stat().st_mode & 0o777 == 0o750
        (tmp_path / "link").symlink_to(tmp_path / "made")
        with pytest.raises(ProviderError) as refused:
            beneath.ensure_directory(parent, "link", uid=me, gid=os.getgid(), mode=0o750, where="l")
        assert refused.value.code == "podman_directory"
        (tmp_path / "made").chmod(0o777)
        with pytest.raises(ProviderError):
            beneath.ensure_directory(parent, "made", uid=me, gid=os.getgid(), mode=0o750, where="m")
    finally:
        os.close(parent)
