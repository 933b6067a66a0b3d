"""The runner: the asynchronous work on an attempt after a handler has replied.

Handlers record decisions durably and reply; the `Runner` then does what takes time
(docs/architecture.md), always through `ctx.workers` so the event loop never
blocks, and records every outcome in the ledger as a lifecycle event. It coordinates
its parts, each a module of its own:

- prepare (here): the attempt layout, staging of streamed inputs, then provider
  `probe` and `prepare` (with `check()`); the result is validated (expectation.py)
  and persisted with `PrepareOk` before anything uses it.
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
- `check()` (prepare) passes while the record is still `prepared`, its lease is
  current and the offer is not `stopped` (paused keeps leases alive, so preparation
  may go on). A refusal by check() is recorded as ITS code (e.g. `lease_expired`),
  not as the provider's error that wraps it.
- Failure reasons: `probe_failed`, `provider_failed`, `provider_timeout`,
  `provider_malformed` (invalid result), `provider_unavailable`, staging and layout
  codes as they come, the first gate failure code (`gate_*`), `service_*` codes.
- A timed-out probe or prepare is `failed` (no payload can have run); a timed-out
  observe leaves the outcome `unknown`, never a replay.
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
import logging
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, Final

import msgspec

from ficc.execution.errors import ErrorCode
from ficc.execution.host import lifecycle, metrics, sdk, slotfs
from ficc.execution.host.attempts import (
    INTERNAL_ERROR,
    AttemptWork,
    Settings,
    _Attempt,
    _decoded,
    _observation,
    _row_error,
    _verified_storage,
)
from ficc.execution.host.batching import PROVIDER_TIMEOUT, Batcher, Ticket
from ficc.execution.host.config import open_image_parent
from ficc.execution.host.context import HostContext
from ficc.execution.host.deadlines import Deadlines
from ficc.execution.host.errors import HostError
from ficc.execution.host.expectation import check_prepare_result, decode_prepare_result
from ficc.execution.host.layout import RELEASE_MARKER
from ficc.execution.host.ledger import OFFER_ALLOWS, AttemptRecord
from ficc.execution.host.monitor import Monitor
from ficc.execution.host.staging import StreamState
from ficc.execution.host.starting import Starter

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
        super().__init__(
            ctx,
            settings,
            batcher=Batcher(ctx, settings.provider_timeout),
            monitor=Monitor(self, interval=settings.tick, on_tick=on_tick),
            handles={},
        )
        self._tasks: set[asyncio.Task[Any]] = set()
        self._preparing: set[str] = set()
        self._again: set[str] = set()
        self._closing = False
        self._watch: set[str] = set()
        self._ticks = 0
        self._deadlines = Deadlines(ctx)
        self._starter = Starter(self, deadlines=self._deadlines, spawn=self._spawn)

    # --- the contract with the handlers -------------------------------------------

    def admitted(self, attempt_ids: Sequence[str]) -> None:
        self._watch.update(attempt_ids)
        self._spawn(self._prepare_all(list(attempt_ids)))

    def inputs_complete(self, attempt_id: str) -> None:
        self._spawn(self._prepare_all([attempt_id]))

    def start_requested(self, attempt_ids: Sequence[str]) -> None:
        self._watch.update(attempt_ids)
        self._starter.request(attempt_ids)

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

    async def expire(self, record: AttemptRecord) -> None:
        await self._apply(record, lifecycle.LeaseExpired())

    async def stop(self, record: AttemptRecord) -> None:
        attempt = await self._attempt(record)
        await self._starter.stop_service(attempt)
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
            await self._deadlines.drop(attempt)
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


async def _gather_logged(jobs: Any) -> None:
    for result in await asyncio.gather(*jobs, return_exceptions=True):
        if isinstance(result, Exception):
            _log.error("runner job failed: %r", result)
        elif isinstance(result, BaseException):
            raise result
