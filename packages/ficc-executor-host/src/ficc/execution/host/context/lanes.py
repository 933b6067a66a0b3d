"""A lane: worker threads that run the event loop's blocking calls, in order of arrival.

The daemon hops to its ledger thread and its I/O threads thousands of times a second
(every ledger read or write, every file it looks at). `loop.run_in_executor` pays for
each hop with a `concurrent.futures.Future` (a lock and a condition of its own), a
second future chained to it, a check that the callable is no coroutine function and
the pool's thread accounting: a fifth of the event loop's busy time in a profile of
the daemon running short jobs, four times the cost of the hop itself. A lane hands
(call, answer) to its threads through one `queue.SimpleQueue` and answers the loop
with one `call_soon_threadsafe`.

What a caller sees is what `run_in_executor` gives: the call's result or its
exception; a caller cancelled before its call starts keeps the call from running (one
already running runs on, its result dropped); after `shutdown` no call is accepted
(RuntimeError), and calls still queued then are cancelled.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import queue
import threading
from collections.abc import Callable
from typing import Any, Generic, Protocol, TypeVar

T = TypeVar("T")
__all__ = ["Answer", "Lane", "Spares", "ToLoop"]


class Answer(Protocol):
    """Where a call's outcome goes."""

    def wanted(self) -> bool:
        """Whether the call should still run (False: its caller is gone); once."""

    def give(self, result: Any, error: BaseException | None) -> None:
        """The call's result, or the exception it raised."""

    def cancel(self) -> None:
        """The call will never run: the lane shut down first."""


class ToLoop(Generic[T]):
    """An answer for a coroutine awaiting `future` on `loop`."""

    __slots__ = ("future", "loop")

    def __init__(self, loop: asyncio.AbstractEventLoop, future: asyncio.Future[T]) -> None:
        self.loop, self.future = loop, future

    def wanted(self) -> bool:
        return not self.future.cancelled()  # a plain read of the future's state

    def give(self, result: Any, error: BaseException | None) -> None:
        self._on_loop(_settle, self.future, result, error)

    def cancel(self) -> None:
        self._on_loop(_cancel, self.future)

    def _on_loop(self, fn: Callable[..., None], *args: Any) -> None:
        with contextlib.suppress(RuntimeError):  # a closed loop: nobody waits any more
            self.loop.call_soon_threadsafe(fn, *args)


class _ToThread:
    """An answer for a thread blocked on `future`."""

    __slots__ = ("future",)

    def __init__(self, future: concurrent.futures.Future[Any]) -> None:
        self.future = future

    def wanted(self) -> bool:
        return self.future.set_running_or_notify_cancel()

    def give(self, result: Any, error: BaseException | None) -> None:
        if error is None:
            self.future.set_result(result)
        else:
            self.future.set_exception(error)

    def cancel(self) -> None:
        self.future.cancel()


def _settle(future: asyncio.Future[Any], result: Any, error: BaseException | None) -> None:
    if future.cancelled():
        return
    if error is None:
        future.set_result(result)
    elif isinstance(error, StopIteration):  # a future refuses it, as a coroutine would
        future.set_exception(RuntimeError(f"the call raised StopIteration: {error!r}"))
    else:
        future.set_exception(error)


def _cancel(future: asyncio.Future[Any]) -> None:
    future.cancel()


def _run_one(
    fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], answer: Answer
) -> None:
    if not answer.wanted():
        return
    try:
        result = fn(*args, **kwargs)
    except BaseException as error:  # the caller's to judge, as any exception
        answer.give(None, error)
        # The exception's traceback holds this frame: let go of the call's arguments
        # (an input chunk, say) now, not when the cyclic collector finds them.
        fn = args = kwargs = answer = None  # type: ignore[assignment]
    else:
        answer.give(result, None)


_Item = tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any], Answer]


class Lane:
    """`threads` worker threads named `name_0`, `name_1`, ..., started on first use."""

    def __init__(self, threads: int, name: str) -> None:
        self._size, self._name = threads, name
        self._queue: queue.SimpleQueue[_Item | None] = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._closed = False

    async def run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """`fn(*args, **kwargs)` in one of the lane's threads."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()
        self.submit(fn, args, kwargs, ToLoop(loop, future))
        try:
            return await future
        finally:
            del future  # else a raised exception's traceback and the future hold each other

    def call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """`fn(*args, **kwargs)` in one of the lane's threads, waited for here (from a
        thread that is not the lane's own: it would wait for itself)."""
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        self.submit(fn, args, kwargs, _ToThread(future))
        return future.result()

    def submit(
        self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], answer: Answer
    ) -> None:
        """Queue one call; `answer` gets its outcome (from the lane's thread)."""
        with self._lock:  # against `shutdown`: a call queued after its sweep would hang
            if self._closed:
                raise RuntimeError(f"the {self._name} threads are shut down; no call is accepted")
            if not self._threads:
                self._start()
            self._queue.put((fn, args, kwargs, answer))

    def _start(self) -> None:
        for n in range(self._size):
            thread = threading.Thread(target=self._work, name=f"{self._name}_{n}", daemon=True)
            thread.start()
            self._threads.append(thread)

    def _work(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            _run_one(*item)
            del item  # an idle thread keeps nothing of the last call alive

    def shutdown(self, *, wait: bool = True) -> None:
        """Accept no more calls, cancel those still queued, stop the threads (and wait
        for the calls running in them, when `wait`)."""
        with self._lock:
            self._closed = True
            threads = list(self._threads)
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if item is not None:
                item[3].cancel()
        for _ in threads:
            self._queue.put(None)
        if wait:
            for thread in threads:
                thread.join()


class Spares:
    """A thread of its own for each call, and up to `keep` finished threads kept for
    the next calls (named `name`).

    For calls that may hang past their timeout (provider calls): on a fixed pool they
    would queue behind each other, so each gets a thread of its own; but starting a
    thread costs a round trip with it (`Thread.start` waits until it runs), and a
    thread that has finished its call can take the next one as well.
    """

    def __init__(self, keep: int, name: str) -> None:
        self._keep, self._name = keep, name
        self._idle: list[queue.SimpleQueue[_Item | None]] = []
        self._lock = threading.Lock()
        self._closed = False

    def submit(
        self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], answer: Answer
    ) -> None:
        """Run one call in a spare thread, or in a new one when none is idle."""
        with self._lock:
            inbox = self._idle.pop() if self._idle else None
        if inbox is None:  # (after `shutdown` too: the new thread ends after its call)
            inbox = queue.SimpleQueue()
            thread = threading.Thread(
                target=self._work, args=(inbox,), name=self._name, daemon=True
            )
            thread.start()
        inbox.put((fn, args, kwargs, answer))

    def _work(self, inbox: queue.SimpleQueue[_Item | None]) -> None:
        while (item := inbox.get()) is not None:
            kept = _IdleBeforeAnswer(self, inbox, item[3])
            _run_one(item[0], item[1], item[2], kept)
            del item
            if not kept.idle_again():
                return

    def _offer_idle(self, inbox: queue.SimpleQueue[_Item | None]) -> bool:
        """Keep this finished thread for the next call, if there is room for it."""
        with self._lock:
            if self._closed or len(self._idle) >= self._keep:
                return False
            self._idle.append(inbox)
            return True

    def shutdown(self) -> None:
        """End the idle threads; a call still running ends its thread when it returns
        (nobody waits for it: such a call may hang)."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for inbox in idle:
            inbox.put(None)


class _IdleBeforeAnswer:
    """A spare thread's answer that marks the thread idle before the answer goes out.

    The caller may submit its next call as soon as it has the answer; were the thread
    marked idle only afterwards, that call would find none idle and start a thread.
    """

    __slots__ = ("_answer", "_inbox", "_kept", "_spares")

    def __init__(
        self, spares: Spares, inbox: queue.SimpleQueue[_Item | None], answer: Answer
    ) -> None:
        self._spares, self._inbox, self._answer = spares, inbox, answer
        self._kept: bool | None = None

    def wanted(self) -> bool:
        return self._answer.wanted()

    def cancel(self) -> None:
        self._answer.cancel()

    def give(self, result: Any, error: BaseException | None) -> None:
        self.idle_again()
        self._answer.give(result, error)

    def idle_again(self) -> bool:
        """Whether the thread is kept for the next call (decided once)."""
        if self._kept is None:
            self._kept = self._spares._offer_idle(self._inbox)
        return self._kept
