"""os.Root-style confinement: symlinks, foreign owners, loose modes, odd file types."""

from __future__ import annotations

import contextlib
import os
import pathlib
import pwd
import shutil
import tempfile
from collections.abc import Iterator

import pytest

import ficc.hoststate as hs
from ficc.hoststate import acquire
from ficc.hoststate.cli import inspect_store
from hs_support import HOST, plan

NOBODY = pwd.getpwnam("nobody").pw_uid  # a real non-root account present on Debian


@pytest.fixture
def initialized(store: pathlib.Path) -> pathlib.Path:
    with acquire(store, HOST) as s:
        s.begin("op-1", plan(1))
    return store


#: giving a file to another user takes root
chowns = pytest.mark.root("it gives files to another user")


def unsafe(directory: pathlib.Path, text: str) -> None:
    """acquire and inspect both refuse, and nothing is written into the directory."""
    before = snapshot_of(directory)
    with pytest.raises(hs.Unsafe) as info:
        acquire(directory, HOST)
    assert info.value.code == "unsafe_store"
    assert text in str(info.value)
    with pytest.raises(hs.Unsafe):
        inspect_store(str(directory), HOST)
    assert snapshot_of(directory) == before


def snapshot_of(directory: pathlib.Path) -> dict[str, bytes | str]:
    if not directory.is_dir() or directory.is_symlink():
        return {}
    out: dict[str, bytes | str] = {}
    for p in directory.iterdir():
        out[p.name] = os.readlink(p) if p.is_symlink() else (p.read_bytes() if p.is_file() else "")
    return out


def test_missing_directory_is_never_created(tmp_path: pathlib.Path) -> None:
    unsafe(tmp_path / "absent", "does not exist")
    assert not (tmp_path / "absent").exists()


def test_directory_is_a_file(tmp_path: pathlib.Path) -> None:
    (tmp_path / "f").write_text("")
    unsafe(tmp_path / "f", "not a directory")


def test_symlinked_directory(initialized: pathlib.Path, tmp_path: pathlib.Path) -> None:
    link = tmp_path / "link"
    link.symlink_to(initialized)
    unsafe(link, "symbolic link")


@pytest.mark.parametrize("suffix", ["/", "/.", "/./"])
def test_a_trailing_slash_never_follows_a_symlinked_directory(
    initialized: pathlib.Path, tmp_path: pathlib.Path, suffix: str
) -> None:
    link = tmp_path / "link"
    link.symlink_to(initialized)
    before = snapshot_of(initialized)
    with pytest.raises(hs.Unsafe) as info:
        acquire(f"{link}{suffix}", HOST)
    assert "symbolic link" in str(info.value)
    with pytest.raises(hs.Unsafe):
        inspect_store(f"{link}{suffix}", HOST)
    assert snapshot_of(initialized) == before


def test_a_symlink_on_the_way_is_never_followed(
    initialized: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    """Whoever owns the directory holding a link on the way could re-point it: the
    path is walked one component at a time and a link anywhere is refused."""
    (tmp_path / "hop").symlink_to(initialized.parent)
    unsafe(tmp_path / "hop" / initialized.name, "on the way")


@pytest.mark.parametrize("bad", [None, "", "dir\x00name", 7])
def test_a_directory_that_is_not_a_path_is_an_invalid_argument(bad: object) -> None:
    with pytest.raises(hs.InvalidArgument):
        acquire(bad, HOST)  # type: ignore[arg-type]


def test_symlinked_state_json(initialized: pathlib.Path, tmp_path: pathlib.Path) -> None:
    real = tmp_path / "elsewhere.json"
    os.rename(initialized / "state.json", real)
    (initialized / "state.json").symlink_to(real)
    unsafe(initialized, "state.json in")


def test_symlinked_host_lock(store: pathlib.Path, tmp_path: pathlib.Path) -> None:
    target = tmp_path / "victim"
    (store / "host.lock").symlink_to(target)  # dangling: O_CREAT must not create the target
    unsafe(store, "host.lock in")
    assert not target.exists()


def test_group_writable_directory(initialized: pathlib.Path) -> None:
    os.chmod(initialized, 0o770)
    unsafe(initialized, "writable by group or others")


def test_other_writable_directory(initialized: pathlib.Path) -> None:
    os.chmod(initialized, 0o703)
    unsafe(initialized, "writable by group or others")


@pytest.mark.parametrize("name", ["state.json", "host.lock"])
def test_group_writable_file(initialized: pathlib.Path, name: str) -> None:
    os.chmod(initialized / name, 0o620)
    unsafe(initialized, "writable by group or others")


@chowns
def test_directory_owned_by_another_user(initialized: pathlib.Path) -> None:
    os.chown(initialized, NOBODY, -1)
    unsafe(initialized, f"owned by uid {NOBODY}")


@chowns
@pytest.mark.parametrize("name", ["state.json", "host.lock"])
def test_file_owned_by_another_user(initialized: pathlib.Path, name: str) -> None:
    os.chown(initialized / name, NOBODY, -1)
    unsafe(initialized, f"owned by uid {NOBODY}")


def test_hard_linked_state(initialized: pathlib.Path, tmp_path: pathlib.Path) -> None:
    os.link(initialized / "state.json", tmp_path / "other-link")
    unsafe(initialized, "hard links")


def test_fifo_state_does_not_hang(initialized: pathlib.Path) -> None:
    os.unlink(initialized / "state.json")
    os.mkfifo(initialized / "state.json", 0o600)
    unsafe(initialized, "not a regular file")


def test_directory_as_host_lock(store: pathlib.Path) -> None:
    (store / "host.lock").mkdir(mode=0o700)
    unsafe(store, "is a directory")


def test_ancestor_writable_by_others(tmp_path: pathlib.Path) -> None:
    parent = tmp_path / "shared"
    parent.mkdir()
    os.chmod(parent, 0o777)  # not sticky: anyone could rename the state directory away
    child = parent / "state"
    child.mkdir(mode=0o700)
    unsafe(child, "ancestor directory")


def test_sticky_ancestor_is_fine(tmp_path: pathlib.Path) -> None:
    parent = tmp_path / "sticky"
    parent.mkdir()
    os.chmod(parent, 0o1777)  # like /tmp: others cannot rename entries they do not own
    child = parent / "state"
    child.mkdir(mode=0o700)
    with acquire(child, HOST) as s:
        s.begin("op-1", plan(1))


@chowns
def test_ancestor_owned_by_another_user(tmp_path: pathlib.Path) -> None:
    parent = tmp_path / "theirs"
    parent.mkdir(mode=0o755)
    os.chown(parent, NOBODY, -1)
    child = parent / "state"
    child.mkdir(mode=0o700)
    unsafe(child, f"owner uid {NOBODY}")


def test_renamed_directory_keeps_writes_confined(
    store: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    """Writes follow the opened directory, not the path, once acquired."""
    with acquire(store, HOST) as s:
        moved = tmp_path / "moved"
        os.rename(store, moved)
        store.mkdir(mode=0o700)  # an impostor at the old path
        s.begin("op-1", plan(1))
    assert list(store.iterdir()) == []
    assert (moved / "state.json").exists()


def test_temp_remnants_are_ignored(initialized: pathlib.Path) -> None:
    remnant = initialized / "state.json.tmp.1.deadbeef"
    remnant.write_bytes(b"garbage from a killed writer")
    os.chmod(remnant, 0o600)
    with acquire(initialized, HOST) as s:
        assert s.get("op-1").revision == 1
        s.advance("op-1", 1, "cancelled")
    assert remnant.read_bytes() == b"garbage from a killed writer"  # neither read nor cleaned


@contextlib.contextmanager
def as_nobody() -> Iterator[None]:
    """File access as the `nobody` account (the effective UID), then root again."""
    os.seteuid(NOBODY)
    try:
        yield
    finally:
        os.seteuid(0)


@pytest.fixture
def nobodys_store() -> Iterator[pathlib.Path]:
    """A state directory of `nobody`, initialized by `nobody`, below /var/tmp (sticky)
    in a root-owned directory that `nobody` may pass through but not read (0711)."""
    base = pathlib.Path(tempfile.mkdtemp(dir="/var/tmp", prefix="ficc-hs-"))
    try:
        os.chmod(base, 0o711)
        state = base / "state"
        state.mkdir(mode=0o700)
        os.chown(state, NOBODY, -1)
        with as_nobody(), acquire(state, HOST) as s:
            s.begin("op-1", plan(1))
        yield state
    finally:
        shutil.rmtree(base)


@chowns
def test_a_non_root_user_passes_an_ancestor_it_cannot_read(nobodys_store: pathlib.Path) -> None:
    with as_nobody():
        with acquire(nobodys_store, HOST) as s:
            assert s.get("op-1").revision == 1
        assert inspect_store(str(nobodys_store), HOST) is not None


@chowns
@pytest.mark.parametrize("name", ["state.json", "host.lock"])
def test_a_private_file_of_another_user_is_unsafe_for_a_non_root_user(
    nobodys_store: pathlib.Path, name: str
) -> None:
    os.chown(nobodys_store / name, NOBODY + 1, -1)
    with as_nobody():
        with pytest.raises(hs.Unsafe) as info:
            acquire(nobodys_store, HOST)
        assert "cannot be opened by this user" in str(info.value)
        with pytest.raises(hs.Unsafe):
            inspect_store(str(nobodys_store), HOST)
