"""The record cache's bookkeeping on a plain SQLite database (no ledger, no root): what
the TEMP trigger counts, which reported records are kept, and the bound."""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator

import msgspec
import pytest

from ficc.execution.host.core import lifecycle
from ficc.execution.host.core.records import AttemptRecord
from ficc.execution.host.ledger.cache import RecordCache


def _record(attempt_id: str, updated: int = 1) -> AttemptRecord:
    status = lifecycle.Status(
        state="prepared", ready=False, preparing=False, start_requested=False,
        stop_pending=None, outcome=None, reason=None, exit_code=None,
        cleanup_confirmed=False, quarantined=False,
    )  # fmt: skip
    return AttemptRecord(
        attempt_id=attempt_id, job_id="j" * 32, generation=1, plan_digest="sha256:" + "a" * 64,
        offer_revision=1, status=status, detail=None, slot_id=None, lease=None, created=1,
        updated=updated,
    )  # fmt: skip


@pytest.fixture
def db() -> Iterator[sqlite3.Connection]:
    connection = sqlite3.connect(":memory:", isolation_level=None)
    connection.execute("CREATE TABLE attempts (attempt_id TEXT PRIMARY KEY, n INTEGER)")
    connection.execute("CREATE TABLE input_objects (attempt_id TEXT, object_id TEXT, n INTEGER)")
    connection.execute("CREATE TABLE renewals (attempt_id TEXT PRIMARY KEY, n INTEGER)")
    connection.executemany("INSERT INTO attempts VALUES (?, 0)", [("a",), ("b",), ("c",)])
    yield connection
    connection.close()


def _write(db: sqlite3.Connection, cache: RecordCache, *sql: str) -> dict[str, int]:
    """One transaction of these statements, committed the way the ledger commits."""
    db.execute("BEGIN IMMEDIATE")
    cache.began()
    for statement in sql:
        db.execute(statement)
    touched = cache.touched()
    db.execute("COMMIT")
    cache.committed(touched)
    return touched


def test_the_trigger_counts_every_row_write_of_the_transaction(db: sqlite3.Connection) -> None:
    """Updates of an attempt's row and writes of its renewal's and its input objects'
    rows, by attempt (a new attempt's row cannot be cached yet)."""
    cache = RecordCache(db)
    touched = _write(
        db,
        cache,
        "UPDATE attempts SET n = 1 WHERE attempt_id = 'a'",
        "UPDATE attempts SET n = 2",
        "INSERT INTO attempts VALUES ('d', 0)",
        "INSERT INTO input_objects VALUES ('c', 'o', 0)",
        "UPDATE input_objects SET n = 1",
        "INSERT INTO renewals VALUES ('b', 1) ON CONFLICT (attempt_id) DO UPDATE SET n = 1",
        "INSERT INTO renewals VALUES ('b', 2) ON CONFLICT (attempt_id) DO UPDATE SET n = 2",
    )
    assert touched == {"a": 2, "b": 3, "c": 3}  # a new attempt row is not counted
    assert _write(db, cache, "UPDATE attempts SET n = 3 WHERE attempt_id = 'b'") == {"b": 1}


def test_a_reported_record_is_kept_only_when_it_was_the_only_write(
    db: sqlite3.Connection,
) -> None:
    cache = RecordCache(db)
    cache.keep([_record("a"), _record("b"), _record("c")])
    db.execute("BEGIN IMMEDIATE")
    cache.began()
    db.execute("UPDATE attempts SET n = 1 WHERE attempt_id = 'a'")
    cache.wrote(_record("a", updated=2))
    db.execute("UPDATE attempts SET n = 1 WHERE attempt_id = 'b'")
    cache.wrote(_record("b", updated=2))
    db.execute("UPDATE attempts SET n = 9 WHERE attempt_id = 'b'")  # not reported
    db.execute("UPDATE attempts SET n = 1 WHERE attempt_id = 'c'")  # not reported
    touched = cache.touched()
    db.execute("COMMIT")
    cache.committed(touched)
    assert cache.known(["a", "b", "c"]) == {"a": _record("a", updated=2)}


def test_a_report_of_a_rolled_back_transaction_is_forgotten(db: sqlite3.Connection) -> None:
    cache = RecordCache(db)
    cache.keep([_record("a")])
    db.execute("BEGIN IMMEDIATE")
    cache.began()
    db.execute("UPDATE attempts SET n = 1 WHERE attempt_id = 'a'")
    cache.wrote(_record("a", updated=2))
    db.execute("ROLLBACK")  # the TEMP table's rows go with it
    assert cache.known(["a"]) == {"a": _record("a")}
    assert _write(db, cache, "UPDATE attempts SET n = 1 WHERE attempt_id = 'b'") == {"b": 1}
    assert cache.known(["a"]) == {"a": _record("a")}


def test_a_failed_transaction_empties_the_cache(db: sqlite3.Connection) -> None:
    cache = RecordCache(db)
    cache.keep([_record("a"), _record("b")])
    cache.failed()
    assert len(cache) == 0


def test_the_cache_keeps_at_most_its_bound_dropping_the_oldest(db: sqlite3.Connection) -> None:
    cache = RecordCache(db, most=2)
    cache.keep([_record("a"), _record("b"), _record("c")])
    assert set(cache.known(["a", "b", "c"])) == {"b", "c"}
    cache.keep([_record("d")])
    assert set(cache.known(["a", "b", "c", "d"])) == {"c", "d"}


def test_cached_records_are_frozen() -> None:
    """Readers share the cached objects: they must not be able to change them."""
    with pytest.raises(AttributeError):
        _record("a").updated = 5  # type: ignore[misc]
    assert msgspec.structs.replace(_record("a"), updated=5).updated == 5
