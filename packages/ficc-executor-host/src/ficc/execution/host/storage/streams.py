"""The rules of a streamed write, pure: what a declared input's stream starts as, whether
a slot can hold them all, what one chunk does to a stream (`plan_write`), and when a
staged file that changed refuses a start."""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterable
from typing import Protocol

import msgspec

from ficc.execution.errors import ErrorCode
from ficc.execution.host.core.errors import HostError
from ficc.execution.host.core.records import StreamState
from ficc.execution.host.linux.fsutil import (
    identity_of,
)
from ficc.execution.provider import InputCapability

ROOT_UID = 0


IDENTITY = re.compile(r"\A[0-9a-f]{32}\Z")


Commit = Callable[["StreamState"], None]


class DeclaredInput(Protocol):
    """The fields of a plan's `InputObject` that staging needs."""

    @property
    def id(self) -> str: ...
    @property
    def name(self) -> str: ...
    @property
    def bytes(self) -> int: ...
    @property
    def digest(self) -> str: ...
    @property
    def delivery(self) -> str: ...


class ChunkPieces(Protocol):
    """A chunk offered in pieces (an `input_write` row offers it so): never whole.

    Its pieces were checked against the row's digest where the row was received (the
    request decoder measures every chunk before the request exists), so staging
    trusts them: it hashes them only into the object's running SHA-256.
    """

    @property
    def chunk_size(self) -> int: ...
    def chunk_pieces(self) -> Iterable[bytes]: ...


def streams_of(inputs: Iterable[DeclaredInput]) -> list[StreamState]:
    """The fresh states of a plan's streamed inputs (local inputs are not staged)."""
    return [
        StreamState(id=i.id, name=i.name, bytes=i.bytes, digest=i.digest)
        for i in inputs
        if i.delivery == "stream"
    ]


def check_capacity(inputs: Iterable[DeclaredInput], slot_storage_bytes: int) -> None:
    """Refuse at admission a plan whose streams cannot fit the slot's reserved storage.

    The slot's storage also holds runtime images, temporary files, logs and outputs,
    so this is a necessary bound, not a sufficient one; a full filesystem at write
    time is refused separately (`slot_full`).
    """
    total = sum(i.bytes for i in inputs if i.delivery == "stream")
    if total > slot_storage_bytes:
        raise HostError(
            ErrorCode.SLOT_CAPACITY,
            f"the streamed inputs declare {total} bytes but the slot reserves only "
            f"{slot_storage_bytes}; use a slot class with more storage or smaller inputs",
        )


def plan_write(
    state: StreamState, offset: int, chunk_len: int, *, chunk_digest_ok: bool, in_flight: bool
) -> HostError | None:
    """Decide whether a chunk may be written; return the refusal, or None to proceed."""
    obj = state.id
    if in_flight:
        return HostError(
            ErrorCode.INPUT_BUSY,
            "another input write for this attempt is in flight; retry on a later polling cycle",
        )
    if state.failed is not None:
        return HostError(
            ErrorCode.INPUT_FAILED,
            f"input {obj} failed earlier ({state.failed}); the attempt cannot start: release it",
        )
    if state.complete:
        return HostError(ErrorCode.INPUT_COMPLETE, f"input {obj} is complete and read-only")
    if offset != state.offset:
        return HostError(
            ErrorCode.INPUT_OFFSET_CHANGED,
            f"input {obj} continues at durable offset {state.offset}, not {offset}; "
            "read input_status and continue from the offset it returns",
        )
    if chunk_len == 0 and state.bytes != 0:
        return HostError(
            ErrorCode.INPUT_SIZE_MISMATCH,
            f"an empty chunk is valid only for an empty object; input {obj} declares "
            f"{state.bytes} bytes",
        )
    if offset + chunk_len > state.bytes:
        return HostError(
            ErrorCode.INPUT_SIZE_MISMATCH,
            f"a chunk of {chunk_len} bytes at offset {offset} overruns the {state.bytes} "
            f"bytes declared for input {obj}",
        )
    if not chunk_digest_ok:
        return HostError(
            ErrorCode.INPUT_DIGEST_MISMATCH,
            f"the chunk at offset {offset} of input {obj} does not match its SHA-256; "
            "resend the chunk",
        )
    return None


def identity_refusal(
    capability: InputCapability, seen: os.stat_result | None, slot_gid: int
) -> HostError | None:
    """Whether a staged file, as `seen` now (None: gone), is still the completed one.

    The `input_changed` refusal, naming the input, or None. Compares device, inode,
    mode, bytes and mtime (not ctime, nor the link count: the provider's hard link
    changes both), plus root ownership and the slot group. Pure: the caller stats the
    file (never following a link), so the rule is tested without a filesystem.
    """
    same = (
        seen is not None
        and identity_of(seen) == capability.identity
        and (seen.st_uid, seen.st_gid) == (ROOT_UID, slot_gid)
    )
    if same:
        return None
    return HostError(
        ErrorCode.INPUT_CHANGED,
        f"the staged input {capability.name!r} (object {capability.id}) changed after it"
        " was staged (its device, inode, mode, size, mtime or owner is no longer the one"
        " recorded when it completed); the attempt failed and its payload never ran:"
        " release the attempt and retry the job as a new attempt",
    )


def failed_stream(state: StreamState, code: str) -> StreamState:
    return msgspec.structs.replace(state, failed=code, complete=False)


def check_identity(value: str, what: str) -> None:
    if not IDENTITY.match(value):
        raise HostError(
            ErrorCode.UNSAFE_PATH,
            f"{what} {value!r} is not 32 lowercase hex characters; fix the plan",
        )
