"""The rule of a slot's health without a daemon: a failed check takes it out of
service, a passing one brings it back, and each transition is reported once."""

from __future__ import annotations

from ficc.execution.host.core.slot_health import Change, HealthBook


def test_a_slot_never_seen_failing_is_healthy_since_the_start() -> None:
    book = HealthBook(started_ms=1000)
    state = book.state("s0")
    assert (state.healthy, state.reason, state.since_ms, state.checked_ms) == (
        True, None, 1000, None,
    )  # fmt: skip
    assert book.record("s0", None, 2000) is None  # still healthy: nothing to report
    assert book.state("s0").since_ms == 1000
    assert book.state("s0").checked_ms == 2000


def test_going_and_coming_back_are_each_one_change() -> None:
    book = HealthBook(started_ms=0)
    went = book.record("s0", ("slot_filesystem", "not mounted"), 10)
    assert went == Change("s0", True, "slot_filesystem", "not mounted")
    assert book.broken() == {"s0": "slot_filesystem"}
    assert book.record("s0", ("slot_filesystem", "not mounted"), 20) is None
    assert book.state("s0").since_ms == 10
    back = book.record("s0", None, 30)
    assert back == Change("s0", False, None, None)
    assert book.broken() == {}
    assert book.state("s0").since_ms == 30


def test_a_broken_slot_that_fails_otherwise_keeps_its_since_and_shows_the_new_reason() -> None:
    book = HealthBook(started_ms=0)
    book.record("s0", ("slot_filesystem", "not mounted"), 10)
    assert book.record("s0", ("slot_identity", "another filesystem"), 20) is None
    state = book.state("s0")
    assert (state.reason, state.message, state.since_ms) == (
        "slot_identity",
        "another filesystem",
        10,
    )


def test_the_broken_slots_are_a_copy() -> None:
    book = HealthBook(started_ms=0)
    book.record("s1", ("slot_account", "no account"), 1)
    broken = book.broken()
    broken["s0"] = "x"  # a copy: the book is not changed through it
    assert book.broken() == {"s1": "slot_account"}
