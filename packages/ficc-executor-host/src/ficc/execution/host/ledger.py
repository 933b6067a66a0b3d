"""The durable ledger: one SQLite database per host.

It holds the installation ID, a random `ledger_id` made once when the file is
created, the offer, and one record per attempt. Records are never deleted (a trigger
refuses it): the fence of an attempt outlives its release. Every state change is one
transaction, and a batch of rows is one transaction, so a crash leaves a batch either
wholly committed or not at all. Durability: WAL with `synchronous=FULL`.

Which state may follow which is decided by `lifecycle`; this module reads a record,
asks the lifecycle, and writes the answer in the same transaction. Admission rules
(slot, resources, devices, generation order, first lease) are here because they need
every other record.

Calls are synchronous and serialized by a lock; the daemon runs them in a thread.

File safety. The state directory is opened component by component without following
symlinks, must be root-owned with no group or other access, and is locked (flock) for
as long as the ledger is open, so a second daemon on the same ledger fails at start.
The ledger file is created with O_CREAT|O_EXCL|O_NOFOLLOW relative to that directory
fd, mode 0600, and checked (regular, root, one link, 0600) through our own fd, which
is closed before SQLite opens the file (closing any fd of a file drops every POSIX
lock the process holds on it, SQLite's included). SQLite has no fd-based open, so it
opens the file again by path, with `mode=rw` so it never creates a file of its own.
That leaves a window: someone able to rename entries in the state directory could
swap the file between our check and SQLite's open. Only root can write that
directory, so the window is open only to root; we still narrow it by checking, after
SQLite has opened the file, that the directory path and the file name still lead to
the exact directory and inode we checked.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import functools
import itertools
import logging
import operator
import os
import secrets
import sqlite3
import stat
import threading
import urllib.parse
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Concatenate, Final, Literal, NamedTuple, ParamSpec, TypeVar

import msgspec

from ficc.execution import plan as planlib
from ficc.execution._executor import canonical_plans
from ficc.execution.errors import ErrorCode
from ficc.execution.host import filesystems, fsutil, leases, ledger_space, lifecycle
from ficc.execution.host.errors import HostError
from ficc.execution.host.leases import Lease, Now
from ficc.execution.host.staging import StreamState
from ficc.execution.protocol import Fence, OfferLimits, Resources

LEDGER_FILE: Final = "ledger.sqlite3"
SCHEMA_VERSION: Final = 2
_MIGRATIONS: Final = {
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
}
ADMISSION_VERSION: Final = 1
PAGE_MAX: Final = 64
BATCH_MAX: Final = planlib.MAX_ROWS

_log = logging.getLogger(__name__)

Control = Literal["active", "paused", "draining", "stopped"]

OFFER_ALLOWS: Final[dict[str, frozenset[str]]] = {
    "active": frozenset({"admit", "start", "renew"}),
    "draining": frozenset({"start", "renew"}),
    "paused": frozenset({"renew"}),
    "stopped": frozenset(),
}
"""What each offer control lets through. Draining finishes admitted work; paused keeps
leases alive but starts nothing; stopped renews nothing, so expiry stops the work."""


# --- record types -------------------------------------------------------------------


class Bindings(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What a controller saves and sends back before any admission (the three bindings)."""

    installation_id: planlib.Identity
    ledger_id: planlib.Identity
    admission_version: Literal[1]


def _current(lease: Lease | None, now: Now) -> bool:
    """The lease rules are `leases`' (one copy); a record without a lease is not current."""
    return lease is not None and leases.is_current(lease, now)


class SlotSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A configured slot, as far as admission needs it."""

    id: planlib.Name
    slot_class: planlib.Name
    storage_bytes: planlib.Count
    storage_inodes: planlib.Count


class HostFacts(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What configuration and the clock say at the moment of admission."""

    slots: list[SlotSpec]
    devices: frozenset[str]
    ceiling: OfferLimits
    now: Now


class Offer(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    revision: planlib.Positive
    control: Control
    limits: OfferLimits


class AttemptRecord(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """One attempt as the ledger holds it (the plan bytes are read separately)."""

    attempt_id: str
    job_id: str
    generation: int
    plan_digest: str
    offer_revision: int
    status: lifecycle.Status
    detail: str | None
    """The precise admission refusal code when status.reason is admission_rejected."""
    slot_id: str | None
    lease: Lease | None
    created: int
    updated: int
    """Ledger ordinals (a counter bumped by every write transaction), not clock times."""

    @property
    def fence(self) -> Fence:
        return Fence(self.attempt_id, self.generation, self.plan_digest)


class InputRecord(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A streamed input object of an attempt and its durable next offset.

    `failed` is the staging refusal that made the object unusable (the attempt cannot
    start); `identity` is the sealed file's identity, recorded at completion, so the
    start pipeline and a restarted daemon can check the file is still the one hashed.
    """

    attempt_id: str
    object_id: str
    name: str
    bytes: int
    digest: str
    offset: int
    complete: bool
    failed: str | None = None
    identity: fsutil.FileIdentity | None = None

    def stream_state(self) -> StreamState:
        """The staging state to register with a `Stager` (after a restart, say)."""
        return StreamState(
            id=self.object_id,
            name=self.name,
            bytes=self.bytes,
            digest=self.digest,
            offset=self.offset,
            complete=self.complete,
            failed=self.failed,
            identity=self.identity,
        )


@dataclass(frozen=True)
class Admitted:
    """A row that returned a record. `new` means this call created it (after `prepare`:
    staging and provider preparation follow); a repeat returns the record unchanged
    with `new` false."""

    record: AttemptRecord
    new: bool


@dataclass(frozen=True)
class PrepareRow:
    """A plan to admit with its granted first lease. `refusal` is a check the caller made
    before the transaction (for example, the provider is unavailable): a new plan with a
    refusal is recorded as a durable admission rejection with that code."""

    plan: planlib.Plan
    lease: Lease
    refusal: HostError | None = None
    acknowledged_unknown: Sequence[str] = ()
    """The prepare row's acknowledgement of the job's earlier unknown attempts."""


@dataclass(frozen=True)
class Applied:
    record: AttemptRecord
    changed: bool


Row = Admitted | HostError


# --- schema -------------------------------------------------------------------------


_SCHEMA: Final = """
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
    created INTEGER NOT NULL,
    updated INTEGER NOT NULL
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
"""
"""Status columns are named after `lifecycle.Status` fields and lease columns after
`Lease` fields, so a record is read by name (see `_record`)."""

_STATUS_FIELDS: Final = lifecycle.Status.__struct_fields__
_LEASE_FIELDS: Final = Lease.__struct_fields__
_HEAD_FIELDS: Final = ("attempt_id", "job_id", "generation", "plan_digest", "offer_revision")
_TAIL_FIELDS: Final = ("detail", "slot_id", "created", "updated")
_RECORD_FIELDS: Final = _HEAD_FIELDS + _STATUS_FIELDS + _LEASE_FIELDS + _TAIL_FIELDS
_RESOURCES: Final = ("cpu_millis", "memory_bytes", "swap_bytes", "processes")
_STORAGE: Final = ("storage_bytes", "storage_inodes")

# SQL is only ever assembled from the constant column names above, never from input.
_SELECT: Final = f"SELECT {', '.join(_RECORD_FIELDS)} FROM attempts"  # noqa: S608
_AMOUNTS: Final = ", ".join(_RESOURCES + _STORAGE)
_OCCUPANCY_SQL: Final = (
    f"SELECT slot_id, devices, {_AMOUNTS} FROM attempts"  # noqa: S608
    " WHERE slot_id IS NOT NULL AND state != 'released'"
)
"""The reservations: every record that holds a slot and is not released."""
_STARTED_SQL: Final = f"SELECT {_AMOUNTS} FROM attempts WHERE state IN ('starting', 'running')"  # noqa: S608
"""What started attempts hold (start authority)."""
_ACTIVE_SQL: Final = f"{_SELECT} WHERE state IN ('prepared', 'starting', 'running')"
"""The records a restart must settle."""
_INSERT_COLUMNS: Final = (
    _RECORD_FIELDS + _RESOURCES + _STORAGE + ("devices", "plan", "acknowledged_unknown")
)


def _literal(value: object) -> str:
    """The SQL literal of a constant of this module (a status value, never input)."""
    if value is None:
        return "NULL"
    if isinstance(value, bool | int):
        return str(int(value))
    if isinstance(value, str) and value.isidentifier():
        return f"'{value}'"
    raise TypeError(f"no SQL literal for {value!r}")


class _Insert(NamedTuple):
    """An INSERT of a new record: its full row (in `_INSERT_COLUMNS` order) minus the
    columns the statement fixes as literals, which `bound` drops from the row."""

    sql: str
    bound: Callable[[tuple[object, ...]], tuple[object, ...]]

    @classmethod
    def fixing(cls, fixed: dict[str, object]) -> _Insert:
        kept = [i for i, column in enumerate(_INSERT_COLUMNS) if column not in fixed]
        values = [_literal(fixed[c]) if c in fixed else "?" for c in _INSERT_COLUMNS]
        sql = (
            f"INSERT INTO attempts ({', '.join(_INSERT_COLUMNS)})"  # noqa: S608
            f" VALUES ({', '.join(values)})"
        )
        return cls(sql, operator.itemgetter(*kept))


_ADMITTED: Final = lifecycle.admitted()
"""The status of every new admitted record (a frozen value, shared)."""
_INSERT_ANY: Final = _Insert.fixing({})
_INSERT_ADMITTED: Final = _Insert.fixing(msgspec.structs.asdict(_ADMITTED) | {"detail": None})
"""The usual new record. Its status and detail are fixed in the statement: the sqlite3
module binds a None or a bool far more slowly than an int or a str (an adapter lookup
each), and they are a third of the columns."""


def _record(row: tuple[object, ...]) -> AttemptRecord:
    """A row of `_SELECT` as a record (SQLite integers become booleans where declared)."""
    columns = dict(zip(_RECORD_FIELDS, row, strict=True))
    fields = {name: columns[name] for name in _HEAD_FIELDS + _TAIL_FIELDS}
    fields["status"] = {name: columns[name] for name in _STATUS_FIELDS}
    has_lease = columns["boot_id"] is not None
    fields["lease"] = {name: columns[name] for name in _LEASE_FIELDS} if has_lease else None
    return msgspec.convert(fields, AttemptRecord, strict=False)


def _input_record(row: tuple[object, ...]) -> InputRecord:
    names = InputRecord.__struct_fields__
    fields = dict(zip(names, row, strict=True))
    if isinstance(fields["identity"], bytes):
        fields["identity"] = msgspec.json.decode(fields["identity"])
    return msgspec.convert(fields, InputRecord, strict=False)


def _status_values(status: lifecycle.Status) -> list[object]:
    return [getattr(status, name) for name in _STATUS_FIELDS]


def _lease_values(lease: Lease | None) -> list[object]:
    if lease is None:
        return [None] * len(_LEASE_FIELDS)
    return [
        lease.boot_id,
        lease.sequence,
        lease.expires_at_ms,
        lease.deadline_boottime_ns,
        lease.effective_expires_at_ms,
    ]


# --- admission arithmetic (pure) ----------------------------------------------------

_COUNTED: Final = ("attempts", *_RESOURCES, *_STORAGE)
"""What admission counts per reservation, in the order it checks them."""


def _amounts(limits: planlib.Limits) -> tuple[int, ...]:
    """What one reservation of `limits` adds, aligned with `_COUNTED`."""
    return (
        1,
        limits.cpu_millis,
        limits.memory_bytes,
        limits.swap_bytes,
        limits.processes,
        limits.storage_bytes,
        limits.storage_inodes,
    )


@dataclass
class _Occupancy:
    """What non-released records with a slot hold: the reservations admission adds to."""

    slots: set[str]
    devices: set[str]
    used: list[int]
    """What they hold of each resource, aligned with `_COUNTED`."""
    free: dict[str, list[SlotSpec]] = dataclasses.field(default_factory=dict)
    """Free slots by class, in configuration order, filled on first use in a batch."""

    def free_of(self, slot_class: str, facts: HostFacts) -> list[SlotSpec]:
        if slot_class not in self.free:
            self.free[slot_class] = [
                s for s in facts.slots if s.slot_class == slot_class and s.id not in self.slots
            ]
        return self.free[slot_class]

    def add(self, slot: SlotSpec, limits: planlib.Limits) -> None:
        self.slots.add(slot.id)
        if slot in self.free.get(slot.slot_class, ()):
            self.free[slot.slot_class].remove(slot)
        self.devices.update(limits.devices)
        self.used = list(map(operator.add, self.used, _amounts(limits)))


class _Rejection(HostError):
    """An admission refusal before any provider call: committed as a failed record."""


AdmissionRejection = _Rejection
"""Public name: a prepare row refused with a durable `admission_rejected` record."""


def _allowed(value: str, offered: list[str] | None, ceiling: list[str] | None) -> bool:
    return (offered is None or value in offered) and (ceiling is None or value in ceiling)


class _Terms(NamedTuple):
    """What every row of one admission transaction is judged against, worked out once:
    the offer, the ceiling, and the tighter of their bounds (aligned with `_COUNTED`)."""

    offer: Offer
    ceiling: OfferLimits
    bounds: tuple[int, ...]

    @classmethod
    def of(cls, offer: Offer, ceiling: OfferLimits) -> _Terms:
        offered, most = offer.limits.resources, ceiling.resources
        bounds = tuple(min(getattr(offered, n), getattr(most, n)) for n in _COUNTED)
        return cls(offer, ceiling, bounds)


def _choose_slot(plan: planlib.Plan, facts: HostFacts, occupancy: _Occupancy) -> SlotSpec:
    """The first free slot of the plan's class that fits its storage and streamed inputs."""
    limits = plan.job.limits
    streamed = sum(i.bytes for i in plan.streamed_inputs)
    for slot in occupancy.free_of(plan.job.slot_class, facts):
        if (
            limits.storage_bytes <= slot.storage_bytes
            and limits.storage_inodes <= slot.storage_inodes
            and streamed <= min(slot.storage_bytes, limits.storage_bytes)
        ):
            return slot
    raise _Rejection(
        ErrorCode.SLOT_CAPACITY,
        f"no free slot of class {plan.job.slot_class!r} fits this plan's storage and inputs;"
        " wait for a release or send a smaller plan",
    )


def _check_acknowledged(acknowledged: Sequence[str], unacknowledged: set[str]) -> None:
    """A job whose earlier attempts ended `unknown` is retried only with an explicit
    acknowledgement of exactly those not yet acknowledged (each is acknowledged once)."""
    if set(acknowledged) == unacknowledged:
        return
    missing, extra = (
        sorted(unacknowledged - set(acknowledged)),
        sorted(set(acknowledged) - unacknowledged),
    )
    raise _Rejection(
        ErrorCode.UNKNOWN_NOT_ACKNOWLEDGED,
        f"acknowledged_unknown must list exactly the job's earlier attempts whose outcome is"
        f" unknown and not yet acknowledged; missing {missing}, not acceptable {extra}:"
        " decide on each unknown attempt (inspect its effects), then prepare a new"
        " attempt that lists them",
    )


def _admissible_slot(
    plan: planlib.Plan, lease: Lease, terms: _Terms, facts: HostFacts, occupancy: _Occupancy
) -> SlotSpec:
    """Every admission check that needs no provider; raises _Rejection or returns a slot."""
    offer, ceiling = terms.offer, terms.ceiling
    if "admit" not in OFFER_ALLOWS[offer.control]:
        raise _Rejection(ErrorCode.OFFER_CLOSED, f"the offer is {offer.control}; try later")
    if plan.offer_revision != offer.revision:
        raise _Rejection(
            ErrorCode.OFFER_REVISION,
            f"the plan was made for offer revision {plan.offer_revision}, the offer is now at"
            f" {offer.revision}; take a new snapshot",
        )
    if not _current(lease, facts.now):
        raise _Rejection(ErrorCode.LEASE_EXPIRED, "the first lease is already past its deadline")
    if not _allowed(plan.project_id, offer.limits.projects, ceiling.projects):
        raise _Rejection(ErrorCode.ADMISSION_REJECTED, "this project is not in the offer")
    if not _allowed(plan.job.runtime.provider, offer.limits.runtimes, ceiling.runtimes):
        raise _Rejection(ErrorCode.ADMISSION_REJECTED, "this runtime is not in the offer")
    limits = plan.job.limits
    for device in limits.devices:
        if device not in facts.devices or device in occupancy.devices:
            raise _Rejection(
                ErrorCode.ADMISSION_REJECTED, f"device {device!r} is not configured or is in use"
            )
    asked = _amounts(limits)
    for name, held, amount, bound in zip(
        _COUNTED, occupancy.used, asked, terms.bounds, strict=True
    ):
        if held + amount > bound:
            raise _Rejection(
                ErrorCode.ADMISSION_REJECTED,
                f"{name}: {held} reserved + {amount} asked > {bound} offered",
            )
    return _choose_slot(plan, facts, occupancy)


def _fits(
    plan: planlib.Plan, offer: Offer, ceiling: OfferLimits | None, started: dict[str, int]
) -> bool:
    """Whether the current offer (and ceiling) still covers starting `plan` now."""
    limits = [offer.limits] + ([ceiling] if ceiling is not None else [])
    for bound in limits:
        if not _allowed(plan.project_id, bound.projects, None):
            return False
        if not _allowed(plan.job.runtime.provider, bound.runtimes, None):
            return False
    wanted = {"attempts": 1} | {n: getattr(plan.job.limits, n) for n in _RESOURCES + _STORAGE}
    for name, amount in wanted.items():
        bound_value = min(getattr(b.resources, name) for b in limits)
        if started[name] + amount > bound_value:
            return False
    return True


def _add_usage(usage: dict[str, int], limits: planlib.Limits, sign: int = 1) -> None:
    usage["attempts"] += sign
    for name in _RESOURCES + _STORAGE:
        usage[name] += sign * getattr(limits, name)


def _within(limits: OfferLimits, ceiling: OfferLimits) -> str | None:
    """Why `limits` exceeds `ceiling`, or None."""
    for name in Resources.__struct_fields__:
        if getattr(limits.resources, name) > getattr(ceiling.resources, name):
            return f"resources.{name} is above the ceiling"
    for name in ("projects", "runtimes"):
        allowed, wanted = getattr(ceiling, name), getattr(limits, name)
        if allowed is not None and (wanted is None or not set(wanted) <= set(allowed)):
            return f"{name} allows more than the ceiling"
    return None


class _Encoded(NamedTuple):
    """A plan with its canonical bytes and digest, computed once outside the transaction."""

    plan: planlib.Plan
    data: bytes
    digest: str

    @classmethod
    def each(cls, plans: Iterable[planlib.Plan]) -> list[_Encoded]:
        plans = list(plans)
        data = canonical_plans(plans)
        return list(map(cls, plans, data, map(planlib.digest_of, data)))


class _JobAttempt(NamedTuple):
    """What admission needs of each earlier attempt of a job."""

    attempt_id: str
    generation: int
    state: str
    outcome: str | None
    acknowledged: tuple[str, ...]
    """The unknown attempts this attempt's admission acknowledged."""


@dataclass
class _Known:
    """The records a batch can collide with, read once and updated as rows are recorded."""

    records: dict[str, AttemptRecord]
    jobs: dict[str, list[_JobAttempt]]
    """job ID -> each of its attempts."""

    def add(self, record: AttemptRecord, acknowledged: Sequence[str] = ()) -> None:
        self.records[record.attempt_id] = record
        status = record.status
        entry = _JobAttempt(
            record.attempt_id, record.generation, status.state, status.outcome, tuple(acknowledged)
        )
        self.jobs.setdefault(record.job_id, []).append(entry)

    def unacknowledged(self, plan: planlib.Plan) -> set[str]:
        """The job's earlier attempts with an `unknown` outcome that no admission has
        acknowledged yet: exactly what the plan's prepare row must acknowledge."""
        attempts = self.jobs.get(plan.job_id, [])
        done = {attempt_id for a in attempts for attempt_id in a.acknowledged}
        return {
            a.attempt_id
            for a in attempts
            if a.generation < plan.generation and a.outcome == "unknown"
        } - done

    def existing(self, plan: _Encoded) -> AttemptRecord | None:
        """The record of a repeated plan, or None if the plan may be recorded; raises
        `fence_mismatch` or `generation_conflict` (the caller decides what to record)."""
        record = self.records.get(plan.plan.attempt_id)
        if record is not None:
            if record.plan_digest != plan.digest or record.generation != plan.plan.generation:
                raise HostError(
                    ErrorCode.FENCE_MISMATCH,
                    "this attempt ID is recorded with another plan; never reuse an attempt ID",
                )
            return record
        for _, generation, state, _, _ in self.jobs.get(plan.plan.job_id, []):
            if generation >= plan.plan.generation:
                raise HostError(
                    ErrorCode.GENERATION_CONFLICT,
                    f"generation {generation} of this job is already recorded; use a higher one",
                )
            if state != "released":
                raise HostError(
                    ErrorCode.GENERATION_CONFLICT,
                    f"generation {generation} of this job is not released yet; release it first",
                )
        return None


class _RenewTerms(NamedTuple):
    """What every row of one renew transaction is judged against."""

    now: Now
    maximum_lease_seconds: int
    offer: Offer
    ordinal: int


@dataclass
class _Batch:
    """What one admission transaction reads once and updates as it records rows.

    The rows of new records and of their streamed inputs wait in `records` and `inputs`
    and are written together once every row is judged (`Ledger._write_new`): nothing in
    the transaction reads them back from the database, since `known` and `occupancy`
    already account for them.
    """

    ordinal: int
    terms: _Terms
    occupancy: _Occupancy
    known: _Known
    records: list[tuple[_Insert, tuple[object, ...]]] = dataclasses.field(default_factory=list)
    inputs: list[tuple[object, ...]] = dataclasses.field(default_factory=list)


# --- the ledger ---------------------------------------------------------------------


def _unsafe(message: str) -> HostError:
    return HostError("ledger_unsafe", message)


def _check_state_dir(dir_fd: int, where: str) -> os.stat_result:
    st = os.fstat(dir_fd)
    if st.st_uid != 0 or stat.S_IMODE(st.st_mode) & 0o077:
        raise _unsafe(
            f"state directory {where} must be owned by root with no group or other access"
            f" (it is uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):o}); chown root and chmod 700"
        )
    return st


def _check_file(st: os.stat_result, name: str) -> None:
    if (
        not stat.S_ISREG(st.st_mode)
        or st.st_uid != 0
        or st.st_nlink != 1
        or stat.S_IMODE(st.st_mode) != 0o600
    ):
        raise _unsafe(
            f"{name} must be a regular root-owned file with one link and mode 600; it is"
            f" {stat.filemode(st.st_mode)} uid {st.st_uid} with {st.st_nlink} links:"
            " investigate before touching it"
        )


def _same(a: os.stat_result, b: os.stat_result) -> bool:
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


class _Full(HostError):
    """A write transaction that failed for lack of space, rolled back: nothing changed."""

    def __init__(self) -> None:
        super().__init__(
            ErrorCode.LEDGER_FULL,
            "the ledger could not record this change (state_dir's filesystem is full or the"
            " ledger reached ledger_max_bytes) and nothing was changed: free space on"
            " state_dir's filesystem or raise ledger_max_bytes, then retry",
        )


_SQLITE_FULL: Final = 13
_SQLITE_IOERR_SHMSIZE: Final = 10 | 19 << 8


def _out_of_space(error: BaseException) -> bool:
    """Whether SQLite failed for lack of space: SQLITE_FULL (the disk, or max_page_count),
    or growing the shared-memory index failed (which it reports as an I/O error)."""
    if not isinstance(error, sqlite3.OperationalError):
        return False
    code = error.sqlite_errorcode
    return code & 0xFF == _SQLITE_FULL or code == _SQLITE_IOERR_SHMSIZE


_P = ParamSpec("_P")
_T = TypeVar("_T")


def _spending_reserve(
    method: Callable[Concatenate[Ledger, _P], _T],
) -> Callable[Concatenate[Ledger, _P], _T]:
    """A write that keeps working when something else filled the disk: when its
    transaction fails for lack of space (rolled back, nothing written), the reserve file
    is deleted and the transaction runs once more. Admission never spends the reserve."""

    @functools.wraps(method)
    def run(self: Ledger, /, *args: _P.args, **kwargs: _P.kwargs) -> _T:
        try:
            return method(self, *args, **kwargs)
        except _Full:
            if not self._drop_reserve():
                raise
        return method(self, *args, **kwargs)

    return run


def _log_change(record: AttemptRecord, cause: str) -> None:
    """One structured log line per committed change of an attempt's record."""
    if not _log.isEnabledFor(logging.INFO):
        return  # skip building the fields of a line nobody keeps
    status = record.status
    _log.info(
        "attempt %s: %s (%s)",
        record.attempt_id,
        status.state,
        cause,
        extra={
            "fields": {
                "event": "attempt_state",
                "attempt_id": record.attempt_id,
                "generation": record.generation,
                "cause": cause,
                "state": status.state,
                "ready": status.ready,
                "outcome": status.outcome,
                "reason": status.reason,
                "exit_code": status.exit_code,
                "slot": record.slot_id,
                "cleanup_confirmed": status.cleanup_confirmed,
            }
        },
    )


def _check_owner_then_migrate(db: sqlite3.Connection, path: str, installation_id: str) -> None:
    """Refuse another installation's ledger or one a newer release wrote, before
    anything is changed; then bring an older one to this schema."""
    row = None
    if db.execute("SELECT 1 FROM sqlite_master WHERE name = 'meta'").fetchone():
        row = db.execute("SELECT schema_version, installation_id FROM meta").fetchone()
    if row is None:
        return  # the constructor refuses a ledger without its identity
    version, owner = row
    if owner != installation_id:
        raise HostError(
            "ledger_installation_mismatch",
            f"{path} belongs to installation {owner}, not {installation_id}; point state_dir"
            " at this installation's ledger",
        )
    if version > SCHEMA_VERSION:
        raise HostError(
            "ledger_schema",
            f"{path} was written by a newer release (schema {version}; this one reads up to"
            f" {SCHEMA_VERSION}); run that release, never an older one, on this ledger",
        )
    _migrate(db)


def _migrate(db: sqlite3.Connection) -> None:
    """Bring a ledger written by an earlier release to this schema, one version per
    transaction; a crash in between leaves a ledger of one version or the next."""
    while db.execute("SELECT 1 FROM sqlite_master WHERE name = 'meta'").fetchone():
        row = db.execute("SELECT schema_version FROM meta").fetchone()
        statements = _MIGRATIONS.get(row[0]) if row is not None else None
        if statements is None:
            return
        db.execute("BEGIN IMMEDIATE")
        try:
            for statement in statements:
                db.execute(statement)
            db.execute("UPDATE meta SET schema_version = ?", (row[0] + 1,))
            db.execute("COMMIT")
        except BaseException:
            db.execute("ROLLBACK")
            raise


class Ledger:
    """The open ledger. Create it once with `create`, then `open` it on every start."""

    def __init__(self, db: sqlite3.Connection, dir_fd: int, path: str) -> None:
        self._db = db
        self._dir_fd = dir_fd
        """Held open, with an exclusive flock, for as long as the ledger is open."""
        self._lock = threading.Lock()
        self._changed: list[tuple[AttemptRecord, str]] = []
        """Records changed by the open transaction, logged once it commits."""
        self.path = path
        self._bounds: ledger_space.SpaceBounds | None = None
        """The configured space bounds (`bound_space`); None: unbounded."""
        self._reserve_spent = False
        """The reserve was deleted to let a write through; made again when there is room."""
        row = None
        if db.execute("SELECT 1 FROM sqlite_master WHERE name = 'meta'").fetchone():
            row = db.execute(
                "SELECT schema_version, installation_id, ledger_id, admission_version FROM meta"
            ).fetchone()
        if row is None or row[0] != SCHEMA_VERSION or row[3] != ADMISSION_VERSION:
            raise HostError(
                "ledger_schema",
                f"{path} has no schema version {SCHEMA_VERSION} identity; restore it from"
                " backup or move it aside and create a new ledger",
            )
        self._bindings = Bindings(row[1], row[2], ADMISSION_VERSION)

    # -- opening --------------------------------------------------------------------

    @classmethod
    def create(
        cls, state_dir: str, installation_id: str, initial_offer: OfferLimits, ceiling: OfferLimits
    ) -> Ledger:
        """Create a new ledger file, exclusively; refuse if anything is at its name.

        A new ledger gets a new random `ledger_id`, even for an unchanged configuration,
        so a controller can tell that earlier admissions are not in it.
        """
        try:
            msgspec.convert(installation_id, planlib.Identity)
        except msgspec.ValidationError as error:
            raise HostError(
                "invalid_installation_id", f"{error}; use the configured 32-hex installation ID"
            ) from error
        if (why := _within(initial_offer, ceiling)) is not None:
            raise HostError(ErrorCode.OFFER_EXCEEDS_CEILING, f"initial offer: {why}")
        dir_fd = _lock_state_dir(state_dir)
        try:
            try:
                fd = fsutil.create_exclusive(dir_fd, LEDGER_FILE, 0o600)
            except HostError as error:
                raise HostError(
                    "ledger_exists",
                    f"{state_dir}/{LEDGER_FILE} cannot be created exclusively ({error.code});"
                    " if a ledger is there, open it instead of creating one",
                ) from error
            checked = _checked_and_closed(fd)
            fsutil.fsync_dir(dir_fd)
            db = _connect(state_dir, dir_fd, checked)
            try:
                db.execute("PRAGMA journal_mode=WAL")
                db.executescript("BEGIN IMMEDIATE;" + _SCHEMA)  # the transaction stays open
                db.execute(
                    "INSERT INTO meta VALUES (1, ?, ?, ?, ?, 0)",
                    (SCHEMA_VERSION, installation_id, secrets.token_hex(16), ADMISSION_VERSION),
                )
                db.execute(
                    "INSERT INTO offer VALUES (1, 1, 'active', ?)",
                    (msgspec.json.encode(initial_offer),),
                )
                db.execute("COMMIT")
            except BaseException:
                db.close()
                raise
            return cls._checked(db, dir_fd, state_dir, installation_id)
        except BaseException:
            os.close(dir_fd)
            raise

    @classmethod
    def open(cls, state_dir: str, installation_id: str) -> Ledger:
        """Open the existing ledger of this installation; refuse any other one."""
        dir_fd = _lock_state_dir(state_dir)
        try:
            try:
                fd = fsutil.open_regular_at(dir_fd, LEDGER_FILE, os.O_RDONLY, owner_uid=0)
            except HostError as error:
                raise HostError(
                    "ledger_missing" if error.code == "not_found" else "ledger_unsafe",
                    f"{state_dir}/{LEDGER_FILE}: {error.message}; create the ledger with the"
                    " daemon's initialization command, or restore it from backup",
                ) from error
            db = _connect(state_dir, dir_fd, _checked_and_closed(fd))
            return cls._checked(db, dir_fd, state_dir, installation_id)
        except BaseException:
            os.close(dir_fd)
            raise

    @classmethod
    def _checked(
        cls, db: sqlite3.Connection, dir_fd: int, state_dir: str, installation_id: str
    ) -> Ledger:
        """The open ledger, once its integrity and installation are confirmed."""
        try:
            mode = db.execute("PRAGMA journal_mode").fetchone()[0]
            if mode != "wal" or db.execute("PRAGMA quick_check").fetchone()[0] != "ok":
                raise HostError(
                    "ledger_corrupt",
                    f"{state_dir}/{LEDGER_FILE} failed its integrity check (journal {mode});"
                    " restore it from backup",
                )
            _check_owner_then_migrate(db, f"{state_dir}/{LEDGER_FILE}", installation_id)
            ledger = cls(db, dir_fd, f"{state_dir}/{LEDGER_FILE}")
        except BaseException:
            db.close()
            raise
        return ledger

    def close(self) -> None:
        """Close the database and release the state directory lock (idempotent)."""
        with self._lock:
            if self._dir_fd >= 0:
                self._db.close()
                os.close(self._dir_fd)
                self._dir_fd = -1

    # -- space ----------------------------------------------------------------------

    def bound_space(self, bounds: ledger_space.SpaceBounds) -> None:
        """Apply the configured space bounds: SQLite's hard limit on the database file,
        admission's check (`_check_room`), and the reserve file, made now if it fits."""
        with self._lock:
            ((page_size,),) = self._db.execute("PRAGMA page_size").fetchall()
            pages = bounds.max_page_count(page_size)
            self._db.execute(f"PRAGMA max_page_count = {pages:d}")
            self._bounds = bounds
            if not ledger_space.make_reserve(self._dir_fd, bounds):
                _log.warning(
                    "no %s in the state directory (too little free space): a full filesystem"
                    " will refuse every ledger write until space is freed",
                    ledger_space.RESERVE_FILE,
                )

    def _check_room(self, plans: Sequence[_Encoded]) -> None:
        """Refuse admission (`ledger_full`) before the ledger or its filesystem passes a
        configured bound, or while the reserve is missing (the space a spent reserve
        freed is for admitted work, not for new records); called inside the admission
        transaction, before any write, with the plans it would record."""
        bounds = self._bounds
        if bounds is None or not plans:
            return
        if self._reserve_spent or not ledger_space.has_reserve(self._dir_fd, bounds.reserve_bytes):
            self._reserve_spent = not ledger_space.make_reserve(self._dir_fd, bounds)
            if self._reserve_spent:
                raise HostError(
                    ErrorCode.LEDGER_FULL,
                    f"admission refused: the ledger's reserve ({ledger_space.RESERVE_FILE},"
                    f" {bounds.reserve_bytes} bytes) is missing and state_dir's filesystem"
                    f" has no room for it above state_dir_min_free_bytes"
                    f" ({bounds.min_free_bytes}): free space on that filesystem",
                )
        ((pages,),) = self._db.execute("PRAGMA page_count").fetchall()
        ((page_size,),) = self._db.execute("PRAGMA page_size").fetchall()
        space = ledger_space.Space(pages * page_size, ledger_space.free_bytes(self._dir_fd))
        wanted = ledger_space.request_bytes(len(p.data) for p in plans)
        why = ledger_space.admission_refusal(space, wanted, bounds)
        if why is not None:
            raise HostError(ErrorCode.LEDGER_FULL, f"admission refused: {why}")

    def _drop_reserve(self) -> bool:
        """Delete the reserve file to free its space (see `_spending_reserve`), unless the
        filesystem has at least that much free: then the write hit `ledger_max_bytes`,
        which the reserve cannot help with."""
        with self._lock:
            if self._dir_fd < 0:
                return False
            size = (
                ledger_space.RESERVE_BYTES if self._bounds is None else self._bounds.reserve_bytes
            )
            if ledger_space.free_bytes(self._dir_fd) >= size:
                return False
            if not ledger_space.drop_reserve(self._dir_fd):
                return False
            self._reserve_spent = True
        _log.warning(
            "the ledger's filesystem is full: %s deleted so the write can be retried;"
            " free space on state_dir's filesystem",
            ledger_space.RESERVE_FILE,
        )
        return True

    def _remake_reserve(self) -> None:
        """After a write that spent the reserve went through, make it again if it fits."""
        if self._reserve_spent and self._bounds is not None:
            self._reserve_spent = not ledger_space.make_reserve(self._dir_fd, self._bounds)

    # -- reading --------------------------------------------------------------------

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
                f"{_SELECT} WHERE attempt_id > ? ORDER BY attempt_id LIMIT ?",
                (after or "", limit + 1),
            ).fetchall()
        records = [_record(r) for r in rows[:limit]]
        return records, (records[-1].attempt_id if len(rows) > limit else None)

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
        return [_fenced_in(records, fence) for fence in fences]

    def reservations(self) -> tuple[set[str], dict[str, int]]:
        """Slots held by unreleased records, and what they reserve per resource."""
        with self._lock:
            occupancy = self._occupancy()
        return set(occupancy.slots), dict(zip(_COUNTED, occupancy.used, strict=True))

    def staged_bytes(self, attempt_ids: Sequence[str]) -> dict[str, int]:
        """Durable streamed bytes per attempt (0 for attempts without streams)."""
        totals = dict.fromkeys(attempt_ids, 0)
        ids = list(totals)
        if not ids:
            return totals
        with self._lock:
            marks = _marks(len(ids))
            rows = self._db.execute(
                f"SELECT attempt_id, sum(offset) FROM input_objects WHERE attempt_id IN ({marks})"  # noqa: S608
                " GROUP BY attempt_id",
                ids,
            ).fetchall()
        totals.update((attempt_id, int(total)) for attempt_id, total in rows)
        return totals

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
                f"SELECT * FROM input_objects WHERE attempt_id IN ({_marks(len(ids))})"  # noqa: S608
                " ORDER BY attempt_id, object_id",
                ids,
            ).fetchall()
        for record in map(_input_record, rows):
            found[record.attempt_id].append(record)
        return found

    # -- admission ------------------------------------------------------------------

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
        _check_batch(rows)
        encoded = _Encoded.each(r.plan for r in rows)
        with self._write(bindings) as ordinal:
            terms = _Terms.of(self._offer(), facts.ceiling)
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
                        self._reject_new(plan, row, _Rejection(error.code, error.message), batch)
                    )
                    continue
                if existing is not None:
                    results.append(Admitted(existing, new=False))
                else:
                    results.append(self._admit_new(plan, row, facts, batch))
            self._write_new(batch.records, batch.inputs)
        return results

    def _admit_new(self, plan: _Encoded, row: PrepareRow, facts: HostFacts, batch: _Batch) -> Row:
        """Reserve for a plan never seen before, or record its durable rejection."""
        lease = row.lease
        try:
            if row.refusal is not None:
                raise _Rejection(row.refusal.code, row.refusal.message)
            _check_acknowledged(row.acknowledged_unknown, batch.known.unacknowledged(plan.plan))
            slot = _admissible_slot(plan.plan, lease, batch.terms, facts, batch.occupancy)
        except _Rejection as rejection:
            return self._reject_new(plan, row, rejection, batch)
        acknowledged = row.acknowledged_unknown
        record = self._insert(plan, _ADMITTED, batch.records, slot_id=slot.id, lease=lease,
                              ordinal=batch.ordinal, acknowledged=acknowledged)  # fmt: skip
        batch.known.add(record, acknowledged)
        batch.occupancy.add(slot, plan.plan.job.limits)
        streamed = plan.plan.streamed_inputs
        batch.inputs += [(record.attempt_id, i.id, i.name, i.bytes, i.digest) for i in streamed]
        return Admitted(record, new=True)

    def _reject_new(
        self, plan: _Encoded, row: PrepareRow, rejection: _Rejection, batch: _Batch
    ) -> _Rejection:
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
            bindings, plans, lifecycle.admission_rejected(), "rejected_absent", admission=True
        )

    @_spending_reserve
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
        admission: bool = False,
    ) -> list[Row]:
        _check_batch(plans)
        if len({p.attempt_id for p in plans}) != len(plans):
            raise HostError(ErrorCode.INVALID_REQUEST, "plans must have distinct attempt IDs")
        encoded = _Encoded.each(plans)
        with self._write(bindings) as ordinal:
            if require_idle and self._occupancy().slots:
                raise HostError(
                    ErrorCode.RECONCILE_REFUSED,
                    "the ledger still holds reservations; release them before reconciling",
                )
            known = self._known(encoded)
            if admission:
                self._check_room([p for p in encoded if p.plan.attempt_id not in known.records])
            results: list[Row] = []
            new: list[tuple[_Insert, tuple[object, ...]]] = []
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

    def _known(self, plans: Sequence[_Encoded]) -> _Known:
        """The records a batch can collide with: same attempt IDs or same jobs."""
        ids = [p.plan.attempt_id for p in plans]
        jobs = sorted({p.plan.job_id for p in plans})
        marks = ", ".join("?" * len(ids))
        records = self._db.execute(f"{_SELECT} WHERE attempt_id IN ({marks})", ids)
        known = _Known({}, {})
        for record in map(_record, records.fetchall()):
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
            entry = _JobAttempt(attempt_id, generation, state, outcome, done)
            known.jobs.setdefault(job_id, []).append(entry)
        return known

    def _insert(
        self,
        plan: _Encoded,
        status: lifecycle.Status,
        pending: list[tuple[_Insert, tuple[object, ...]]],
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
        row = (  # in _INSERT_COLUMNS order
            *(record.attempt_id, record.job_id, record.generation, record.plan_digest),
            record.offer_revision,
            *msgspec.structs.astuple(status),
            *_lease_values(lease),
            *(detail, slot_id, ordinal, ordinal),
            *(limits.cpu_millis, limits.memory_bytes, limits.swap_bytes, limits.processes),
            *(limits.storage_bytes, limits.storage_inodes),
            msgspec.json.encode(limits.devices).decode(),
            plan.data,
            msgspec.json.encode(acknowledged).decode() if acknowledged else None,
        )
        insert = _INSERT_ADMITTED if status == _ADMITTED and detail is None else _INSERT_ANY
        pending.append((insert, insert.bound(row)))
        self._changed.append((record, "admitted" if status.reason is None else status.reason))
        return record

    def _write_new(
        self,
        records: list[tuple[_Insert, tuple[object, ...]]],
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

    def _occupancy(self) -> _Occupancy:
        """The reservations, summed column by column (one row per reserving record)."""
        rows = self._db.execute(_OCCUPANCY_SQL).fetchall()
        # zip(*rows) of no rows has no columns at all, not empty ones
        columns = list(zip(*rows, strict=True)) or [()] * (2 + len(_RESOURCES + _STORAGE))
        slot_ids, device_lists, *amounts = columns
        occupancy = _Occupancy(set(slot_ids), set(), [len(rows), *map(sum, amounts)])
        for devices in device_lists:
            if devices != "[]":
                occupancy.devices.update(msgspec.json.decode(devices, type=list[str]))
        return occupancy

    # -- lifecycle ------------------------------------------------------------------

    @_spending_reserve
    def apply_batch(
        self, rows: Sequence[tuple[Fence, lifecycle.AnyEvent]]
    ) -> list[Applied | HostError]:
        """Apply lifecycle events to up to 64 attempts in one transaction.

        Use `start_batch` for starts: it computes the lease and authority facts
        inside the transaction that records the start.
        """
        _check_batch(rows)
        with self._write() as ordinal:
            records = self._records(fence.attempt_id for fence, _ in rows)
            return [self._apply_one(fence, event, ordinal, records) for fence, event in rows]

    def apply(self, fence: Fence, event: lifecycle.AnyEvent) -> Applied:
        """One event; raises the row's HostError."""
        result = self.apply_batch([(fence, event)])[0]
        if isinstance(result, HostError):
            raise result
        return result

    @_spending_reserve
    def start_batch(
        self, fences: Sequence[Fence], now: Now, ceiling: OfferLimits | None = None
    ) -> list[Applied | HostError]:
        """Record `start` for up to 64 attempts. A row whose `changed` is true is the one
        and only start of that attempt: the caller starts it; otherwise it must not.

        Start authority holds when the current offer's control allows starts (active or
        draining) and the attempt still fits the current offer (and `ceiling`): its
        project and runtime are allowed, and its limits fit within what the offer leaves
        after the attempts already starting or running (`offer_changed` otherwise). A
        `set_offer` since admission that still covers the attempt does not refuse it.
        """
        _check_batch(fences)
        with self._write() as ordinal:
            offer = self._offer()
            started = self._started_usage()
            records = self._records(fence.attempt_id for fence in fences)
            plans = self._plan_blobs(records)
            results: list[Applied | HostError] = []
            for fence in fences:
                record = _fenced_in(records, fence)
                if isinstance(record, HostError):
                    results.append(record)
                    continue
                plan = planlib.decode_plan(plans[fence.attempt_id])
                event = lifecycle.StartRequested(
                    lease_current=_current(record.lease, now),
                    offer_open="start" in OFFER_ALLOWS[offer.control],
                    offer_fits=_fits(plan, offer, ceiling, started),
                )
                result = self._apply_one(fence, event, ordinal, records)
                if isinstance(result, Applied) and result.changed:
                    _add_usage(started, plan.job.limits)
                    self._db.execute(
                        "UPDATE attempts SET start_offer_revision = ? WHERE attempt_id = ?",
                        (offer.revision, fence.attempt_id),
                    )
                results.append(result)
            return results

    def authorize_release(self, fence: Fence, ceiling: OfferLimits | None = None) -> str | None:
        """Check start authority again at the moment the release marker would be written.

        Authority is unchanged when the offer is still at the revision the start was
        accepted under; a later revision keeps it only if it is `active` and still
        covers the attempt beside the other started ones. Otherwise the attempt ends
        `cancelled` in this same transaction, with the reason returned (`offer_closed`:
        paused, stopped or draining since; `offer_changed`: no longer covered), and
        the payload must never be released. None: release it.
        """
        with self._write() as ordinal:
            records = self._records([fence.attempt_id])
            record = _fenced_in(records, fence)
            if isinstance(record, HostError):
                raise record
            offer = self._offer()
            (since,) = self._db.execute(
                "SELECT start_offer_revision FROM attempts WHERE attempt_id = ?",
                (fence.attempt_id,),
            ).fetchone()
            if since == offer.revision:
                return None
            reason = self._lost_authority(record, offer, ceiling)
            if reason is None:
                return None
            result = self._apply_one(
                fence, lifecycle.StartCancelled(reason=reason), ordinal, records
            )
            if isinstance(result, HostError):
                raise result
            return reason

    def _lost_authority(
        self, record: AttemptRecord, offer: Offer, ceiling: OfferLimits | None
    ) -> str | None:
        """Why a changed offer no longer lets this started attempt be released."""
        if offer.control != "active":
            return str(ErrorCode.OFFER_CLOSED)
        plan = planlib.decode_plan(self._plan_blobs([record.attempt_id])[record.attempt_id])
        others = self._started_usage()
        _add_usage(others, plan.job.limits, -1)  # the attempt itself is counted as starting
        if not _fits(plan, offer, ceiling, others):
            return str(ErrorCode.OFFER_CHANGED)
        return None

    def _started_usage(self) -> dict[str, int]:
        """What attempts in `starting` or `running` hold, summed per resource."""
        usage = dict.fromkeys(Resources.__struct_fields__, 0)
        rows = self._db.execute(_STARTED_SQL)
        for amounts in rows:
            usage["attempts"] += 1
            for name, amount in zip(_RESOURCES + _STORAGE, amounts, strict=True):
                usage[name] += amount
        return usage

    def _plan_blobs(self, attempt_ids: Iterable[str]) -> dict[str, bytes]:
        """The plan bytes of these attempts, by ID, in one query."""
        ids = list(attempt_ids)
        rows = self._db.execute(
            f"SELECT attempt_id, plan FROM attempts WHERE attempt_id IN ({_marks(len(ids))})",  # noqa: S608
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
        record = _fenced_in(records, fence)
        if isinstance(record, HostError):
            return record
        try:
            step = lifecycle.apply(record.status, event)
        except HostError as error:
            return error
        if not step.changed:
            return Applied(record, changed=False)
        assignments = ", ".join(f"{name} = ?" for name in _STATUS_FIELDS)
        values = [*_status_values(step.status), ordinal, fence.attempt_id]
        self._db.execute(
            f"UPDATE attempts SET {assignments}, updated = ? WHERE attempt_id = ?",  # noqa: S608
            values,
        )
        if isinstance(event, lifecycle.PrepareOk):
            self._db.execute(
                "UPDATE attempts SET prepare_result = ? WHERE attempt_id = ?",
                (event.result, fence.attempt_id),
            )
        updated = msgspec.structs.replace(record, status=step.status, updated=ordinal)
        records[fence.attempt_id] = updated
        self._changed.append((updated, event.name))
        return Applied(updated, changed=True)

    @_spending_reserve
    def mark_restarted(self) -> list[AttemptRecord]:
        """Apply `DaemonRestarted` to every record, in one transaction, at daemon start.

        Returns the records that changed (uncertain attempts now `unknown`, interrupted
        preparations now `failed`); the monitor then confirms their cleanup.
        """
        with self._write() as ordinal:
            records = {
                record.attempt_id: record
                for record in map(
                    _record,
                    self._db.execute(_ACTIVE_SQL).fetchall(),
                )
            }
            changed = []
            for fence in [record.fence for record in records.values()]:
                result = self._apply_one(fence, lifecycle.DaemonRestarted(), ordinal, records)
                if isinstance(result, Applied) and result.changed:
                    changed.append(result.record)
            return changed

    # -- leases ---------------------------------------------------------------------

    @_spending_reserve
    def renew_batch(
        self, rows: Sequence[tuple[Fence, leases.Renewal]], now: Now, maximum_lease_seconds: int
    ) -> list[Applied | HostError]:
        """Renew up to 64 leases in one transaction, by the rules of `leases.renew`.

        An identical duplicate (same sequence and expiry) keeps the original deadline;
        any other sequence must be strictly higher; an expired lease is never revived.
        """
        _check_batch(rows)
        with self._write() as ordinal:
            offer = self._offer()
            terms = _RenewTerms(now, maximum_lease_seconds, offer, ordinal)
            records = self._records(fence.attempt_id for fence, _ in rows)
            return [self._renew_one(fence, renewal, terms, records) for fence, renewal in rows]

    def _renew_one(
        self,
        fence: Fence,
        renewal: leases.Renewal,
        terms: _RenewTerms,
        records: dict[str, AttemptRecord],
    ) -> Applied | HostError:
        """Renew one row; `records` (this transaction's, by ID) is kept current, so a
        later row of the same attempt sees this one's lease."""
        now, maximum_lease_seconds, offer, ordinal = terms
        record = _fenced_in(records, fence)
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
        self._db.execute(
            "UPDATE attempts SET boot_id = ?, sequence = ?, expires_at_ms = ?,"
            " deadline_boottime_ns = ?, effective_expires_at_ms = ?,"
            " updated = ? WHERE attempt_id = ?",
            [*_lease_values(lease), ordinal, fence.attempt_id],
        )
        updated = msgspec.structs.replace(record, lease=lease, updated=ordinal)
        records[fence.attempt_id] = updated
        return Applied(updated, changed=True)

    # -- streamed inputs ------------------------------------------------------------

    @_spending_reserve
    def commit_input_offset(
        self,
        fence: Fence,
        object_id: str,
        expected_offset: int,
        new_offset: int,
        identity: fsutil.FileIdentity | None = None,
    ) -> InputRecord:
        """Advance an object's durable offset after its bytes are synced (compare-and-set).

        The object is complete exactly when the offset reaches its declared size;
        completeness is derived, never claimed. `identity` is the sealed file's, given
        with the final chunk.
        """
        with self._write() as ordinal:
            current = self._staging_input(fence, object_id, expected_offset)
            if not expected_offset <= new_offset <= current.bytes:
                raise HostError(
                    ErrorCode.INPUT_SIZE_MISMATCH,
                    f"offset {new_offset} is outside {expected_offset}..{current.bytes}",
                )
            complete = new_offset == current.bytes
            kept = identity if complete else None
            self._db.execute(
                "UPDATE input_objects SET offset = ?, complete = ?, identity = ?"
                " WHERE attempt_id = ? AND object_id = ?",
                (new_offset, complete, _identity_blob(kept), fence.attempt_id, object_id),
            )
            self._db.execute(
                "UPDATE attempts SET updated = ? WHERE attempt_id = ?", (ordinal, fence.attempt_id)
            )
            return msgspec.structs.replace(
                current, offset=new_offset, complete=complete, identity=kept
            )

    @_spending_reserve
    def commit_stream(self, fence: Fence, state: StreamState, expected_offset: int) -> InputRecord:
        """Commit what `Stager.write` reports (pass this as its `commit`).

        A failed object is recorded as failed and, in the same transaction, the attempt
        fails (`input_digest_mismatch` or `storage_failed`): it can never start, and it
        follows the normal cleanup and release path.
        """
        if state.failed is None:
            return self.commit_input_offset(
                fence, state.id, expected_offset, state.offset, state.identity
            )
        reason = (
            "input_digest_mismatch"
            if state.failed == "input_digest_mismatch"
            else ("storage_failed")
        )
        with self._write() as ordinal:
            current = self._staging_input(fence, state.id, expected_offset)
            self._db.execute(
                "UPDATE input_objects SET failed = ?, complete = 0"
                " WHERE attempt_id = ? AND object_id = ?",
                (state.failed, fence.attempt_id, state.id),
            )
            records = self._records([fence.attempt_id])
            result = self._apply_one(
                fence, lifecycle.PrepareFailed(reason=reason), ordinal, records
            )
            if isinstance(result, HostError):
                raise result
            return msgspec.structs.replace(current, failed=state.failed, complete=False)

    def _staging_input(self, fence: Fence, object_id: str, expected_offset: int) -> InputRecord:
        """The object, if the attempt is still staging and the offset is still expected."""
        record = self._fenced(fence)
        if record.status.state != "prepared" or record.status.ready or record.status.preparing:
            raise HostError(
                ErrorCode.INVALID_STATE,
                f"inputs are written only while staging; the attempt is {record.status.state}",
            )
        current = self._input(fence.attempt_id, object_id)
        if current.failed is not None:
            raise HostError("input_failed", f"the object failed earlier ({current.failed})")
        if current.complete:
            raise HostError(ErrorCode.INPUT_COMPLETE, "the object is complete and read-only")
        if current.offset != expected_offset:
            raise HostError(
                ErrorCode.INPUT_OFFSET_CHANGED,
                f"the durable offset is {current.offset}, not {expected_offset};"
                " read input_status and continue there",
            )
        return current

    def _input(self, attempt_id: str, object_id: str) -> InputRecord:
        row = self._db.execute(
            "SELECT * FROM input_objects WHERE attempt_id = ? AND object_id = ?",
            (attempt_id, object_id),
        ).fetchone()
        if row is None:
            raise HostError(ErrorCode.INPUT_UNKNOWN, "not a declared streamed input of this plan")
        return _input_record(row)

    # -- the offer ------------------------------------------------------------------

    @_spending_reserve
    def set_offer(
        self,
        expected_revision: int,
        control: Control,
        limits: OfferLimits | None,
        ceiling: OfferLimits,
    ) -> Offer:
        """Change the offer if its revision is still `expected_revision`; bump it."""
        if limits is not None and (why := _within(limits, ceiling)) is not None:
            raise HostError(ErrorCode.OFFER_EXCEEDS_CEILING, f"{why}; offer less")
        with self._write():
            current = self._offer()
            if current.revision != expected_revision:
                raise HostError(
                    ErrorCode.OFFER_REVISION,
                    f"the offer is at revision {current.revision}, not {expected_revision};"
                    " read it again",
                )
            offer = Offer(current.revision + 1, control, limits or current.limits)
            self._db.execute(
                "UPDATE offer SET revision = ?, control = ?, limits = ?",
                (offer.revision, offer.control, msgspec.json.encode(offer.limits)),
            )
            return offer

    # -- internals ------------------------------------------------------------------

    @contextlib.contextmanager
    def _write(self, bindings: Bindings | None = None) -> Iterator[int]:
        """One write transaction; yields this transaction's ordinal.

        With `bindings`, they are checked inside the transaction before any write, so a
        mismatch writes nothing. A transaction that wrote nothing besides its ordinal
        is rolled back instead of committed: no record can refer to that ordinal.
        """
        with self._lock:
            self._changed.clear()
            self._db.execute("BEGIN IMMEDIATE")
            try:
                if bindings is not None and bindings != self._bindings:
                    raise HostError(
                        ErrorCode.BINDINGS_CHANGED,
                        "installation, ledger or admission version differ from this host's;"
                        " take a new snapshot and save its bindings before preparing",
                    )
                ((ordinal,),) = self._db.execute(
                    "UPDATE meta SET ordinal = ordinal + 1 RETURNING ordinal"
                ).fetchall()
                bumped = self._db.total_changes
                yield ordinal
                if self._db.total_changes == bumped:
                    # Nothing but the ordinal was written (say, identical duplicate
                    # renewals): nothing to make durable, so skip the commit and its fsync.
                    self._db.execute("ROLLBACK")
                else:
                    self._db.execute("COMMIT")
            except BaseException as error:
                self._rollback()
                if _out_of_space(error):
                    raise _Full() from error
                raise
            self._remake_reserve()
            changed, self._changed = self._changed, []
            for record, cause in changed:
                _log_change(record, cause)

    def _rollback(self) -> None:
        """End the failed transaction. SQLite may have rolled it back already (it does on
        a full disk), and a ROLLBACK then would fail and hide the real error."""
        self._changed.clear()
        if self._db.in_transaction:
            self._db.execute("ROLLBACK")

    def _get(self, attempt_id: str) -> AttemptRecord | None:
        row = self._db.execute(f"{_SELECT} WHERE attempt_id = ?", (attempt_id,)).fetchone()
        return None if row is None else _record(row)

    def _records(self, attempt_ids: Iterable[str]) -> dict[str, AttemptRecord]:
        """The records of these attempts by ID, read with one query (a batch's rows);
        unknown IDs are simply absent."""
        ids = list(dict.fromkeys(attempt_ids))
        if not ids:
            return {}
        rows = self._db.execute(f"{_SELECT} WHERE attempt_id IN ({_marks(len(ids))})", ids)
        return {record.attempt_id: record for record in map(_record, rows.fetchall())}

    def _fenced(self, fence: Fence) -> AttemptRecord:
        record = _fenced_in(self._records([fence.attempt_id]), fence)
        if isinstance(record, HostError):
            raise record
        return record

    def _offer(self) -> Offer:
        revision, control, limits = self._db.execute(
            "SELECT revision, control, limits FROM offer"
        ).fetchone()
        return Offer(revision, control, msgspec.json.decode(limits, type=OfferLimits))


def _fenced_in(records: dict[str, AttemptRecord], fence: Fence) -> AttemptRecord | HostError:
    """The record of `fence` among a batch's `records`, or why the row is refused."""
    record = records.get(fence.attempt_id)
    if record is None:
        return HostError(ErrorCode.UNKNOWN_ATTEMPT, "no such attempt; prepare it first")
    if record.fence != fence:
        return HostError(
            ErrorCode.FENCE_MISMATCH, "generation or plan digest differ from the record"
        )
    return record


def _marks(count: int) -> str:
    """`?, ?, ...` for an `IN (...)` of `count` values (a batch has at most 64)."""
    return ", ".join("?" * count)


def _identity_blob(identity: fsutil.FileIdentity | None) -> bytes | None:
    return None if identity is None else msgspec.json.encode(identity)


def _check_batch(rows: Sequence[object]) -> None:
    if not 1 <= len(rows) <= BATCH_MAX:
        raise HostError(ErrorCode.INVALID_REQUEST, f"a batch has 1..{BATCH_MAX} rows")


def _lock_state_dir(state_dir: str) -> int:
    """Open and check the state directory, and take its exclusive lock.

    The lock (flock on the directory, independent of SQLite's own POSIX locks) makes a
    second daemon on the same ledger fail at start instead of marking the first one's
    attempts unknown. It is released when the fd is closed or the process dies.
    """
    dir_fd = fsutil.open_dir(state_dir)
    try:
        _check_state_dir(dir_fd, state_dir)
        filesystems.check_local(dir_fd, f"state directory {state_dir}")
        fcntl.flock(dir_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError as error:
        os.close(dir_fd)
        raise HostError(
            "ledger_busy",
            f"another process has the ledger in {state_dir} open; stop the other daemon first",
        ) from error
    except BaseException:
        os.close(dir_fd)
        raise
    return dir_fd


def _checked_and_closed(fd: int) -> os.stat_result:
    """Sync and stat our own fd of the ledger file, then close it before SQLite opens the
    file: closing any fd of a file drops every POSIX lock this process holds on it,
    SQLite's included, which would let another process delete the live WAL."""
    try:
        os.fsync(fd)
        return os.fstat(fd)
    finally:
        os.close(fd)


def _connect(state_dir: str, dir_fd: int, checked: os.stat_result) -> sqlite3.Connection:
    """Open the checked file with SQLite, then prove SQLite opened that same file."""
    _check_file(checked, LEDGER_FILE)
    for suffix in ("-wal", "-shm"):
        with contextlib.suppress(FileNotFoundError):
            _check_file(os.stat(LEDGER_FILE + suffix, dir_fd=dir_fd, follow_symlinks=False),
                        LEDGER_FILE + suffix)  # fmt: skip
    path = f"{state_dir}/{LEDGER_FILE}"
    db = sqlite3.connect(
        f"file:{urllib.parse.quote(path)}?mode=rw",
        uri=True,
        isolation_level=None,
        check_same_thread=False,
    )
    try:
        db.execute("PRAGMA synchronous=FULL")
        db.execute("PRAGMA foreign_keys=ON")
        db.execute("PRAGMA trusted_schema=OFF")
        db.execute("SELECT count(*) FROM sqlite_master").fetchone()
        if not (
            _same(os.stat(state_dir, follow_symlinks=False), os.fstat(dir_fd))
            and _same(os.stat(LEDGER_FILE, dir_fd=dir_fd, follow_symlinks=False), checked)
        ):
            raise _unsafe(f"{path} changed while it was being opened; investigate")
    except BaseException:
        db.close()
        raise
    return db


__all__ = [
    "ADMISSION_VERSION",
    "LEDGER_FILE",
    "OFFER_ALLOWS",
    "PAGE_MAX",
    "AdmissionRejection",
    "Admitted",
    "Applied",
    "AttemptRecord",
    "Bindings",
    "HostFacts",
    "InputRecord",
    "Lease",
    "Ledger",
    "Now",
    "Offer",
    "PrepareRow",
    "SlotSpec",
]
