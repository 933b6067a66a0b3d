"""The ledger's file and its directory: opened without following symlinks, checked,
locked, connected, and its schema migrated or refused.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import sqlite3
import stat
import urllib.parse
from collections.abc import Sequence
from typing import Any, Final

from ficc.execution.host.core.codes import HostCode
from ficc.execution.host.core.errors import HostError
from ficc.execution.host.ledger import schema as ledger_schema
from ficc.execution.host.ledger.schema import SCHEMA_VERSION
from ficc.execution.host.linux import filesystems, fsutil

_log = logging.getLogger("ficc.execution.host.ledger")

LEDGER_FILE: Final = "ledger.sqlite3"
SIDECARS: Final = tuple(LEDGER_FILE + suffix for suffix in ("-wal", "-shm", "-journal"))
ADMISSION_VERSION: Final = 1


def _unsafe(message: str) -> HostError:
    return HostError(HostCode.LEDGER_UNSAFE, message)


ROOT_UID: Final = 0
"""Who owns the ledger: root, always, for the daemon. Only a test of the ledger's own
logic, run without root, names its own UID instead (`Ledger.create(..., owner=...)`)."""


def _owner_name(owner: int) -> str:
    return "root" if owner == ROOT_UID else f"uid {owner}"


def _check_state_dir(dir_fd: int, where: str, owner: int) -> os.stat_result:
    st = os.fstat(dir_fd)
    if st.st_uid != owner or stat.S_IMODE(st.st_mode) & 0o077:
        raise _unsafe(
            f"state directory {where} must be owned by {_owner_name(owner)} with no group or"
            f" other access (it is uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):o});"
            f" chown {'root' if owner == ROOT_UID else owner} and chmod 700"
        )
    return st


def _check_file(st: os.stat_result, name: str, owner: int) -> None:
    if (
        not stat.S_ISREG(st.st_mode)
        or st.st_uid != owner
        or st.st_nlink != 1
        or stat.S_IMODE(st.st_mode) != 0o600
    ):
        raise _unsafe(
            f"{name} must be a regular file owned by {_owner_name(owner)} with one link and"
            f" mode 600; it is {stat.filemode(st.st_mode)} uid {st.st_uid} with"
            f" {st.st_nlink} links: investigate before touching it"
        )


def _same(a: os.stat_result, b: os.stat_result) -> bool:
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def mount_point(path: str) -> str:
    """The mount point of the filesystem holding `path` (for messages; `path` itself if
    it cannot be found)."""
    try:
        device = os.stat(path).st_dev
        while (parent := os.path.dirname(path)) != path and os.stat(parent).st_dev == device:
            path = parent
    except OSError:
        pass
    return path


def remove_new(dir_fd: int, names: Sequence[str]) -> None:
    """Remove files a failed `create` made, durably, so the next start finds no ledger
    (rather than an empty or half-made one it would refuse as corrupt)."""
    for name in names:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(name, dir_fd=dir_fd)
    try:
        fsutil.fsync_dir(dir_fd)
    except OSError as error:
        _log.warning("the state directory could not be synced after a failed create: %s", error)


def check_owner_then_migrate(db: sqlite3.Connection, path: str, installation_id: str) -> None:
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


def unreadable_schema(path: str, row: tuple[Any, ...] | None) -> str:
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


def lock_state_dir(state_dir: str, owner: int) -> int:
    """Open and check the state directory, and take its exclusive lock.

    The lock (flock on the directory, independent of SQLite's own POSIX locks) makes a
    second daemon on the same ledger fail at start instead of marking the first one's
    attempts unknown. It is released when the fd is closed or the process dies.
    """
    dir_fd = fsutil.open_dir(state_dir)
    try:
        _check_state_dir(dir_fd, state_dir, owner)
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


def checked_and_closed(fd: int) -> os.stat_result:
    """Sync and stat our own fd of the ledger file, then close it before SQLite opens the
    file: closing any fd of a file drops every POSIX lock this process holds on it,
    SQLite's included, which would let another process delete the live WAL."""
    try:
        os.fsync(fd)
        return os.fstat(fd)
    finally:
        os.close(fd)


def connect(state_dir: str, dir_fd: int, checked: os.stat_result, owner: int) -> sqlite3.Connection:
    """Open the checked file with SQLite, then prove SQLite opened that same file."""
    _check_file(checked, LEDGER_FILE, owner)
    for suffix in ("-wal", "-shm"):
        with contextlib.suppress(FileNotFoundError):
            sidecar = os.stat(LEDGER_FILE + suffix, dir_fd=dir_fd, follow_symlinks=False)
            _check_file(sidecar, LEDGER_FILE + suffix, owner)
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


def has_json(db: sqlite3.Connection) -> bool:
    """Whether this SQLite has its JSON functions (a build may leave them out)."""
    try:
        db.execute("SELECT json_group_array(json_array(1))").fetchone()
    except sqlite3.OperationalError:  # built without its JSON functions
        return False
    return True
