"""The rows of version-1 requests and the bounds they share: fences, renewals, prepared
attempts, object references, input chunks, reads, resources and offer limits. Public
through `ficc.execution.protocol`; this module is private."""

from __future__ import annotations

import binascii
import enum
import hashlib
from collections.abc import Iterator
from typing import Annotated, Any, Literal

import msgspec

from ficc.execution import _rules
from ficc.execution.plan import (
    MAX_ROWS,
    Count,
    Digest,
    Identity,
    Name,
    Plan,
    Positive,
)

PROTOCOL_VERSION = 1
_MIB = 1024 * 1024
COLLECT_MAX_BYTES = 1 * _MIB
"""Most bytes one `collect` request may ask for, summed over its reads."""
INPUT_CHUNK_MAX_BYTES = 8 * _MIB
"""Most decoded bytes one `input_write` request may carry (current executors)."""
INPUT_CHUNK_LEGACY_BYTES = 1 * _MIB
"""The chunk bound to assume when a snapshot has no `input_chunk_bytes`."""
ZERO_ID = "0" * 32
"""The request ID a refusal echoes when the request's own ID could not be read."""
ObjectName = Annotated[
    str, msgspec.Meta(pattern=r"\A(?:stdout|stderr|output:[a-z][a-z0-9_.-]{0,79})\Z")
]
"""What `collect` can read: the two log streams and declared outputs."""
_ReadLength = Annotated[int, msgspec.Meta(ge=1, le=COLLECT_MAX_BYTES)]
_BATCH = msgspec.Meta(min_length=1, max_length=MAX_ROWS)
"""A batch has 1..64 rows."""


class Sender(enum.StrEnum):
    """Who is on the other end of the socket, decided only by socket and SO_PEERCRED."""

    TRANSPORT = "transport"
    OWNER = "owner"
    ADMINISTRATOR = "administrator"


class Fence(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What every per-attempt operation binds: attempt, generation and plan digest."""

    attempt_id: Identity
    generation: Positive
    plan_digest: Digest


class Renewal(msgspec.Struct, frozen=True, forbid_unknown_fields=True, gc=False):
    """A lease renewal: the fence, a strictly increasing sequence and a wall-clock expiry.

    Up to 64 per request, in `prepare` and `renew`: there their patterns are checked
    per batch, by the request; a renewal decoded or converted on its own checks itself.
    """

    attempt_id: _rules.CheckedIdentity
    generation: Positive
    plan_digest: _rules.CheckedDigest
    sequence: Positive
    expires_at_ms: Count

    def __post_init__(self) -> None:
        """Check the ID and digest patterns, unless a request checks its whole batch."""
        if not _rules.checks_deferred():
            _rules.check_rules([self], Renewal)

    @property
    def fence(self) -> Fence:
        """The renewal's attempt, generation and plan digest."""
        return Fence(self.attempt_id, self.generation, self.plan_digest)


ACKNOWLEDGED_MAX = 1024
"""Most earlier unknown attempts one prepare row may acknowledge."""


class PrepareAttempt(
    msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True, gc=False
):
    """One attempt to admit: its immutable plan and its first lease (sequence 1).

    `acknowledged_unknown` lists the attempt IDs of the job's earlier generations whose
    outcome is `unknown` and that the controller explicitly accepts retrying after (the
    host requires exactly the unacknowledged ones). It is omitted when empty, so a row
    without acknowledgements keeps the bytes it always had; the plan never changes.
    """

    plan: Plan
    lease: Renewal
    acknowledged_unknown: Annotated[list[Identity], msgspec.Meta(max_length=ACKNOWLEDGED_MAX)] = (
        msgspec.field(default_factory=list)
    )


class ObjectRef(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """An `input_status` row: the fence and a declared streamed input ID."""

    attempt_id: Identity
    generation: Positive
    plan_digest: Digest
    object: Identity

    @property
    def fence(self) -> Fence:
        """The row's attempt, generation and plan digest."""
        return Fence(self.attempt_id, self.generation, self.plan_digest)


class _ChunkRow:
    """What both spellings of an `input_write` row answer: the fence, and the chunk."""

    __slots__ = ()
    attempt_id: str
    generation: int
    plan_digest: str
    object: str
    offset: int
    digest: str
    __dict__: dict[str, Any]

    def _base64(self) -> str | memoryview:
        raise NotImplementedError

    @property
    def fence(self) -> Fence:
        """The row's attempt, generation and plan digest."""
        return Fence(self.attempt_id, self.generation, self.plan_digest)

    @property
    def chunk(self) -> bytes:
        """The decoded chunk (decoded once, when the request was validated)."""
        cached: bytes | None = self.__dict__.get("_chunk")
        if cached is None:
            cached = _canonical_b64decode(self._base64())
            self.__dict__["_chunk"] = cached
        return cached

    @property
    def chunk_size(self) -> int:
        """The decoded chunk's length."""
        return len(self.chunk)

    def chunk_pieces(self) -> Iterator[bytes]:
        """The decoded chunk in order, in pieces (here one: the whole `chunk`)."""
        yield self.chunk

    def _measure(self) -> tuple[int, str]:
        """The decoded length and `sha256:` digest, for the request's checks."""
        chunk = self.chunk
        return len(chunk), "sha256:" + hashlib.sha256(chunk).hexdigest()


class InputWrite(msgspec.Struct, _ChunkRow, frozen=True, forbid_unknown_fields=True, dict=True):
    """An `input_write` row: one chunk at the object's durable next offset.

    `data` is canonical base64 and `digest` the SHA-256 of the decoded chunk; the
    request checks both and keeps the decoded bytes, available as `chunk`.
    """

    attempt_id: Identity
    generation: Positive
    plan_digest: Digest
    object: Identity
    offset: Count
    data: str
    digest: Digest

    def _base64(self) -> str | memoryview:
        return self.data


class Read(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A `collect` row: `length` bytes of `stdout`, `stderr` or `output:<name>`."""

    attempt_id: Identity
    generation: Positive
    plan_digest: Digest
    object: ObjectName
    offset: Count
    length: _ReadLength

    @property
    def fence(self) -> Fence:
        """The row's attempt, generation and plan digest."""
        return Fence(self.attempt_id, self.generation, self.plan_digest)


class Resources(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Resource counts: an offer's limits, a ceiling, or what is available now."""

    attempts: Count
    cpu_millis: Count
    memory_bytes: Count
    swap_bytes: Count
    processes: Count
    storage_bytes: Count
    storage_inodes: Count


Control = Literal["active", "paused", "draining", "stopped"]
"""The offer's control: `active` admits, `draining` starts what is admitted, `paused`
only renews, `stopped` renews nothing."""


class OfferLimits(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What an offer allows, within the administrator's ceiling.

    `projects` and `runtimes` (provider IDs) are allow-lists; null means "whatever the
    ceiling allows".
    """

    resources: Resources
    projects: Annotated[list[Identity], msgspec.Meta(max_length=1024)] | None
    runtimes: Annotated[list[Name], msgspec.Meta(max_length=MAX_ROWS)] | None

    def __post_init__(self) -> None:
        for field, values in (("projects", self.projects), ("runtimes", self.runtimes)):
            if values is not None and len(set(values)) != len(values):
                raise ValueError(f"{field} lists a value more than once")


def _canonical_b64decode(data: str | bytes | memoryview) -> bytes:
    """Decode standard padded base64, refusing any other spelling of the same bytes.

    Canonical means `b64encode(b64decode(data)) == data`: the standard alphabet,
    padding, no whitespace, and zero unused bits in the last quantum. `data` is text or
    its ASCII bytes. Raises ValueError.
    """
    if len(data) % 4:
        raise ValueError("base64 length is not a multiple of 4")
    try:
        raw = binascii.a2b_base64(data, strict_mode=True)
    except (binascii.Error, ValueError):
        raise ValueError("not strict standard base64") from None
    tail = len(raw) % 3 or 3
    last = data[-4:]
    spelled = last.encode() if isinstance(last, str) else bytes(last)
    if raw and binascii.b2a_base64(raw[-tail:], newline=False) != spelled:
        raise ValueError("base64 is not canonical (nonzero unused bits)")
    return raw
