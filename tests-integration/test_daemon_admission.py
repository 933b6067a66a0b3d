"""Admission, bindings, fences, generation order, the offer, and leases.

Lease deadlines are compared with a small tolerance only where the daemon converts a
BOOTTIME deadline back to wall-clock milliseconds for its reply; the tolerance is far
below the differences the rules are about (seconds to minutes).
"""

from __future__ import annotations

import pytest

from ficc.execution.plan import plan_digest
from ficc.execution.protocol import ObserveRequest, SetOfferRequest
from ficc.execution.wire import OfferReply
from ficc_testkit.driver import attempt, error_code, row_code, rows
from ficc_testkit.host import Daemon
from ficc_testkit.waits import now_ms, wait_for

CONVERSION_SLACK_MS = 250
"""Tolerance for a deadline the daemon reports back in wall-clock milliseconds."""


def test_prepare_admits_into_a_slot_and_replies_at_once(daemon: Daemon) -> None:
    plan = daemon.plan()
    expires = now_ms() + 300_000
    (row,) = rows(daemon.prepare([plan], expires_in_ms=expires - now_ms()))
    record = attempt(row)
    assert (record.attempt_id, record.generation) == (plan.attempt_id, 1)
    assert record.state == "prepared"
    assert record.outcome is None
    assert record.slot in {"s0", "s1"}
    assert record.lease_sequence == 1
    assert record.lease_expires_at_ms is not None
    assert abs(record.lease_expires_at_ms - expires) < 5_000
    assert record.cleanup_confirmed is False
    snap = daemon.snapshot()
    assert [a.attempt_id for a in snap.attempts] == [plan.attempt_id]
    assert {c.class_: c.free for c in snap.capacity.slot_classes} == {"small": 1}


@pytest.mark.parametrize("layout", [{"maximum_lease_seconds": 2}], indirect=True)
def test_a_lease_is_capped_by_maximum_lease_seconds(daemon: Daemon) -> None:
    """An hour asked, two seconds configured: the attempt expires (a real condition,
    waited for with a deadline far below the hour the controller asked for)."""
    plan = daemon.plan()
    rows(daemon.prepare([plan], expires_in_ms=3_600_000))
    expired = daemon.wait_state(plan, lambda r: r.state == "expired", "the capped lease to end")
    assert expired.reason == "lease_expired"


def test_changed_bindings_refuse_the_whole_request_and_write_nothing(daemon: Daemon) -> None:
    good = daemon.bindings()
    for key in ("ledger_id", "installation_id"):
        wrong = dict(good, **{key: "f" * 32})
        reply = daemon.prepare([daemon.plan()], bindings=wrong)
        assert error_code(reply) == "bindings_changed", reply
        reply = daemon.reject_absent([daemon.plan()], bindings=wrong)
        assert error_code(reply) == "bindings_changed", reply
    snap = daemon.snapshot()
    assert snap.attempts == []
    assert snap.bindings() == good


def test_a_repeated_prepare_returns_the_same_record_and_keeps_its_deadline(
    daemon: Daemon,
) -> None:
    plan = daemon.plan()
    (first,) = rows(daemon.prepare([plan], expires_in_ms=120_000))
    (again,) = rows(daemon.prepare([plan], expires_in_ms=500_000))  # asks for much more
    a, b = attempt(first), attempt(again)
    assert (b.attempt_id, b.slot, b.lease_sequence) == (a.attempt_id, a.slot, 1)
    assert a.lease_expires_at_ms is not None
    assert b.lease_expires_at_ms is not None
    assert abs(b.lease_expires_at_ms - a.lease_expires_at_ms) < CONVERSION_SLACK_MS
    assert len(daemon.snapshot().attempts) == 1


def test_a_reused_attempt_id_with_another_plan_is_a_fence_mismatch(daemon: Daemon) -> None:
    plan = daemon.plan()
    rows(daemon.prepare([plan]))
    other = daemon.plan(attempt_id=plan.attempt_id, memory_bytes=32 * 1024 * 1024)
    (row,) = rows(daemon.prepare([other]))
    assert row_code(row) == "fence_mismatch"
    assert attempt(daemon.observe(plan)).plan_digest == plan_digest(plan)  # unchanged
    assert row_code(daemon.observe(other)) == "fence_mismatch"
    assert len(daemon.snapshot().attempts) == 1


def test_an_unknown_attempt_is_refused_per_row(daemon: Daemon) -> None:
    known, unknown = daemon.plan(), daemon.plan()
    rows(daemon.prepare([known]))
    first, second = daemon.fenced(ObserveRequest, [unknown, known])
    assert row_code(first) == "unknown_attempt"
    assert attempt(second).attempt_id == known.attempt_id


def test_generations_of_a_job_are_admitted_in_order_only(daemon: Daemon) -> None:
    """A conflicting generation is refused before any provider call, so like every such
    refusal it leaves a durable admission rejection (detail `generation_conflict`)."""
    job = "9" * 32
    second = daemon.plan(job_id=job, generation=2)
    rows(daemon.prepare([second]))
    lower = daemon.plan(job_id=job, generation=1)
    later = daemon.plan(job_id=job, generation=3)  # generation 2 is not released yet
    for plan in (lower, later):
        (row,) = rows(daemon.prepare([plan]))
        assert row_code(row) == "admission_rejected"
        assert row.error.message.startswith("generation_conflict: ")
        record = attempt(daemon.observe(plan))
        assert (record.state, record.reason, record.slot) == ("failed", "admission_rejected", None)
    assert daemon.layout.provider_calls("probe", lower.attempt_id) == 0
    assert daemon.layout.provider_calls("probe", later.attempt_id) == 0
    held = [a.attempt_id for a in daemon.snapshot().attempts if a.slot is not None]
    assert held == [second.attempt_id]


def test_a_paused_offer_records_durable_admission_rejections(daemon: Daemon) -> None:
    reply = daemon.set_offer("paused", sender="owner")
    assert isinstance(reply, OfferReply), reply
    assert (reply.offer.control, reply.offer.revision) == ("paused", 2)
    plan = daemon.plan(offer_revision=2)
    (row,) = rows(daemon.prepare([plan]))
    # the row names the refusal (offer_closed, or the generic admission_rejected);
    # the durable record is what the protocol fixes
    assert row_code(row) in {"offer_closed", "admission_rejected"}
    record = attempt(daemon.observe(plan))
    assert (record.state, record.outcome, record.reason) == (
        "failed",
        "failed",
        "admission_rejected",
    )
    assert (record.slot, record.cleanup_confirmed) == (None, True)
    # repeated prepare or start cannot run it; release keeps the failed outcome
    (again,) = rows(daemon.prepare([plan]))
    assert attempt(again).state == "failed"
    started = daemon.start_attempt(plan)
    assert row_code(started) is not None or attempt(started).state == "failed"
    released = attempt(daemon.release(plan))
    assert (released.state, released.outcome) == ("released", "failed")
    assert {c.class_: c.free for c in daemon.snapshot().capacity.slot_classes} == {"small": 2}


def test_set_offer_needs_the_current_revision(daemon: Daemon) -> None:
    stale = SetOfferRequest(version=1, id="c" * 32, expected_revision=7, control="paused")
    reply = daemon.as_admin(stale)
    assert error_code(reply) == "offer_revision"
    assert daemon.snapshot().offer.control == "active"
    assert isinstance(daemon.set_offer("draining", sender="admin"), OfferReply)
    assert daemon.snapshot().offer.control == "draining"


def test_renewals_need_strictly_increasing_sequences(daemon: Daemon) -> None:
    plan = daemon.plan()
    rows(daemon.prepare([plan], expires_in_ms=60_000))
    target = now_ms() + 240_000
    renewed = attempt(daemon.renew(plan, 2, target))
    assert renewed.lease_sequence == 2
    assert renewed.lease_expires_at_ms is not None
    assert abs(renewed.lease_expires_at_ms - target) < 5_000
    assert row_code(daemon.renew(plan, 1, target + 60_000)) == "lease_sequence"
    assert row_code(daemon.renew(plan, 2, target + 60_000)) == "lease_sequence"  # not identical
    current = attempt(daemon.observe(plan))
    assert current.lease_sequence == 2
    assert current.lease_expires_at_ms == renewed.lease_expires_at_ms


@pytest.mark.parametrize("layout", [{"maximum_lease_seconds": 3}], indirect=True)
def test_an_identical_duplicate_renewal_keeps_the_original_deadline(daemon: Daemon) -> None:
    """Each renewal is capped to 3 s from receipt. Resending the identical renewal over
    and over must not move the deadline: the attempt still expires. (If a duplicate
    were recomputed, this loop would keep the lease alive until the test's deadline.)"""
    plan = daemon.plan()
    rows(daemon.prepare([plan], expires_in_ms=3_600_000))
    far = now_ms() + 30 * 86_400_000
    first = attempt(daemon.renew(plan, 2, far))
    assert first.lease_sequence == 2

    def duplicate_until_expired() -> bool:
        row = daemon.renew(plan, 2, far)
        if row_code(row) is not None:
            assert row_code(row) in {"lease_expired", "invalid_state"}, row
        return bool(attempt(daemon.observe(plan)).state == "expired")

    wait_for(duplicate_until_expired, "expiry despite identical duplicate renewals")


def test_a_lease_that_runs_out_expires_the_attempt(daemon: Daemon) -> None:
    plan = daemon.plan()
    (row,) = rows(daemon.prepare([plan], expires_in_ms=1_500))
    assert attempt(row).state == "prepared"
    expired = daemon.wait_state(plan, lambda r: r.state == "expired", "state expired")
    assert expired.outcome == "expired"
    assert expired.reason == "lease_expired"
    # an expired lease is never renewed (the terminal record may also say invalid_state)
    assert row_code(daemon.renew(plan, 2, now_ms() + 60_000)) in {"lease_expired", "invalid_state"}
    assert attempt(daemon.observe(plan)).state == "expired"
    assert row_code(daemon.start_attempt(plan)) is not None
    done = daemon.wait_state(plan, lambda r: r.cleanup_confirmed, "confirmed cleanup")
    assert done.state == "expired"
    released = attempt(daemon.release(plan))
    assert (released.state, released.outcome) == ("released", "expired")


def test_a_renewal_whose_expiry_has_passed_ends_the_lease(daemon: Daemon) -> None:
    plan = daemon.plan()
    rows(daemon.prepare([plan], expires_in_ms=120_000))
    daemon.wait_state(plan, lambda r: r.ready or r.state != "prepared", "readiness")
    attempt(daemon.renew(plan, 2, now_ms() - 1_000))
    daemon.wait_state(plan, lambda r: r.state == "expired", "state expired")
