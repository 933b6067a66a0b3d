"""What every part of the running daemon shares: its parts and where each may run.

The daemon is one asyncio loop plus three kinds of worker threads, and which work
runs where is the concurrency design:

- `db`: ONE thread owns the SQLite ledger. Every ledger call goes through it, so
  transactions never interleave and the loop never waits on fsync. Renewals, which
  many controllers send at once, go through a group commit (group_commit.py, kept in
  `HostContext.groups`): those that arrive while one commits share the next
  transaction and its one fsync.
- `io`: a small pool for file I/O (staging writes, collect reads, layout), outside any
  lock the monitor needs; staging's own per-attempt guard gives `input_busy`. Work
  that must read the ledger first and files next (collect) goes from the ledger
  thread straight to this pool (`db_then_io`), without a return to the loop between.
- `provider`: provider batch calls, which are synchronous and may be slow: each in a
  thread of its own, at most a few at once, each bounded by a timeout counted from
  when it starts. A call that times out leaves its rows' outcome uncertain (never a
  reason to replay); its thread runs on (Python cannot kill it) but no longer counts
  against the bound, so a provider that hangs cannot starve the calls after it.

The handlers (requests) and the runner (asynchronous work after a reply) both take a
`HostContext`; `daemon/root.py` builds it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable
from typing import Any, TypeVar

from ficc.execution.host.config.model import Config
from ficc.execution.host.context.build import Build, capture
from ficc.execution.host.context.group_commit import GroupCommit
from ficc.execution.host.context.lanes import Lane, Spares, ToLoop
from ficc.execution.host.context.slot_health import SlotHealth
from ficc.execution.host.core.errors import HostError
from ficc.execution.host.ledger.store import Ledger
from ficc.execution.host.linux.clock import BootClock
from ficc.execution.host.providers.loader import LoadedProvider
from ficc.execution.host.service.interface import SystemService
from ficc.execution.host.storage.slot_files import SlotFiles
from ficc.execution.host.storage.staging import Stager

_log = logging.getLogger(__name__)

T = TypeVar("T")
U = TypeVar("U")

PROVIDER_CALL_TIMEOUT_S = 300.0
"""Longest a provider batch call may take before its rows count as uncertain."""


@dataclasses.dataclass(frozen=True)
class SlotRuntime:
    """A configured slot, its attempt files and the stager on its reserved filesystem."""

    id: str
    slot_class: str
    path: str
    uid: int
    gid: int
    storage_bytes: int
    storage_inodes: int
    filesystem_uuid: str
    stager: Stager
    files: SlotFiles
    """The attempt directories on the slot (the daemon's is `ReservedSlot`)."""


@dataclasses.dataclass(frozen=True)
class ProviderRuntime:
    """A configured provider: loaded and verified, or the refusal that keeps it off."""

    id: str
    package_digest: str
    loaded: LoadedProvider | None
    refusal: HostError | None


class Workers:
    """The three executors of the daemon (see the module docstring)."""

    def __init__(self, io_threads: int = 4, provider_threads: int = 4) -> None:
        self._db = Lane(1, "ficc-db")
        self._io = Lane(io_threads, "ficc-io")
        self._provider_threads = provider_threads
        self._providers = Spares(provider_threads, "ficc-provider")
        self._provider_slots: tuple[asyncio.AbstractEventLoop, asyncio.Semaphore] | None = None

    async def db(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run one ledger call on the ledger thread."""
        return await self._db.run(fn, *args, **kwargs)

    def db_blocking(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run one ledger call on the ledger thread and wait for it, from another thread.

        Why: `Stager.write` calls its `commit` from an io thread
        while holding the attempt's write guard; the commit must still run on the one
        ledger thread. Never call this from the ledger thread or the event loop.
        """
        return self._db.call(fn, *args, **kwargs)

    async def io(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run blocking file I/O off the loop."""
        return await self._io.run(fn, *args, **kwargs)

    async def db_then_io(self, lookup: Callable[[], U], then: Callable[[U], T]) -> T:
        """`then(lookup())`: `lookup` on the ledger thread, `then` in an I/O thread.

        Why: awaiting `db` and then `io` wakes the event loop in between only to hand
        the result on: two thread round trips of about 0.1 ms each on a small VM, for
        a request (a 1 MiB collect) of about 2 ms. Here the ledger thread queues
        `then` itself (it never waits on the I/O), and the loop wakes once, with the
        outcome. An exception from either step is raised here, as is a RuntimeError
        when a step's threads shut down before it ran; a cancelled caller stops
        `lookup` only if it has not started.
        """
        loop = asyncio.get_running_loop()
        outcome: asyncio.Future[T] = loop.create_future()
        answer = ToLoop(loop, outcome)
        io = self._io

        def first(answer: ToLoop[T]) -> None:
            io.submit(then, (lookup(),), {}, _Step(answer, "I/O", results=True))

        self._db.submit(first, (answer,), {}, _Step(answer, "ledger", results=False))
        try:
            return await outcome
        finally:
            del outcome, answer  # a raised exception's traceback would hold them

    async def provider(
        self,
        fn: Callable[..., T],
        *args: Any,
        timeout: float = PROVIDER_CALL_TIMEOUT_S,
        on_end: Callable[[], None] | None = None,
        **kwargs: Any,
    ) -> T:
        """Run one provider batch call in a thread of its own, once fewer than
        `provider_threads` calls run, bounded by `timeout` from then (TimeoutError).

        A timed-out call keeps running in its thread (Python cannot kill it) but frees
        its place at once; the caller must treat the rows' outcome as uncertain.
        `on_end` runs exactly once when the call is over: in its thread once `fn`
        returned or raised, or here if the call was never made.
        """
        started = False
        try:
            async with self._provider_slot():
                loop = asyncio.get_running_loop()
                outcome: asyncio.Future[T] = loop.create_future()
                call = (fn, args, kwargs, on_end)
                self._providers.submit(_ending, call, {}, _Provided(loop, outcome, on_end))
                started = True
                try:
                    # wait_for, not asyncio.timeout: an answer already on its way when the
                    # deadline passes (the loop was late) still counts.
                    return await asyncio.wait_for(outcome, timeout)
                except TimeoutError:
                    # Python 3.12's wait_for is asyncio.timeout inside: the same rule.
                    if outcome.done() and not outcome.cancelled():
                        return outcome.result()
                    raise
                finally:
                    del outcome  # a raised exception's traceback would hold it
        finally:
            if not started:
                _ended(on_end)

    def _provider_slot(self) -> asyncio.Semaphore:
        """The bound on running provider calls, for the running loop."""
        loop = asyncio.get_running_loop()
        if self._provider_slots is None or self._provider_slots[0] is not loop:
            self._provider_slots = (loop, asyncio.Semaphore(self._provider_threads))
        return self._provider_slots[1]

    def shutdown(self) -> None:
        """Stop the ledger and I/O threads; provider calls still running are left to
        end with the process (every provider call is safe to cut off: a restart never
        replays work whose outcome it does not know)."""
        for lane in (self._io, self._db):
            lane.shutdown(wait=True)
        self._providers.shutdown()


class _Step:
    """One step of `db_then_io`: passes the step's refusal (and, for the last step,
    its result) to the caller, and a step that will never run as a RuntimeError."""

    __slots__ = ("answer", "results", "threads")

    def __init__(self, answer: ToLoop[Any], threads: str, *, results: bool) -> None:
        self.answer, self.threads, self.results = answer, threads, results

    def wanted(self) -> bool:
        return self.answer.wanted()

    def give(self, result: Any, error: BaseException | None) -> None:
        if error is not None or self.results:
            self.answer.give(result, error)

    def cancel(self) -> None:
        message = f"the {self.threads} threads shut down before the call ran"
        self.answer.give(None, RuntimeError(message))


class _Provided(ToLoop[Any]):
    """The answer of a provider call: one never made (its caller timed out or was
    cancelled before a thread took it) still runs `on_end`."""

    __slots__ = ("on_end",)

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        future: asyncio.Future[Any],
        on_end: Callable[[], None] | None,
    ) -> None:
        super().__init__(loop, future)
        self.on_end = on_end

    def wanted(self) -> bool:
        if super().wanted():
            return True
        _ended(self.on_end)
        return False


def _ending(
    fn: Callable[..., T],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    on_end: Callable[[], None] | None,
) -> T:
    """A provider call, then `on_end` (so whoever sees its result also sees it over)."""
    try:
        return fn(*args, **kwargs)
    finally:
        _ended(on_end)


def _ended(on_end: Callable[[], None] | None) -> None:
    """Run `on_end`; its failure is logged and changes nothing of the call's outcome."""
    if on_end is None:
        return
    try:
        on_end()
    except Exception:
        _log.exception("the end of a provider call could not be noted")


@dataclasses.dataclass
class HostContext:
    """The daemon's parts, shared by handlers and the runner."""

    config: Config
    ledger: Ledger
    clock: BootClock
    slots: dict[str, SlotRuntime]
    providers: dict[str, ProviderRuntime]
    service: SystemService
    workers: Workers
    groups: dict[str, GroupCommit[Any, Any]] = dataclasses.field(default_factory=dict)
    """The group commits of the handlers, by kind of request (made on first use)."""
    build: Build = dataclasses.field(default_factory=capture)
    """What the daemon runs, read once when its context is made (before it serves)."""
    slot_health: SlotHealth = dataclasses.field(default_factory=SlotHealth)
    """Each slot's health: a broken slot is out of the offer until it passes again."""
