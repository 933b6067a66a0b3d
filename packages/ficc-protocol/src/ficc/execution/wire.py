"""Version-1 reply models, and the call that decodes a reply for a given request.

Replies are not tagged by action: the client knows which request it sent, so
`decode_reply` takes the action and picks the shape. Every reply has `version`, `id`
(the request's) and `ok`. A refused request is `ErrorReply`; a batch request gets one
result row per request row, in order, each `{ok: true, ...}` or `{ok: false, error}`.
"""

from __future__ import annotations

import binascii
import itertools
from typing import Annotated, Any, Literal, TypeAlias

import msgspec

from ficc.execution.errors import ErrorCode, ProtocolError
from ficc.execution.plan import MAX_ROWS, Count, Digest, Identity, Name, Positive
from ficc.execution.protocol import (
    COLLECT_MAX_BYTES,
    INPUT_CHUNK_LEGACY_BYTES,
    INPUT_CHUNK_MAX_BYTES,
    ZERO_ID,
    Control,
    ObjectName,
    OfferLimits,
    Resources,
    explain,
)

State = Literal[
    "prepared",
    "starting",
    "running",
    "succeeded",
    "failed",
    "cancelled",
    "expired",
    "unknown",
    "released",
]
"""Host states of an attempt. `released` keeps the prior one as `outcome`."""

Outcome = Literal["succeeded", "failed", "cancelled", "expired", "unknown"]
"""Terminal states. Once reached it is the outcome, kept through release."""

TERMINAL: frozenset[str] = frozenset(Outcome.__args__)  # type: ignore[attr-defined]

REASONS: dict[str, str] = {
    "admission_rejected": "refused before any provider call; no slot, nothing ran",
    "legacy_absence_acknowledged": "an operator acknowledged an absent legacy attempt",
    "lease_expired": "the lease ran out; the host stopped the work",
    "stopped": "a stop request ended the work",
    "offer_closed": "cancelled before release: the offer was paused, stopped or drained",
    "offer_changed": "cancelled before release: the offer no longer covers the attempt",
    "exited": "the payload exited; see exit_code",
    "provider_failed": "the provider failed or gave a malformed reply",
    "gate_refused": "the payload gate found the live process out of policy",
    "input_digest_mismatch": "a streamed input did not match its declared digest",
    "storage_failed": "staging or storage failed",
    "storage_exhausted": "the payload ran its slot's filesystem out of bytes or inodes",
    "slot_filesystem": "the slot's filesystem was not mounted as required when used",
    "slot_identity": "another filesystem than the slot's was mounted on its path",
    "memory_exhausted": "the kernel's out-of-memory killer killed a process of the payload"
    " (or, before the release, of its runtime)",
    "executor_restarted": "the executor restarted while the outcome was uncertain",
    "cleanup_failed": "cleanup could not be confirmed",
}
"""Reasons a version-1 executor records. `reason` is any `Name`; these are documented."""

_ExitCode = Annotated[int, msgspec.Meta(ge=0, le=255)]
_MESSAGE_MAX = 4096
_Message = Annotated[str, msgspec.Meta(max_length=_MESSAGE_MAX)]


class Error(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A stable code (see ErrorCode and docs/protocol.md) and an operator-facing message."""

    code: Name
    message: _Message


# --- rows ---------------------------------------------------------------------------


class ErrorRow(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A refused row; the other rows of the batch are unaffected."""

    error: Error
    ok: Literal[False] = False


class PayloadUsage(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """What the payload used on its own, apart from the provider's runtime that shares
    its service (Podman, conmon, runc): read from the payload's own cgroup below the
    service, where the host moved the payload before its release. Each figure is
    omitted when the host could not read it (no payload cgroup, nothing ran).

    - `cpu_user_us`, `cpu_system_us`: the payload's CPU time, microseconds;
    - `memory_peak_bytes`: the most memory the payload held at once.
    """

    cpu_user_us: Count | msgspec.UnsetType = msgspec.UNSET
    cpu_system_us: Count | msgspec.UnsetType = msgspec.UNSET
    memory_peak_bytes: Count | msgspec.UnsetType = msgspec.UNSET


class Usage(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """What an attempt used, read from the kernel's counters of the service the host
    made for it (never from the provider or the payload).

    `final` is true once the figures are the ones recorded durably when the attempt
    ended (they never change after that, through release and restarts), false for a
    live reading while the payload runs (or before anything ran). Every figure is
    omitted when the host could not read it (no such counter on this kernel, the
    service already gone, nothing ran): an absent figure is unknown, never zero.

    - `cpu_user_us`, `cpu_system_us`: CPU time in user and kernel mode, microseconds;
    - `memory_peak_bytes`: the most memory the service held at once;
    - `oom_kills`: processes the kernel's out-of-memory killer killed in the service;
    - `processes_peak`: the most processes (tasks) at once;
    - `storage_bytes`, `storage_inodes`: the slot filesystem's bytes and inodes in use
      when the payload finished (logs and the attempt's own files included);
    - `wall_ms`: from the release of the payload to its observed exit (or to its stop),
      milliseconds; absent when this host's daemon did not see the release (a restart);
    - `payload`: only when asked, the payload's own figures (`PayloadUsage`).

    The figures above are the whole service's: the provider's runtime included.
    """

    final: bool
    cpu_user_us: Count | msgspec.UnsetType = msgspec.UNSET
    cpu_system_us: Count | msgspec.UnsetType = msgspec.UNSET
    memory_peak_bytes: Count | msgspec.UnsetType = msgspec.UNSET
    oom_kills: Count | msgspec.UnsetType = msgspec.UNSET
    processes_peak: Count | msgspec.UnsetType = msgspec.UNSET
    storage_bytes: Count | msgspec.UnsetType = msgspec.UNSET
    storage_inodes: Count | msgspec.UnsetType = msgspec.UNSET
    wall_ms: Count | msgspec.UnsetType = msgspec.UNSET
    payload: PayloadUsage | msgspec.UnsetType = msgspec.UNSET
    """Present only when the request asked for it (`payload_usage: true`): the payload's
    own share of the figures above (`PayloadUsage`). A client that asked only for
    `usage` never sees it, so one built before it still decodes every `usage`."""


DETAIL_MAX = 2048
"""The longest `detail` of an attempt row, in characters."""


class AttemptStatus(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """What the host's record says about one attempt.

    `outcome` is null until the attempt reaches a terminal state, then equals it and
    is kept when `state` becomes `released`. `ready` is meaningful only while
    `prepared` (false while inputs stage and the provider prepares). `lease_sequence`
    is 0 and `lease_expires_at_ms` null for records that were never sent a lease
    (`reject_absent` rejections); a prepare row refused before any provider call
    reports the first lease it was sent (sequence 1, its effective expiry). `slot` is
    null when no slot is reserved. A payload that fills its slot fails with reason
    `storage_exhausted` and the two storage flags.
    """

    attempt_id: Identity
    generation: Positive
    plan_digest: Digest
    state: State
    ready: bool
    outcome: Outcome | None
    reason: Name | None
    exit_code: _ExitCode | None
    lease_sequence: Count
    lease_expires_at_ms: Count | None
    slot: Name | None
    staged_bytes: Count
    stdout_bytes: Count
    stderr_bytes: Count
    cleanup_confirmed: bool
    storage_exhausted: bool | msgspec.UnsetType = msgspec.UNSET
    """Present (true) only when the payload ran its slot's filesystem out of bytes or
    inodes; absent otherwise, so replies stay readable by earlier clients."""
    log_cut_short: bool | msgspec.UnsetType = msgspec.UNSET
    """Present (true) only when the slot ran out of bytes while the logs were open:
    stdout or stderr may end before the payload stopped writing."""
    usage: Usage | msgspec.UnsetType = msgspec.UNSET
    """Present only when the request asked for it (`usage: true` in observe or
    snapshot): what the attempt used, see `Usage`."""
    detail: Annotated[str, msgspec.Meta(max_length=DETAIL_MAX)] | msgspec.UnsetType = msgspec.UNSET
    """Present only when an observe asked for it (`detail: true`) and the host has one:
    for a start that failed before the payload ran, the end of what the provider's
    runtime printed (bounded, control characters shown as `?`), after the host's own
    explanation when the runtime was killed for memory; for a payload that ended 126 or
    127 because its program could not be executed, the barrier's report in the host's
    words (the program and the reason). For a controller to show. Kept by the daemon
    until the attempt's release or a restart; never the payload's output."""
    changed_at_ms: Count | msgspec.UnsetType = msgspec.UNSET
    """Present only when a snapshot asked for it (`changed: true`) and the host recorded
    it: when the attempt's status last changed (its admission, each change of state,
    its release), wall-clock Unix milliseconds. A lease renewal is no change of status.
    Records a host made before it recorded this time have none."""

    def __post_init__(self) -> None:
        if self.state in TERMINAL and self.outcome != self.state:
            raise ValueError("a terminal state is its own outcome")
        if self.state == "released" and self.outcome is None:
            raise ValueError("a released attempt keeps its outcome")
        if self.state not in TERMINAL and self.state != "released" and self.outcome is not None:
            raise ValueError("only terminal and released attempts have an outcome")


class AttemptRow(AttemptStatus, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """A successful row of prepare, renew, start, observe, stop, release, reject_absent
    and reconcile_absent."""

    ok: Literal[True] = True


class InputRow(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """A successful input_status or input_write row: the durable next offset."""

    attempt_id: Identity
    generation: Positive
    plan_digest: Digest
    object: Identity
    offset: Count
    bytes: Count
    digest: Digest
    complete: bool
    ok: Literal[True] = True

    def __post_init__(self) -> None:
        """Complete exactly when the offset reaches the declared bytes, except for an
        empty object: at offset 0 of 0 bytes it is complete only once its one empty
        write sealed it, and `input_status` reports it before that write too."""
        if self.offset > self.bytes:
            raise ValueError("offset is past the declared bytes")
        if self.complete and self.offset != self.bytes:
            raise ValueError("complete only once offset reaches the declared bytes")
        if not self.complete and self.offset == self.bytes and self.bytes != 0:
            raise ValueError("complete exactly when offset reaches the declared bytes")


class ReadRow(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """A successful collect row.

    `data` holds the bytes read; on the wire it is a standard padded (canonical)
    base64 string. `eof`: `next_offset` is the file's current end. `complete`: the file is
    final and will not grow. `identity` is an opaque stable identity of the file: if it
    changes between reads, the object was replaced and earlier bytes are not part of it.
    """

    attempt_id: Identity
    generation: Positive
    plan_digest: Digest
    object: ObjectName
    offset: Count
    data: Annotated[bytes, msgspec.Meta(max_length=COLLECT_MAX_BYTES)]
    next_offset: Count
    eof: bool
    complete: bool
    identity: Digest
    ok: Literal[True] = True

    def __post_init__(self) -> None:
        if self.next_offset != self.offset + len(self.data):
            raise ValueError("next_offset is not offset plus the decoded data length")
        if self.complete and not self.eof:
            raise ValueError("a complete read is at eof")


# --- snapshot -----------------------------------------------------------------------


class Offer(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The current offer: `revision` increases with every accepted set_offer."""

    revision: Count
    control: Control
    limits: OfferLimits


class SlotClass(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Configured slots of one class: how many, how many free, and each slot's storage."""

    class_: Name = msgspec.field(name="class")
    total: Count
    free: Count
    bytes: Count
    inodes: Count
    usable: Count | msgspec.UnsetType = msgspec.UNSET
    """Only in a snapshot that asked with `slots: true`: the free slots of the class
    that passed their last check, where admission can place an attempt now (`free`
    counts every slot no attempt holds, a slot out of service included)."""

    def __post_init__(self) -> None:
        if self.free > self.total:
            raise ValueError("more free slots than slots")
        if isinstance(self.usable, int) and self.usable > self.free:
            raise ValueError("more usable slots than free slots")


SLOTS_MAX = 1024
"""The most slots a host has (its configuration's bound), so the most `SlotState`s."""
SLOT_MESSAGE_MAX = 1024
"""The longest `message` of a `SlotState`, in characters (a reply of every slot stays
well within the reply bound)."""


class SlotState(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """One configured slot's health, as the host last checked it.

    `healthy` is false while a check of the slot fails (its filesystem, its mount, its
    account or its layout): the host then admits nothing into it, and checks it again
    on its own schedule and at an administrator's `check_slots`. `reason` is the failed
    check's code and `message` what the administrator must do (both null while
    healthy). `free`: no attempt holds the slot. `since_ms`: when the slot entered its
    current state (wall-clock Unix milliseconds; the daemon's start for a slot that has
    been healthy all along).
    """

    id: Name
    class_: Name = msgspec.field(name="class")
    healthy: bool
    free: bool
    reason: Name | None
    message: Annotated[str, msgspec.Meta(max_length=SLOT_MESSAGE_MAX)] | None
    since_ms: Count

    def __post_init__(self) -> None:
        if self.healthy != (self.reason is None):
            raise ValueError("a slot has a reason exactly when it is not healthy")


_Version = Annotated[str, msgspec.Meta(pattern=r"\A[0-9A-Za-z][0-9A-Za-z.+!_-]{0,63}\Z")]


class RunningVersion(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One distribution of the running daemon and its version (`unknown` when it ran
    from a source tree that was not installed)."""

    distribution: Name
    version: _Version


class DaemonInfo(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """What the running daemon is: the versions of its distributions and its start
    time (`started_at_ms`, wall-clock Unix milliseconds), both read once when it
    started. A release installed since shows here only after a restart."""

    started_at_ms: Count
    versions: Annotated[list[RunningVersion], msgspec.Meta(max_length=MAX_ROWS)]
    tasks: Annotated[str, msgspec.Meta(max_length=1024)] | None = None
    """How the daemon knows which tasks of a slot account live: `process events` (the
    kernel tells it) or `walks of /proc: WHY` (the kernel cannot, and why); None from
    a daemon that does not say."""


class ProviderInfo(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A configured provider, its pinned digest, and whether it verified and loaded."""

    id: Name
    package_digest: Digest
    available: bool


class Capacity(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """An observation, not a reservation: admission rechecks everything."""

    available: Resources
    slot_classes: Annotated[list[SlotClass], msgspec.Meta(max_length=MAX_ROWS)]
    providers: Annotated[list[ProviderInfo], msgspec.Meta(max_length=MAX_ROWS)]


# --- replies ------------------------------------------------------------------------


class Reply(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Every reply: `version` 1 and the request's `id`."""

    version: Literal[1]
    id: Identity


class ErrorReply(Reply, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """The whole request was refused; no row was processed."""

    error: Error
    ok: Literal[False] = False


def error_row(code: str, message: str) -> ErrorRow:
    """A refused batch row (the message is cut to the 4096-character bound)."""
    return ErrorRow(error=Error(code=code, message=message[:_MESSAGE_MAX]))


def error_reply(request_id: str | None, code: str, message: str) -> ErrorReply:
    """A whole-request refusal; echoes the request ID, or ZERO_ID when it was unreadable."""
    return ErrorReply(
        version=1,
        id=request_id or ZERO_ID,
        error=Error(code=code, message=message[:_MESSAGE_MAX]),
    )


AttemptResult: TypeAlias = AttemptRow | ErrorRow
InputResult: TypeAlias = InputRow | ErrorRow
ReadResult: TypeAlias = ReadRow | ErrorRow


class AttemptsReply(Reply, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """The reply to prepare, renew, start, observe, stop, release, reject_absent and
    reconcile_absent: one attempt row or error row per request row, in order."""

    results: list[AttemptResult]
    ok: Literal[True] = True


class InputsReply(Reply, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """The reply to input_status and input_write: one input row or error row per row."""

    results: list[InputResult]
    ok: Literal[True] = True


class ReadsReply(Reply, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """The reply to collect: one read row or error row per read, in order."""

    results: list[ReadResult]
    ok: Literal[True] = True


class SnapshotReply(Reply, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Bindings, bounds, offer, capacity and one page of attempts (ordered by ID).

    Old saved snapshots have `ledger_id: null`, `admission_version: 0` and no
    `input_chunk_bytes` (read as 1 MiB); they do not prove admission under the current
    contract, so `bindings()` refuses them.
    """

    installation_id: Identity
    ledger_id: Identity | None
    admission_version: Literal[0, 1]
    maximum_lease_seconds: Positive
    input_chunk_bytes: Annotated[int, msgspec.Meta(ge=1, le=INPUT_CHUNK_MAX_BYTES)] = (
        INPUT_CHUNK_LEGACY_BYTES
    )
    offer: Offer
    capacity: Capacity
    attempts: Annotated[list[AttemptStatus], msgspec.Meta(max_length=MAX_ROWS)]
    next: Identity | None
    slots: Annotated[list[SlotState], msgspec.Meta(max_length=SLOTS_MAX)] | msgspec.UnsetType = (
        msgspec.UNSET
    )
    """Only when the request asked with `slots: true`: every configured slot's health."""
    daemon: DaemonInfo | msgspec.UnsetType = msgspec.UNSET
    """Only when the request asked with `daemon: true`: what the running daemon is."""
    ok: Literal[True] = True

    def __post_init__(self) -> None:
        if (self.ledger_id is None) != (self.admission_version == 0):
            raise ValueError("ledger_id is null exactly when admission_version is 0")
        ids = [a.attempt_id for a in self.attempts]
        if any(a >= b for a, b in itertools.pairwise(ids)):
            raise ValueError("attempts are not in strictly increasing ID order")

    def bindings(self) -> dict[str, Any]:
        """The admission binding to save before queueing prepare (refuses old snapshots)."""
        if self.admission_version != 1 or self.ledger_id is None:
            raise ProtocolError(
                ErrorCode.BINDINGS_CHANGED,
                "this snapshot predates admission_version 1 and proves no admission binding;"
                " take a new snapshot",
                "$.admission_version",
                self.id,
            )
        return {
            "installation_id": self.installation_id,
            "ledger_id": self.ledger_id,
            "admission_version": 1,
        }


class OfferReply(Reply, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """The offer after an accepted set_offer."""

    offer: Offer
    ok: Literal[True] = True


METRICS_MAX_CHARS = 1024 * 1024


class MetricsReply(Reply, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """The daemon's metrics as Prometheus text exposition format (version 0.0.4)."""

    text: Annotated[str, msgspec.Meta(max_length=METRICS_MAX_CHARS)]
    ok: Literal[True] = True


class SlotsReply(Reply, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Every configured slot's health, after the checks a `check_slots` ran."""

    slots: Annotated[list[SlotState], msgspec.Meta(max_length=SLOTS_MAX)]
    ok: Literal[True] = True


AnyReply: TypeAlias = (
    ErrorReply
    | AttemptsReply
    | InputsReply
    | ReadsReply
    | SnapshotReply
    | OfferReply
    | MetricsReply
    | SlotsReply
)

# --- decoding and encoding ----------------------------------------------------------

_ROW_TYPES: dict[
    str, tuple[type[AttemptsReply | InputsReply | ReadsReply], type[msgspec.Struct]]
] = {
    **{
        action: (AttemptsReply, AttemptRow)
        for action in (
            "prepare",
            "renew",
            "start",
            "observe",
            "stop",
            "release",
            "reject_absent",
            "reconcile_absent",
        )
    },
    "input_status": (InputsReply, InputRow),
    "input_write": (InputsReply, InputRow),
    "collect": (ReadsReply, ReadRow),
}


class _Envelope(msgspec.Struct, frozen=True):
    """The envelope, read leniently to pick the shape and to name a mismatch."""

    version: Any = None
    id: Any = None
    ok: Any = None


class _RawBatch(Reply, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """A batch reply checked strictly except for its rows, decoded one by one after."""

    results: list[msgspec.Raw]
    ok: Literal[True] = True


class _RowHead(msgspec.Struct, frozen=True):
    ok: Any = None


_encoder = msgspec.json.Encoder(order="sorted")
_decoders: dict[Any, msgspec.json.Decoder[Any]] = {}


def _decode_as(data: bytes | msgspec.Raw, kind: Any, prefix: str = "$") -> Any:
    decoder = _decoders.get(kind)
    if decoder is None:
        decoder = _decoders[kind] = msgspec.json.Decoder(kind)
    try:
        return decoder.decode(data)
    except msgspec.ValidationError as exc:
        message, path = explain(exc)
        raise ProtocolError(ErrorCode.INVALID_REPLY, message, prefix + path[1:]) from None
    except (msgspec.DecodeError, RecursionError) as exc:
        raise ProtocolError(ErrorCode.BAD_FRAME, f"not UTF-8 JSON: {exc}") from None


def read_envelope(frame: bytes) -> tuple[object, object]:
    """(version, id) of a reply, read leniently, so a client can name a mismatch."""
    head = _decode_as(frame, _Envelope)
    return head.version, head.id


def decode_reply(frame: bytes, action: str, *, rows: int | None = None) -> AnyReply:
    """Decode and validate the reply to a request with `action` (and `rows` rows).

    Raises ProtocolError: `bad_frame` for bytes that are not JSON, `invalid_reply`
    (naming the JSON path) for a reply of the wrong shape or row count.
    """
    head = _decode_as(frame, _Envelope)
    if head.ok is False:
        return _decode_as(frame, ErrorReply)  # type: ignore[no-any-return]
    if head.ok is not True:
        raise ProtocolError(ErrorCode.INVALID_REPLY, "ok is not a boolean", "$.ok")
    if action == "snapshot":
        return _decode_as(frame, SnapshotReply)  # type: ignore[no-any-return]
    if action == "set_offer":
        return _decode_as(frame, OfferReply)  # type: ignore[no-any-return]
    if action == "metrics":
        return _decode_as(frame, MetricsReply)  # type: ignore[no-any-return]
    if action == "check_slots":
        return _decode_as(frame, SlotsReply)  # type: ignore[no-any-return]
    if action not in _ROW_TYPES:
        raise ProtocolError(ErrorCode.UNSUPPORTED_ACTION, f"unknown action {action!r}")
    reply_type, row_type = _ROW_TYPES[action]
    batch = _decode_as(frame, _RawBatch)
    raw_rows = batch.results
    if rows is not None and len(raw_rows) != rows:
        raise ProtocolError(
            ErrorCode.INVALID_REPLY,
            f"{len(raw_rows)} result rows for {rows} request rows",
            "$.results",
        )
    results = [_decode_row(raw, row_type, f"$.results[{i}]") for i, raw in enumerate(raw_rows)]
    return reply_type(version=batch.version, id=batch.id, results=results)


def _decode_row(raw: msgspec.Raw, row_type: type[msgspec.Struct], path: str) -> Any:
    """One result row: the success shape when `ok` is true, else an ErrorRow."""
    ok = _decode_as(raw, _RowHead, path).ok
    row = _decode_as(raw, row_type if ok is True else ErrorRow, path)
    if isinstance(row, ReadRow) and not _canonical_base64(raw, row.data, path):
        raise ProtocolError(
            ErrorCode.INVALID_REPLY, "base64 is not canonical (nonzero unused bits)", f"{path}.data"
        )
    return row


class _DataSpelling(msgspec.Struct):
    """A read row's `data` exactly as sent (a JSON string), without decoding it."""

    data: msgspec.Raw


def _canonical_base64(raw: msgspec.Raw, data: bytes, path: str) -> bool:
    """Whether `data` was spelled as canonical base64 (`b64encode(data)`).

    msgspec already refused any other alphabet, missing padding and whitespace, but it
    accepts nonzero unused bits in the last quantum, so only that quantum is compared.
    """
    if not data:
        return True  # msgspec decodes only "" to no bytes
    quoted = bytes(_decode_as(raw, _DataSpelling, path).data)
    spelled = quoted[1:-1]
    if b"\\" in spelled:  # JSON escapes: legal, though an executor never sends them
        spelled = msgspec.json.decode(quoted, type=str).encode()
    last = data[-(len(data) % 3 or 3) :]
    return spelled[-4:] == binascii.b2a_base64(last, newline=False)


def encode_reply(reply: AnyReply) -> bytes:
    """Canonical JSON (sorted keys, compact, UTF-8)."""
    return _encoder.encode(reply)


__all__ = [
    "DETAIL_MAX",
    "METRICS_MAX_CHARS",
    "REASONS",
    "SLOTS_MAX",
    "SLOT_MESSAGE_MAX",
    "TERMINAL",
    "AnyReply",
    "AttemptResult",
    "AttemptRow",
    "AttemptStatus",
    "AttemptsReply",
    "Capacity",
    "Control",
    "DaemonInfo",
    "Error",
    "ErrorReply",
    "ErrorRow",
    "InputResult",
    "InputRow",
    "InputsReply",
    "MetricsReply",
    "Offer",
    "OfferReply",
    "Outcome",
    "PayloadUsage",
    "ProviderInfo",
    "ReadResult",
    "ReadRow",
    "ReadsReply",
    "Reply",
    "RunningVersion",
    "SlotClass",
    "SlotState",
    "SlotsReply",
    "SnapshotReply",
    "State",
    "Usage",
    "decode_reply",
    "encode_reply",
    "error_reply",
    "error_row",
    "read_envelope",
]
