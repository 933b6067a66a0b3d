"""What the ledger holds and hands out: the offer, attempt and input records, and the
rows of an admission batch.

These are the values the rest of the daemon reads; the ledger is the only writer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final, Literal, NamedTuple

import msgspec

from ficc.execution import plan as planlib
from ficc.execution.host.core import leases, lifecycle
from ficc.execution.host.core.errors import HostError
from ficc.execution.host.core.leases import Lease, Now
from ficc.execution.protocol import Fence, OfferLimits
from ficc.execution.provider import FileIdentity
from ficc.execution.wire import Control

OFFER_ALLOWS: Final[dict[str, frozenset[str]]] = {
    "active": frozenset({"admit", "start", "renew"}),
    "draining": frozenset({"start", "renew"}),
    "paused": frozenset({"renew"}),
    "stopped": frozenset(),
}
"""What each offer control lets through. Draining finishes admitted work; paused keeps
leases alive but starts nothing; stopped renews nothing, so expiry stops the work."""


RESOURCES: Final = ("cpu_millis", "memory_bytes", "swap_bytes", "processes")
STORAGE: Final = ("storage_bytes", "storage_inodes")
"""The resource and storage amounts of a reservation, by their column and limit names."""
UUID_PATTERN: Final = r"\A[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}\Z"
"""How a slot filesystem's UUID is written (lower-case hex, dashed)."""


class StreamState(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What the ledger records about one streamed object.

    `offset` is the durable next offset. `failed` holds the refusal code that made
    the object unusable (a failed object prevents start; the attempt follows the
    normal cleanup and release path). `identity` is recorded at completion.
    """

    id: str
    name: str
    bytes: int
    digest: str
    offset: int = 0
    complete: bool = False
    failed: str | None = None
    identity: FileIdentity | None = None


class Bindings(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What a controller saves and sends back before any admission (the three bindings)."""

    installation_id: planlib.Identity
    ledger_id: planlib.Identity
    admission_version: Literal[1]


def lease_is_current(lease: Lease | None, now: Now) -> bool:
    """The lease rules are `leases`' (one copy); a record without a lease is not current."""
    return lease is not None and leases.is_current(lease, now)


class SlotSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A configured slot, as far as admission needs it."""

    id: planlib.Name
    slot_class: planlib.Name
    storage_bytes: planlib.Count
    storage_inodes: planlib.Count


class HostFacts(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What configuration and the clock say at the moment of admission."""

    slots: list[SlotSpec]
    devices: frozenset[str]
    ceiling: OfferLimits
    now: Now
    deployment_id: str | None = None
    """The deployment and node this host serves (None: not checked, for tests of the
    ledger alone); a plan addressed to another is refused."""
    node_id: str | None = None
    out_of_service: dict[str, str] = msgspec.field(default_factory=dict)
    """Slots whose health checks fail, each with its reason: admission places nothing
    in them (core/slot_health.py)."""


class Offer(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    revision: planlib.Positive
    control: Control
    limits: OfferLimits


class AttemptRecord(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """One attempt as the ledger holds it (the plan bytes are read separately)."""

    attempt_id: str
    job_id: str
    generation: int
    plan_digest: str
    offer_revision: int
    status: lifecycle.Status
    detail: str | None
    """The precise admission refusal code when status.reason is admission_rejected."""
    slot_id: str | None
    lease: Lease | None
    created: int
    updated: int
    """Ledger ordinals (a counter bumped by every write transaction), not clock times."""

    @property
    def fence(self) -> Fence:
        return Fence(self.attempt_id, self.generation, self.plan_digest)


class InputRecord(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A streamed input object of an attempt and its durable next offset.

    `failed` is the staging refusal that made the object unusable (the attempt cannot
    start); `identity` is the sealed file's identity, recorded at completion, so the
    start pipeline and a restarted daemon can check the file is still the one hashed.
    """

    attempt_id: str
    object_id: str
    name: str
    bytes: int
    digest: str
    offset: int
    complete: bool
    failed: str | None = None
    identity: FileIdentity | None = None

    def stream_state(self) -> StreamState:
        """The staging state to register with a `Stager` (after a restart, say)."""
        return StreamState(
            id=self.object_id,
            name=self.name,
            bytes=self.bytes,
            digest=self.digest,
            offset=self.offset,
            complete=self.complete,
            failed=self.failed,
            identity=self.identity,
        )


class ResourceUsage(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """What an attempt used (`ficc.execution.wire.Usage` without `final`, and the
    `payload_` figures of its `payload` part); None: the host could not read it. The
    ledger keeps one per attempt, recorded once, when it ended."""

    cpu_user_us: int | None = None
    cpu_system_us: int | None = None
    memory_peak_bytes: int | None = None
    oom_kills: int | None = None
    processes_peak: int | None = None
    storage_bytes: int | None = None
    storage_inodes: int | None = None
    wall_ms: int | None = None
    payload_cpu_user_us: int | None = None
    payload_cpu_system_us: int | None = None
    payload_memory_peak_bytes: int | None = None


USAGE_FIELDS: Final = ResourceUsage.__struct_fields__
"""The figures, by their ledger column and wire names."""


class RecordedUsage(NamedTuple):
    """An attempt's usage as the ledger holds it: `recorded` once it was written (the
    figures never change after that), and the figures (all None before)."""

    recorded: bool
    usage: ResourceUsage


@dataclass(frozen=True)
class Admitted:
    """A row that returned a record. `new` means this call created it (after `prepare`:
    staging and provider preparation follow); a repeat returns the record unchanged
    with `new` false."""

    record: AttemptRecord
    new: bool


@dataclass(frozen=True)
class PrepareRow:
    """A plan to admit with its granted first lease. `refusal` is a check the caller made
    before the transaction (for example, the provider is unavailable): a new plan with a
    refusal is recorded as a durable admission rejection with that code."""

    plan: planlib.Plan
    lease: Lease
    refusal: HostError | None = None
    acknowledged_unknown: Sequence[str] = ()
    """The prepare row's acknowledgement of the job's earlier unknown attempts."""


@dataclass(frozen=True)
class Applied:
    record: AttemptRecord
    changed: bool


Row = Admitted | HostError
