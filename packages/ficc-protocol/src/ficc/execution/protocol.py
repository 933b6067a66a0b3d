"""Version-1 request models: a tagged union on `action`, and the one decoding call.

A request is validated once, here, at the boundary: types, bounds and anchored
patterns by msgspec; distinctness, aggregate sizes, canonical base64 and chunk digests
by each request's `__post_init__`, which raises `ProtocolError` with the exact JSON
path. What the model cannot know (records, leases, declared object sizes) the host
checks and refuses with the codes in `ficc.execution.errors`.

The rows and the bounds they share are defined in `_rows` and are public here.

The executor decodes with its own twin of `decode_request` (same acceptance, same
refusals, less memory for `input_write` chunks); it is not part of this module.

Fence fields (`attempt_id`, `generation`, `plan_digest`) are inline in every
per-attempt row, and the admission bindings (`installation_id`, `ledger_id`,
`admission_version`) are inline in the request, never nested.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from itertools import repeat
from operator import attrgetter
from typing import Annotated, Any, Literal

import msgspec

from ficc.execution import _rules
from ficc.execution._rows import (
    _BATCH,
    ACKNOWLEDGED_MAX,
    COLLECT_MAX_BYTES,
    INPUT_CHUNK_LEGACY_BYTES,
    INPUT_CHUNK_MAX_BYTES,
    PROTOCOL_VERSION,
    ZERO_ID,
    Control,
    Fence,
    InputWrite,
    ObjectName,
    ObjectRef,
    OfferLimits,
    PrepareAttempt,
    Read,
    Renewal,
    Resources,
    Sender,
    _ChunkRow,
)
from ficc.execution.errors import ErrorCode, ProtocolError
from ficc.execution.plan import (
    U63_MAX,
    Count,
    Identity,
    Plan,
    PlanTooLarge,
    _digests,
)

# --- requests -----------------------------------------------------------------------

_PrepareAttempts = Annotated[list[PrepareAttempt], _BATCH]
_Renewals = Annotated[list[Renewal], _BATCH]
_Fences = Annotated[list[Fence], _BATCH]
_Reads = Annotated[list[Read], _BATCH]
_ObjectRefs = Annotated[list[ObjectRef], _BATCH]
_InputWrites = Annotated[list[InputWrite], _BATCH]
_Plans = Annotated[list[Plan], _BATCH]


class Request(
    msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag_field="action", kw_only=True
):
    """Every request: `version` 1, a client-chosen `id`, and the `action` tag."""

    version: Literal[1]
    id: Identity

    @property
    def action(self) -> str:
        """The `action` tag of this request's class."""
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
    """Admit 1..64 attempts: each row is a plan and its first lease (sequence 1).

    Carries the saved admission binding. Plans are distinct by attempt, and each
    lease names its plan's attempt, generation and digest. The reply has one attempt
    row per plan.
    """

    attempts: _PrepareAttempts

    @property
    def row_count(self) -> int:
        """How many result rows the reply carries: one per request row."""
        return len(self.attempts)

    def __post_init__(self) -> None:
        plans = list(map(_PLAN, self.attempts))
        leases = list(map(_LEASE, self.attempts))
        digests = _checked_plans(self, plans, "$.attempts[{}].plan")
        _checked_rows(self, leases, Renewal, "$.attempts[{}].lease")
        self._check_acknowledged()
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

    def _check_acknowledged(self) -> None:
        """Acknowledged attempt IDs are distinct and never the row's own attempt."""
        for i, row in enumerate(self.attempts):
            acknowledged = row.acknowledged_unknown
            if not acknowledged:
                continue
            here = f"$.attempts[{i}].acknowledged_unknown"
            if len(set(acknowledged)) != len(acknowledged):
                raise self._invalid("an attempt ID appears twice", here)
            if row.plan.attempt_id in acknowledged:
                raise self._invalid("an attempt cannot acknowledge itself", here)


class RenewRequest(Request, frozen=True, kw_only=True, tag="renew"):
    """Extend the leases of 1..64 distinct attempts (sequences strictly increase)."""

    leases: _Renewals

    @property
    def row_count(self) -> int:
        """How many result rows the reply carries: one per request row."""
        return len(self.leases)

    def __post_init__(self) -> None:
        _checked_rows(self, self.leases, Renewal, "$.leases[{}]")
        _distinct_attempts(self, self.leases, "leases")


class _FenceBatch(Request, frozen=True, kw_only=True):
    attempts: _Fences

    @property
    def row_count(self) -> int:
        """How many result rows the reply carries: one per request row."""
        return len(self.attempts)

    def __post_init__(self) -> None:
        _distinct_attempts(self, self.attempts, "attempts")


class StartRequest(_FenceBatch, frozen=True, kw_only=True, tag="start"):
    """Start 1..64 prepared, ready attempts; a second start never starts twice."""

    pass


class ObserveRequest(_FenceBatch, frozen=True, kw_only=True, tag="observe"):
    """Read the host's record of 1..64 attempts; changes nothing.

    `usage: true` asks for each row's `usage` (what the attempt used); without it (or
    with `false`) the rows are exactly what they always were. The field is omitted
    unless set, so a request made without it keeps its bytes. `payload_usage: true`
    asks for `usage` with its `payload` part (the payload's own share, apart from its
    runtime), which a client that asked only for `usage` never receives.
    """

    usage: bool | msgspec.UnsetType = msgspec.UNSET
    detail: bool | msgspec.UnsetType = msgspec.UNSET
    """`detail: true` asks for each row's `detail`: what went wrong, in the runtime's
    own words, when a start failed before the payload ran, or the barrier's report when
    the payload's program could not be executed. Omitted unless set."""
    payload_usage: bool | msgspec.UnsetType = msgspec.UNSET
    """`payload_usage: true` asks for each row's `usage` with its `payload` part: what
    the payload used on its own, apart from its runtime. Omitted unless set."""

    @property
    def wants_usage(self) -> bool:
        """Whether the reply's rows carry `usage` (`payload_usage: true` asks for it too)."""
        return self.usage is True or self.payload_usage is True

    @property
    def wants_payload_usage(self) -> bool:
        """Whether each row's `usage` carries its `payload` part."""
        return self.payload_usage is True

    @property
    def wants_detail(self) -> bool:
        """Whether the reply's rows carry `detail` (where the host has one)."""
        return self.detail is True


class StopRequest(_FenceBatch, frozen=True, kw_only=True, tag="stop"):
    """Stop 1..64 attempts; a stopped attempt ends `cancelled`."""

    pass


class ReleaseRequest(_FenceBatch, frozen=True, kw_only=True, tag="release"):
    """Free the slots of 1..64 finished attempts whose cleanup is confirmed."""

    pass


class CollectRequest(Request, frozen=True, kw_only=True, tag="collect"):
    """Read 1..64 byte ranges of logs and declared outputs, at most 1 MiB in total."""

    reads: _Reads

    @property
    def row_count(self) -> int:
        """How many result rows the reply carries: one per request row."""
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
    """Ask for the durable next offset of 1..64 streamed inputs (where to resume)."""

    objects: _ObjectRefs

    @property
    def row_count(self) -> int:
        """How many result rows the reply carries: one per request row."""
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
    writes: Sequence[_ChunkRow]

    @property
    def row_count(self) -> int:
        """How many result rows the reply carries: one per request row."""
        return len(self.writes)

    @property
    def chunk_bytes(self) -> int:
        """Decoded bytes over all writes (compare with the snapshot's input_chunk_bytes)."""
        return sum(w.chunk_size for w in self.writes)


class InputWriteRequest(Request, _Writes, frozen=True, kw_only=True, tag="input_write"):
    """Write one chunk to each of 1..64 streamed inputs, each at its durable offset.

    The decoded data of all rows is at most the snapshot's `input_chunk_bytes`.
    """

    writes: _InputWrites

    def __post_init__(self) -> None:
        _check_writes(self, self.writes)


def _check_writes(request: Request, writes: Sequence[_ChunkRow]) -> None:
    """Distinct rows, canonical base64, at most 8 MiB decoded, chunk digests, offsets.

    Each row measures its own chunk (`InputWrite` decodes it once and keeps it).
    """
    seen: set[tuple[str, str]] = set()
    total = 0
    for i, write in enumerate(writes):
        here = f"$.writes[{i}]"
        if (write.attempt_id, write.object) in seen:
            raise request._invalid("the same (attempt, object) twice", here)
        seen.add((write.attempt_id, write.object))
        try:
            size, digest = write._measure()
        except ValueError as exc:
            raise request._invalid(str(exc), f"{here}.data") from None
        total += size
        if total > INPUT_CHUNK_MAX_BYTES:
            raise request._invalid("writes carry more than 8 MiB of data", "$.writes")
        if digest != write.digest:
            raise request._invalid("digest is not SHA-256 of the decoded data", f"{here}.digest")
        if write.offset + size > U63_MAX:
            raise request._invalid("offset + length passes 2^63-1", f"{here}.offset")


class _PlanBatch(_Bound, frozen=True, kw_only=True):
    plans: _Plans

    @property
    def row_count(self) -> int:
        """How many result rows the reply carries: one per request row."""
        return len(self.plans)

    def __post_init__(self) -> None:
        _checked_plans(self, self.plans, "$.plans[{}]")
        seen: set[str] = set()
        for i, plan in enumerate(self.plans):
            if plan.attempt_id in seen:
                raise self._invalid("attempt appears twice", f"$.plans[{i}].attempt_id")
            seen.add(plan.attempt_id)


class RejectAbsentRequest(_PlanBatch, frozen=True, kw_only=True, tag="reject_absent"):
    """Refuse for good 1..64 queued plans the host never received, so they never run.

    A matching attempt the host already has returns its actual state instead.
    """

    pass


class ReconcileAbsentRequest(_PlanBatch, frozen=True, kw_only=True, tag="reconcile_absent"):
    """Administrator only: record absent plans as `unknown` after checking the host is idle.

    `acknowledge_unknown` must be literally `true`; matching records come back unchanged.
    """

    acknowledge_unknown: Literal[True]


class SnapshotRequest(Request, frozen=True, kw_only=True, tag="snapshot"):
    """Bindings, bounds, offer, capacity and one page of attempts after `after`.

    `usage: true` asks for each listed attempt's `usage`, as in `observe` (and
    `payload_usage: true` for it with its `payload` part). `slots: true`
    asks for the health of every slot (`slots`) and, per slot class, how many slots are
    usable now (`usable`); `daemon: true` asks for what the running daemon is (`daemon`:
    its versions and start time). Each is omitted unless set, and without it the reply
    has exactly the fields it always had, so a client built before it keeps its bytes.
    """

    after: Identity | None = None
    usage: bool | msgspec.UnsetType = msgspec.UNSET
    slots: bool | msgspec.UnsetType = msgspec.UNSET
    daemon: bool | msgspec.UnsetType = msgspec.UNSET
    changed: bool | msgspec.UnsetType = msgspec.UNSET
    """`changed: true` asks for each listed attempt's `changed_at_ms` (when its status
    last changed), so an operator's view can order and filter the history by time."""
    payload_usage: bool | msgspec.UnsetType = msgspec.UNSET
    """`payload_usage: true` asks for each listed attempt's `usage` with its `payload`
    part, as in `observe`."""

    @property
    def wants_usage(self) -> bool:
        """Whether the listed attempts carry `usage` (`payload_usage: true` asks for it
        too)."""
        return self.usage is True or self.payload_usage is True

    @property
    def wants_payload_usage(self) -> bool:
        """Whether each listed attempt's `usage` carries its `payload` part."""
        return self.payload_usage is True

    @property
    def wants_changed(self) -> bool:
        """Whether the listed attempts carry `changed_at_ms` (where the host knows it)."""
        return self.changed is True

    @property
    def wants_slots(self) -> bool:
        """Whether the reply carries each slot's health and each class's `usable`."""
        return self.slots is True

    @property
    def wants_daemon(self) -> bool:
        """Whether the reply carries the running daemon's versions and start time."""
        return self.daemon is True


class SetOfferRequest(Request, frozen=True, kw_only=True, tag="set_offer"):
    """Change the offer, if its revision is still `expected_revision`."""

    expected_revision: Count
    control: Control
    limits: OfferLimits | None = None


class MetricsRequest(Request, frozen=True, kw_only=True, tag="metrics"):
    """The daemon's metrics in the Prometheus text format (administrator only)."""


class CheckSlotsRequest(Request, frozen=True, kw_only=True, tag="check_slots"):
    """Check every slot now, and answer each one's health (administrator only).

    Why: a slot taken out of the offer because a check failed comes back on the host's
    own schedule; an administrator who has just repaired it need not wait for that.
    """


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
    | CheckSlotsRequest
)
"""The request models as a controller builds them, and as `decode_request` decodes."""

AnyRequest = _SentRequest
"""Every request model: what a controller builds and what `decode_request` returns."""

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
    "check_slots": frozenset({_A}),
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
        _rules.check_plans(plans)
        return _digests(plans)
    except _rules.PlanFault as fault:
        message, where = explain(msgspec.ValidationError(fault.error))
        raise request._invalid(message, path.format(fault.index) + where[1:]) from None
    except PlanTooLarge as exc:
        raise request._invalid(str(exc), path.format(exc.index)) from None


def _checked_rows(request: Request, rows: list[Any], cls: type, path: str) -> None:
    """Check the batch-checked patterns of `rows` (see `check_rules`)."""
    try:
        _rules.check_rules(rows, cls)
    except _rules.PlanFault as fault:
        message, where = explain(msgspec.ValidationError(fault.error))
        raise request._invalid(message, path.format(fault.index) + where[1:]) from None


def _distinct_attempts(request: Request, rows: list[Any], field: str) -> None:
    seen: set[str] = set()
    for i, row in enumerate(rows):
        if row.attempt_id in seen:
            raise request._invalid("attempt appears twice", f"$.{field}[{i}].attempt_id")
        seen.add(row.attempt_id)


# --- decoding and encoding ----------------------------------------------------------

_decoder = msgspec.json.Decoder(_SentRequest)
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
    _rules.IDENTITY.pattern: "an Identity (32 lowercase hex characters)",
    _rules.DIGEST.pattern: "a Digest (sha256: and 64 lowercase hex characters)",
    _rules.NAME.pattern: "a Name ([a-z][a-z0-9_.-]{0,79})",
    _rules.EXEC_STRING.pattern: "a string without NUL characters",
    _rules.ENV_NAME.pattern: "an environment name ([A-Za-z_][A-Za-z0-9_]{0,127})",
    _rules.INPUT_NAME.pattern: "an input name ([A-Za-z0-9][A-Za-z0-9_.-]{0,127})",
    _rules.OUTPUT_PATH.pattern: (
        "a relative output path (normalized, no `..`, no control characters)"
    ),
}


def explain(exc: msgspec.ValidationError) -> tuple[str, str]:
    """(message, JSON path) of a msgspec validation error, patterns given names."""
    match = _LOCATED.match(str(exc))
    assert match is not None  # the pattern matches every string
    message, path = match["message"], match["path"] or "$"
    if match["key"]:
        message += " (in an object key)"
    for pattern, name in _PATTERN_NAMES.items():
        message = message.replace(f"`str` matching regex {pattern!r}", name)
    return message, path


def _refusal(frame: bytes, exc: msgspec.ValidationError) -> ProtocolError:
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
        with _rules.deferred_checks():  # each request checks its plans and leases as a batch
            request: AnyRequest = _decoder.decode(frame)
    except msgspec.ValidationError as exc:
        raise _refusal(frame, exc) from None
    except (msgspec.DecodeError, RecursionError) as exc:
        raise ProtocolError(ErrorCode.BAD_FRAME, f"not UTF-8 JSON: {exc}") from None
    if isinstance(request, InputWriteRequest) and request.chunk_bytes > input_chunk_bytes:
        raise request._invalid(
            f"writes carry {request.chunk_bytes} bytes, more than {input_chunk_bytes}", "$.writes"
        )
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
    "ACKNOWLEDGED_MAX",
    "ACTIONS",
    "COLLECT_MAX_BYTES",
    "INPUT_CHUNK_LEGACY_BYTES",
    "INPUT_CHUNK_MAX_BYTES",
    "PROTOCOL_VERSION",
    "SENDERS",
    "ZERO_ID",
    "AnyRequest",
    "CheckSlotsRequest",
    "CollectRequest",
    "Control",
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
    "Read",
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
    "decode_request",
    "encode_request",
    "explain",
    "may_send",
    "validate_request",
]
