"""Admission writes: new attempts judged by `admission` against what one transaction
read, and the absent IDs a controller reconciles.
"""

from __future__ import annotations

import dataclasses
import itertools
import operator
from collections.abc import Sequence
from dataclasses import dataclass

import msgspec

from ficc.execution import plan as planlib
from ficc.execution.errors import ErrorCode
from ficc.execution.host.core import admission, lifecycle
from ficc.execution.host.core.errors import HostError
from ficc.execution.host.core.leases import Lease
from ficc.execution.host.core.records import (
    Admitted,
    AttemptRecord,
    Bindings,
    HostFacts,
    PrepareRow,
    Row,
)
from ficc.execution.host.ledger import schema as ledger_schema
from ficc.execution.host.ledger.queries import Queries
from ficc.execution.host.ledger.schema import ADMITTED
from ficc.execution.host.ledger.transactions import check_batch, spending_reserve


@dataclass
class _Batch:
    """What one admission transaction reads once and updates as it records rows.

    The rows of new records and of their streamed inputs wait in `records` and `inputs`
    and are written together once every row is judged (`Ledger._write_new`): nothing in
    the transaction reads them back from the database, since `known` and `occupancy`
    already account for them.
    """

    ordinal: int
    terms: admission.Terms
    occupancy: admission.Occupancy
    known: admission.Known
    records: list[tuple[ledger_schema.Insert, tuple[object, ...]]] = dataclasses.field(
        default_factory=list
    )
    inputs: list[tuple[object, ...]] = dataclasses.field(default_factory=list)


class Admissions(Queries):
    """Admission: one transaction per batch of plans."""

    def admit_batch(
        self, bindings: Bindings, rows: Sequence[PrepareRow], facts: HostFacts
    ) -> list[Row]:
        """Admit up to 64 plans in one transaction, before any provider call.

        Per row: the existing record of a repeated plan unchanged (same deadline, same
        partial input); `fence_mismatch` without a record (the attempt ID already holds
        another plan); any other refusal, `generation_conflict` and
        `unknown_not_acknowledged` included, as a durable failed record (reason
        admission_rejected, no slot, cleanup confirmed) and a HostError with the
        precise code.
        """
        check_batch(rows)
        encoded = admission.Encoded.each(r.plan for r in rows)
        with self._write(bindings) as ordinal:
            terms = admission.Terms.of(self._offer(), facts.ceiling)
            batch = _Batch(ordinal, terms, self._occupancy(), self._known(encoded))
            self._check_room([p for p in encoded if p.plan.attempt_id not in batch.known.records])
            results: list[Row] = []
            for row, plan in zip(rows, encoded, strict=True):
                try:
                    existing = batch.known.existing(plan)
                except HostError as error:
                    if error.code != ErrorCode.GENERATION_CONFLICT:
                        results.append(error)  # fence_mismatch: the ID holds another plan
                        continue
                    results.append(
                        self._reject_new(
                            plan, row, admission.Rejection(error.code, error.message), batch
                        )
                    )
                    continue
                if existing is not None:
                    results.append(Admitted(existing, new=False))
                else:
                    results.append(self._admit_new(plan, row, facts, batch))
            self._write_new(batch.records, batch.inputs)
        return results

    def _admit_new(
        self, plan: admission.Encoded, row: PrepareRow, facts: HostFacts, batch: _Batch
    ) -> Row:
        """Reserve for a plan never seen before, or record its durable rejection."""
        lease = row.lease
        try:
            admission.check_addressed_here(plan.plan, facts)
            if row.refusal is not None:
                raise admission.Rejection(row.refusal.code, row.refusal.message)
            admission.check_acknowledged(
                row.acknowledged_unknown, batch.known.unacknowledged(plan.plan)
            )
            slot = admission.admissible_slot(plan.plan, lease, batch.terms, facts, batch.occupancy)
        except admission.Rejection as rejection:
            return self._reject_new(plan, row, rejection, batch)
        acknowledged = row.acknowledged_unknown
        record = self._insert(plan, ADMITTED, batch.records, slot_id=slot.id, lease=lease,
                              ordinal=batch.ordinal, acknowledged=acknowledged)  # fmt: skip
        batch.known.add(record, acknowledged)
        batch.occupancy.add(slot, plan.plan.job.limits)
        streamed = plan.plan.streamed_inputs
        batch.inputs += [(record.attempt_id, i.id, i.name, i.bytes, i.digest) for i in streamed]
        return Admitted(record, new=True)

    def _reject_new(
        self,
        plan: admission.Encoded,
        row: PrepareRow,
        rejection: admission.Rejection,
        batch: _Batch,
    ) -> admission.Rejection:
        """Commit the durable rejection of a plan never seen before (no slot, nothing
        acknowledged, cleanup confirmed) and return it with its precise code."""
        status = lifecycle.admission_rejected()
        record = self._insert(plan, status, batch.records, slot_id=None, lease=row.lease,
                              ordinal=batch.ordinal, detail=rejection.code)  # fmt: skip
        batch.known.add(record)
        return rejection

    def reject_absent(self, bindings: Bindings, plans: Sequence[planlib.Plan]) -> list[Row]:
        """Commit failed, never-runnable rejections for plans the host never admitted."""
        return self._record_absent(
            bindings, plans, lifecycle.admission_rejected(), "rejected_absent", as_admission=True
        )

    @spending_reserve
    def reconcile_absent(
        self, bindings: Bindings, plans: Sequence[planlib.Plan], evidence_ok: bool
    ) -> list[Row]:
        """The administrator's acknowledgement that missing attempts have unknown outcomes.

        `evidence_ok` is the daemon's verdict after checking every slot, account,
        attempt directory, service and workload tree; the ledger adds its own: no
        record may still hold a reservation.
        """
        if not evidence_ok:
            raise HostError(
                ErrorCode.RECONCILE_REFUSED,
                "the host is not confirmed idle (live work or retained attempt storage);"
                " clean up, then retry",
            )
        status = lifecycle.absence_acknowledged()
        return self._record_absent(bindings, plans, status, None, require_idle=True)

    def _record_absent(
        self,
        bindings: Bindings,
        plans: Sequence[planlib.Plan],
        status: lifecycle.Status,
        detail: str | None,
        *,
        require_idle: bool = False,
        as_admission: bool = False,
    ) -> list[Row]:
        check_batch(plans)
        if len({p.attempt_id for p in plans}) != len(plans):
            raise HostError(ErrorCode.INVALID_REQUEST, "plans must have distinct attempt IDs")
        encoded = admission.Encoded.each(plans)
        with self._write(bindings) as ordinal:
            if require_idle and self._occupancy().slots:
                raise HostError(
                    ErrorCode.RECONCILE_REFUSED,
                    "the ledger still holds reservations; release them before reconciling",
                )
            known = self._known(encoded)
            if as_admission:
                self._check_room([p for p in encoded if p.plan.attempt_id not in known.records])
            results: list[Row] = []
            new: list[tuple[ledger_schema.Insert, tuple[object, ...]]] = []
            for plan in encoded:
                try:
                    existing = known.existing(plan)
                except HostError as error:
                    results.append(error)
                    continue
                if existing is None:
                    record = self._insert(
                        plan, status, new, slot_id=None, lease=None, ordinal=ordinal, detail=detail
                    )
                    known.add(record)
                    results.append(Admitted(record, new=True))
                else:
                    results.append(Admitted(existing, new=False))
            self._write_new(new, [])
        return results

    def _known(self, plans: Sequence[admission.Encoded]) -> admission.Known:
        """The records a batch can collide with: same attempt IDs or same jobs."""
        ids = [p.plan.attempt_id for p in plans]
        jobs = sorted({p.plan.job_id for p in plans})
        marks = ", ".join("?" * len(ids))
        known = admission.Known({}, {})
        for record in self._select(f"WHERE attempt_id IN ({marks})", ids):
            known.records[record.attempt_id] = record
        marks = ", ".join("?" * len(jobs))
        columns = "job_id, attempt_id, generation, state, outcome, acknowledged_unknown"
        query = f"SELECT {columns} FROM attempts WHERE job_id IN ({marks})"  # noqa: S608
        for job_id, attempt_id, generation, state, outcome, acknowledged in self._db.execute(
            query, jobs
        ):
            done: tuple[str, ...] = ()
            if acknowledged:
                done = tuple(msgspec.json.decode(acknowledged, type=list[str]))
            entry = admission.JobAttempt(attempt_id, generation, state, outcome, done)
            known.jobs.setdefault(job_id, []).append(entry)
        return known

    def _insert(
        self,
        plan: admission.Encoded,
        status: lifecycle.Status,
        pending: list[tuple[ledger_schema.Insert, tuple[object, ...]]],
        *,
        slot_id: str | None,
        lease: Lease | None,
        ordinal: int,
        detail: str | None = None,
        acknowledged: Sequence[str] = (),
    ) -> AttemptRecord:
        """A new record: its row is appended to `pending` (for `_write_new`, in this
        transaction) and its change to the log of this transaction. `acknowledged` is
        what an admitted record's prepare row acknowledged (see `_unacknowledged`)."""
        record = AttemptRecord(
            attempt_id=plan.plan.attempt_id,
            job_id=plan.plan.job_id,
            generation=plan.plan.generation,
            plan_digest=plan.digest,
            offer_revision=plan.plan.offer_revision,
            status=status,
            detail=detail,
            slot_id=slot_id,
            lease=lease,
            created=ordinal,
            updated=ordinal,
        )
        limits = plan.plan.job.limits
        row = (  # in ledger_schema.INSERT_COLUMNS order
            *(record.attempt_id, record.job_id, record.generation, record.plan_digest),
            record.offer_revision,
            *msgspec.structs.astuple(status),
            *ledger_schema.lease_values(lease),
            *(detail, slot_id, ordinal, ordinal),
            *(limits.cpu_millis, limits.memory_bytes, limits.swap_bytes, limits.processes),
            *(limits.storage_bytes, limits.storage_inodes),
            msgspec.json.encode(limits.devices).decode(),
            plan.data,
            msgspec.json.encode(acknowledged).decode() if acknowledged else None,
            self._changed_ms,
        )
        insert = (
            ledger_schema.INSERT_ADMITTED
            if status == ledger_schema.ADMITTED and detail is None
            else ledger_schema.INSERT_ANY
        )
        pending.append((insert, insert.bound(row)))
        self._changed.append((record, "admitted" if status.reason is None else status.reason))
        return record

    def _write_new(
        self,
        records: list[tuple[ledger_schema.Insert, tuple[object, ...]]],
        inputs: list[tuple[object, ...]],
    ) -> None:
        """Insert the records `_insert` collected, in order (one `executemany` per run of
        the same statement), then their streamed inputs, which refer to them."""
        for insert, run in itertools.groupby(records, key=operator.itemgetter(0)):
            self._db.executemany(insert.sql, [values for _, values in run])
        if inputs:
            self._db.executemany(
                "INSERT INTO input_objects VALUES (?, ?, ?, ?, ?, 0, 0, NULL, NULL)", inputs
            )
