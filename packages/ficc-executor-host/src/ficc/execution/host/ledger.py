"""The durable ledger: one SQLite database per host.

It holds the installation ID, a random `ledger_id` made once when the file is
created, the offer, and one record per attempt. Records are never deleted (a trigger
refuses it): the fence of an attempt outlives its release. Every state change is one
transaction, and a batch of rows is one transaction, so a crash leaves a batch either
wholly committed or not at all. Durability: WAL with `synchronous=FULL`.

Which state may follow which is decided by `lifecycle`; this module reads a record,
asks the lifecycle, and writes the answer in the same transaction. Whether a plan is
admissible (slot, resources, devices, generation order, first lease) is decided by
`admission` from what the transaction read; the record types are in `records`, the
tables and how a row maps to a record in `ledger_schema`.

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
import errno
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
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Concatenate, Final, NamedTuple, ParamSpec, TypeVar

import msgspec

from ficc.execution import plan as planlib
from ficc.execution.errors import ErrorCode
from ficc.execution.host import (
    admission,
    filesystems,
    fsutil,
    leases,
    ledger_schema,
    ledger_space,
    lifecycle,
)
from ficc.execution.host.admission import AdmissionRejection
from ficc.execution.host.codes import HostCode
from ficc.execution.host.errors import HostError
from ficc.execution.host.leases import Clock, Lease, Now
from ficc.execution.host.ledger_schema import ADMITTED, SCHEMA_VERSION
from ficc.execution.host.record_cache import RecordCache
from ficc.execution.host.records import (
    OFFER_ALLOWS,
    RESOURCES,
    STORAGE,
    Admitted,
    Applied,
    AttemptRecord,
    Bindings,
    HostFacts,
    InputRecord,
    Offer,
    PrepareRow,
    RecordedUsage,
    ResourceUsage,
    Row,
    SlotSpec,
    StreamState,
    lease_is_current,
)
from ficc.execution.protocol import Fence, OfferLimits, Resources
from ficc.execution.wire import Control

LEDGER_FILE: Final = "ledger.sqlite3"
_SIDECARS: Final = tuple(LEDGER_FILE + suffix for suffix in ("-wal", "-shm", "-journal"))
ADMISSION_VERSION: Final = 1
PAGE_MAX: Final = 64
BATCH_MAX: Final = planlib.MAX_ROWS

_log = logging.getLogger(__name__)


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
    terms: admission.Terms
    occupancy: admission.Occupancy
    known: admission.Known
    records: list[tuple[ledger_schema.Insert, tuple[object, ...]]] = dataclasses.field(
        default_factory=list
    )
    inputs: list[tuple[object, ...]] = dataclasses.field(default_factory=list)


# --- the ledger ---------------------------------------------------------------------


def _unsafe(message: str) -> HostError:
    return HostError(HostCode.LEDGER_UNSAFE, message)


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


def _log_reserve_spent() -> None:
    _log.warning(
        "the ledger's filesystem is full: %s deleted so the write can be retried;"
        " free space on state_dir's filesystem",
        ledger_space.RESERVE_FILE,
    )


def _no_space(error: BaseException) -> bool:
    """Whether opening or creating the ledger failed for lack of space (bytes or inodes),
    whether SQLite or the daemon's own file calls met it (`fsutil` wraps the OSError)."""
    if isinstance(error, HostError) and isinstance(error.__cause__, OSError):
        error = error.__cause__
    if isinstance(error, OSError):
        return error.errno in (errno.ENOSPC, errno.EDQUOT)
    return _out_of_space(error)


def _spending_reserve_to_start(
    dir_fd: int, state_dir: str, done: str, start: Callable[[], Ledger], *, spend: bool = True
) -> Ledger:
    """`start()` (open or create, under the lock on `dir_fd`); when it fails for lack of
    space, spend the reserve and run it once more, as a write at runtime would. The
    ledger then starts with its reserve spent, so admission stays closed until there
    is room to make it again. Still no space: `ledger_full`, naming the filesystem."""
    try:
        return start()
    except Exception as error:
        if not _no_space(error):
            raise
        first = error
    if not (spend and ledger_space.drop_reserve(dir_fd)):
        raise _full_at_start(dir_fd, state_dir, done, spent=False) from first
    _log_reserve_spent()
    try:
        ledger = start()
    except Exception as error:
        if not _no_space(error):
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
        f" (mounted at {_mount_point(state_dir)}) is full ({free} bytes free); free space on"
        " that filesystem, then start the daemon again",
    )


def _mount_point(path: str) -> str:
    """The mount point of the filesystem holding `path` (for messages; `path` itself if
    it cannot be found)."""
    try:
        device = os.stat(path).st_dev
        while (parent := os.path.dirname(path)) != path and os.stat(parent).st_dev == device:
            path = parent
    except OSError:
        pass
    return path


def _remove_new(dir_fd: int, names: Sequence[str]) -> None:
    """Remove files a failed `create` made, durably, so the next start finds no ledger
    (rather than an empty or half-made one it would refuse as corrupt)."""
    for name in names:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(name, dir_fd=dir_fd)
    try:
        fsutil.fsync_dir(dir_fd)
    except OSError as error:
        _log.warning("the state directory could not be synced after a failed create: %s", error)


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
            HostCode.LEDGER_INSTALLATION_MISMATCH,
            f"{path} belongs to installation {owner}, not {installation_id}; point state_dir"
            " at this installation's ledger",
        )
    if version > SCHEMA_VERSION:
        raise HostError(
            HostCode.LEDGER_SCHEMA,
            f"{path} was written by a newer release (schema {version}; this one reads up to"
            f" {SCHEMA_VERSION}); run that release, never an older one, on this ledger",
        )
    _migrate(db)


def _migrate(db: sqlite3.Connection) -> None:
    """Bring a ledger written by an earlier release to this schema, one version per
    transaction; a crash in between leaves a ledger of one version or the next."""
    while db.execute("SELECT 1 FROM sqlite_master WHERE name = 'meta'").fetchone():
        row = db.execute("SELECT schema_version FROM meta").fetchone()
        statements = ledger_schema.MIGRATIONS.get(row[0]) if row is not None else None
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


def _unreadable_schema(path: str, row: tuple[Any, ...] | None) -> str:
    """Why this release cannot open the ledger, and what to do: never to delete it, since
    it holds every attempt ID this host admitted."""
    if row is None:
        found = "holds no ledger identity (it is not a ficc ledger, or it is damaged)"
        fix = "restore it from a backup"
    else:
        found = f"has schema version {row[0]}, admission version {row[3]}"
        fix = "a newer release wrote it: install that release again, or restore it from a backup"
    return (
        f"{path} {found}; this release reads schema version {SCHEMA_VERSION}, admission "
        f"version {ADMISSION_VERSION}. {fix}. Do not delete it: it holds every attempt ID "
        "this host admitted"
    )


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
        self._as_one = _has_json(db)
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
            raise HostError(HostCode.LEDGER_SCHEMA, _unreadable_schema(path, row))
        self._bindings = Bindings(row[1], row[2], ADMISSION_VERSION)
        # Only now: its TEMP triggers need this ledger's tables.
        self._cache = RecordCache(db) if self._as_one else None
        """Records as last committed (see `record_cache`); it needs the JSON functions."""
        self._unchanged: int | None = None
        """In a write transaction: `total_changes` before its first change."""

    # -- opening --------------------------------------------------------------------

    @classmethod
    def create(
        cls,
        state_dir: str,
        installation_id: str,
        initial_offer: OfferLimits,
        ceiling: OfferLimits,
        control: Control = "active",
    ) -> Ledger:
        """Create a new ledger file, exclusively; refuse if anything is at its name.

        A new ledger gets a new random `ledger_id`, even for an unchanged configuration,
        so a controller can tell that earlier admissions are not in it. The offer's
        first revision has `control`, in the same transaction as the ledger itself: a
        ledger is never there with an offer more open than the configured one.
        """
        try:
            msgspec.convert(installation_id, planlib.Identity)
        except msgspec.ValidationError as error:
            raise HostError(
                HostCode.INVALID_INSTALLATION_ID,
                f"{error}; use the configured 32-hex installation ID",
            ) from error
        if (why := admission.within(initial_offer, ceiling)) is not None:
            raise HostError(ErrorCode.OFFER_EXCEEDS_CEILING, f"initial offer: {why}")
        dir_fd = _lock_state_dir(state_dir)
        try:
            return _spending_reserve_to_start(
                dir_fd,
                state_dir,
                "created",
                lambda: cls._create_locked(
                    dir_fd, state_dir, installation_id, initial_offer, control
                ),
            )
        except BaseException:
            os.close(dir_fd)
            raise

    @classmethod
    def _create_locked(
        cls,
        dir_fd: int,
        state_dir: str,
        installation_id: str,
        initial_offer: OfferLimits,
        control: Control,
    ) -> Ledger:
        """`create` under the state directory's lock. A failure after the file was made
        removes what it made, so no half-made ledger is ever taken for a lost one."""
        sidecars = [n for n in _SIDECARS if not fsutil.exists_at(dir_fd, n)]
        try:
            fd = fsutil.create_exclusive(dir_fd, LEDGER_FILE, 0o600)
        except HostError as error:
            if _no_space(error):
                raise
            raise HostError(
                HostCode.LEDGER_EXISTS,
                f"{state_dir}/{LEDGER_FILE} cannot be created exclusively ({error.code});"
                " if a ledger is there, open it instead of creating one",
            ) from error
        try:
            checked = _checked_and_closed(fd)
            fsutil.fsync_dir(dir_fd)
            db = _connect(state_dir, dir_fd, checked)
            try:
                db.execute("PRAGMA journal_mode=WAL")
                db.executescript(
                    "BEGIN IMMEDIATE;" + ledger_schema.SCHEMA
                )  # the transaction stays open
                db.execute(
                    "INSERT INTO meta VALUES (1, ?, ?, ?, ?, 0)",
                    (
                        SCHEMA_VERSION,
                        installation_id,
                        secrets.token_hex(16),
                        ADMISSION_VERSION,
                    ),
                )
                db.execute(
                    "INSERT INTO offer VALUES (1, 1, ?, ?)",
                    (control, msgspec.json.encode(initial_offer)),
                )
                db.execute("COMMIT")
            except BaseException:
                db.close()
                raise
            return cls._checked(db, dir_fd, state_dir, installation_id)
        except BaseException:
            _remove_new(dir_fd, [LEDGER_FILE, *sidecars])
            raise

    @classmethod
    def open(cls, state_dir: str, installation_id: str, *, spend_reserve: bool = True) -> Ledger:
        """Open the existing ledger of this installation; refuse any other one.

        Opening writes: SQLite makes its write-ahead log and shared-memory index again
        (a clean stop deletes them). On a full filesystem the reserve is spent for that,
        as for any other write, unless `spend_reserve` is False (a check that must change
        nothing): then a full filesystem is refused with `ledger_full`.
        """
        dir_fd = _lock_state_dir(state_dir)
        try:
            return _spending_reserve_to_start(
                dir_fd,
                state_dir,
                "opened",
                lambda: cls._open_locked(dir_fd, state_dir, installation_id),
                spend=spend_reserve,
            )
        except BaseException:
            os.close(dir_fd)
            raise

    @classmethod
    def _open_locked(cls, dir_fd: int, state_dir: str, installation_id: str) -> Ledger:
        """`open` under the state directory's lock."""
        try:
            fd = fsutil.open_regular_at(dir_fd, LEDGER_FILE, os.O_RDONLY, owner_uid=0)
        except HostError as error:
            if error.code != ErrorCode.NOT_FOUND:  # its message already says what to fix
                raise HostError(
                    HostCode.LEDGER_UNSAFE, f"{state_dir}/{LEDGER_FILE}: {error.message}"
                ) from error
            raise HostError(
                HostCode.LEDGER_MISSING,
                f"{state_dir}/{LEDGER_FILE}: {error.message}; restore it from backup"
                " (serve creates a ledger only in a state_dir that never held one)",
            ) from error
        db = _connect(state_dir, dir_fd, _checked_and_closed(fd))
        return cls._checked(db, dir_fd, state_dir, installation_id)

    @classmethod
    def _checked(
        cls, db: sqlite3.Connection, dir_fd: int, state_dir: str, installation_id: str
    ) -> Ledger:
        """The open ledger, once its integrity and installation are confirmed."""
        try:
            mode = db.execute("PRAGMA journal_mode").fetchone()[0]
            if mode != "wal" or db.execute("PRAGMA quick_check").fetchone()[0] != "ok":
                raise HostError(
                    HostCode.LEDGER_CORRUPT,
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
            if self._cache is not None:
                self._cache.failed()  # `cached` answers nothing once closed
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
        _log_reserve_spent()
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
                f"{ledger_schema.USAGE_SQL} WHERE attempt_id IN ({_marks(len(ids))})", ids
            ).fetchall()
        return {str(row[0]): ledger_schema.usage_row(row[1:]) for row in rows}

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
        return [_fenced_in(records, fence) for fence in fences]

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
                marks = _marks(len(ids))
                rows = self._db.execute(
                    f"SELECT attempt_id, sum(offset) FROM input_objects"  # noqa: S608
                    f" WHERE attempt_id IN ({marks}) GROUP BY attempt_id",
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
        return [_fenced_in(records, f) for f in fences], dict(zip(ids, read[1], strict=True))

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
        for record in map(ledger_schema.input_record, rows):
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
        as_admission: bool = False,
    ) -> list[Row]:
        _check_batch(plans)
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

    # -- lifecycle ------------------------------------------------------------------

    @_spending_reserve
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
        _check_batch(rows)
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

    @_spending_reserve
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

    @_spending_reserve
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
        _check_batch(fences)
        with self._write() as ordinal:
            now = leases.reading(when)
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
                    lease_current=lease_is_current(record.lease, now),
                    offer_open="start" in OFFER_ALLOWS[offer.control],
                    offer_fits=admission.fits(plan, offer, ceiling, started),
                )
                refusal = (refusals or {}).get(fence.attempt_id)
                if refusal is not None and _accepts(record.status, event):
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
            record = _fenced_in(records, fence)
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
        columns = [*ledger_schema.STATUS_FIELDS, "updated"]
        values: list[object] = [*ledger_schema.status_values(step.status), ordinal]
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

    # -- leases ---------------------------------------------------------------------

    @_spending_reserve
    def expire(self, fence: Fence, when: Now | Clock) -> Applied | None:
        """Record `LeaseExpired` if the lease has run out at `when`, read inside this
        transaction; None (nothing recorded) when the lease is current, say renewed
        after the monitor read the record. Only then may the caller stop the work."""
        with self._write() as ordinal:
            records = self._records([fence.attempt_id])
            record = _fenced_in(records, fence)
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

    @_spending_reserve
    def renew_batches(
        self,
        batches: Sequence[Sequence[tuple[Fence, leases.Renewal]]],
        when: Now | Clock,
        maximum_lease_seconds: int,
    ) -> list[list[Applied | HostError]]:
        """Several requests' `renew_batch`es in ONE transaction and one commit (group
        commit), each judged as if it came alone right after the ones before it."""
        for rows in batches:
            _check_batch(rows)
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
        writes.append([fence.attempt_id, *ledger_schema.lease_values(lease), ordinal])
        updated = msgspec.structs.replace(record, lease=lease, updated=ordinal)
        records[fence.attempt_id] = updated
        self._wrote(updated)
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
        *,
        when: Now | Clock | None = None,
    ) -> InputRecord:
        """Advance an object's durable offset after its bytes are synced (compare-and-set).

        The object is complete exactly when the offset reaches its declared size;
        completeness is derived, never claimed. `identity` is the sealed file's, given
        with the final chunk. With `when` (every client write), the lease must be
        current at `when` read inside this transaction (`lease_expired`).
        """
        with self._write() as ordinal:
            current = self._staging_input(fence, object_id, expected_offset, when)
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
    def commit_stream(
        self,
        fence: Fence,
        state: StreamState,
        expected_offset: int,
        *,
        when: Now | Clock | None = None,
    ) -> InputRecord:
        """Commit what `Stager.write` reports (pass this as its `commit`).

        A failed object is recorded as failed and, in the same transaction, the attempt
        fails (`input_digest_mismatch` or `storage_failed`): it can never start, and it
        follows the normal cleanup and release path. `when`: as for
        `commit_input_offset` (a failure is recorded whatever the lease).
        """
        if state.failed is None:
            return self.commit_input_offset(
                fence, state.id, expected_offset, state.offset, state.identity, when=when
            )
        reason = (
            ErrorCode.INPUT_DIGEST_MISMATCH
            if state.failed == ErrorCode.INPUT_DIGEST_MISMATCH
            else ErrorCode.STORAGE_FAILED
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

    def _staging_input(
        self,
        fence: Fence,
        object_id: str,
        expected_offset: int,
        when: Now | Clock | None = None,
    ) -> InputRecord:
        """The object, if the attempt is still staging (with a lease current at `when`,
        when given) and the offset is still expected."""
        record = self._fenced(fence)
        if record.status.state != "prepared" or record.status.ready or record.status.preparing:
            raise HostError(
                ErrorCode.INVALID_STATE,
                f"inputs are written only while staging; the attempt is {record.status.state}",
            )
        if when is not None and not lease_is_current(record.lease, leases.reading(when)):
            raise HostError(
                ErrorCode.LEASE_EXPIRED,
                "the lease ran out before this chunk was committed; inputs are closed:"
                " release the attempt when it is terminal",
            )
        current = self._input(fence.attempt_id, object_id)
        if current.failed is not None:
            raise HostError(ErrorCode.INPUT_FAILED, f"the object failed earlier ({current.failed})")
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
        return ledger_schema.input_record(row)

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
        if limits is not None and (why := admission.within(limits, ceiling)) is not None:
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
            read = self._select(f"WHERE attempt_id IN ({_marks(len(ids))})", ids)
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
        record = _fenced_in(self._records([fence.attempt_id]), fence)
        if isinstance(record, HostError):
            raise record
        return record

    def _offer(self) -> Offer:
        revision, control, limits = self._db.execute(
            "SELECT revision, control, limits FROM offer"
        ).fetchone()
        return Offer(revision, control, msgspec.json.decode(limits, type=OfferLimits))


def _has_json(db: sqlite3.Connection) -> bool:
    """Whether this SQLite has its JSON functions (a build may leave them out)."""
    try:
        db.execute("SELECT json_group_array(json_array(1))").fetchone()
    except sqlite3.OperationalError:  # built without its JSON functions
        return False
    return True


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


def _accepts(status: lifecycle.Status, event: lifecycle.AnyEvent) -> bool:
    """Whether the lifecycle would accept `event` and change the status."""
    try:
        return lifecycle.apply(status, event).changed
    except HostError:
        return False


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
            HostCode.LEDGER_BUSY,
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
    "Control",
    "HostFacts",
    "InputRecord",
    "Lease",
    "Ledger",
    "Now",
    "Offer",
    "PrepareRow",
    "RecordedUsage",
    "ResourceUsage",
    "Row",
    "SlotSpec",
]
