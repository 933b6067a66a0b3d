"""The registry's rules over the set of operations, without I/O.

Each mutation is split into `plan_*` (decide, or refuse, without changing anything)
and `commit` (record the decided value), because the session must save the new
snapshot in between: nothing is recorded in memory that is not yet on disk.
"""

from __future__ import annotations

from collections.abc import Iterable

from .errors import Blocked, Conflict, InvalidTransition, NotFound, StaleRevision
from .model import Operation, Status, can_transition


class Registry:
    """All operations of one host, keyed by ID, plus the one unresolved ID (if any)."""

    def __init__(self, operations: Iterable[Operation] = ()) -> None:
        self._ops: dict[str, Operation] = {}
        self._unresolved: str | None = None
        for op in operations:
            self.commit(op)

    def __len__(self) -> int:
        return len(self._ops)

    def operations(self) -> list[Operation]:
        """Every operation, sorted by ID (the snapshot order)."""
        return [self._ops[k] for k in sorted(self._ops)]

    def get(self, op_id: str) -> Operation:
        """The operation `op_id`; NotFound if the registry has none."""
        try:
            return self._ops[op_id]
        except KeyError:
            raise NotFound(
                f"no operation {op_id!r} is registered on this host; check the ID"
            ) from None

    def plan_begin(self, op_id: str, plan_hash: str) -> tuple[Operation, bool]:
        """The record `begin` returns and whether it is new; raises if it must refuse."""
        existing = self._ops.get(op_id)
        if existing is not None:
            if existing.plan_hash != plan_hash:
                raise Conflict(
                    f"operation {op_id!r} is registered with plan hash {existing.plan_hash},"
                    f" not {plan_hash}; an ID is never reused for another plan: pick a new ID"
                )
            return existing, False
        if self._unresolved is not None:
            blocker = self._ops[self._unresolved]
            raise Blocked(
                f"operation {blocker.id!r} is still {blocker.status.value} (revision"
                f" {blocker.revision}); resolve it (inspect the host's actual state, then"
                f" advance it to a terminal status) before beginning {op_id!r}"
            )
        return Operation(id=op_id, plan_hash=plan_hash, status=Status.QUEUED, revision=1), True

    def plan_advance(self, op_id: str, revision: int, nxt: Status) -> Operation:
        """The advanced record; raises if the revision is stale or the step not allowed."""
        current = self.get(op_id)
        if current.revision != revision:
            raise StaleRevision(
                f"operation {op_id!r} is at revision {current.revision} ({current.status.value}),"
                f" not {revision}; get it again and decide from its current status"
            )
        if not can_transition(current.status, nxt):
            raise InvalidTransition(
                f"operation {op_id!r} cannot go from {current.status.value} to {nxt.value}"
            )
        return Operation(id=op_id, plan_hash=current.plan_hash, status=nxt, revision=revision + 1)

    def commit(self, op: Operation) -> None:
        """Record a planned (and saved) value, keeping track of the unresolved one."""
        self._ops[op.id] = op
        if not op.resolved:
            self._unresolved = op.id
        elif self._unresolved == op.id:
            self._unresolved = None
