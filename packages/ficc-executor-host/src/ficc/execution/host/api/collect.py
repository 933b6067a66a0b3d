"""Bounded reads of an attempt's `stdout`, `stderr` and declared outputs.

Only three kinds of object can be read, and never by a path from the request:
`stdout` and `stderr` are the host's own log files (`logs/` of the attempt layout,
root-owned), and `output:<name>` is the path the immutable plan declares for `name`,
resolved below the attempt's `storage/` one component at a time without following a
link (`fsutil`), and accepted only as a regular file with exactly one link. A request
reads at most 1 MiB in total (the request model bounds it).

Each row answers `next_offset`, `eof` (the read reached the file's current end),
`complete` (the attempt has settled and its cleanup is confirmed, so the file will
never grow: a complete read is also at eof) and `identity`, the SHA-256 of the file's
(st_dev, st_ino): if it changes between reads, the object was replaced.

Records that never held resources (`admission_rejected`, `legacy_absence_acknowledged`)
have empty logs with a stable identity, `eof` and `complete`, and no outputs
(`object_unavailable`). No provider is called for any read.

Reads run in an I/O thread; the records are read first on the ledger thread, which
hands them straight to the I/O thread (`Workers.db_then_io`), and decoded plans are
kept for the next request (`PlanCache`: a client reads an output 1 MiB a request). A row
carries the bytes read, read into reused buffers (`ReadBuffers`) so a row's `data` is a
view of one; the reply carries them as `Base64Data`, which the daemon's reply encoder
writes as base64 with pybase64 (`replies`).
"""

from __future__ import annotations

import functools
import hashlib
import os
from collections import OrderedDict
from typing import Any, cast

import msgspec

from ficc.execution.errors import ErrorCode
from ficc.execution.host.context.buffers import ReadBuffers
from ficc.execution.host.context.parts import HostContext
from ficc.execution.host.core import lifecycle
from ficc.execution.host.core.errors import HostError
from ficc.execution.host.core.replies import Base64Data
from ficc.execution.host.ledger import store as ledgerlib
from ficc.execution.host.linux import fsutil
from ficc.execution.host.storage.layout import LOGS, STORAGE
from ficc.execution.host.storage.slot_files import SlotFiles
from ficc.execution.plan import Plan, decode_plan
from ficc.execution.protocol import COLLECT_MAX_BYTES, CollectRequest, Read
from ficc.execution.wire import ReadResult, ReadRow, ReadsReply, error_row

__all__ = ["collect", "identity_digest", "read_object"]

_LOGS = {"stdout", "stderr"}
_OUTPUT_PREFIX = "output:"
_BUFFERS = ReadBuffers(COLLECT_MAX_BYTES, keep=2)
"""The daemon's read buffers: 2 MiB resident at most, enough for back-to-back reads."""


def identity_digest(device: int, inode: int) -> str:
    """The stable, opaque identity of a file: SHA-256 of its (st_dev, st_ino)."""
    return "sha256:" + hashlib.sha256(f"file:{device}:{inode}".encode()).hexdigest()


def _empty_identity(attempt_id: str, name: str) -> str:
    """The identity of a log that never existed: stable per attempt and stream."""
    return "sha256:" + hashlib.sha256(f"empty:{attempt_id}:{name}".encode()).hexdigest()


async def collect(ctx: HostContext, request: CollectRequest) -> ReadsReply:
    """Answer a collect request: records on the ledger thread, then reads in an I/O thread.

    Every read is checked against its record (fence and state) on the ledger thread
    before any byte of it is read; the records go from there straight to the I/O thread.
    """
    fences = [read.fence for read in request.reads]

    def read_all(found: list[_Found]) -> list[ReadResult]:
        return [_row(ctx, read, item) for read, item in zip(request.reads, found, strict=True)]

    lookup = functools.partial(_records_with_plans, ctx.ledger, fences)
    rows = await ctx.workers.db_then_io(lookup, read_all)
    return ReadsReply(version=1, id=request.id, results=rows)


_Found = tuple[ledgerlib.AttemptRecord, Plan] | HostError
"""A read's record and plan, or why the ledger refuses the read."""


class PlanCache:
    """The last `size` plans decoded, by (attempt ID, plan digest); ledger thread only.

    Why: a client collecting an output sends one request per MiB, and reading,
    decoding and re-checking the same plan each time was about 0.03 ms a request. A plan
    never changes once admitted (the ledger's trigger refuses it), and the key holds
    the digest of its canonical bytes, so a cached plan is the one the ledger holds.
    """

    def __init__(self, size: int) -> None:
        self._size = size
        self._plans: OrderedDict[tuple[str, str], Plan] = OrderedDict()

    def get(self, ledger: ledgerlib.Ledger, record: ledgerlib.AttemptRecord) -> Plan:
        key = (record.attempt_id, record.plan_digest)
        plan = self._plans.get(key)
        if plan is None:
            data = ledger.plan_bytes(record.attempt_id)
            assert data is not None  # a record always has its plan
            plan = decode_plan(data)
            self._plans[key] = plan
            if len(self._plans) > self._size:
                self._plans.popitem(last=False)
        else:
            self._plans.move_to_end(key)
        return plan


_PLANS = PlanCache(8)
"""A few clients collecting at once; at most 8 plans of 128 KiB (encoded) stay decoded."""


def _records_with_plans(ledger: ledgerlib.Ledger, fences: list[Any]) -> list[_Found]:
    results: list[_Found] = []
    plans: dict[str, Plan] = {}  # each plan once per request, whatever the cache keeps
    for record in ledger.fenced(fences):
        if isinstance(record, HostError):
            results.append(record)
            continue
        if record.attempt_id not in plans:
            plans[record.attempt_id] = _PLANS.get(ledger, record)
        results.append((record, plans[record.attempt_id]))
    return results


def _row(ctx: HostContext, read: Read, item: _Found) -> ReadResult:
    try:
        if isinstance(item, HostError):
            raise item
        record, plan = item
        slot = ctx.slots.get(record.slot_id or "")
        if slot is None and record.slot_id is not None:
            # It held a slot the configuration no longer has (released before the slot
            # was removed): it may have run, so it is never answered as a record that
            # never did (empty logs, complete).
            raise HostError(
                ErrorCode.OBJECT_UNAVAILABLE,
                f"attempt {record.attempt_id} ran on slot {record.slot_id}, which is no longer"
                f" in the configuration; {read.object} cannot be read",
            )
        row = read_object(slot.files if slot is not None else None, record, plan, read)
    except HostError as error:
        return error_row(error.code, error.message)
    # pybase64 writes it into the reply (`replies`); typed bytes, as every reader sees it
    return msgspec.structs.replace(row, data=cast(bytes, Base64Data(row.data)))


def read_object(
    files: SlotFiles | None, record: ledgerlib.AttemptRecord, plan: Plan, read: Read
) -> ReadRow:
    """One bounded read; raises HostError with the row's code."""
    settled = record.status.state in lifecycle.SETTLED or record.status.state == "released"
    final = settled and record.status.cleanup_confirmed
    if files is None:  # a record that never held a slot: nothing was ever written
        return _no_resource_read(record, read)
    fd = _open_object(files, record, plan, read.object)
    try:
        st = os.fstat(fd)
        if read.offset > st.st_size:
            raise HostError(
                ErrorCode.OBJECT_CHANGED,
                f"{read.object} has {st.st_size} bytes, fewer than offset {read.offset}: it was"
                " replaced or truncated; restart the read from 0",
            )
        data = _pread(fd, min(read.length, st.st_size - read.offset), read.offset)
    finally:
        os.close(fd)
    end = read.offset + len(data)
    eof = end >= st.st_size
    return _read_row(read, data, eof=eof, complete=final and eof,
                     identity=identity_digest(st.st_dev, st.st_ino))  # fmt: skip


def _no_resource_read(record: ledgerlib.AttemptRecord, read: Read) -> ReadRow:
    if read.object not in _LOGS:
        raise HostError(
            ErrorCode.OBJECT_UNAVAILABLE,
            f"attempt {record.attempt_id} never ran ({record.status.reason}); it has no outputs",
        )
    if read.offset != 0:
        raise HostError(
            ErrorCode.OBJECT_CHANGED,
            f"{read.object} of an attempt that never ran is empty; read it from offset 0",
        )
    identity = _empty_identity(record.attempt_id, read.object)
    return _read_row(read, b"", eof=True, complete=True, identity=identity)


def _read_row(
    read: Read, data: bytes | memoryview, *, eof: bool, complete: bool, identity: str
) -> ReadRow:
    return ReadRow(
        attempt_id=read.attempt_id,
        generation=read.generation,
        plan_digest=read.plan_digest,
        object=read.object,
        offset=read.offset,
        # typed bytes for decoding; the encoder writes any buffer as the same base64
        data=cast(bytes, data),
        next_offset=read.offset + len(data),
        eof=eof,
        complete=complete,
        identity=identity,
    )


def _pread(fd: int, length: int, offset: int) -> memoryview:
    """Up to `length` bytes at `offset` (fewer at the end of the file), in a read buffer."""
    view = _BUFFERS.view(length)
    filled = 0
    while filled < length:
        count = os.preadv(fd, [view[filled:]], offset + filled)
        if not count:
            break
        filled += count
    return view[:filled]


def _open_object(files: SlotFiles, record: ledgerlib.AttemptRecord, plan: Plan, name: str) -> int:
    """The object's fd, opened without following links; refusals name the object."""
    attempt_id = record.attempt_id
    try:
        if name in _LOGS:
            logs_fd = files.open_part(attempt_id, LOGS)
            try:
                return fsutil.open_regular_at(logs_fd, name, owner_uid=0)
            finally:
                os.close(logs_fd)
        output = name.removeprefix(_OUTPUT_PREFIX)
        path = next((o.path for o in plan.job.outputs if o.name == output), None)
        if path is None:
            raise HostError(
                ErrorCode.OBJECT_UNKNOWN,
                f"{output!r} is not a declared output of this plan; only declared outputs,"
                " stdout and stderr can be read",
            )
        return _open_below(files.open_part(attempt_id, STORAGE), path)
    except HostError as error:
        if error.code == ErrorCode.OBJECT_UNKNOWN:
            raise
        detail = "does not exist (yet)" if error.code == ErrorCode.NOT_FOUND else error.message
        raise HostError(
            ErrorCode.OBJECT_UNAVAILABLE,
            f"{name} of attempt {attempt_id} is not readable: {detail} [{error.code}]",
        ) from error


def _open_below(storage_fd: int, path: str) -> int:
    """Walk `path` (relative, normalized, from the plan) below storage; takes the fd."""
    fd = storage_fd
    try:
        *directories, leaf = path.split("/")
        for component in directories:
            child = fsutil.open_dir_at(fd, component)
            os.close(fd)
            fd = child
        return fsutil.open_regular_at(fd, leaf)
    finally:
        os.close(fd)
