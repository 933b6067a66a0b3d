"""What only the executor needs from the wire contract; not for controllers.

A controller builds requests and reads replies with `ficc.execution.protocol`,
`ficc.execution.wire` and `ficc.execution.client`. The executor (ficc-executor-host)
also needs a few things a controller never uses: the memory-saving twin of
`decode_request`, its `input_write` row models, and a frame encoder that writes into
a reused buffer. They live here, outside the controller-facing modules, and may
change with any release of the executor.
"""

from __future__ import annotations

import binascii
import hashlib
import importlib
from collections.abc import Callable, Iterator
from typing import Annotated, cast

import msgspec

from ficc.execution._rows import _BATCH, INPUT_CHUNK_MAX_BYTES, _canonical_b64decode, _ChunkRow
from ficc.execution._rules import deferred_checks
from ficc.execution.errors import ProtocolError
from ficc.execution.frames import _encode_frame_into as encode_frame_into
from ficc.execution.frames import _EncodesInto as EncodesInto
from ficc.execution.plan import Count, Digest, Identity, Plan, Positive, _canonical, _digests
from ficc.execution.protocol import (
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
    _Writes,
    decode_request,
)


class ReceivedInputWrite(
    msgspec.Struct, _ChunkRow, frozen=True, forbid_unknown_fields=True, dict=True
):
    """An `input_write` row as the executor receives it (see `receive_request`).

    The same fields and checks as `InputWrite`, but `data` is left as raw JSON, a view
    of the frame, and the chunk is never held whole: `InputWrite` would first build the
    base64 `str` (10.7 MiB for an 8 MiB chunk), then the decoded chunk (8 MiB). The
    checks decode it piece by piece to hash it; the writer decodes it again piece by
    piece (`chunk_pieces`), then calls `release` so the frame can be freed.
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

    @property
    def chunk_size(self) -> int:
        """The decoded length, from the checked base64's length and padding alone."""
        body = _json_string_body(self.data)
        return len(body) // 4 * 3 - bytes(body[-2:]).count(b"=")

    def chunk_pieces(self) -> Iterator[bytes]:
        """The decoded chunk in pieces of at most `_PIECE_BYTES`, each decoded on demand.

        Only for a row whose request was checked, and until `release`.
        """
        cached: bytes | None = self.__dict__.get("_chunk")
        if cached is not None:
            yield cached
            return
        yield from _plain_pieces(_json_string_body(self.data))

    def release(self) -> None:
        """Let go of the frame: the chunk is written (or will not be)."""
        msgspec.structs.force_setattr(self, "data", _RELEASED)
        self.__dict__.pop("_chunk", None)

    def _measure(self) -> tuple[int, str]:
        body = _json_string_body(self.data)
        hasher = hashlib.sha256()
        try:
            for piece in _plain_pieces(body):
                hasher.update(piece)
        except ValueError:  # rare: a refusal, or a spelling only the reference decides
            chunk = self.__dict__["_chunk"] = _canonical_b64decode(body)  # raises the reason
            return len(chunk), "sha256:" + hashlib.sha256(chunk).hexdigest()
        return self.chunk_size, "sha256:" + hasher.hexdigest()


_PIECE_BYTES = 510 * 1024
"""The largest decoded piece `chunk_pieces` yields (a fixed slice of the base64).

A multiple of 3, so every piece but the last is whole quanta and exactly this long.
"""

_PIECE_CHARS = _PIECE_BYTES // 3 * 4
_PAD = ord("=")
_bytes_of_base64 = msgspec.json.Decoder(bytes)


def _msgspec_piece(text: memoryview) -> bytes:
    """One slice by msgspec's base64 decoder (the check in the same pass), quoted as a
    JSON string: a backslash would be a JSON escape there, so it is refused first."""
    quoted = b"".join((b'"', text, b'"'))
    if b"\\" in quoted:
        raise ValueError("not plainly canonical base64")
    try:
        return _bytes_of_base64.decode(quoted)
    except msgspec.DecodeError:
        raise ValueError("not plainly canonical base64") from None


def _simd_b64decode() -> Callable[..., bytes] | None:
    """pybase64's decoder where it is installed (the executor host depends on it); a
    controller's install of ficc-protocol needs msgspec alone."""
    try:
        return cast("Callable[..., bytes]", importlib.import_module("pybase64").b64decode)
    except ImportError:
        return None


SIMD_B64DECODE = _simd_b64decode()


def _pybase64_piece(text: memoryview) -> bytes:
    """One slice by pybase64 (SIMD: about 10 times as fast as msgspec's here)."""
    assert SIMD_B64DECODE is not None
    try:
        return SIMD_B64DECODE(text, validate=True)
    except ValueError:  # binascii.Error included
        raise ValueError("not plainly canonical base64") from None


_decode_piece = _msgspec_piece if SIMD_B64DECODE is None else _pybase64_piece
"""Both refuse every character outside the alphabet and any `=` but the final padding
of the slice they are given."""


def _plain_pieces(body: memoryview) -> Iterator[bytes]:
    """Decode canonical base64 in 4-aligned slices; ValueError on anything else.

    Each slice but the last must not end in `=` (the piece decoders accept padding at
    the end of what they are given), and the last quantum is checked for canonical
    padding and unused bits on its own.
    """
    if len(body) % 4 or not _canonical_quantum(bytes(body[-4:])):
        raise ValueError("not plainly canonical base64")
    for start in range(0, len(body), _PIECE_CHARS):
        end = start + _PIECE_CHARS
        text = body[start:end]
        if end < len(body) and text[-1] == _PAD:
            raise ValueError("not plainly canonical base64")
        yield _decode_piece(text)


def _canonical_quantum(last: bytes) -> bool:
    """Whether the last 4 characters (or none) are canonical base64 on their own."""
    try:
        raw = binascii.a2b_base64(last, strict_mode=True)
    except (binascii.Error, ValueError):
        return False
    return binascii.b2a_base64(raw, newline=False) == last


_ReceivedInputWrites = Annotated[list[ReceivedInputWrite], _BATCH]


class ReceivedInputWriteRequest(Request, _Writes, frozen=True, kw_only=True, tag="input_write"):
    """`InputWriteRequest` as the executor receives it: rows are `ReceivedInputWrite`.

    Not for building requests (a controller builds `InputWriteRequest` with base64
    text); `receive_request` returns it for the common, plainly spelled document.
    """

    writes: _ReceivedInputWrites

    def __post_init__(self) -> None:
        _check_writes(self, self.writes)

    def release(self) -> None:
        """Let go of the frame once every row is written (or refused)."""
        for write in self.writes:
            write.release()


_RELEASED = msgspec.Raw()
"""What a received row's `data` holds once it let go of the frame."""

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
