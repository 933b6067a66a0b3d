"""The initialization marker in host.lock: written after the first snapshot, repaired
from a valid snapshot, and the reason a deleted snapshot is refused."""

from __future__ import annotations

import os
import pathlib

import pytest

import ficc.hoststate as hs
import ficc.hoststate.session as session_module
from ficc.hoststate import acquire, marker
from ficc.hoststate.cli import inspect_store
from hs_support import HOST, plan

MARKER = b'{"format":"ficc-hoststate-marker","host_id":"host-a","version":1}\n'


def test_marker_bytes() -> None:
    assert marker.encode(HOST) == MARKER
    assert marker.decode(MARKER) == HOST
    assert marker.decode(b"") is None


def test_fresh_store_has_empty_lock_and_no_snapshot(store: pathlib.Path) -> None:
    with acquire(store, HOST):
        pass
    assert (store / "host.lock").read_bytes() == b""
    assert not (store / "state.json").exists()
    with acquire(store, HOST) as s, pytest.raises(hs.NotFound):  # still fresh, no error
        s.get("op-1")


def test_marker_written_after_first_snapshot(
    store: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[bool] = []
    real = session_module.write_in_place

    def spy(fd: int, data: bytes) -> None:
        seen.append((store / "state.json").exists())
        real(fd, data)

    monkeypatch.setattr(session_module, "write_in_place", spy)
    with acquire(store, HOST) as s:
        s.begin("op-1", plan(1))
        s.advance("op-1", 1, "running")
    assert seen == [True]  # once, and only after state.json existed
    assert (store / "host.lock").read_bytes() == MARKER


def test_missing_snapshot_after_marker_is_refused(store: pathlib.Path) -> None:
    with acquire(store, HOST) as s:
        s.begin("op-1", plan(1))
    os.unlink(store / "state.json")
    with pytest.raises(hs.Corrupt) as info:
        acquire(store, HOST)
    assert "state.json is missing" in str(info.value)
    with pytest.raises(hs.Corrupt):
        inspect_store(str(store), HOST)
    assert not (store / "state.json").exists()  # nothing was started over it


def test_lost_marker_is_repaired_from_valid_snapshot(store: pathlib.Path) -> None:
    with acquire(store, HOST) as s:
        s.begin("op-1", plan(1))
        s.advance("op-1", 1, "running")
    inode = (store / "host.lock").stat().st_ino
    os.truncate(store / "host.lock", 0)  # as if killed between the snapshot and the marker
    with acquire(store, HOST) as s:
        assert s.get("op-1").revision == 2
        assert (store / "host.lock").read_bytes() == MARKER  # repaired in place
    assert (store / "host.lock").stat().st_ino == inode
    os.unlink(store / "state.json")
    with pytest.raises(hs.Corrupt):  # and from now on the snapshot is required
        acquire(store, HOST)


def test_lost_marker_with_corrupt_snapshot_is_not_repaired(store: pathlib.Path) -> None:
    with acquire(store, HOST) as s:
        s.begin("op-1", plan(1))
    os.truncate(store / "host.lock", 0)
    data = (store / "state.json").read_bytes()
    (store / "state.json").write_bytes(data[:-3])
    with pytest.raises(hs.Corrupt):
        acquire(store, HOST)
    assert (store / "host.lock").read_bytes() == b""


@pytest.mark.parametrize(
    "garbage",
    [
        b"x",
        b"\x00" * 10,
        MARKER[:-1],  # no newline
        MARKER[:30],  # torn
        MARKER + b"more",
        MARKER.replace(b"1}", b"2}"),
        MARKER.replace(b"-marker", b"-other"),
        MARKER.replace(b'":', b'": '),
        MARKER.replace(b'"version"', b'"extra":1,"version"'),
        b"{}\n",
        b"x" * 5000,
    ],
)
def test_marker_garbage(store: pathlib.Path, garbage: bytes) -> None:
    with acquire(store, HOST) as s:
        s.begin("op-1", plan(1))
    with open(store / "host.lock", "r+b") as f:  # in place, like any real damage
        f.truncate(0)
        f.write(garbage)
    with pytest.raises(hs.Corrupt) as info:
        acquire(store, HOST)
    assert "host.lock" in str(info.value)
    assert (store / "host.lock").read_bytes() == garbage  # left for the operator


def test_marker_for_another_host(store: pathlib.Path) -> None:
    with acquire(store, "host-b") as s:
        s.begin("op-1", plan(1))
    with pytest.raises(hs.HostMismatch) as info:
        acquire(store, HOST)
    assert "host-b" in str(info.value)
    with pytest.raises(hs.HostMismatch):
        inspect_store(str(store), HOST)
