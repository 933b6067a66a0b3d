"""Workers: where each step of a request runs, with real thread pools and a real loop."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator

import pytest

from ficc.execution.host.context.parts import Workers
from ficc_testkit.waits import wait_for


@pytest.fixture
def workers() -> Iterator[Workers]:
    pool = Workers(io_threads=2, provider_threads=1)
    yield pool
    pool.shutdown()


def test_db_then_io_looks_up_on_the_ledger_thread_then_reads_on_an_io_thread(
    workers: Workers,
) -> None:
    seen: list[str] = []

    def lookup() -> int:
        seen.append(threading.current_thread().name)
        return 20

    def then(found: int) -> int:
        seen.append(threading.current_thread().name)
        return found + 1

    async def scenario() -> int:
        ledger_thread = await workers.db(lambda: threading.current_thread().name)
        seen.append(ledger_thread)
        return await workers.db_then_io(lookup, then)

    assert asyncio.run(scenario()) == 21
    ledger_thread, looked_up_in, read_in = seen
    assert looked_up_in == ledger_thread
    assert read_in.startswith("ficc-io")


def test_a_refused_lookup_is_raised_and_nothing_is_read(workers: Workers) -> None:
    read: list[object] = []

    def lookup() -> int:
        raise LookupError("fence_mismatch")

    with pytest.raises(LookupError, match="fence_mismatch"):
        asyncio.run(workers.db_then_io(lookup, read.append))
    assert read == []


def test_a_failed_read_is_raised(workers: Workers) -> None:
    def then(found: int) -> int:
        raise OSError(f"cannot read {found}")

    with pytest.raises(OSError, match="cannot read 7"):
        asyncio.run(workers.db_then_io(lambda: 7, then))


def test_a_caller_cancelled_before_the_lookup_starts_runs_neither_step(workers: Workers) -> None:
    release = threading.Event()
    ran: list[str] = []

    async def scenario() -> None:
        busy = asyncio.ensure_future(workers.db(release.wait, 30))  # holds the ledger thread
        chained = asyncio.ensure_future(
            workers.db_then_io(lambda: ran.append("lookup"), lambda _: ran.append("read"))
        )
        await asyncio.sleep(0)  # both are queued on the ledger thread now
        chained.cancel()
        with pytest.raises(asyncio.CancelledError):
            await chained
        release.set()
        assert await busy
        await workers.db(lambda: None)  # everything queued before it has run

    asyncio.run(scenario())
    assert ran == []


def test_io_threads_shut_down_make_the_chain_fail_not_hang() -> None:
    pool = Workers(io_threads=1, provider_threads=1)
    try:
        pool._io.shutdown(wait=True)
        with pytest.raises(RuntimeError):
            asyncio.run(pool.db_then_io(lambda: 1, lambda found: found))
    finally:
        pool.shutdown()


def test_a_provider_call_past_its_timeout_does_not_hold_back_the_next(
    workers: Workers,
) -> None:
    """One place for provider calls; the first hangs past its timeout and keeps its
    thread, yet the next call runs at once and answers."""
    hung = threading.Event()

    async def scenario() -> str:
        with pytest.raises(TimeoutError):
            await workers.provider(hung.wait, 30, timeout=0.05)
        return await workers.provider(lambda: "answered", timeout=10)

    try:
        assert asyncio.run(scenario()) == "answered"
    finally:
        hung.set()


def test_a_provider_call_s_timeout_starts_when_it_runs_not_while_it_waits(
    workers: Workers,
) -> None:
    """With one place, the second call waits for the first; waiting does not count
    against its own timeout, which is shorter than the first call takes."""
    first_done = threading.Event()

    def first() -> str:
        first_done.wait(0.5)  # nothing sets it: this call takes 0.5 s
        return "first"

    async def scenario() -> list[str]:
        return list(
            await asyncio.gather(
                workers.provider(first, timeout=30),
                workers.provider(lambda: "second", timeout=0.3),
            )
        )

    assert asyncio.run(scenario()) == ["first", "second"]


def test_no_more_provider_calls_run_at_once_than_there_are_places(workers: Workers) -> None:
    """One place: a second call cannot run while the first does (it would set the
    event the first one waits for)."""
    event = threading.Event()

    async def scenario() -> list[bool]:
        return list(
            await asyncio.gather(
                workers.provider(event.wait, 0.3, timeout=30),
                workers.provider(lambda: event.set() or True, timeout=30),
            )
        )

    assert asyncio.run(scenario()) == [False, True]


def test_a_provider_call_s_exception_reaches_the_caller(workers: Workers) -> None:
    def refuse() -> None:
        raise ValueError("malformed")

    with pytest.raises(ValueError, match="malformed"):
        asyncio.run(workers.provider(refuse, timeout=30))


def test_a_provider_answer_that_came_before_a_late_loop_saw_the_deadline_counts(
    workers: Workers,
) -> None:
    """The loop is held up (by this test) until the call has answered and its deadline
    has passed: both wait for the same loop turn, and the answer counts."""

    async def scenario() -> str:
        begun = time.monotonic()
        call = asyncio.ensure_future(workers.provider(str.upper, "done", timeout=0.2))
        await asyncio.sleep(0)  # the call is handed to a thread
        wait_for(lambda: workers._providers._idle, "the call to answer (its thread idle again)")
        wait_for(lambda: time.monotonic() > begun + 0.3, "the deadline to pass")
        return await call

    assert asyncio.run(scenario()) == "DONE"


def test_shutdown_ends_the_idle_provider_threads() -> None:
    pool = Workers(io_threads=1, provider_threads=2)
    name_of = "ficc-provider"
    before = {t for t in threading.enumerate() if t.name == name_of}

    async def scenario() -> list[str]:
        return list(await asyncio.gather(*(pool.provider(str, n, timeout=30) for n in range(2))))

    assert asyncio.run(scenario()) == ["0", "1"]
    pool.shutdown()
    wait_for(
        lambda: not {t for t in threading.enumerate() if t.name == name_of} - before,
        "the idle provider threads to end",
    )
