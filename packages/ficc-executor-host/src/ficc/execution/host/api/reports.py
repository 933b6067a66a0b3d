"""What the host reports of itself: `snapshot` (bindings, offer, capacity, attempts; with
`slots: true` and `daemon: true`, the slots' health and what the daemon runs, from
`slots`), `set_offer` and `metrics`."""

from __future__ import annotations

import contextlib
import os
from collections import Counter
from collections.abc import Mapping
from typing import Any, NamedTuple

import msgspec

from ficc.execution.host.api import slots as slot_reports
from ficc.execution.host.api.inputs import INPUT_CHUNK_BYTES
from ficc.execution.host.api.port import RunnerPort
from ficc.execution.host.api.rows import (
    attempt_status,
    logs_of,
    usages,
)
from ficc.execution.host.config.ceiling import ceiling_limits
from ficc.execution.host.context.parts import HostContext
from ficc.execution.host.context.slot_health import Health
from ficc.execution.host.core import lifecycle
from ficc.execution.host.core import metrics as metricslib
from ficc.execution.host.ledger import store as ledgerlib
from ficc.execution.protocol import (
    MetricsRequest,
    Resources,
    Sender,
    SetOfferRequest,
    SnapshotRequest,
)
from ficc.execution.wire import (
    AnyReply,
    AttemptStatus,
    Capacity,
    MetricsReply,
    Offer,
    OfferReply,
    ProviderInfo,
    SlotClass,
    SlotState,
    SnapshotReply,
    Usage,
)


def wire_offer(offer: ledgerlib.Offer) -> Offer:
    return Offer(revision=offer.revision, control=offer.control, limits=offer.limits)


def _capacity(
    ctx: HostContext,
    occupied: set[str],
    used: dict[str, int],
    health: Mapping[str, Health] | None = None,
) -> Capacity:
    """What is free now: the offer (within the ceiling) minus the reservations; with
    `health`, each class's `usable` slots too (the snapshot asked with `slots: true`)."""
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
    usable_slots = None if health is None else slot_reports.usable(ctx, occupied, health)
    slot_classes = [
        SlotClass(
            class_=name,
            total=len(slots),
            free=sum(1 for s in slots if s.id not in occupied),
            bytes=max(s.storage_bytes for s in slots),
            inodes=max(s.storage_inodes for s in slots),
            usable=msgspec.UNSET if usable_slots is None else usable_slots[name],
        )
        for name, slots in sorted(classes.items())
    ]
    providers = [
        ProviderInfo(id=p.id, package_digest=p.package_digest, available=p.loaded is not None)
        for p in sorted(ctx.providers.values(), key=lambda p: p.id)
    ]
    return Capacity(available=available, slot_classes=slot_classes, providers=providers)


class _SnapshotState(NamedTuple):
    offer: ledgerlib.Offer
    capacity: Capacity
    records: list[ledgerlib.AttemptRecord]
    cursor: str | None
    staged: dict[str, int]
    slots: list[SlotState] | None
    """Each slot's health, when the request asked (`slots: true`)."""


def _snapshot_state(
    ctx: HostContext, after: str | None, health: Mapping[str, Health] | None
) -> _SnapshotState:
    """Everything a snapshot reads from the ledger, on the ledger thread; `health` (taken
    on the event loop) when the request asked for the slots' health."""
    occupied, used = ctx.ledger.reservations()
    offer = ctx.ledger.offer()
    capacity = _capacity(ctx, occupied, used, health)
    records, cursor = ctx.ledger.page(after)
    staged = ctx.ledger.staged_bytes([r.attempt_id for r in records])
    slots = None if health is None else slot_reports.slot_states(ctx, occupied, health)
    return _SnapshotState(offer, capacity, records, cursor, staged, slots)


async def snapshot(
    ctx: HostContext, runner: RunnerPort, sender: Sender, request: SnapshotRequest
) -> AnyReply:
    """Bindings, bounds, offer, capacity and one page of up to 64 attempts; the slots'
    health and what the daemon runs only when the request asks (`slots`, `daemon`)."""
    health = slot_reports.health_now(ctx) if request.wants_slots else None
    state = await ctx.workers.db(_snapshot_state, ctx, request.after, health)
    offer, capacity, records, cursor, staged, slots = state
    logs = await logs_of(ctx, records)
    payload = request.wants_payload_usage
    used = await usages(ctx, runner, records, payload=payload) if request.wants_usage else {}
    changed = await _changed_times(ctx, records) if request.wants_changed else {}
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
            _listed(r, staged[r.attempt_id], logs.get(r.attempt_id, (0, 0)), used, changed)
            for r in records
        ],
        next=cursor,
        slots=msgspec.UNSET if slots is None else slots,
        daemon=slot_reports.daemon_info(ctx) if request.wants_daemon else msgspec.UNSET,
    )


def _listed(
    record: ledgerlib.AttemptRecord,
    staged: int,
    logs: tuple[int, int],
    used: dict[str, Usage],
    changed: dict[str, int],
) -> AttemptStatus:
    """A snapshot's attempt, with its `usage` and `changed_at_ms` when the request
    asked for them (and the host has them)."""
    status = attempt_status(record, staged, logs)
    extra: dict[str, Any] = {}
    if record.attempt_id in used:
        extra["usage"] = used[record.attempt_id]
    if record.attempt_id in changed:
        extra["changed_at_ms"] = changed[record.attempt_id]
    return msgspec.structs.replace(status, **extra) if extra else status


async def _changed_times(
    ctx: HostContext, records: list[ledgerlib.AttemptRecord]
) -> dict[str, int]:
    """When each listed attempt's status last changed, read only when asked: it is not
    part of the records every other request reads."""
    ids = [r.attempt_id for r in records]
    return await ctx.workers.db(ctx.ledger.changed_times, ids) if ids else {}


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


def metric_facts(ctx: HostContext, health: Mapping[str, Health]) -> metricslib.LedgerFacts:
    """Everything the metrics read from the durable state, on the ledger thread, with
    what the daemon holds in memory: what it runs, and `health` (taken on the loop)."""
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
    capacity = _capacity(ctx, occupied, used, health)
    classes = {slot.id: slot.slot_class for slot in ctx.config.slots}
    by_class: dict[tuple[str, str], metricslib.ClassUse] = {}
    for slot_id, outcome, count, cpu_us, oom_kills in ctx.ledger.usage_tally():
        key = (classes.get(slot_id, "unconfigured"), outcome)
        use = metricslib.ClassUse(count, cpu_us, oom_kills)
        by_class[key] = by_class[key] + use if key in by_class else use
    return metricslib.LedgerFacts(
        version=ctx.build.version,
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
        running=dict(ctx.build.versions),
        started_at_seconds=ctx.build.started_at_ms / 1000,
        slot_health=slot_reports.slot_gauges(ctx, health),
        usable={c.class_: c.usable for c in capacity.slot_classes if isinstance(c.usable, int)},
    )


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
    facts = await ctx.workers.db(metric_facts, ctx, slot_reports.health_now(ctx))
    text = metricslib.render(facts, metricslib.PROCESS)
    return MetricsReply(version=1, id=request.id, text=text)
