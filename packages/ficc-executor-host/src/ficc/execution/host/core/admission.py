"""Admission arithmetic: whether a plan may be admitted, given what is already held.

Pure: every function takes what one transaction read (the offer, the ceiling, the
host's slots and devices, the records a batch can collide with) and returns an answer
or raises a `Rejection`; the ledger reads, asks, and writes the answer in the same
transaction. Tested like `lifecycle`, without a database.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Final, NamedTuple

from ficc.execution import plan as planlib
from ficc.execution._executor import canonical_plans
from ficc.execution.errors import ErrorCode
from ficc.execution.host.core.errors import HostError
from ficc.execution.host.core.leases import Lease
from ficc.execution.host.core.records import (
    OFFER_ALLOWS,
    RESOURCES,
    STORAGE,
    AttemptRecord,
    HostFacts,
    Offer,
    SlotSpec,
    lease_is_current,
)
from ficc.execution.protocol import OfferLimits, Resources
from ficc.execution.provider import MinimumLimits

COUNTED: Final = ("attempts", *RESOURCES, *STORAGE)
"""What admission counts per reservation, in the order it checks them."""


def amounts(limits: planlib.Limits) -> tuple[int, ...]:
    """What one reservation of `limits` adds, aligned with `COUNTED`."""
    return (
        1,
        limits.cpu_millis,
        limits.memory_bytes,
        limits.swap_bytes,
        limits.processes,
        limits.storage_bytes,
        limits.storage_inodes,
    )


@dataclass
class Occupancy:
    """What non-released records with a slot hold: the reservations admission adds to."""

    slots: set[str]
    devices: set[str]
    used: list[int]
    """What they hold of each resource, aligned with `COUNTED`."""
    free: dict[str, list[SlotSpec]] = dataclasses.field(default_factory=dict)
    """Free slots by class, in configuration order, filled on first use in a batch."""

    def free_of(self, slot_class: str, facts: HostFacts) -> list[SlotSpec]:
        if slot_class not in self.free:
            self.free[slot_class] = [
                s
                for s in facts.slots
                if s.slot_class == slot_class
                and s.id not in self.slots
                and s.id not in facts.out_of_service
            ]
        return self.free[slot_class]

    def add(self, slot: SlotSpec, limits: planlib.Limits) -> None:
        self.slots.add(slot.id)
        if slot in self.free.get(slot.slot_class, ()):
            self.free[slot.slot_class].remove(slot)
        self.devices.update(limits.devices)
        self.used = list(map(operator.add, self.used, amounts(limits)))


class Rejection(HostError):
    """An admission refusal before any provider call: committed as a failed record."""


AdmissionRejection = Rejection
"""Public name: a prepare row refused with a durable `admission_rejected` record."""


def allowed(value: str, offered: list[str] | None, ceiling: list[str] | None) -> bool:
    return (offered is None or value in offered) and (ceiling is None or value in ceiling)


class Terms(NamedTuple):
    """What every row of one admission transaction is judged against, worked out once:
    the offer, the ceiling, and the tighter of their bounds (aligned with `COUNTED`)."""

    offer: Offer
    ceiling: OfferLimits
    bounds: tuple[int, ...]

    @classmethod
    def of(cls, offer: Offer, ceiling: OfferLimits) -> Terms:
        offered, most = offer.limits.resources, ceiling.resources
        bounds = tuple(min(getattr(offered, n), getattr(most, n)) for n in COUNTED)
        return cls(offer, ceiling, bounds)


def choose_slot(plan: planlib.Plan, facts: HostFacts, occupancy: Occupancy) -> SlotSpec:
    """The first free slot of the plan's class that fits its storage and streamed inputs."""
    limits = plan.job.limits
    streamed = sum(i.bytes for i in plan.streamed_inputs)
    for slot in occupancy.free_of(plan.job.slot_class, facts):
        if (
            limits.storage_bytes <= slot.storage_bytes
            and limits.storage_inodes <= slot.storage_inodes
            and streamed <= min(slot.storage_bytes, limits.storage_bytes)
        ):
            return slot
    raise Rejection(
        ErrorCode.SLOT_CAPACITY,
        f"no free slot of class {plan.job.slot_class!r} fits this plan's storage and inputs;"
        " wait for a release or send a smaller plan" + _out_of_service(plan, facts),
    )


def _out_of_service(plan: planlib.Plan, facts: HostFacts) -> str:
    """The slots of the plan's class that are out of service, for the refusal's message:
    the controller waits or sends the work elsewhere, the administrator repairs them."""
    broken = [
        f"{s.id} ({facts.out_of_service[s.id]})"
        for s in facts.slots
        if s.slot_class == plan.job.slot_class and s.id in facts.out_of_service
    ]
    if not broken:
        return ""
    return (
        f"; out of service: {', '.join(broken)} (their checks fail; the administrator"
        " repairs them: `ficc-executor status` says why)"
    )


def check_acknowledged(acknowledged: Sequence[str], unacknowledged: set[str]) -> None:
    """A job whose earlier attempts ended `unknown` is retried only with an explicit
    acknowledgement of exactly those not yet acknowledged (each is acknowledged once)."""
    if set(acknowledged) == unacknowledged:
        return
    missing, extra = (
        sorted(unacknowledged - set(acknowledged)),
        sorted(set(acknowledged) - unacknowledged),
    )
    raise Rejection(
        ErrorCode.UNKNOWN_NOT_ACKNOWLEDGED,
        f"acknowledged_unknown must list exactly the job's earlier attempts whose outcome is"
        f" unknown and not yet acknowledged; missing {missing}, not acceptable {extra}:"
        " decide on each unknown attempt (inspect its effects), then prepare a new"
        " attempt that lists them",
    )


def check_addressed_here(plan: planlib.Plan, facts: HostFacts) -> None:
    """A plan names its deployment and node; one for another host is refused first,
    before any other answer could send an operator after the wrong cause."""
    if facts.deployment_id is not None and (plan.deployment_id, plan.node_id) != (
        facts.deployment_id,
        facts.node_id,
    ):
        raise Rejection(
            ErrorCode.NODE_MISMATCH,
            f"the plan is for deployment {plan.deployment_id}, node {plan.node_id}; this host"
            f" serves deployment {facts.deployment_id}, node {facts.node_id}: send it to its"
            " own node (take a snapshot to see which host a socket belongs to)",
        )


def below_minimum(plan: planlib.Plan, minimums: MinimumLimits | None) -> Rejection | None:
    """Why `plan` asks for less than its provider's own runtime needs (the driver's
    `minimum_limits()`, read once when the provider was configured), or None.

    The provider's supervisor runs inside the attempt's service, under the plan's
    limits: below these figures it cannot start any payload, and the attempt would only
    fail later, after a slot was held and the runtime was killed or refused a fork. So
    such a plan is refused here, before anything is reserved and before any provider
    method runs, with the figure an operator must ask for."""
    if minimums is None:
        return None
    limits, provider = plan.job.limits, plan.job.runtime.provider
    short = [
        (name, getattr(limits, name), needed)
        for name in MinimumLimits.__struct_fields__
        if (needed := getattr(minimums, name)) is not None and getattr(limits, name) < needed
    ]
    if not short:
        return None
    return Rejection(
        ErrorCode.LIMITS_BELOW_MINIMUM,
        "; ".join(
            f"{name} {asked} is below the {needed} the {provider} runtime needs; ask for at"
            f" least {needed}{_in_mib(name, needed)}"
            for name, asked, needed in short
        ),
    )


def _in_mib(name: str, value: int) -> str:
    """A byte figure in MiB too, as an operator reads it."""
    return f" ({value / (1 << 20):g} MiB)" if name.endswith("_bytes") else ""


def admissible_slot(
    plan: planlib.Plan, lease: Lease, terms: Terms, facts: HostFacts, occupancy: Occupancy
) -> SlotSpec:
    """Every admission check that needs no provider; raises Rejection or returns a slot."""
    offer, ceiling = terms.offer, terms.ceiling
    if "admit" not in OFFER_ALLOWS[offer.control]:
        raise Rejection(ErrorCode.OFFER_CLOSED, f"the offer is {offer.control}; try later")
    if plan.offer_revision != offer.revision:
        raise Rejection(
            ErrorCode.OFFER_REVISION,
            f"the plan was made for offer revision {plan.offer_revision}, the offer is now at"
            f" {offer.revision}; take a new snapshot",
        )
    if not lease_is_current(lease, facts.now):
        raise Rejection(ErrorCode.LEASE_EXPIRED, "the first lease is already past its deadline")
    if not allowed(plan.project_id, offer.limits.projects, ceiling.projects):
        raise Rejection(ErrorCode.ADMISSION_REJECTED, "this project is not in the offer")
    if not allowed(plan.job.runtime.provider, offer.limits.runtimes, ceiling.runtimes):
        raise Rejection(ErrorCode.ADMISSION_REJECTED, "this runtime is not in the offer")
    limits = plan.job.limits
    for device in limits.devices:
        if device not in facts.devices or device in occupancy.devices:
            raise Rejection(
                ErrorCode.ADMISSION_REJECTED, f"device {device!r} is not configured or is in use"
            )
    asked = amounts(limits)
    for name, held, amount, bound in zip(COUNTED, occupancy.used, asked, terms.bounds, strict=True):
        if held + amount > bound:
            raise Rejection(
                ErrorCode.ADMISSION_REJECTED,
                f"{name}: {held} reserved + {amount} asked > {bound} offered",
            )
    return choose_slot(plan, facts, occupancy)


def fits(
    plan: planlib.Plan, offer: Offer, ceiling: OfferLimits | None, started: dict[str, int]
) -> bool:
    """Whether the current offer (and ceiling) still covers starting `plan` now."""
    limits = [offer.limits] + ([ceiling] if ceiling is not None else [])
    for bound in limits:
        if not allowed(plan.project_id, bound.projects, None):
            return False
        if not allowed(plan.job.runtime.provider, bound.runtimes, None):
            return False
    wanted = {"attempts": 1} | {n: getattr(plan.job.limits, n) for n in RESOURCES + STORAGE}
    for name, amount in wanted.items():
        bound_value = min(getattr(b.resources, name) for b in limits)
        if started[name] + amount > bound_value:
            return False
    return True


def add_usage(usage: dict[str, int], limits: planlib.Limits, sign: int = 1) -> None:
    usage["attempts"] += sign
    for name in RESOURCES + STORAGE:
        usage[name] += sign * getattr(limits, name)


def within(limits: OfferLimits, ceiling: OfferLimits) -> str | None:
    """Why `limits` exceeds `ceiling`, or None."""
    for name in Resources.__struct_fields__:
        if getattr(limits.resources, name) > getattr(ceiling.resources, name):
            return f"resources.{name} is above the ceiling"
    for name in ("projects", "runtimes"):
        allowed, wanted = getattr(ceiling, name), getattr(limits, name)
        if allowed is not None and (wanted is None or not set(wanted) <= set(allowed)):
            return f"{name} allows more than the ceiling"
    return None


class Encoded(NamedTuple):
    """A plan with its canonical bytes and digest, computed once outside the transaction."""

    plan: planlib.Plan
    data: bytes
    digest: str

    @classmethod
    def each(cls, plans: Iterable[planlib.Plan]) -> list[Encoded]:
        plans = list(plans)
        data = canonical_plans(plans)
        return list(map(cls, plans, data, map(planlib.digest_of, data)))


class JobAttempt(NamedTuple):
    """What admission needs of each earlier attempt of a job."""

    attempt_id: str
    generation: int
    state: str
    outcome: str | None
    acknowledged: tuple[str, ...]
    """The unknown attempts this attempt's admission acknowledged."""


@dataclass
class Known:
    """The records a batch can collide with, read once and updated as rows are recorded."""

    records: dict[str, AttemptRecord]
    jobs: dict[str, list[JobAttempt]]
    """job ID -> each of its attempts."""

    def add(self, record: AttemptRecord, acknowledged: Sequence[str] = ()) -> None:
        self.records[record.attempt_id] = record
        status = record.status
        entry = JobAttempt(
            record.attempt_id, record.generation, status.state, status.outcome, tuple(acknowledged)
        )
        self.jobs.setdefault(record.job_id, []).append(entry)

    def unacknowledged(self, plan: planlib.Plan) -> set[str]:
        """The job's earlier attempts with an `unknown` outcome that no admission has
        acknowledged yet: exactly what the plan's prepare row must acknowledge."""
        attempts = self.jobs.get(plan.job_id, [])
        done = {attempt_id for a in attempts for attempt_id in a.acknowledged}
        return {
            a.attempt_id
            for a in attempts
            if a.generation < plan.generation and a.outcome == "unknown"
        } - done

    def existing(self, plan: Encoded) -> AttemptRecord | None:
        """The record of a repeated plan, or None if the plan may be recorded; raises
        `fence_mismatch` or `generation_conflict` (the caller decides what to record)."""
        record = self.records.get(plan.plan.attempt_id)
        if record is not None:
            if record.plan_digest != plan.digest or record.generation != plan.plan.generation:
                raise HostError(
                    ErrorCode.FENCE_MISMATCH,
                    "this attempt ID is recorded with another plan; never reuse an attempt ID",
                )
            return record
        for _, generation, state, _, _ in self.jobs.get(plan.plan.job_id, []):
            if generation >= plan.plan.generation:
                raise HostError(
                    ErrorCode.GENERATION_CONFLICT,
                    f"generation {generation} of this job is already recorded; use a higher one",
                )
            if state != "released":
                raise HostError(
                    ErrorCode.GENERATION_CONFLICT,
                    f"generation {generation} of this job is not released yet; release it first",
                )
        return None
