"""Host-wide scans of live tasks by account, one walk for every caller waiting on it.

Whether a slot account has anything left anywhere on the host is answered by reading
the status of every thread on the host (`live_tasks`: credentials are per thread,
and no cheaper source is exact). A process's leader is not enough: a leader that
called `exit(2)` while another thread runs shows `State: Z`, and its live thread is
only seen in `/proc/PID/task/`. The host asks before it confirms an attempt's
cleanup, and a provider before it lets anything of a slot run or acts on the slot
account's files, so both sides use this one module (a provider runs inside the
host's process, so they also share its walks).

A batch of attempts settles together: 32 cleanups walked all of /proc 32 times,
each walk the longer for the others' processes. `SharedScan` lets concurrent callers
share a walk. A caller is only ever answered by a walk that began after it asked, so
its answer is exactly as fresh as a walk of its own, and exactly what `live_tasks` of
its own UIDs would say.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import NamedTuple, Protocol

__all__ = [
    "SHARED",
    "TASK_STATUS_BYTES",
    "Answers",
    "SharedScan",
    "Source",
    "TaskHits",
    "accounts_in",
    "has_live_thread",
    "live_tasks",
    "live_uid_of",
    "scan_tasks",
    "state_and_uids",
    "task_status",
    "tasks_of",
]


TASK_STATUS_BYTES = 8192
"""Enough for State and Uid, which come in a status file's first lines."""


def state_and_uids(data: bytes) -> tuple[bytes, tuple[int, ...]] | None:
    """The `State:` letter and the four `Uid:` values of a status file, or None when
    either is missing or malformed, or `Uid:` comes first (a caller counting live tasks
    counts it as live).

    Only these two lines are looked up, by search rather than by splitting every line:
    a host-wide scan reads every task's status. A line can only begin after a newline
    the kernel wrote, because it escapes a newline in a task's name.
    """
    text = b"\n" + data
    state_at = text.find(b"\nState:")
    uid_at = text.find(b"\nUid:")
    if state_at < 0 or uid_at < state_at:
        return None
    state = _line_value(text, state_at + 7)[:1]
    parts = _line_value(text, uid_at + 5).split()
    if len(parts) != 4 or not b"".join(parts).isdigit():  # each part is non-empty
        return None
    return state, tuple(map(int, parts))


def _line_value(text: bytes, start: int) -> bytes:
    """The rest of the line from `start`, without its surrounding blanks."""
    end = text.find(b"\n", start)
    return text[start : None if end < 0 else end].strip()


def task_status(path: str) -> bytes | None:
    """A task's status bytes; None when the task is gone."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except (FileNotFoundError, ProcessLookupError):
        return None
    try:
        return os.read(fd, TASK_STATUS_BYTES)
    except ProcessLookupError:
        return None
    finally:
        os.close(fd)


def live_tasks(uids: set[int]) -> list[tuple[int, int]]:
    """(uid, pid) of each process with a live (non-zombie) thread whose real,
    effective, saved or filesystem UID is in `uids`; uid -1 for a process with a
    thread whose status could not be parsed, which is counted as live (fail closed).

    Every thread is read (credentials are per thread), each on its own: a thread that
    ends while it is read is skipped without skipping its siblings. Who owns the /proc
    files is not used to filter: a non-dumpable process's files are root's.
    """
    return accounts_in(scan_tasks(uids), uids)


class TaskHits(NamedTuple):
    """What one walk saw of one process: the UIDs of `uids` its live threads hold,
    and whether a thread's status could not be parsed."""

    pid: int
    hits: frozenset[int]
    unreadable: bool


def scan_tasks(uids: set[int]) -> list[TaskHits]:
    """One walk of every thread on the host: each process that holds any of `uids` in
    a live thread, or has a thread whose status cannot be parsed. `accounts_in` turns
    it into `live_tasks`'s answer for any subset of `uids`."""
    found: list[TaskHits] = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            seen = _process_hits(int(entry), uids)
            if seen.hits or seen.unreadable:
                found.append(seen)
    return found


def accounts_in(scan: list[TaskHits], uids: set[int]) -> list[tuple[int, int]]:
    """`live_tasks(uids)` from a walk that looked for at least `uids`."""
    found: list[tuple[int, int]] = []
    for seen in scan:
        mine = seen.hits & uids
        if mine:
            found.append((min(mine), seen.pid))
        elif seen.unreadable:
            found.append((-1, seen.pid))
    return found


def live_uid_of(pid: int, uids: set[int]) -> int | None:
    """The smallest of `uids` a live thread of process `pid` runs as, -1 for a thread
    whose status cannot be parsed, or None (none of them, or the process is gone)."""
    found = accounts_in([_process_hits(pid, uids)], uids)
    return found[0][0] if found else None


def has_live_thread(pid: int) -> bool:
    """Whether any thread of process `pid` is alive (not a zombie; a status that cannot
    be parsed counts as alive). A leader that called `exit(2)` while another thread
    runs is a zombie whose process is not done: its /proc/PID/status says `Z`."""
    for task in tasks_of(pid):
        data = task_status(f"/proc/{pid}/task/{task}/status")
        if data is None:
            continue
        parsed = state_and_uids(data)
        if parsed is None or parsed[0] != b"Z":
            return True
    return False


def tasks_of(pid: int) -> list[str]:
    """The task (thread) IDs of process `pid` as /proc names them; [] when gone."""
    try:
        return os.listdir(f"/proc/{pid}/task")
    except (FileNotFoundError, ProcessLookupError):
        return []


def _process_hits(pid: int, uids: set[int]) -> TaskHits:
    hits: set[int] = set()
    unreadable = False
    for task in tasks_of(pid):
        data = task_status(f"/proc/{pid}/task/{task}/status")
        if data is None:
            continue
        parsed = state_and_uids(data)
        if parsed is None:
            unreadable = True
        elif parsed[0] != b"Z":
            hits.update(uids.intersection(parsed[1]))
    return TaskHits(pid, frozenset(hits), unreadable)


# --- one walk shared by the callers waiting for it ---------------------------------

Scan = Callable[[set[int]], list[TaskHits]]


class SharedScan:
    """`live_tasks` for many threads at once: whoever finds no walk running leads the
    next one for every UID asked for until then; callers that arrive while a walk runs
    wait for the one after it (they asked too late for the running one)."""

    def __init__(self, scan: Scan = scan_tasks) -> None:
        self._scan = scan
        self._changed = threading.Condition()
        self._next = 0  # the walk that serves a caller arriving now
        self._walking = False
        self._wanted: dict[int, set[int]] = {}
        self._waiting: dict[int, int] = {}
        self._done: dict[int, list[TaskHits] | BaseException] = {}
        self.walks = 0

    def live_tasks(self, uids: set[int]) -> list[tuple[int, int]]:
        """What `live_tasks(uids)` says, from a walk that began after this call."""
        with self._changed:
            walk = self._next
            self._wanted.setdefault(walk, set()).update(uids)
            self._waiting[walk] = self._waiting.get(walk, 0) + 1
            while walk not in self._done and self._walking:
                self._changed.wait()
            lead = walk not in self._done
            if lead:
                self._walking, self._next = True, walk + 1
                wanted = self._wanted.pop(walk)
        if lead:
            self._lead(walk, wanted)
        with self._changed:
            outcome = self._done[walk]
            self._waiting[walk] -= 1
            if not self._waiting[walk]:
                del self._waiting[walk], self._done[walk]
        if isinstance(outcome, BaseException):
            raise outcome
        return accounts_in(outcome, uids)

    def _lead(self, walk: int, wanted: set[int]) -> None:
        outcome: list[TaskHits] | BaseException
        try:
            outcome = self._scan(wanted)
        except BaseException as error:  # every caller of this walk gets it
            outcome = error
        with self._changed:
            self._done[walk] = outcome
            self._walking = False
            self.walks += 1
            self._changed.notify_all()


class Source(Protocol):
    """Anything that answers `live_tasks` as a walk begun after the call would."""

    def live_tasks(self, uids: set[int]) -> list[tuple[int, int]]:
        """(uid or -1, process) of every process with a live task of `uids`."""
        ...


class Answers:
    """Where this process's decisions get their answer: the kernel's task index once
    the host started one (taskindex.py), else a walk shared by concurrent callers.
    Who asks (the host's cleanup kill and idle checks, the smoke test, a provider's
    idle checks and kills) never needs to know which."""

    def __init__(self) -> None:
        self.walk = SharedScan()
        self._told: Source | None = None
        self.why_walking = "no task index was started in this process"

    def live_tasks(self, uids: set[int]) -> list[tuple[int, int]]:
        """Every process with a live task of `uids` now (see `live_tasks`)."""
        told = self._told
        return (told or self.walk).live_tasks(uids)

    @property
    def told(self) -> bool:
        """Whether answers come from the kernel's task index."""
        return self._told is not None

    def use(self, source: Source | None, why_walking: str = "") -> None:
        """Answer from `source` from now on (None: walk again, because `why_walking`)."""
        self._told = source
        self.why_walking = why_walking


SHARED = Answers()
"""The process's one source of answers."""
