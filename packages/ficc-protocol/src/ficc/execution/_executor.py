"""What only the executor needs from the wire contract; not for controllers.

A controller builds requests and reads replies with `ficc.execution.protocol`,
`ficc.execution.wire` and `ficc.execution.client`. The executor (ficc-executor-host)
also needs a few things a controller never uses: the memory-saving twin of
`decode_request`, its `input_write` row models, and a frame encoder that writes into
a reused buffer. They live here, outside the controller-facing modules, and may
change with any release of the executor.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

from ficc.execution._rules import deferred_checks
from ficc.execution.errors import ProtocolError
from ficc.execution.frames import _encode_frame_into as encode_frame_into
from ficc.execution.frames import _EncodesInto as EncodesInto
from ficc.execution.plan import Count, Digest, Identity, Plan, Positive, _canonical, _digests
from ficc.execution.protocol import (
    _BATCH,
    INPUT_CHUNK_MAX_BYTES,
    AnyRequest,
    CollectRequest,
    InputStatusRequest,
    ObserveRequest,
    PrepareRequest,
    ReconcileAbsentRequest,
    RejectAbsentRequest,
    ReleaseRequest,
    RenewRequest,
    Request,
    SetOfferRequest,
    SnapshotRequest,
    StartRequest,
    StopRequest,
    _check_writes,
    _ChunkRow,
    _Writes,
    decode_request,
)


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


_ReceivedInputWrites = Annotated[list[ReceivedInputWrite], _BATCH]


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
)

ReceivedRequest = AnyRequest | ReceivedInputWriteRequest
"""Every request model `receive_request` returns."""


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


_receiver = msgspec.json.Decoder(_ReceivedRequest)


def receive_request(
    frame: bytes, *, input_chunk_bytes: int = INPUT_CHUNK_MAX_BYTES
) -> ReceivedRequest:
    """`decode_request` for the executor: the same answer, less memory for chunks.

    An `input_write` comes back as a `ReceivedInputWriteRequest`, its chunks decoded
    straight from `frame` (the frame and the chunk are the only full-size buffers).
    Every document this fast path refuses, including one whose base64 is spelled with
    JSON escapes, is decided by `decode_request`, so both accept the same documents
    and every refusal has the same code, message and path.
    """
    try:
        with deferred_checks():
            request: ReceivedRequest = _receiver.decode(frame)
    except (msgspec.MsgspecError, RecursionError, ProtocolError):
        return decode_request(frame, input_chunk_bytes=input_chunk_bytes)
    if isinstance(request, ReceivedInputWriteRequest) and request.chunk_bytes > input_chunk_bytes:
        return decode_request(frame, input_chunk_bytes=input_chunk_bytes)
    return request


def canonical_plans(plans: list[Plan]) -> list[bytes]:
    """The canonical bytes of plans a request already checked, without checking again.

    `encode_plan` decodes its result again to refuse a plan built in Python; a plan
    from a decoded request has passed exactly those checks.
    """
    return list(map(_canonical, plans))


plan_digests = _digests
"""The digests of plans a decoded request already checked, in one pass."""

__all__ = [
    "EncodesInto",
    "ReceivedInputWrite",
    "ReceivedInputWriteRequest",
    "ReceivedRequest",
    "canonical_plans",
    "encode_frame_into",
    "plan_digests",
    "receive_request",
]
