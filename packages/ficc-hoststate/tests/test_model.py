"""The pure rules: the transition table, reachable records, ID shapes."""

from __future__ import annotations

import itertools

import pytest

from ficc.hoststate import InvalidArgument, Status
from ficc.hoststate.model import (
    REACHABLE,
    TERMINAL,
    TRANSITIONS,
    can_transition,
    check_host_id,
    check_op_id,
    check_plan_hash,
    check_revision,
    check_status,
)

S = Status
ALLOWED = {
    (S.QUEUED, S.RUNNING),
    (S.QUEUED, S.CANCELLED),
    (S.RUNNING, S.SUCCEEDED),
    (S.RUNNING, S.FAILED_RECOVERED),
    (S.RUNNING, S.NEEDS_ATTENTION),
    (S.RUNNING, S.UNKNOWN),
    (S.NEEDS_ATTENTION, S.SUCCEEDED),
    (S.NEEDS_ATTENTION, S.FAILED_RECOVERED),
    (S.UNKNOWN, S.SUCCEEDED),
    (S.UNKNOWN, S.FAILED_RECOVERED),
}
ALL_PAIRS = list(itertools.product(Status, Status))


def test_status_values_are_the_seed_names() -> None:
    assert [s.value for s in Status] == [
        "queued", "running", "succeeded", "failed_recovered",
        "needs_attention", "unknown", "cancelled",
    ]  # fmt: skip


@pytest.mark.parametrize(("current", "nxt"), ALL_PAIRS, ids=lambda s: s.value)
def test_transition_table_is_exactly_the_seed(current: Status, nxt: Status) -> None:
    assert can_transition(current, nxt) is ((current, nxt) in ALLOWED)


def test_terminal_states() -> None:
    assert {S.SUCCEEDED, S.FAILED_RECOVERED, S.CANCELLED} == TERMINAL
    assert all(not TRANSITIONS[s] for s in TERMINAL)


def test_reachable_pairs() -> None:
    assert frozenset(
        {
            (S.QUEUED, 1), (S.RUNNING, 2), (S.CANCELLED, 2),
            (S.SUCCEEDED, 3), (S.FAILED_RECOVERED, 3), (S.NEEDS_ATTENTION, 3), (S.UNKNOWN, 3),
            (S.SUCCEEDED, 4), (S.FAILED_RECOVERED, 4),
        }
    ) == REACHABLE  # fmt: skip


@pytest.mark.parametrize(
    "good", ["a", "A", "0", "op-1", "a.b_c:d-e", "x" * 128, "9" + "._:-" * 31 + "abc"]
)
def test_valid_op_ids(good: str) -> None:
    assert check_op_id(good) == good


@pytest.mark.parametrize(
    "bad",
    ["", "-a", ".a", "_a", ":a", "x" * 129, "a b", "a/b", "a\n", "a\x00", "é", 'a"', None, 3],
)
def test_invalid_op_ids(bad: object) -> None:
    with pytest.raises(InvalidArgument) as info:
        check_op_id(bad)
    assert info.value.code == "invalid_argument"
    assert "operation ID" in str(info.value)


@pytest.mark.parametrize("bad", ["", "-h", "h:1", "h" * 129, "h\n", "h/1", "h h", b"h"])
def test_invalid_host_ids(bad: object) -> None:
    with pytest.raises(InvalidArgument):
        check_host_id(bad)


def test_valid_host_id() -> None:
    assert check_host_id("Host-1.example_x") == "Host-1.example_x"


@pytest.mark.parametrize(
    "bad",
    [
        "sha256:" + "A" * 64,
        "sha256:" + "a" * 63,
        "sha256:" + "a" * 65,
        "sha512:" + "a" * 64,
        "a" * 64,
        "sha256:" + "a" * 64 + "\n",
        "sha256:" + "g" * 64,
    ],
)
def test_invalid_plan_hashes(bad: str) -> None:
    with pytest.raises(InvalidArgument):
        check_plan_hash(bad)


@pytest.mark.parametrize("bad", [0, -1, True, 1.0, "1", None])
def test_invalid_revisions(bad: object) -> None:
    with pytest.raises(InvalidArgument):
        check_revision(bad)


@pytest.mark.parametrize("bad", ["done", "QUEUED", "", None, 1])
def test_invalid_status(bad: object) -> None:
    with pytest.raises(InvalidArgument):
        check_status(bad)


def test_status_accepts_enum_and_string() -> None:
    assert check_status("running") is S.RUNNING
    assert check_status(S.UNKNOWN) is S.UNKNOWN
