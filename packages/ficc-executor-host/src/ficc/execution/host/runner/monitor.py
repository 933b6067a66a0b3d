"""The monitor: what to do with each attempt on every tick, and the loop that does it.

The decision is pure (`decide`): from an attempt's status, whether its lease is
current and whether its start pipeline is still running, it names the actions of
this tick. The runner (pipeline.py) carries them out through `MonitorOps`, so this
module never touches the ledger, a provider or the service itself.

Order of a tick, per attempt:
1. a lease past its deadline is recorded (`LeaseExpired`: a prepared attempt becomes
   `expired`, a starting or running one gets `stop_pending`), judged again at a clock
   reading inside the transaction that records it: a lease renewed after this tick
   read its record is not expired, and then nothing of it is stopped;
2. a pending stop (stop request or expiry) kills the service; while the start
   pipeline still runs, the stop is handed to it instead (it owns the service until
   it returns), and the monitor records `Stopped` on a later tick;
3. a running attempt is observed (its provider's observe rows of one tick go out as
   one batch per provider): `finished` records the exit code, an unreadable outcome
   records `unknown`, never a replay;
4. a settled attempt whose cleanup is not confirmed is stopped and checked idle:
   `CleanupConfirmed`, or `CleanupFailed` (quarantine: the slot stays reserved and
   the next tick tries again).

The monitor holds nothing that staging writes need: it only reads records, and
every blocking call of the ops runs in the daemon's worker threads.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Protocol

from ficc.execution.host.core import lifecycle
from ficc.execution.host.ledger.store import AttemptRecord

__all__ = ["Action", "Monitor", "MonitorOps", "decide"]

_log = logging.getLogger(__name__)

TICK_SECONDS = 0.2


class Action(enum.Enum):
    EXPIRE = "expire"
    ABORT_START = "abort_start"
    STOP = "stop"
    OBSERVE = "observe"
    CLEANUP = "cleanup"


def decide(status: lifecycle.Status, *, lease_current: bool, start_running: bool) -> list[Action]:
    """The actions of one tick for one attempt (empty: nothing to do)."""
    state = status.state
    if state in lifecycle.ACTIVE and not lease_current and status.stop_pending is None:
        if state == "prepared":
            return [Action.EXPIRE, Action.CLEANUP]
        return [Action.EXPIRE, Action.ABORT_START if start_running else Action.STOP]
    if state in ("starting", "running") and status.stop_pending is not None:
        return [Action.ABORT_START if start_running else Action.STOP]
    if state == "running" and not start_running:
        return [Action.OBSERVE]
    if state in lifecycle.SETTLED and not status.cleanup_confirmed and not start_running:
        return [Action.CLEANUP]
    return []


class MonitorOps(Protocol):
    """What the runner does for the monitor (each may block in a worker thread)."""

    async def watched(self) -> list[AttemptRecord]:
        """The records that may need an action (active or not yet cleaned up)."""
        ...

    def lease_current(self, record: AttemptRecord) -> bool: ...

    def start_running(self, attempt_id: str) -> bool: ...

    async def expire(self, record: AttemptRecord) -> bool:
        """Record the expiry if the lease ran out as the recording transaction sees it;
        False (nothing recorded, nothing to stop): it was renewed meanwhile."""
        ...

    def abort_start(self, attempt_id: str) -> None: ...

    async def stop(self, record: AttemptRecord) -> None: ...

    async def observe(self, records: Sequence[AttemptRecord]) -> None: ...

    async def cleanup(self, record: AttemptRecord) -> None: ...


class Monitor:
    """Runs ticks until cancelled; `wake()` brings the next tick forward."""

    def __init__(
        self,
        ops: MonitorOps,
        *,
        interval: float = TICK_SECONDS,
        on_tick: Callable[[], None] | None = None,
    ) -> None:
        self._ops = ops
        self._interval = interval
        self._on_tick = on_tick
        self._wake = asyncio.Event()
        self.ticks = 0

    def wake(self) -> None:
        self._wake.set()

    async def run(self) -> None:
        """Tick forever. A failing tick is logged and the loop goes on: the monitor is
        what enforces leases, so it must not die of one bad attempt."""
        while True:
            self._wake.clear()
            try:
                await self.tick()
            except asyncio.CancelledError:
                raise
            except Exception:
                _log.exception("monitor tick failed; retrying on the next tick")
            self.ticks += 1
            if self._on_tick is not None:
                self._on_tick()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self._interval)

    async def tick(self) -> None:
        records = await self._ops.watched()
        plans = [
            (
                record,
                decide(
                    record.status,
                    lease_current=self._ops.lease_current(record),
                    start_running=self._ops.start_running(record.attempt_id),
                ),
            )
            for record in records
        ]
        await _each(self._expire_then_act(r, a) for r, a in plans if Action.OBSERVE not in a)
        running = [r for r, actions in plans if Action.OBSERVE in actions]
        if running:
            await self._ops.observe(running)

    async def _expire_then_act(self, record: AttemptRecord, actions: list[Action]) -> None:
        for action in actions:
            if action is Action.EXPIRE:
                if not await self._ops.expire(record):
                    return  # renewed after the records were read: nothing to stop
            elif action is Action.ABORT_START:
                self._ops.abort_start(record.attempt_id)
            elif action is Action.STOP:
                await self._ops.stop(record)
            elif action is Action.CLEANUP:
                await self._ops.cleanup(record)


async def _each(jobs: Iterable[Awaitable[None]]) -> None:
    """Run every job concurrently; one failure is logged, the others still finish."""
    for result in await asyncio.gather(*jobs, return_exceptions=True):
        if isinstance(result, BaseException) and not isinstance(result, Exception):
            raise result
        if isinstance(result, Exception):
            _log.error("monitor action failed: %r", result)
