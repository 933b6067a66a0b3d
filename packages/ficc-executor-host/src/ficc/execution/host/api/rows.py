"""Reply rows: an attempt's record as the protocol shows it (its status with the outcome
only once settled, its staged bytes, its log sizes and its usage), read for a batch of
attempts at once."""

from __future__ import annotations

import os
import stat
from collections.abc import Sequence
from typing import Final, NamedTuple, TypeVar, cast

import msgspec

from ficc.execution._executor import (
    ReceivedRequest,
)
from ficc.execution.host.api.port import RunnerPort
from ficc.execution.host.context.parts import HostContext
from ficc.execution.host.core import lifecycle
from ficc.execution.host.core import usage as usagelib
from ficc.execution.host.core.errors import HostError
from ficc.execution.host.ledger import store as ledgerlib
from ficc.execution.wire import (
    AttemptResult,
    AttemptRow,
    AttemptsReply,
    AttemptStatus,
    Outcome,
    Usage,
    error_row,
)


def _has_logs(record: ledgerlib.AttemptRecord) -> bool:
    """Whether the attempt can have written logs: only a service writes them, and a
    service is created only after a start was requested (the flag is never cleared)."""
    return record.status.start_requested


def _log_bytes(ctx: HostContext, record: ledgerlib.AttemptRecord) -> tuple[int, int]:
    """Current sizes of the attempt's stdout and stderr (0 when absent or not a file,
    and without a look at the disk for an attempt that never started)."""
    if not _has_logs(record):
        return 0, 0
    slot = ctx.slots.get(record.slot_id or "")
    if slot is None:
        return 0, 0
    paths = slot.files.paths(record.attempt_id)
    sizes = []
    for path in (paths.stdout, paths.stderr):
        try:
            st = os.stat(path, follow_symlinks=False)
        except OSError:
            sizes.append(0)
            continue
        sizes.append(st.st_size if stat.S_ISREG(st.st_mode) else 0)
    return sizes[0], sizes[1]


def attempt_row(record: ledgerlib.AttemptRecord, staged: int, logs: tuple[int, int]) -> AttemptRow:
    """The wire row of a record (a batch reply row)."""
    return _status_as(AttemptRow, record, staged, logs)


def attempt_status(
    record: ledgerlib.AttemptRecord, staged: int, logs: tuple[int, int]
) -> AttemptStatus:
    """What the record says, as a snapshot lists it."""
    return _status_as(AttemptStatus, record, staged, logs)


_Status = TypeVar("_Status", bound=AttemptStatus)
_SHOWS_OUTCOME: Final = lifecycle.SETTLED | {"released"}


def _status_as(
    cls: type[_Status], record: ledgerlib.AttemptRecord, staged: int, logs: tuple[int, int]
) -> _Status:
    """The fields an attempt row and a snapshot's status share, from the record (built
    with keyword arguments, not a dict: every reply row of a batch passes here)."""
    status = record.status
    state = status.state
    lease = record.lease
    # The ledger records the settled state as the outcome; a state is wider as a type.
    outcome = cast("Outcome", status.outcome) if state in _SHOWS_OUTCOME else None
    return cls(
        attempt_id=record.attempt_id,
        generation=record.generation,
        plan_digest=record.plan_digest,
        state=state,
        ready=status.ready,
        outcome=outcome,
        reason=status.reason,
        exit_code=status.exit_code,
        lease_sequence=0 if lease is None else lease.sequence,
        lease_expires_at_ms=None if lease is None else lease.effective_expires_at_ms,
        slot=None if state == "released" else record.slot_id,  # reserved only
        staged_bytes=staged,
        stdout_bytes=logs[0],
        stderr_bytes=logs[1],
        cleanup_confirmed=status.cleanup_confirmed,
        storage_exhausted=True if status.storage_exhausted else msgspec.UNSET,
        log_cut_short=True if status.log_cut_short else msgspec.UNSET,
    )


class RowsRead(NamedTuple):
    """A batch's records (or row refusals) with their staged bytes, read together."""

    results: list[ledgerlib.AttemptRecord | HostError]
    staged: dict[str, int]


def with_staged(
    ledger: ledgerlib.Ledger, results: list[ledgerlib.AttemptRecord | HostError]
) -> RowsRead:
    """Add the staged bytes in the same ledger-thread call that produced `results`, so
    a hot request queues once on the ledger thread instead of twice."""
    ids = [r.attempt_id for r in results if isinstance(r, ledgerlib.AttemptRecord)]
    return RowsRead(results, ledger.staged_bytes(ids))


async def attempt_rows(
    ctx: HostContext,
    results: Sequence[ledgerlib.AttemptRecord | HostError],
    staged: dict[str, int] | None = None,
) -> list[AttemptResult]:
    """Rows for records (with staged and log byte counts) and refusals, in order.
    `staged` is read from the ledger unless the caller already has it."""
    records = [r for r in results if isinstance(r, ledgerlib.AttemptRecord)]
    ids = [r.attempt_id for r in records]
    if staged is None:
        staged = await ctx.workers.db(ctx.ledger.staged_bytes, ids) if ids else {}
    logs = await logs_of(ctx, records)
    rows: list[AttemptResult] = []
    for result in results:
        if isinstance(result, HostError):
            rows.append(error_row(result.code, result.message))
        else:
            logged = logs.get(result.attempt_id, (0, 0))
            rows.append(attempt_row(result, staged[result.attempt_id], logged))
    return rows


async def logs_of(
    ctx: HostContext, records: Sequence[ledgerlib.AttemptRecord]
) -> dict[str, tuple[int, int]]:
    """Log sizes of the records that can have logs, read on an I/O thread (none: no
    thread hop; the others have (0, 0))."""
    started = [r for r in records if _has_logs(r)]
    if not started:
        return {}
    return await ctx.workers.io(lambda: {r.attempt_id: _log_bytes(ctx, r) for r in started})


async def usages(
    ctx: HostContext,
    runner: RunnerPort,
    records: Sequence[ledgerlib.AttemptRecord],
    *,
    payload: bool = False,
) -> dict[str, Usage]:
    """Each record's `usage` (see `usage.py`): the ledger's, or read live from the
    service of a started attempt whose usage is not final yet; with its `payload` part
    when the request asked (`payload_usage: true`)."""
    recorded = await ctx.workers.db(ctx.ledger.usage_of, [r.attempt_id for r in records])
    pending = [r for r in records if not usagelib.is_final(r, recorded.get(r.attempt_id))]
    live = await runner.usage_now(pending) if pending else {}
    return {
        r.attempt_id: usagelib.wire_usage(
            r, recorded.get(r.attempt_id), live.get(r.attempt_id), payload=payload
        )
        for r in records
    }


async def with_usage(
    ctx: HostContext,
    runner: RunnerPort,
    results: Sequence[ledgerlib.AttemptRecord | HostError],
    rows: list[AttemptResult],
    *,
    payload: bool = False,
) -> list[AttemptResult]:
    """`rows` (one per result) with each attempt row's `usage` (and its `payload` part
    when asked)."""
    records = [r for r in results if isinstance(r, ledgerlib.AttemptRecord)]
    found = await usages(ctx, runner, records, payload=payload)
    return [
        msgspec.structs.replace(row, usage=found[row.attempt_id])
        if isinstance(row, AttemptRow)
        else row
        for row in rows
    ]


def attempts_reply(request: ReceivedRequest, rows: list[AttemptResult]) -> AttemptsReply:
    return AttemptsReply(version=1, id=request.id, results=rows)


def records_of(
    results: Sequence[ledgerlib.Admitted | ledgerlib.Applied | HostError],
) -> list[ledgerlib.AttemptRecord | HostError]:
    return [r if isinstance(r, HostError) else r.record for r in results]
