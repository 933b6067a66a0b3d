"""The ledger's connection and its transactions: one lock, one write transaction at a
time, the record cache kept exact, the change log, and the space reserve a write may
spend when the disk is full.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import logging
import os
import sqlite3
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Concatenate, Final, ParamSpec, TypeVar

import msgspec

from ficc.execution import plan as planlib
from ficc.execution.errors import ErrorCode
from ficc.execution.host.core import admission, lifecycle
from ficc.execution.host.core.codes import HostCode
from ficc.execution.host.core.errors import HostError
from ficc.execution.host.core.records import (
    AttemptRecord,
    Bindings,
    Offer,
)
from ficc.execution.host.ledger import schema as ledger_schema
from ficc.execution.host.ledger import space as ledger_space
from ficc.execution.host.ledger.cache import RecordCache
from ficc.execution.host.ledger.files import (
    ADMISSION_VERSION,
    LEDGER_FILE,
    has_json,
    mount_point,
    unreadable_schema,
)
from ficc.execution.host.ledger.schema import SCHEMA_VERSION
from ficc.execution.host.linux import fsutil
from ficc.execution.protocol import Fence, OfferLimits

PAGE_MAX: Final = 64
BATCH_MAX: Final = planlib.MAX_ROWS
_log = logging.getLogger("ficc.execution.host.ledger")


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
_L = TypeVar("_L", bound="Transactions")


def spending_reserve(
    method: Callable[Concatenate[_L, _P], _T],
) -> Callable[Concatenate[_L, _P], _T]:
    """A write that keeps working when something else filled the disk: when its
    transaction fails for lack of space (rolled back, nothing written), the reserve file
    is deleted and the transaction runs once more. Admission never spends the reserve."""

    @functools.wraps(method)
    def run(self: _L, /, *args: _P.args, **kwargs: _P.kwargs) -> _T:
        try:
            return method(self, *args, **kwargs)
        except _Full:
            if not self._drop_reserve():
                raise
        return method(self, *args, **kwargs)

    return run


def _log_reserve_spent() -> None:
    _log.warning(
        "the ledger's filesystem is full: %s deleted so the write can be retried;"
        " free space on state_dir's filesystem",
        ledger_space.RESERVE_FILE,
    )


def no_space(error: BaseException) -> bool:
    """Whether opening or creating the ledger failed for lack of space (bytes or inodes),
    whether SQLite or the daemon's own file calls met it (`fsutil` wraps the OSError)."""
    if isinstance(error, HostError) and isinstance(error.__cause__, OSError):
        error = error.__cause__
    if isinstance(error, OSError):
        return error.errno in (errno.ENOSPC, errno.EDQUOT)
    return _out_of_space(error)


def spending_reserve_to_start(
    dir_fd: int, state_dir: str, done: str, start: Callable[[], _L], *, spend: bool = True
) -> _L:
    """`start()` (open or create, under the lock on `dir_fd`); when it fails for lack of
    space, spend the reserve and run it once more, as a write at runtime would. The
    ledger then starts with its reserve spent, so admission stays closed until there
    is room to make it again. Still no space: `ledger_full`, naming the filesystem."""
    try:
        return start()
    except Exception as error:
        if not no_space(error):
            raise
        first = error
    if not (spend and ledger_space.drop_reserve(dir_fd)):
        raise _full_at_start(dir_fd, state_dir, done, spent=False) from first
    _log_reserve_spent()
    try:
        ledger = start()
    except Exception as error:
        if not no_space(error):
            raise
        raise _full_at_start(dir_fd, state_dir, done, spent=True) from error
    ledger._reserve_spent = True
    return ledger


def _full_at_start(dir_fd: int, state_dir: str, done: str, *, spent: bool) -> HostError:
    free = ledger_space.free_bytes(dir_fd)
    spending = f" even after deleting {ledger_space.RESERVE_FILE}" if spent else ""
    return HostError(
        ErrorCode.LEDGER_FULL,
        f"{state_dir}/{LEDGER_FILE} cannot be {done}{spending}: state_dir's filesystem"
        f" (mounted at {mount_point(state_dir)}) is full ({free} bytes free); free space on"
        " that filesystem, then start the daemon again",
    )


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


def fenced_in(records: dict[str, AttemptRecord], fence: Fence) -> AttemptRecord | HostError:
    """The record of `fence` among a batch's `records`, or why the row is refused."""
    record = records.get(fence.attempt_id)
    if record is None:
        return HostError(ErrorCode.UNKNOWN_ATTEMPT, "no such attempt; prepare it first")
    if record.fence != fence:
        return HostError(
            ErrorCode.FENCE_MISMATCH, "generation or plan digest differ from the record"
        )
    return record


def accepts(status: lifecycle.Status, event: lifecycle.AnyEvent) -> bool:
    """Whether the lifecycle would accept `event` and change the status."""
    try:
        return lifecycle.apply(status, event).changed
    except HostError:
        return False


def marks(count: int) -> str:
    """`?, ?, ...` for an `IN (...)` of `count` values (a batch has at most 64)."""
    return ", ".join("?" * count)


def identity_blob(identity: fsutil.FileIdentity | None) -> bytes | None:
    return None if identity is None else msgspec.json.encode(identity)


def check_batch(rows: Sequence[object]) -> None:
    if not 1 <= len(rows) <= BATCH_MAX:
        raise HostError(ErrorCode.INVALID_REQUEST, f"a batch has 1..{BATCH_MAX} rows")


class Transactions:
    """The open connection: its lock, its write transaction and the reads every part shares."""

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
        self._as_one = has_json(db)
        """Batch reads come back as one JSON row (`ledger_schema.SELECT_AS_ONE`), and a
        renewal's writes go in as one JSON parameter (`ledger_schema.RENEW_AS_ONE_SQL`),
        where this SQLite has its JSON functions (3.38 and newer always do); else row by
        row."""
        row = None
        if db.execute("SELECT 1 FROM sqlite_master WHERE name = 'meta'").fetchone():
            row = db.execute(
                "SELECT schema_version, installation_id, ledger_id, admission_version FROM meta"
            ).fetchone()
        if row is None or row[0] != SCHEMA_VERSION or row[3] != ADMISSION_VERSION:
            raise HostError(HostCode.LEDGER_SCHEMA, unreadable_schema(path, row))
        self._bindings = Bindings(row[1], row[2], ADMISSION_VERSION)
        # Only now: its TEMP triggers need this ledger's tables.
        self._cache = RecordCache(db) if self._as_one else None
        """Records as last committed (see `record_cache`); it needs the JSON functions."""
        self._unchanged: int | None = None
        """In a write transaction: `total_changes` before its first change."""
        self._changed_ms = 0
        """In a write transaction: the wall clock when it began (ms since the epoch), the
        time a status it changes is recorded with (`changed_ms`, what `status` shows)."""

    def close(self) -> None:
        """Close the database and release the state directory lock (idempotent)."""
        with self._lock:
            if self._cache is not None:
                self._cache.failed()  # `cached` answers nothing once closed
            if self._dir_fd >= 0:
                self._db.close()
                os.close(self._dir_fd)
                self._dir_fd = -1

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

    def _check_room(self, plans: Sequence[admission.Encoded]) -> None:
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
        """Delete the reserve file to free its space (see `spending_reserve`), unless the
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
        _log_reserve_spent()
        return True

    def _remake_reserve(self) -> None:
        """After a write that spent the reserve went through, make it again if it fits."""
        if self._reserve_spent and self._bounds is not None:
            self._reserve_spent = not ledger_space.make_reserve(self._dir_fd, self._bounds)

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
            committing = False
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
                bumped = self._unchanged = self._db.total_changes
                self._changed_ms = time.time_ns() // 1_000_000
                if self._cache is not None:
                    self._cache.began()
                yield ordinal
                if self._db.total_changes == bumped:
                    # Nothing but the ordinal was written (say, identical duplicate
                    # renewals): nothing to make durable, so skip the commit and its fsync.
                    self._db.execute("ROLLBACK")
                elif self._cache is None:
                    self._db.execute("COMMIT")
                else:
                    touched = self._cache.touched()
                    committing = True
                    self._db.execute("COMMIT")
                    self._cache.committed(touched)
            except BaseException as error:
                self._abandoned(committing)
                if _out_of_space(error):
                    raise _Full() from error
                raise
            finally:
                self._unchanged = None
            self._remake_reserve()
            changed, self._changed = self._changed, []
            for record, cause in changed:
                _log_change(record, cause)

    def _abandoned(self, committing: bool) -> None:
        """End a transaction that raised. Before its COMMIT (a refusal, a full disk),
        the rollback leaves the database as the cache has it: only what the writer
        reported goes. A failed COMMIT, or a failure after it, or a rollback that
        fails, leaves an outcome the cache cannot know: it is emptied."""
        cache = self._cache
        if cache is not None:
            if committing:
                cache.failed()
            else:
                cache.began()
        try:
            self._rollback()
        except BaseException:
            if cache is not None:
                cache.failed()
            raise

    def _rollback(self) -> None:
        """End the failed transaction. SQLite may have rolled it back already (it does on
        a full disk), and a ROLLBACK then would fail and hide the real error."""
        self._changed.clear()
        if self._db.in_transaction:
            self._db.execute("ROLLBACK")

    def _get(self, attempt_id: str) -> AttemptRecord | None:
        return self._records([attempt_id]).get(attempt_id)

    def _records(self, attempt_ids: Iterable[str]) -> dict[str, AttemptRecord]:
        """The records of these attempts by ID, from the cache where it may be used and
        with one query for the rest (a batch's rows); unknown IDs are simply absent."""
        ids = list(dict.fromkeys(attempt_ids))
        cache = self._usable_cache()
        found = cache.known(ids) if cache is not None else {}
        ids = [i for i in ids if i not in found]
        if ids:
            read = self._select(f"WHERE attempt_id IN ({marks(len(ids))})", ids)
            found.update((record.attempt_id, record) for record in read)
            if cache is not None:
                cache.keep(read)
        return found

    def _usable_cache(self) -> RecordCache | None:
        """The record cache where it holds what a read would: outside a write
        transaction, or inside one before its first change."""
        if self._unchanged is None or self._db.total_changes == self._unchanged:
            return self._cache
        return None

    def _select(self, where: str, parameters: Sequence[object]) -> list[AttemptRecord]:
        """The records `where` selects, in one result row where SQLite can (see
        `ledger_schema.SELECT_AS_ONE`)."""
        if self._as_one:
            (cell,) = self._db.execute(
                f"{ledger_schema.SELECT_AS_ONE} {where}", parameters
            ).fetchone()
            return ledger_schema.records_of(cell)
        rows = self._db.execute(f"{ledger_schema.SELECT} {where}", parameters).fetchall()
        return list(map(ledger_schema.record, rows))

    def _fenced(self, fence: Fence) -> AttemptRecord:
        record = fenced_in(self._records([fence.attempt_id]), fence)
        if isinstance(record, HostError):
            raise record
        return record

    def _offer(self) -> Offer:
        revision, control, limits = self._db.execute(
            "SELECT revision, control, limits FROM offer"
        ).fetchone()
        return Offer(revision, control, msgspec.json.decode(limits, type=OfferLimits))
