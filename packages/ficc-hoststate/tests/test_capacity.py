"""Capacity: the 16 MiB limit and the 64-byte admission reserve, at the exact boundary.

The near-limit store is built directly with the codec (128-character IDs, so about
65,000 records make 16 MiB), written as a real store, then acquired.
"""

from __future__ import annotations

import os
import pathlib

import pytest

import ficc.hoststate as hs
from ficc.hoststate import Operation, Status, acquire, marker, snapshot
from ficc.hoststate.snapshot import MAX_BYTES, RESERVE
from hs_support import HOST, plan

S = Status
NEW = "z" * 128  # sorts after every filler record
FRAGMENT = len(snapshot._fragment(Operation(NEW, plan(0), S.QUEUED, 1)))


def filler(n: int, id_len: int) -> Operation:
    op_id = f"{n:08d}" + "x" * (id_len - 8)
    return Operation(id=op_id, plan_hash=plan(n), status=S.SUCCEEDED, revision=3)


def ops_for_size(size: int) -> list[Operation]:
    """Resolved records whose snapshot is exactly `size` bytes."""
    base = snapshot.Image(HOST, []).size
    full = len(snapshot._fragment(filler(0, 128))) + 1  # a record and its comma
    need = size - base + 1  # the first record has no comma
    count = -(-need // full)
    excess = count * full - need  # trim this many ID characters, at most 120 per record
    ops = []
    for n in range(count):
        cut = min(excess, 120)
        excess -= cut
        ops.append(filler(n, 128 - cut))
    assert excess == 0
    return ops


def write_store(store: pathlib.Path, ops: list[Operation]) -> int:
    data = snapshot.encode(HOST, ops)
    for name, content in (("state.json", data), ("host.lock", marker.encode(HOST))):
        fd = os.open(store / name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.write(fd, content)
        os.close(fd)
    return len(data)


def test_builder_is_exact() -> None:
    for size in (10_000, 10_001, 10_250, 123_457):
        assert len(snapshot.encode(HOST, ops_for_size(size))) == size


def test_begin_admitted_exactly_at_reserve_then_advances_always_fit(store: pathlib.Path) -> None:
    # After admitting NEW the file is exactly MAX_BYTES - RESERVE bytes.
    size = write_store(store, ops_for_size(MAX_BYTES - RESERVE - FRAGMENT - 1))
    assert size > 16 * 1024 * 1024 - 400
    with acquire(store, HOST) as s:
        op, created = s.begin(NEW, plan(0))
        assert created
        assert (store / "state.json").stat().st_size == MAX_BYTES - RESERVE
        # The longest growth path: queued -> running -> needs_attention -> failed_recovered.
        for status in (S.RUNNING, S.NEEDS_ATTENTION, S.FAILED_RECOVERED):
            op = s.advance(NEW, op.revision, status)
        final = (store / "state.json").stat().st_size
        assert final <= MAX_BYTES
        assert final - (MAX_BYTES - RESERVE) == len("failed_recovered") - len("queued")
        # Resolved, so the next begin is not blocked, but it no longer fits.
        with pytest.raises(hs.CapacityExceeded) as info:
            s.begin("next", plan("next"))
        assert "over the 16777216-byte limit" in str(info.value)
        # Refusal did not poison: reads and idempotent begins still work.
        assert s.get(NEW).status is S.FAILED_RECOVERED
        assert s.get(filler(7, 128).id).revision == 3
        assert s.begin(NEW, plan(0)) == (op, False)
    with acquire(store, HOST) as s:  # and what was written at the limit reopens
        assert s.get(NEW).revision == 4


def test_begin_refused_one_byte_over_the_reserve(store: pathlib.Path) -> None:
    write_store(store, ops_for_size(MAX_BYTES - RESERVE - FRAGMENT))
    before = (store / "state.json").read_bytes()
    with acquire(store, HOST) as s:
        with pytest.raises(hs.CapacityExceeded):
            s.begin(NEW, plan(0))
        with pytest.raises(hs.NotFound):
            s.get(NEW)
        assert s.get(filler(3, 128).id).status is S.SUCCEEDED
    assert (store / "state.json").read_bytes() == before  # nothing written


def test_reserve_covers_every_growth_path() -> None:
    """No sequence of advances grows a record by more than the reserve."""
    start = len(snapshot._fragment(Operation(NEW, plan(0), S.QUEUED, 1)))
    growth = max(
        len(snapshot._fragment(Operation(NEW, plan(0), status, revision))) - start
        for status, revision in hs.model.REACHABLE
    )
    assert 0 < growth <= RESERVE
