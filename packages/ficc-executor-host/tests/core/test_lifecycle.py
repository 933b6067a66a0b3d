"""Every (event, status) pair of the attempt lifecycle, allowed or refused.

The expectations below are written out independently of `lifecycle.TRANSITIONS`:
for each event, the statuses where it is allowed and what changes; every pair not
listed must be refused with `invalid_state`.
"""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ficc.execution.host.core import lifecycle as lc
from ficc.execution.host.core.errors import HostError

Status = lc.Status


def _settled(state: str, **extra: object) -> Status:
    base = {"ready": True, "start_requested": True, "outcome": state, "reason": "exited"}
    return Status(state=state, **(base | extra))  # type: ignore[arg-type]


STATUSES: dict[str, Status] = {
    "staging": Status(state="prepared"),
    "preparing": Status(state="prepared", preparing=True),
    "ready": Status(state="prepared", ready=True),
    "starting": Status(state="starting", ready=True, start_requested=True),
    "running": Status(state="running", ready=True, start_requested=True),
    "stopping": Status(state="running", ready=True, start_requested=True, stop_pending="cancelled"),
    "expiring": Status(state="running", ready=True, start_requested=True, stop_pending="expired"),
    "succeeded": _settled("succeeded", exit_code=0),
    "failed": _settled("failed", exit_code=1),
    "cancelled": _settled("cancelled", reason="stopped"),
    "expired": _settled("expired", reason="lease_expired"),
    "unknown": _settled("unknown", reason="executor_restarted"),
    "prep_failed": Status(state="failed", outcome="failed", reason="prepare_failed"),
    "input_changed": Status(state="failed", ready=True, outcome="failed", reason="input_changed"),
    "rejected": lc.admission_rejected(),
    "legacy": lc.absence_acknowledged(),
    "cleaned": _settled("succeeded", exit_code=0, cleanup_confirmed=True),
    "quarantined": _settled("failed", exit_code=1, quarantined=True),
    "released": msgspec.structs.replace(
        _settled("succeeded", exit_code=0, cleanup_confirmed=True), state="released"
    ),
    "released_rejected": msgspec.structs.replace(lc.admission_rejected(), state="released"),
}
ACTIVE = ["staging", "preparing", "ready", "starting", "running", "stopping", "expiring"]
UNCLEANED = [
    "succeeded",
    "failed",
    "cancelled",
    "expired",
    "unknown",
    "prep_failed",
    "input_changed",
    "quarantined",
]
CLEANED = ["rejected", "legacy", "cleaned"]
SETTLED = UNCLEANED + CLEANED
RELEASED = ["released", "released_rejected"]

SAME = "="


def _all(names: list[str], value: object) -> dict[str, object]:
    return dict.fromkeys(names, value)


def _failed(reason: str) -> dict[str, object]:
    return {"state": "failed", "outcome": "failed", "reason": reason, "cleanup_confirmed": False}


def _ended(state: str) -> dict[str, object]:
    reason = lc.STOP_REASONS[state]
    return {"state": state, "outcome": state, "reason": reason, "preparing": False}


START = lc.StartRequested(lease_current=True, offer_open=True, offer_fits=True)
STARTS: dict[str, object] = {
    "ready": {"state": "starting", "start_requested": True},
    "staging": "!not_ready",
    "preparing": "!runtime_preparing",
    **_all(["starting", "running", "stopping", "expiring"], SAME),
    **_all(["succeeded", "failed", "cancelled", "expired", "unknown"], SAME),
    **_all(["cleaned", "quarantined", "released"], SAME),
    "rejected": "!admission_rejected",
    "released_rejected": "!admission_rejected",
    # refused before it was ever accepted: a retried start hears the same code
    "input_changed": "!input_changed",
}

# event -> {status name: SAME | "!code" | {field: expected value}}; unlisted: !invalid_state
EXPECTED: dict[str, tuple[lc.AnyEvent, dict[str, object]]] = {
    "prepare_begun": (lc.PrepareBegun(), {"staging": {"preparing": True}}),
    "prepare_ok": (lc.PrepareOk(result=b"{}"), {"preparing": {"preparing": False, "ready": True}}),
    "prepare_failed": (
        lc.PrepareFailed(reason="input_digest_mismatch"),
        _all(
            ["staging", "preparing", "ready"],
            _failed("input_digest_mismatch") | {"preparing": False},
        ),
    ),
    "start": (START, STARTS),
    # a start already requested is an idempotent reply whatever the lease or offer now
    "start_lease_expired": (
        lc.StartRequested(lease_current=False, offer_open=True, offer_fits=True),
        STARTS | {"ready": "!lease_expired"},
    ),
    "start_offer_closed": (
        lc.StartRequested(lease_current=True, offer_open=False, offer_fits=True),
        STARTS | {"ready": "!offer_closed"},
    ),
    "start_offer_changed": (
        lc.StartRequested(lease_current=True, offer_open=True, offer_fits=False),
        STARTS | {"ready": "!offer_changed"},
    ),
    "started": (lc.Started(), {"starting": {"state": "running"}}),
    "start_failed": (lc.StartFailed(reason="gate_refused"), {"starting": _failed("gate_refused")}),
    # a start refused before it was accepted fails a ready attempt, never started
    "start_refused": (
        lc.StartRefused(reason="input_changed"),
        {
            "ready": _failed("input_changed"),
            **_all(["staging", "preparing"], "!not_ready"),
        },
    ),
    "start_cancelled": (
        lc.StartCancelled(reason="offer_closed"),
        {
            "starting": {
                "state": "cancelled",
                "outcome": "cancelled",
                "reason": "offer_closed",
                "cleanup_confirmed": False,
            }
        },
    ),
    "finished_0": (
        lc.Finished(exit_code=0),
        _all(
            ["running", "stopping", "expiring"],
            {"state": "succeeded", "outcome": "succeeded", "reason": "exited", "exit_code": 0}
            | {"stop_pending": None},
        ),
    ),
    # an observed exit wins over a pending stop
    "finished_3": (
        lc.Finished(exit_code=3),
        _all(
            ["running", "stopping", "expiring"],
            {"state": "failed", "outcome": "failed", "reason": "exited", "exit_code": 3}
            | {"stop_pending": None},
        ),
    ),
    # a full slot is noted while the payload runs (flags only) ...
    "storage_exhausted": (
        lc.StorageExhausted(log_cut_short=True),
        _all(
            ["starting", "running", "stopping", "expiring"],
            {"storage_exhausted": True, "log_cut_short": True},
        ),
    ),
    "stop": (
        lc.StopRequested(),
        {
            **_all(["staging", "preparing", "ready"], _ended("cancelled")),
            **_all(["starting", "running"], {"stop_pending": "cancelled"}),
            **_all(["stopping", "expiring"], SAME),
            **_all(SETTLED + RELEASED, SAME),
        },
    ),
    "lease_expired": (
        lc.LeaseExpired(),
        {
            **_all(["staging", "preparing", "ready"], _ended("expired")),
            **_all(["starting", "running"], {"stop_pending": "expired"}),
            **_all(["stopping", "expiring"], SAME),
            **_all(SETTLED + RELEASED, SAME),
        },
    ),
    "stopped": (
        lc.Stopped(),
        {
            "stopping": _ended("cancelled") | {"stop_pending": None},
            "expiring": _ended("expired") | {"stop_pending": None},
        },
    ),
    "outcome_lost": (
        lc.OutcomeLost(reason="observe_failed"),
        _all(
            ["starting", "running", "stopping", "expiring"],
            {"state": "unknown", "outcome": "unknown", "reason": "observe_failed"},
        ),
    ),
    "cleanup_confirmed": (
        lc.CleanupConfirmed(),
        {
            **_all(UNCLEANED, {"cleanup_confirmed": True, "quarantined": False}),
            **_all(CLEANED, SAME),
        },
    ),
    "cleanup_failed": (
        lc.CleanupFailed(),
        {
            **_all(UNCLEANED, {"quarantined": True, "cleanup_confirmed": False}),
            "quarantined": SAME,
        },
    ),
    "daemon_restarted": (
        lc.DaemonRestarted(),
        {
            **_all(["staging", "ready"], SAME),
            "preparing": _failed("executor_restarted") | {"preparing": False},
            **_all(
                ["starting", "running", "stopping", "expiring"],
                {"state": "unknown", "outcome": "unknown", "reason": "executor_restarted"},
            ),
            **_all(SETTLED + RELEASED, SAME),
        },
    ),
    "release": (
        lc.Release(),
        {
            **_all(ACTIVE, "!not_terminal"),
            **_all(UNCLEANED, "!cleanup_unconfirmed"),
            **_all(CLEANED, {"state": "released"}),
            **_all(RELEASED, SAME),
        },
    ),
}

CASES = [
    pytest.param(event_name, status_name, id=f"{event_name}-{status_name}")
    for event_name in EXPECTED
    for status_name in STATUSES
]


@pytest.mark.parametrize(("event_name", "status_name"), CASES)
def test_transition(event_name: str, status_name: str) -> None:
    event, expectations = EXPECTED[event_name]
    before = STATUSES[status_name]
    expected = expectations.get(status_name, "!invalid_state")
    if isinstance(expected, str) and expected.startswith("!"):
        with pytest.raises(HostError) as refused:
            lc.apply(before, event)
        assert refused.value.code == expected[1:]
        assert refused.value.message  # an operator-facing explanation
        return
    step = lc.apply(before, event)
    if expected == SAME:
        assert step == lc.Step(before, changed=False)
        return
    assert isinstance(expected, dict)
    assert step.changed
    want = msgspec.structs.replace(before, **expected)
    assert step.status == want


def test_release_keeps_the_outcome() -> None:
    for name in CLEANED:
        before = STATUSES[name]
        after = lc.apply(before, lc.Release()).status
        assert after.state == "released"
        assert after.outcome == before.outcome
    assert lc.apply(STATUSES["legacy"], lc.Release()).status.outcome == "unknown"


def test_initial_statuses() -> None:
    assert lc.admitted() == Status(state="prepared")
    rejected = lc.admission_rejected()
    assert (rejected.state, rejected.reason, rejected.cleanup_confirmed) == (
        "failed",
        "admission_rejected",
        True,
    )
    legacy = lc.absence_acknowledged()
    assert (legacy.state, legacy.outcome, legacy.reason, legacy.cleanup_confirmed) == (
        "unknown",
        "unknown",
        "legacy_absence_acknowledged",
        True,
    )


def test_table_covers_every_state_and_event() -> None:
    assert set(lc.TRANSITIONS) == {e.__struct_config__.tag for e in lc.AnyEvent.__args__}  # type: ignore[attr-defined]
    for row in lc.TRANSITIONS.values():
        assert set(row) <= set(lc.STATES)


# --- properties over random event sequences -----------------------------------------

_EVENTS = st.sampled_from(
    [
        lc.PrepareBegun(),
        lc.PrepareOk(result=b"{}"),
        lc.PrepareFailed(reason="provider_failed"),
        START,
        lc.StartRequested(lease_current=False, offer_open=True, offer_fits=True),
        lc.Started(),
        lc.StartFailed(reason="gate_refused"),
        lc.StartRefused(reason="input_changed"),
        lc.StartCancelled(reason="offer_changed"),
        lc.Finished(exit_code=0),
        lc.Finished(exit_code=137),
        lc.StopRequested(),
        lc.LeaseExpired(),
        lc.Stopped(),
        lc.OutcomeLost(reason="observe_failed"),
        lc.CleanupConfirmed(),
        lc.CleanupFailed(),
        lc.DaemonRestarted(),
        lc.Release(),
    ]
)


@settings(max_examples=400, deadline=None)
@given(st.lists(_EVENTS, max_size=40), st.sampled_from([lc.admitted(), lc.admission_rejected()]))
def test_invariants_hold_for_any_sequence(events: list[lc.AnyEvent], start: Status) -> None:
    status, starts, outcome = start, 0, start.outcome
    for event in events:
        try:
            step = lc.apply(status, event)
        except HostError:
            continue
        after = step.status
        if isinstance(event, lc.StartRequested) and step.changed:
            starts += 1
        if outcome is not None:
            assert after.outcome == outcome, "an outcome never changes once settled"
        if after.state == "released" and status.state != "released":
            assert status.state in lc.SETTLED
            assert status.cleanup_confirmed
        if after.state in ("starting", "running"):
            assert after.start_requested
            assert start.reason is None
        outcome = after.outcome
        status = after
    assert starts <= 1, "an attempt is started at most once"


@pytest.mark.parametrize("code", [0, 3])
@pytest.mark.parametrize("pending", [None, "cancelled", "expired"])
def test_a_full_slot_fails_the_job_whatever_its_exit_code(code: int, pending: str | None) -> None:
    running = msgspec.structs.replace(STATUSES["running"], stop_pending=pending)
    full = lc.apply(running, lc.StorageExhausted(log_cut_short=False)).status
    assert (full.state, full.storage_exhausted, full.log_cut_short) == ("running", True, False)
    full = lc.apply(full, lc.StorageExhausted(log_cut_short=True)).status
    assert full.log_cut_short
    assert lc.apply(full, lc.StorageExhausted(log_cut_short=False)).status.log_cut_short
    done = lc.apply(full, lc.Finished(exit_code=code)).status
    assert (done.state, done.outcome, done.reason) == ("failed", "failed", "storage_exhausted")
    assert (done.exit_code, done.stop_pending) == (code, None)
    assert (done.storage_exhausted, done.log_cut_short) == (True, True)


@pytest.mark.parametrize("pending", [None, "cancelled", "expired"])
def test_an_oom_killed_payload_fails_with_memory_exhausted(pending: str | None) -> None:
    running = msgspec.structs.replace(STATUSES["running"], stop_pending=pending)
    done = lc.apply(running, lc.Finished(exit_code=137, oom_killed=True)).status
    assert (done.state, done.outcome, done.reason) == ("failed", "failed", "memory_exhausted")
    assert (done.exit_code, done.stop_pending) == (137, None)
    # a payload that survived an OOM kill of one of its processes keeps its own exit
    kept = lc.apply(running, lc.Finished(exit_code=0, oom_killed=True)).status
    assert (kept.state, kept.reason) == ("succeeded", "exited")
    # a full slot is the first reason
    full = lc.apply(running, lc.StorageExhausted(log_cut_short=False)).status
    both = lc.apply(full, lc.Finished(exit_code=137, oom_killed=True)).status
    assert both.reason == "storage_exhausted"


def test_a_full_slot_keeps_the_outcome_of_a_stop_and_its_flags_survive_release() -> None:
    stopping = lc.apply(STATUSES["stopping"], lc.StorageExhausted(log_cut_short=True)).status
    stopped = lc.apply(stopping, lc.Stopped()).status
    assert (stopped.state, stopped.reason, stopped.storage_exhausted) == (
        "cancelled",
        "stopped",
        True,
    )
    cleaned = lc.apply(stopped, lc.CleanupConfirmed()).status
    released = lc.apply(cleaned, lc.Release()).status
    assert (released.state, released.outcome, released.storage_exhausted) == (
        "released",
        "cancelled",
        True,
    )
