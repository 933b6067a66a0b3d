"""GroupCommit: which items share a call, what each gets back (pure asyncio, no I/O)."""

from __future__ import annotations

import asyncio

import pytest

from ficc.execution.host.context.group_commit import GroupCommit


class Calls:
    """A `run` that records each call's items and holds the call until released."""

    def __init__(self) -> None:
        self.calls: list[list[int]] = []
        self.gates: list[asyncio.Event] = []
        self.fail: set[int] = set()

    async def run(self, items: list[int]) -> list[str]:
        self.calls.append(items)
        gate = asyncio.Event()
        self.gates.append(gate)
        await gate.wait()
        if self.fail & set(items):
            raise ValueError(f"call {items} refused")
        return [f"r{item}" for item in items]

    async def started(self, count: int) -> None:
        while len(self.calls) < count:
            await asyncio.sleep(0)


def test_items_that_arrive_while_a_call_runs_share_the_next_call_in_order() -> None:
    calls = Calls()

    async def scenario() -> list[str]:
        group = GroupCommit(calls.run, most=16)
        first = asyncio.ensure_future(group.submit(1))
        await calls.started(1)
        later = [asyncio.ensure_future(group.submit(n)) for n in (2, 3, 4)]
        await asyncio.sleep(0)
        calls.gates[0].set()
        await calls.started(2)
        calls.gates[1].set()
        return list(await asyncio.gather(first, *later))

    assert asyncio.run(scenario()) == ["r1", "r2", "r3", "r4"]
    assert calls.calls == [[1], [2, 3, 4]]


def test_a_call_takes_at_most_most_items() -> None:
    calls = Calls()

    async def scenario() -> None:
        group = GroupCommit(calls.run, most=2)
        futures = [asyncio.ensure_future(group.submit(1))]
        await calls.started(1)
        futures += [asyncio.ensure_future(group.submit(n)) for n in (2, 3, 4, 5, 6)]
        for index in range(4):
            await calls.started(index + 1)
            calls.gates[index].set()
        await asyncio.gather(*futures)

    asyncio.run(scenario())
    assert calls.calls == [[1], [2, 3], [4, 5], [6]]


def test_a_refused_call_refuses_its_items_only() -> None:
    calls = Calls()
    calls.fail = {2}

    async def scenario() -> tuple[list[BaseException | str], str]:
        group = GroupCommit(calls.run, most=16)
        first = asyncio.ensure_future(group.submit(1))
        await calls.started(1)
        together = [asyncio.ensure_future(group.submit(n)) for n in (2, 3)]
        await asyncio.sleep(0)
        calls.gates[0].set()
        await calls.started(2)
        calls.gates[1].set()
        refused = await asyncio.gather(*together, return_exceptions=True)
        after = asyncio.ensure_future(group.submit(4))
        await calls.started(3)
        calls.gates[2].set()
        assert await first == "r1"
        return refused, await after

    refused, after = asyncio.run(scenario())
    assert [type(r) for r in refused] == [ValueError, ValueError]
    assert after == "r4"


def test_a_submitter_that_gives_up_leaves_the_others_their_results() -> None:
    calls = Calls()

    async def scenario() -> list[str]:
        group = GroupCommit(calls.run, most=16)
        first = asyncio.ensure_future(group.submit(1))
        await calls.started(1)
        gone, kept = (asyncio.ensure_future(group.submit(n)) for n in (2, 3))
        await asyncio.sleep(0)
        gone.cancel()
        calls.gates[0].set()
        await calls.started(2)
        calls.gates[1].set()
        with pytest.raises(asyncio.CancelledError):
            await gone
        return [await first, await kept]

    assert asyncio.run(scenario()) == ["r1", "r3"]
    assert calls.calls == [[1], [3]]  # the one that gave up was never committed


def test_closing_cancels_what_waits_and_commits_nothing_more() -> None:
    calls = Calls()

    async def scenario() -> list[BaseException | str]:
        group = GroupCommit(calls.run, most=16)
        first = asyncio.ensure_future(group.submit(1))
        await calls.started(1)
        waiting = asyncio.ensure_future(group.submit(2))
        await asyncio.sleep(0)
        await group.close()
        return list(await asyncio.gather(first, waiting, return_exceptions=True))

    outcomes = asyncio.run(scenario())
    assert all(isinstance(o, asyncio.CancelledError) for o in outcomes), outcomes
    assert calls.calls == [[1]]
