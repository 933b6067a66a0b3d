"""Confined file helpers against real files, links, FIFOs and devices."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from ficc.execution.host.core.errors import HostError
from ficc.execution.host.linux.fsutil import (
    atomic_replace,
    bounded_read,
    create_exclusive,
    identity_of,
    open_dir,
    open_dir_at,
    open_regular_at,
)


@pytest.fixture
def dir_fd(tmp_path: Path) -> Iterator[int]:
    fd = open_dir(str(tmp_path))
    yield fd
    os.close(fd)


def _code(excinfo: pytest.ExceptionInfo[HostError]) -> str:
    return excinfo.value.code


def test_open_dir_walks_a_real_path(tmp_path: Path) -> None:
    (tmp_path / "a" / "b").mkdir(parents=True)
    fd = open_dir(str(tmp_path / "a" / "b"))
    try:
        assert os.path.samestat(os.fstat(fd), os.stat(tmp_path / "a" / "b"))
    finally:
        os.close(fd)


@pytest.mark.parametrize("path", ["relative/dir", "/tmp/../etc", "/tmp/", "//tmp", "/tmp/./x"])
def test_open_dir_refuses_unnormalized_paths(path: str) -> None:
    with pytest.raises(HostError) as excinfo:
        open_dir(path)
    assert _code(excinfo) == "unsafe_path"


def test_open_dir_refuses_a_symlink_in_a_middle_component(tmp_path: Path) -> None:
    (tmp_path / "real" / "inner").mkdir(parents=True)
    (tmp_path / "link").symlink_to(tmp_path / "real")
    with pytest.raises(HostError) as excinfo:
        open_dir(str(tmp_path / "link" / "inner"))
    assert _code(excinfo) == "unsafe_path"


def test_open_dir_refuses_a_symlink_as_the_last_component(tmp_path: Path) -> None:
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    with pytest.raises(HostError) as excinfo:
        open_dir(str(tmp_path / "link"))
    assert _code(excinfo) == "unsafe_path"


def _open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


def test_open_dir_lets_a_caller_check_every_directory_on_the_walk(tmp_path: Path) -> None:
    (tmp_path / "a" / "b").mkdir(parents=True)
    seen: list[tuple[str, bool]] = []

    def check(fd: int, walked: str) -> None:
        seen.append((walked, os.path.samestat(os.fstat(fd), os.stat(walked))))

    fd = open_dir(str(tmp_path / "a" / "b"), check=check)
    os.close(fd)
    walk = ["/", *(str(p) for p in reversed((tmp_path / "a" / "b").parents[:-1]))]
    assert seen == [(w, True) for w in [*walk, str(tmp_path / "a" / "b")]]


def test_a_refusal_by_the_callers_rules_leaks_no_descriptor(tmp_path: Path) -> None:
    (tmp_path / "a" / "b").mkdir(parents=True)
    target = str(tmp_path / "a")

    def check(_fd: int, walked: str) -> None:
        if walked == target:
            raise HostError("refused_here", walked)

    def open_child(parent_fd: int, name: str, walked: str) -> int:
        if walked == str(tmp_path / "a" / "b"):
            raise HostError("refused_child", walked)
        return os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=parent_fd)

    before = _open_fds()
    with pytest.raises(HostError) as by_check:
        open_dir(str(tmp_path / "a" / "b"), check=check)
    assert (by_check.value.code, by_check.value.message) == ("refused_here", target)
    with pytest.raises(HostError) as by_opener:
        open_dir(str(tmp_path / "a" / "b"), open_child=open_child)
    assert by_opener.value.code == "refused_child"
    assert _open_fds() == before


def test_open_dir_reports_missing_and_non_directory(tmp_path: Path) -> None:
    with pytest.raises(HostError) as missing:
        open_dir(str(tmp_path / "absent"))
    assert _code(missing) == "not_found"
    (tmp_path / "file").write_bytes(b"x")
    with pytest.raises(HostError) as not_dir:
        open_dir(str(tmp_path / "file" / "below"))
    assert _code(not_dir) == "not_directory"


@pytest.mark.parametrize("name", ["", ".", "..", "a/b", "a\0b"])
def test_single_component_names_only(dir_fd: int, name: str) -> None:
    with pytest.raises(HostError) as excinfo:
        open_dir_at(dir_fd, name)
    assert _code(excinfo) == "unsafe_path"
    with pytest.raises(HostError) as excinfo:
        create_exclusive(dir_fd, name, 0o600)
    assert _code(excinfo) == "unsafe_path"


def test_open_dir_at_refuses_a_symlink(tmp_path: Path, dir_fd: int) -> None:
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to("real")
    with pytest.raises(HostError) as excinfo:
        open_dir_at(dir_fd, "link")
    assert _code(excinfo) == "unsafe_path"
    os.close(open_dir_at(dir_fd, "real"))


def test_create_exclusive_sets_the_exact_mode_despite_umask(tmp_path: Path, dir_fd: int) -> None:
    old = os.umask(0o077)
    try:
        fd = create_exclusive(dir_fd, "f", 0o640)
    finally:
        os.umask(old)
    os.close(fd)
    assert stat.S_IMODE(os.stat(tmp_path / "f").st_mode) == 0o640


def test_create_exclusive_refuses_an_existing_file(tmp_path: Path, dir_fd: int) -> None:
    (tmp_path / "f").write_bytes(b"old")
    with pytest.raises(HostError) as excinfo:
        create_exclusive(dir_fd, "f", 0o600)
    assert _code(excinfo) == "file_exists"
    assert (tmp_path / "f").read_bytes() == b"old"


def test_create_exclusive_refuses_a_planted_symlink(tmp_path: Path, dir_fd: int) -> None:
    target = tmp_path / "victim"
    (tmp_path / "f").symlink_to(target)  # dangling: O_CREAT alone would create the target
    with pytest.raises(HostError) as excinfo:
        create_exclusive(dir_fd, "f", 0o600)
    assert _code(excinfo) == "unsafe_path"
    assert not target.exists()


def test_open_regular_at_accepts_a_plain_file(tmp_path: Path, dir_fd: int) -> None:
    (tmp_path / "f").write_bytes(b"data")
    fd = open_regular_at(dir_fd, "f", owner_uid=os.getuid())
    try:
        assert os.pread(fd, 10, 0) == b"data"
    finally:
        os.close(fd)


def test_open_regular_at_refuses_a_symlink(tmp_path: Path, dir_fd: int) -> None:
    (tmp_path / "real").write_bytes(b"x")
    (tmp_path / "f").symlink_to("real")
    with pytest.raises(HostError) as excinfo:
        open_regular_at(dir_fd, "f")
    assert _code(excinfo) == "unsafe_path"


def test_open_regular_at_refuses_a_fifo_without_hanging(tmp_path: Path, dir_fd: int) -> None:
    os.mkfifo(tmp_path / "f")
    with pytest.raises(HostError) as excinfo:
        open_regular_at(dir_fd, "f")
    assert _code(excinfo) == "not_regular_file"


def test_open_regular_at_refuses_a_directory(tmp_path: Path, dir_fd: int) -> None:
    (tmp_path / "d").mkdir()
    with pytest.raises(HostError) as excinfo:
        open_regular_at(dir_fd, "d")
    assert _code(excinfo) == "not_regular_file"


@pytest.mark.root("only root makes a device node")
def test_open_regular_at_refuses_a_device(tmp_path: Path, dir_fd: int) -> None:
    os.mknod(tmp_path / "null", 0o600 | stat.S_IFCHR, os.makedev(1, 3))
    with pytest.raises(HostError) as excinfo:
        open_regular_at(dir_fd, "null")
    assert _code(excinfo) == "not_regular_file"


def test_open_regular_at_refuses_a_hard_link(tmp_path: Path, dir_fd: int) -> None:
    (tmp_path / "f").write_bytes(b"x")
    os.link(tmp_path / "f", tmp_path / "alias")
    with pytest.raises(HostError) as excinfo:
        open_regular_at(dir_fd, "f")
    assert _code(excinfo) == "hard_link_refused"


def test_open_regular_at_refuses_the_wrong_owner(tmp_path: Path, dir_fd: int) -> None:
    (tmp_path / "f").write_bytes(b"x")
    os.chown(tmp_path / "f", 65534, 65534)
    with pytest.raises(HostError) as excinfo:
        open_regular_at(dir_fd, "f", owner_uid=0)
    assert _code(excinfo) == "wrong_owner"


def test_open_regular_at_reports_a_missing_file(dir_fd: int) -> None:
    with pytest.raises(HostError) as excinfo:
        open_regular_at(dir_fd, "absent")
    assert _code(excinfo) == "not_found"


def test_atomic_replace_swaps_content_and_leaves_no_temporary(tmp_path: Path, dir_fd: int) -> None:
    (tmp_path / "state").write_bytes(b"old")
    atomic_replace(dir_fd, "state", b"new", mode=0o640)
    assert (tmp_path / "state").read_bytes() == b"new"
    assert stat.S_IMODE(os.stat(tmp_path / "state").st_mode) == 0o640
    assert sorted(os.listdir(tmp_path)) == ["state"]


def test_atomic_replace_replaces_a_symlink_not_its_target(tmp_path: Path, dir_fd: int) -> None:
    (tmp_path / "victim").write_bytes(b"keep")
    (tmp_path / "state").symlink_to("victim")
    atomic_replace(dir_fd, "state", b"new")
    assert (tmp_path / "victim").read_bytes() == b"keep"
    assert not (tmp_path / "state").is_symlink()
    assert (tmp_path / "state").read_bytes() == b"new"


def test_bounded_read_takes_exactly_the_limit(tmp_path: Path, dir_fd: int) -> None:
    (tmp_path / "f").write_bytes(b"x" * 5000)
    fd = open_regular_at(dir_fd, "f")
    try:
        os.lseek(fd, 100, os.SEEK_SET)  # the position is irrelevant
        assert bounded_read(fd, 5000) == b"x" * 5000
        with pytest.raises(HostError) as excinfo:
            bounded_read(fd, 4999)
        assert _code(excinfo) == "file_too_large"
    finally:
        os.close(fd)


def test_identity_ignores_a_new_link_but_not_a_new_mtime(tmp_path: Path) -> None:
    path = tmp_path / "f"
    path.write_bytes(b"data")
    before = identity_of(os.stat(path))
    ctime = os.stat(path).st_ctime_ns
    os.link(path, tmp_path / "alias")
    assert os.stat(path).st_ctime_ns >= ctime
    assert identity_of(os.stat(path)) == before
    os.utime(path, ns=(0, before.mtime_ns + 1))
    assert identity_of(os.stat(path)) != before
