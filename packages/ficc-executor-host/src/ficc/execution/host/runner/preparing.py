"""The prepare pipeline: from an admitted attempt to its persisted preparation.

`Preparer` takes each attempt through, in this order: the slot checked, the attempt
layout created, its streamed inputs staged; once every input is complete, provider
`probe` and `prepare` (with `check()`); the result is validated (gate/expectation.py) and
persisted with `PrepareOk` before anything uses it. The runner (pipeline.py) owns the
preparer: it hands it admitted attempts, completed inputs and, after a restart, the
attempts to stage or prepare again.

Decisions:
- `check()` passes while the record is still `prepared`, its lease is current and the
  offer is not `stopped` (paused keeps leases alive, so preparation may go on). A
  refusal by check() is recorded as ITS code (e.g. `lease_expired`), not as the
  provider's error that wraps it.
- An attempt already being prepared is looked at again once that preparation ends
  (its last input may have completed after it found the inputs incomplete).
- A timed-out probe or prepare is `failed` (`provider_timeout`): no payload can have
  run.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from typing import Any

import msgspec

from ficc.execution import provider as sdk
from ficc.execution.errors import ErrorCode
from ficc.execution.host.core import lifecycle
from ficc.execution.host.core.errors import HostError
from ficc.execution.host.gate.expectation import check_prepare_result, decode_prepare_result
from ficc.execution.host.ledger.store import OFFER_ALLOWS, AttemptRecord
from ficc.execution.host.runner.attempts import (
    INTERNAL_ERROR,
    Attempt,
    AttemptWork,
    Shared,
    decoded_reply,
    gather_logged,
    row_error,
)
from ficc.execution.host.runner.batching import Ticket
from ficc.execution.host.storage.staging import StreamState

__all__ = ["Preparer"]

_log = logging.getLogger(__name__)


class Preparer(AttemptWork):
    """The prepare pipeline of the runner's attempts (see the module docstring)."""

    def __init__(
        self,
        shared: Shared,
        *,
        spawn: Callable[[Coroutine[Any, Any, None]], asyncio.Task[None]],
    ) -> None:
        super().__init__(shared)
        self._spawn = spawn
        """Starts a task the runner keeps (and cancels when it closes)."""
        self._preparing: set[str] = set()
        self._again: set[str] = set()
        self._closing = False

    def close(self) -> None:
        """Start no further preparation (the runner cancels those under way)."""
        self._closing = True

    def running(self, attempt_id: str) -> bool:
        """Whether this attempt's preparation (the provider's `prepare` among it) still
        runs: until it returns, nothing of the attempt may be called cleaned up."""
        return attempt_id in self._preparing

    async def prepare(self, attempt_ids: list[str]) -> None:
        """Prepare attempts; one already being prepared is looked at again afterwards
        (its last input may have completed after it found the inputs incomplete)."""
        wanted = list(dict.fromkeys(attempt_ids))
        self._again.update(a for a in wanted if a in self._preparing)
        fresh = [a for a in wanted if a not in self._preparing]
        self._preparing.update(fresh)
        probes, prepares = self._batcher.cohort(len(fresh)), self._batcher.cohort(len(fresh))
        try:
            await gather_logged(
                self._prepare_one(a, probes.ticket(), prepares.ticket()) for a in fresh
            )
        finally:
            self._preparing.difference_update(fresh)
            again = [a for a in fresh if a in self._again]
            self._again.difference_update(again)
            if again and not self._closing:
                self._spawn(self.prepare(again))

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

    async def restage(self, record: AttemptRecord) -> None:
        """After a restart: staging of a ready attempt, without calling its provider."""
        try:
            await self._stage(await self._attempt(record))
        except HostError as error:
            await self._refused(record, lifecycle.PrepareFailed(reason=error.code), error)

    async def _stage(self, attempt: Attempt) -> bool:
        """Layout and staging; True once every streamed input is complete. A slot found
        broken here is out of the offer at once (not only at its next scheduled check)."""
        try:
            await self._io(attempt.files.verify)
        except HostError as error:
            self._ctx.slot_health.attempt_found(attempt.slot, error)
            raise
        await self._io(attempt.files.create, attempt.id)
        if not attempt.plan.streamed_inputs:
            return True
        stager = attempt.slot.stager
        inputs = await self._db(self._ctx.ledger.inputs, attempt.id)
        stager.register_attempt(attempt.id, [i.stream_state() for i in inputs])
        try:
            states: list[StreamState] = await self._io(stager.prepare_attempt, attempt.id)
        except HostError as error:
            if error.code == ErrorCode.INPUTS_PREPARING:
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
        self, attempt: Attempt, probe_ticket: Ticket, prepare_ticket: Ticket
    ) -> None:
        if not await self._apply(attempt.record, lifecycle.PrepareBegun()):
            return
        refusals: list[HostError] = []
        try:
            storage = await self._io(
                attempt.files.storage_binding, attempt.id, attempt.plan.job.limits
            )
            inputs = await self._inputs(attempt)
            context = self._context(attempt, storage, inputs)
            probe = await probe_ticket.call(attempt.provider, "probe", context)
            if not probe.ok or not decoded_reply(probe, "probe", sdk.ProbeReply).ok:
                raise row_error(probe, "probe")
            check = self._checker(attempt.id, refusals)
            prepare_context = sdk.PrepareContext(**msgspec.structs.asdict(context), check=check)
            prepared = await prepare_ticket.call(attempt.provider, "prepare", prepare_context)
            if not prepared.ok:
                if prepared.code == sdk.SLOT_FILES_STUCK:
                    self._ctx.slot_health.provider_found(
                        attempt.slot, prepared.code, prepared.message or "no message"
                    )
                raise refusals[0] if refusals else row_error(prepared, "prepare")
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
