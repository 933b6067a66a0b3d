"""The ledger's reads: records, pages, usage, tallies, reservations and inputs."""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from ficc.execution.host.core import admission
from ficc.execution.host.core.errors import HostError
from ficc.execution.host.core.records import (
    RESOURCES,
    STORAGE,
    AttemptRecord,
    Bindings,
    InputRecord,
    Offer,
    RecordedUsage,
)
from ficc.execution.host.ledger import schema as ledger_schema
from ficc.execution.host.ledger.transactions import PAGE_MAX, Transactions, fenced_in, marks
from ficc.execution.protocol import Fence


class Queries(Transactions):
    """Reads, each under the ledger's lock."""

    def bindings(self) -> Bindings:
        return self._bindings

    def offer(self) -> Offer:
        with self._lock:
            return self._offer()

    def get(self, attempt_id: str) -> AttemptRecord | None:
        with self._lock:
            return self._get(attempt_id)

    def plan_bytes(self, attempt_id: str) -> bytes | None:
        """The canonical plan bytes exactly as admitted."""
        with self._lock:
            row = self._db.execute(
                "SELECT plan FROM attempts WHERE attempt_id = ?", (attempt_id,)
            ).fetchone()
        return None if row is None else bytes(row[0])

    def prepare_result(self, attempt_id: str) -> bytes | None:
        with self._lock:
            row = self._db.execute(
                "SELECT prepare_result FROM attempts WHERE attempt_id = ?", (attempt_id,)
            ).fetchone()
        return None if row is None or row[0] is None else bytes(row[0])

    def page(
        self, after: str | None = None, limit: int = PAGE_MAX
    ) -> tuple[list[AttemptRecord], str | None]:
        """Up to `limit` records ordered by attempt ID after `after`, and the next cursor."""
        limit = max(1, min(limit, PAGE_MAX))
        with self._lock:
            rows = self._db.execute(
                f"{ledger_schema.SELECT} WHERE attempt_id > ? ORDER BY attempt_id LIMIT ?",
                (after or "", limit + 1),
            ).fetchall()
        records = [ledger_schema.record(r) for r in rows[:limit]]
        return records, (records[-1].attempt_id if len(rows) > limit else None)

    def usage_of(self, attempt_ids: Sequence[str]) -> dict[str, RecordedUsage]:
        """The recorded usage of each of these attempts (one query; unknown IDs absent)."""
        ids = list(dict.fromkeys(attempt_ids))
        if not ids:
            return {}
        with self._lock:
            rows = self._db.execute(
                f"{ledger_schema.USAGE_SQL} WHERE attempt_id IN ({marks(len(ids))})", ids
            ).fetchall()
        return {str(row[0]): ledger_schema.usage_row(row[1:]) for row in rows}

    def changed_times(self, attempt_ids: Sequence[str]) -> dict[str, int]:
        """When each of these attempts' status last changed (ms since the epoch); an
        attempt whose record predates schema 5, or an unknown ID, is absent."""
        ids = list(dict.fromkeys(attempt_ids))
        if not ids:
            return {}
        with self._lock:
            rows = self._db.execute(
                f"{ledger_schema.CHANGED_SQL} AND attempt_id IN ({marks(len(ids))})", ids
            ).fetchall()
        return {str(attempt_id): int(changed) for attempt_id, changed in rows}

    def usage_tally(self) -> list[tuple[str, str, int, int, int]]:
        """(slot, outcome, attempts, CPU microseconds, OOM kills) for every slot and
        outcome of the records that held a slot and settled (figures not read count 0)."""
        with self._lock:
            rows = self._db.execute(ledger_schema.USAGE_TALLY_SQL).fetchall()
        return [
            (str(slot), str(outcome), int(n), int(user or 0) + int(system or 0), int(oom or 0))
            for slot, outcome, n, user, system, oom in rows
        ]

    def tally(self) -> list[tuple[str, str | None, str | None, bool, int]]:
        """(state, outcome, reason, cleanup confirmed, records) for every combination
        present: the figures the metrics report, in one aggregate query."""
        with self._lock:
            rows = self._db.execute(
                "SELECT state, outcome, reason, cleanup_confirmed, COUNT(*) FROM attempts"
                " GROUP BY state, outcome, reason, cleanup_confirmed"
            ).fetchall()
        return [(str(s), o, r, bool(c), int(n)) for s, o, r, c, n in rows]

    def fenced(self, fences: Sequence[Fence]) -> list[AttemptRecord | HostError]:
        """The record of each fence, or `unknown_attempt` / `fence_mismatch` (one query)."""
        with self._lock:
            records = self._records(f.attempt_id for f in fences)
        return [fenced_in(records, fence) for fence in fences]

    def reservations(self) -> tuple[set[str], dict[str, int]]:
        """Slots held by unreleased records, and what they reserve per resource."""
        with self._lock:
            occupancy = self._occupancy()
        return set(occupancy.slots), dict(zip(admission.COUNTED, occupancy.used, strict=True))

    def staged_bytes(self, attempt_ids: Sequence[str]) -> dict[str, int]:
        """Durable streamed bytes per attempt (0 for attempts without streams)."""
        with self._lock:
            cache = self._usable_cache()
            found = cache.known_staged(attempt_ids) if cache is not None else {}
            totals = {i: 0 for i in attempt_ids if i not in found}
            ids = list(totals)
            if ids:
                placeholders = marks(len(ids))
                rows = self._db.execute(
                    f"SELECT attempt_id, sum(offset) FROM input_objects"  # noqa: S608
                    f" WHERE attempt_id IN ({placeholders}) GROUP BY attempt_id",
                    ids,
                ).fetchall()
                totals.update((attempt_id, int(total)) for attempt_id, total in rows)
                if cache is not None:
                    cache.keep_staged(totals)
        return found | totals

    def cached(
        self, fences: Sequence[Fence]
    ) -> tuple[list[AttemptRecord | HostError], dict[str, int]] | None:
        """What `fenced` and `staged_bytes` would answer for these fences, from the
        record cache alone, or None when one is not cached. Unlike every other call it
        takes no lock: the event loop answers a poll of cached records with it, without
        queueing behind the ledger thread's transactions (see `record_cache`)."""
        ids = [f.attempt_id for f in fences]
        read = None if self._cache is None else self._cache.read(ids)
        if read is None:
            return None
        records = dict(zip(ids, read[0], strict=True))
        return [fenced_in(records, f) for f in fences], dict(zip(ids, read[1], strict=True))

    def inputs(self, attempt_id: str) -> list[InputRecord]:
        return self.inputs_of([attempt_id])[attempt_id]

    def inputs_of(self, attempt_ids: Sequence[str]) -> dict[str, list[InputRecord]]:
        """The streamed inputs of each attempt, ordered by object ID (one query)."""
        found: dict[str, list[InputRecord]] = {attempt_id: [] for attempt_id in attempt_ids}
        ids = list(found)
        if not ids:
            return found
        with self._lock:
            rows = self._db.execute(
                f"SELECT * FROM input_objects WHERE attempt_id IN ({marks(len(ids))})"  # noqa: S608
                " ORDER BY attempt_id, object_id",
                ids,
            ).fetchall()
        for record in map(ledger_schema.input_record, rows):
            found[record.attempt_id].append(record)
        return found

    def _occupancy(self) -> admission.Occupancy:
        """The reservations, summed column by column (one row per reserving record)."""
        rows = self._db.execute(ledger_schema.OCCUPANCY_SQL).fetchall()
        # zip(*rows) of no rows has no columns at all, not empty ones
        columns = list(zip(*rows, strict=True)) or [()] * (2 + len(RESOURCES + STORAGE))
        slot_ids, device_lists, *amounts = columns
        occupancy = admission.Occupancy(set(slot_ids), set(), [len(rows), *map(sum, amounts)])
        for devices in device_lists:
            if devices != "[]":
                occupancy.devices.update(msgspec.json.decode(devices, type=list[str]))
        return occupancy
