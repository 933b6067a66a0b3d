"""Bounded reads of logs and declared outputs, against a real attempt layout on disk."""

from __future__ import annotations

import gc
import hashlib
import os
import threading
from dataclasses import dataclass
from pathlib import Path

import msgspec
import pytest

from ficc.execution import plan as planlib
from ficc.execution.host.api.collect import PlanCache, identity_digest, read_object
from ficc.execution.host.context.buffers import ReadBuffers
from ficc.execution.host.core import lifecycle as lc
from ficc.execution.host.core.errors import HostError
from ficc.execution.host.ledger.store import AttemptRecord
from ficc.execution.host.storage.layout import Layout
from ficc.execution.protocol import COLLECT_MAX_BYTES, CollectRequest, Read, validate_request
from ficc_testkit import plans

pytestmark = pytest.mark.root("the layout chowns to a slot account")

SLOT_UID = 61_771
SHA = "sha256:" + "c" * 64


@dataclass(frozen=True)
class Slot:
    path: str
    uid: int = SLOT_UID
    gid: int = SLOT_UID


def make_plan(outputs: dict[str, str]) -> planlib.Plan:
    return plans.make_plan(
        package_digest=SHA, image_digest=SHA, cpu_millis=100, memory_bytes=1 << 30,
        processes=8, storage_bytes=1 << 30, storage_inodes=100, outputs=outputs,
    )  # fmt: skip


def record_of(
    plan: planlib.Plan, status: lc.Status, slot_id: str | None = "slot0"
) -> AttemptRecord:
    return AttemptRecord(
        attempt_id=plan.attempt_id,
        job_id=plan.job_id,
        generation=plan.generation,
        plan_digest=planlib.plan_digest(plan),
        offer_revision=1,
        status=status,
        detail=None,
        slot_id=slot_id,
        lease=None,
        created=1,
        updated=1,
    )


RUNNING = lc.Status(state="running", start_requested=True)
DONE = lc.Status(state="succeeded", outcome="succeeded", reason="exited", exit_code=0)
CLEAN = lc.Status(
    state="succeeded", outcome="succeeded", reason="exited", exit_code=0, cleanup_confirmed=True
)


def read(plan: planlib.Plan, name: str, offset: int = 0, length: int = COLLECT_MAX_BYTES) -> Read:
    return Read(plan.attempt_id, 1, planlib.plan_digest(plan), name, offset, length)


@pytest.fixture
def layout(tmp_path: Path) -> Layout:
    slot = tmp_path / "slot"
    slot.mkdir(mode=0o755)
    return Layout(Slot(str(slot)))


@pytest.fixture
def plan() -> planlib.Plan:
    return make_plan({"result": "out/result.txt", "flat": "flat.bin"})


def refused(call: object) -> str:
    assert callable(call)
    with pytest.raises(HostError) as caught:
        call()
    return caught.value.code


def test_logs_read_in_bounded_chunks_with_offsets(layout: Layout, plan: planlib.Plan) -> None:
    paths = layout.create(plan.attempt_id)
    content = os.urandom(COLLECT_MAX_BYTES + 1000)
    Path(paths.stdout).write_bytes(content)
    record = record_of(plan, RUNNING)
    first = read_object(layout, record, plan, read(plan, "stdout"))
    assert first.data == content[:COLLECT_MAX_BYTES]
    assert (first.next_offset, first.eof, first.complete) == (COLLECT_MAX_BYTES, False, False)
    second = read_object(layout, record, plan, read(plan, "stdout", first.next_offset, 4096))
    assert second.data == content[COLLECT_MAX_BYTES:]
    assert (second.next_offset, second.eof, second.complete) == (len(content), True, False)
    assert first.identity == second.identity
    st = os.stat(paths.stdout)
    assert first.identity == identity_digest(st.st_dev, st.st_ino)
    empty = read_object(layout, record, plan, read(plan, "stderr"))
    assert (empty.data, empty.eof) == (b"", True)


def test_complete_only_once_settled_and_cleaned_up(layout: Layout, plan: planlib.Plan) -> None:
    paths = layout.create(plan.attempt_id)
    Path(paths.stderr).write_bytes(b"done\n")
    assert not read_object(layout, record_of(plan, DONE), plan, read(plan, "stderr")).complete
    final = read_object(layout, record_of(plan, CLEAN), plan, read(plan, "stderr"))
    assert (final.complete, final.eof, final.data) == (True, True, b"done\n")
    partial = read_object(layout, record_of(plan, CLEAN), plan, read(plan, "stderr", 0, 2))
    assert (partial.eof, partial.complete) == (False, False)


def test_declared_outputs_below_storage(layout: Layout, plan: planlib.Plan) -> None:
    paths = layout.create(plan.attempt_id)
    storage = Path(paths.storage)
    (storage / "out").mkdir()
    (storage / "out" / "result.txt").write_bytes(b"42\n")
    row = read_object(layout, record_of(plan, RUNNING), plan, read(plan, "output:result", 1))
    assert (row.data, row.offset, row.next_offset) == (b"2\n", 1, 3)
    code = refused(lambda: read_object(layout, record_of(plan, RUNNING), plan,
                                       read(plan, "output:other")))  # fmt: skip
    assert code == "object_unknown"
    code = refused(lambda: read_object(layout, record_of(plan, RUNNING), plan,
                                       read(plan, "output:flat")))  # fmt: skip
    assert code == "object_unavailable"  # declared, not produced yet


@pytest.mark.parametrize("kind", ["symlink", "hardlink", "fifo", "directory", "linked_parent"])
def test_outputs_that_are_not_plain_files_are_refused(
    layout: Layout, plan: planlib.Plan, tmp_path: Path, kind: str
) -> None:
    paths = layout.create(plan.attempt_id)
    storage = Path(paths.storage)
    secret = tmp_path / "secret"
    secret.write_bytes(b"root only")
    target = storage / "flat.bin"
    if kind == "symlink":
        target.symlink_to(secret)
    elif kind == "hardlink":
        (storage / "original").write_bytes(b"x")
        os.link(storage / "original", target)
    elif kind == "fifo":
        os.mkfifo(target)
    elif kind == "directory":
        target.mkdir()
    else:  # a link where a parent directory is expected
        outside = tmp_path / "outside"
        outside.mkdir()
        (outside / "result.txt").write_bytes(b"root only")
        (storage / "out").symlink_to(outside)
    name = "output:result" if kind == "linked_parent" else "output:flat"
    row = lambda: read_object(layout, record_of(plan, RUNNING), plan, read(plan, name))  # noqa: E731
    assert refused(row) == "object_unavailable"


def test_large_reads_held_at_once_keep_their_own_bytes(layout: Layout, plan: planlib.Plan) -> None:
    """Reads share reused buffers, yet a row still held is never overwritten."""
    paths = layout.create(plan.attempt_id)
    content = os.urandom(3 * COLLECT_MAX_BYTES)
    Path(paths.stdout).write_bytes(content)
    record = record_of(plan, RUNNING)
    rows = [
        read_object(layout, record, plan, read(plan, "stdout", offset))
        for offset in range(0, len(content), COLLECT_MAX_BYTES)
    ]
    assert b"".join(row.data for row in rows) == content
    del rows
    gc.collect()
    again = read_object(layout, record, plan, read(plan, "stdout", COLLECT_MAX_BYTES))
    assert again.data == content[COLLECT_MAX_BYTES : 2 * COLLECT_MAX_BYTES]


def test_a_read_buffer_is_handed_out_again_only_once_no_view_of_it_is_left() -> None:
    buffers = ReadBuffers(1 << 20, keep=2)
    first, second = buffers.view(1 << 20), buffers.view(1 << 19)
    third = buffers.view(1 << 20)  # both kept buffers are in use: a fresh one
    assert len({id(first.obj), id(second.obj), id(third.obj)}) == 3
    assert (len(first), len(second), len(third)) == (1 << 20, 1 << 19, 1 << 20)
    kept = first.obj
    part = first[10:20]
    del first
    assert buffers.view(1 << 20).obj is not kept  # a slice of it is still alive
    del part
    assert buffers.view(1 << 20).obj is kept
    assert len(buffers.view(100).obj) == 100  # small reads never hold a kept buffer
    with pytest.raises(ValueError, match="does not fit"):
        buffers.view((1 << 20) + 1)


def test_read_buffers_are_never_shared_between_threads() -> None:
    buffers = ReadBuffers(1 << 16, keep=2)
    together = threading.Barrier(4)
    failures: list[str] = []

    def fill(mark: int) -> None:
        for _ in range(100):
            view = buffers.view(1 << 16)
            view[:] = bytes([mark]) * len(view)
            together.wait(30)  # all four views are alive here, two of them kept buffers
            if view.tobytes() != bytes([mark]) * len(view):
                failures.append(f"thread {mark} saw another thread's bytes")
            together.wait(30)

    threads = [threading.Thread(target=fill, args=(mark,)) for mark in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert failures == []


def test_an_offset_past_the_end_means_the_file_changed(layout: Layout, plan: planlib.Plan) -> None:
    paths = layout.create(plan.attempt_id)
    Path(paths.stdout).write_bytes(b"short")
    code = refused(lambda: read_object(layout, record_of(plan, RUNNING), plan,
                                       read(plan, "stdout", 6)))  # fmt: skip
    assert code == "object_changed"
    at_end = read_object(layout, record_of(plan, RUNNING), plan, read(plan, "stdout", 5))
    assert (at_end.data, at_end.eof) == (b"", True)


def test_a_replaced_log_has_another_identity(layout: Layout, plan: planlib.Plan) -> None:
    paths = layout.create(plan.attempt_id)
    before = read_object(layout, record_of(plan, RUNNING), plan, read(plan, "stdout")).identity
    os.rename(paths.stdout, Path(paths.logs) / "old")  # keeps the old inode in use
    Path(paths.stdout).write_bytes(b"")
    after = read_object(layout, record_of(plan, RUNNING), plan, read(plan, "stdout")).identity
    assert before != after


def test_no_resource_records_have_empty_final_logs_and_no_outputs(plan: planlib.Plan) -> None:
    for status in (lc.admission_rejected(), lc.absence_acknowledged()):
        record = record_of(plan, status, slot_id=None)
        rows = [read_object(None, record, plan, read(plan, name)) for name in ("stdout", "stderr")]
        for row in rows:
            assert (row.data, row.eof, row.complete, row.next_offset) == (b"", True, True, 0)
        again = read_object(None, record, plan, read(plan, "stdout"))
        assert again.identity == rows[0].identity != rows[1].identity
        name = f"empty:{plan.attempt_id}:stdout".encode()
        assert rows[0].identity == "sha256:" + hashlib.sha256(name).hexdigest()
        with pytest.raises(HostError) as caught:
            read_object(None, record, plan, read(plan, "output:result"))
        assert caught.value.code == "object_unavailable"


class PlanLedger:
    """The one ledger call PlanCache makes (`plan_bytes`), counted; pure logic only."""

    def __init__(self, *plans: planlib.Plan) -> None:
        self.plans = {p.attempt_id: planlib.encode_plan(p) for p in plans}
        self.reads: list[str] = []

    def plan_bytes(self, attempt_id: str) -> bytes | None:
        self.reads.append(attempt_id)
        return self.plans.get(attempt_id)


def test_a_plan_is_decoded_once_then_kept_by_attempt_and_digest(plan: planlib.Plan) -> None:
    ledger, cache = PlanLedger(plan), PlanCache(2)
    record = record_of(plan, RUNNING)
    assert cache.get(ledger, record) == plan  # type: ignore[arg-type]
    assert cache.get(ledger, record) == plan  # type: ignore[arg-type]
    assert ledger.reads == [plan.attempt_id]


def test_the_plan_cache_keeps_the_most_recently_used_few() -> None:
    a, b, c = (make_plan({"result": f"{name}.txt"}) for name in "abc")
    ledger, cache = PlanLedger(a, b, c), PlanCache(2)
    for p in (a, b, a, c):  # c evicts b, the least recently used
        cache.get(ledger, record_of(p, RUNNING))  # type: ignore[arg-type]
    ledger.reads.clear()
    assert cache.get(ledger, record_of(a, RUNNING)) == a  # type: ignore[arg-type]
    assert cache.get(ledger, record_of(b, RUNNING)) == b  # type: ignore[arg-type]
    assert ledger.reads == [b.attempt_id]


def test_another_plan_digest_under_the_same_attempt_id_is_never_served_from_the_cache() -> None:
    first = make_plan({"result": "first.txt"})
    second = msgspec.structs.replace(first, job=msgspec.structs.replace(first.job, name="other"))
    ledger, cache = PlanLedger(first), PlanCache(2)
    assert cache.get(ledger, record_of(first, RUNNING)) == first  # type: ignore[arg-type]
    ledger.plans[first.attempt_id] = planlib.encode_plan(second)  # as a different ledger holds it
    assert cache.get(ledger, record_of(second, RUNNING)) == second  # type: ignore[arg-type]
    assert ledger.reads == [first.attempt_id, first.attempt_id]


def test_the_request_bounds_a_batch_to_one_mebibyte(plan: planlib.Plan) -> None:
    reads = [read(plan, "stdout", 0, COLLECT_MAX_BYTES), read(plan, "stderr", 0, 1)]
    with pytest.raises(Exception, match="more than 1 MiB"):
        validate_request(CollectRequest(version=1, id="0" * 32, reads=reads))
