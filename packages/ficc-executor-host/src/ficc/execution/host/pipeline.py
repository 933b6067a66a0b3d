"""The runner: the asynchronous work on an attempt after a handler has replied.

Handlers record decisions durably and reply; the `Runner` then does what takes time
(docs/architecture.md), always through `ctx.workers` so the event loop never
blocks, and records every outcome in the ledger as a lifecycle event:

- prepare: the attempt layout, staging of streamed inputs, then provider `probe`
  and `prepare` (with `check()`); the result is validated (expectation.py) and
  persisted with `PrepareOk` before anything uses it.
- start: staged inputs re-verified, the system service created with the provider's
  argv as the slot account and the plan's limits, controls read back, provider
  `start`, `observe` until the barrier's PID, the device-open results checked, the
  payload gate run, and only on a pass the release marker written (`Started`).
- the monitor (monitor.py) drives expiry, stops, observation and cleanup through
  the `MonitorOps` methods below; each tick also hands moved lease deadlines to the
  lease reaper (service/reaper.py), which stops a service at its deadline even when
  this daemon is dead or hung. A start that fails once its lease has run out is left
  to the monitor, which records the expiry (the reaper may have ended the service).
- release and startup recovery.

Provider calls go through `_Batcher`: every row queued for the same (provider,
method) in one turn of the event loop goes out as one driver call of at most 64 rows
(providers.driver.call), bounded by a timeout. The rows of one request (prepare's
probe and prepare, start, release) and of one monitor tick (observe) are a `Cohort`:
held until each of its attempts has queued its row or dropped out, so they reach the
provider as one call although the work before the call takes each a different time.
A timed-out call leaves its rows uncertain: `failed` for probe/prepare (no payload can
have run), `unknown` for start/observe, never a replay.

Decisions (see also docs/operations.md):
- `check()` (prepare) passes while the record is still `prepared`, its lease is
  current and the offer is not `stopped` (paused keeps leases alive, so preparation
  may go on). A refusal by check() is recorded as ITS code (e.g. `lease_expired`),
  not as the provider's error that wraps it.
- Failure reasons: `probe_failed`, `provider_failed`, `provider_timeout`,
  `provider_malformed` (invalid result), `provider_unavailable`, staging and layout
  codes as they come, the first gate failure code (`gate_*`), `service_*` codes.
- A stop or expiry arriving while the start pipeline runs is handed to it: it stops
  the service and returns; the monitor then records `Stopped` (cancelled/expired).
  The release marker is never written once a stop is pending or the lease is gone.
- Start authority is checked again in the ledger right before the marker is written
  (`Ledger.authorize_release`): an offer paused, stopped or drained since the start
  was accepted, or one that no longer covers the attempt, ends it `cancelled`
  (reason `offer_closed` / `offer_changed`) and the payload is never released.
- The barrier exiting before release is `failed` (`barrier_exited`): the payload
  cannot have run.
- Device-open results are taken from the latest `ready` or `payload` observation.
- Outcome cross-check: when the service knows its main process's exit status (not
  after an adoption) and it differs from the provider's `finished` exit code, the
  outcome is `unknown` (`outcome_conflict`). A running attempt whose service tree is
  empty while the provider reports no exit is `unknown` (`outcome_unreadable`).
- Restart (`recover`): the ledger turns starting/running into unknown and in-flight
  preparations into failed; every settled attempt without confirmed cleanup has its
  service adopted by name, stopped and checked idle. Prepared attempts whose streams
  are all complete but whose provider preparation never began are prepared again
  (nothing was called yet, so this is no replay). No payload is ever restarted.

What the runner needs of a service backend beyond starting and stopping a service:
`planned_supervisor_cgroup(name)` (the prepare context's cgroup, known before the
service exists), `planned_cgroups(name)` (what the lease reaper kills at the deadline,
handed to it before the service exists) and `account_idle(uid)` (cleanup of an
attempt that never had a service).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import os
import posixpath
import time
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, Final, TypeVar

import msgspec

from ficc.execution import plan as planlib
from ficc.execution.errors import ErrorCode
from ficc.execution.host import gate, layout, leases, lifecycle, metrics, procfs, sdk, slotfs
from ficc.execution.host.config import open_image_parent
from ficc.execution.host.context import PROVIDER_CALL_TIMEOUT_S, HostContext, SlotRuntime
from ficc.execution.host.errors import HostError
from ficc.execution.host.expectation import (
    DEFAULT_NOFILE,
    PrepareResult,
    build_expectation,
    check_device_opens,
    check_prepare_result,
    decode_prepare_result,
    device_rules,
)
from ficc.execution.host.handlers import ceiling_limits
from ficc.execution.host.layout import RELEASE_MARKER, AttemptPaths, provider_context, service_name
from ficc.execution.host.ledger import OFFER_ALLOWS, AttemptRecord
from ficc.execution.host.monitor import TICK_SECONDS, Monitor
from ficc.execution.host.providers.driver import MAX_BATCH, RowResult, call
from ficc.execution.host.sdk import DeviceOpen, Observation
from ficc.execution.host.service import reaper
from ficc.execution.host.service.interface import Controls, ServiceHandle, ServiceSpec
from ficc.execution.host.staging import StreamState

__all__ = ["RELEASE_MARKER", "Runner", "Settings"]

_log = logging.getLogger(__name__)

"""Name of the release marker in the attempt's `control/` directory."""
PROVIDER_TIMEOUT: Final = "provider_timeout"
INTERNAL_ERROR: Final = "internal_error"
"""A bug in the host, not a refusal: the attempt fails closed and is cleaned up."""
NO_RESOURCE_REASONS: Final = frozenset(
    {lifecycle.ADMISSION_REJECTED, lifecycle.LEGACY_ABSENCE_ACKNOWLEDGED}
)
LIVE_STATES: Final = frozenset({"starting", "running"})
_R = TypeVar("_R", bound=msgspec.Struct)
SERVICE_ENVIRONMENT: Final = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8"}
"""The complete environment of the provider argv: nothing is inherited."""


@dataclasses.dataclass(frozen=True)
class Settings:
    """Timing and host policy of the runner (the daemon may take them from config)."""

    tick: float = TICK_SECONDS
    provider_timeout: float = PROVIDER_CALL_TIMEOUT_S
    start_timeout: float = 120.0
    """How long start waits for the barrier's PID."""
    observe_interval: float = 0.01
    rescan_ticks: int = 25
    """Every this many ticks the monitor reads every record, not just the watched ones."""
    nofile: int = DEFAULT_NOFILE
    user_namespace: bool = True
    cgroup_namespace: bool = True


# --- provider replies ---------------------------------------------------------------


def _observation(result: RowResult) -> Observation:
    if result.reply is None:
        raise HostError(result.code or ErrorCode.PROVIDER_FAILED, result.message or "")
    return _decoded(result, "observe", Observation)


def _decoded(result: RowResult, method: str, kind: type[_R]) -> _R:
    """A row's reply as its SDK Struct, or `provider_malformed`."""
    try:
        return sdk.decode_reply(method, result.reply, kind)
    except (msgspec.ValidationError, ValueError) as error:
        raise HostError("provider_malformed", f"{method} returned {error}") from error


MAX_OBSERVATION_PAUSE = 0.25
"""The longest wait between observations of a start waiting for its payload."""


def observation_pause(interval: float, last_cost: float) -> float:
    """How long waiting starts pause before they observe again.

    Observing many attempts costs more per call, so the pause grows with the last
    call's duration (observation then takes at most a fifth of a thread); it never
    exceeds MAX_OBSERVATION_PAUSE, so one slow provider call (a full worker pool, a
    timeout) cannot push every waiting start towards its start deadline.
    """
    return min(max(interval, 4 * last_cost), max(interval, MAX_OBSERVATION_PAUSE))


class _Uncertain(Exception):
    """The outcome of a possibly started attempt cannot be known (OutcomeLost)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class _Aborted(Exception):
    """A stop became pending during start: the monitor records it."""


# --- batching provider rows ---------------------------------------------------------


class _Batcher:
    """Coalesces provider rows of one event-loop turn into driver calls of <= 64 rows."""

    def __init__(self, ctx: HostContext, timeout: float) -> None:
        self._ctx = ctx
        self._timeout = timeout
        self._pending: dict[tuple[str, str], list[tuple[sdk.Context, asyncio.Future[Any]]]] = {}
        self.tasks: set[asyncio.Task[None]] = set()

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
                results = await self._ctx.workers.provider(
                    call, runtime.loaded.driver, method, contexts, timeout=self._timeout
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

    def __init__(self, batcher: _Batcher, size: int) -> None:
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


# --- one attempt, as the runner sees it ---------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Attempt:
    record: AttemptRecord
    plan: planlib.Plan
    slot: SlotRuntime
    layout: layout.Layout
    paths: AttemptPaths
    service: str

    @property
    def id(self) -> str:
        return self.record.attempt_id

    @property
    def provider(self) -> str:
        return self.plan.job.runtime.provider


def _row_error(result: RowResult, method: str) -> HostError:
    code = result.code or ErrorCode.PROVIDER_FAILED
    if code not in (PROVIDER_TIMEOUT, ErrorCode.PROVIDER_UNAVAILABLE):
        code = "probe_failed" if method == "probe" else ErrorCode.PROVIDER_FAILED
    return HostError(code, f"provider {method}: {result.message or 'no reply'}")


class Runner:
    """Prepare, start, monitor, release and recover attempts (see the module docstring)."""

    def __init__(
        self,
        ctx: HostContext,
        *,
        settings: Settings | None = None,
        on_tick: Callable[[], None] | None = None,
    ) -> None:
        self._ctx = ctx
        self._settings = settings or Settings()
        self._batcher = _Batcher(ctx, self._settings.provider_timeout)
        self._monitor = Monitor(self, interval=self._settings.tick, on_tick=on_tick)
        self._tasks: set[asyncio.Task[Any]] = set()
        self._exit_watches: set[int] = set()
        """pidfds of released services' main processes (see `_wake_on_exit`)."""
        self._preparing: set[str] = set()
        self._again: set[str] = set()
        self._closing = False
        self._starting: dict[str, asyncio.Task[None]] = {}
        self._abort: set[str] = set()
        self._handles: dict[str, ServiceHandle] = {}
        self._watch: set[str] = set()
        self._ticks = 0
        self._reaper: reaper.Keeper | None = None
        self._deadlines: dict[str, tuple[str, int]] = {}
        """attempt ID -> (service, lease deadline) as last written for the reaper."""
        self._deadline_lock = asyncio.Lock()
        self._beat: asyncio.Future[None] | None = None
        """The next shared observation instant of starts (see `_next_observation`)."""
        self._observe_cost = 0.0
        """Seconds the last observe call of a waiting start took."""

    # --- the contract with the handlers -------------------------------------------

    def admitted(self, attempt_ids: Sequence[str]) -> None:
        self._watch.update(attempt_ids)
        self._spawn(self._prepare_all(list(attempt_ids)))

    def inputs_complete(self, attempt_id: str) -> None:
        self._spawn(self._prepare_all([attempt_id]))

    def start_requested(self, attempt_ids: Sequence[str]) -> None:
        self._watch.update(attempt_ids)
        # one already in the pipeline is left alone: a second start never starts twice
        fresh = [a for a in dict.fromkeys(attempt_ids) if a not in self._starting]
        cohort = self._batcher.cohort(len(fresh))
        for attempt_id in fresh:
            task = self._spawn(self._start(attempt_id, cohort.ticket()))
            self._starting[attempt_id] = task
            task.add_done_callback(functools.partial(self._start_done, attempt_id))

    def stop_requested(self, attempt_ids: Sequence[str]) -> None:
        self._watch.update(attempt_ids)
        self._monitor.wake()

    async def release(self, attempt_id: str) -> None:
        (outcome,) = await self.release_batch([attempt_id])
        if outcome is not None:
            raise outcome

    async def release_batch(self, attempt_ids: Sequence[str]) -> list[HostError | None]:
        """Release these attempts together (one provider call where they share a
        provider); per attempt, None or the HostError that kept its resources."""
        cohort = self._batcher.cohort(len(attempt_ids))
        outcomes = await asyncio.gather(
            *(self._release_one(a, cohort.ticket()) for a in attempt_ids),
            return_exceptions=True,
        )
        for outcome in outcomes:
            if isinstance(outcome, BaseException) and not isinstance(outcome, HostError):
                raise outcome
        return [o if isinstance(o, HostError) else None for o in outcomes]

    async def _release_one(self, attempt_id: str, ticket: Ticket) -> None:
        with ticket:
            await self._release_resources(attempt_id, ticket)

    async def _release_resources(self, attempt_id: str, ticket: Ticket) -> None:
        record = await self._db(self._ctx.ledger.get, attempt_id)
        if record is None:
            raise HostError(ErrorCode.UNKNOWN_ATTEMPT, "no such attempt")
        if record.slot_id is None or record.status.reason in NO_RESOURCE_REASONS:
            return
        attempt = await self._attempt(record)
        context = await self._later_context(attempt)  # the binding, verified while it exists
        # What the payload wrote goes first, so a full slot leaves room for the provider.
        await self._io(attempt.layout.free_payload_data, attempt.id)
        result = await ticket.call(attempt.provider, "release", context)
        if not result.ok:
            raise _row_error(result, "release")
        _decoded(result, "release", sdk.ReleaseReply)
        await self._io(attempt.slot.stager.remove_attempt, attempt.id)
        await self._io(attempt.layout.remove, attempt.id)
        handle = self._handles.pop(attempt.id, None) or await self._io(
            self._ctx.service.adopt, attempt.service
        )
        if handle is not None:
            await self._io(self._ctx.service.remove, handle)
        self._watch.discard(attempt.id)

    async def recover(self) -> None:
        """Startup, before the server listens (see the module docstring)."""
        await self._db(self._ctx.ledger.mark_restarted)
        records = await self._all_records()
        self._watch.update(r.attempt_id for r in records if self._needs_watch(r))
        unclean = [
            r for r in records if r.status.state in lifecycle.SETTLED and r.slot_id is not None
        ]
        await _gather_logged(self.cleanup(r) for r in unclean if not r.status.cleanup_confirmed)
        prepared = [r for r in records if r.status.state == "prepared"]
        # A ready attempt's inputs are complete, but this new Stager does not know them:
        # re-register and re-verify them before the server listens, so a start finds
        # them staged (and a file changed while the daemon was down fails the attempt).
        await _gather_logged(self._restage(r) for r in prepared if r.status.ready)
        staged = [r.attempt_id for r in prepared if not r.status.ready and not r.status.preparing]
        if staged:
            self._spawn(self._prepare_all(staged))

    async def run(self) -> None:
        await self._monitor.run()

    async def close(self) -> None:
        """Cancel every task of this runner (a provider call already in a thread runs on)."""
        self._closing = True
        for fd in list(self._exit_watches):
            self._unwatch(fd)
        tasks = [*self._tasks, *self._batcher.tasks]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    @property
    def monitor(self) -> Monitor:
        return self._monitor

    # --- plumbing -----------------------------------------------------------------

    def _spawn(self, job: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        """A background task, kept referenced until done (cancelled by `close`)."""
        task = asyncio.get_running_loop().create_task(job)
        self._tasks.add(task)
        task.add_done_callback(self._finished_task)
        return task

    def _finished_task(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            _log.error("runner task failed: %r", task.exception())

    def _start_done(self, attempt_id: str, _: object) -> None:
        self._starting.pop(attempt_id, None)
        self._abort.discard(attempt_id)
        self._monitor.wake()

    async def _db(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await self._ctx.workers.db(fn, *args)

    async def _io(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await self._ctx.workers.io(fn, *args)

    async def _apply(self, record: AttemptRecord, event: lifecycle.AnyEvent) -> bool:
        """Record an event; False (logged) when the lifecycle refuses it."""
        try:
            await self._db(self._ctx.ledger.apply, record.fence, event)
        except HostError as error:
            _log.info("attempt %s: %s not recorded (%s)", record.attempt_id, event.name, error)
            return False
        if event.name in ("prepare_failed", "start_failed", "outcome_lost", "finished"):
            self._monitor.wake()
        return True

    async def _refused(
        self, record: AttemptRecord, event: lifecycle.AnyEvent, error: HostError
    ) -> None:
        """Record a failure; the ledger keeps only its code, so the operator's log gets
        the message that says what went wrong (a provider's refusal text, say)."""
        _log.warning("attempt %s: %s: %s", record.attempt_id, event.name, error)
        await self._apply(record, event)

    def lease_current(self, record: AttemptRecord) -> bool:
        lease = record.lease
        return lease is not None and leases.is_current(lease, self._ctx.clock.now())

    async def _attempt(self, record: AttemptRecord) -> _Attempt:
        data = await self._db(self._ctx.ledger.plan_bytes, record.attempt_id)
        plan = planlib.decode_plan(data)
        if record.slot_id is None or record.slot_id not in self._ctx.slots:
            raise HostError("slot_unknown", f"attempt {record.attempt_id} holds no configured slot")
        slot = self._ctx.slots[record.slot_id]
        place = layout.Layout(slot)
        name = service_name(self._ctx.config.installation_id, record.attempt_id)
        return _Attempt(record, plan, slot, place, place.paths(record.attempt_id), name)

    def _context(
        self,
        attempt: _Attempt,
        storage: sdk.StorageBinding,
        inputs: Sequence[sdk.InputCapability] = (),
        prepared: sdk.PrepareResult | None = None,
    ) -> sdk.Context:
        """The provider context of the contract (prepare adds `check`; later ones `prepared`)."""
        return provider_context(
            plan=attempt.plan,
            plan_digest=attempt.record.plan_digest,
            slot=attempt.slot,
            paths=attempt.paths,
            service=attempt.service,
            cgroup=self._ctx.service.planned_supervisor_cgroup(attempt.service),
            backend=self._ctx.service.backend,
            storage=storage,
            inputs=inputs,
            prepared=prepared,
        )

    async def _later_context(
        self,
        attempt: _Attempt,
        *,
        verify: bool = False,
        inputs: Sequence[sdk.InputCapability] = (),
    ) -> sdk.Context:
        """Context for start/observe/stop/release: with the persisted prepared result and
        the verified storage binding. With `verify` (start) a binding that cannot be
        verified refuses; otherwise (stopping, cleaning up) the context falls back to
        the storage path alone, so cleanup never waits on a damaged layout."""
        data = await self._db(self._ctx.ledger.prepare_result, attempt.id)
        prepared = None if data is None else msgspec.json.decode(data, type=sdk.PrepareResult)
        try:
            storage = await self._io(_verified_storage, attempt)
        except (HostError, OSError) as error:
            if verify:
                raise
            _log.warning("attempt %s: storage binding not verified: %s", attempt.id, error)
            storage = sdk.StorageBinding(path=attempt.paths.storage)
        return self._context(attempt, storage, inputs, prepared)

    # --- prepare ------------------------------------------------------------------

    async def _prepare_all(self, attempt_ids: list[str]) -> None:
        """Prepare attempts; one already being prepared is looked at again afterwards
        (its last input may have completed after it found the inputs incomplete)."""
        wanted = list(dict.fromkeys(attempt_ids))
        self._again.update(a for a in wanted if a in self._preparing)
        fresh = [a for a in wanted if a not in self._preparing]
        self._preparing.update(fresh)
        probes, prepares = self._batcher.cohort(len(fresh)), self._batcher.cohort(len(fresh))
        try:
            await _gather_logged(
                self._prepare_one(a, probes.ticket(), prepares.ticket()) for a in fresh
            )
        finally:
            self._preparing.difference_update(fresh)
            again = [a for a in fresh if a in self._again]
            self._again.difference_update(again)
            if again and not self._closing:
                self._spawn(self._prepare_all(again))

    async def _prepare_one(self, attempt_id: str, probe: Ticket, prepare: Ticket) -> None:
        """One attempt of a batch; its tickets let its probe and prepare rows go out
        with the batch's others."""
        with probe, prepare:
            await self._prepare_staged(attempt_id, probe, prepare)

    async def _prepare_staged(self, attempt_id: str, probe: Ticket, prepare: Ticket) -> None:
        record = await self._db(self._ctx.ledger.get, attempt_id)
        status = record.status if record is not None else None
        if record is None or status is None or status.state != "prepared":
            return
        if status.ready or status.preparing:
            return
        try:
            attempt = await self._attempt(record)
            inputs_ready = await self._stage(attempt)
        except HostError as error:
            await self._refused(record, lifecycle.PrepareFailed(reason=error.code), error)
            return
        if inputs_ready:
            await self._provider_prepare(attempt, probe, prepare)

    async def _restage(self, record: AttemptRecord) -> None:
        """After a restart: staging of a ready attempt, without calling its provider."""
        try:
            await self._stage(await self._attempt(record))
        except HostError as error:
            await self._refused(record, lifecycle.PrepareFailed(reason=error.code), error)

    async def _stage(self, attempt: _Attempt) -> bool:
        """Layout and staging; True once every streamed input is complete."""
        await self._io(slotfs.verify, attempt.slot, open_image_parent)
        await self._io(attempt.layout.create, attempt.id)
        if not attempt.plan.streamed_inputs:
            return True
        stager = attempt.slot.stager
        inputs = await self._db(self._ctx.ledger.inputs, attempt.id)
        stager.register_attempt(attempt.id, [i.stream_state() for i in inputs])
        try:
            states: list[StreamState] = await self._io(stager.prepare_attempt, attempt.id)
        except HostError as error:
            if error.code == "inputs_preparing":
                return False  # another prepare_attempt is on it
            raise
        recorded = {i.object_id: i for i in inputs}
        for state in states:
            if state.failed is not None and recorded[state.id].failed is None:
                # Records the object as failed and the attempt as failed, in one transaction.
                await self._db(
                    self._ctx.ledger.commit_stream, attempt.record.fence, state, state.offset
                )
                return False
        return all(s.complete and s.failed is None for s in states)

    async def _provider_prepare(
        self, attempt: _Attempt, probe_ticket: Ticket, prepare_ticket: Ticket
    ) -> None:
        if not await self._apply(attempt.record, lifecycle.PrepareBegun()):
            return
        refusals: list[HostError] = []
        try:
            storage = await self._io(_verified_storage, attempt)
            inputs = await self._inputs(attempt)
            context = self._context(attempt, storage, inputs)
            probe = await probe_ticket.call(attempt.provider, "probe", context)
            if not probe.ok or not _decoded(probe, "probe", sdk.ProbeReply).ok:
                raise _row_error(probe, "probe")
            check = self._checker(attempt.id, refusals)
            prepare_context = sdk.PrepareContext(**msgspec.structs.asdict(context), check=check)
            prepared = await prepare_ticket.call(attempt.provider, "prepare", prepare_context)
            if not prepared.ok:
                raise refusals[0] if refusals else _row_error(prepared, "prepare")
            result = decode_prepare_result(prepared.reply)
            await self._io(check_prepare_result, result, attempt.plan)
        except HostError as error:
            prepare_ticket.close()  # the batch's other rows need not wait for this record
            await self._refused(attempt.record, lifecycle.PrepareFailed(reason=error.code), error)
            return
        except Exception:
            prepare_ticket.close()
            _log.exception("attempt %s: preparation failed unexpectedly", attempt.id)
            await self._apply(attempt.record, lifecycle.PrepareFailed(reason=INTERNAL_ERROR))
            return
        await self._apply(attempt.record, lifecycle.PrepareOk(result=msgspec.json.encode(result)))

    async def _inputs(self, attempt: _Attempt) -> list[sdk.InputCapability]:
        if not attempt.plan.streamed_inputs:
            return []
        caps: list[sdk.InputCapability] = await self._io(
            attempt.slot.stager.capabilities, attempt.id
        )
        return caps

    def _checker(self, attempt_id: str, refusals: list[HostError]) -> Callable[[], None]:
        """check() for prepare: runs in the provider thread, reads through the ledger
        thread, and keeps its own refusal on the side (the driver would wrap it)."""
        loop = asyncio.get_running_loop()

        def check() -> None:
            future = asyncio.run_coroutine_threadsafe(self._authority(attempt_id), loop)
            try:
                future.result(timeout=60)
            except HostError as error:
                refusals.append(error)
                raise sdk.Refused(error.code, error.message) from error

        return check

    async def _authority(self, attempt_id: str) -> None:
        record = await self._db(self._ctx.ledger.get, attempt_id)
        offer = await self._db(self._ctx.ledger.offer)
        if record is None or record.status.state != "prepared":
            state = "gone" if record is None else record.status.state
            raise HostError(ErrorCode.INVALID_STATE, f"the attempt is {state}, not prepared")
        if not self.lease_current(record):
            raise HostError(ErrorCode.LEASE_EXPIRED, "the lease expired during preparation")
        if "renew" not in OFFER_ALLOWS[offer.control]:
            raise HostError(ErrorCode.OFFER_CLOSED, f"the offer is {offer.control}")

    # --- start --------------------------------------------------------------------

    async def _start(self, attempt_id: str, ticket: Ticket) -> None:
        """One attempt of a start batch; its ticket lets its provider start go out
        with the batch's others."""
        with ticket:
            await self._start_attempt(attempt_id, ticket)

    async def _start_attempt(self, attempt_id: str, ticket: Ticket) -> None:
        record = await self._db(self._ctx.ledger.get, attempt_id)
        if record is None or record.status.state != "starting":
            return
        if record.status.stop_pending is not None:
            return  # the monitor stops it; nothing was created
        attempt = await self._attempt(record)
        try:
            await self._start_pipeline(attempt, ticket)
        except _Aborted:
            await self._stop_service(attempt)
        except _Uncertain as uncertain:
            await self._stop_service(attempt)
            await self._apply(record, lifecycle.OutcomeLost(reason=uncertain.reason))
        except HostError as error:
            await self._stop_service(attempt)
            if not await self._lease_still_current(attempt.id):
                return  # the reaper may have ended the service at the deadline: expiry
            await self._refused(record, lifecycle.StartFailed(reason=error.code), error)
        except Exception:
            _log.exception("attempt %s: start failed unexpectedly", attempt.id)
            await self._stop_service(attempt)
            await self._apply(record, lifecycle.StartFailed(reason=INTERNAL_ERROR))

    async def _start_pipeline(self, attempt: _Attempt, ticket: Ticket) -> None:
        try:
            result = await self._prepared(attempt)
            inputs = await self._inputs(attempt)
            for capability in inputs:
                await self._io(attempt.slot.stager.verify_identity, attempt.id, capability)
            handle = await self._create_service(attempt, result)
            context = await self._later_context(attempt, verify=True, inputs=inputs)
        except BaseException:
            ticket.close()  # the batch's other rows need not wait for this one's stop
            raise
        started = await ticket.call(attempt.provider, "start", context)
        if started.code == PROVIDER_TIMEOUT:
            raise _Uncertain(PROVIDER_TIMEOUT)
        if not started.ok:
            raise _row_error(started, "start")
        _decoded(started, "start", sdk.StartReply)
        pid, devices = await self._await_payload(attempt, context, handle)
        check_device_opens(result, None if devices is None else {d.path: d.opened for d in devices})
        verdict = await self._io(self._run_gate, attempt, result, handle, pid)
        if not verdict.ok:
            raise HostError(verdict.failures[0].code, verdict.failures[0].message)
        await self._release_payload(attempt)
        self._wake_on_exit(handle.main_pid)

    def _wake_on_exit(self, pid: int | None) -> None:
        """Wake the monitor the moment the service's main process exits.

        The monitor otherwise notices the end of a payload only at its next tick; a
        pidfd becomes readable when the process exits, so the outcome is observed at
        once. A PID that is already gone (or reused) only costs an early tick.
        """
        if pid is None:
            return
        try:
            fd = os.pidfd_open(pid)
        except OSError:
            self._monitor.wake()
            return
        loop = asyncio.get_running_loop()
        self._exit_watches.add(fd)

        def exited() -> None:
            self._unwatch(fd)
            self._monitor.wake()

        loop.add_reader(fd, exited)

    def _unwatch(self, fd: int) -> None:
        if fd in self._exit_watches:
            self._exit_watches.discard(fd)
            asyncio.get_running_loop().remove_reader(fd)
            os.close(fd)

    async def _prepared(self, attempt: _Attempt) -> PrepareResult:
        data = await self._db(self._ctx.ledger.prepare_result, attempt.id)
        if data is None:
            raise HostError("prepare_result_missing", "no persisted prepare result")
        return decode_prepare_result(msgspec.json.decode(data))

    async def _create_service(self, attempt: _Attempt, result: PrepareResult) -> ServiceHandle:
        limits = attempt.plan.job.limits
        try:
            spec = msgspec.convert(
                {
                    "name": attempt.service,
                    "argv": result.argv,
                    "uid": attempt.slot.uid,
                    "gid": attempt.slot.gid,
                    "cwd": attempt.paths.storage,
                    "environment": SERVICE_ENVIRONMENT,
                    "limits": {
                        "cpu_millis": limits.cpu_millis,
                        "memory_bytes": limits.memory_bytes,
                        "swap_bytes": limits.swap_bytes,
                        "processes": limits.processes,
                        "nofile": self._settings.nofile,
                    },
                    "devices": msgspec.to_builtins(device_rules(result)),
                    "stdout": attempt.paths.stdout,
                    "stderr": attempt.paths.stderr,
                },
                ServiceSpec,
            )
        except msgspec.ValidationError as error:
            raise HostError("service_spec", f"the service cannot be built: {error}") from error
        self._check_abort(attempt)
        await self._set_deadline(attempt)
        handle: ServiceHandle = await self._io(self._ctx.service.create, spec)
        self._handles[attempt.id] = handle
        controls: Controls = await self._io(self._ctx.service.controls, handle)
        _check_controls(controls, attempt.plan.job.limits)
        return handle

    # --- the lease reaper (service/reaper.py) -----------------------------------------

    def _keeper(self) -> reaper.Keeper:
        if self._reaper is None:
            directory = os.path.join(self._ctx.config.state_dir, "deadlines")
            self._reaper = reaper.Keeper(directory)
        return self._reaper

    async def _set_deadline(self, attempt: _Attempt) -> None:
        """Hand the lease deadline to the reaper before the service exists, so the
        service is stopped at the deadline even if this daemon dies or hangs."""
        async with self._deadline_lock:
            record = await self._db(self._ctx.ledger.get, attempt.id)
            lease = None if record is None else record.lease
            if lease is None:
                raise HostError(ErrorCode.LEASE_EXPIRED, "the attempt holds no lease")
            cgroups = self._ctx.service.planned_cgroups(attempt.service)
            try:
                await self._io(
                    self._keeper().set,
                    attempt.service,
                    lease.boot_id,
                    lease.deadline_boottime_ns,
                    cgroups,
                )
            except OSError as error:
                raise HostError(
                    "service_create",
                    f"the lease deadline could not be handed to the reaper ({error}); "
                    "check the state directory",
                ) from error
            self._deadlines[attempt.id] = (attempt.service, lease.deadline_boottime_ns)

    async def leases_renewed(self, records: Sequence[AttemptRecord]) -> None:
        """Give renewed deadlines to the reaper before the renewal is answered, so a
        daemon that hangs right after answering still stops the payload at the deadline
        the controller was told, also when the renewal shortened it."""
        await self._sync_deadlines(records)

    def _deadline_moved(self, record: AttemptRecord) -> bool:
        written = self._deadlines.get(record.attempt_id)
        lease = record.lease
        if written is None or lease is None or record.status.state not in LIVE_STATES:
            return False
        return lease.deadline_boottime_ns != written[1]

    async def _sync_deadlines(self, records: Sequence[AttemptRecord]) -> None:
        """Follow renewals (answered ones at once, any other once per tick) and keep a
        reaper running while any live service has a deadline.

        One writer at a time, and each moved deadline is read again from the ledger
        under the lock: `records` may be older than a renewal another writer has
        already handed over, and the file must never go back to a stale deadline.
        """
        if not self._deadlines:
            return
        async with self._deadline_lock:
            moved_ids = [r.attempt_id for r in records if self._deadline_moved(r)]
            fresh = await self._db(self._records, moved_ids) if moved_ids else []
            moved = [
                (r.attempt_id, self._deadlines[r.attempt_id][0], r.lease)
                for r in fresh
                if r.lease is not None and self._deadline_moved(r)
            ]
            keeper = self._keeper()

            def write() -> None:
                for _attempt_id, service, lease in moved:
                    reaper.write_deadline(
                        keeper.directory,
                        service,
                        lease.boot_id,
                        lease.deadline_boottime_ns,
                        self._ctx.service.planned_cgroups(service),
                    )
                keeper.ensure()

            try:
                await self._io(write)
            except OSError as error:
                _log.error("the lease reaper's deadlines could not be updated: %s", error)
                return
            for attempt_id, service, lease in moved:
                self._deadlines[attempt_id] = (service, lease.deadline_boottime_ns)

    def _records(self, attempt_ids: Sequence[str]) -> list[AttemptRecord]:
        """The current records of `attempt_ids` (a ledger-thread call)."""
        found = (self._ctx.ledger.get(a) for a in attempt_ids)
        return [r for r in found if r is not None]

    async def _drop_deadline(self, attempt: _Attempt) -> None:
        self._deadlines.pop(attempt.id, None)
        try:
            await self._io(self._keeper().drop, attempt.service)
        except OSError as error:
            _log.warning("attempt %s: deadline file not removed: %s", attempt.id, error)

    async def _lease_still_current(self, attempt_id: str) -> bool:
        record = await self._db(self._ctx.ledger.get, attempt_id)
        return record is not None and self.lease_current(record)

    async def _await_payload(
        self, attempt: _Attempt, context: sdk.Context, handle: ServiceHandle
    ) -> tuple[int, list[DeviceOpen] | None]:
        """Observe until the barrier's host PID is reported (or the deadline).

        A provider reports `ready` (the device opens) before `payload` (the PID), often
        on consecutive calls, so the first `ready` is followed by the next observation
        at once; every other observation waits `observe_interval` first.
        """
        deadline = time.monotonic() + self._settings.start_timeout
        devices: list[DeviceOpen] | None = None
        furthest = "waiting"
        while True:
            self._check_abort(attempt)
            began = time.monotonic()
            result = await self._batcher.call(attempt.provider, "observe", context)
            self._observe_cost = time.monotonic() - began
            if result.code == PROVIDER_TIMEOUT:
                raise _Uncertain(PROVIDER_TIMEOUT)
            seen = _observation(result)
            if seen.devices is not None:
                devices = seen.devices
            if seen.phase == "payload" and seen.pid is not None:
                return seen.pid, devices
            exited = await self._io(self._ctx.service.exit_status, handle)
            if seen.phase == "finished" or exited is not None:
                raise HostError(
                    "barrier_exited", "the barrier exited before release; the payload never ran"
                )
            if time.monotonic() >= deadline:
                raise HostError(
                    "start_timeout",
                    f"no payload PID within {self._settings.start_timeout}s; the payload never"
                    " ran: check the provider",
                )
            if seen.phase == "ready" and furthest == "waiting":
                furthest = "ready"
            else:
                await self._next_observation()

    async def _next_observation(self) -> None:
        """Wait `observe_interval`, on a beat shared by every start waiting for its
        payload: they wake in the same loop turn, so their observe rows go out as one
        provider call (one walk of the provider's process table instead of one each)."""
        beat = self._beat
        if beat is None or beat.done():
            loop = asyncio.get_running_loop()
            beat = self._beat = loop.create_future()
            pause = observation_pause(self._settings.observe_interval, self._observe_cost)
            loop.call_later(pause, _settle_beat, beat)
        await asyncio.shield(beat)

    def _run_gate(
        self, attempt: _Attempt, result: PrepareResult, handle: ServiceHandle, pid: int
    ) -> gate.Verdict:
        """Blocking: build the Expectation and judge the live barrier (evidence first)."""
        logs = tuple(
            procfs.FileIdentity(st.st_dev, st.st_ino)
            for st in (os.stat(p) for p in (attempt.paths.stdout, attempt.paths.stderr))
        )
        expectation = build_expectation(
            uid=attempt.slot.uid,
            gid=attempt.slot.gid,
            result=result,
            handle=handle,
            service_cgroup=posixpath.dirname(self._ctx.service.supervisor_cgroup(handle)),
            processes=attempt.plan.job.limits.processes,
            log_files=logs,
            nofile=self._settings.nofile,
            user_namespace=self._settings.user_namespace,
            cgroup_namespace=self._settings.cgroup_namespace,
        )
        evidence = attempt.layout.open_part(attempt.id, layout.EVIDENCE)
        try:
            return gate.inspect_and_check(pid, expectation, evidence)
        finally:
            os.close(evidence)

    async def _release_payload(self, attempt: _Attempt) -> None:
        """The last checks, then the marker, then `Started` (in that order only)."""
        self._check_abort(attempt)
        record = await self._db(self._ctx.ledger.get, attempt.id)
        if record is None or record.status.stop_pending is not None:
            raise _Aborted()
        if not self.lease_current(record):
            raise _Aborted()  # the monitor records the expiry and stops
        ceiling = ceiling_limits(self._ctx.config)
        lost = await self._db(self._ctx.ledger.authorize_release, record.fence, ceiling)
        if lost is not None:
            _log.warning("attempt %s: start authority lost before release (%s)", attempt.id, lost)
            raise _Aborted()  # recorded as cancelled; the service is stopped, then cleaned
        await self._io(_write_marker, attempt)
        await self._apply(record, lifecycle.Started())

    def _check_abort(self, attempt: _Attempt) -> None:
        if attempt.id in self._abort:
            raise _Aborted()

    async def _stop_service(self, attempt: _Attempt) -> None:
        """Kill the service tree (provider stop first, best effort); never raises."""
        try:
            context = await self._later_context(attempt)
            stopped = await self._batcher.call(attempt.provider, "stop", context)
            if not stopped.ok:
                _log.warning("attempt %s: provider stop: %s", attempt.id, stopped.message)
            handle = self._handles.get(attempt.id) or await self._io(
                self._ctx.service.adopt, attempt.service
            )
            if handle is not None:
                await self._io(self._ctx.service.stop, handle)
        except HostError as error:
            _log.warning("attempt %s: stop not confirmed yet: %s", attempt.id, error)

    # --- MonitorOps -----------------------------------------------------------------

    async def watched(self) -> list[AttemptRecord]:
        self._ticks += 1
        if self._ticks % self._settings.rescan_ticks == 1:
            # Page by page: the ledger keeps every record forever, and holding all of
            # them at once every few seconds costs megabytes of RSS (benchmark P7).
            after: str | None = None
            while True:
                page, after = await self._db(self._ctx.ledger.page, after)
                self._watch.update(r.attempt_id for r in page if self._needs_watch(r))
                if after is None:
                    break
        found = []
        for attempt_id in sorted(self._watch):
            record = await self._db(self._ctx.ledger.get, attempt_id)
            if record is not None and self._needs_watch(record):
                found.append(record)
            else:
                self._watch.discard(attempt_id)
        await self._sync_deadlines(found)
        return found

    def start_running(self, attempt_id: str) -> bool:
        return attempt_id in self._starting

    def abort_start(self, attempt_id: str) -> None:
        self._abort.add(attempt_id)

    async def expire(self, record: AttemptRecord) -> None:
        await self._apply(record, lifecycle.LeaseExpired())

    async def stop(self, record: AttemptRecord) -> None:
        attempt = await self._attempt(record)
        await self._stop_service(attempt)
        handle = self._handles.get(attempt.id) or await self._io(
            self._ctx.service.adopt, attempt.service
        )
        if handle is None or not await self._io(self._ctx.service.members, handle):
            await self._apply(record, lifecycle.Stopped())

    async def observe(self, records: Sequence[AttemptRecord]) -> None:
        cohort = self._batcher.cohort(len(records))
        await _gather_logged(self._observe_one(r, cohort.ticket()) for r in records)

    async def _observe_one(self, record: AttemptRecord, ticket: Ticket) -> None:
        with ticket:
            await self._observe_record(record, ticket)

    async def _observe_record(self, record: AttemptRecord, ticket: Ticket) -> None:
        attempt = await self._attempt(record)
        context = await self._later_context(attempt)
        result = await ticket.call(attempt.provider, "observe", context)
        if result.code == PROVIDER_TIMEOUT:
            await self._apply(record, lifecycle.OutcomeLost(reason=PROVIDER_TIMEOUT))
            return
        await self._note_storage(attempt)
        handle = self._handles.get(attempt.id) or await self._io(
            self._ctx.service.adopt, attempt.service
        )
        try:
            seen = _observation(result)
        except HostError:
            seen = None
        if seen is not None and seen.phase == "finished" and seen.exit_code is not None:
            exited = (
                None if handle is None else await self._io(self._ctx.service.exit_status, handle)
            )
            if exited is not None and exited != seen.exit_code:
                # The service's own main process disagrees with the provider: neither
                # can be trusted as the outcome.
                await self._apply(record, lifecycle.OutcomeLost(reason="outcome_conflict"))
                return
            await self._apply(record, lifecycle.Finished(exit_code=seen.exit_code))
            return
        alive = handle is not None and bool(await self._io(self._ctx.service.members, handle))
        if not alive:
            # The service is gone but the provider reports no exit: unreadable outcome.
            await self._apply(record, lifecycle.OutcomeLost(reason="outcome_unreadable"))

    async def _note_storage(self, attempt: _Attempt) -> None:
        """A full slot fails the job: looked at on every observation while the payload
        runs and before its exit is recorded (a payload that fills its slot and then
        deletes what it wrote before the next look is not seen)."""
        use = await self._io(slotfs.usage, attempt.slot.path)
        if use.bytes_exhausted or use.inodes_exhausted:
            event = lifecycle.StorageExhausted(log_cut_short=use.bytes_exhausted)
            await self._apply(attempt.record, event)

    async def cleanup(self, record: AttemptRecord) -> None:
        fresh = await self._db(self._ctx.ledger.get, record.attempt_id)
        if fresh is None or fresh.status.state not in lifecycle.SETTLED:
            return
        if fresh.status.cleanup_confirmed or fresh.slot_id is None:
            return
        attempt = await self._attempt(fresh)
        try:
            handle = self._handles.get(attempt.id) or await self._io(
                self._ctx.service.adopt, attempt.service
            )
            if handle is not None:
                await self._io(self._ctx.service.stop, handle)
                idle = await self._io(self._ctx.service.is_idle, handle, attempt.slot.uid)
            else:
                idle = await self._io(self._ctx.service.account_idle, attempt.slot.uid)
        except HostError as error:
            _log.warning("attempt %s: cleanup not confirmed: %s", attempt.id, error)
            idle = False
        if idle:
            await self._drop_deadline(attempt)
            await self._apply(fresh, lifecycle.CleanupConfirmed())
            return
        metrics.PROCESS.cleanup_not_confirmed()
        if not fresh.status.quarantined:
            await self._apply(fresh, lifecycle.CleanupFailed())

    # --- reading the ledger -------------------------------------------------------

    async def _all_records(self) -> list[AttemptRecord]:
        records: list[AttemptRecord] = []
        after: str | None = None
        while True:
            page, after = await self._db(self._ctx.ledger.page, after)
            records += page
            if after is None:
                return records

    @staticmethod
    def _needs_watch(record: AttemptRecord) -> bool:
        status = record.status
        if status.state in lifecycle.ACTIVE:
            return True
        return status.state in lifecycle.SETTLED and not status.cleanup_confirmed


# --- blocking helpers (run in worker threads) ---------------------------------------


def _verified_storage(attempt: _Attempt) -> sdk.StorageBinding:
    """The storage binding: the slot-owned storage directory on the slot's filesystem."""
    fd = attempt.layout.open_part(attempt.id, layout.STORAGE)
    try:
        st = os.fstat(fd)
    finally:
        os.close(fd)
    slot = os.stat(attempt.slot.path, follow_symlinks=False)
    if st.st_dev != slot.st_dev:
        raise HostError(
            "storage_unverified",
            f"{attempt.paths.storage} is not on the slot's reserved filesystem; check the slot",
        )
    limits = attempt.plan.job.limits
    return sdk.StorageBinding(
        path=attempt.paths.storage,
        device=st.st_dev,
        inode=st.st_ino,
        bytes=limits.storage_bytes,
        inodes=limits.storage_inodes,
    )


def _write_marker(attempt: _Attempt) -> None:
    control = attempt.layout.open_part(attempt.id, layout.CONTROL)
    try:
        gate.write_release_marker(control, RELEASE_MARKER, group=attempt.slot.gid)
    finally:
        os.close(control)


def _check_controls(controls: Controls, limits: planlib.Limits) -> None:
    """The limits the kernel reports must be the plan's (memory in whole pages)."""
    page = os.sysconf("SC_PAGE_SIZE")
    wrong = []
    if controls.processes != limits.processes:
        wrong.append(f"processes {controls.processes} != {limits.processes}")
    if controls.cpu_millis != limits.cpu_millis:
        wrong.append(f"cpu_millis {controls.cpu_millis} != {limits.cpu_millis}")
    if controls.memory_bytes != limits.memory_bytes // page * page:
        wrong.append(f"memory_bytes {controls.memory_bytes} != {limits.memory_bytes}")
    if controls.swap_bytes is not None and controls.swap_bytes > limits.swap_bytes:
        wrong.append(f"swap_bytes {controls.swap_bytes} > {limits.swap_bytes}")
    if wrong:
        raise HostError(
            "service_limits", "the service does not enforce the plan: " + "; ".join(wrong)
        )


def _settle_beat(beat: asyncio.Future[None]) -> None:
    if not beat.done():
        beat.set_result(None)


async def _gather_logged(jobs: Any) -> None:
    for result in await asyncio.gather(*jobs, return_exceptions=True):
        if isinstance(result, Exception):
            _log.error("runner job failed: %r", result)
        elif isinstance(result, BaseException):
            raise result
