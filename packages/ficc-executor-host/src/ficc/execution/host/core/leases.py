"""Lease rules on the boot clock, without I/O.

A controller grants time by wall clock (`expires_at_ms`, Unix milliseconds), but the wall
clock can jump backwards and a suspended or rebooted machine must not wake up with time
to spare. So on receipt a lease is turned into a deadline on `CLOCK_BOOTTIME`, which
counts suspended time and never goes back, tagged with the kernel's boot ID, which
changes on every boot. From then on only the boot clock decides: a wall-clock rollback
cannot extend a deadline already stored, a suspend consumes lease time, and after a
reboot (or a restarted daemon on a new boot) no old lease is current.

The current time is passed in as a `Now` value (see `clock.BootClock` for the real
one), so every rule here is a pure function that tests can drive with any clock. A
decision that is recorded (a renewal, a start, the release, an input commit, an
expiry) reads the clock inside the ledger transaction that records it, so it is
judged at one instant against the record as that transaction sees it: the ledger
takes a `Clock` (or, in tests, a fixed `Now`) and reads it there (`reading`).
Refusal codes: `lease_expired`, `lease_sequence`.
"""

from __future__ import annotations

from typing import Annotated, Protocol

import msgspec

from ficc.execution.errors import ErrorCode
from ficc.execution.host.core.errors import HostError
from ficc.execution.plan import Count, Positive

BOOT_ID_PATTERN = r"\A[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}\Z"
BootId = Annotated[str, msgspec.Meta(pattern=BOOT_ID_PATTERN)]
Nanoseconds = Count

_NS_PER_MS = 1_000_000
_NS_PER_S = 1_000_000_000


class Now(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One reading of the host clocks: boot identity, boot time and wall time."""

    boot_id: BootId
    boottime_ns: Nanoseconds
    wall_ns: int  # may be anything the wall clock says, even before 1970


class Clock(Protocol):
    """Anything that reads `Now` (the real one is `clock.BootClock`)."""

    def now(self) -> Now: ...


def reading(when: Now | Clock) -> Now:
    """The reading of `when`: a fixed `Now` as it is, a clock read now."""
    return when if isinstance(when, Now) else when.now()


class Lease(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A lease as the host records it: the terms as sent and the boot-clock deadline."""

    boot_id: BootId
    sequence: Positive
    expires_at_ms: Count
    deadline_boottime_ns: Nanoseconds
    effective_expires_at_ms: Count
    """The deadline the host enforces, as wall-clock Unix ms computed at receipt: the
    asked `expires_at_ms` unless `maximum_lease_seconds` capped it (or it had passed).
    `expires_at_ms` stays the value asked for, which identifies a duplicate renewal."""


class Renewal(Protocol):
    """The lease terms of a request row (the protocol's `Renewal` satisfies this)."""

    @property
    def sequence(self) -> int: ...

    @property
    def expires_at_ms(self) -> int: ...


def grant(first: Renewal, now: Now, maximum_lease_seconds: int) -> Lease:
    """Turn the first lease of an admission (sequence 1) into a recorded lease.

    The deadline is now on the boot clock plus the time left until `expires_at_ms` on the
    wall clock, capped at `maximum_lease_seconds`. An expiry already past is refused.
    """
    if first.sequence != 1:
        raise HostError(
            ErrorCode.LEASE_SEQUENCE,
            f"the first lease of an attempt has sequence 1, not {first.sequence}; "
            "send prepare with lease sequence 1",
        )
    remaining = _remaining_ns(first, now, maximum_lease_seconds)
    if remaining <= 0:
        raise HostError(
            ErrorCode.LEASE_EXPIRED,
            f"expires_at_ms {first.expires_at_ms} is not in the future by this host's clock; "
            "send a lease that expires later (check the controller's clock)",
        )
    return _lease(first, now, remaining)


def renew(current: Lease, renewal: Renewal, now: Now, maximum_lease_seconds: int) -> Lease:
    """Apply a renewal to the recorded lease and return the lease to record.

    An expired lease (deadline passed, or from another boot) cannot be renewed. An
    identical duplicate (same sequence and expiry) returns `current` unchanged, so a
    retried renewal keeps the original deadline. Otherwise the sequence must be strictly
    greater. The new deadline is what the renewal asks for, capped: it may be earlier
    than the current one, and a renewal whose expiry has already passed ends the lease
    at once (the returned lease is not current), since the controller is asking the
    work to stop.
    """
    if not is_current(current, now):
        raise HostError(
            ErrorCode.LEASE_EXPIRED,
            f"the lease (sequence {current.sequence}) has expired and cannot be renewed; "
            "the attempt is being stopped, release it when it is terminal",
        )
    same_sequence = renewal.sequence == current.sequence
    if same_sequence and renewal.expires_at_ms == current.expires_at_ms:
        return current
    if renewal.sequence <= current.sequence:
        reused = "was already used with another expires_at_ms" if same_sequence else "is stale"
        raise HostError(
            ErrorCode.LEASE_SEQUENCE,
            f"lease sequence {renewal.sequence} {reused} (current {current.sequence}); "
            "send a renewal with a sequence greater than the current one",
        )
    remaining = max(0, _remaining_ns(renewal, now, maximum_lease_seconds))
    return _lease(renewal, now, remaining)


def is_current(lease: Lease, now: Now) -> bool:
    """True only on the boot that granted the lease and before its boot-clock deadline."""
    return lease.boot_id == now.boot_id and now.boottime_ns < lease.deadline_boottime_ns


def remaining_ns(lease: Lease, now: Now) -> int:
    """Boot-clock nanoseconds until the lease expires; 0 if it is not current."""
    if not is_current(lease, now):
        return 0
    return lease.deadline_boottime_ns - now.boottime_ns


def _remaining_ns(renewal: Renewal, now: Now, maximum_lease_seconds: int) -> int:
    asked = renewal.expires_at_ms * _NS_PER_MS - now.wall_ns
    return min(asked, maximum_lease_seconds * _NS_PER_S)


def _lease(renewal: Renewal, now: Now, remaining: int) -> Lease:
    return Lease(
        boot_id=now.boot_id,
        sequence=renewal.sequence,
        expires_at_ms=renewal.expires_at_ms,
        deadline_boottime_ns=now.boottime_ns + remaining,
        effective_expires_at_ms=effective_ms(now, remaining),
    )


def effective_ms(now: Now, remaining: int) -> int:
    """The wall-clock Unix ms of a deadline `remaining` boot-clock ns after `now`,
    rounded down so a controller never plans with time the host will not give."""
    return max(0, (now.wall_ns + remaining) // _NS_PER_MS)
