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
  loaded, pinned digest differs, limits below what the provider's runtime states it
  needs, offer, resources, slot, first lease already past) is
  committed as a failed `admission_rejected` record; its row answers
  `admission_rejected` with the precise cause (the record's `detail`) in the message.
  A slot out of service (its health checks fail) is never chosen: admission takes
  another free slot of the class, or refuses `slot_capacity` naming the broken ones.
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

import functools
import logging
from collections.abc import Sequence
from typing import Any

import msgspec

from ficc.execution import plan as planlib
from ficc.execution._executor import (
    ReceivedRequest,
)
from ficc.execution.errors import ErrorCode
from ficc.execution.host.api import collect as collecting
from ficc.execution.host.api.inputs import input_status, input_write
from ficc.execution.host.api.port import Handler, RunnerPort
from ficc.execution.host.api.reports import metrics, set_offer, snapshot
from ficc.execution.host.api.rows import (
    RowsRead,
    attempt_rows,
    attempts_reply,
    records_of,
    with_staged,
    with_usage,
)
from ficc.execution.host.api.slots import check_slots
from ficc.execution.host.config.ceiling import ceiling_limits
from ficc.execution.host.context.group_commit import GroupCommit
from ficc.execution.host.context.parts import HostContext
from ficc.execution.host.core import admission, leases, lifecycle
from ficc.execution.host.core.errors import HostError
from ficc.execution.host.ledger import store as ledgerlib
from ficc.execution.host.storage.layout import service_name
from ficc.execution.host.storage.staging import Stager
from ficc.execution.host.storage.streams import streams_of
from ficc.execution.protocol import (
    CollectRequest,
    Fence,
    ObserveRequest,
    PrepareRequest,
    ReconcileAbsentRequest,
    RejectAbsentRequest,
    ReleaseRequest,
    RenewRequest,
    Sender,
    StartRequest,
    StopRequest,
)
from ficc.execution.provider import tasks
from ficc.execution.wire import (
    AnyReply,
    AttemptResult,
    AttemptRow,
    error_reply,
)

_log = logging.getLogger(__name__)


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
    """What admission checks a plan against, besides the ledger's own records: a slot
    out of service (its checks fail) is never chosen (core/slot_health.py)."""
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
        out_of_service=ctx.slot_health.broken(),
    )


# --- reply rows ----------------------------------------------------------------------


_RenewRows = Sequence[tuple[Fence, leases.Renewal]]


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
    """Why the plan's provider cannot serve it here, or None: it is not available, or
    the plan is below the limits its runtime states it needs (read when it was
    configured: no provider code runs before the admission is committed)."""
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
    return admission.below_minimum(plan, provider.loaded.minimums)


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
    return attempts_reply(request, await attempt_rows(ctx, [_admission_row(r) for r in results]))


async def reject_absent(
    ctx: HostContext, runner: RunnerPort, sender: Sender, request: RejectAbsentRequest
) -> AnyReply:
    """Commit never-runnable rejections for plans this host never admitted."""
    results = await ctx.workers.db(ctx.ledger.reject_absent, _bindings(request), request.plans)
    return attempts_reply(request, await attempt_rows(ctx, [_admission_row(r) for r in results]))


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
    return attempts_reply(request, await attempt_rows(ctx, [_admission_row(r) for r in results]))


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
            left = slot.files.leftovers()
        except HostError as error:
            problems.append(f"slot {slot.id}: {error.code}: {error.message}")
            continue
        problems += [f"slot {slot.id} retains {entry}" for entry in left]
    for uid, pid in tasks.SHARED.live_tasks(set(slot_uids)):
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
    return attempts_reply(request, await attempt_rows(ctx, results, read.staged))


RENEW_GROUP_MOST = 16
"""Renew requests that share one transaction at most (64 rows each)."""


def _renewals(ctx: HostContext) -> GroupCommit[_RenewRows, RowsRead]:
    """The group commit of renew requests: those that arrive while one commits go
    together in the next transaction (one fsync for all)."""
    group = ctx.groups.get("renew")
    if group is None:
        group = ctx.groups["renew"] = GroupCommit(functools.partial(_renew, ctx), RENEW_GROUP_MOST)
    return group


async def _renew(ctx: HostContext, batches: list[_RenewRows]) -> list[RowsRead]:
    def commit() -> list[RowsRead]:
        maximum = ctx.config.maximum_lease_seconds
        applied = ctx.ledger.renew_batches(batches, ctx.clock, maximum)
        return [with_staged(ctx.ledger, records_of(results)) for results in applied]

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
    return attempts_reply(request, await attempt_rows(ctx, records_of(results)))


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

    def read_rows() -> RowsRead:
        return with_staged(ctx.ledger, ctx.ledger.fenced(request.attempts))

    cached = ctx.ledger.cached(request.attempts)
    read = RowsRead(*cached) if cached is not None else await ctx.workers.db(read_rows)
    rows = await attempt_rows(ctx, read.results, read.staged)
    if request.wants_usage:
        payload = request.wants_payload_usage
        rows = await with_usage(ctx, runner, read.results, rows, payload=payload)
    if request.wants_detail:
        rows = _with_detail(runner, rows)
    return attempts_reply(request, rows)


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
    return attempts_reply(request, await attempt_rows(ctx, records_of(results)))


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
    return attempts_reply(request, await attempt_rows(ctx, results))


# --- streamed inputs -----------------------------------------------------------------


# --- collect -------------------------------------------------------------------------


async def collect(
    ctx: HostContext, runner: RunnerPort, sender: Sender, request: CollectRequest
) -> AnyReply:
    """Bounded reads of logs and declared outputs (see `collect`); never a provider call."""
    return await collecting.collect(ctx, request)


# --- snapshot and set_offer ---------------------------------------------------------


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
    "check_slots": check_slots,
}


__all__ = [
    "HANDLERS",
    "handle",
    "host_facts",
    "idle_evidence",
    "provider_refusal",
]
