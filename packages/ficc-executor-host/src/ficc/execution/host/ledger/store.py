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

import os
import secrets
import sqlite3

import msgspec

from ficc.execution import plan as planlib
from ficc.execution.errors import ErrorCode
from ficc.execution.host.core import admission
from ficc.execution.host.core.admission import AdmissionRejection
from ficc.execution.host.core.codes import HostCode
from ficc.execution.host.core.errors import HostError
from ficc.execution.host.core.leases import Lease, Now
from ficc.execution.host.core.records import (
    OFFER_ALLOWS,
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
)
from ficc.execution.host.ledger import schema as ledger_schema
from ficc.execution.host.ledger.admit import Admissions
from ficc.execution.host.ledger.files import (
    ADMISSION_VERSION,
    LEDGER_FILE,
    ROOT_UID,
    SIDECARS,
    check_owner_then_migrate,
    checked_and_closed,
    connect,
    lock_state_dir,
    remove_new,
)
from ficc.execution.host.ledger.inputs import InputWrites
from ficc.execution.host.ledger.schema import SCHEMA_VERSION
from ficc.execution.host.ledger.transactions import (
    PAGE_MAX,
    no_space,
    spending_reserve,
    spending_reserve_to_start,
)
from ficc.execution.host.linux import fsutil
from ficc.execution.protocol import OfferLimits
from ficc.execution.wire import Control

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


class Ledger(Admissions, InputWrites):
    """The open ledger. Create it once with `create`, then `open` it on every start."""

    @classmethod
    def create(
        cls,
        state_dir: str,
        installation_id: str,
        initial_offer: OfferLimits,
        ceiling: OfferLimits,
        control: Control = "active",
        *,
        owner: int = ROOT_UID,
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
        dir_fd = lock_state_dir(state_dir, owner)
        try:
            return spending_reserve_to_start(
                dir_fd,
                state_dir,
                "created",
                lambda: cls._create_locked(
                    dir_fd, state_dir, installation_id, initial_offer, control, owner=owner
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
        *,
        owner: int,
    ) -> Ledger:
        """`create` under the state directory's lock. A failure after the file was made
        removes what it made, so no half-made ledger is ever taken for a lost one."""
        sidecars = [n for n in SIDECARS if not fsutil.exists_at(dir_fd, n)]
        try:
            fd = fsutil.create_exclusive(dir_fd, LEDGER_FILE, 0o600)
        except HostError as error:
            if no_space(error):
                raise
            raise HostError(
                HostCode.LEDGER_EXISTS,
                f"{state_dir}/{LEDGER_FILE} cannot be created exclusively ({error.code});"
                " if a ledger is there, open it instead of creating one",
            ) from error
        try:
            checked = checked_and_closed(fd)
            fsutil.fsync_dir(dir_fd)
            db = connect(state_dir, dir_fd, checked, owner)
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
            remove_new(dir_fd, [LEDGER_FILE, *sidecars])
            raise

    @classmethod
    def open(
        cls,
        state_dir: str,
        installation_id: str,
        *,
        spend_reserve: bool = True,
        owner: int = ROOT_UID,
    ) -> Ledger:
        """Open the existing ledger of this installation; refuse any other one.

        Opening writes: SQLite makes its write-ahead log and shared-memory index again
        (a clean stop deletes them). On a full filesystem the reserve is spent for that,
        as for any other write, unless `spend_reserve` is False (a check that must change
        nothing): then a full filesystem is refused with `ledger_full`.
        """
        dir_fd = lock_state_dir(state_dir, owner)
        try:
            return spending_reserve_to_start(
                dir_fd,
                state_dir,
                "opened",
                lambda: cls._open_locked(dir_fd, state_dir, installation_id, owner),
                spend=spend_reserve,
            )
        except BaseException:
            os.close(dir_fd)
            raise

    @classmethod
    def _open_locked(cls, dir_fd: int, state_dir: str, installation_id: str, owner: int) -> Ledger:
        """`open` under the state directory's lock."""
        try:
            fd = fsutil.open_regular_at(dir_fd, LEDGER_FILE, os.O_RDONLY, owner_uid=owner)
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
        db = connect(state_dir, dir_fd, checked_and_closed(fd), owner)
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
            check_owner_then_migrate(db, f"{state_dir}/{LEDGER_FILE}", installation_id)
            ledger = cls(db, dir_fd, f"{state_dir}/{LEDGER_FILE}")
        except BaseException:
            db.close()
            raise
        return ledger

    @spending_reserve
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
