"""Group commit: requests that arrive while one ledger transaction runs share the next.

Renewals come from many controllers at once, each request a transaction of its own
with its own fsync on the one ledger thread, so under load most of a renewal's time is
spent queued behind the others' commits. A `GroupCommit` keeps one drain running per
kind of call: every item submitted while a call is under way waits, and the next call
takes all of them (up to `most`) as one list, in the order they came: one transaction,
one fsync. Each item then gets its own result, or the exception its call raised.

Order and isolation are those of the same requests one after another: the call
applies the items in order inside its transaction, each seeing the ones before it.
Nothing waits for company: an item that arrives while nothing runs goes at once.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

T = TypeVar("T")
R = TypeVar("R")


class GroupCommit(Generic[T, R]):
    """One kind of call (`run`: a list of items to one result per item, in order)."""

    def __init__(self, run: Callable[[list[T]], Awaitable[list[R]]], most: int) -> None:
        self._run = run
        self._most = most
        self._waiting: list[tuple[T, asyncio.Future[R]]] = []
        self._drain: asyncio.Task[None] | None = None

    async def submit(self, item: T) -> R:
        """`item`'s result, from the first call that takes it."""
        future: asyncio.Future[R] = asyncio.get_running_loop().create_future()
        self._waiting.append((item, future))
        if self._drain is None or self._drain.done():
            self._drain = asyncio.create_task(self._drained())
        return await future

    async def close(self) -> None:
        """Stop the drain (the daemon stops): what waits is cancelled, not committed."""
        if self._drain is not None and not self._drain.done():
            self._drain.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._drain

    async def _drained(self) -> None:
        try:
            while self._waiting:
                # A submitter that gave up (its request was cancelled) is never committed.
                live = [(item, future) for item, future in self._waiting if not future.done()]
                taken, self._waiting = live[: self._most], live[self._most :]
                if taken:
                    await self._call(taken)
        finally:  # cancelled (the daemon stops): nobody is left waiting for ever
            for _, future in self._waiting:
                future.cancel()

    async def _call(self, taken: list[tuple[T, asyncio.Future[R]]]) -> None:
        try:
            results = await self._run([item for item, _ in taken])
            if len(results) != len(taken):
                raise RuntimeError(f"{len(results)} results for {len(taken)} items")
        except BaseException as error:
            for _, future in taken:
                if future.done():
                    continue
                if isinstance(error, Exception):
                    future.set_exception(error)
                else:
                    future.cancel()
            if not isinstance(error, Exception):
                raise
            return
        for (_, future), result in zip(taken, results, strict=True):
            if not future.done():  # its submitter may have been cancelled
                future.set_result(result)
