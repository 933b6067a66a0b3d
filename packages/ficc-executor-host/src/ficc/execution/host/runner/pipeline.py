"""The runner: the asynchronous work on an attempt after a handler has replied.

Handlers record decisions durably and reply; the `Runner` then does what takes time
(docs/architecture.md), always through `ctx.workers` so the event loop never
blocks, and records every outcome in the ledger as a lifecycle event. It coordinates
its parts, each a module of its own:

- prepare (preparing.py, `Preparer`): the attempt layout, staging of streamed inputs,
  then provider `probe` and `prepare` (with `check()`), persisted with `PrepareOk`.
- start (starting.py, `Starter`): from staged inputs re-verified through the system
  service, provider `start`, the payload gate and the release marker (`Started`).
- the monitor (monitor.py) drives expiry, stops, observation and cleanup through
  the `MonitorOps` methods below; each tick also hands moved lease deadlines to the
  lease reaper (deadlines.py), which stops a service at its deadline even when this
  daemon is dead or hung.
- release and startup recovery (here).
- provider calls, from every part, go through the batcher (batching.py): the rows of
  one request or one monitor tick reach a provider as one call. What every part
  shares (loading an attempt, its provider context, recording an event) is in
  attempts.py.

Decisions (see also docs/operations.md):
- Failure reasons: `probe_failed`, `provider_failed`, `provider_timeout`,
  `provider_malformed` (invalid result), `provider_unavailable`, staging and layout
  codes as they come, the first gate failure code (`gate_*`), `service_*` codes.
- A timed-out observe leaves the outcome `unknown` (`provider_timeout`), never a
  replay.
- Outcome cross-check: when the service knows its main process's exit status at the
  moment `finished` is read (not after an adoption, and not for an early `finished`
  while the main process still runs) and it differs from the provider's exit code,
  the outcome is `unknown` (`outcome_conflict`). A running attempt whose service tree was
  already empty before the provider was asked, while the provider reports no exit, is
  `unknown` (`outcome_unreadable`); a payload that ends while the provider answers is
  read at the next look. An empty service found once the lease was over is left to
  the expiry (the lease reaper empties services at their deadline).
- What an attempt used (`usage`): read from its service's cgroups (`accounting`), the
  slot's statvfs and the release and end instants this daemon saw, just before the
  event that settles it (an exit, a confirmed stop, a lost outcome) and recorded with
  it in one transaction; an attempt settled without a reading (a restart, a failed or
  cancelled start) gets one at its cleanup, before the service is stopped. An OOM
  kill counted there makes a nonzero exit `memory_exhausted`. While the payload runs,
  `usage_now` reads the same figures live for `observe`/`snapshot`.
- A payload that ends 126 or 127 after the barrier's report that its program could
  not be executed (runtime_errors.py) gets that report, in the host's words, as its
  `detail` and as a `runtime_error` log event; any other output stays out of both.
- A payload that ended by itself before this daemon killed anything keeps its exit,
  also when a stop or the deadline came before the monitor noticed: the stop looks
  once before it kills, when the service is empty or the gated payload process ended
  within the last looks after its end (a provider may report the exit while its
  runtime still tears down).
- Cleanup is never confirmed while the attempt's preparation or any provider call of
  it still runs, even after a stop, an expiry or the call's timeout settled it.
- Wind-down: the service's main process of a payload that exited by itself is left to
  end on its own for up to `Settings.wind_down` before cleanup stops the service, so
  the runtime finishes its teardown (a provider can then release without undoing a
  half-finished one).
- Restart (`recover`): the ledger turns starting/running into unknown and in-flight
  preparations into failed; every settled attempt without confirmed cleanup has its
  service adopted by name, stopped and checked idle. Prepared attempts whose streams
  are all complete but whose provider preparation never began are prepared again
  (nothing was called yet, so this is no replay). No payload is ever restarted.

What the runner needs of a service backend beyond starting and stopping a service:
`planned_supervisor_cgroup(name)` (the prepare context's cgroup, known before the
service exists), `planned_cgroups(name)` (what the lease reaper kills at the deadline,
handed to it before the service exists) and `kill_account(uid)` (cleanup: what is
left of the slot account, inside the service or outside it, killed and the account
found idle). What it needs of a slot's disk is the `SlotFiles` port (storage/
slot_files.py, kept in `SlotRuntime.files`), through which it creates, checks and
removes the attempt directories.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, Final

import msgspec

from ficc.execution import provider as sdk
from ficc.execution.errors import ErrorCode
from ficc.execution.host.context.parts import HostContext
from ficc.execution.host.core import lifecycle, metrics
from ficc.execution.host.core.codes import HostCode
from ficc.execution.host.core.errors import HostError
from ficc.execution.host.core.leases import Now
from ficc.execution.host.core.records import ResourceUsage, lease_is_current
from ficc.execution.host.ledger.store import AttemptRecord
from ficc.execution.host.linux import procfs
from ficc.execution.host.runner import runtime_errors
from ficc.execution.host.runner.attempts import (
    Attempt,
    AttemptWork,
    Settings,
    Shared,
    decoded_reply,
    gather_logged,
    observation_of,
    row_error,
)
from ficc.execution.host.runner.batching import PROVIDER_TIMEOUT, Batcher, Ticket
from ficc.execution.host.runner.deadlines import Deadlines
from ficc.execution.host.runner.monitor import Monitor
from ficc.execution.host.runner.preparing import Preparer
from ficc.execution.host.runner.starting import Starter
from ficc.execution.host.service.interface import ServiceHandle
from ficc.execution.host.storage.layout import RELEASE_MARKER
from ficc.execution.wire import DETAIL_MAX

__all__ = ["RELEASE_MARKER", "Runner", "Settings"]

_log = logging.getLogger(__name__)

NO_RESOURCE_REASONS: Final = frozenset(
    {lifecycle.ADMISSION_REJECTED, lifecycle.LEGACY_ABSENCE_ACKNOWLEDGED}
)


class Runner(AttemptWork):
    """Prepare, start, monitor, release and recover attempts (see the module docstring)."""

    def __init__(
        self,
        ctx: HostContext,
        *,
        settings: Settings | None = None,
        on_tick: Callable[[], None] | None = None,
    ) -> None:
        settings = settings or Settings()
        shared = Shared(
            ctx,
            settings,
            batcher=Batcher(ctx, settings.provider_timeout),
            monitor=Monitor(self, interval=settings.tick, on_tick=on_tick),
            handles={},
        )
        super().__init__(shared)
        self._tasks: set[asyncio.Task[Any]] = set()
        self._watch: set[str] = set()
        self._killed: set[str] = set()
        self._releasing: set[str] = set()
        """Attempts with a release under way (a controller may resend one)."""
        self._winding_down: dict[str, float] = {}
        """Exited attempts whose service still runs: when cleanup first saw it so."""
        self._ticks = 0
        self._deadlines = Deadlines(ctx)
        self._preparer = Preparer(shared, spawn=self._spawn)
        self._starter = Starter(shared, deadlines=self._deadlines, spawn=self._spawn)

    # --- the contract with the handlers -------------------------------------------

    def admitted(self, attempt_ids: Sequence[str]) -> None:
        self._watch.update(attempt_ids)
        self._spawn(self._preparer.prepare(list(attempt_ids)))

    def inputs_complete(self, attempt_id: str) -> None:
        self._spawn(self._preparer.prepare([attempt_id]))

    def start_requested(self, attempt_ids: Sequence[str]) -> None:
        self._watch.update(attempt_ids)
        self._starter.request(attempt_ids)

    def stop_requested(self, attempt_ids: Sequence[str]) -> None:
        self._watch.update(attempt_ids)
        self._monitor.wake()

    def settled(self, attempt_ids: Sequence[str]) -> None:
        """Attempts a handler settled by itself (a start refused `input_changed` before
        it was accepted): the monitor confirms their cleanup at once."""
        self._watch.update(attempt_ids)
        self._monitor.wake()

    async def release(self, attempt_id: str) -> None:
        (outcome,) = await self.release_batch([attempt_id])
        if outcome is not None:
            raise outcome

    async def leases_renewed(self, records: Sequence[AttemptRecord]) -> frozenset[str]:
        """Give renewed deadlines to the reaper before the renewal is answered, so a
        daemon that hangs right after answering still stops the payload at the deadline
        the controller was told, also when the renewal shortened it. Returns the
        attempts the reaper had already decided to stop at the old deadline."""
        return await self._deadlines.renewed(records)

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
        # Taken before any await: of two releases of one attempt, only the first may
        # kill what runs as its slot account (the second's would hit the first's
        # provider commands).
        first = attempt_id not in self._releasing
        self._releasing.add(attempt_id)
        try:
            with ticket:
                await self._release_resources(attempt_id, ticket, first=first)
        finally:
            if first:
                self._releasing.discard(attempt_id)

    async def _release_resources(self, attempt_id: str, ticket: Ticket, *, first: bool) -> None:
        record = await self._db(self._ctx.ledger.get, attempt_id)
        if record is None:
            raise HostError(ErrorCode.UNKNOWN_ATTEMPT, "no such attempt")
        if record.slot_id is None or record.status.reason in NO_RESOURCE_REASONS:
            return
        attempt = await self._attempt(record)
        context = await self._release_context(attempt)
        # What the payload wrote goes first, so a full slot leaves room for the provider.
        await self._io(attempt.files.free_payload_data, attempt.id)
        if first and not self._batcher.in_flight.running(attempt.id):
            # Cleanup was confirmed, so anything of the slot account running now was
            # orphaned by a daemon that died during a provider command (its release).
            await self._io(self._ctx.service.kill_account, attempt.slot.uid)
        result = await ticket.call(attempt.provider, "release", context)
        if not result.ok:
            raise row_error(result, "release")
        decoded_reply(result, "release", sdk.ReleaseReply)
        await self._io(attempt.slot.stager.remove_attempt, attempt.id)
        await self._io(attempt.files.remove, attempt.id)
        handle = self._handles.pop(attempt.id, None) or await self._io(
            self._ctx.service.adopt, attempt.service
        )
        if handle is not None:
            await self._io(self._ctx.service.remove, handle)
        self._watch.discard(attempt.id)
        self._killed.discard(attempt.id)
        self._walls.forget(attempt.id)
        self._details.pop(attempt.id, None)
        self._decoded.forget(attempt.id)

    async def _release_context(self, attempt: Attempt) -> sdk.Context:
        """The release's context. A storage directory an earlier release of this
        attempt already freed (`free_payload_data`) is named by its path alone: nothing
        is left there to verify or to act on. A binding that exists and cannot be
        verified refuses the release (`layout_unsafe`, the reservation stays) instead of
        asking the provider to release a path the daemon cannot vouch for."""
        try:
            return await self._later_context(attempt)
        except HostError as error:
            if error.code == ErrorCode.NOT_FOUND and await self._io(
                attempt.files.storage_freed, attempt.id
            ):
                return await self._freed_context(attempt)
            if error.code != HostCode.STORAGE_UNVERIFIED:
                raise
            raise HostError(
                ErrorCode.LAYOUT_UNSAFE,
                f"{error.message}; the provider is not asked to release it: investigate the"
                " attempt directory, then release again",
            ) from error

    async def _freed_context(self, attempt: Attempt) -> sdk.Context:
        data = await self._db(self._ctx.ledger.prepare_result, attempt.id)
        prepared = None if data is None else msgspec.json.decode(data, type=sdk.PrepareResult)
        storage = sdk.StorageBinding(path=attempt.paths.storage)
        return self._context(attempt, storage, (), prepared)

    async def recover(self) -> None:
        """Startup, before the server listens (see the module docstring)."""
        await self._db(self._ctx.ledger.mark_restarted)
        await self._deadlines.resume()
        records = await self._all_records()
        self._watch.update(r.attempt_id for r in records if self._needs_watch(r))
        unclean = [
            r for r in records if r.status.state in lifecycle.SETTLED and r.slot_id is not None
        ]
        await gather_logged(self.cleanup(r) for r in unclean if not r.status.cleanup_confirmed)
        prepared = [r for r in records if r.status.state == "prepared"]
        # A ready attempt's inputs are complete, but this new Stager does not know them:
        # re-register and re-verify them before the server listens, so a start finds
        # them staged (and a file changed while the daemon was down fails the attempt).
        await gather_logged(self._preparer.restage(r) for r in prepared if r.status.ready)
        staged = [r.attempt_id for r in prepared if not r.status.ready and not r.status.preparing]
        if staged:
            self._spawn(self._preparer.prepare(staged))

    async def run(self) -> None:
        await self._monitor.run()

    async def close(self) -> None:
        """Cancel every task of this runner (a provider call already in a thread runs on)."""
        self._preparer.close()
        self._starter.close()
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
        await self._deadlines.sync(found)
        return found

    def start_running(self, attempt_id: str) -> bool:
        return self._starter.running(attempt_id)

    def abort_start(self, attempt_id: str) -> None:
        self._starter.abort(attempt_id)

    async def expire(self, record: AttemptRecord) -> bool:
        """Record the expiry if the lease has run out as the recording transaction sees
        it (a renewal may have come after the monitor read `record`); False: it has
        not, and nothing may be stopped."""
        try:
            applied = await self._db(self._ctx.ledger.expire, record.fence, self._ctx.clock)
        except HostError as error:
            _log.info("attempt %s: lease_expired not recorded (%s)", record.attempt_id, error)
            return False
        return applied is not None

    async def stop(self, record: AttemptRecord) -> None:
        attempt = await self._attempt(record)
        try:
            if await self._ended_by_itself(attempt):
                return
        except Exception:  # the look is a courtesy to the payload: never block the stop
            _log.exception("attempt %s: looking for an exit before the stop failed", attempt.id)
        self._killed.add(attempt.id)
        await self._starter.stop_service(attempt)
        handle = await self._service(attempt)
        if handle is None or not await self._io(self._ctx.service.occupied, handle):
            await self._apply(record, lifecycle.Stopped(), await self._usage(attempt, handle))

    async def _ended_by_itself(self, attempt: Attempt) -> bool:
        """A running payload whose service emptied before this daemon killed anything,
        or whose gated process ended moments ago (its runtime may still tear down), may
        have ended on its own before the stop or the deadline: its exit, if reported, is
        the outcome (one look, as a tick would have taken)."""
        if attempt.record.status.state != "running" or attempt.id in self._killed:
            return False
        if await self._deadlines.reaped(attempt):
            return False  # the reaper stopped it at its deadline: it did not end by itself
        handle = await self._service(attempt)
        if (
            handle is not None
            and not self._starter.payload_ended(attempt.id)
            and await self._io(self._ctx.service.occupied, handle)
        ):
            return False
        with self._batcher.cohort(1).ticket() as ticket:
            await self._observe_record(attempt.record, ticket)
        fresh = await self._db(self._ctx.ledger.get, attempt.id)
        return fresh is None or fresh.status.state != "running"

    async def observe(self, records: Sequence[AttemptRecord]) -> None:
        cohort = self._batcher.cohort(len(records))
        await gather_logged(self._observe_one(r, cohort.ticket()) for r in records)

    async def _observe_one(self, record: AttemptRecord, ticket: Ticket) -> None:
        with ticket:
            await self._observe_record(record, ticket)

    async def _observe_record(self, record: AttemptRecord, ticket: Ticket) -> None:
        attempt = await self._attempt(record)
        try:
            context = await self._later_context(attempt)
        except HostError as error:
            # No provider is asked about a storage binding the daemon cannot vouch for:
            # the outcome cannot be read (the monitor then stops the service).
            _log.warning("attempt %s: not observed: %s", attempt.id, error)
            await self._apply(record, lifecycle.OutcomeLost(reason=error.code))
            return
        handle = await self._service(attempt)
        # Looked at before the provider is asked: a payload may end while the provider
        # answers, and only a service already empty before the question proves that its
        # exit report (written inside the service) is missing.
        alive = handle is not None and await self._io(self._ctx.service.occupied, handle)
        looked = self._ctx.clock.now()
        result = await ticket.call(attempt.provider, "observe", context)
        if result.code == PROVIDER_TIMEOUT:
            if alive or await self._lease_was_current(record.attempt_id, looked):
                used = await self._usage(attempt, handle)
                await self._lost(attempt, PROVIDER_TIMEOUT, alive=alive, usage=used)
            return
        await self._note_storage(attempt)
        try:
            seen = observation_of(result)
        except HostError:
            seen = None
        if seen is not None and seen.phase == "finished" and seen.exit_code is not None:
            exited = (
                None if handle is None else await self._io(self._ctx.service.exit_status, handle)
            )
            # What it used is read before its exit is recorded (the service's cgroups
            # are still there), and recorded with it, in one transaction.
            used = await self._usage(attempt, handle)
            if exited is not None and exited != seen.exit_code:
                # The service's own main process disagrees with the provider: neither
                # can be trusted as the outcome.
                conflict = lifecycle.OutcomeLost(reason="outcome_conflict")
                await self._apply(record, conflict, used)
                return
            oom_killed = bool(used.oom_kills)
            finished = lifecycle.Finished(exit_code=seen.exit_code, oom_killed=oom_killed)
            if await self._apply(record, finished, used):
                await self._note_exec_failure(attempt, seen.exit_code)
            return
        if not alive and await self._lease_was_current(record.attempt_id, looked):
            # The service was gone before the provider looked, and it reports no exit.
            used = await self._usage(attempt, handle)
            await self._lost(attempt, "outcome_unreadable", alive=alive, usage=used)

    async def _note_exec_failure(self, attempt: Attempt, exit_code: int) -> None:
        """A payload that ended 126 or 127 because its program could not be executed
        (the barrier's report, `runtime_errors.exec_failure`): the report becomes the
        row's `detail` and a `runtime_error` event in the log, as for a start that
        failed before the release. The status alone names neither the program nor why."""
        program = attempt.plan.job.payload.argv[0]
        said = await self._io(
            runtime_errors.exec_failure, attempt.files, attempt.id, program, exit_code
        )
        if not said:
            return
        self._details[attempt.id] = said[-DETAIL_MAX:]
        _log.warning(
            "attempt %s: the payload's program could not be executed: %s",
            attempt.id,
            said,
            extra={
                "fields": {
                    "event": "runtime_error",
                    "attempt_id": attempt.id,
                    "code": "exec_failed",
                    "exit_code": exit_code,
                    "runtime_stderr": said,
                }
            },
        )

    async def _lost(
        self, attempt: Attempt, reason: str, *, alive: bool, usage: ResourceUsage | None
    ) -> None:
        """An outcome that cannot be read is `unknown`, unless the lease reaper left its
        evidence of a kill at the deadline on a service found empty: that attempt was
        stopped at its deadline (a renewal came too late for the reaper, and was
        refused), so its lease is recorded as expired and it ends `expired`. Either way
        what it used is recorded with the event that settles it."""
        if not alive and await self._deadlines.reaped(attempt):
            await self._apply(attempt.record, lifecycle.LeaseExpired(), usage)
            self._monitor.wake()
            return
        await self._apply(attempt.record, lifecycle.OutcomeLost(reason=reason), usage)

    async def _lease_was_current(self, attempt_id: str, when: Now) -> bool:
        """Whether the lease (as stored now) was current at `when`. The lease reaper
        kills a service only at its deadline, so a service found empty while the lease
        was already over may be the reaper's work: the next tick records the expiry."""
        fresh = await self._db(self._ctx.ledger.get, attempt_id)
        return fresh is not None and lease_is_current(fresh.lease, when)

    async def _note_storage(self, attempt: Attempt) -> None:
        """A full slot fails the job: looked at on every observation while the payload
        runs and before its exit is recorded (a payload that fills its slot and then
        deletes what it wrote before the next look is not seen)."""
        use = await self._io(attempt.files.usage)
        if use.bytes_exhausted or use.inodes_exhausted:
            event = lifecycle.StorageExhausted(log_cut_short=use.bytes_exhausted)
            await self._apply(attempt.record, event)

    async def cleanup(self, record: AttemptRecord) -> None:
        fresh = await self._db(self._ctx.ledger.get, record.attempt_id)
        if fresh is None or fresh.status.state not in lifecycle.SETTLED:
            return
        if fresh.status.cleanup_confirmed or fresh.slot_id is None:
            return
        # Its preparation or a provider call (maybe past its timeout) may still run: the
        # service is stopped all the same, but nothing is confirmed until they returned.
        busy = self._preparer.running(fresh.attempt_id) or self._batcher.in_flight.running(
            fresh.attempt_id
        )
        attempt = await self._attempt(fresh)
        try:
            handle = await self._service(attempt)
            if await self._winding_down_now(fresh, handle):
                return
            await self._record_usage(attempt, handle)
            if handle is not None:
                await self._io(self._ctx.service.stop, handle)
            if busy or self._batcher.in_flight.running(fresh.attempt_id):
                return  # (looked at again: a call may have begun during the stop)
            # Whatever of the slot account still runs outside the service is left over
            # (a provider command's rootless Podman pause process, or a command
            # orphaned when a daemon died): the attempt has settled and holds the slot.
            # A quarantined attempt is looked at on every tick: one kill, no waiting.
            patience = 0.0 if fresh.status.quarantined else None
            idle = await self._io(self._ctx.service.kill_account, attempt.slot.uid, patience)
            if idle and handle is not None:
                idle = not await self._io(self._ctx.service.occupied, handle)
        except HostError as error:
            _log.warning("attempt %s: cleanup not confirmed: %s", attempt.id, error)
            idle = False
        if idle:
            await self._deadlines.drop(attempt)
            await self._apply(fresh, lifecycle.CleanupConfirmed())
            return
        metrics.PROCESS.cleanup_not_confirmed()
        if not fresh.status.quarantined:
            await self._apply(fresh, lifecycle.CleanupFailed())

    async def _winding_down_now(self, record: AttemptRecord, handle: ServiceHandle | None) -> bool:
        """True while the service's main process of a payload that exited by itself
        is still in the service and `Settings.wind_down` has not passed since cleanup
        first saw it so: the runtime tears down on its own (a later tick looks again).
        Whatever is left once the main process exited (a runtime's helper such as
        rootless Podman's pause process) is stopped then; so is a service whose main
        process is unknown (adopted after a restart), at once."""
        status = record.status
        if handle is None or handle.main_pid is None or status.exit_code is None:
            return False
        if status.quarantined or not await self._io(_main_runs, handle):
            self._winding_down.pop(record.attempt_id, None)
            return False
        first = self._winding_down.setdefault(record.attempt_id, time.monotonic())
        if time.monotonic() - first < self._settings.wind_down:
            return True
        self._winding_down.pop(record.attempt_id, None)
        return False

    async def _record_usage(self, attempt: Attempt, handle: ServiceHandle | None) -> None:
        """What a settled attempt used, recorded before its cleanup touches the service
        if its settling did not record it (a restart, a failed or cancelled start: the
        service's cgroups are still there). One that never had a service used nothing
        the host can read: an empty usage is recorded."""
        recorded = await self._db(self._ctx.ledger.usage_of, [attempt.id])
        if attempt.id not in recorded or recorded[attempt.id].recorded:
            return
        started = attempt.record.status.start_requested
        used = await self._usage(attempt, handle) if started else ResourceUsage()
        try:
            await self._db(self._ctx.ledger.record_usage, attempt.record.fence, used)
        except HostError as error:  # never a reason to keep a slot: cleanup goes on
            _log.warning("attempt %s: usage not recorded: %s", attempt.id, error)

    def details(self, attempt_ids: Sequence[str]) -> dict[str, str]:
        """What the runtime printed for these attempts' failed starts, where kept."""
        return {a: self._details[a] for a in attempt_ids if a in self._details}

    async def usage_now(self, records: Sequence[AttemptRecord]) -> dict[str, ResourceUsage]:
        """A live reading of what each started, unsettled attempt used so far (the
        others are left out: their usage is the ledger's)."""
        live = [r for r in records if r.status.state in ("starting", "running")]
        readings = await asyncio.gather(*(self._live(r) for r in live), return_exceptions=True)
        found: dict[str, ResourceUsage] = {}
        for record, reading in zip(live, readings, strict=True):
            if isinstance(reading, ResourceUsage):
                found[record.attempt_id] = reading
            elif isinstance(reading, BaseException) and not isinstance(reading, Exception):
                raise reading
            else:
                _log.warning("attempt %s: live usage not read: %r", record.attempt_id, reading)
        return found

    async def _live(self, record: AttemptRecord) -> ResourceUsage:
        attempt = await self._attempt(record)
        return await self._usage(attempt, await self._service(attempt))

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


def _main_runs(handle: ServiceHandle) -> bool:
    """Whether the service's main process still runs: the same process (its start time
    is the handle's), not a zombie. It was placed in the service when it started and
    cannot leave it, so this is `main_pid in members` without walking the tree."""
    if handle.main_pid is None or handle.main_start_ticks is None:
        return False
    try:
        procfs.confirm_unchanged(handle.main_pid, handle.main_start_ticks)
    except HostError:
        return False
    return True
