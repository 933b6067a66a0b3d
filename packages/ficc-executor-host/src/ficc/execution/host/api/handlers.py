"""One function per action: check against the records, commit, answer.

A handler validates a request against the ledger, commits in ONE ledger transaction
where correctness allows, hands the asynchronous work to the runner (never calling a
provider or the service itself), and builds the reply rows from the records. The
server has already checked who may send the action (`may_send`), and the request was
validated once at the boundary (ficc.execution.protocol).

Refusals: a `HostError` for one row becomes that row's `ErrorRow` with the error's
stable code; a refusal of the whole request (`bindings_changed`, `offer_revision`,
`offer_exceeds_ceiling`) becomes an `ErrorReply`. Anything else is a bug and is
raised to the server, which answers `internal`.

Threads (see `context`): ledger calls run on `ctx.workers.db`, file I/O on
`ctx.workers.io`; nothing blocking runs on the event loop.

Decisions made here:
- A prepare row refused before any provider call (provider not configured or not
  loaded, pinned digest differs, offer, resources, slot, first lease already past) is
  committed as a failed `admission_rejected` record; its row answers
  `admission_rejected` with the precise cause (the record's `detail`) in the message.
- Staging inputs (`input_status`, `input_write`) needs the offer to keep leases alive
  (active, draining or paused): staging is part of preparation, not a start.
- `stop` hands every attempt whose record changed to the runner; a prepared attempt is
  cancelled at once by the ledger, and the runner confirms its cleanup like any other.
- `start` first looks at the staged inputs of each ready attempt it names: one whose
  staged file is no longer the one recorded when it completed is refused
  `input_changed` in its row, and fails (`StartRefused`) in the transaction that
  records the other starts; the runner confirms its cleanup. The start pipeline looks
  again just before the provider's start (a file can change in between).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import stat
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from importlib import metadata
from typing import Any, Final, NamedTuple, Protocol, TypeVar, cast

import msgspec

from ficc.execution import plan as planlib
from ficc.execution._executor import (
    ReceivedInputWrite,
    ReceivedInputWriteRequest,
    ReceivedRequest,
)
from ficc.execution.errors import ErrorCode
from ficc.execution.host.api import collect as collecting
from ficc.execution.host.config.ceiling import ceiling_limits
from ficc.execution.host.context.group_commit import GroupCommit
from ficc.execution.host.context.parts import HostContext
from ficc.execution.host.core import leases, lifecycle
from ficc.execution.host.core import metrics as metricslib
from ficc.execution.host.core import usage as usagelib
from ficc.execution.host.core.errors import HostError
from ficc.execution.host.ledger import store as ledgerlib
from ficc.execution.host.linux import taskscan
from ficc.execution.host.storage.layout import Layout, service_name
from ficc.execution.host.storage.staging import Stager, StreamState, streams_of
from ficc.execution.protocol import (
    INPUT_CHUNK_MAX_BYTES,
    CollectRequest,
    Fence,
    InputStatusRequest,
    InputWrite,
    InputWriteRequest,
    MetricsRequest,
    ObjectRef,
    ObserveRequest,
    PrepareRequest,
    ReconcileAbsentRequest,
    RejectAbsentRequest,
    ReleaseRequest,
    RenewRequest,
    Resources,
    Sender,
    SetOfferRequest,
    SnapshotRequest,
    StartRequest,
    StopRequest,
)
from ficc.execution.wire import (
    AnyReply,
    AttemptResult,
    AttemptRow,
    AttemptsReply,
    AttemptStatus,
    Capacity,
    InputResult,
    InputRow,
    InputsReply,
    MetricsReply,
    Offer,
    OfferReply,
    Outcome,
    ProviderInfo,
    SlotClass,
    SnapshotReply,
    Usage,
    error_reply,
    error_row,
)

_log = logging.getLogger(__name__)

INPUT_CHUNK_BYTES = INPUT_CHUNK_MAX_BYTES
"""The `input_chunk_bytes` this executor announces and enforces (8 MiB)."""

AnyInputWrite = ReceivedInputWrite | InputWrite
"""An `input_write` row as `receive_request` may return it."""


class RunnerPort(Protocol):
    """What the handlers ask of the runner (pipeline.Runner implements it)."""

    def admitted(self, attempt_ids: Sequence[str]) -> None: ...
    def inputs_complete(self, attempt_id: str) -> None: ...
    def start_requested(self, attempt_ids: Sequence[str]) -> None: ...
    def stop_requested(self, attempt_ids: Sequence[str]) -> None: ...
    def settled(self, attempt_ids: Sequence[str]) -> None: ...
    async def release_batch(self, attempt_ids: Sequence[str]) -> list[HostError | None]: ...
    async def leases_renewed(
        self, records: Sequence[ledgerlib.AttemptRecord]
    ) -> frozenset[str]: ...
    async def usage_now(
        self, records: Sequence[ledgerlib.AttemptRecord]
    ) -> dict[str, ledgerlib.ResourceUsage]: ...
    def details(self, attempt_ids: Sequence[str]) -> dict[str, str]: ...


Handler = Callable[[HostContext, RunnerPort, Sender, Any], Awaitable[AnyReply]]


async def handle(
    ctx: HostContext, runner: RunnerPort, sender: Sender, request: ReceivedRequest
) -> AnyReply:
    """Answer one request; a whole-request HostError becomes an ErrorReply."""
    handler = HANDLERS[request.action]
    try:
        return await handler(ctx, runner, sender, request)
    except HostError as error:
        return error_reply(request.id, error.code, error.message)


# --- host facts admission checks against --------------------------------------------


def host_facts(ctx: HostContext, now: leases.Now) -> ledgerlib.HostFacts:
    """What admission checks a plan against, besides the ledger's own records."""
    config = ctx.config
    return ledgerlib.HostFacts(
        slots=[
            ledgerlib.SlotSpec(s.id, s.slot_class, s.storage_bytes, s.storage_inodes)
            for s in config.slots
        ],
        devices=frozenset(config.initial_offer.devices),
        ceiling=ceiling_limits(config),
        now=now,
        deployment_id=config.deployment_id,
        node_id=config.node_id,
    )


# --- reply rows ----------------------------------------------------------------------


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
    paths = Layout(slot).paths(record.attempt_id)
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


_RenewRows = Sequence[tuple[Fence, leases.Renewal]]


class _Read(NamedTuple):
    """A batch's records (or row refusals) with their staged bytes, read together."""

    results: list[ledgerlib.AttemptRecord | HostError]
    staged: dict[str, int]


def _with_staged(
    ledger: ledgerlib.Ledger, results: list[ledgerlib.AttemptRecord | HostError]
) -> _Read:
    """Add the staged bytes in the same ledger-thread call that produced `results`, so
    a hot request queues once on the ledger thread instead of twice."""
    ids = [r.attempt_id for r in results if isinstance(r, ledgerlib.AttemptRecord)]
    return _Read(results, ledger.staged_bytes(ids))


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
    logs = await _logs_of(ctx, records)
    rows: list[AttemptResult] = []
    for result in results:
        if isinstance(result, HostError):
            rows.append(error_row(result.code, result.message))
        else:
            logged = logs.get(result.attempt_id, (0, 0))
            rows.append(attempt_row(result, staged[result.attempt_id], logged))
    return rows


async def _logs_of(
    ctx: HostContext, records: Sequence[ledgerlib.AttemptRecord]
) -> dict[str, tuple[int, int]]:
    """Log sizes of the records that can have logs, read on an I/O thread (none: no
    thread hop; the others have (0, 0))."""
    started = [r for r in records if _has_logs(r)]
    if not started:
        return {}
    return await ctx.workers.io(lambda: {r.attempt_id: _log_bytes(ctx, r) for r in started})


async def usages(
    ctx: HostContext, runner: RunnerPort, records: Sequence[ledgerlib.AttemptRecord]
) -> dict[str, Usage]:
    """Each record's `usage` (see `usage.py`): the ledger's, or read live from the
    service of a started attempt whose usage is not final yet."""
    recorded = await ctx.workers.db(ctx.ledger.usage_of, [r.attempt_id for r in records])
    pending = [r for r in records if not usagelib.is_final(r, recorded.get(r.attempt_id))]
    live = await runner.usage_now(pending) if pending else {}
    return {
        r.attempt_id: usagelib.wire_usage(r, recorded.get(r.attempt_id), live.get(r.attempt_id))
        for r in records
    }


async def _with_usage(
    ctx: HostContext,
    runner: RunnerPort,
    results: Sequence[ledgerlib.AttemptRecord | HostError],
    rows: list[AttemptResult],
) -> list[AttemptResult]:
    """`rows` (one per result) with each attempt row's `usage`."""
    records = [r for r in results if isinstance(r, ledgerlib.AttemptRecord)]
    found = await usages(ctx, runner, records)
    return [
        msgspec.structs.replace(row, usage=found[row.attempt_id])
        if isinstance(row, AttemptRow)
        else row
        for row in rows
    ]


def _reply(request: ReceivedRequest, rows: list[AttemptResult]) -> AttemptsReply:
    return AttemptsReply(version=1, id=request.id, results=rows)


def _records_of(
    results: Sequence[ledgerlib.Admitted | ledgerlib.Applied | HostError],
) -> list[ledgerlib.AttemptRecord | HostError]:
    return [r if isinstance(r, HostError) else r.record for r in results]


# --- prepare, reject_absent, reconcile_absent ---------------------------------------


def _bindings(request: PrepareRequest | RejectAbsentRequest | ReconcileAbsentRequest) -> Any:
    return ledgerlib.Bindings(request.installation_id, request.ledger_id, 1)


def _first_lease(renewal: leases.Renewal, now: leases.Now, maximum: int) -> leases.Lease:
    """The granted first lease; one already past is kept as an expired lease, so the
    ledger records the durable rejection (`lease_expired`) instead of nothing."""
    try:
        return leases.grant(renewal, now, maximum)
    except HostError as error:
        if error.code != ErrorCode.LEASE_EXPIRED:
            raise
        return leases.Lease(
            boot_id=now.boot_id,
            sequence=renewal.sequence,
            expires_at_ms=renewal.expires_at_ms,
            deadline_boottime_ns=now.boottime_ns,
            effective_expires_at_ms=leases.effective_ms(now, 0),
        )


def provider_refusal(ctx: HostContext, plan: planlib.Plan) -> HostError | None:
    """Why the plan's provider cannot serve it here, or None."""
    runtime = plan.job.runtime
    provider = ctx.providers.get(runtime.provider)
    if provider is None:
        return HostError(
            ErrorCode.PROVIDER_UNAVAILABLE,
            f"provider {runtime.provider!r} is not configured on this host",
        )
    if provider.loaded is None:
        why = provider.refusal.code if provider.refusal is not None else "not loaded"
        return HostError(
            ErrorCode.PROVIDER_UNAVAILABLE,
            f"provider {runtime.provider!r} is configured but unavailable ({why});"
            " the administrator must check its pin",
        )
    if runtime.package_digest != provider.package_digest:
        return HostError(
            ErrorCode.PROVIDER_UNAVAILABLE,
            f"the plan pins provider package {runtime.package_digest}, this host runs"
            f" {provider.package_digest}",
        )
    return None


def _admission_row(result: ledgerlib.Row) -> ledgerlib.AttemptRecord | HostError:
    if isinstance(result, ledgerlib.AdmissionRejection):  # the record's detail leads
        message = f"{result.code}: {result.message}; the failed record is kept, release it"
        return HostError(ErrorCode.ADMISSION_REJECTED, message)
    if isinstance(result, HostError):
        return result
    return result.record


async def prepare(
    ctx: HostContext, runner: RunnerPort, sender: Sender, request: PrepareRequest
) -> AnyReply:
    """Admit plans in one transaction; the runner prepares the new ones after the reply."""
    bindings = _bindings(request)
    now = ctx.clock.now()
    maximum = ctx.config.maximum_lease_seconds
    rows = [
        ledgerlib.PrepareRow(
            row.plan,
            _first_lease(row.lease, now, maximum),
            refusal=provider_refusal(ctx, row.plan),
            acknowledged_unknown=row.acknowledged_unknown,
        )
        for row in request.attempts
    ]
    facts = host_facts(ctx, now)
    results = await ctx.workers.db(ctx.ledger.admit_batch, bindings, rows, facts)
    new: list[str] = []
    for row, result in zip(request.attempts, results, strict=True):
        if isinstance(result, ledgerlib.Admitted) and result.new:
            slot = ctx.slots[result.record.slot_id or ""]
            slot.stager.register_attempt(result.record.attempt_id, streams_of(row.plan.job.inputs))
            new.append(result.record.attempt_id)
    if new:
        runner.admitted(new)
    return _reply(request, await attempt_rows(ctx, [_admission_row(r) for r in results]))


async def reject_absent(
    ctx: HostContext, runner: RunnerPort, sender: Sender, request: RejectAbsentRequest
) -> AnyReply:
    """Commit never-runnable rejections for plans this host never admitted."""
    results = await ctx.workers.db(ctx.ledger.reject_absent, _bindings(request), request.plans)
    return _reply(request, await attempt_rows(ctx, [_admission_row(r) for r in results]))


async def reconcile_absent(
    ctx: HostContext, runner: RunnerPort, sender: Sender, request: ReconcileAbsentRequest
) -> AnyReply:
    """The administrator's acknowledgement of absent attempts, after checking for real
    that nothing is left on any slot (see `idle_evidence`)."""
    bindings = _bindings(request)
    if bindings != ctx.ledger.bindings():
        raise HostError(
            ErrorCode.BINDINGS_CHANGED,
            "installation, ledger or admission version differ from this host's;"
            " take a new snapshot",
        )
    known = await ctx.workers.db(_all_attempt_ids, ctx.ledger)
    attempts = sorted(known | {p.attempt_id for p in request.plans})
    problems = await ctx.workers.io(idle_evidence, ctx, attempts)
    if problems:
        raise HostError(
            ErrorCode.RECONCILE_REFUSED,
            "the host is not confirmed idle: "
            + "; ".join(problems[:8])
            + "; clean up (release attempts, stop stray processes), then retry",
        )
    results = await ctx.workers.db(ctx.ledger.reconcile_absent, bindings, request.plans, True)
    return _reply(request, await attempt_rows(ctx, [_admission_row(r) for r in results]))


def _all_attempt_ids(ledger: ledgerlib.Ledger) -> set[str]:
    """Every attempt the ledger knows (each could have had a service)."""
    ids: set[str] = set()
    after = None
    while True:
        records, after = ledger.page(after)
        ids.update(r.attempt_id for r in records)
        if after is None:
            return ids


def idle_evidence(ctx: HostContext, attempt_ids: Sequence[str]) -> list[str]:
    """Everything that keeps the host from being confirmed idle (empty: idle).

    For every configured slot: no attempt directory or staging directory left, and no
    live process of the slot account. For every attempt given (the ledger's and the
    acknowledged ones): no service of its name. Runs in an I/O thread; reads only
    (never stops anything).
    """
    problems: list[str] = []
    slot_uids = {s.uid: s.id for s in ctx.slots.values()}
    for slot in ctx.slots.values():
        try:
            left = Layout(slot).leftovers()
        except HostError as error:
            problems.append(f"slot {slot.id}: {error.code}: {error.message}")
            continue
        problems += [f"slot {slot.id} retains {entry}" for entry in left]
    for uid, pid in taskscan.SHARED.live_tasks(set(slot_uids)):
        whose = (
            f"the account of slot {slot_uids[uid]}"
            if uid in slot_uids
            else "an account we cannot read"
        )
        problems.append(f"process {pid} runs as {whose}")
    for attempt_id in attempt_ids:
        name = service_name(ctx.config.installation_id, attempt_id)
        if ctx.service.adopt(name) is not None:
            problems.append(f"service {name} still exists")
    return problems


# --- renew, start, observe, stop, release -------------------------------------------


async def renew(
    ctx: HostContext, runner: RunnerPort, sender: Sender, request: RenewRequest
) -> AnyReply:
    """Renew leases by `leases.renew`, in one transaction judged at one clock reading
    inside it; the lease reaper holds the new deadlines before the reply says they
    hold. A row whose service the reaper had already decided to stop at the old
    deadline is refused `lease_expired`, and its attempt ends `expired`."""
    rows = [(r.fence, r) for r in request.leases]
    read = await _renewals(ctx).submit(rows)
    renewed = [r for r in read.results if isinstance(r, ledgerlib.AttemptRecord)]
    reaped = await runner.leases_renewed(renewed)
    results = read.results
    if reaped:
        results = await _reaped_first(ctx, runner, results, reaped)
    return _reply(request, await attempt_rows(ctx, results, read.staged))


RENEW_GROUP_MOST = 16
"""Renew requests that share one transaction at most (64 rows each)."""


def _renewals(ctx: HostContext) -> GroupCommit[_RenewRows, _Read]:
    """The group commit of renew requests: those that arrive while one commits go
    together in the next transaction (one fsync for all)."""
    group = ctx.groups.get("renew")
    if group is None:
        group = ctx.groups["renew"] = GroupCommit(functools.partial(_renew, ctx), RENEW_GROUP_MOST)
    return group


async def _renew(ctx: HostContext, batches: list[_RenewRows]) -> list[_Read]:
    def commit() -> list[_Read]:
        maximum = ctx.config.maximum_lease_seconds
        applied = ctx.ledger.renew_batches(batches, ctx.clock, maximum)
        return [_with_staged(ctx.ledger, _records_of(results)) for results in applied]

    return await ctx.workers.db(commit)


async def _reaped_first(
    ctx: HostContext,
    runner: RunnerPort,
    results: list[ledgerlib.AttemptRecord | HostError],
    reaped: frozenset[str],
) -> list[ledgerlib.AttemptRecord | HostError]:
    """The rows of attempts the reaper stopped at the deadline the renewal came too late
    for: `LeaseExpired` is recorded (the monitor then records `expired`) and each row
    answers `lease_expired`."""
    fences = {
        r.attempt_id: r.fence
        for r in results
        if isinstance(r, ledgerlib.AttemptRecord) and r.attempt_id in reaped
    }
    rows = [(fence, lifecycle.LeaseExpired()) for fence in fences.values()]
    await ctx.workers.db(ctx.ledger.apply_batch, rows)
    runner.stop_requested(list(fences))
    refusal = HostError(
        ErrorCode.LEASE_EXPIRED,
        "the lease reaper had already stopped the attempt at its earlier deadline when"
        " this renewal arrived; the attempt ends expired: release it when it is terminal",
    )
    return [
        refusal if isinstance(r, ledgerlib.AttemptRecord) and r.attempt_id in fences else r
        for r in results
    ]


def _changed(results: Sequence[ledgerlib.Applied | HostError]) -> list[str]:
    """Attempts whose record this transaction changed (the runner acts on exactly these)."""
    return [r.record.attempt_id for r in results if isinstance(r, ledgerlib.Applied) and r.changed]


async def start(
    ctx: HostContext, runner: RunnerPort, sender: Sender, request: StartRequest
) -> AnyReply:
    """Look at the staged inputs first (`_changed_inputs`), record `starting` durably
    (the lease judged inside that transaction) or, for an attempt whose staged input
    changed, its refusal; then let the runner start exactly the started attempts and
    clean up the refused ones."""
    ceiling = ceiling_limits(ctx.config)
    lookup = functools.partial(_input_checks, ctx, request.attempts)
    refusals = await ctx.workers.db_then_io(lookup, _changed_inputs)
    results = await ctx.workers.db(
        ctx.ledger.start_batch, request.attempts, ctx.clock, ceiling, refusals
    )
    started = _changed(results)
    if started:
        runner.start_requested(started)
    # The ledger answers a row it failed with the very refusal it was given.
    pairs = zip(request.attempts, results, strict=True)
    failed = [f.attempt_id for f, r in pairs if r is refusals.get(f.attempt_id)]
    if failed:
        runner.settled(failed)
    return _reply(request, await attempt_rows(ctx, _records_of(results)))


def _input_checks(ctx: HostContext, fences: Sequence[Fence]) -> list[tuple[str, Stager]]:
    """On the ledger thread: the ready attempts of a start request that have streamed
    inputs (only those have staged files to look at), each with its slot's stager.

    One whose start the ledger then refuses for another reason (lease, offer) is looked
    at too: that refusal wins in the start transaction, and nothing is recorded.
    """
    records = [r for r in ctx.ledger.fenced(fences) if isinstance(r, ledgerlib.AttemptRecord)]
    ready = [r for r in records if r.status.state == "prepared" and r.status.ready]
    streamed = ctx.ledger.inputs_of([r.attempt_id for r in ready])
    return [
        (r.attempt_id, ctx.slots[r.slot_id].stager)
        for r in ready
        if streamed[r.attempt_id] and r.slot_id is not None and r.slot_id in ctx.slots
    ]


def _changed_inputs(checks: Sequence[tuple[str, Stager]]) -> dict[str, HostError]:
    """In an I/O thread: the `input_changed` refusal of each attempt one of whose staged
    files is no longer the one recorded when it completed.

    Why here, before the start is accepted: the controller hears it in the start row,
    no payload and no service are ever made for it, and the attempt is failed at once.
    Anything else the look meets is not decided here (logged): the start pipeline
    checks every staged input again before the provider's start and fails the attempt
    with that code (fail closed).
    """
    found: dict[str, HostError] = {}
    for attempt_id, stager in checks:
        try:
            refusal = stager.changed_input(attempt_id)
        except (HostError, OSError) as error:
            _log.warning(
                "attempt %s: staged inputs not looked at before the start (%s); the start"
                " pipeline checks them",
                attempt_id,
                error,
            )
            continue
        if refusal is not None:
            found[attempt_id] = refusal
    return found


async def observe(
    ctx: HostContext, runner: RunnerPort, sender: Sender, request: ObserveRequest
) -> AnyReply:
    """The records as the monitor keeps them: from the ledger's record cache on the
    event loop when it holds every row, else read on the ledger thread."""

    def read_rows() -> _Read:
        return _with_staged(ctx.ledger, ctx.ledger.fenced(request.attempts))

    cached = ctx.ledger.cached(request.attempts)
    read = _Read(*cached) if cached is not None else await ctx.workers.db(read_rows)
    rows = await attempt_rows(ctx, read.results, read.staged)
    if request.wants_usage:
        rows = await _with_usage(ctx, runner, read.results, rows)
    if request.wants_detail:
        rows = _with_detail(runner, rows)
    return _reply(request, rows)


def _with_detail(runner: RunnerPort, rows: list[AttemptResult]) -> list[AttemptResult]:
    """`rows` with each attempt row's `detail`, where the runner keeps one."""
    kept = runner.details([r.attempt_id for r in rows if isinstance(r, AttemptRow)])
    return [
        msgspec.structs.replace(row, detail=kept[row.attempt_id])
        if isinstance(row, AttemptRow) and row.attempt_id in kept
        else row
        for row in rows
    ]


async def stop(
    ctx: HostContext, runner: RunnerPort, sender: Sender, request: StopRequest
) -> AnyReply:
    """Record the stop (prepared: cancelled now; started: stop pending), then let the
    runner stop the work and confirm cleanup."""
    rows = [(fence, lifecycle.StopRequested()) for fence in request.attempts]
    results = await ctx.workers.db(ctx.ledger.apply_batch, rows)
    changed = _changed(results)
    if changed:
        runner.stop_requested(changed)
    return _reply(request, await attempt_rows(ctx, _records_of(results)))


async def release(
    ctx: HostContext, runner: RunnerPort, sender: Sender, request: ReleaseRequest
) -> AnyReply:
    """Release settled, cleaned-up attempts: the runner removes their resources (provider
    release, staging, layout, service); then one transaction records every release.
    A failed removal keeps that row's reservation and answers its error."""
    current = await ctx.workers.db(ctx.ledger.fenced, request.attempts)
    results: list[ledgerlib.AttemptRecord | HostError] = list(current)
    releasing: list[tuple[int, Fence, ledgerlib.AttemptRecord]] = []
    for index, (fence, record) in enumerate(zip(request.attempts, current, strict=True)):
        if isinstance(record, HostError):
            continue
        try:
            step = lifecycle.apply(record.status, lifecycle.Release())
        except HostError as error:
            results[index] = error
            continue
        if step.changed:  # else already released: the record as it is
            releasing.append((index, fence, record))
    # The resources of every row go together, so the provider sees one batch.
    holders = list(dict.fromkeys(r.attempt_id for _, _, r in releasing if r.slot_id is not None))
    outcomes = await runner.release_batch(holders) if holders else []
    removed = dict(zip(holders, outcomes, strict=True))
    to_apply: list[tuple[int, Fence]] = []
    for index, fence, record in releasing:
        refusal = removed.get(record.attempt_id)
        if refusal is not None:
            results[index] = refusal
            continue
        to_apply.append((index, fence))
    if to_apply:
        rows = [(fence, lifecycle.Release()) for _, fence in to_apply]
        applied = await ctx.workers.db(ctx.ledger.apply_batch, rows)
        for (index, _), result in zip(to_apply, applied, strict=True):
            results[index] = result if isinstance(result, HostError) else result.record
    return _reply(request, await attempt_rows(ctx, results))


# --- streamed inputs -----------------------------------------------------------------


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


# --- collect -------------------------------------------------------------------------


async def collect(
    ctx: HostContext, runner: RunnerPort, sender: Sender, request: CollectRequest
) -> AnyReply:
    """Bounded reads of logs and declared outputs (see `collect`); never a provider call."""
    return await collecting.collect(ctx, request)


# --- snapshot and set_offer ---------------------------------------------------------


def wire_offer(offer: ledgerlib.Offer) -> Offer:
    return Offer(revision=offer.revision, control=offer.control, limits=offer.limits)


def _capacity(ctx: HostContext, occupied: set[str], used: dict[str, int]) -> Capacity:
    """What is free now: the offer (within the ceiling) minus the reservations."""
    offer = ctx.ledger.offer()
    ceiling = ceiling_limits(ctx.config)
    available = Resources(
        **{
            name: max(
                0,
                min(getattr(offer.limits.resources, name), getattr(ceiling.resources, name))
                - used.get(name, 0),
            )
            for name in Resources.__struct_fields__
        }
    )
    classes: dict[str, list[Any]] = {}
    for slot in ctx.config.slots:
        classes.setdefault(slot.slot_class, []).append(slot)
    slot_classes = [
        SlotClass(
            class_=name,
            total=len(slots),
            free=sum(1 for s in slots if s.id not in occupied),
            bytes=max(s.storage_bytes for s in slots),
            inodes=max(s.storage_inodes for s in slots),
        )
        for name, slots in sorted(classes.items())
    ]
    providers = [
        ProviderInfo(id=p.id, package_digest=p.package_digest, available=p.loaded is not None)
        for p in sorted(ctx.providers.values(), key=lambda p: p.id)
    ]
    return Capacity(available=available, slot_classes=slot_classes, providers=providers)


def _snapshot_state(
    ctx: HostContext, after: str | None
) -> tuple[ledgerlib.Offer, Capacity, list[ledgerlib.AttemptRecord], str | None, dict[str, int]]:
    """Everything a snapshot reads from the ledger, on the ledger thread."""
    occupied, used = ctx.ledger.reservations()
    offer = ctx.ledger.offer()
    capacity = _capacity(ctx, occupied, used)
    records, cursor = ctx.ledger.page(after)
    staged = ctx.ledger.staged_bytes([r.attempt_id for r in records])
    return offer, capacity, records, cursor, staged


async def snapshot(
    ctx: HostContext, runner: RunnerPort, sender: Sender, request: SnapshotRequest
) -> AnyReply:
    """Bindings, bounds, offer, capacity and one page of up to 64 attempts."""
    offer, capacity, records, cursor, staged = await ctx.workers.db(
        _snapshot_state, ctx, request.after
    )
    logs = await _logs_of(ctx, records)
    used = await usages(ctx, runner, records) if request.wants_usage else {}
    bindings = ctx.ledger.bindings()
    return SnapshotReply(
        version=1,
        id=request.id,
        installation_id=bindings.installation_id,
        ledger_id=bindings.ledger_id,
        admission_version=1,
        maximum_lease_seconds=ctx.config.maximum_lease_seconds,
        input_chunk_bytes=INPUT_CHUNK_BYTES,
        offer=wire_offer(offer),
        capacity=capacity,
        attempts=[
            _listed(r, staged[r.attempt_id], logs.get(r.attempt_id, (0, 0)), used) for r in records
        ],
        next=cursor,
    )


def _listed(
    record: ledgerlib.AttemptRecord, staged: int, logs: tuple[int, int], used: dict[str, Usage]
) -> AttemptStatus:
    """A snapshot's attempt, with its `usage` when the request asked for it."""
    status = attempt_status(record, staged, logs)
    if record.attempt_id in used:
        return msgspec.structs.replace(status, usage=used[record.attempt_id])
    return status


async def set_offer(
    ctx: HostContext, runner: RunnerPort, sender: Sender, request: SetOfferRequest
) -> AnyReply:
    """Change the offer within the administrator's ceiling, if still at the expected
    revision (`offer_revision` / `offer_exceeds_ceiling` refuse the whole request)."""
    offer = await ctx.workers.db(
        ctx.ledger.set_offer,
        request.expected_revision,
        request.control,
        request.limits,
        ceiling_limits(ctx.config),
    )
    return OfferReply(version=1, id=request.id, offer=wire_offer(offer))


def metric_facts(ctx: HostContext) -> metricslib.LedgerFacts:
    """Everything the metrics read from the durable state, on the ledger thread."""
    attempts: Counter[tuple[str, str]] = Counter()
    reasons: Counter[str] = Counter()
    unconfirmed = records = 0
    for state, outcome, reason, confirmed, count in ctx.ledger.tally():
        attempts[(state, outcome or "")] += count
        if reason is not None:
            reasons[reason] += count
        if state in lifecycle.SETTLED and not confirmed:
            unconfirmed += count
        records += count
    occupied, used = ctx.ledger.reservations()
    capacity = _capacity(ctx, occupied, used)
    classes = {slot.id: slot.slot_class for slot in ctx.config.slots}
    by_class: dict[tuple[str, str], metricslib.ClassUse] = {}
    for slot_id, outcome, count, cpu_us, oom_kills in ctx.ledger.usage_tally():
        key = (classes.get(slot_id, "unconfigured"), outcome)
        use = metricslib.ClassUse(count, cpu_us, oom_kills)
        by_class[key] = by_class[key] + use if key in by_class else use
    return metricslib.LedgerFacts(
        version=host_version(),
        attempts=attempts,
        reasons=reasons,
        cleanup_unconfirmed=unconfirmed,
        slots={c.class_: (c.total, c.free) for c in capacity.slot_classes},
        providers={
            p.id: None if p.refusal is None else p.refusal.code for p in ctx.providers.values()
        },
        ledger_records=records,
        ledger_bytes=_ledger_bytes(ctx.config.state_dir),
        by_class=by_class,
    )


def host_version() -> str:
    try:
        return metadata.version("ficc-executor-host")
    except metadata.PackageNotFoundError:  # a source tree on sys.path, not installed
        return "unknown"


def _ledger_bytes(state_dir: str) -> int:
    total = 0
    for suffix in ("", "-wal", "-shm"):
        with contextlib.suppress(FileNotFoundError):
            total += os.stat(os.path.join(state_dir, ledgerlib.LEDGER_FILE + suffix)).st_size
    return total


async def metrics(
    ctx: HostContext, runner: RunnerPort, sender: Sender, request: MetricsRequest
) -> AnyReply:
    """The daemon's metrics as Prometheus text (administrator only)."""
    facts = await ctx.workers.db(metric_facts, ctx)
    text = metricslib.render(facts, metricslib.PROCESS)
    return MetricsReply(version=1, id=request.id, text=text)


HANDLERS: dict[str, Handler] = {
    "prepare": prepare,
    "renew": renew,
    "start": start,
    "observe": observe,
    "stop": stop,
    "release": release,
    "collect": collect,
    "input_status": input_status,
    "input_write": input_write,
    "reject_absent": reject_absent,
    "reconcile_absent": reconcile_absent,
    "snapshot": snapshot,
    "set_offer": set_offer,
    "metrics": metrics,
}


__all__ = [
    "HANDLERS",
    "INPUT_CHUNK_BYTES",
    "RunnerPort",
    "attempt_row",
    "handle",
    "host_facts",
    "idle_evidence",
    "provider_refusal",
]
