"""The ledger's cache of attempt records and staged bytes, kept exact by the database.

Why: `observe` and `renew` read up to 64 records per request, many clients at once,
and building records from SQL rows was the largest share of a request's time on the
interpreter (about a third in a profile of many clients renewing and observing). The
records a client polls rarely change between two of its requests. With every row of
an `observe` cached, the event loop answers it without a trip to the ledger thread,
where it would queue behind renewals' transactions (`read`).

Why it cannot go stale: the ledger is the only writer of its database (it holds the
state directory's exclusive lock for as long as it is open), and every write is one
transaction on its one connection. A TEMP trigger on that connection, which nothing
else sees, notes the ID of every attempt whose row an UPDATE touches, or whose renewed
lease or one of whose input objects' rows an INSERT or UPDATE touches, in a TEMP
table, inside the same transaction, whichever code wrote it. Just before the ledger
commits, it takes those IDs with the number of row writes of each (`touched`); once
the commit has succeeded, the cache drops them, except where the writer reported the
record it wrote (`wrote`: a renewal, a lifecycle step) and the trigger counted exactly
as many writes of that row as were reported: then it keeps that record. A
transaction refused before its commit is rolled back to what the cache holds, and
only the reports go; a commit or a rollback that fails empties the whole cache:
nothing is trusted that the database may not hold.

Reads inside a write transaction may use the cache only until the transaction's first
change (the ledger checks); after it, they read the database.

`read` is the one call made without the ledger's lock, from the event loop (it relies on
CPython's global interpreter lock for each single dictionary lookup): every
change of the cache happens under that lock on the ledger thread, between two steps
of a version counter (odd while changing), and a read that saw the counter odd, or
changed, is given up (a sequence lock). What it returns is the cache at one moment:
the state of the last transaction whose commit has finished, as a read on the ledger
thread would have seen it an instant earlier.
"""

from __future__ import annotations

import contextlib
import sqlite3
from collections.abc import Iterable, Iterator, Sequence
from typing import Final

import msgspec

from ficc.execution.host.core.records import AttemptRecord

RECORDS_MOST: Final = 2048
"""Records kept at most (about 1 KiB each): the oldest kept go first."""

_TOUCHING: Final = " ON CONFLICT (attempt_id) DO UPDATE SET writes = writes + 1; END"
_SETUP: Final = (
    "CREATE TEMP TABLE IF NOT EXISTS touched"
    " (attempt_id TEXT PRIMARY KEY, writes INTEGER NOT NULL) WITHOUT ROWID",
    *(  # constant names only
        f"CREATE TEMP TRIGGER IF NOT EXISTS touched_by_{table}_{event} AFTER {event.upper()}"  # noqa: S608
        f" ON main.{table} BEGIN INSERT INTO touched VALUES ({row}.attempt_id, 1){_TOUCHING}"
        for table, event, row in (
            ("attempts", "update", "old"),
            ("renewals", "insert", "new"),
            ("renewals", "update", "old"),
            ("input_objects", "insert", "new"),
            ("input_objects", "update", "old"),
        )
    ),
)
"""No trigger on a new attempt's row: only records read from the database are kept,
and an attempt's ID is new when its row is inserted (records are never deleted), so
nothing of it can be kept yet. (Staged bytes of an ID not yet admitted can be: its
input objects' rows are counted.) Admission, the busiest insert, pays nothing."""

_TOUCHED: Final = msgspec.json.Decoder(dict[str, int])


class RecordCache:
    """Records by attempt ID, as last committed. Not thread-safe: the ledger's lock
    serializes every call, as it does the connection's."""

    def __init__(self, db: sqlite3.Connection, *, most: int = RECORDS_MOST) -> None:
        self._db = db
        self._most = most
        self._records: dict[str, AttemptRecord] = {}
        self._staged: dict[str, int] = {}
        """Durable streamed bytes by attempt ID (the sum of its objects' offsets)."""
        self._version = 0
        """Even when no change is under way (see `read`)."""
        self._written: dict[str, tuple[AttemptRecord, int]] = {}
        """Records reported written by the open transaction, with their row writes."""
        for statement in _SETUP:
            db.execute(statement)

    def __len__(self) -> int:
        return len(self._records)

    def known(self, attempt_ids: Iterable[str]) -> dict[str, AttemptRecord]:
        """The cached records among `attempt_ids` (unknown IDs are simply absent)."""
        records = self._records
        return {i: records[i] for i in attempt_ids if i in records}

    def known_staged(self, attempt_ids: Iterable[str]) -> dict[str, int]:
        staged = self._staged
        return {i: staged[i] for i in attempt_ids if i in staged}

    def read(self, attempt_ids: Sequence[str]) -> tuple[list[AttemptRecord], list[int]] | None:
        """The records and staged bytes of all these attempts, in order, or None when
        one is not cached or the cache changed meanwhile. Safe without the lock."""
        version = self._version
        if version & 1:
            return None
        records, staged = self._records, self._staged
        try:
            found = [records[i] for i in attempt_ids]
            amounts = [staged[i] for i in attempt_ids]
        except KeyError:
            return None
        return (found, amounts) if self._version == version else None

    def keep(self, records: Iterable[AttemptRecord]) -> None:
        """Keep records just read from the database outside any change of its own."""
        with self._changing():
            kept = self._records
            for record in records:
                kept[record.attempt_id] = record
            self._trim()

    def keep_staged(self, totals: dict[str, int]) -> None:
        """Keep staged bytes just read, as `keep` does records."""
        with self._changing():
            self._staged.update(totals)
            self._trim()

    def began(self) -> None:
        """A write transaction began, or one was rolled back before its commit:
        nothing is reported written."""
        self._written.clear()

    def wrote(self, record: AttemptRecord) -> None:
        """The open transaction just wrote this record with ONE row write (an UPDATE of
        its row): kept once the transaction commits, if no other write touched it."""
        earlier = self._written.get(record.attempt_id)
        self._written[record.attempt_id] = (record, 1 + (earlier[1] if earlier else 0))

    def touched(self) -> dict[str, int]:
        """The attempts the open transaction wrote, each with its number of row writes,
        taken from the TEMP table (emptied in the same transaction). Call it just
        before COMMIT."""
        db = self._db
        (cell,) = db.execute(
            "SELECT json_group_object(attempt_id, writes) FROM temp.touched"
        ).fetchone()
        touched = _TOUCHED.decode(cell)
        if touched:
            db.execute("DELETE FROM temp.touched")
        return touched

    def committed(self, touched: dict[str, int]) -> None:
        """The transaction that wrote `touched` (from `touched()`) is durable. A record
        reported as the only write of its attempt is kept, and so are its staged
        bytes (no input object of it was written); every other touched ID goes."""
        kept, staged, written = self._records, self._staged, self._written
        with self._changing():
            for attempt_id, writes in touched.items():
                reported = written.get(attempt_id)
                if reported is not None and reported[1] == writes:
                    kept[attempt_id] = reported[0]
                else:
                    kept.pop(attempt_id, None)
                    staged.pop(attempt_id, None)
            written.clear()
            self._trim()

    def failed(self) -> None:
        """A write transaction failed (rolled back, or its commit's outcome is not
        known): trust nothing kept."""
        with self._changing():
            self._records.clear()
            self._staged.clear()
            self._written.clear()

    @contextlib.contextmanager
    def _changing(self) -> Iterator[None]:
        self._version += 1
        try:
            yield
        finally:
            self._version += 1

    def _trim(self) -> None:
        for kept in (self._records, self._staged):
            while len(kept) > self._most:
                del kept[next(iter(kept))]


__all__ = ["RECORDS_MOST", "RecordCache"]
