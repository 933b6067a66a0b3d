"""The monitor's decisions (pure) and its loop, driven through a recording stand-in.

The runner's real operations are exercised in test_pipeline.py; here the stand-in
only records which operation the monitor asked for, in which order.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import msgspec
import pytest

from ficc.execution.host.core import lifecycle
from ficc.execution.host.ledger.store import AttemptRecord
from ficc.execution.host.runner.monitor import Action, Monitor, decide


def status(state: str, **changes: Any) -> lifecycle.Status:
    return msgspec.convert({"state": state, **changes}, lifecycle.Status)


@pytest.mark.parametrize(
    ("state", "changes", "lease", "starting", "actions"),
    [
        ("prepared", {}, True, False, []),
        ("prepared", {}, False, False, [Action.EXPIRE, Action.CLEANUP]),
        ("starting", {}, True, True, []),
        ("starting", {}, False, True, [Action.EXPIRE, Action.ABORT_START]),
        ("starting", {}, False, False, [Action.EXPIRE, Action.STOP]),
        ("starting", {"stop_pending": "cancelled"}, True, True, [Action.ABORT_START]),
        ("starting", {"stop_pending": "expired"}, False, False, [Action.STOP]),
        ("running", {}, True, False, [Action.OBSERVE]),
        ("running", {}, False, False, [Action.EXPIRE, Action.STOP]),
        ("running", {"stop_pending": "cancelled"}, True, False, [Action.STOP]),
        ("failed", {}, False, False, [Action.CLEANUP]),
        ("failed", {}, False, True, []),  # the start pipeline still owns the service
        ("unknown", {"quarantined": True}, False, False, [Action.CLEANUP]),
        ("failed", {"cleanup_confirmed": True}, False, False, []),
        ("released", {"cleanup_confirmed": True}, False, False, []),
    ],
)
def test_decide(
    state: str, changes: dict[str, Any], lease: bool, starting: bool, actions: list[Action]
) -> None:
    assert decide(status(state, **changes), lease_current=lease, start_running=starting) == actions


def record(attempt_id: str, state: str, **changes: Any) -> AttemptRecord:
    return AttemptRecord(
        attempt_id=attempt_id,
        job_id="5" * 32,
        generation=1,
        plan_digest="sha256:" + "a" * 64,
        offer_revision=1,
        status=status(state, **changes),
        detail=None,
        slot_id="slot0",
        lease=None,
        created=1,
        updated=1,
    )


class Recorder:
    """MonitorOps that records calls; `expired` attempt IDs have no current lease."""

    def __init__(
        self,
        records: list[AttemptRecord],
        expired: set[str] = frozenset(),
        renewed: set[str] = frozenset(),
    ) -> None:
        self.records = records
        self.expired = expired
        self.renewed = renewed
        """Expired when read, renewed before the expiry's transaction: not recorded."""
        self.calls: list[tuple[str, Any]] = []
        self.failing: set[str] = set()

    async def watched(self) -> list[AttemptRecord]:
        return self.records

    def lease_current(self, record: AttemptRecord) -> bool:
        return record.attempt_id not in self.expired

    def start_running(self, attempt_id: str) -> bool:
        return False

    async def expire(self, record: AttemptRecord) -> bool:
        self.calls.append(("expire", record.attempt_id))
        return record.attempt_id not in self.renewed

    def abort_start(self, attempt_id: str) -> None:
        self.calls.append(("abort", attempt_id))

    async def stop(self, record: AttemptRecord) -> None:
        if record.attempt_id in self.failing:
            raise RuntimeError("stop exploded")
        self.calls.append(("stop", record.attempt_id))

    async def observe(self, records: Sequence[AttemptRecord]) -> None:
        self.calls.append(("observe", tuple(r.attempt_id for r in records)))

    async def cleanup(self, record: AttemptRecord) -> None:
        self.calls.append(("cleanup", record.attempt_id))


def test_a_tick_expires_before_stopping_and_observes_running_attempts_in_one_batch() -> None:
    ops = Recorder(
        [
            record("a", "running"),
            record("b", "running", stop_pending="cancelled"),
            record("c", "running"),
            record("d", "starting"),
            record("e", "failed"),
        ],
        expired={"d"},
    )
    asyncio.run(Monitor(ops).tick())
    assert ops.calls.index(("expire", "d")) < ops.calls.index(("stop", "d"))
    assert ("stop", "b") in ops.calls
    assert ("cleanup", "e") in ops.calls
    assert [c for c in ops.calls if c[0] == "observe"] == [("observe", ("a", "c"))]


def test_an_expiry_the_ledger_does_not_record_stops_nothing() -> None:
    """The tick judged the lease on records read earlier; the expiry's own transaction
    found it renewed since: neither the stop nor the start's abort may follow."""
    ops = Recorder(
        [record("r", "running"), record("p", "prepared"), record("s", "starting")],
        expired={"r", "p", "s"},
        renewed={"r", "p", "s"},
    )
    asyncio.run(Monitor(ops).tick())
    assert sorted(ops.calls) == [("expire", "p"), ("expire", "r"), ("expire", "s")]


def test_one_failing_action_does_not_stop_the_others() -> None:
    ops = Recorder([record("a", "running", stop_pending="cancelled"), record("b", "failed")])
    ops.failing.add("a")
    asyncio.run(Monitor(ops).tick())
    assert ops.calls == [("cleanup", "b")]


def test_run_ticks_calls_on_tick_and_wakes_early() -> None:
    ops = Recorder([record("a", "failed")])
    ticks: list[int] = []

    async def scenario() -> None:
        monitor = Monitor(ops, interval=3600.0, on_tick=lambda: ticks.append(monitor.ticks))
        task = asyncio.get_running_loop().create_task(monitor.run())
        while monitor.ticks < 1:
            await asyncio.sleep(0)
        monitor.wake()  # the hour-long interval would never end the test otherwise
        while monitor.ticks < 2:
            await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(asyncio.wait_for(scenario(), 30))
    assert ticks[:2] == [1, 2]
    assert ops.calls[:2] == [("cleanup", "a"), ("cleanup", "a")]


def test_a_failing_tick_is_survived() -> None:
    class Broken(Recorder):
        async def watched(self) -> list[AttemptRecord]:
            raise RuntimeError("ledger unavailable")

    ops = Broken([])

    async def scenario() -> int:
        monitor = Monitor(ops, interval=0.001)
        task = asyncio.get_running_loop().create_task(monitor.run())
        while monitor.ticks < 3:
            await asyncio.sleep(0.001)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return monitor.ticks

    assert asyncio.run(asyncio.wait_for(scenario(), 30)) >= 3
