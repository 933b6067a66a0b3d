"""Code that runs in child processes of the multi-process tests.

`hold` runs under `python -c` (a fresh interpreter); `mutate` and `stop_at_marker`
run in children made with os.fork (cheap enough for thousands of kills) and never
return: they end by os._exit or by the parent's SIGKILL.
"""

from __future__ import annotations

import os
import random
import sys

import ficc.hoststate.session as session_module
from ficc.hoststate import Blocked, Session, Status, acquire
from hs_support import HOST, plan

S = Status
# Lifecycles from each status to a terminal one (the mutation loop picks among them).
PATHS: dict[Status, list[list[Status]]] = {
    S.QUEUED: [
        [S.CANCELLED],
        [S.RUNNING, S.SUCCEEDED],
        [S.RUNNING, S.FAILED_RECOVERED],
        [S.RUNNING, S.NEEDS_ATTENTION, S.SUCCEEDED],
        [S.RUNNING, S.NEEDS_ATTENTION, S.FAILED_RECOVERED],
        [S.RUNNING, S.UNKNOWN, S.SUCCEEDED],
        [S.RUNNING, S.UNKNOWN, S.FAILED_RECOVERED],
    ],
    S.RUNNING: [
        [S.SUCCEEDED],
        [S.FAILED_RECOVERED],
        [S.NEEDS_ATTENTION, S.SUCCEEDED],
        [S.UNKNOWN, S.FAILED_RECOVERED],
    ],
    S.NEEDS_ATTENTION: [[S.SUCCEEDED], [S.FAILED_RECOVERED]],
    S.UNKNOWN: [[S.SUCCEEDED], [S.FAILED_RECOVERED]],
}


def op_name(n: int) -> str:
    return f"op-{n:07d}"


def hold(directory: str) -> None:
    """Acquire, say so on stdout, then hold the lock until stdin closes."""
    with acquire(directory, HOST):
        sys.stdout.write("held\n")
        sys.stdout.flush()
        sys.stdin.read()


def try_acquire(directory: str) -> None:
    """Print the outcome of one acquire attempt (for the reverse lock test)."""
    try:
        acquire(directory, HOST).close()
        print("acquired")
    except Exception as exc:  # the parent asserts on the code
        print(getattr(exc, "code", repr(exc)))


def mutate(directory: str, seed: int, first: int, ack_fd: int) -> None:
    """Drive full lifecycles forever, acknowledging each returned call on `ack_fd`.

    An acknowledgement line is written only after the call returned, so every
    acknowledged transition was durable before the parent could see it.
    """
    rng = random.Random(seed)
    with acquire(directory, HOST) as session:
        n = _last_existing(session, first)
        while True:
            name = op_name(n)
            op, _ = session.begin(name, plan(name))  # idempotent for an existing one
            _ack(ack_fd, op.id, op.revision, op.status)
            if rng.random() < 0.1 and not op.resolved:
                try:
                    session.begin(op_name(n + 1), plan(op_name(n + 1)))
                    raise AssertionError("begin was not blocked by an unresolved record")
                except Blocked:
                    pass
            if not op.resolved:
                for status in rng.choice(PATHS[op.status]):
                    op = session.advance(op.id, op.revision, status)
                    _ack(ack_fd, op.id, op.revision, op.status)
            n += 1


def _last_existing(session: Session, first: int) -> int:
    """The highest-numbered operation the store has, starting at what the parent saw."""
    n = first
    while True:
        try:
            session.get(op_name(n + 1))
        except KeyError:
            return n
        n += 1


def _ack(fd: int, op_id: str, revision: int, status: Status) -> None:
    os.write(fd, f"{op_id} {revision} {status.value}\n".encode())


def stop_at_marker(directory: str, report_fd: int, wait_fd: int) -> None:
    """Begin the first operation, but stop just before the marker is written."""

    def stopped(fd: int, data: bytes) -> None:
        os.write(report_fd, b"at-marker\n")
        os.read(wait_fd, 1)  # blocks until the parent kills us
        os._exit(3)

    session_module.write_in_place = stopped  # type: ignore[assignment]
    with acquire(directory, HOST) as session:
        session.begin("op-1", plan("op-1"))
