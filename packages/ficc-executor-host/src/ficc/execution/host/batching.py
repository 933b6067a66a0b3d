"""The batcher: provider rows of one turn of the event loop become one provider call.

Every row queued for the same (provider, method) in one turn of the event loop goes
out as one driver call of at most 64 rows (providers.driver.call), bounded by a
timeout. The rows of one request (prepare's probe and prepare, start, release) and of
one monitor tick (observe) are a `Cohort`: held until each of its attempts has queued
its row or dropped out, so they reach the provider as one call although the work
before the call takes each a different time. A timed-out call leaves its rows
uncertain: the runner records `failed` for probe/prepare (no payload can have run),
`unknown` for start/observe, never a replay.

The batcher also keeps, per (provider, method), the CPU seconds its last call spent
in its worker thread (`cpu_seconds`): what the call cost the host, without the time it
waited for a CPU that others (Podman starting, say) were using.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import Any, Final

from ficc.execution.errors import ErrorCode
from ficc.execution.host import sdk
from ficc.execution.host.context import HostContext
from ficc.execution.host.providers.driver import MAX_BATCH, RowResult, call

__all__ = ["PROVIDER_TIMEOUT", "Batcher", "Cohort", "Ticket"]

PROVIDER_TIMEOUT: Final = "provider_timeout"
"""The code of every row of a provider call that took longer than its timeout."""


class Batcher:
    """Coalesces provider rows of one event-loop turn into driver calls of <= 64 rows."""

    def __init__(self, ctx: HostContext, timeout: float) -> None:
        self._ctx = ctx
        self._timeout = timeout
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
        provider, method = key
        runtime = self._ctx.providers.get(provider)
        results: list[RowResult]
        if runtime is None or runtime.loaded is None:
            why = "not configured" if runtime is None else str(runtime.refusal)
            results = [RowResult.failed(ErrorCode.PROVIDER_UNAVAILABLE, why)] * len(rows)
        else:
            contexts = [context for context, _ in rows]
            try:
                results, self.cpu_seconds[key] = await self._ctx.workers.provider(
                    _timed_call, runtime.loaded.driver, method, contexts, timeout=self._timeout
                )
            except TimeoutError:
                message = f"{method} took longer than {self._timeout}s"
                results = [RowResult.failed(PROVIDER_TIMEOUT, message)] * len(rows)
            except Exception as error:  # the thread pool itself failed
                results = [RowResult.failed(ErrorCode.PROVIDER_FAILED, repr(error))] * len(rows)
        for (_, future), result in zip(rows, results, strict=True):
            if not future.done():
                future.set_result(result)


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
