"""Lifecycle writes: each asks `lifecycle` for the next state and writes the answer in
the same transaction; starts, release authority, restarts, expiry and renewals.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import NamedTuple

import msgspec

from ficc.execution import plan as planlib
from ficc.execution.errors import ErrorCode
from ficc.execution.host.core import admission, leases, lifecycle
from ficc.execution.host.core.errors import HostError
from ficc.execution.host.core.leases import Clock, Now
from ficc.execution.host.core.records import (
    OFFER_ALLOWS,
    RESOURCES,
    STORAGE,
    Applied,
    AttemptRecord,
    Offer,
    ResourceUsage,
    lease_is_current,
)
from ficc.execution.host.ledger import schema as ledger_schema
from ficc.execution.host.ledger.queries import Queries
from ficc.execution.host.ledger.transactions import (
    accepts,
    check_batch,
    fenced_in,
    marks,
    spending_reserve,
)
from ficc.execution.protocol import Fence, OfferLimits, Resources


class _RenewTerms(NamedTuple):
    """What every row of one renew transaction is judged against."""

    now: Now
    maximum_lease_seconds: int
    offer: Offer
    ordinal: int


class Transitions(Queries):
    """State changes of admitted attempts."""

    @spending_reserve
    def apply_batch(
        self,
        rows: Sequence[tuple[Fence, lifecycle.AnyEvent]],
        usage: Mapping[str, ResourceUsage] | None = None,
    ) -> list[Applied | HostError]:
        """Apply lifecycle events to up to 64 attempts in one transaction.

        `usage` (by attempt ID): what an attempt used, recorded in the same transaction
        when its event settles it (once: a recorded usage is never overwritten). Use
        `start_batch` for starts: it computes the lease and authority facts inside the
        transaction that records the start.
        """
        check_batch(rows)
        with self._write() as ordinal:
            records = self._records(fence.attempt_id for fence, _ in rows)
            results = [self._apply_one(fence, event, ordinal, records) for fence, event in rows]
            for result in results:
                if isinstance(result, Applied) and result.changed:
                    used = (usage or {}).get(result.record.attempt_id)
                    if used is not None and result.record.status.state in lifecycle.SETTLED:
                        self._record_usage(result.record.attempt_id, used)
            return results

    def apply(
        self, fence: Fence, event: lifecycle.AnyEvent, usage: ResourceUsage | None = None
    ) -> Applied:
        """One event (and the usage it settles with, see `apply_batch`); raises the
        row's HostError."""
        used = None if usage is None else {fence.attempt_id: usage}
        result = self.apply_batch([(fence, event)], used)[0]
        if isinstance(result, HostError):
            raise result
        return result

    @spending_reserve
    def record_usage(self, fence: Fence, usage: ResourceUsage) -> bool:
        """Record what a settled attempt used, unless a usage is already recorded (then
        nothing changes); whether this call recorded it. For attempts settled without
        their service at hand (a restart, a failed start): cleanup reads it first."""
        with self._write():
            record = self._fenced(fence)
            if record.status.state not in lifecycle.SETTLED:
                raise HostError(
                    ErrorCode.INVALID_STATE,
                    f"usage is recorded when an attempt ends; it is {record.status.state}",
                )
            return self._record_usage(fence.attempt_id, usage)

    def _record_usage(self, attempt_id: str, usage: ResourceUsage) -> bool:
        cursor = self._db.execute(
            ledger_schema.RECORD_USAGE_SQL, [*ledger_schema.usage_values(usage), attempt_id]
        )
        return cursor.rowcount == 1

    @spending_reserve
    def start_batch(
        self,
        fences: Sequence[Fence],
        when: Now | Clock,
        ceiling: OfferLimits | None = None,
        refusals: Mapping[str, HostError] | None = None,
    ) -> list[Applied | HostError]:
        """Record `start` for up to 64 attempts. A row whose `changed` is true is the one
        and only start of that attempt: the caller starts it; otherwise it must not.

        `refusals` (by attempt ID): what the caller found, before this transaction, that
        forbids a start (a staged input changed). A row it would otherwise accept is
        answered with that very HostError instead, and its attempt fails in this
        transaction (`StartRefused`, the refusal's code as the reason): never started,
        cleaned up and released as any failed attempt. A row refused for another reason
        (lease, offer, state) keeps that refusal, and nothing is recorded for it.

        Start authority holds when the current offer's control allows starts (active or
        draining) and the attempt still fits the current offer (and `ceiling`): its
        project and runtime are allowed, and its limits fit within what the offer leaves
        after the attempts already starting or running (`offer_changed` otherwise). A
        `set_offer` since admission that still covers the attempt does not refuse it.
        The lease is judged at `when` read inside the transaction.
        """
        check_batch(fences)
        with self._write() as ordinal:
            now = leases.reading(when)
            offer = self._offer()
            started = self._started_usage()
            records = self._records(fence.attempt_id for fence in fences)
            plans = self._plan_blobs(records)
            results: list[Applied | HostError] = []
            for fence in fences:
                record = fenced_in(records, fence)
                if isinstance(record, HostError):
                    results.append(record)
                    continue
                plan = planlib.decode_plan(plans[fence.attempt_id])
                event = lifecycle.StartRequested(
                    lease_current=lease_is_current(record.lease, now),
                    offer_open="start" in OFFER_ALLOWS[offer.control],
                    offer_fits=admission.fits(plan, offer, ceiling, started),
                )
                refusal = (refusals or {}).get(fence.attempt_id)
                if refusal is not None and accepts(record.status, event):
                    results.append(self._refuse_start(fence, refusal, ordinal, records))
                    continue
                result = self._apply_one(fence, event, ordinal, records)
                if isinstance(result, Applied) and result.changed:
                    admission.add_usage(started, plan.job.limits)
                    self._db.execute(
                        "UPDATE attempts SET start_offer_revision = ? WHERE attempt_id = ?",
                        (offer.revision, fence.attempt_id),
                    )
                results.append(result)
            return results

    def _refuse_start(
        self,
        fence: Fence,
        refusal: HostError,
        ordinal: int,
        records: dict[str, AttemptRecord],
    ) -> HostError:
        """Fail a ready attempt whose start is refused with `refusal` (see `start_batch`)."""
        event = lifecycle.StartRefused(reason=str(refusal.code))  # as a read gives it
        result = self._apply_one(fence, event, ordinal, records)
        return result if isinstance(result, HostError) else refusal

    def authorize_release(
        self,
        fence: Fence,
        when: Now | Clock,
        ceiling: OfferLimits | None = None,
        *,
        release: Callable[[], None] | None = None,
    ) -> str | None:
        """Check start authority again at the moment the release marker is written, and
        write it (`release`) in the same step.

        A stop recorded or a lease run out at `when` (read inside this transaction)
        refuses the release (`stop_pending`, `lease_expired`) and records nothing: the
        monitor stops the service and records the outcome. Checked in this transaction,
        so a stop or a renewal committed at any point before it is seen, and none can
        come between the check and `release`, which runs on the ledger thread inside
        the transaction once every check passed. The clock is read again after
        `release`: a marker that appeared only once the deadline had passed is refused
        all the same (`lease_expired`; the reaper and the monitor stop the payload at
        its deadline, and the attempt ends `expired`).

        Authority is unchanged when the offer is still at the revision the start was
        accepted under; a later revision keeps it only if it is `active` and still
        covers the attempt beside the other started ones. Otherwise the attempt ends
        `cancelled` in this same transaction, with the reason returned (`offer_closed`:
        paused, stopped or draining since; `offer_changed`: no longer covered), and
        the payload must never be released. None: released (or, without `release`,
        it may be).
        """
        with self._write() as ordinal:
            now = leases.reading(when)
            records = self._records([fence.attempt_id])
            record = fenced_in(records, fence)
            if isinstance(record, HostError):
                raise record
            if record.status.stop_pending is not None:
                return "stop_pending"
            if not lease_is_current(record.lease, now):
                return str(ErrorCode.LEASE_EXPIRED)
            offer = self._offer()
            (since,) = self._db.execute(
                "SELECT start_offer_revision FROM attempts WHERE attempt_id = ?",
                (fence.attempt_id,),
            ).fetchone()
            reason = None
            if since != offer.revision:
                reason = self._lost_authority(record, offer, ceiling)
            if reason is not None:
                result = self._apply_one(
                    fence, lifecycle.StartCancelled(reason=reason), ordinal, records
                )
                if isinstance(result, HostError):
                    raise result
                return reason
            if release is None:
                return None
            release()
            if not lease_is_current(record.lease, leases.reading(when)):
                return str(ErrorCode.LEASE_EXPIRED)
            return None

    def _lost_authority(
        self, record: AttemptRecord, offer: Offer, ceiling: OfferLimits | None
    ) -> str | None:
        """Why a changed offer no longer lets this started attempt be released."""
        if offer.control != "active":
            return str(ErrorCode.OFFER_CLOSED)
        plan = planlib.decode_plan(self._plan_blobs([record.attempt_id])[record.attempt_id])
        others = self._started_usage()
        admission.add_usage(
            others, plan.job.limits, -1
        )  # the attempt itself is counted as starting
        if not admission.fits(plan, offer, ceiling, others):
            return str(ErrorCode.OFFER_CHANGED)
        return None

    def _started_usage(self) -> dict[str, int]:
        """What attempts in `starting` or `running` hold, summed per resource."""
        usage = dict.fromkeys(Resources.__struct_fields__, 0)
        rows = self._db.execute(ledger_schema.STARTED_SQL)
        for amounts in rows:
            usage["attempts"] += 1
            for name, amount in zip(RESOURCES + STORAGE, amounts, strict=True):
                usage[name] += amount
        return usage

    def _plan_blobs(self, attempt_ids: Iterable[str]) -> dict[str, bytes]:
        """The plan bytes of these attempts, by ID, in one query."""
        ids = list(attempt_ids)
        rows = self._db.execute(
            f"SELECT attempt_id, plan FROM attempts WHERE attempt_id IN ({marks(len(ids))})",  # noqa: S608
            ids,
        ).fetchall()
        return {attempt_id: bytes(plan) for attempt_id, plan in rows}

    def _apply_one(
        self,
        fence: Fence,
        event: lifecycle.AnyEvent,
        ordinal: int,
        records: dict[str, AttemptRecord],
    ) -> Applied | HostError:
        """Apply one event; `records` (this transaction's, by ID) is kept current."""
        record = fenced_in(records, fence)
        if isinstance(record, HostError):
            return record
        try:
            step = lifecycle.apply(record.status, event)
        except HostError as error:
            return error
        if not step.changed:
            return Applied(record, changed=False)
        columns = [*ledger_schema.STATUS_FIELDS, "updated", "changed_ms"]
        status = ledger_schema.status_values(step.status)
        values: list[object] = [*status, ordinal, self._changed_ms]
        if isinstance(event, lifecycle.PrepareOk):  # the same one row write
            columns.append("prepare_result")
            values.append(event.result)
        assignments = ", ".join(f"{name} = ?" for name in columns)
        self._db.execute(
            f"UPDATE attempts SET {assignments} WHERE attempt_id = ?",  # noqa: S608
            [*values, fence.attempt_id],
        )
        updated = msgspec.structs.replace(record, status=step.status, updated=ordinal)
        records[fence.attempt_id] = updated
        self._wrote(updated)
        self._changed.append((updated, event.name))
        return Applied(updated, changed=True)

    def _wrote(self, record: AttemptRecord) -> None:
        """`record` is what one UPDATE of its row just wrote (for the record cache)."""
        if self._cache is not None:
            self._cache.wrote(record)

    @spending_reserve
    def mark_restarted(self) -> list[AttemptRecord]:
        """Apply `DaemonRestarted` to every record, in one transaction, at daemon start.

        Returns the records that changed (uncertain attempts now `unknown`, interrupted
        preparations now `failed`); the monitor then confirms their cleanup.
        """
        with self._write() as ordinal:
            records = {
                record.attempt_id: record
                for record in map(
                    ledger_schema.record,
                    self._db.execute(ledger_schema.ACTIVE_SQL).fetchall(),
                )
            }
            changed = []
            for fence in [record.fence for record in records.values()]:
                result = self._apply_one(fence, lifecycle.DaemonRestarted(), ordinal, records)
                if isinstance(result, Applied) and result.changed:
                    changed.append(result.record)
            return changed

    @spending_reserve
    def expire(self, fence: Fence, when: Now | Clock) -> Applied | None:
        """Record `LeaseExpired` if the lease has run out at `when`, read inside this
        transaction; None (nothing recorded) when the lease is current, say renewed
        after the monitor read the record. Only then may the caller stop the work."""
        with self._write() as ordinal:
            records = self._records([fence.attempt_id])
            record = fenced_in(records, fence)
            if isinstance(record, HostError):
                raise record
            if lease_is_current(record.lease, leases.reading(when)):
                return None
            result = self._apply_one(fence, lifecycle.LeaseExpired(), ordinal, records)
            if isinstance(result, HostError):
                raise result
            return result

    def renew_batch(
        self,
        rows: Sequence[tuple[Fence, leases.Renewal]],
        when: Now | Clock,
        maximum_lease_seconds: int,
    ) -> list[Applied | HostError]:
        """Renew up to 64 leases in one transaction, by the rules of `leases.renew`.

        An identical duplicate (same sequence and expiry) keeps the original deadline;
        any other sequence must be strictly higher; an expired lease is never revived:
        every row is judged at `when` read inside the transaction, so a lease that ran
        out while the request waited for the ledger is not renewed.
        """
        (results,) = self.renew_batches([rows], when, maximum_lease_seconds)
        return results

    @spending_reserve
    def renew_batches(
        self,
        batches: Sequence[Sequence[tuple[Fence, leases.Renewal]]],
        when: Now | Clock,
        maximum_lease_seconds: int,
    ) -> list[list[Applied | HostError]]:
        """Several requests' `renew_batch`es in ONE transaction and one commit (group
        commit), each judged as if it came alone right after the ones before it."""
        for rows in batches:
            check_batch(rows)
        with self._write() as ordinal:
            now = leases.reading(when)
            offer = self._offer()
            terms = _RenewTerms(now, maximum_lease_seconds, offer, ordinal)
            records = self._records(fence.attempt_id for rows in batches for fence, _ in rows)
            writes: list[list[object]] = []
            results = [
                [self._renew_one(fence, renewal, terms, records, writes) for fence, renewal in rows]
                for rows in batches
            ]
            if writes and self._as_one:
                rows_json = msgspec.json.encode(writes).decode()
                self._db.execute(ledger_schema.RENEW_AS_ONE_SQL, (rows_json,))
            elif writes:
                self._db.executemany(ledger_schema.RENEW_SQL, writes)
            return results

    def _renew_one(
        self,
        fence: Fence,
        renewal: leases.Renewal,
        terms: _RenewTerms,
        records: dict[str, AttemptRecord],
        writes: list[list[object]],
    ) -> Applied | HostError:
        """Renew one row; `records` (this transaction's, by ID) is kept current, so a
        later row of the same attempt sees this one's lease. The row's write is added
        to `writes`, which the transaction then writes in order, in one statement."""
        now, maximum_lease_seconds, offer, ordinal = terms
        record = fenced_in(records, fence)
        if isinstance(record, HostError):
            return record
        held = record.lease
        if record.status.state not in lifecycle.ACTIVE or held is None:
            return HostError(
                ErrorCode.INVALID_STATE,
                f"the attempt is {record.status.state}; only active attempts hold leases",
            )
        try:
            lease = leases.renew(held, renewal, now, maximum_lease_seconds)
        except HostError as error:
            return error
        if lease == held:
            return Applied(record, changed=False)
        if "renew" not in OFFER_ALLOWS[offer.control]:
            return HostError(ErrorCode.OFFER_CLOSED, f"the offer is {offer.control}")
        writes.append([fence.attempt_id, *ledger_schema.lease_values(lease), ordinal])
        updated = msgspec.structs.replace(record, lease=lease, updated=ordinal)
        records[fence.attempt_id] = updated
        self._wrote(updated)
        return Applied(updated, changed=True)
