"""A storm of process events for test_task_index.py (run as root, not imported).

    python storm.py SETRESUID_NUMBER UID_ONE UID_TWO

It forks `WORKERS` worker processes whose leader stays root and waits. In each, one
thread switches between the two accounts with the raw `setresuid` system call (that
thread alone, so its IDs differ from its leader's; the saved UID stays root's so it
can switch again) and loops: fork a child that execs `/bin/true`, starts a thread and
exits, or exits at once; start a short-lived thread that switches to the other
account and ends; switch. It prints `storming` once every worker has looped, and for
each `round` line on stdin, `round` once every worker has looped `ROUND` more times.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import struct
import sys
import threading
import time

WORKERS = 4
ROUND = 50

_libc = ctypes.CDLL(None, use_errno=True)
SETRESUID, ONE, TWO = (int(value) for value in sys.argv[1:4])
_COUNTS = mmap.mmap(-1, 8 * WORKERS)  # shared with the worker processes


def loops() -> list[int]:
    return list(struct.unpack_from(f"={WORKERS}Q", _COUNTS))


def become(uid: int) -> None:
    """This thread alone: root's effective UID back (the saved one allows it), then
    the account's real and effective UIDs, root's kept as the saved one."""
    for ids in ((-1, 0, -1), (uid, uid, 0)):
        if _libc.syscall(SETRESUID, *ids) != 0:
            error = ctypes.get_errno()
            raise OSError(error, os.strerror(error))


def child(kind: int) -> None:
    try:
        if kind == 0:
            os.execv("/bin/true", ["true"])
        elif kind == 1:
            threading.Thread(target=lambda: None).start()
    finally:
        os._exit(0)


def work(number: int) -> None:
    uids = (ONE, TWO) if number % 2 else (TWO, ONE)
    turn = 0
    while True:
        become(uids[turn % 2])
        pid = os.fork()
        if pid == 0:
            child(turn % 3)
        os.waitpid(pid, 0)
        short = threading.Thread(target=become, args=(uids[(turn + 1) % 2],))
        short.start()
        short.join()
        turn += 1
        struct.pack_into("=Q", _COUNTS, 8 * number, turn)


def worker(number: int) -> None:
    """A worker process: root's leader waits, one thread storms."""
    thread = threading.Thread(target=work, args=(number,), daemon=True)
    thread.start()
    thread.join()
    os._exit(1)  # the storm thread failed (its traceback is on stderr)


def wait_for(done: int) -> None:
    """Until every worker has looped `done` times (the counters are in shared memory:
    a look every millisecond is a wait for them, not a guess at a duration)."""
    while min(loops()) < done:
        time.sleep(0.001)


def main() -> None:
    for number in range(WORKERS):
        if os.fork() == 0:
            worker(number)
    wait_for(1)
    print("storming", flush=True)
    for line in sys.stdin:
        if line.strip() == "round":
            wait_for(min(loops()) + ROUND)
            print("round", flush=True)


main()
