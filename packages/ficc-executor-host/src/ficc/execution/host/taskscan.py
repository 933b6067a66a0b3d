"""Host-wide scans of live tasks by account, one walk for every caller waiting on it.

Whether a slot account has anything left anywhere on the host is answered by reading
the status of every thread on the host (`procfs.live_tasks`: credentials are per
thread, and no cheaper source is exact). Cleanup asks it for each settled attempt, and
a batch of attempts settles together: 32 cleanups walked all of /proc 32 times, each
walk the longer for the others' processes. `SharedScan` lets concurrent callers share
a walk. A caller is only ever answered by a walk that began after it asked, so its
answer is exactly as fresh as a walk of its own, and exactly what `live_tasks` of its
own UIDs would say.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from ficc.execution.host import procfs

__all__ = ["SHARED", "SharedScan"]

Scan = Callable[[set[int]], list[procfs.TaskHits]]


class SharedScan:
    """`live_tasks` for many threads at once: whoever finds no walk running leads the
    next one for every UID asked for until then; callers that arrive while a walk runs
    wait for the one after it (they asked too late for the running one)."""

    def __init__(self, scan: Scan = procfs.scan_tasks) -> None:
        self._scan = scan
        self._changed = threading.Condition()
        self._next = 0  # the walk that serves a caller arriving now
        self._walking = False
        self._wanted: dict[int, set[int]] = {}
        self._waiting: dict[int, int] = {}
        self._done: dict[int, list[procfs.TaskHits] | BaseException] = {}
        self.walks = 0

    def live_tasks(self, uids: set[int]) -> list[tuple[int, int]]:
        """What `procfs.live_tasks(uids)` says, from a walk that began after this call."""
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
        return procfs.accounts_in(outcome, uids)

    def _lead(self, walk: int, wanted: set[int]) -> None:
        outcome: list[procfs.TaskHits] | BaseException
        try:
            outcome = self._scan(wanted)
        except BaseException as error:  # every caller of this walk gets it
            outcome = error
        with self._changed:
            self._done[walk] = outcome
            self._walking = False
            self.walks += 1
            self._changed.notify_all()


SHARED = SharedScan()
"""The daemon's one shared scan (cleanup's kill and idle checks, the smoke test)."""
