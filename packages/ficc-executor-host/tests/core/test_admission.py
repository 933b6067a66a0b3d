"""Admission arithmetic without a database: each refusal, slot choice and the rule that
reservations never exceed the tighter of the offer and the ceiling."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ficc.execution import plan as planlib
from ficc.execution.errors import ErrorCode
from ficc.execution.host.core import admission
from ficc.execution.host.core.errors import HostError
from ficc.execution.host.core.lifecycle import admitted
from ficc.execution.host.ledger.store import AttemptRecord, Offer
from ficc.execution.provider import MinimumLimits
from ficc_testkit.plans import new_id
from ledger_support import CEILING, NOW, facts, lease, limits, make_plan

OFFER = Offer(revision=1, control="active", limits=limits())


def empty() -> admission.Occupancy:
    return admission.Occupancy(slots=set(), devices=set(), used=[0] * len(admission.COUNTED))


def judge(plan: object, offer: Offer = OFFER, occupancy: admission.Occupancy | None = None) -> str:
    """The slot admission gives `plan`, or the refusal's code."""
    terms = admission.Terms.of(offer, CEILING)
    try:
        slot = admission.admissible_slot(plan, lease(), terms, facts(), occupancy or empty())  # type: ignore[arg-type]
    except admission.Rejection as rejection:
        return rejection.code
    return slot.id


@pytest.mark.parametrize(
    ("offer", "code"),
    [
        (Offer(1, "paused", limits()), ErrorCode.OFFER_CLOSED),
        (Offer(1, "draining", limits()), ErrorCode.OFFER_CLOSED),
        (Offer(2, "active", limits()), ErrorCode.OFFER_REVISION),
        (Offer(1, "active", limits(cpu_millis=999)), ErrorCode.ADMISSION_REJECTED),
        (Offer(1, "active", limits(attempts=0)), ErrorCode.ADMISSION_REJECTED),
    ],
)
def test_the_offer_refuses(offer: Offer, code: str) -> None:
    assert judge(make_plan(), offer) == code


def test_an_expired_first_lease_is_refused() -> None:
    terms = admission.Terms.of(OFFER, CEILING)
    expired = lease(deadline_ns=NOW.boottime_ns)
    with pytest.raises(admission.Rejection) as refusal:
        admission.admissible_slot(make_plan(), expired, terms, facts(), empty())
    assert refusal.value.code == ErrorCode.LEASE_EXPIRED


def test_a_device_not_configured_or_in_use_is_refused() -> None:
    assert judge(make_plan(devices=("gpu1",))) == ErrorCode.ADMISSION_REJECTED
    held = empty()
    held.devices.add("gpu0")
    assert judge(make_plan(devices=("gpu0",)), occupancy=held) == ErrorCode.ADMISSION_REJECTED
    assert judge(make_plan(devices=("gpu0",))) == "slot0"


def test_the_first_free_slot_of_the_class_is_chosen_and_then_held() -> None:
    occupancy = empty()
    plan = make_plan()
    first = admission.admissible_slot(
        plan, lease(), admission.Terms.of(OFFER, CEILING), facts(slots=2), occupancy
    )
    occupancy.add(first, plan.job.limits)
    assert judge(make_plan(), occupancy=occupancy) == "slot1"
    assert judge(make_plan(slot_class="gpu")) == ErrorCode.SLOT_CAPACITY


def test_an_acknowledgement_must_name_exactly_the_unacknowledged() -> None:
    admission.check_acknowledged(["a", "b"], {"a", "b"})
    for given_ in (["a"], ["a", "b", "c"], []):
        with pytest.raises(admission.Rejection) as refusal:
            admission.check_acknowledged(given_, {"a", "b"})
        assert refusal.value.code == ErrorCode.UNKNOWN_NOT_ACKNOWLEDGED


def _record(plan: object, digest: str, state: str = "prepared") -> AttemptRecord:
    status = admitted()
    status = type(status)(**{**{f: getattr(status, f) for f in status.__struct_fields__},
                             "state": state})  # fmt: skip
    return AttemptRecord(attempt_id=plan.attempt_id, job_id=plan.job_id,  # type: ignore[attr-defined]
                         generation=plan.generation, plan_digest=digest, offer_revision=1,  # type: ignore[attr-defined]
                         status=status, detail=None, slot_id="slot0", lease=None, created=1,
                         updated=1)  # fmt: skip


def test_known_records_fence_repeats_and_order_generations() -> None:
    plan = make_plan()
    (encoded,) = admission.Encoded.each([plan])
    known = admission.Known(records={}, jobs={})
    assert known.existing(encoded) is None
    known.add(_record(plan, encoded.digest))
    assert known.existing(encoded) == known.records[plan.attempt_id]
    (other,) = admission.Encoded.each([make_plan(attempt_id=plan.attempt_id, name="other")])
    with pytest.raises(HostError) as mismatch:
        known.existing(other)
    assert mismatch.value.code == ErrorCode.FENCE_MISMATCH
    (next_one,) = admission.Encoded.each([make_plan(job_id=plan.job_id, generation=2)])
    with pytest.raises(HostError) as conflict:
        known.existing(next_one)
    assert conflict.value.code == ErrorCode.GENERATION_CONFLICT  # generation 1 still held


def test_within_names_what_exceeds_the_ceiling() -> None:
    assert admission.within(limits(), CEILING) is None
    assert admission.within(limits(cpu_millis=10), limits(cpu_millis=5)) == (
        "resources.cpu_millis is above the ceiling"
    )


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.integers(min_value=1, max_value=4000), min_size=1, max_size=12),
    st.integers(min_value=0, max_value=10_000),
    st.integers(min_value=0, max_value=6),
)
def test_reservations_never_exceed_the_tighter_bound(
    asks: list[int], cpu_bound: int, attempt_bound: int
) -> None:
    offer = Offer(1, "active", limits(cpu_millis=cpu_bound, attempts=attempt_bound))
    terms = admission.Terms.of(offer, CEILING)
    occupancy, host = empty(), facts(slots=8)
    admitted_cpu = admitted_count = 0
    for cpu in asks:
        plan = make_plan(cpu_millis=cpu, job_id=new_id())
        try:
            slot = admission.admissible_slot(plan, lease(), terms, host, occupancy)
        except admission.Rejection:
            continue
        occupancy.add(slot, plan.job.limits)
        admitted_cpu, admitted_count = admitted_cpu + cpu, admitted_count + 1
    assert admitted_cpu <= cpu_bound
    assert admitted_count <= min(attempt_bound, 8)
    assert occupancy.used[admission.COUNTED.index("cpu_millis")] == admitted_cpu


# --- what the provider's runtime states it needs -----------------------------------------


def _with_limits(**figures: int) -> planlib.Plan:
    plan = make_plan()
    limits_ = msgspec.structs.replace(plan.job.limits, **figures)
    return msgspec.structs.replace(plan, job=msgspec.structs.replace(plan.job, limits=limits_))


def test_a_provider_that_states_no_minimum_refuses_nothing() -> None:
    assert admission.below_minimum(_with_limits(memory_bytes=1, processes=1), None) is None
    assert admission.below_minimum(_with_limits(memory_bytes=1), MinimumLimits()) is None


def test_a_plan_at_the_minimum_is_admissible() -> None:
    stated = MinimumLimits(memory_bytes=64 << 20, processes=64)
    assert (
        admission.below_minimum(_with_limits(memory_bytes=64 << 20, processes=64), stated) is None
    )


def test_a_plan_below_the_minimum_is_refused_with_the_figure_to_ask_for() -> None:
    stated = MinimumLimits(memory_bytes=64 << 20, processes=64)
    refusal = admission.below_minimum(_with_limits(memory_bytes=8 << 20, processes=64), stated)
    assert isinstance(refusal, admission.Rejection)
    assert refusal.code == ErrorCode.LIMITS_BELOW_MINIMUM
    assert refusal.message == (
        "memory_bytes 8388608 is below the 67108864 the podman runtime needs; ask for at"
        " least 67108864 (64 MiB)"
    )
    both = admission.below_minimum(_with_limits(memory_bytes=1 << 20, processes=8), stated)
    assert both is not None
    assert both.message.count("is below") == 2
    assert "processes 8 is below the 64 the podman runtime needs; ask for at least 64" in (
        both.message
    )


def test_a_slot_out_of_service_is_never_chosen() -> None:
    """Admission takes another healthy slot of the class, or refuses `slot_capacity`
    naming the broken one and its reason (what an operator must repair)."""
    terms = admission.Terms.of(OFFER, CEILING)
    broken = msgspec.structs.replace(facts(slots=2), out_of_service={"slot0": "slot_filesystem"})
    slot = admission.admissible_slot(make_plan(), lease(), terms, broken, empty())
    assert slot.id == "slot1"
    held = empty()
    held.add(slot, make_plan().job.limits)
    with pytest.raises(admission.Rejection) as refusal:
        admission.admissible_slot(make_plan(), lease(), terms, broken, held)
    assert refusal.value.code == ErrorCode.SLOT_CAPACITY
    assert "out of service: slot0 (slot_filesystem)" in refusal.value.message
    every = msgspec.structs.replace(broken, out_of_service={"slot0": "a", "slot1": "b"})
    with pytest.raises(admission.Rejection) as refusal:
        admission.admissible_slot(make_plan(), lease(), terms, every, empty())
    assert "out of service: slot0 (a), slot1 (b)" in refusal.value.message
