"""The I/O shell: acquire the host lock, load the verified snapshot, save each change.

All decisions are made by the pure `Registry` (rules) and `Image` (encoding); this
module only orders the side effects: decide, check capacity, save durably, then
record in memory. A save that fails part-way poisons the session, because the rename
may already have happened and only a fresh read can tell.
"""

from __future__ import annotations

import functools
import os
import threading
import weakref
from types import TracebackType

from . import marker
from .errors import CapacityExceeded, Closed, Corrupt, HostMismatch, Poisoned, Unsafe
from .lock import check_platform, lock_exclusive
from .model import (
    Operation,
    Status,
    check_host_id,
    check_op_id,
    check_plan_hash,
    check_revision,
    check_status,
)
from .registry import Registry
from .root import Root, read_all, write_all, write_at, write_in_place
from .snapshot import HEADER_LEN, MAX_BYTES, RESERVE, Image

STATE_FILE = "state.json"
LOCK_FILE = "host.lock"


def acquire(directory: str | os.PathLike[str], host_id: str) -> Session:
    """Open the host's state directory and hold its lock until `close`.

    Raises Locked if another session holds it, Unsupported on an unsupported OS,
    Unsafe for an untrustworthy directory, Corrupt/HostMismatch if the stored state
    fails verification. Never creates the directory; never removes `host.lock`.
    """
    check_host_id(host_id)
    check_platform()
    root = Root.open(directory)
    lock_fd: int | None = None
    try:
        lock_fd = root.open_lock_file()
        lock_exclusive(lock_fd, root.path)
        image, operations, marked = _load(root, lock_fd, host_id)
    except BaseException:
        if lock_fd is not None:
            os.close(lock_fd)
        root.close()
        raise
    return Session(
        root=root,
        lock_fd=lock_fd,
        host_id=host_id,
        image=image,
        registry=Registry(operations),
        marked=marked,
    )


def marker_mismatch(directory: str, marked_for: str, host_id: str) -> HostMismatch:
    """The refusal for a marker of another host (`acquire` and `inspect` alike)."""
    return HostMismatch(
        f"{directory} was initialized for host {marked_for!r}, not {host_id!r}; use that"
        " host ID or the directory bootstrap made for this host"
    )


def snapshot_missing(directory: str) -> Corrupt:
    """The refusal for a marker without its snapshot (`acquire` and `inspect` alike)."""
    return Corrupt(
        f"{directory}/state.json is missing but host.lock records that work was"
        " persisted; restore state.json from a backup (and reconcile), never"
        " start an empty store over it"
    )


def _load(root: Root, lock_fd: int, host_id: str) -> tuple[Image, list[Operation], bool]:
    """Verify marker and snapshot together; repair a marker lost to a crash."""
    marked_for = marker.decode(read_all(lock_fd, LOCK_FILE, marker.MAX_BYTES))
    if marked_for is not None and marked_for != host_id:
        raise marker_mismatch(root.path, marked_for, host_id)
    data = root.read(STATE_FILE, MAX_BYTES)
    if data is None:
        if marked_for is not None:
            raise snapshot_missing(root.path)
        return Image(host_id, []), [], False
    image, operations = Image.load(data, host_id)
    if marked_for is None:  # crashed between the first snapshot and the marker
        try:
            write_in_place(lock_fd, marker.encode(host_id))
        except OSError as exc:  # a read-only or full filesystem
            raise Unsafe(
                f"{root.path}/{LOCK_FILE} lost its marker (a crash after the first save)"
                f" and it cannot be written again: {exc.strerror}; free space on that"
                " filesystem or make it writable, then acquire again"
            ) from None
    return image, operations, True


class Session:
    """Exclusive use of one host's registry. Not shareable across processes.

    Thread-safe (calls are serialized). After `close`, or in a child forked from the
    holder, every call raises Closed; after a failed save, every call but `close`
    raises Poisoned.
    """

    def __init__(
        self,
        *,
        root: Root,
        lock_fd: int,
        host_id: str,
        image: Image,
        registry: Registry,
        marked: bool,
    ) -> None:
        self._root = root
        self._lock_fd: int | None = lock_fd
        self._host_id = host_id
        self._image = image
        self._registry = registry
        self._marked = marked
        self._guard = threading.Lock()
        self._closed: str | None = None
        self._poison: str | None = None
        _OPEN_SESSIONS.add(self)

    @property
    def host_id(self) -> str:
        """The host this session's state directory belongs to."""
        return self._host_id

    @property
    def directory(self) -> str:
        """The state directory's path, as it was opened."""
        return self._root.path

    def begin(self, op_id: str, plan_hash: str) -> tuple[Operation, bool]:
        """Register queued work; `created` is False when the ID/hash pair already exists."""
        with self._guard:
            self._check_usable()
            op, created = self._registry.plan_begin(check_op_id(op_id), check_plan_hash(plan_hash))
            if created:
                size = self._image.size_after(None, op)
                if size + RESERVE > MAX_BYTES:
                    raise CapacityExceeded(
                        f"admitting {op_id!r} would make state.json {size} bytes (plus a"
                        f" {RESERVE}-byte reserve), over the {MAX_BYTES}-byte limit; no"
                        " pruning exists, so this host cannot admit new operations"
                    )
                self._save(None, op)
            return op, created

    def advance(self, op_id: str, revision: int, next: Status | str) -> Operation:
        """Move an operation to `next` if it is still at `revision` and the step is allowed."""
        with self._guard:
            self._check_usable()
            op_id = check_op_id(op_id)
            nxt, revision = check_status(next), check_revision(revision)
            old = self._registry.get(op_id)
            new = self._registry.plan_advance(op_id, revision, nxt)
            size = self._image.size_after(old, new)
            if size > MAX_BYTES:  # unreachable while the admission reserve holds
                raise CapacityExceeded(f"advancing {op_id!r} would exceed {MAX_BYTES} bytes")
            self._save(old, new)
            return new

    def get(self, op_id: str) -> Operation:
        """The stored operation (an immutable value); NotFound if absent."""
        with self._guard:
            self._check_usable()
            return self._registry.get(check_op_id(op_id))

    def close(self) -> None:
        """Release the lock. Idempotent; allowed on a poisoned session."""
        with self._guard:
            self._release("the session was closed; acquire the host again to continue")

    def __enter__(self) -> Session:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def _save(self, old: Operation | None, new: Operation) -> None:
        try:
            self._image.put(old, new)
            self._root.replace(STATE_FILE, functools.partial(_write_snapshot, self._image))
            if not self._marked:
                assert self._lock_fd is not None
                write_in_place(self._lock_fd, marker.encode(self._host_id))
                self._marked = True
        except BaseException as exc:
            self._poison = f"{type(exc).__name__}: {exc}"
            if isinstance(exc, Exception):
                raise Poisoned(self._poison_message()) from exc
            raise
        self._registry.commit(new)

    def _check_usable(self) -> None:
        if self._closed is not None:
            raise Closed(self._closed)
        if self._poison is not None:
            raise Poisoned(self._poison_message())

    def _poison_message(self) -> str:
        return (
            f"saving state.json failed ({self._poison}); the rename may already have"
            " happened, so this session no longer knows the stored state: close it,"
            " acquire again and get the operation before deciding anything"
        )

    def _release(self, reason: str) -> None:
        if self._closed is not None:
            return
        self._closed = reason
        _OPEN_SESSIONS.discard(self)
        if self._lock_fd is not None:
            fd, self._lock_fd = self._lock_fd, None
            os.close(fd)  # closing the last descriptor releases the OS lock
        self._root.close()

    def _abandon_after_fork(self) -> None:
        """In a forked child: drop the inherited descriptors, never touch the lock."""
        self._guard = threading.Lock()  # the parent may have held it while forking
        self._release(
            "this session belongs to the process that acquired it, not to a forked"
            " child; acquire in the child instead"
        )


PARALLEL_HASH_FROM = 1 << 20  # below this, a thread costs more than the hash it hides


def _write_snapshot(image: Image, fd: int) -> None:
    """Fill the temporary file: the body, then the checksum header in front of it.

    For a large image the checksum is computed in a short-lived thread while this
    thread writes the body and syncs its data (both release the GIL); the caller's
    fsync then only carries the header page and metadata. That hides the hashing
    behind I/O the save needs anyway. A thread per save, not a pool: a pool's worker
    would not survive `fork`.
    """
    if image.size < PARALLEL_HASH_FROM:
        write_all(fd, [image.header(), *image.pieces()], 0)
        return
    headers: list[bytes] = []
    hasher = threading.Thread(target=lambda: headers.append(image.header()), daemon=True)
    hasher.start()
    try:
        write_all(fd, image.pieces(), HEADER_LEN)
        if hasattr(os, "fdatasync"):
            os.fdatasync(fd)
    finally:
        hasher.join()
    if not headers:
        raise RuntimeError("computing the snapshot checksum failed; see the thread's traceback")
    write_at(fd, headers[0], 0)


_OPEN_SESSIONS: weakref.WeakSet[Session] = weakref.WeakSet()


def _forget_sessions_in_child() -> None:
    for session in list(_OPEN_SESSIONS):
        session._abandon_after_fork()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_sessions_in_child)
