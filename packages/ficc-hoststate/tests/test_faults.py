"""R6 storage faults: failing write, fsync, rename and a full filesystem fail closed.

Faults are injected by replacing `os` functions for the duration of one call (the
save path calls them through the `os` module), and the full filesystem is a real,
tiny tmpfs. After every fault the session is poisoned and a fresh acquire sees a
valid snapshot: the last good state, or the new one if the rename had happened.
"""

from __future__ import annotations

import errno
import os
import pathlib
import subprocess
from collections.abc import Callable, Iterator
from typing import Any

import pytest

import ficc.hoststate as hs
import ficc.hoststate.session as session_module
from ficc.hoststate import Status, acquire
from ficc.hoststate.cli import inspect_store
from hs_support import HOST, plan


def failing(real: Callable[..., Any], fail_on: int, err: int = errno.EIO) -> Callable[..., Any]:
    """`real`, except that its `fail_on`-th call (1-based) raises OSError(err)."""
    calls = [0]

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        if calls[0] == fail_on:
            raise OSError(err, os.strerror(err))
        return real(*args, **kwargs)

    return wrapper


def short_then_failing(real: Callable[..., Any]) -> Callable[..., Any]:
    """A vectored write that writes 10 bytes, then fails with ENOSPC."""
    calls = [0]

    def wrapper(fd: int, buffers: list[memoryview], offset: int) -> int:
        calls[0] += 1
        if calls[0] == 1:
            return int(real(fd, [bytes(buffers[0])[:10]], offset))
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    return wrapper


# (name, os attribute, wrapper factory, did the rename happen before the fault?)
FAULTS = [
    ("write", "pwritev", lambda real: failing(real, 1), False),
    ("short-write-then-enospc", "pwritev", short_then_failing, False),
    ("file-fsync", "fsync", lambda real: failing(real, 1), False),
    ("rename", "replace", lambda real: failing(real, 1), False),
    ("rename-exdev", "replace", lambda real: failing(real, 1, errno.EXDEV), False),
    ("directory-fsync", "fsync", lambda real: failing(real, 2), True),
    ("close", "close", lambda real: failing(real, 1), False),
]


@pytest.fixture(params=[False, True], ids=["small-path", "parallel-hash-path"])
def parallel(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> bool:
    if request.param:  # force the large-image path (thread hash + fdatasync) on small data
        monkeypatch.setattr(session_module, "PARALLEL_HASH_FROM", 0)
    return bool(request.param)


def prepared(store: pathlib.Path) -> hs.Session:
    s = acquire(store, HOST)
    s.begin("op-1", plan(1))
    s.advance("op-1", 1, Status.RUNNING)
    return s


def assert_poisoned(s: hs.Session) -> None:
    for call, args in [("get", ("op-1",)), ("begin", ("op-1", plan(1))),
                       ("advance", ("op-1", 2, Status.SUCCEEDED))]:  # fmt: skip
        with pytest.raises(hs.Poisoned) as info:
            getattr(s, call)(*args)
        assert info.value.code == "poisoned"
    s.close()
    s.close()


@pytest.mark.parametrize(("name", "attr", "wrap", "renamed"), FAULTS, ids=[f[0] for f in FAULTS])
def test_save_fault_poisons_and_store_reopens_valid(
    store: pathlib.Path,
    monkeypatch: pytest.MonkeyPatch,
    parallel: bool,
    name: str,
    attr: str,
    wrap: Callable[[Callable[..., Any]], Callable[..., Any]],
    renamed: bool,
) -> None:
    s = prepared(store)
    with monkeypatch.context() as m:
        m.setattr(os, attr, wrap(getattr(os, attr)))
        with pytest.raises(hs.Poisoned) as info:
            s.advance("op-1", 2, Status.SUCCEEDED)
    assert isinstance(info.value.__cause__, OSError)
    assert "acquire again" in str(info.value)
    assert_poisoned(s)
    with acquire(store, HOST) as again:
        op = again.get("op-1")
        expected = (Status.SUCCEEDED, 3) if renamed else (Status.RUNNING, 2)
        assert (op.status, op.revision) == expected
    if not renamed:  # the writer removed its own temporary file
        assert sorted(p.name for p in store.iterdir()) == ["host.lock", "state.json"]


def test_datasync_fault_on_parallel_path(
    store: pathlib.Path, monkeypatch: pytest.MonkeyPatch, parallel: bool
) -> None:
    s = prepared(store)
    with monkeypatch.context() as m:
        m.setattr(os, "fdatasync", failing(os.fdatasync, 1))
        if parallel:
            with pytest.raises(hs.Poisoned):
                s.advance("op-1", 2, Status.SUCCEEDED)
            assert_poisoned(s)
        else:  # the small path does not use fdatasync at all
            s.advance("op-1", 2, Status.SUCCEEDED)
            s.close()
    with acquire(store, HOST) as again:
        assert again.get("op-1").revision == (2 if parallel else 3)


def test_marker_write_fault_poisons_and_reopen_repairs(
    store: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    s = acquire(store, HOST)
    with monkeypatch.context() as m:
        m.setattr(os, "pwrite", failing(os.pwrite, 1))
        with pytest.raises(hs.Poisoned):
            s.begin("op-1", plan(1))
    assert_poisoned(s)
    assert (store / "host.lock").read_bytes() == b""
    with acquire(store, HOST) as again:  # the snapshot landed; the marker is repaired
        assert again.get("op-1").revision == 1
    assert (store / "host.lock").read_bytes() != b""


def test_capacity_refusal_does_not_poison(
    store: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    s = prepared(store)
    s.advance("op-1", 2, Status.SUCCEEDED)
    monkeypatch.setattr(session_module, "MAX_BYTES", s._image.size + 10)
    with pytest.raises(hs.CapacityExceeded) as info:
        s.begin("op-2", plan(2))
    assert info.value.code == "capacity_exceeded"
    assert s.get("op-1").revision == 3  # still usable
    s.close()


# --- a real full filesystem -----------------------------------------------------


@pytest.fixture
def tiny_fs(tmp_path: pathlib.Path) -> Iterator[pathlib.Path]:
    """A 256 KiB tmpfs (mode 0700), unmounted afterwards."""
    mnt = tmp_path / "tiny"
    mnt.mkdir(mode=0o700)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k,mode=0700", "tmpfs", str(mnt)],
                   check=True)  # fmt: skip
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


def fill(directory: pathlib.Path) -> pathlib.Path:
    """Write a filler file until the filesystem reports ENOSPC."""
    filler = directory / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        with pytest.raises(OSError) as info:  # noqa: PT012 - the loop ends only by raising
            while True:
                os.write(fd, b"\0" * 4096)
    finally:
        os.close(fd)
    assert info.value.errno == errno.ENOSPC
    return filler


@pytest.mark.root("it mounts a tiny tmpfs to fill")
def test_full_filesystem_fails_closed(tiny_fs: pathlib.Path) -> None:
    with acquire(tiny_fs, HOST) as s:
        for n in range(20):
            op, _ = s.begin(f"op-{n}", plan(n))
            s.advance(op.id, 1, Status.CANCELLED)
        good = (tiny_fs / "state.json").read_bytes()
        filler = fill(tiny_fs)
        with pytest.raises(hs.Poisoned) as info:
            s.begin("op-20", plan(20))
        assert isinstance(info.value.__cause__, OSError)
        assert info.value.__cause__.errno == errno.ENOSPC
        assert_poisoned(s)
    assert (tiny_fs / "state.json").read_bytes() == good
    with acquire(tiny_fs, HOST) as s:  # reopen: the last good state, still full
        assert s.get("op-19").status is Status.CANCELLED
        with pytest.raises(hs.NotFound):
            s.get("op-20")
        with pytest.raises(hs.Poisoned):  # still fails closed while the disk is full
            s.begin("op-20", plan(20))
    os.unlink(filler)
    with acquire(tiny_fs, HOST) as s:  # space freed: work continues from the good state
        op, created = s.begin("op-20", plan(20))
        assert created
        assert op.revision == 1


@pytest.mark.root("it mounts a tiny tmpfs to fill")
def test_a_lost_marker_that_cannot_be_written_again_is_a_clean_refusal(
    tiny_fs: pathlib.Path,
) -> None:
    """The marker lost to a crash after the first save is written again by acquire; on
    a full filesystem that fails, and the refusal is a HostStateError, not an OSError."""
    with acquire(tiny_fs, HOST) as s:
        s.begin("op-1", plan(1))
    os.truncate(tiny_fs / "host.lock", 0)  # as a crash between the save and the marker
    filler = fill(tiny_fs)
    with pytest.raises(hs.Unsafe) as info:
        acquire(tiny_fs, HOST)
    assert "cannot be written again" in str(info.value)
    os.unlink(filler)
    with acquire(tiny_fs, HOST) as s:  # space freed: the marker is repaired
        assert s.get("op-1").revision == 1


@pytest.mark.root("it remounts a tmpfs read-only")
def test_a_read_only_store_is_a_clean_refusal(tiny_fs: pathlib.Path) -> None:
    """acquire needs host.lock for writing (the lock and the marker): on a read-only
    filesystem it refuses with a HostStateError naming the cause; inspect still reads."""
    with acquire(tiny_fs, HOST) as s:
        s.begin("op-1", plan(1))
    subprocess.run(["mount", "-o", "remount,ro", str(tiny_fs)], check=True)
    try:
        with pytest.raises(hs.Unsafe) as info:
            acquire(tiny_fs, HOST)
        assert "writable filesystem" in str(info.value)
        assert inspect_store(str(tiny_fs), HOST) is not None
    finally:
        subprocess.run(["mount", "-o", "remount,rw", str(tiny_fs)], check=True)
