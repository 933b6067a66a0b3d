"""The batcher: provider rows of one turn of the event loop become one provider call.

Every row queued for the same (provider, method) in one turn of the event loop goes
out as one driver call of at most 64 rows (providers.driver.call), bounded by a
timeout. The rows of one request (prepare's probe and prepare, start, release) and of
one monitor tick (observe) are a `Cohort`: held until each of its attempts has queued
its row or dropped out, so they reach the provider as one call although the work
before the call takes each a different time. A timed-out call leaves its rows
uncertain: the runner records `failed` for probe/prepare (no payload can have run),
`unknown` for start/observe, never a replay.

A timed-out call keeps running in its thread (Python cannot stop it), so the batcher
also keeps which attempts have a provider call still running (`running`): the runner
confirms no cleanup while one does, and a new row of an attempt whose earlier call is
past its timeout is refused without a call (`provider_timeout`), so no call overlaps
one the host has given up waiting for; `stop` alone still goes out, since stopping the
attempt's processes may be what ends the hung call. Past MAX_LATE_CALLS such calls of
one provider (threads left behind by a hung provider) no call of that provider is made
at all (`provider_unavailable`).

The batcher also keeps, per (provider, method), the CPU seconds its last call spent
in its worker thread (`cpu_seconds`): what the call cost the host, without the time it
waited for a CPU that others (Podman starting, say) were using.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import logging
import threading
import time
from collections.abc import Sequence
from typing import Any, Final

from ficc.execution import provider as sdk
from ficc.execution.errors import ErrorCode
from ficc.execution.host.context.parts import HostContext
from ficc.execution.host.providers.driver import MAX_BATCH, RowResult, call

__all__ = ["PROVIDER_TIMEOUT", "Batcher", "Cohort", "Ticket"]

PROVIDER_TIMEOUT: Final = ErrorCode.PROVIDER_TIMEOUT
"""The code of every row of a provider call that took longer than its timeout."""
_log = logging.getLogger(__name__)

MAX_LATE_CALLS: Final = 64
"""Calls of one provider still running past their timeout beyond which no call of
that provider is made."""


class _Call:
    """One driver call's provider and attempts, shared by the loop and its thread."""

    __slots__ = ("attempt_ids", "ended", "late", "provider")

    def __init__(self, provider: str, attempt_ids: list[str]) -> None:
        self.provider = provider
        self.attempt_ids = attempt_ids
        self.ended = False
        self.late = False


class InFlight:
    """Attempts with a provider call running in its thread, past its timeout or not
    (updated from the loop and from the calls' threads, hence the lock)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._running: collections.Counter[str] = collections.Counter()
        self._late: collections.Counter[str] = collections.Counter()
        self._late_calls: collections.Counter[str] = collections.Counter()

    def begin(self, provider: str, attempt_ids: list[str]) -> _Call:
        with self._lock:
            self._running.update(attempt_ids)
        return _Call(provider, attempt_ids)

    def timed_out(self, call: _Call) -> None:
        with self._lock:
            if not call.ended:
                call.late = True
                self._late.update(call.attempt_ids)
                self._late_calls[call.provider] += 1

    def end(self, call: _Call) -> None:
        """In the call's thread (or the loop, if the thread never started)."""
        with self._lock:
            call.ended = True
            self._running.subtract(call.attempt_ids)
            if call.late:
                self._late.subtract(call.attempt_ids)
                self._late_calls[call.provider] -= 1
            for counter in (self._running, self._late):
                for attempt_id in call.attempt_ids:
                    if counter[attempt_id] <= 0:
                        del counter[attempt_id]

    def running(self, attempt_id: str) -> bool:
        with self._lock:
            return attempt_id in self._running

    def late(self, attempt_id: str) -> bool:
        with self._lock:
            return attempt_id in self._late

    def late_calls(self, provider: str) -> int:
        """This provider's calls still running past their timeout."""
        with self._lock:
            return self._late_calls[provider]


class Batcher:
    """Coalesces provider rows of one event-loop turn into driver calls of <= 64 rows."""

    def __init__(
        self, ctx: HostContext, timeout: float, max_late_calls: int = MAX_LATE_CALLS
    ) -> None:
        self._ctx = ctx
        self._timeout = timeout
        self._max_late_calls = max_late_calls
        self.in_flight = InFlight()
        self._pending: dict[tuple[str, str], list[tuple[sdk.Context, asyncio.Future[Any]]]] = {}
        self.tasks: set[asyncio.Task[None]] = set()
        self.cpu_seconds: dict[tuple[str, str], float] = {}
        """CPU seconds of the last driver call of each (provider, method)."""

    async def call(self, provider: str, method: str, context: sdk.Context) -> RowResult:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[RowResult] = loop.create_future()
        queue = self._pending.setdefault((provider, method), [])
        queue.append((context, future))
        if len(queue) == 1:
            loop.call_soon(self._flush, (provider, method))
        return await future

    def cohort(self, size: int) -> Cohort:
        """`size` rows that belong together (see `Cohort`)."""
        return Cohort(self, size)

    def _flush(self, key: tuple[str, str]) -> None:
        self.submit(key, self._pending.pop(key, []))

    def submit(
        self, key: tuple[str, str], rows: list[tuple[sdk.Context, asyncio.Future[Any]]]
    ) -> None:
        """Send `rows` now, in driver calls of at most 64 rows."""
        for start in range(0, len(rows), MAX_BATCH):
            task = asyncio.get_running_loop().create_task(
                self._run(key, rows[start : start + MAX_BATCH])
            )
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)

    async def _run(
        self, key: tuple[str, str], rows: list[tuple[sdk.Context, asyncio.Future[Any]]]
    ) -> None:
        provider, _ = key
        runtime = self._ctx.providers.get(provider)
        results: list[RowResult]
        if runtime is None or runtime.loaded is None:
            why = "not configured" if runtime is None else str(runtime.refusal)
            results = [RowResult.failed(ErrorCode.PROVIDER_UNAVAILABLE, why)] * len(rows)
        else:
            contexts = [context for context, _ in rows]
            results = await self._call_driver(runtime.loaded.driver, key, contexts)
        for (_, future), result in zip(rows, results, strict=True):
            if not future.done():
                future.set_result(result)

    async def _call_driver(
        self, driver: Any, key: tuple[str, str], contexts: list[sdk.Context]
    ) -> list[RowResult]:
        """One driver call of the rows whose attempts have no call past its timeout."""
        provider, method = key
        late_calls = self.in_flight.late_calls(provider)
        if late_calls >= self._max_late_calls:
            why = (
                f"{late_calls} calls of provider {provider} still run past their timeout;"
                " no new call is made: fix the provider, then restart the daemon"
            )
            return [RowResult.failed(ErrorCode.PROVIDER_UNAVAILABLE, why)] * len(contexts)
        late = RowResult.failed(
            PROVIDER_TIMEOUT, "an earlier provider call of this attempt still runs past its timeout"
        )
        held = [method != "stop" and self.in_flight.late(c.attempt_id) for c in contexts]
        sent = [c for c, is_late in zip(contexts, held, strict=True) if not is_late]
        answers = iter(await self._send(driver, key, sent) if sent else [])
        return [late if is_late else next(answers) for is_late in held]

    async def _send(
        self, driver: Any, key: tuple[str, str], contexts: list[sdk.Context]
    ) -> list[RowResult]:
        provider, method = key
        call = self.in_flight.begin(provider, [c.attempt_id for c in contexts])
        try:
            results, self.cpu_seconds[key] = await self._ctx.workers.provider(
                _timed_call,
                driver,
                method,
                contexts,
                timeout=self._timeout,
                on_end=functools.partial(self.in_flight.end, call),
            )
        except TimeoutError:
            self.in_flight.timed_out(call)
            message = f"{method} took longer than {self._timeout}s"
            _log.warning(
                "provider %s: %s (%d rows) took longer than %ss; its thread runs on, and its"
                " attempts get no other provider call and no cleanup until it returns",
                *key,
                len(contexts),
                self._timeout,
            )
            return [RowResult.failed(PROVIDER_TIMEOUT, message)] * len(contexts)
        except Exception as error:  # the thread itself failed
            return [RowResult.failed(ErrorCode.PROVIDER_FAILED, repr(error))] * len(contexts)
        return results


class Cohort:
    """Rows of one request (or one monitor tick) that reach the provider as one call.

    Each member does its own work first (ledger reads, staging, creating its service),
    which takes each a different time, so their provider calls would otherwise land in
    different loop turns and go out one row at a time. A cohort holds the rows of each
    (provider, method) until every member has either queued its row or left, then
    sends them together. Each member takes a `Ticket`, calls through it at most once,
    and closes it when done (`with cohort.ticket() as ticket:`), so a member that
    fails before its call never holds the others back.
    """

    def __init__(self, batcher: Batcher, size: int) -> None:
        self._batcher = batcher
        self._outstanding = size
        self._rows: dict[tuple[str, str], list[tuple[sdk.Context, asyncio.Future[Any]]]] = {}

    def ticket(self) -> Ticket:
        return Ticket(self)

    def _queue(self, provider: str, method: str, context: sdk.Context) -> asyncio.Future[Any]:
        future: asyncio.Future[RowResult] = asyncio.get_running_loop().create_future()
        self._rows.setdefault((provider, method), []).append((context, future))
        self._leave()
        return future

    def _leave(self) -> None:
        self._outstanding -= 1
        if self._outstanding <= 0:
            rows, self._rows = self._rows, {}
            for key, queued in rows.items():
                self._batcher.submit(key, queued)


class Ticket:
    """One member's single use of a `Cohort` (a context manager that leaves on exit)."""

    def __init__(self, cohort: Cohort) -> None:
        self._cohort: Cohort | None = cohort

    async def call(self, provider: str, method: str, context: sdk.Context) -> RowResult:
        cohort, self._cohort = self._cohort, None
        if cohort is None:
            raise RuntimeError("a cohort ticket is used once")
        result: RowResult = await cohort._queue(provider, method, context)
        return result

    def close(self) -> None:
        cohort, self._cohort = self._cohort, None
        if cohort is not None:
            cohort._leave()

    def __enter__(self) -> Ticket:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


def _timed_call(
    driver: Any, method: str, contexts: Sequence[object]
) -> tuple[list[RowResult], float]:
    """`call`, and the CPU seconds it spent in this (worker) thread."""
    began = time.thread_time()
    results = call(driver, method, contexts)
    return results, time.thread_time() - began
