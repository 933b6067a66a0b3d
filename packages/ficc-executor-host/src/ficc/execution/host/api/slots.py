"""What the host reports of its slots' health and of itself as it runs: the snapshot's
opt-in `slots` and `daemon`, and the administrator's `check_slots`.

The health is taken on the event loop (`SlotHealth.states`, a copy) and handed to the
ledger thread with the reservations it is read beside, so a reply's `usable`, `free`
and `healthy` agree with each other.
"""

from __future__ import annotations

from collections.abc import Mapping

from ficc.execution.host.api.port import RunnerPort
from ficc.execution.host.context.parts import HostContext
from ficc.execution.host.context.slot_health import Health
from ficc.execution.host.core import metrics as metricslib
from ficc.execution.protocol import CheckSlotsRequest, Sender
from ficc.execution.provider import tasks
from ficc.execution.wire import (
    SLOT_MESSAGE_MAX,
    AnyReply,
    DaemonInfo,
    RunningVersion,
    SlotsReply,
    SlotState,
)

__all__ = ["check_slots", "daemon_info", "health_now", "slot_gauges", "slot_states", "usable"]


def health_now(ctx: HostContext) -> dict[str, Health]:
    """Every configured slot's health now (on the event loop)."""
    return ctx.slot_health.states(ctx.slots)


def slot_states(
    ctx: HostContext, occupied: set[str], health: Mapping[str, Health]
) -> list[SlotState]:
    """Each configured slot, in configuration order, as the protocol shows it."""
    return [
        SlotState(
            id=slot.id,
            class_=slot.slot_class,
            healthy=health[slot.id].healthy,
            free=slot.id not in occupied,
            reason=health[slot.id].reason,
            message=_bounded(health[slot.id].message),
            since_ms=health[slot.id].since_ms,
        )
        for slot in ctx.config.slots
    ]


def _bounded(message: str | None) -> str | None:
    if message is None or len(message) <= SLOT_MESSAGE_MAX:
        return message
    return message[: SLOT_MESSAGE_MAX - 3] + "..."


def usable(ctx: HostContext, occupied: set[str], health: Mapping[str, Health]) -> dict[str, int]:
    """Free slots that pass their checks, by class (every class, 0 included)."""
    counts: dict[str, int] = {}
    for slot in ctx.config.slots:
        counts.setdefault(slot.slot_class, 0)
        if slot.id not in occupied and health[slot.id].healthy:
            counts[slot.slot_class] += 1
    return counts


def slot_gauges(ctx: HostContext, health: Mapping[str, Health]) -> dict[str, metricslib.SlotGauge]:
    """Each slot's health as its metrics gauge shows it."""
    return {
        slot.id: metricslib.SlotGauge(slot.slot_class, health[slot.id].reason)
        for slot in ctx.config.slots
    }


def daemon_info(ctx: HostContext) -> DaemonInfo:
    """The versions and start the daemon captured when it opened (`context/build.py`)."""
    build = ctx.build
    return DaemonInfo(
        started_at_ms=build.started_at_ms,
        versions=[RunningVersion(name, version) for name, version in build.versions],
        tasks=task_source(),
    )


def task_source() -> str:
    """Where this process's "is anything of the account left?" answers come from."""
    if tasks.SHARED.told:
        return "process events"
    return f"walks of /proc: {tasks.SHARED.why_walking}"[:1024]


async def check_slots(
    ctx: HostContext, runner: RunnerPort, sender: Sender, request: CheckSlotsRequest
) -> AnyReply:
    """Check every slot now (administrator only): a repaired slot is back in the offer
    with this reply, without waiting for the next scheduled check."""
    await ctx.slot_health.check(ctx.workers, ctx.slots.values(), administrator=True)
    health = health_now(ctx)
    occupied, _ = await ctx.workers.db(ctx.ledger.reservations)
    return SlotsReply(version=1, id=request.id, slots=slot_states(ctx, occupied, health))
