"""Version-1 request models: a tagged union on `action`, and the one decoding call.

A request is validated once, here, at the boundary: types, bounds and anchored
patterns by msgspec; distinctness, aggregate sizes, canonical base64 and chunk digests
by each request's `__post_init__`, which raises `ProtocolError` with the exact JSON
path. What the model cannot know (records, leases, declared object sizes) the host
checks and refuses with the codes in `ficc.execution.errors`.

The executor decodes with `receive_request`: the same acceptance and refusals, but an
`input_write` chunk is decoded from the frame without an intermediate base64 `str`
(`ReceivedInputWrite`), which keeps the daemon's memory per chunk near two buffers.

Fence fields (`attempt_id`, `generation`, `plan_digest`) are inline in every
per-attempt row, and the admission bindings (`installation_id`, `ledger_id`,
`admission_version`) are inline in the request, never nested.
"""

from __future__ import annotations

import binascii
import enum
import hashlib
import re
from collections.abc import Sequence
from itertools import repeat
from operator import attrgetter
from typing import Annotated, Any, Literal

import msgspec

from ficc.execution.errors import ErrorCode, ProtocolError
from ficc.execution.plan import (
    DIGEST,
    IDENTITY,
    MAX_ROWS,
    NAME,
    U63_MAX,
    CheckedDigest,
    CheckedIdentity,
    Count,
    Digest,
    Identity,
    Name,
    Plan,
    PlanFault,
    PlanTooLarge,
    Positive,
    check_plans,
    check_rules,
    plan_digests,
)

PROTOCOL_VERSION = 1
MIB = 1024 * 1024
COLLECT_MAX_BYTES = 1 * MIB
"""Most bytes one `collect` request may ask for, summed over its reads."""
INPUT_CHUNK_MAX_BYTES = 8 * MIB
"""Most decoded bytes one `input_write` request may carry (current executors)."""
INPUT_CHUNK_LEGACY_BYTES = 1 * MIB
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


# --- rows ---------------------------------------------------------------------------


class Fence(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What every per-attempt operation binds: attempt, generation and plan digest."""

    attempt_id: Identity
    generation: Positive
    plan_digest: Digest


class Renewal(msgspec.Struct, frozen=True, forbid_unknown_fields=True, gc=False):
    """A lease renewal: the fence, a strictly increasing sequence and a wall-clock expiry.

    Up to 64 per request, in `prepare` and `renew`: their patterns are checked per batch
    (`check_rules`, called by those requests) rather than per value.
    """

    attempt_id: CheckedIdentity
    generation: Positive
    plan_digest: CheckedDigest
    sequence: Positive
    expires_at_ms: Count

    @property
    def fence(self) -> Fence:
        return Fence(self.attempt_id, self.generation, self.plan_digest)


class PrepareAttempt(msgspec.Struct, frozen=True, forbid_unknown_fields=True, gc=False):
    """One attempt to admit: its immutable plan and its first lease (sequence 1)."""

    plan: Plan
    lease: Renewal


class ObjectRef(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """An `input_status` row: the fence and a declared streamed input ID."""

    attempt_id: Identity
    generation: Positive
    plan_digest: Digest
    object: Identity

    @property
    def fence(self) -> Fence:
        return Fence(self.attempt_id, self.generation, self.plan_digest)


class _ChunkRow:
    """What both spellings of an `input_write` row answer: the fence, and the chunk."""

    __slots__ = ()
    attempt_id: str
    generation: int
    plan_digest: str
    __dict__: dict[str, Any]

    def _base64(self) -> str | memoryview:
        raise NotImplementedError

    @property
    def fence(self) -> Fence:
        return Fence(self.attempt_id, self.generation, self.plan_digest)

    @property
    def chunk(self) -> bytes:
        """The decoded chunk (decoded once, when the request was validated)."""
        cached: bytes | None = self.__dict__.get("_chunk")
        if cached is None:
            cached = canonical_b64decode(self._base64())
            self.__dict__["_chunk"] = cached
        return cached


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


class ReceivedInputWrite(
    msgspec.Struct, _ChunkRow, frozen=True, forbid_unknown_fields=True, dict=True
):
    """An `input_write` row as the executor receives it (see `receive_request`).

    The same fields and checks as `InputWrite`, but `data` is left as raw JSON, a view
    of the frame, and decoded from there: `InputWrite` would first build the base64
    `str` (10.7 MiB for an 8 MiB chunk). Once the request has decoded `chunk`, `data`
    is emptied so the frame can be freed while the chunk is written and synced.
    """

    attempt_id: Identity
    generation: Positive
    plan_digest: Digest
    object: Identity
    offset: Count
    data: msgspec.Raw
    digest: Digest

    def _base64(self) -> str | memoryview:
        return _json_string_body(self.data)


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


# --- requests -----------------------------------------------------------------------

_PrepareAttempts = Annotated[list[PrepareAttempt], _BATCH]
_Renewals = Annotated[list[Renewal], _BATCH]
_Fences = Annotated[list[Fence], _BATCH]
_Reads = Annotated[list[Read], _BATCH]
_ObjectRefs = Annotated[list[ObjectRef], _BATCH]
_InputWrites = Annotated[list[InputWrite], _BATCH]
_ReceivedInputWrites = Annotated[list[ReceivedInputWrite], _BATCH]
_Plans = Annotated[list[Plan], _BATCH]


class Request(
    msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag_field="action", kw_only=True
):
    """Every request: `version` 1, a client-chosen `id`, and the `action` tag."""

    version: Literal[1]
    id: Identity

    @property
    def action(self) -> str:
        return str(type(self).__struct_config__.tag)

    @property
    def row_count(self) -> int:
        """How many result rows the reply carries (0 for non-batch requests)."""
        return 0

    def _invalid(self, message: str, path: str) -> ProtocolError:
        return ProtocolError(ErrorCode.INVALID_REQUEST, message, path, self.id)


class _Bound(Request, frozen=True, kw_only=True):
    """A request that admits or records attempts: carries the saved admission binding."""

    installation_id: Identity
    ledger_id: Identity
    admission_version: Literal[1]


class PrepareRequest(_Bound, frozen=True, kw_only=True, tag="prepare", gc=False):
    attempts: _PrepareAttempts

    @property
    def row_count(self) -> int:
        return len(self.attempts)

    def __post_init__(self) -> None:
        plans = list(map(_PLAN, self.attempts))
        leases = list(map(_LEASE, self.attempts))
        digests = _checked_plans(self, plans, "$.attempts[{}].plan")
        _checked_rows(self, leases, Renewal, "$.attempts[{}].lease")
        # The whole batch at once; only a failure walks the rows to name the first one.
        attempt_ids = list(map(_ATTEMPT_ID, plans))
        if (
            len(set(attempt_ids)) == len(plans)
            and list(map(_SEQUENCE, leases)) == list(repeat(1, len(leases)))
            and list(map(_ATTEMPT_ID, leases)) == attempt_ids
            and list(map(_GENERATION, leases)) == list(map(_GENERATION, plans))
            and list(map(_PLAN_DIGEST, leases)) == digests
        ):
            return
        seen: set[str] = set()
        for i, (plan, lease, digest) in enumerate(zip(plans, leases, digests, strict=True)):
            here = f"$.attempts[{i}]"
            if plan.attempt_id in seen:
                raise self._invalid("attempt appears twice", f"{here}.plan.attempt_id")
            seen.add(plan.attempt_id)
            if lease.sequence != 1:
                raise self._invalid("the first lease has sequence 1", f"{here}.lease.sequence")
            if lease.attempt_id != plan.attempt_id:
                raise self._invalid("not the plan's attempt", f"{here}.lease.attempt_id")
            if lease.generation != plan.generation:
                raise self._invalid("not the plan's generation", f"{here}.lease.generation")
            if lease.plan_digest != digest:
                raise self._invalid("not the plan's digest", f"{here}.lease.plan_digest")


class RenewRequest(Request, frozen=True, kw_only=True, tag="renew"):
    leases: _Renewals

    @property
    def row_count(self) -> int:
        return len(self.leases)

    def __post_init__(self) -> None:
        _checked_rows(self, self.leases, Renewal, "$.leases[{}]")
        _distinct_attempts(self, self.leases, "leases")


class _FenceBatch(Request, frozen=True, kw_only=True):
    attempts: _Fences

    @property
    def row_count(self) -> int:
        return len(self.attempts)

    def __post_init__(self) -> None:
        _distinct_attempts(self, self.attempts, "attempts")


class StartRequest(_FenceBatch, frozen=True, kw_only=True, tag="start"):
    pass


class ObserveRequest(_FenceBatch, frozen=True, kw_only=True, tag="observe"):
    pass


class StopRequest(_FenceBatch, frozen=True, kw_only=True, tag="stop"):
    pass


class ReleaseRequest(_FenceBatch, frozen=True, kw_only=True, tag="release"):
    pass


class CollectRequest(Request, frozen=True, kw_only=True, tag="collect"):
    reads: _Reads

    @property
    def row_count(self) -> int:
        return len(self.reads)

    def __post_init__(self) -> None:
        seen: set[tuple[str, str, int]] = set()
        total = 0
        for i, read in enumerate(self.reads):
            key = (read.attempt_id, read.object, read.offset)
            if key in seen:
                raise self._invalid("the same (attempt, object, offset) twice", f"$.reads[{i}]")
            seen.add(key)
            if read.offset + read.length > U63_MAX:
                raise self._invalid("offset + length passes 2^63-1", f"$.reads[{i}].length")
            total += read.length
        if total > COLLECT_MAX_BYTES:
            raise self._invalid(f"reads ask for {total} bytes, more than 1 MiB", "$.reads")


class InputStatusRequest(Request, frozen=True, kw_only=True, tag="input_status"):
    objects: _ObjectRefs

    @property
    def row_count(self) -> int:
        return len(self.objects)

    def __post_init__(self) -> None:
        seen: set[tuple[str, str]] = set()
        for i, ref in enumerate(self.objects):
            if (ref.attempt_id, ref.object) in seen:
                raise self._invalid("the same (attempt, object) twice", f"$.objects[{i}]")
            seen.add((ref.attempt_id, ref.object))


class _Writes:
    """What both spellings of an input_write request answer about their rows."""

    __slots__ = ()
    writes: Sequence[InputWrite | ReceivedInputWrite]

    @property
    def row_count(self) -> int:
        return len(self.writes)

    @property
    def chunk_bytes(self) -> int:
        """Decoded bytes over all writes (compare with the snapshot's input_chunk_bytes)."""
        return sum(len(w.chunk) for w in self.writes)


class InputWriteRequest(Request, _Writes, frozen=True, kw_only=True, tag="input_write"):
    writes: _InputWrites

    def __post_init__(self) -> None:
        _check_writes(self, self.writes)


class ReceivedInputWriteRequest(Request, _Writes, frozen=True, kw_only=True, tag="input_write"):
    """`InputWriteRequest` as the executor receives it: rows are `ReceivedInputWrite`.

    Not for building requests (a controller builds `InputWriteRequest` with base64
    text); `receive_request` returns it for the common, plainly spelled document.
    """

    writes: _ReceivedInputWrites

    def __post_init__(self) -> None:
        _check_writes(self, self.writes)
        for write in self.writes:  # every chunk is decoded: let go of the frame
            msgspec.structs.force_setattr(write, "data", _RELEASED)


_RELEASED = msgspec.Raw()
"""What a received row's `data` holds once its chunk is decoded."""


def _check_writes(request: Request, writes: Sequence[InputWrite | ReceivedInputWrite]) -> None:
    """Distinct rows, canonical base64, at most 8 MiB decoded, chunk digests, offsets.

    Decodes each row's chunk once and keeps it on the row (its `chunk`).
    """
    seen: set[tuple[str, str]] = set()
    total = 0
    for i, write in enumerate(writes):
        here = f"$.writes[{i}]"
        if (write.attempt_id, write.object) in seen:
            raise request._invalid("the same (attempt, object) twice", here)
        seen.add((write.attempt_id, write.object))
        try:
            chunk = write.chunk
        except ValueError as exc:
            raise request._invalid(str(exc), f"{here}.data") from None
        total += len(chunk)
        if total > INPUT_CHUNK_MAX_BYTES:
            raise request._invalid("writes carry more than 8 MiB of data", "$.writes")
        if "sha256:" + hashlib.sha256(chunk).hexdigest() != write.digest:
            raise request._invalid("digest is not SHA-256 of the decoded data", f"{here}.digest")
        if write.offset + len(chunk) > U63_MAX:
            raise request._invalid("offset + length passes 2^63-1", f"{here}.offset")


class _PlanBatch(_Bound, frozen=True, kw_only=True):
    plans: _Plans

    @property
    def row_count(self) -> int:
        return len(self.plans)

    def __post_init__(self) -> None:
        _checked_plans(self, self.plans, "$.plans[{}]")
        seen: set[str] = set()
        for i, plan in enumerate(self.plans):
            if plan.attempt_id in seen:
                raise self._invalid("attempt appears twice", f"$.plans[{i}].attempt_id")
            seen.add(plan.attempt_id)


class RejectAbsentRequest(_PlanBatch, frozen=True, kw_only=True, tag="reject_absent"):
    pass


class ReconcileAbsentRequest(_PlanBatch, frozen=True, kw_only=True, tag="reconcile_absent"):
    acknowledge_unknown: Literal[True]


class SnapshotRequest(Request, frozen=True, kw_only=True, tag="snapshot"):
    after: Identity | None = None


class SetOfferRequest(Request, frozen=True, kw_only=True, tag="set_offer"):
    expected_revision: Count
    control: Literal["active", "paused", "draining", "stopped"]
    limits: OfferLimits | None = None


class MetricsRequest(Request, frozen=True, kw_only=True, tag="metrics"):
    """The daemon's metrics in the Prometheus text format (administrator only)."""


_SentRequest = (
    PrepareRequest
    | RenewRequest
    | StartRequest
    | ObserveRequest
    | StopRequest
    | ReleaseRequest
    | CollectRequest
    | InputStatusRequest
    | InputWriteRequest
    | RejectAbsentRequest
    | ReconcileAbsentRequest
    | SnapshotRequest
    | SetOfferRequest
    | MetricsRequest
)
"""The request models as a controller builds them, and as `decode_request` decodes."""

_ReceivedRequest = (
    PrepareRequest
    | RenewRequest
    | StartRequest
    | ObserveRequest
    | StopRequest
    | ReleaseRequest
    | CollectRequest
    | InputStatusRequest
    | ReceivedInputWriteRequest
    | RejectAbsentRequest
    | ReconcileAbsentRequest
    | SnapshotRequest
    | SetOfferRequest
    | MetricsRequest
)
"""The same union with the executor's twin of `InputWriteRequest` (`receive_request`)."""

AnyRequest = _SentRequest | ReceivedInputWriteRequest
"""Every request model a decoding call returns."""

_T, _O, _A = Sender.TRANSPORT, Sender.OWNER, Sender.ADMINISTRATOR
SENDERS: dict[str, frozenset[Sender]] = {
    "prepare": frozenset({_T, _A}),
    "renew": frozenset({_T, _A}),
    "start": frozenset({_T, _A}),
    "observe": frozenset({_T, _A}),
    "stop": frozenset({_T, _A}),
    "release": frozenset({_T, _A}),
    "collect": frozenset({_T, _A}),
    "input_status": frozenset({_T, _A}),
    "input_write": frozenset({_T, _A}),
    "reject_absent": frozenset({_T, _A}),
    "reconcile_absent": frozenset({_A}),
    "snapshot": frozenset({_T, _O, _A}),
    "set_offer": frozenset({_O, _A}),
    "metrics": frozenset({_A}),
}
"""Who may send each action (docs/protocol.md). The host decides the sender from the socket."""

ACTIONS = frozenset(SENDERS)


def may_send(sender: Sender, action: str) -> bool:
    """Whether `sender` may send `action`; unknown actions are never allowed."""
    return sender in SENDERS.get(action, frozenset())


# --- checks shared by several requests ----------------------------------------------


_PLAN, _LEASE = attrgetter("plan"), attrgetter("lease")
_ATTEMPT_ID, _GENERATION = attrgetter("attempt_id"), attrgetter("generation")
_SEQUENCE, _PLAN_DIGEST = attrgetter("sequence"), attrgetter("plan_digest")


def _checked_plans(request: Request, plans: list[Plan], path: str) -> list[str]:
    """Check a batch of plans (rules, 128 KiB bound) and return their digests.

    `path` is the JSON path of a plan with `{}` for its position in the batch.
    """
    try:
        check_plans(plans)
        return plan_digests(plans)
    except PlanFault as fault:
        message, where = explain(msgspec.ValidationError(fault.error))
        raise request._invalid(message, path.format(fault.index) + where[1:]) from None
    except PlanTooLarge as exc:
        raise request._invalid(str(exc), path.format(exc.index)) from None


def _checked_rows(request: Request, rows: list[Any], cls: type, path: str) -> None:
    """Check the batch-checked patterns of `rows` (see `check_rules`)."""
    try:
        check_rules(rows, cls)
    except PlanFault as fault:
        message, where = explain(msgspec.ValidationError(fault.error))
        raise request._invalid(message, path.format(fault.index) + where[1:]) from None


def _distinct_attempts(request: Request, rows: list[Any], field: str) -> None:
    seen: set[str] = set()
    for i, row in enumerate(rows):
        if row.attempt_id in seen:
            raise request._invalid("attempt appears twice", f"$.{field}[{i}].attempt_id")
        seen.add(row.attempt_id)


def canonical_b64decode(data: str | bytes | memoryview) -> bytes:
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


def _json_string_body(raw: msgspec.Raw) -> memoryview:
    """The bytes between the quotes of a raw JSON string, without copying them.

    They are the string's value only if it has no escapes; `\\` is not in the base64
    alphabet, so an escaped spelling is refused as base64, and `receive_request` leaves
    it (like every refusal) to `decode_request`. Anything but a string raises ValueError.
    """
    view = memoryview(raw)
    if len(view) < 2 or view[0] != ord('"') or view[-1] != ord('"'):
        raise ValueError("not a JSON string")
    return view[1:-1]


# --- decoding and encoding ----------------------------------------------------------

_decoder = msgspec.json.Decoder(_SentRequest)
_receiver = msgspec.json.Decoder(_ReceivedRequest)
_encoder = msgspec.json.Encoder(order="sorted")


class _Head(msgspec.Struct):
    """The envelope fields, read leniently only to explain a refusal."""

    version: Any = None
    id: Any = None
    action: Any = None


_LOCATED = re.compile(
    r"\A(?P<message>.*?)(?: - at (?P<key>`key` in )?`(?P<path>\$[^`]*)`)?\Z", re.DOTALL
)
_ID = re.compile(r"\A[0-9a-f]{32}\Z")
_PATTERN_NAMES = {
    IDENTITY.pattern: "an Identity (32 lowercase hex characters)",
    DIGEST.pattern: "a Digest (sha256: and 64 lowercase hex characters)",
    NAME.pattern: "a Name ([a-z][a-z0-9_.-]{0,79})",
}


def explain(exc: msgspec.ValidationError) -> tuple[str, str]:
    """(message, JSON path) of a msgspec validation error, patterns given names."""
    match = _LOCATED.match(str(exc))
    assert match is not None  # the pattern matches every string
    message, path = match["message"], match["path"] or "$"
    if match["key"]:
        message += " (in an object key)"
    for pattern, name in _PATTERN_NAMES.items():
        message = message.replace(f"matching regex {pattern!r}", name)
    return message, path


def refusal(frame: bytes, exc: msgspec.ValidationError) -> ProtocolError:
    """Turn a validation failure into the most precise ProtocolError we can name."""
    message, path = explain(exc)
    try:
        document = msgspec.json.decode(frame)  # not JSON at all is a bad frame
    except (msgspec.DecodeError, RecursionError) as not_json:
        return ProtocolError(ErrorCode.BAD_FRAME, f"not UTF-8 JSON: {not_json}")
    head = msgspec.convert(document, _Head) if isinstance(document, dict) else _Head()
    request_id = head.id if isinstance(head.id, str) and _ID.match(head.id) else None
    wrong_version = head.version != PROTOCOL_VERSION or isinstance(head.version, bool)
    if head.version is not None and wrong_version:
        return ProtocolError(
            ErrorCode.UNSUPPORTED_VERSION,
            f"this executor speaks protocol version 1, not {head.version!r}",
            "$.version",
            request_id,
        )
    if isinstance(head.action, str) and head.action not in ACTIONS:
        return ProtocolError(
            ErrorCode.UNSUPPORTED_ACTION,
            f"unknown action {head.action[:64]!r}",
            "$.action",
            request_id,
        )
    return ProtocolError(ErrorCode.INVALID_REQUEST, message, path, request_id)


def decode_request(frame: bytes, *, input_chunk_bytes: int = INPUT_CHUNK_MAX_BYTES) -> AnyRequest:
    """Decode and fully validate one request frame payload (the JSON, not the length).

    `input_chunk_bytes` is the receiver's bound on decoded `input_write` data. Raises
    ProtocolError: `bad_frame` for bytes that are not UTF-8 JSON, `unsupported_version`,
    `unsupported_action`, or `invalid_request` with the JSON path of the first problem.
    """
    try:
        request: AnyRequest = _decoder.decode(frame)
    except msgspec.ValidationError as exc:
        raise refusal(frame, exc) from None
    except (msgspec.DecodeError, RecursionError) as exc:
        raise ProtocolError(ErrorCode.BAD_FRAME, f"not UTF-8 JSON: {exc}") from None
    if isinstance(request, InputWriteRequest) and request.chunk_bytes > input_chunk_bytes:
        raise request._invalid(
            f"writes carry {request.chunk_bytes} bytes, more than {input_chunk_bytes}", "$.writes"
        )
    return request


def receive_request(frame: bytes, *, input_chunk_bytes: int = INPUT_CHUNK_MAX_BYTES) -> AnyRequest:
    """`decode_request` for the executor: the same answer, less memory for chunks.

    An `input_write` comes back as a `ReceivedInputWriteRequest`, its chunks decoded
    straight from `frame` (the frame and the chunk are the only full-size buffers).
    Every document this fast path refuses, including one whose base64 is spelled with
    JSON escapes, is decided by `decode_request`, so both accept the same documents
    and every refusal has the same code, message and path.
    """
    try:
        request: AnyRequest = _receiver.decode(frame)
    except (msgspec.MsgspecError, RecursionError, ProtocolError):
        return decode_request(frame, input_chunk_bytes=input_chunk_bytes)
    if isinstance(request, ReceivedInputWriteRequest) and request.chunk_bytes > input_chunk_bytes:
        return decode_request(frame, input_chunk_bytes=input_chunk_bytes)
    return request


def encode_request(request: Request) -> bytes:
    """Canonical JSON (sorted keys, compact). Does not validate: see `validate_request`."""
    return _encoder.encode(request)


def validate_request(
    request: Request, *, input_chunk_bytes: int = INPUT_CHUNK_MAX_BYTES
) -> tuple[AnyRequest, bytes]:
    """Encode a request built in Python and check it exactly as a receiver would.

    msgspec checks types and bounds only when decoding, so a model built in code is
    trusted only after this round trip. Returns the validated model and its bytes.
    """
    try:
        data = encode_request(request)
    except (TypeError, ValueError) as exc:  # e.g. a lone surrogate, a non-JSON value
        raise ProtocolError(ErrorCode.INVALID_REQUEST, f"cannot encode: {exc}") from None
    return decode_request(data, input_chunk_bytes=input_chunk_bytes), data


__all__ = [
    "ACTIONS",
    "COLLECT_MAX_BYTES",
    "INPUT_CHUNK_LEGACY_BYTES",
    "INPUT_CHUNK_MAX_BYTES",
    "PROTOCOL_VERSION",
    "SENDERS",
    "ZERO_ID",
    "AnyRequest",
    "CollectRequest",
    "ErrorCode",
    "Fence",
    "InputStatusRequest",
    "InputWrite",
    "InputWriteRequest",
    "MetricsRequest",
    "ObjectName",
    "ObjectRef",
    "ObserveRequest",
    "OfferLimits",
    "PrepareAttempt",
    "PrepareRequest",
    "ProtocolError",
    "Read",
    "ReceivedInputWrite",
    "ReceivedInputWriteRequest",
    "ReconcileAbsentRequest",
    "RejectAbsentRequest",
    "ReleaseRequest",
    "RenewRequest",
    "Renewal",
    "Request",
    "Resources",
    "Sender",
    "SetOfferRequest",
    "SnapshotRequest",
    "StartRequest",
    "StopRequest",
    "canonical_b64decode",
    "decode_request",
    "encode_request",
    "may_send",
    "receive_request",
    "validate_request",
]
