"""Streamed input objects staged on a slot's reserved filesystem.

A plan may declare inputs with `delivery: "stream"`: the controller uploads their
bytes in `input_write` chunks after admission. This module owns the files that
receive them. Layout, per slot::

    <slot path>/ficc-staging/                  root, 0700
    <slot path>/ficc-staging/<attempt_id>/     root, 0700 (private to root)
    <slot path>/ficc-staging/<attempt_id>/<object_id>
        root:root 0600 while incomplete; root:<slot gid> 0440 once complete

Files are named by the declared object ID (32 lowercase hex), never by anything a
remote peer supplies as a path. The parent stays private to root: the workload
reads a completed file only through the hard link its provider makes in its own
runtime layout on the same filesystem.

The rules of a write are a pure function (`plan_write`) over a pure `StreamState`;
`Stager` is the thin I/O shell around them. The durable offset of an object is the
ledger's: `Stager.write` syncs the bytes and then calls the caller's `commit`
callback with the new state *before* it releases the attempt's write guard, so
"bytes are synced before their offset is committed" holds, and commits of one
attempt never overtake each other.

Hashing is incremental: one SHA-256 object per open stream lives in memory, tagged
with the offset it has consumed. When the tag disagrees with the committed offset
(after a daemon restart, or after a commit that failed), the hasher is rebuilt by
re-reading the durable prefix `[0, offset)` of the file in bounded blocks. That
costs one read of the prefix, once per object per restart, and means the final
digest is always checked against the bytes actually on disk.

A completed file's identity (device, inode, mode, size, mtime) is recorded when it
completes. The start handler asks `changed_input` before it accepts a start, and the
start pipeline asks `verify_identity` again just before the provider's start (a file
can change in between): a staged file that is no longer the recorded one, owned by
root and the slot's group, refuses the start (`input_changed`, `identity_refusal`).

A failed object (digest mismatch at completion, a full or failing disk, a file
that changed under us) stays failed: later writes and status reads answer
`input_failed`, and the attempt cannot start.

All methods are synchronous and may block on disk; the daemon calls them from
worker threads, outside any lock the monitor needs. Refusal codes:
`inputs_preparing`, `input_busy`, `input_offset_changed`, `input_digest_mismatch`,
`input_size_mismatch` (also an empty chunk for a non-empty object), `input_complete`,
`input_failed`, `input_not_declared`, `input_changed`, `inputs_incomplete`,
`slot_capacity`, `slot_full`, `input_storage_failed`, `attempt_not_staged`,
`unexpected_entry`, `staging_cleanup_failed`, plus the `fsutil` codes for unsafe files.
"""

from __future__ import annotations

import errno
import hashlib
import os
import stat
import threading
from collections.abc import Iterable, Sequence
from typing import Any

import msgspec

from ficc.execution.errors import ErrorCode
from ficc.execution.host.core.errors import HostError
from ficc.execution.host.core.records import StreamState
from ficc.execution.host.linux.fsutil import (
    FileIdentity,
    create_exclusive,
    fsync_dir,
    identity_of,
    open_dir,
    open_dir_at,
    open_dir_below,
    open_regular_at,
    require_owner,
    storage_refusal,
)
from ficc.execution.host.storage.streams import (
    IDENTITY,
    ROOT_UID,
    ChunkPieces,
    Commit,
    check_identity,
    failed_stream,
    identity_refusal,
    plan_write,
)
from ficc.execution.provider import InputCapability

__all__ = [
    "STAGING_DIRECTORY",
    "Stager",
    "StreamState",
]

STAGING_DIRECTORY = "ficc-staging"
_INCOMPLETE_MODE = 0o600
_COMPLETE_MODE = 0o440
_REHASH_BLOCK = 1 << 20


class _Whole:
    """A chunk held whole, offered as one piece."""

    __slots__ = ("_data",)

    def __init__(self, data: bytes) -> None:
        self._data = data

    @property
    def chunk_size(self) -> int:
        return len(self._data)

    def chunk_pieces(self) -> Iterable[bytes]:
        return (self._data,)


class _Attempt:
    """In-memory staging state of one attempt. `busy` is the one-write-in-flight guard."""

    def __init__(self, states: Sequence[StreamState]) -> None:
        self.preparing = True
        self.dir_fd: int | None = None
        self.states: dict[str, StreamState] = {s.id: s for s in states}
        self.hashers: dict[str, tuple[int, Any]] = {}
        self.busy = threading.Lock()
        self.removed = False


class Stager:
    """Stages streamed inputs for the attempts of one slot.

    `slot_path` is the slot's directory on its reserved filesystem; `slot_gid` is the
    reserved workload group that may read completed files.
    """

    def __init__(self, slot_path: str, slot_gid: int) -> None:
        self._slot_path = slot_path
        self._slot_gid = slot_gid
        self._lock = threading.Lock()
        self._attempts: dict[str, _Attempt] = {}

    # -- lifecycle -----------------------------------------------------------------

    def register_attempt(self, attempt_id: str, states: Sequence[StreamState]) -> None:
        """Record an admitted attempt's streams (no I/O; call it at admission).

        Until `prepare_attempt` finishes, status and writes answer `inputs_preparing`.
        After a daemon restart, pass the states the ledger recorded. Registering a
        known attempt again keeps its current state (a repeated prepare keeps the partial).
        """
        check_identity(attempt_id, "attempt ID")
        for state in states:
            check_identity(state.id, "input object ID")
        with self._lock:
            if attempt_id not in self._attempts:
                self._attempts[attempt_id] = _Attempt(states)

    def prepare_attempt(self, attempt_id: str) -> list[StreamState]:
        """Create (or, after a restart, re-verify) the attempt's directory and files.

        Returns the states, some possibly now `failed`, for the caller to commit.
        A repeated call after success returns the current states unchanged.
        """
        attempt = self._attempt(attempt_id)
        if not attempt.busy.acquire(blocking=False):
            raise HostError(
                ErrorCode.INPUTS_PREPARING,
                "the staging directory is being initialized; retry later",
            )
        try:
            if attempt.removed:
                raise _not_staged(attempt_id)
            if not attempt.preparing:
                return list(attempt.states.values())
            try:
                dir_fd = self._open_attempt_dir(attempt_id)
                try:
                    states = {i: self._prepare_file(dir_fd, s) for i, s in attempt.states.items()}
                    fsync_dir(dir_fd)
                except BaseException:
                    os.close(dir_fd)
                    raise
            except OSError as error:
                where = f"the staging directory of attempt {attempt_id}"
                raise storage_refusal(where, error, ErrorCode.INPUT_STORAGE_FAILED) from error
            attempt.states = states
            attempt.dir_fd = dir_fd
            attempt.preparing = False
            return list(states.values())
        finally:
            attempt.busy.release()

    def remove_attempt(self, attempt_id: str) -> None:
        """Delete the attempt's staged files and directory (after confirmed cleanup).

        Only regular files named like object IDs are expected; anything else (a link,
        a FIFO, a directory, a foreign name) refuses removal untouched, so an operator
        can look. Removing an attempt that has no directory succeeds.
        """
        check_identity(attempt_id, "attempt ID")
        with self._lock:
            attempt = self._attempts.get(attempt_id)
            if attempt is not None and not attempt.busy.acquire(blocking=False):
                raise HostError(
                    ErrorCode.INPUT_BUSY, "an input write is in flight; retry the release"
                )
        try:
            try:
                self._remove_directory(attempt_id)
            except OSError as error:
                raise HostError(
                    ErrorCode.STAGING_CLEANUP_FAILED,
                    f"removing the staged inputs of attempt {attempt_id} failed "
                    f"({error.strerror or error}); the reservation stays: fix the slot "
                    "filesystem and retry the release",
                ) from error
            with self._lock:
                self._attempts.pop(attempt_id, None)
            if attempt is not None:
                attempt.removed = True  # a write already past the lookup must not use the fd
                if attempt.dir_fd is not None:
                    os.close(attempt.dir_fd)
                    attempt.dir_fd = None
        finally:
            if attempt is not None:
                attempt.busy.release()

    # -- reads ---------------------------------------------------------------------

    def state(self, attempt_id: str, object_id: str) -> StreamState:
        """The current state of one object, failed or not."""
        attempt = self._ready_attempt(attempt_id)
        return self._declared(attempt, object_id)

    def status(self, attempt_id: str, object_id: str) -> StreamState:
        """The `input_status` answer: durable offset, declared size and digest, complete."""
        state = self.state(attempt_id, object_id)
        if state.failed is not None:
            raise HostError(
                ErrorCode.INPUT_FAILED,
                f"input {object_id} failed ({state.failed}); the attempt cannot start: "
                "release it and admit a new attempt",
            )
        return state

    def all_complete(self, attempt_id: str) -> bool:
        """True when every stream is complete with its full digest (preparation may start)."""
        attempt = self._ready_attempt(attempt_id)
        return all(s.complete and s.failed is None for s in attempt.states.values())

    def capabilities(self, attempt_id: str) -> list[InputCapability]:
        """The provider-context `inputs`: one host-created capability per completed stream."""
        attempt = self._ready_attempt(attempt_id)
        if not self.all_complete(attempt_id):
            raise HostError(
                ErrorCode.INPUTS_INCOMPLETE, "some streamed inputs are not complete; keep uploading"
            )
        return [
            InputCapability(
                id=s.id,
                name=s.name,
                bytes=s.bytes,
                digest=s.digest,
                delivery="stream",
                path=self._object_path(attempt_id, s.id),
                identity=s.identity,
            )
            for s in attempt.states.values()
            if s.identity is not None
        ]

    def verify_identity(self, attempt_id: str, capability: InputCapability) -> None:
        """Refuse start (`input_changed`) unless the staged file is still the recorded one
        (`identity_refusal` decides)."""
        object_id = capability.id
        check_identity(object_id, "input object ID")
        if capability.path != self._object_path(attempt_id, object_id):
            raise HostError(ErrorCode.INPUT_CHANGED, f"capability {object_id} has a foreign path")
        seen = self._lstat_staged(attempt_id, object_id)
        refusal = identity_refusal(capability, seen, self._slot_gid)
        if refusal is not None:
            raise refusal

    def changed_input(self, attempt_id: str) -> HostError | None:
        """The `input_changed` refusal of the first completed input whose staged file is
        no longer the one recorded when it completed; None when every one still is.

        Why: the start handler asks before it accepts a start row, so the controller
        hears `input_changed` in the row itself, not later from a failed attempt.
        Anything else the look meets (an attempt this stager does not know, a staging
        directory it cannot open) raises: it is not a changed input, and the start
        pipeline, which runs the same check again, refuses it with its own code.
        """
        for capability in self.capabilities(attempt_id):
            try:
                self.verify_identity(attempt_id, capability)
            except HostError as error:
                if error.code != ErrorCode.INPUT_CHANGED:
                    raise
                return error
        return None

    # -- writes --------------------------------------------------------------------

    def write(
        self,
        attempt_id: str,
        object_id: str,
        offset: int,
        data: bytes | ChunkPieces,
        chunk_digest: str,
        *,
        commit: Commit | None = None,
    ) -> StreamState:
        """Write one chunk at the durable offset, sync it, then commit the new state.

        `data` may come in pieces, already checked against `chunk_digest` (see
        `ChunkPieces`): each is written and hashed as it comes, so the whole chunk is
        never held. Bytes are checked here, before anything is written; pieces that
        do not add up to their `chunk_size` are cut off the file again and refused
        before anything is synced or committed. `commit` (the
        ledger's) runs while this attempt's write guard is held; its failure leaves
        the in-memory offset where it was. A failed object is also passed to `commit`
        before the refusal is raised.
        """
        chunk, digest_ok = _checked(data, chunk_digest)
        attempt = self._ready_attempt(attempt_id)
        acquired = attempt.busy.acquire(blocking=False)
        try:
            state = self._declared(attempt, object_id)  # read under the guard: no stale offset
            size = chunk.chunk_size
            refusal = plan_write(
                state, offset, size, chunk_digest_ok=digest_ok, in_flight=not acquired
            )
            if refusal is not None:
                raise refusal
            if attempt.dir_fd is None:  # removed since the lookup
                raise _not_staged(attempt_id)
            try:
                new = self._write_synced(attempt, attempt.dir_fd, state, chunk)
            except HostError as error:
                self._record(attempt, failed_stream(state, error.code), commit)
                raise
            if new is None:
                refusal = plan_write(state, offset, size, chunk_digest_ok=False, in_flight=False)
                assert refusal is not None
                raise refusal
            if new.failed is not None:
                self._record(attempt, new, commit)
                raise HostError(
                    new.failed,
                    f"input {object_id} does not match its declared SHA-256 {state.digest}; "
                    "the attempt cannot start: release it",
                )
            self._record(attempt, new, commit)
            return new
        finally:
            if acquired:
                attempt.busy.release()

    # -- internals -----------------------------------------------------------------

    def _record(self, attempt: _Attempt, new: StreamState, commit: Commit | None) -> None:
        """Commit, then publish the state in memory. A failure is published regardless."""
        try:
            if commit is not None:
                commit(new)
        except BaseException:
            attempt.hashers.pop(new.id, None)
            if new.failed is not None:
                attempt.states[new.id] = new
            raise
        attempt.states[new.id] = new

    def _write_synced(
        self,
        attempt: _Attempt,
        dir_fd: int,
        state: StreamState,
        chunk: ChunkPieces,
    ) -> StreamState | None:
        """pwrite the pieces + fsync; on reaching the declared size, check and seal the file.

        None when the pieces miss their `chunk_size`: the file is cut back to the
        durable offset and the stream's hasher has not seen them (a copy took them).
        """
        fd = open_regular_at(dir_fd, state.id, os.O_RDWR, owner_uid=ROOT_UID)
        try:
            running = self._hasher(attempt, fd, state)
            hasher = running.copy()
            try:
                if os.fstat(fd).st_size > state.offset:
                    os.ftruncate(fd, state.offset)  # drop synced bytes never committed
                # Only then count the space: the dropped bytes are free again, so the
                # retry of a chunk whose commit was lost fits where the chunk did.
                _require_space(fd, chunk.chunk_size)
                end = _write_pieces(fd, chunk, state.offset, hasher)
                if end is None:
                    os.ftruncate(fd, state.offset)
                    return None
                os.fsync(fd)
            except OSError as error:
                raise storage_refusal(
                    f"input {state.id}", error, ErrorCode.INPUT_STORAGE_FAILED
                ) from error
            attempt.hashers[state.id] = (end, hasher)
            if end < state.bytes:
                return msgspec.structs.replace(state, offset=end)
            if "sha256:" + hasher.hexdigest() != state.digest:
                return msgspec.structs.replace(
                    state, offset=end, failed=ErrorCode.INPUT_DIGEST_MISMATCH
                )
            return msgspec.structs.replace(
                state, offset=end, complete=True, identity=self._seal(fd, state.id)
            )
        finally:
            os.close(fd)

    def _seal(self, fd: int, object_id: str) -> FileIdentity:
        """Make a completed file read-only, group-readable by the slot, and durable."""
        try:
            os.fchown(fd, ROOT_UID, self._slot_gid)
            os.fchmod(fd, _COMPLETE_MODE)
            os.fsync(fd)
        except OSError as error:
            raise storage_refusal(
                f"input {object_id}", error, ErrorCode.INPUT_STORAGE_FAILED
            ) from error
        return identity_of(fd)

    def _hasher(self, attempt: _Attempt, fd: int, state: StreamState) -> Any:
        """The stream's SHA-256 at the committed offset, rebuilt from disk if needed."""
        cached = attempt.hashers.get(state.id)
        if cached is not None and cached[0] == state.offset:
            return cached[1]
        hasher = hashlib.sha256()
        position = 0
        while position < state.offset:
            block = os.pread(fd, min(_REHASH_BLOCK, state.offset - position), position)
            if not block:
                raise HostError(
                    ErrorCode.INPUT_CHANGED,
                    f"staged input {state.id} is shorter than its durable offset "
                    f"{state.offset}; release the attempt",
                )
            hasher.update(block)
            position += len(block)
        attempt.hashers[state.id] = (state.offset, hasher)
        return hasher

    def _prepare_file(self, dir_fd: int, state: StreamState) -> StreamState:
        """Create a fresh object file, or check that a recorded one is still ours."""
        if state.failed is not None:
            return state
        try:
            if state.complete:
                self._check_complete_file(dir_fd, state)
                return state
            self._check_or_create_partial(dir_fd, state)
        except HostError as error:
            return failed_stream(state, error.code)
        return state

    def _check_complete_file(self, dir_fd: int, state: StreamState) -> None:
        try:
            st = os.stat(state.id, dir_fd=dir_fd, follow_symlinks=False)
        except FileNotFoundError:
            st = None
        if st is None or identity_of(st) != state.identity or st.st_uid != ROOT_UID:
            raise HostError(ErrorCode.INPUT_CHANGED, f"completed input {state.id} changed on disk")

    def _check_or_create_partial(self, dir_fd: int, state: StreamState) -> None:
        try:
            fd = open_regular_at(dir_fd, state.id, owner_uid=ROOT_UID)
        except HostError as error:
            if error.code != ErrorCode.NOT_FOUND or state.offset != 0:
                raise
            os.close(create_exclusive(dir_fd, state.id, _INCOMPLETE_MODE))
            return
        try:
            st = os.fstat(fd)
        finally:
            os.close(fd)
        # 0440 is allowed: a crash between sealing and the ledger commit leaves it.
        if st.st_mode & 0o7137 or st.st_size < state.offset:
            raise HostError(
                ErrorCode.INPUT_CHANGED,
                f"partial input {state.id} has mode {stat.filemode(st.st_mode)} and "
                f"{st.st_size} bytes (durable offset {state.offset})",
            )

    def _open_private_dir(self, parent_fd: int, name: str) -> int:
        """Open or create a root-owned 0700 directory, refusing anything less private."""
        try:
            os.mkdir(name, 0o700, dir_fd=parent_fd)
        except FileExistsError:
            pass
        else:
            fsync_dir(parent_fd)
        fd = open_dir_below(parent_fd, name)
        try:
            st = os.fstat(fd)
            require_owner(st, ROOT_UID, f"staging directory {name!r}")
            if st.st_mode & 0o077:
                raise HostError(
                    ErrorCode.UNSAFE_PATH,
                    f"staging directory {name!r} has mode {stat.filemode(st.st_mode)}; it "
                    "must be private to root (0700): fix it or remove it",
                )
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _open_attempt_dir(self, attempt_id: str) -> int:
        slot_fd = open_dir(self._slot_path)
        try:
            root_fd = self._open_private_dir(slot_fd, STAGING_DIRECTORY)
        finally:
            os.close(slot_fd)
        try:
            return self._open_private_dir(root_fd, attempt_id)
        finally:
            os.close(root_fd)

    def _lstat_staged(self, attempt_id: str, object_id: str) -> os.stat_result | None:
        """Stat a staged file without following links anywhere; None if it is gone."""
        check_identity(attempt_id, "attempt ID")
        fd = open_dir(self._slot_path)
        try:
            for name in (STAGING_DIRECTORY, attempt_id):
                try:
                    child = open_dir_at(fd, name)
                except HostError as error:
                    if error.code == ErrorCode.NOT_FOUND:
                        return None
                    raise
                os.close(fd)
                fd = child
            try:
                return os.stat(object_id, dir_fd=fd, follow_symlinks=False)
            except FileNotFoundError:
                return None
        finally:
            os.close(fd)

    def _remove_directory(self, attempt_id: str) -> None:
        slot_fd = open_dir(self._slot_path)
        try:
            try:
                root_fd = open_dir_at(slot_fd, STAGING_DIRECTORY)
            except HostError as error:
                if error.code == ErrorCode.NOT_FOUND:
                    return
                raise
        finally:
            os.close(slot_fd)
        try:
            try:
                dir_fd = open_dir_at(root_fd, attempt_id)
            except HostError as error:
                if error.code == ErrorCode.NOT_FOUND:
                    return
                raise
            try:
                names = _expected_entries(dir_fd)
                for name in names:
                    os.unlink(name, dir_fd=dir_fd)
                fsync_dir(dir_fd)
            finally:
                os.close(dir_fd)
            os.rmdir(attempt_id, dir_fd=root_fd)
            fsync_dir(root_fd)
        finally:
            os.close(root_fd)

    def _object_path(self, attempt_id: str, object_id: str) -> str:
        return f"{self._slot_path}/{STAGING_DIRECTORY}/{attempt_id}/{object_id}"

    def _attempt(self, attempt_id: str) -> _Attempt:
        with self._lock:
            attempt = self._attempts.get(attempt_id)
        if attempt is None:
            raise _not_staged(attempt_id)
        return attempt

    def _ready_attempt(self, attempt_id: str) -> _Attempt:
        attempt = self._attempt(attempt_id)
        if attempt.preparing:
            raise HostError(
                ErrorCode.INPUTS_PREPARING,
                "the staging directory is still being initialized; retry on a later polling cycle",
            )
        return attempt

    @staticmethod
    def _declared(attempt: _Attempt, object_id: str) -> StreamState:
        state = attempt.states.get(object_id)
        if state is None:
            raise HostError(
                ErrorCode.INPUT_NOT_DECLARED,
                f"{object_id!r} is not a streamed input of this attempt's plan",
            )
        return state


def _expected_entries(dir_fd: int) -> list[str]:
    """The names in an attempt directory, refusing anything staging never creates."""
    names = []
    with os.scandir(dir_fd) as entries:
        for entry in entries:
            if not (IDENTITY.match(entry.name) and entry.is_file(follow_symlinks=False)):
                raise HostError(
                    ErrorCode.UNEXPECTED_ENTRY,
                    f"staging directory contains {entry.name!r}, which staging never "
                    "creates; inspect and remove it by hand, then retry the release",
                )
            names.append(entry.name)
    return names


def _require_space(fd: int, length: int) -> None:
    vfs = os.fstatvfs(fd)
    if vfs.f_bavail * vfs.f_frsize < length:
        raise OSError(errno.ENOSPC, "not enough free space for the chunk")


def _checked(data: bytes | ChunkPieces, chunk_digest: str) -> tuple[ChunkPieces, bool]:
    """The chunk as pieces, and whether it matches `chunk_digest`.

    Bytes are hashed here; pieces were checked where they were received.
    """
    if isinstance(data, bytes):
        return _Whole(data), "sha256:" + hashlib.sha256(data).hexdigest() == chunk_digest
    return data, True


def _write_pieces(fd: int, chunk: ChunkPieces, offset: int, stream: Any) -> int | None:
    """pwrite the pieces from `offset`, each into the stream's running SHA-256.

    The end offset, or None when the pieces do not add up to `chunk_size`.
    """
    end = offset
    for piece in chunk.chunk_pieces():
        _pwrite_all(fd, piece, end)
        stream.update(piece)
        end += len(piece)
    if end - offset != chunk.chunk_size:
        return None
    return end


def _pwrite_all(fd: int, data: bytes, offset: int) -> None:
    view = memoryview(data)
    while view:
        written = os.pwrite(fd, view, offset)
        view = view[written:]
        offset += written


def _not_staged(attempt_id: str) -> HostError:
    return HostError(
        ErrorCode.ATTEMPT_NOT_STAGED,
        f"attempt {attempt_id} has no staged inputs on this slot; register and prepare it first",
    )
