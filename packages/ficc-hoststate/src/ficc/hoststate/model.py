"""The operation record, its statuses and the transition table: pure values, no I/O.

The same `Operation` struct is the public value returned by a session and the record
stored in `state.json`, so there is one definition of its shape and constraints.
"""

from __future__ import annotations

import enum
import re
from typing import Annotated

import msgspec

from .errors import InvalidArgument

# `\Z`, not `$`: `$` also matches before a trailing newline, which would let "op\n" in.
OP_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}\Z"
HOST_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}\Z"
PLAN_HASH_PATTERN = r"^sha256:[0-9a-f]{64}\Z"

OpId = Annotated[str, msgspec.Meta(pattern=OP_ID_PATTERN)]
HostId = Annotated[str, msgspec.Meta(pattern=HOST_ID_PATTERN)]
PlanHash = Annotated[str, msgspec.Meta(pattern=PLAN_HASH_PATTERN)]
Revision = Annotated[int, msgspec.Meta(ge=1, le=4)]


class Status(enum.StrEnum):
    """Where an operation stands. Success/recovery labels are the caller's assertion."""

    QUEUED = "queued"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED_RECOVERED = "failed_recovered"
    NEEDS_ATTENTION = "needs_attention"
    UNKNOWN = "unknown"
    CANCELLED = "cancelled"


TRANSITIONS: dict[Status, frozenset[Status]] = {
    Status.QUEUED: frozenset({Status.RUNNING, Status.CANCELLED}),
    Status.RUNNING: frozenset(
        {Status.SUCCEEDED, Status.FAILED_RECOVERED, Status.NEEDS_ATTENTION, Status.UNKNOWN}
    ),
    Status.NEEDS_ATTENTION: frozenset({Status.SUCCEEDED, Status.FAILED_RECOVERED}),
    Status.UNKNOWN: frozenset({Status.SUCCEEDED, Status.FAILED_RECOVERED}),
    Status.SUCCEEDED: frozenset(),
    Status.FAILED_RECOVERED: frozenset(),
    Status.CANCELLED: frozenset(),
}

TERMINAL = frozenset(s for s, nexts in TRANSITIONS.items() if not nexts)


class Operation(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One registered operation. Immutable, so every value handed out is a safe copy.

    `revision` is 1 after `begin` and grows by one per `advance`; the longest path
    (queued, running, needs_attention/unknown, terminal) ends at 4.
    """

    id: OpId
    plan_hash: PlanHash
    status: Status
    revision: Revision

    @property
    def resolved(self) -> bool:
        """True once the operation reached a terminal status and can never change."""
        return self.status in TERMINAL


def _reachable() -> frozenset[tuple[Status, int]]:
    """Every (status, revision) pair some sequence of allowed advances can produce."""
    seen = {(Status.QUEUED, 1)}
    frontier = [(Status.QUEUED, 1)]
    while frontier:
        status, revision = frontier.pop()
        for nxt in TRANSITIONS[status]:
            if (nxt, revision + 1) not in seen:
                seen.add((nxt, revision + 1))
                frontier.append((nxt, revision + 1))
    return frozenset(seen)


REACHABLE = _reachable()


def can_transition(current: Status, nxt: Status) -> bool:
    """Whether the state machine allows moving from `current` to `nxt`."""
    return nxt in TRANSITIONS[current]


def is_consistent(op: Operation) -> bool:
    """False for a record no sequence of advances could have produced (a forged file)."""
    return (op.status, op.revision) in REACHABLE


def check_op_id(value: object) -> str:
    """`value` if it is a valid operation ID; InvalidArgument naming the rule otherwise."""
    return _check(value, OP_ID_PATTERN, "operation ID", "1-128 of [A-Za-z0-9._:-], alnum first")


def check_host_id(value: object) -> str:
    """`value` if it is a valid host ID; InvalidArgument naming the rule otherwise."""
    return _check(value, HOST_ID_PATTERN, "host ID", "1-128 of [A-Za-z0-9._-], alnum first")


def check_plan_hash(value: object) -> str:
    """`value` if it is a `sha256:` plan hash; InvalidArgument naming the rule otherwise."""
    return _check(value, PLAN_HASH_PATTERN, "plan hash", "'sha256:' + 64 lowercase hex")


def check_status(value: object) -> Status:
    """`value` as a Status; InvalidArgument listing the statuses otherwise."""
    try:
        return Status(value)  # type: ignore[arg-type]  # any object: ValueError if not a status
    except ValueError:
        names = ", ".join(s.value for s in Status)
        raise InvalidArgument(f"unknown status {value!r}; use one of: {names}") from None


def check_revision(value: object) -> int:
    """`value` if it is a positive int (never a bool); InvalidArgument otherwise."""
    if type(value) is not int or value < 1:
        raise InvalidArgument(f"revision must be a positive int, got {value!r}")
    return value


def _check(value: object, pattern: str, what: str, shape: str) -> str:
    if not isinstance(value, str) or re.match(pattern, value) is None:
        raise InvalidArgument(f"invalid {what} {value!r}: expected {shape}")
    return value
