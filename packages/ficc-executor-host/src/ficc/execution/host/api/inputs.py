"""The streamed-input actions: `input_status` and `input_write`, each row checked
against the attempt's authority and its plan's declared inputs before a byte is staged."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any, NamedTuple

from ficc.execution._executor import (
    ReceivedInputWrite,
    ReceivedInputWriteRequest,
)
from ficc.execution.errors import ErrorCode
from ficc.execution.host.api.port import RunnerPort
from ficc.execution.host.context.parts import HostContext
from ficc.execution.host.core import leases
from ficc.execution.host.core.errors import HostError
from ficc.execution.host.ledger import store as ledgerlib
from ficc.execution.host.storage.staging import StreamState
from ficc.execution.protocol import (
    INPUT_CHUNK_MAX_BYTES,
    Fence,
    InputStatusRequest,
    InputWrite,
    InputWriteRequest,
    ObjectRef,
    Sender,
)
from ficc.execution.wire import (
    AnyReply,
    InputResult,
    InputRow,
    InputsReply,
    error_row,
)

INPUT_CHUNK_BYTES = INPUT_CHUNK_MAX_BYTES
"""The `input_chunk_bytes` this executor announces and enforces (8 MiB)."""
AnyInputWrite = ReceivedInputWrite | InputWrite
"""An `input_write` row as `receive_request` may return it."""


class _StagingFacts(NamedTuple):
    """What every input row of one request is checked against (read once)."""

    now: leases.Now
    inputs: dict[str, list[ledgerlib.InputRecord]]
    """The declared streamed inputs of each fenced attempt of the request."""
    control: ledgerlib.Control


def _staging_record(
    record: ledgerlib.AttemptRecord | HostError, object_id: str, facts: _StagingFacts
) -> ledgerlib.AttemptRecord:
    """Refuse input operations unless the attempt is prepared with a current lease and
    the offer keeps leases alive."""
    if isinstance(record, HostError):
        raise record
    declared = {i.object_id: i for i in facts.inputs[record.attempt_id]}
    if object_id not in declared:
        raise HostError(
            ErrorCode.INPUT_UNKNOWN,
            f"{object_id} is not a streamed input of this attempt's plan; check the plan",
        )
    if record.status.state != "prepared":
        failed = declared[object_id].failed
        if failed is not None:
            raise HostError(
                ErrorCode.INPUT_FAILED,
                f"input {object_id} failed ({failed}); the attempt cannot start:"
                " release it and admit a new attempt",
            )
        raise HostError(
            ErrorCode.INVALID_STATE,
            f"inputs are staged only while the attempt is prepared; it is {record.status.state}",
        )
    if record.lease is None or not leases.is_current(record.lease, facts.now):
        raise HostError(ErrorCode.LEASE_EXPIRED, "the lease is not current; inputs are closed")
    control = facts.control
    if "renew" not in ledgerlib.OFFER_ALLOWS[control]:
        raise HostError(ErrorCode.OFFER_CLOSED, f"the offer is {control}; staging is closed")
    return record


def _authorized(
    ctx: HostContext, rows: Sequence[ObjectRef | AnyInputWrite]
) -> list[ledgerlib.AttemptRecord | HostError]:
    """Fence, state, lease and offer checks for each input row. One ledger-thread call,
    so records, inputs and offer are read with no write in between, and the clock is
    read there, after the request's wait for the ledger thread."""
    results: list[ledgerlib.AttemptRecord | HostError] = []
    now = ctx.clock.now()
    records = ctx.ledger.fenced([row.fence for row in rows])
    known = [r.attempt_id for r in records if isinstance(r, ledgerlib.AttemptRecord)]
    facts = _StagingFacts(now, ctx.ledger.inputs_of(known), ctx.ledger.offer().control)
    for row, record in zip(rows, records, strict=True):
        try:
            results.append(_staging_record(record, row.object, facts))
        except HostError as error:
            results.append(error)
    return results


def _input_row(fence: Fence, state: StreamState) -> InputRow:
    return InputRow(
        attempt_id=fence.attempt_id,
        generation=fence.generation,
        plan_digest=fence.plan_digest,
        object=state.id,
        offset=state.offset,
        bytes=state.bytes,
        digest=state.digest,
        complete=state.complete,
    )


def _stager(ctx: HostContext, record: ledgerlib.AttemptRecord) -> Any:
    slot = ctx.slots.get(record.slot_id or "")
    if slot is None:
        raise HostError(ErrorCode.INVALID_STATE, "the attempt holds no slot; it has no inputs")
    return slot.stager


def _not_staged_yet(error: HostError) -> HostError:
    """A prepared attempt the stager does not know yet is being set up again (after a
    restart, recovery re-registers it): the client retries, as for `inputs_preparing`."""
    if error.code != ErrorCode.ATTEMPT_NOT_STAGED:
        return error
    return HostError(
        ErrorCode.INPUTS_PREPARING,
        "the staging directory is being initialized again after a restart; retry on a"
        " later polling cycle",
    )


async def input_status(
    ctx: HostContext, runner: RunnerPort, sender: Sender, request: InputStatusRequest
) -> AnyReply:
    """The durable next offset of each object (the stager's state is the committed one)."""
    records = await ctx.workers.db(_authorized, ctx, request.objects)

    def status(ref: ObjectRef, record: ledgerlib.AttemptRecord | HostError) -> InputResult:
        try:
            if isinstance(record, HostError):
                raise record
            state = _stager(ctx, record).status(ref.attempt_id, ref.object)
        except HostError as error:
            refusal = _not_staged_yet(error)
            return error_row(refusal.code, refusal.message)
        return _input_row(ref.fence, state)

    rows = await ctx.workers.io(
        lambda: [status(ref, rec) for ref, rec in zip(request.objects, records, strict=True)]
    )
    return InputsReply(version=1, id=request.id, results=rows)


async def input_write(
    ctx: HostContext,
    runner: RunnerPort,
    sender: Sender,
    request: ReceivedInputWriteRequest | InputWriteRequest,
) -> AnyReply:
    """Write chunks: rows of one attempt one after another (else the second would meet
    `input_busy`), different attempts in parallel. Each chunk is synced by the stager
    before the ledger commits its offset, on the ledger thread.

    The server's `receive_request` gives a `ReceivedInputWriteRequest` (chunks decoded
    piece by piece straight from the frame, which is let go once every row is written),
    or an `InputWriteRequest` for a document whose base64 is spelled with JSON escapes;
    both offer checked chunks in pieces to the stager. The lease is judged when the
    rows are authorized and again inside each chunk's commit transaction."""
    writes: Sequence[AnyInputWrite] = request.writes
    results: list[InputResult | None] = [None] * len(writes)
    try:
        records = await ctx.workers.db(_authorized, ctx, writes)
        by_attempt: dict[str, list[int]] = {}
        for index, write in enumerate(writes):
            by_attempt.setdefault(write.attempt_id, []).append(index)

        async def attempt_writes(indices: list[int]) -> None:
            for index in indices:
                results[index] = await _write_one(ctx, runner, writes[index], records[index])

        await asyncio.gather(*(attempt_writes(indices) for indices in by_attempt.values()))
    finally:
        if isinstance(request, ReceivedInputWriteRequest):
            request.release()
    rows = [r for r in results if r is not None]
    return InputsReply(version=1, id=request.id, results=rows)


async def _write_one(
    ctx: HostContext,
    runner: RunnerPort,
    write: AnyInputWrite,
    record: ledgerlib.AttemptRecord | HostError,
) -> InputResult:
    if isinstance(record, HostError):
        return error_row(record.code, record.message)
    fence = write.fence

    def commit(state: StreamState) -> None:
        ctx.workers.db_blocking(
            ctx.ledger.commit_stream, fence, state, write.offset, when=ctx.clock
        )

    try:
        stager = _stager(ctx, record)
        state = await ctx.workers.io(
            stager.write,
            write.attempt_id,
            write.object,
            write.offset,
            write,
            write.digest,
            commit=commit,
        )
        complete = state.complete and await ctx.workers.io(stager.all_complete, write.attempt_id)
    except HostError as error:
        refusal = _not_staged_yet(error)
        return error_row(refusal.code, refusal.message)
    if complete:
        runner.inputs_complete(write.attempt_id)
    return _input_row(fence, state)
