"""The ledger's tables, its migrations, and how a row maps to a record and back.

SQL is only ever assembled from the constant column names here, never from input.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Final, NamedTuple

import msgspec

from ficc.execution.host.core import lifecycle, records
from ficc.execution.host.core.leases import Lease

STATUS_FIELDS: Final = lifecycle.Status.__struct_fields__
LEASE_FIELDS: Final = Lease.__struct_fields__
HEAD_FIELDS: Final = ("attempt_id", "job_id", "generation", "plan_digest", "offer_revision")
TAIL_FIELDS: Final = ("detail", "slot_id", "created", "updated")
RECORD_FIELDS: Final = HEAD_FIELDS + STATUS_FIELDS + LEASE_FIELDS + TAIL_FIELDS
"""Status columns are named after `lifecycle.Status` fields and lease columns after
`Lease` fields, so a record is read by name (see `record`)."""


def _record_column(name: str) -> str:
    """A column of `attempt_records`: a renewed lease field from `renewals`, the last
    write's ordinal from either table, everything else from `attempts`."""
    if name in LEASE_FIELDS:
        return f"coalesce(renewals.{name}, attempts.{name}) AS {name}"
    if name == "updated":
        return "max(attempts.updated, coalesce(renewals.updated, 0)) AS updated"
    return f"attempts.{name} AS {name}"


RENEWALS: Final = (
    "CREATE TABLE renewals ("
    " attempt_id TEXT PRIMARY KEY REFERENCES attempts (attempt_id),"
    " boot_id TEXT NOT NULL, sequence INTEGER NOT NULL, expires_at_ms INTEGER NOT NULL,"
    " deadline_boottime_ns INTEGER NOT NULL, effective_expires_at_ms INTEGER NOT NULL,"
    " updated INTEGER NOT NULL"
    ") STRICT, WITHOUT ROWID",
    "CREATE TRIGGER renewals_never_deleted BEFORE DELETE ON renewals"
    " BEGIN SELECT RAISE(ABORT, 'renewals are never deleted'); END",
    "CREATE VIEW attempt_records AS SELECT "  # noqa: S608
    + ", ".join(map(_record_column, RECORD_FIELDS))
    + " FROM attempts LEFT JOIN renewals ON renewals.attempt_id = attempts.attempt_id",
)
"""The lease a renewal records, in a narrow table of its own (schema 4), and the view
every record is read through.

Why: an attempt's row holds its plan (about 1 KiB), and SQLite rewrites a whole row,
and its pages in the log, for any change. A renewal of 64 leases rewrote 64 plans:
about 0.9 ms with its commit, against 0.25-0.45 ms for the same leases in a narrow
table. Admission still writes the first lease into the attempt's row (one insert per
attempt, as before); a renewal's lease, once there is one, is the record's lease."""

SCHEMA_VERSION: Final = 6
MIGRATIONS: Final = {
    # from version: the statements that bring a ledger to the next version, in one
    # transaction. Columns are only ever added, with values that are true of every
    # record made before them. A lease recorded before the effective expiry was kept
    # gets its asked expiry as its effective one (the wall-clock time at its receipt
    # is lost); its next renewal records the real one.
    1: (
        "ALTER TABLE attempts ADD COLUMN storage_exhausted INTEGER NOT NULL DEFAULT 0",
        "ALTER TABLE attempts ADD COLUMN log_cut_short INTEGER NOT NULL DEFAULT 0",
        "ALTER TABLE attempts ADD COLUMN effective_expires_at_ms INTEGER",
        "ALTER TABLE attempts ADD COLUMN acknowledged_unknown TEXT",
        "ALTER TABLE attempts ADD COLUMN start_offer_revision INTEGER",
        "UPDATE attempts SET effective_expires_at_ms = expires_at_ms WHERE boot_id IS NOT NULL",
    ),
    # What each attempt used: unknown (NULL, not recorded) for every earlier record.
    2: (
        "ALTER TABLE attempts ADD COLUMN usage_recorded INTEGER NOT NULL DEFAULT 0",
        "ALTER TABLE attempts ADD COLUMN cpu_user_us INTEGER",
        "ALTER TABLE attempts ADD COLUMN cpu_system_us INTEGER",
        "ALTER TABLE attempts ADD COLUMN memory_peak_bytes INTEGER",
        "ALTER TABLE attempts ADD COLUMN oom_kills INTEGER",
        "ALTER TABLE attempts ADD COLUMN processes_peak INTEGER",
        "ALTER TABLE attempts ADD COLUMN storage_bytes_used INTEGER",
        "ALTER TABLE attempts ADD COLUMN storage_inodes_used INTEGER",
        "ALTER TABLE attempts ADD COLUMN wall_ms INTEGER",
    ),
    # Renewed leases in a table of their own; each record keeps its lease until the
    # next renewal writes one there.
    3: RENEWALS,
    # When each record's status last changed: unknown (NULL) for every earlier record.
    4: ("ALTER TABLE attempts ADD COLUMN changed_ms INTEGER",),
    # What each attempt's payload used on its own, apart from its runtime: unknown
    # (NULL) for every earlier record.
    5: (
        "ALTER TABLE attempts ADD COLUMN payload_cpu_user_us INTEGER",
        "ALTER TABLE attempts ADD COLUMN payload_cpu_system_us INTEGER",
        "ALTER TABLE attempts ADD COLUMN payload_memory_peak_bytes INTEGER",
    ),
}


SCHEMA: Final = """
CREATE TABLE meta (
    id INTEGER PRIMARY KEY CHECK (id = 1),
    schema_version INTEGER NOT NULL,
    installation_id TEXT NOT NULL,
    ledger_id TEXT NOT NULL,
    admission_version INTEGER NOT NULL,
    ordinal INTEGER NOT NULL
) STRICT;
CREATE TABLE offer (
    id INTEGER PRIMARY KEY CHECK (id = 1),
    revision INTEGER NOT NULL,
    control TEXT NOT NULL CHECK (control IN ('active', 'paused', 'draining', 'stopped')),
    limits BLOB NOT NULL
) STRICT;
CREATE TABLE attempts (
    attempt_id TEXT PRIMARY KEY,
    job_id TEXT NOT NULL,
    generation INTEGER NOT NULL,
    plan_digest TEXT NOT NULL,
    plan BLOB NOT NULL,
    offer_revision INTEGER NOT NULL,
    state TEXT NOT NULL,
    ready INTEGER NOT NULL,
    preparing INTEGER NOT NULL,
    start_requested INTEGER NOT NULL,
    stop_pending TEXT,
    outcome TEXT,
    reason TEXT,
    exit_code INTEGER,
    cleanup_confirmed INTEGER NOT NULL,
    quarantined INTEGER NOT NULL,
    storage_exhausted INTEGER NOT NULL DEFAULT 0,
    log_cut_short INTEGER NOT NULL DEFAULT 0,
    detail TEXT,
    slot_id TEXT,
    cpu_millis INTEGER NOT NULL,
    memory_bytes INTEGER NOT NULL,
    swap_bytes INTEGER NOT NULL,
    processes INTEGER NOT NULL,
    storage_bytes INTEGER NOT NULL,
    storage_inodes INTEGER NOT NULL,
    devices TEXT NOT NULL,
    boot_id TEXT,
    sequence INTEGER,
    expires_at_ms INTEGER,
    deadline_boottime_ns INTEGER,
    effective_expires_at_ms INTEGER,
    acknowledged_unknown TEXT,
    start_offer_revision INTEGER,
    prepare_result BLOB,
    usage_recorded INTEGER NOT NULL DEFAULT 0,
    cpu_user_us INTEGER,
    cpu_system_us INTEGER,
    memory_peak_bytes INTEGER,
    oom_kills INTEGER,
    processes_peak INTEGER,
    storage_bytes_used INTEGER,
    storage_inodes_used INTEGER,
    wall_ms INTEGER,
    payload_cpu_user_us INTEGER,
    payload_cpu_system_us INTEGER,
    payload_memory_peak_bytes INTEGER,
    created INTEGER NOT NULL,
    updated INTEGER NOT NULL,
    changed_ms INTEGER
) STRICT;
CREATE INDEX attempts_job ON attempts (job_id, generation);
-- Records are never deleted: what admission, starts and recovery look for (the records
-- holding a slot, the active ones) must not cost a scan of every record ever made.
CREATE INDEX attempts_held ON attempts (slot_id)
    WHERE slot_id IS NOT NULL AND state != 'released';
CREATE INDEX attempts_state ON attempts (state);
CREATE TABLE input_objects (
    attempt_id TEXT NOT NULL REFERENCES attempts (attempt_id),
    object_id TEXT NOT NULL,
    name TEXT NOT NULL,
    bytes INTEGER NOT NULL,
    digest TEXT NOT NULL,
    offset INTEGER NOT NULL CHECK (offset BETWEEN 0 AND bytes),
    complete INTEGER NOT NULL CHECK (complete IN (0, 1)),
    failed TEXT,
    identity BLOB,
    PRIMARY KEY (attempt_id, object_id)
) STRICT;
CREATE TRIGGER attempts_never_deleted BEFORE DELETE ON attempts
BEGIN SELECT RAISE(ABORT, 'attempt records are never deleted'); END;
CREATE TRIGGER inputs_never_deleted BEFORE DELETE ON input_objects
BEGIN SELECT RAISE(ABORT, 'input records are never deleted'); END;
CREATE TRIGGER meta_never_deleted BEFORE DELETE ON meta
BEGIN SELECT RAISE(ABORT, 'the ledger identity is never deleted'); END;
CREATE TRIGGER offer_never_deleted BEFORE DELETE ON offer
BEGIN SELECT RAISE(ABORT, 'the offer is never deleted'); END;
CREATE TRIGGER identity_fixed BEFORE UPDATE OF installation_id, ledger_id, admission_version
ON meta BEGIN SELECT RAISE(ABORT, 'the ledger identity never changes'); END;
CREATE TRIGGER fence_fixed BEFORE UPDATE OF attempt_id, job_id, generation, plan_digest, plan
ON attempts BEGIN SELECT RAISE(ABORT, 'an attempt fence never changes'); END;
""" + "".join(f"{statement};\n" for statement in RENEWALS)

# SQL is only ever assembled from the constant column names above, never from input.
SELECT: Final = f"SELECT {', '.join(RECORD_FIELDS)} FROM attempt_records"  # noqa: S608


def _json_object(names: tuple[str, ...]) -> str:
    return "json_object(" + ", ".join(f"'{name}', {name}" for name in names) + ")"


SELECT_AS_ONE: Final = (
    "SELECT json_group_array(json_object("  # noqa: S608
    + ", ".join(f"'{name}', {name}" for name in HEAD_FIELDS + TAIL_FIELDS)
    + f", 'status', {_json_object(STATUS_FIELDS)}"
    + f", 'lease', CASE WHEN boot_id IS NULL THEN NULL ELSE {_json_object(LEASE_FIELDS)} END"
    + ")) FROM attempt_records"
)
"""`SELECT`'s records as ONE row: a JSON array of records shaped as `AttemptRecord`
(see `records_of`).

Python's sqlite3 gives up the GIL for every row it steps; while the event loop or a
worker thread is busy, each row then waits to get it back (up to the interpreter's
switch interval, 5 ms). A batch read of 64 records is one step this way, not 65, and
msgspec builds and checks the records from the JSON in C."""

AMOUNTS: Final = ", ".join(records.RESOURCES + records.STORAGE)
OCCUPANCY_SQL: Final = (
    f"SELECT slot_id, devices, {AMOUNTS} FROM attempts"  # noqa: S608
    " WHERE slot_id IS NOT NULL AND state != 'released'"
)
"""The reservations: every record that holds a slot and is not released."""
STARTED_SQL: Final = f"SELECT {AMOUNTS} FROM attempts WHERE state IN ('starting', 'running')"  # noqa: S608
"""What started attempts hold (start authority)."""
ACTIVE_SQL: Final = f"{SELECT} WHERE state IN ('prepared', 'starting', 'running')"
"""The records a restart must settle."""
INSERT_COLUMNS: Final = (
    RECORD_FIELDS
    + records.RESOURCES
    + records.STORAGE
    + ("devices", "plan", "acknowledged_unknown", "changed_ms")
)
CHANGED_SQL: Final = "SELECT attempt_id, changed_ms FROM attempts WHERE changed_ms IS NOT NULL"
"""When each record's status last changed (wall clock, ms since the epoch; schema 5).
Not part of `AttemptRecord`: only `status` shows it, so the records every request
reads (and the record cache) stay as they were."""


USAGE_COLUMNS: Final = tuple(
    {"storage_bytes": "storage_bytes_used", "storage_inodes": "storage_inodes_used"}.get(n, n)
    for n in records.USAGE_FIELDS
)
"""The column of each `ResourceUsage` figure, in field order (the slot's bytes and
inodes in use are `*_used`: `storage_bytes` and `storage_inodes` are reservations)."""
USAGE_SQL: Final = f"SELECT attempt_id, usage_recorded, {', '.join(USAGE_COLUMNS)} FROM attempts"  # noqa: S608
RECORD_USAGE_SQL: Final = (
    f"UPDATE attempts SET usage_recorded = 1, {', '.join(f'{c} = ?' for c in USAGE_COLUMNS)}"  # noqa: S608
    " WHERE attempt_id = ? AND usage_recorded = 0"
)
"""Write an attempt's usage once: a recorded usage is never overwritten."""
USAGE_TALLY_SQL: Final = (
    "SELECT slot_id, outcome, COUNT(*), SUM(cpu_user_us), SUM(cpu_system_us), SUM(oom_kills)"
    " FROM attempts WHERE outcome IS NOT NULL AND slot_id IS NOT NULL GROUP BY slot_id, outcome"
)
"""Per slot and outcome: attempts, CPU microseconds and OOM kills (the metrics)."""


def usage_row(row: tuple[object, ...]) -> records.RecordedUsage:
    """A row of `USAGE_SQL` without its attempt ID, as a recorded usage."""
    recorded, *figures = row
    usage = records.ResourceUsage(**dict(zip(records.USAGE_FIELDS, figures, strict=True)))  # type: ignore[arg-type]
    return records.RecordedUsage(bool(recorded), usage)


def usage_values(usage: records.ResourceUsage) -> list[object]:
    return [getattr(usage, name) for name in records.USAGE_FIELDS]


def literal(value: object) -> str:
    """The SQL literal of a constant of this module (a status value, never input)."""
    if value is None:
        return "NULL"
    if isinstance(value, bool | int):
        return str(int(value))
    if isinstance(value, str) and value.isidentifier():
        return f"'{value}'"
    raise TypeError(f"no SQL literal for {value!r}")


class Insert(NamedTuple):
    """An INSERT of a new record: its full row (in `INSERT_COLUMNS` order) minus the
    columns the statement fixes as literals, which `bound` drops from the row."""

    sql: str
    bound: Callable[[tuple[object, ...]], tuple[object, ...]]

    @classmethod
    def fixing(cls, fixed: dict[str, object]) -> Insert:
        kept = [i for i, column in enumerate(INSERT_COLUMNS) if column not in fixed]
        values = [literal(fixed[c]) if c in fixed else "?" for c in INSERT_COLUMNS]
        sql = (
            f"INSERT INTO attempts ({', '.join(INSERT_COLUMNS)})"  # noqa: S608
            f" VALUES ({', '.join(values)})"
        )
        return cls(sql, operator.itemgetter(*kept))


ADMITTED: Final = lifecycle.admitted()
"""The status of every new admitted record (a frozen value, shared)."""
INSERT_ANY: Final = Insert.fixing({})
INSERT_ADMITTED: Final = Insert.fixing(msgspec.structs.asdict(ADMITTED) | {"detail": None})
"""The usual new record. Its status and detail are fixed in the statement: the sqlite3
module binds a None or a bool far more slowly than an int or a str (an adapter lookup
each), and they are a third of the columns."""


def _getter(names: tuple[str, ...]) -> Callable[[tuple[object, ...]], tuple[object, ...]]:
    """The values of `names` from a `SELECT` row, in one C call."""
    return operator.itemgetter(*(RECORD_FIELDS.index(name) for name in names))


_OUTER_FIELDS: Final = HEAD_FIELDS + TAIL_FIELDS
_OUTER, _STATUS, _LEASE = map(_getter, (_OUTER_FIELDS, STATUS_FIELDS, LEASE_FIELDS))
_BOOT_ID: Final = RECORD_FIELDS.index("boot_id")


def record(row: tuple[object, ...]) -> records.AttemptRecord:
    """A row of `SELECT` as a record (SQLite integers become booleans where declared).
    Every read of a batch makes one per row: the columns are picked by position."""
    if len(row) != len(RECORD_FIELDS):
        raise ValueError(f"a record row has {len(RECORD_FIELDS)} columns, not {len(row)}")
    fields: dict[str, object] = dict(zip(_OUTER_FIELDS, _OUTER(row), strict=True))
    fields["status"] = dict(zip(STATUS_FIELDS, _STATUS(row), strict=True))
    has_lease = row[_BOOT_ID] is not None
    fields["lease"] = dict(zip(LEASE_FIELDS, _LEASE(row), strict=True)) if has_lease else None
    return msgspec.convert(fields, records.AttemptRecord, strict=False)


_RECORDS: Final = msgspec.json.Decoder(list[records.AttemptRecord], strict=False)


def records_of(cell: str) -> list[records.AttemptRecord]:
    """The records of a `SELECT_AS_ONE` result (its one cell). Not strict, as `record`:
    SQLite's integers become booleans where a field is one."""
    return _RECORDS.decode(cell)


def input_record(row: tuple[object, ...]) -> records.InputRecord:
    names = records.InputRecord.__struct_fields__
    fields = dict(zip(names, row, strict=True))
    if isinstance(fields["identity"], bytes):
        fields["identity"] = msgspec.json.decode(fields["identity"])
    return msgspec.convert(fields, records.InputRecord, strict=False)


def status_values(status: lifecycle.Status) -> list[object]:
    return [getattr(status, name) for name in STATUS_FIELDS]


_RENEWAL_COLUMNS: Final = ("attempt_id", *LEASE_FIELDS, "updated")
_RENEW_INTO: Final = f"INSERT INTO renewals ({', '.join(_RENEWAL_COLUMNS)})"
_RENEW_UPSERT: Final = " ON CONFLICT (attempt_id) DO UPDATE SET " + ", ".join(
    f"{n} = excluded.{n}" for n in _RENEWAL_COLUMNS[1:]
)

RENEW_SQL: Final = f"{_RENEW_INTO} VALUES ({', '.join('?' * len(_RENEWAL_COLUMNS))}){_RENEW_UPSERT}"
"""Record a renewed lease: attempt ID, `lease_values(lease)`, the ordinal."""


def _json_items(count: int) -> list[str]:
    """`json_each`'s `value` (a JSON array) as its first `count` items, SQL values."""
    return [f"json_extract(value, '$[{i}]')" for i in range(count)]


RENEW_AS_ONE_SQL: Final = (
    f"{_RENEW_INTO} SELECT {', '.join(_json_items(len(_RENEWAL_COLUMNS)))}"  # noqa: S608
    f" FROM json_each(?) WHERE true{_RENEW_UPSERT}"
)
"""`RENEW_SQL` for many leases in ONE statement: its one parameter is a JSON array of
`RENEW_SQL`'s parameter lists, written in order. One statement is one step, so
the ledger thread gives up the interpreter's lock once for a batch's writes instead of
once per row (see `SELECT_AS_ONE`). The `WHERE true` tells SQLite's parser that
`ON CONFLICT` belongs to the `INSERT`."""


def lease_values(lease: Lease | None) -> list[object]:
    if lease is None:
        return [None] * len(LEASE_FIELDS)
    return [
        lease.boot_id,
        lease.sequence,
        lease.expires_at_ms,
        lease.deadline_boottime_ns,
        lease.effective_expires_at_ms,
    ]
