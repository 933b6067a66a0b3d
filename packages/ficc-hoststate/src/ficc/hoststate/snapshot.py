"""The `state.json` codec: canonical, versioned, checksummed JSON. Pure bytes in, bytes out.

A file is the canonical encoding (sorted keys, no insignificant whitespace, UTF-8) of
`{checksum, format, host_id, operations, version}`. `checksum` is `sha256:<hex>` of the
canonical encoding of the same object without `checksum`; because "checksum" sorts
first, the file is exactly a fixed-length checksum header followed by that encoding
minus its opening brace. Decoding re-encodes what it parsed and compares bytes, which
rejects duplicate keys, reordered keys and extra whitespace that a JSON parser accepts.

`Image` keeps the encoding in memory and edits one record in place per mutation, so
saving an 8 MiB store costs a memmove and a partial hash, not a full re-encode.
"""

from __future__ import annotations

import bisect
import contextlib
import hashlib
import re
from collections.abc import Iterator, Sequence

import msgspec

from .errors import Corrupt, HostMismatch
from .model import HostId, Operation, is_consistent

FORMAT = "ficc-hoststate"
VERSION = 1
MAX_BYTES = 16 * 1024 * 1024
RESERVE = 64  # room kept for the active record's later status and revision growth

_HEADER_RE = re.compile(rb'\{"checksum":"sha256:([0-9a-f]{64})",')
HEADER_LEN = len(b'{"checksum":"sha256:",') + 64
_TAIL = b'],"version":%d}' % VERSION
_HASH_STEP = 256 * 1024  # distance between cached partial-hash states in `Image`


class _Body(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The checksummed object: everything in the file except `checksum`."""

    format: str
    host_id: HostId
    operations: list[Operation]
    version: int


class _Envelope(msgspec.Struct, frozen=True):
    """Just enough to name a foreign format or version before parsing the rest."""

    format: str = ""
    version: int = 0


_ENCODER = msgspec.json.Encoder(order="sorted")
_BODY_DECODER = msgspec.json.Decoder(_Body)
_ENVELOPE_DECODER = msgspec.json.Decoder(_Envelope)


def _encode_body(host_id: str, operations: Sequence[Operation]) -> bytes:
    return _ENCODER.encode(_Body(FORMAT, host_id, list(operations), VERSION))


def _header(checksum_hex: str) -> bytes:
    return b'{"checksum":"sha256:' + checksum_hex.encode() + b'",'


def seal(body: bytes) -> bytes:
    """The file for a checksummed object's canonical encoding `body` (`{...}`)."""
    return _header(hashlib.sha256(body).hexdigest()) + body[1:]


def encode(host_id: str, operations: Sequence[Operation]) -> bytes:
    """The reference encoder: the exact file bytes for this state."""
    return seal(_encode_body(host_id, sorted(operations, key=lambda op: op.id)))


def decode(data: bytes, host_id: str) -> list[Operation]:
    """Verify a whole file and return its operations, sorted by ID; raise on any defect."""
    if len(data) > MAX_BYTES:
        raise Corrupt(f"state.json is {len(data)} bytes, over the {MAX_BYTES}-byte limit")
    match = _HEADER_RE.match(data)
    if match is None:
        raise Corrupt("state.json is truncated or not a ficc-hoststate snapshot (no checksum)")
    body = b"{" + data[HEADER_LEN:]
    if hashlib.sha256(body).hexdigest().encode() != match.group(1):
        raise Corrupt("state.json checksum mismatch: the file was changed or truncated")
    parsed = _parse(body)
    if parsed.host_id != host_id:
        raise HostMismatch(
            f"state.json belongs to host {parsed.host_id!r}, not {host_id!r}; use that host"
            " ID or the directory bootstrap made for this host"
        )
    if _encode_body(parsed.host_id, parsed.operations) != body:
        raise Corrupt(
            "state.json is not canonical (duplicate key, key order or whitespace);"
            " it was not written by ficc-hoststate"
        )
    _check_invariants(parsed.operations)
    return parsed.operations


def _parse(body: bytes) -> _Body:
    try:
        envelope = _ENVELOPE_DECODER.decode(body)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise Corrupt(f"state.json is not a valid snapshot: {exc}") from None
    if envelope.format != FORMAT:
        raise Corrupt(f"state.json has format {envelope.format!r}, expected {FORMAT!r}")
    if envelope.version != VERSION:
        raise Corrupt(
            f"state.json has version {envelope.version}; this ficc-hoststate reads only"
            f" version {VERSION}: use the release that wrote it"
        )
    try:
        return _BODY_DECODER.decode(body)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise Corrupt(f"state.json is not a valid snapshot: {exc}") from None


def _check_invariants(operations: Sequence[Operation]) -> None:
    """Refuse what the codec accepts but no sequence of sessions could have written."""
    unresolved = 0
    for i, op in enumerate(operations):
        if i and operations[i - 1].id >= op.id:
            raise Corrupt(f"state.json operations are not strictly sorted at {op.id!r}")
        if not is_consistent(op):
            raise Corrupt(
                f"state.json record {op.id!r} has status {op.status.value} at revision"
                f" {op.revision}, which no sequence of transitions produces"
            )
        unresolved += not op.resolved
    if unresolved > 1:
        raise Corrupt(f"state.json has {unresolved} unresolved operations; at most 1 can exist")


def _fragment(op: Operation) -> bytes:
    return _ENCODER.encode(op)


class Image:
    """The canonical encoding of one host's snapshot, edited in place as records change.

    The object's canonical bytes (`body`) live in a bytearray; the checksum is the
    SHA-256 of `body`, computed from the last cached partial-hash state that precedes
    the earliest edit. Every record is located by its unique `{"id":"<id>"` prefix
    (IDs cannot contain a quote), so no offset table has to be maintained.
    """

    def __init__(self, body: bytes, ids: list[str]) -> None:
        self._body = bytearray(body)
        self._ids = ids
        self._ops_start = self._body.index(b'"operations":[') + len(b'"operations":[')
        self._hashes: list[tuple[int, hashlib._Hash]] = []

    @classmethod
    def empty(cls, host_id: str) -> Image:
        return cls(_encode_body(host_id, []), [])

    @classmethod
    def load(cls, data: bytes, host_id: str) -> tuple[Image, list[Operation]]:
        """Verify a file (see `decode`) and keep its bytes as the image."""
        operations = decode(data, host_id)
        return cls(b"{" + data[HEADER_LEN:], [op.id for op in operations]), operations

    @property
    def size(self) -> int:
        """The size of the file this image saves as."""
        return HEADER_LEN + len(self._body) - 1

    def size_after(self, old: Operation | None, new: Operation) -> int:
        """The file size once `new` replaces `old` (or is added, when `old` is None)."""
        if old is None:
            return self.size + len(_fragment(new)) + (1 if self._ids else 0)
        return self.size + len(_fragment(new)) - len(_fragment(old))

    def put(self, old: Operation | None, new: Operation) -> None:
        """Replace `old`'s record with `new`, or insert `new` in ID order."""
        body, fragment = self._body, _fragment(new)
        if old is not None:
            pos = self._find(old.id)
            body[pos : body.index(b"}", pos) + 1] = fragment
        else:
            i = bisect.bisect_left(self._ids, new.id)
            if i < len(self._ids):
                pos, fragment = self._find(self._ids[i]), fragment + b","
            else:
                pos = len(body) - len(_TAIL)
                fragment = b"," + fragment if self._ids else fragment
            body[pos:pos] = fragment
            self._ids.insert(i, new.id)
        while self._hashes and self._hashes[-1][0] > pos:
            self._hashes.pop()

    def checksum(self) -> str:
        """SHA-256 hex of the body, rehashing only from the last still-valid state."""
        offset, state = self._hashes[-1] if self._hashes else (0, hashlib.sha256())
        state = state.copy()
        with memoryview(self._body) as view:
            while offset + _HASH_STEP <= len(view):
                with view[offset : offset + _HASH_STEP] as chunk:
                    state.update(chunk)
                offset += _HASH_STEP
                self._hashes.append((offset, state.copy()))
            with view[offset:] as rest:
                state.update(rest)
        return state.hexdigest()

    @contextlib.contextmanager
    def file_chunks(self) -> Iterator[list[bytes | memoryview]]:
        """The file as buffers to write in order, without copying the body."""
        header = _header(self.checksum())
        with memoryview(self._body) as view, view[1:] as rest:
            yield [header, rest]

    def to_bytes(self) -> bytes:
        with self.file_chunks() as chunks:
            return b"".join(chunks)

    def _find(self, op_id: str) -> int:
        pos = self._body.find(b'{"id":"' + op_id.encode() + b'"', self._ops_start)
        if pos < 0:  # the registry and the image disagree: a bug, never a user error
            raise AssertionError(f"record {op_id!r} missing from the snapshot image")
        return pos
