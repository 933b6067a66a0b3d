"""Model-based test: random call sequences against a real session and a tiny model.

The model is the contract's rules written as plainly as possible; hypothesis drives both
with the same calls (including reopening the store) and compares every outcome.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import tempfile
from collections.abc import Callable
from typing import TypeVar

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

import ficc.hoststate as hs
from ficc.hoststate import Status, acquire
from ficc.hoststate.model import TERMINAL, TRANSITIONS
from hs_support import HOST, plan, soak_size

IDS = st.sampled_from(["a", "b", "c", "d"])
HASHES = st.sampled_from([plan(1), plan(2)])


T = TypeVar("T")


def outcome(call: Callable[[], T]) -> tuple[T | None, type[Exception] | None]:
    """(result, None) or (None, the HostStateError class the call raised)."""
    try:
        return call(), None
    except hs.HostStateError as exc:
        return None, type(exc)


class Registry(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.tmp = tempfile.mkdtemp(prefix="ficc-hs-stateful-")
        self.dir = pathlib.Path(self.tmp) / "state"
        self.dir.mkdir(mode=0o700)
        os.chmod(self.dir, 0o700)
        self.session = acquire(self.dir, HOST)
        self.model: dict[str, tuple[str, Status, int]] = {}

    def teardown(self) -> None:
        self.session.close()
        shutil.rmtree(self.tmp)

    def unresolved(self) -> bool:
        return any(status not in TERMINAL for _, status, _ in self.model.values())

    @rule(op_id=IDS, plan_hash=HASHES)
    def begin(self, op_id: str, plan_hash: str) -> None:
        stored = self.model.get(op_id)
        if stored is not None and stored[0] != plan_hash:
            expected: type[Exception] | None = hs.Conflict
        elif stored is None and self.unresolved():
            expected = hs.Blocked
        else:
            expected = None
        result, raised = outcome(lambda: self.session.begin(op_id, plan_hash))
        assert raised is expected, f"begin({op_id}): expected {expected}, got {raised}"
        if result is None:
            return
        op, created = result
        assert created is (stored is None)
        if stored is None:
            self.model[op_id] = (plan_hash, Status.QUEUED, 1)
        assert (op.plan_hash, op.status, op.revision) == self.model[op_id]

    @rule(op_id=IDS, delta=st.sampled_from([-1, 0, 0, 0, 1]), nxt=st.sampled_from(list(Status)))
    def advance(self, op_id: str, delta: int, nxt: Status) -> None:
        stored = self.model.get(op_id)
        revision = (stored[2] if stored else 1) + delta
        if revision < 1:
            return
        if stored is None:
            expected: type[Exception] | None = hs.NotFound
        elif stored[2] != revision:
            expected = hs.StaleRevision
        elif nxt not in TRANSITIONS[stored[1]]:
            expected = hs.InvalidTransition
        else:
            expected = None
        op, raised = outcome(lambda: self.session.advance(op_id, revision, nxt))
        assert raised is expected, f"advance({op_id}, {revision}, {nxt}): {raised}, not {expected}"
        if op is None:
            return
        assert stored is not None
        self.model[op_id] = (stored[0], nxt, revision + 1)
        assert (op.status, op.revision) == (nxt, revision + 1)

    @rule()
    def reopen(self) -> None:
        self.session.close()
        self.session = acquire(self.dir, HOST)

    @invariant()
    def matches_model(self) -> None:
        for op_id in ("a", "b", "c", "d"):
            try:
                op = self.session.get(op_id)
            except hs.NotFound:
                assert op_id not in self.model
            else:
                assert (op.plan_hash, op.status, op.revision) == self.model[op_id]


Registry.TestCase.settings = settings(
    max_examples=soak_size(ci=40, soak=1000),
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_registry_against_model = pytest.mark.soak(Registry.TestCase)
