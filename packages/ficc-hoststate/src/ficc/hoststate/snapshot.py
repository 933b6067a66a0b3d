"""The `state.json` codec: canonical, versioned, checksummed JSON. Pure bytes in, bytes out.

A file is the canonical encoding (sorted keys, no insignificant whitespace, UTF-8) of
`{checksum, format, host_id, operations, version}`. `checksum` is `sha256:<hex>` of the
canonical encoding of the same object without `checksum`; because "checksum" sorts
first, the file is exactly a fixed-length checksum header followed by that encoding
minus its opening brace. Decoding re-encodes what it parsed and compares bytes, which
rejects duplicate keys, reordered keys and extra whitespace that a JSON parser accepts.

`Image` keeps the encoding in memory, in blocks, and edits one record in place per
mutation, so saving an 8 MiB store re-encodes one record and rehashes only the blocks
from the edit onwards.
"""

from __future__ import annotations

import bisect
import hashlib
import re
from collections.abc import Sequence

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
_BLOCK = 64 * 1024  # target size of a block of records in `Image`


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
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError) as exc:
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
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError) as exc:
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

    Records are kept as their encoded fragments in blocks of about `_BLOCK` bytes, in
    ID order, so an edit touches one block (memmove of at most ~2 blocks). The body
    hash is cached at every block boundary: after an edit only the edited block and
    those after it are rehashed. The file is `header(checksum)`, then `pieces()`.
    """

    def __init__(self, host_id: str, operations: Sequence[Operation]) -> None:
        self._prefix = _encode_body(host_id, [])[: -len(_TAIL)]  # ...,"operations":[
        self._blocks: list[bytearray] = []
        self._ids: list[list[str]] = []  # the sorted IDs of each block
        self._hashes: list[hashlib._Hash] = []  # state after prefix + blocks[: i + 1]
        for op in operations:
            fragment = _fragment(op)
            if not self._blocks or len(self._blocks[-1]) + len(fragment) > _BLOCK:
                self._blocks.append(bytearray(fragment))
                self._ids.append([op.id])
            else:
                self._blocks[-1] += b"," + fragment
                self._ids[-1].append(op.id)

    @classmethod
    def load(cls, data: bytes, host_id: str) -> tuple[Image, list[Operation]]:
        """Verify a file (see `decode`) and build the image of what it holds."""
        operations = decode(data, host_id)
        return cls(host_id, operations), operations

    @property
    def size(self) -> int:
        """The size of the file this image saves as."""
        records = sum(map(len, self._blocks)) + max(len(self._blocks) - 1, 0)
        return HEADER_LEN - 1 + len(self._prefix) + records + len(_TAIL)

    def size_after(self, old: Operation | None, new: Operation) -> int:
        """The file size once `new` replaces `old` (or is added, when `old` is None)."""
        if old is None:
            return self.size + len(_fragment(new)) + (1 if self._blocks else 0)
        return self.size + len(_fragment(new)) - len(_fragment(old))

    def put(self, old: Operation | None, new: Operation) -> None:
        """Replace `old`'s record with `new`, or insert `new` in ID order."""
        fragment = _fragment(new)
        if not self._blocks:
            self._blocks.append(bytearray(fragment))
            self._ids.append([new.id])
            k = 0
        else:
            k = max(bisect.bisect_right(self._ids, new.id, key=lambda ids: ids[0]) - 1, 0)
            block, ids = self._blocks[k], self._ids[k]
            if old is not None:
                pos = _find(block, old.id)
                block[pos : block.index(b"}", pos) + 1] = fragment
            else:
                j = bisect.bisect_left(ids, new.id)
                if j < len(ids):
                    pos = _find(block, ids[j])
                    block[pos:pos] = fragment + b","
                else:
                    block += b"," + fragment
                ids.insert(j, new.id)
                if len(block) > 2 * _BLOCK:
                    self._split(k)
        del self._hashes[k:]

    def _split(self, k: int) -> None:
        block, ids = self._blocks[k], self._ids[k]
        half = len(ids) // 2
        pos = _find(block, ids[half])
        self._blocks[k : k + 1] = [block[: pos - 1], block[pos:]]  # drop the comma between
        self._ids[k : k + 1] = [ids[:half], ids[half:]]

    def checksum(self) -> str:
        """SHA-256 hex of the body, rehashing only from the last still-valid block."""
        state = self._hashes[-1].copy() if self._hashes else hashlib.sha256(self._prefix)
        for k in range(len(self._hashes), len(self._blocks)):
            if k:
                state.update(b",")
            state.update(self._blocks[k])  # large updates release the GIL
            self._hashes.append(state.copy())
        state.update(_TAIL)
        return state.hexdigest()

    def header(self) -> bytes:
        """The first `HEADER_LEN` bytes of the file: `{"checksum":"sha256:<hex>",`."""
        return _header(self.checksum())

    def pieces(self) -> list[bytes | bytearray]:
        """The file after the header, as buffers to write in order (no copies)."""
        out: list[bytes | bytearray] = [self._prefix[1:]]
        for k, block in enumerate(self._blocks):
            if k:
                out.append(b",")
            out.append(block)
        out.append(_TAIL)
        return out

    def to_bytes(self) -> bytes:
        """The whole snapshot file: header, then every piece, in order."""
        return b"".join([self.header(), *self.pieces()])


def _find(block: bytearray, op_id: str) -> int:
    """Offset of a record in its block; IDs cannot contain a quote, so this is unique."""
    pos = block.find(b'{"id":"' + op_id.encode() + b'"')
    if pos < 0:  # the registry and the image disagree: a bug, never a user error
        raise AssertionError(f"record {op_id!r} missing from the snapshot image")
    return pos
