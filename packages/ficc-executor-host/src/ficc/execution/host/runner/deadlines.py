"""Lease deadlines handed to the lease reaper (service/reaper.py).

The start pipeline hands an attempt's lease deadline to the reaper before its service
exists (`set`), so the service is stopped at the deadline even when this daemon is
dead or hung; a renewal hands on the deadline it moved before it is answered
(`renewed`), and each monitor tick any other that moved (`sync`), and keeps a reaper
running while any live service has one (also from the daemon's start, `resume`);
cleanup takes a settled attempt's deadline back (`drop`). What the reaper kills is the
service backend's `planned_cgroups(name)`, known before the service exists. Where the
reaper runs is the backend's choice: as this daemon's child moved into a cgroup of its
own (`place_reaper`, cgroupfs) or as a unit of its own (`reaper_unit` and
`start_reaper`, systemd).

The reaper is the enforcer of record: a moved deadline counts only once the reaper is
known to judge by it (`reaper.move`). When the reaper had already decided to kill at
the old deadline, the renewal is refused `lease_expired` and the attempt ends
`expired`; the reaper's evidence (`reaped`) also tells the monitor that a service
found empty was stopped at its deadline, not lost.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
from collections.abc import Sequence
from typing import Final

from ficc.execution.errors import ErrorCode
from ficc.execution.host.context.parts import HostContext
from ficc.execution.host.core.codes import HostCode
from ficc.execution.host.core.errors import HostError
from ficc.execution.host.ledger.store import AttemptRecord
from ficc.execution.host.runner.attempts import Attempt, HostWork
from ficc.execution.host.service import reaper

__all__ = ["Deadlines"]

_log = logging.getLogger(__name__)

LIVE_STATES: Final = frozenset({"starting", "running"})


class Deadlines(HostWork):
    """The deadline files of this daemon's live services, and the reaper that reads them."""

    def __init__(self, ctx: HostContext) -> None:
        super().__init__(ctx)
        self._reaper: reaper.Keeper | None = None
        self._deadlines: dict[str, tuple[str, int]] = {}
        """attempt ID -> (service, lease deadline) as last written for the reaper."""
        self._lock = asyncio.Lock()

    def _keeper(self) -> reaper.Keeper:
        if self._reaper is None:
            directory = os.path.join(self._ctx.config.state_dir, "deadlines")
            unit = self._ctx.service.reaper_unit(self._ctx.config.installation_id)
            launch = None if unit is None else functools.partial(self._launch, unit, directory)
            self._reaper = reaper.Keeper(directory, place=self._place, launch=launch)
        return self._reaper

    def _launch(self, unit: str, directory: str, command: list[str]) -> bool:
        """Start the reaper as unit `unit` (see the service backend's `start_reaper`);
        a refusal is an `OSError` to the callers, as a failed spawn is."""
        try:
            started = self._ctx.service.start_reaper(unit, command, directory)
        except HostError as error:
            raise reaper.ReaperUnavailable(str(error)) from error
        if started:
            _log.info("the lease reaper runs as unit %s", unit)
        return started

    def _place(self, pid: int) -> None:
        """Move a reaper just started into a cgroup of its own (see the service
        backend's `place_reaper`); if that fails it still enforces from the daemon's
        cgroup, and the failure is logged."""
        try:
            placed = self._ctx.service.place_reaper(pid)
        except (OSError, HostError) as error:
            _log.error("the lease reaper (pid %d) stays in the daemon's cgroup: %s", pid, error)
            return
        if placed:
            _log.info("the lease reaper (pid %d) runs in %s", pid, ", ".join(placed))

    async def set(self, attempt: Attempt) -> None:
        """Hand the lease deadline to the reaper before the service exists, so the
        service is stopped at the deadline even if this daemon dies or hangs."""
        async with self._lock:
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
                    HostCode.SERVICE_CREATE,
                    f"the lease deadline could not be handed to the reaper ({error}); "
                    "check the state directory",
                ) from error
            self._deadlines[attempt.id] = (attempt.service, lease.deadline_boottime_ns)

    def _moved(self, record: AttemptRecord) -> bool:
        written = self._deadlines.get(record.attempt_id)
        lease = record.lease
        if written is None or lease is None or record.status.state not in LIVE_STATES:
            return False
        return lease.deadline_boottime_ns != written[1]

    async def sync(self, records: Sequence[AttemptRecord]) -> None:
        """Follow moved deadlines (each monitor tick) and keep a reaper running while
        any live service has a deadline; a failure is logged and tried again next tick."""
        error = await self._sync(records)
        if isinstance(error, OSError):
            _log.error("the lease reaper's deadlines could not be updated: %s", error)

    async def renewed(self, records: Sequence[AttemptRecord]) -> frozenset[str]:
        """Hand renewed deadlines to the reaper before the renewal is answered; the
        attempts whose service the reaper had already decided to stop at the old
        deadline are returned (their renewal must be refused `lease_expired`).

        Refuses the answer (`lease_reaper_unavailable`) when the files cannot be
        written or the reaper's decision cannot be known, for the reaper may stop the
        payload at the old deadline. The ledger keeps the renewal, so the same renewal
        sent again writes the files again."""
        error = await self._sync(records, renewal=True)
        if isinstance(error, OSError):
            raise HostError(
                ErrorCode.LEASE_REAPER_UNAVAILABLE,
                f"the renewal is recorded, but the lease reaper's deadline could not be"
                f" moved ({error}), so the payload may still be stopped at the old"
                " deadline: free space in state_dir (or fix its deadlines/ directory),"
                " then send the same renewal again",
            )
        return error

    async def resume(self) -> None:
        """At the daemon's start: a reaper runs whenever any deadline file is there, so
        deadlines written by an earlier daemon stay guarded whatever follows."""
        keeper = self._keeper()

        def ensure() -> None:
            if reaper.any_deadline(keeper.directory):
                keeper.ensure()

        try:
            await self._io(ensure)
        except OSError as error:
            _log.error("the lease reaper could not be started: %s", error)

    async def reaped(self, attempt: Attempt) -> bool:
        """Whether the reaper stopped this attempt's service at its lease deadline."""
        directory = self._keeper().directory
        try:
            found: bool = await self._io(reaper.reaped, directory, attempt.service)
            return found
        except OSError as error:
            _log.warning("attempt %s: reaper evidence unreadable: %s", attempt.id, error)
            return False

    async def _sync(
        self, records: Sequence[AttemptRecord], *, renewal: bool = False
    ) -> OSError | frozenset[str]:
        """One writer at a time, and each moved deadline is read again from the ledger
        under the lock: `records` may be older than a renewal another writer has
        already handed over, and the file must never go back to a stale deadline.
        Returns the attempts the reaper had already decided to stop, or the error.

        For a `renewal`, every renewed live attempt is read again: the monitor may
        have found its service stopped at the old deadline and recorded the expiry
        (cleanup may even have taken its deadline back) between the renewal's commit
        and this hand-over, and such a renewal must be refused as one that came late."""
        async with self._lock:  # also when none is known yet: a first `set` may be writing
            if renewal:
                moved_ids = [r.attempt_id for r in records if r.status.state in LIVE_STATES]
            elif self._deadlines:
                moved_ids = [r.attempt_id for r in records if self._moved(r)]
            else:
                return frozenset()
            fresh = await self._db(self._records, moved_ids) if moved_ids else []
            ended = frozenset(r.attempt_id for r in fresh if renewal and _expiring(r))
            moved = [
                (r.attempt_id, self._deadlines[r.attempt_id][0], r.lease)
                for r in fresh
                if r.lease is not None and self._moved(r)
            ]
            if not moved and not self._deadlines:
                return ended
            keeper = self._keeper()

            def write() -> frozenset[str]:
                keeper.ensure()  # first: a reaper that died deciding is replaced
                return frozenset(
                    attempt_id
                    for attempt_id, service, lease in moved
                    if not reaper.move(
                        keeper.directory,
                        service,
                        lease.boot_id,
                        lease.deadline_boottime_ns,
                        self._ctx.service.planned_cgroups(service),
                    )
                )

            try:
                late: frozenset[str] = await self._io(write)
            except OSError as error:
                return error
            for attempt_id, service, lease in moved:
                self._deadlines[attempt_id] = (service, lease.deadline_boottime_ns)
            return late | ended

    def _records(self, attempt_ids: Sequence[str]) -> list[AttemptRecord]:
        """The current records of `attempt_ids` (a ledger-thread call)."""
        found = (self._ctx.ledger.get(a) for a in attempt_ids)
        return [r for r in found if r is not None]

    async def drop(self, attempt: Attempt) -> None:
        self._deadlines.pop(attempt.id, None)
        try:
            await self._io(self._keeper().drop, attempt.service)
        except OSError as error:
            _log.warning("attempt %s: deadline file not removed: %s", attempt.id, error)


def _expiring(record: AttemptRecord) -> bool:
    """Whether the attempt ends `expired`: recorded so, or being stopped for it."""
    status = record.status
    return status.state == "expired" or status.stop_pending == "expired"
