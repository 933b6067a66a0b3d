"""Decoded: the runner's plans and prepared results, decoded once (logic only; the
pipeline tests run every step of real attempts through it)."""

from __future__ import annotations

from typing import Any

from ficc.execution.host.runner.attempts import Decoded
from ficc_testkit import plans


def _plan(n: int) -> Any:
    return plans.make_plan(argv=("/bin/true", str(n)))


def test_what_was_kept_is_answered_until_the_attempt_is_forgotten() -> None:
    decoded = Decoded()
    plan, prepared = _plan(1), object()
    assert decoded.plan("a") is None
    decoded.keep_plan("a", plan, 100)
    decoded.keep_prepared("a", prepared, 50)  # type: ignore[arg-type]
    assert decoded.plan("a") is plan
    assert decoded.prepared("a") is prepared
    assert decoded.plan("b") is None
    decoded.forget("a")
    assert decoded.plan("a") is None
    assert decoded.prepared("a") is None


def test_the_oldest_go_first_once_the_bytes_are_over_the_bound() -> None:
    decoded = Decoded()
    third = Decoded.MOST_BYTES // 3
    for name in ("a", "b", "c"):
        decoded.keep_plan(name, _plan(len(name)), third)
    assert [decoded.plan(n) is not None for n in "abc"] == [True, True, True]
    decoded.keep_plan("d", _plan(4), third)
    assert [decoded.plan(n) is not None for n in "abcd"] == [False, True, True, True]
    decoded.forget("b")
    decoded.keep_plan("e", _plan(5), third)  # fits in the room "b" left
    assert [decoded.plan(n) is not None for n in "cde"] == [True, True, True]


def test_a_value_larger_than_the_bound_is_not_kept_and_the_first_keeping_stands() -> None:
    decoded = Decoded()
    decoded.keep_plan("big", _plan(1), Decoded.MOST_BYTES + 1)
    assert decoded.plan("big") is None
    first, second = _plan(2), _plan(3)
    decoded.keep_plan("a", first, 10)
    decoded.keep_plan("a", second, 10)
    assert decoded.plan("a") is first
