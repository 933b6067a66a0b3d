"""Lane: the worker threads behind the ledger thread and the I/O threads, with real
threads and a real loop (asyncio's own and uvloop, which the daemon runs)."""

from __future__ import annotations

import asyncio
import secrets
import threading
from collections.abc import Callable, Coroutine, Iterator
from typing import Any

import pytest
import uvloop

from ficc.execution.host.context.lanes import Lane, Spares, ToLoop
from ficc_testkit.waits import wait_for


@pytest.fixture(params=["asyncio", "uvloop"])
def run(request: pytest.FixtureRequest) -> Callable[[Coroutine[Any, Any, Any]], Any]:
    """Each test runs on both loops."""
    return asyncio.run if request.param == "asyncio" else uvloop.run


@pytest.fixture
def lane() -> Iterator[Lane]:
    made = Lane(2, "ficc-test")
    yield made
    made.shutdown()


def test_a_call_runs_in_a_named_thread_and_answers(lane: Lane, run: Any) -> None:
    async def scenario() -> tuple[str, int]:
        name = await lane.run(lambda: threading.current_thread().name)
        return name, await lane.run(divmod, 7, 2) == (3, 1)

    name, answered = run(scenario())
    assert name.startswith("ficc-test_")
    assert answered


def test_a_call_s_exception_reaches_the_caller_with_its_type(lane: Lane, run: Any) -> None:
    def refuse() -> None:
        raise LookupError("fence_mismatch")

    with pytest.raises(LookupError, match="fence_mismatch"):
        run(lane.run(refuse))


def test_a_stop_iteration_from_a_call_is_a_runtime_error_not_a_hang(lane: Lane, run: Any) -> None:
    """A future cannot carry StopIteration; the caller still gets an answer."""
    with pytest.raises(RuntimeError, match="StopIteration"):
        run(lane.run(next, iter(())))


def test_a_caller_cancelled_before_its_call_starts_keeps_it_from_running(run: Any) -> None:
    one = Lane(1, "ficc-one")
    release = threading.Event()
    ran: list[str] = []

    async def scenario() -> None:
        busy = asyncio.ensure_future(one.run(release.wait, 30))  # holds the one thread
        queued = asyncio.ensure_future(one.run(ran.append, "queued"))
        await asyncio.sleep(0)  # both are in the queue now
        queued.cancel()
        with pytest.raises(asyncio.CancelledError):
            await queued
        release.set()
        assert await busy
        await one.run(ran.append, "after")  # everything queued before it has run

    try:
        run(scenario())
    finally:
        one.shutdown()
    assert ran == ["after"]


def test_calls_of_many_callers_each_get_their_own_answer(lane: Lane, run: Any) -> None:
    async def scenario() -> list[int]:
        return list(await asyncio.gather(*(lane.run(pow, n, 2) for n in range(500))))

    assert run(scenario()) == [n * n for n in range(500)]


def test_a_blocking_call_from_another_thread_answers_there(lane: Lane) -> None:
    answers: list[object] = []

    def elsewhere() -> None:
        answers.append(lane.call(divmod, 9, 4))
        with pytest.raises(ZeroDivisionError):
            lane.call(divmod, 1, 0)
        answers.append("refused")

    thread = threading.Thread(target=elsewhere)
    thread.start()
    thread.join(30)
    assert answers == [(2, 1), "refused"]


def test_after_shutdown_no_call_is_accepted(run: Any) -> None:
    closed = Lane(1, "ficc-closed")
    run(closed.run(int))  # its thread runs
    closed.shutdown()
    with pytest.raises(RuntimeError, match="shut down"):
        run(closed.run(int))
    with pytest.raises(RuntimeError, match="shut down"):
        closed.call(int)


def test_shutdown_cancels_the_calls_still_queued_and_waits_for_the_running_one(
    run: Any,
) -> None:
    one = Lane(1, "ficc-one")
    started, release = threading.Event(), threading.Event()
    ran: list[str] = []

    def running() -> str:
        started.set()
        release.wait(30)
        return "finished"

    async def scenario() -> tuple[object, object]:
        first = asyncio.ensure_future(one.run(running))
        second = asyncio.ensure_future(one.run(ran.append, "queued"))
        await asyncio.get_running_loop().run_in_executor(None, started.wait, 30)
        one.shutdown(wait=False)  # the second is still queued behind the first
        release.set()
        outcomes = await asyncio.gather(first, second, return_exceptions=True)
        return outcomes[0], outcomes[1]

    first, second = run(scenario())
    one.shutdown()  # and now its thread is gone
    assert first == "finished"
    assert isinstance(second, asyncio.CancelledError)
    assert ran == []


def test_a_spare_thread_that_finished_its_call_takes_the_next(run: Any) -> None:
    spares = Spares(2, "ficc-spare")

    async def scenario() -> list[int]:
        loop = asyncio.get_running_loop()
        seen = []
        for _ in range(3):
            future: asyncio.Future[int] = loop.create_future()
            spares.submit(threading.get_ident, (), {}, ToLoop(loop, future))
            seen.append(await future)
        return seen

    first, second, third = run(scenario())
    assert first == second == third


def test_a_hung_call_keeps_its_thread_and_the_next_call_gets_another(run: Any) -> None:
    spares = Spares(2, "ficc-spare")
    hung = threading.Event()

    async def scenario() -> tuple[bool, str]:
        loop = asyncio.get_running_loop()
        held: asyncio.Future[bool] = loop.create_future()
        spares.submit(hung.wait, (30,), {}, ToLoop(loop, held))
        answered: asyncio.Future[str] = loop.create_future()
        spares.submit(str.upper, ("next",), {}, ToLoop(loop, answered))
        text = await answered  # while the first still waits
        hung.set()
        return await held, text

    assert run(scenario()) == (True, "NEXT")


def test_no_more_spare_threads_are_kept_than_asked(run: Any) -> None:
    name = f"ficc-spare-{secrets.token_hex(4)}"
    spares = Spares(1, name)
    both = threading.Barrier(2)

    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        futures = [loop.create_future() for _ in range(2)]
        for future in futures:  # two at once: two threads
            spares.submit(both.wait, (30,), {}, ToLoop(loop, future))
        await asyncio.gather(*futures)

    run(scenario())

    def spare_threads() -> list[threading.Thread]:
        return [t for t in threading.enumerate() if t.name == name]

    wait_for(lambda: len(spare_threads()) == 1, "one of the two threads to end")
    assert len(spares._idle) == 1
