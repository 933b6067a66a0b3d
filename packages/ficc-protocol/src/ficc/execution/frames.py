"""Frames: a 4-byte unsigned big-endian length, then that many bytes of UTF-8 JSON.

`FrameDecoder` is sans-I/O and the only frame reader: the executor's server, the
client and anyone who feeds it bytes share its bound and end-of-stream rules. It
refuses length 0 and any length above its bound as soon as it has seen the four
length bytes, so it never holds more than 4 + bound bytes, whatever a peer sends.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import Any, Protocol

from ficc.execution.errors import ErrorCode, ProtocolError

_MIB = 1024 * 1024
REQUEST_MAX = 12 * _MIB
"""Largest request payload."""
REPLY_MAX = 2 * _MIB
"""Largest reply payload."""
HEADER = struct.Struct(">I")


class FrameError(ProtocolError):
    """A framing failure: `bad_frame` (length 0, truncated) or `frame_too_large`."""


def _check_length(length: int, max_length: int) -> None:
    """Refuse a declared length before a single payload byte is buffered."""
    if length == 0:
        raise FrameError(ErrorCode.BAD_FRAME, "a frame has length 0")
    if length > max_length:
        raise FrameError(
            ErrorCode.FRAME_TOO_LARGE, f"a frame of {length} bytes is over the {max_length} bound"
        )


def encode_frame(payload: bytes, max_length: int) -> bytes:
    """Length prefix + payload; refuses an empty or oversized payload."""
    _check_length(len(payload), max_length)
    return HEADER.pack(len(payload)) + payload


class _EncodesInto(Protocol):
    """What `_encode_frame_into` needs of an encoder (a `msgspec.json.Encoder` has it)."""

    def encode_into(self, obj: Any, buffer: bytearray, offset: int = 0, /) -> None:
        """Write `obj` into `buffer` from `offset` on, growing the buffer as needed."""


def _encode_frame_into(
    encoder: _EncodesInto, value: object, buffer: bytearray, max_length: int
) -> int:
    """Encode `value` as one whole frame at the start of `buffer`; return the frame size.

    The payload is encoded straight after a 4-byte header slot, then the header is
    filled in, so a frame is built with no copy and can go out in one send. Reusing
    `buffer` spares a fresh allocation per frame: for a 1.4 MB collect reply, page
    faults on fresh memory cost about as much as the encoding. Raises FrameError for
    an empty or oversized payload; `buffer` then holds no valid frame.
    """
    _keep_allocation(buffer)
    encoder.encode_into(value, buffer, HEADER.size)
    length = len(buffer) - HEADER.size
    _check_length(length, max_length)
    HEADER.pack_into(buffer, 0, length)
    return len(buffer)


def _keep_allocation(buffer: bytearray) -> None:
    """Lengthen a reused `buffer` so the encoder's growth cannot give its memory back.

    CPython reallocates a bytearray resized to less than half its allocation down to
    that size, and msgspec grows a buffer from its current length: after a small
    frame, the next large one would start from a few bytes of memory again. From half
    the allocation (zeros, overwritten by the next frame), every resize stays inside.
    """
    floor = buffer.__alloc__() // 2 + 1
    if len(buffer) < floor:
        buffer.extend(bytes(floor - len(buffer)))


class FrameDecoder:
    """The one framing rule, sans-I/O: every reader of frames in this project uses it.

    Two ways in. `feed(data)` takes bytes that arrived anywhere and returns the
    frames they complete. `want()` and `received(count)` let a socket reader receive
    straight into the decoder's memory instead: the header first, then one buffer of
    exactly the declared length, handed back whole with no copy. Either way the
    length is checked (0 and above the bound refused) as soon as its four bytes are
    in, before any payload memory exists, and `eof()` tells a clean end between
    frames from a truncated frame. After an error it stays failed: the stream is
    unusable.
    """

    def __init__(self, max_length: int, allocate: Callable[[int], bytearray] = bytearray) -> None:
        """`allocate(length)` gives the payload buffer for `want()`: exactly `length`
        bytes, whatever they hold (every one is received before the frame is handed
        back). A reader may pass one that reuses memory; the default makes a new one."""
        if not 1 <= max_length <= 0xFFFFFFFF:
            raise ValueError("max_length must fit the 4-byte length")
        self.max_length = max_length
        self._allocate = allocate
        self._header = bytearray(HEADER.size)
        self._payload: bytearray | None = None
        self._have = 0  # bytes of the current header, or of the current payload
        self._need: int | None = None  # payload length once the header is read
        self._failed: FrameError | None = None

    @property
    def buffered(self) -> int:
        """Bytes of the current frame held now; never more than 4 + max_length."""
        return self._have

    @property
    def idle(self) -> bool:
        """True between frames: EOF here is clean, anywhere else is truncation."""
        return not self._have and self._need is None

    @property
    def expected(self) -> int | None:
        """The declared payload length of the frame being read, once its header is in."""
        return self._need

    def want(self) -> memoryview:
        """Where the next bytes go: the rest of the header, else the rest of the payload.

        The payload buffer is allocated here, on the first call after the header, so
        a reader can refuse a length (for its own budget) before any memory is taken.
        """
        if self._failed is not None:
            raise self._failed
        if self._need is None:
            return memoryview(self._header)[self._have :]
        if self._payload is None:
            self._payload = self._allocate(self._need)
            if len(self._payload) != self._need:
                raise ValueError(f"allocate gave {len(self._payload)} bytes, not {self._need}")
        return memoryview(self._payload)[self._have :]

    def received(self, count: int) -> bytearray | None:
        """Count `count` bytes written into the last `want()` view.

        Returns the payload when this completes a frame (the buffer itself, not a
        copy). Raises FrameError on a length of 0 or above the bound.
        """
        if self._failed is not None:
            raise self._failed
        self._have += count
        if self._need is None:
            if self._have == HEADER.size:
                self._start(HEADER.unpack(self._header)[0])
            return None
        if self._have < self._need:
            return None
        payload = self._payload if self._payload is not None else bytearray()
        self._payload, self._need, self._have = None, None, 0
        return payload

    def _start(self, length: int) -> None:
        self._have = 0
        try:
            _check_length(length, self.max_length)
        except FrameError as exc:
            self._failed = exc
            raise
        self._need = length

    def feed(self, data: bytes) -> list[bytes]:
        """Consume `data`; return every frame it completes, in order.

        Raises FrameError (and keeps raising it) on a length of 0 or above the bound;
        frames completed earlier in the same call are returned first and the error is
        raised by the next call. Bytes beyond a bad header are never buffered.
        """
        frames: list[bytes] = []
        view = memoryview(data)
        while view:
            target = self.want()
            count = min(len(target), len(view))
            target[:count] = view[:count]
            view = view[count:]
            try:
                payload = self.received(count)
            except FrameError:
                if frames:  # hand over the good frames; the error comes next call
                    return frames
                raise
            if payload is not None:
                frames.append(bytes(payload))
        if self._failed is not None and not frames:
            raise self._failed
        return frames

    def eof(self) -> None:
        """The peer closed: fine between frames, `bad_frame` inside one."""
        if self._failed is not None:
            raise self._failed
        if self._need is not None:
            raise FrameError(
                ErrorCode.BAD_FRAME,
                f"the peer closed after {self._have} of {self._need} frame bytes",
            )
        if self._have:
            raise FrameError(ErrorCode.BAD_FRAME, "the peer closed inside a frame header")


__all__ = [
    "HEADER",
    "REPLY_MAX",
    "REQUEST_MAX",
    "FrameDecoder",
    "FrameError",
    "encode_frame",
]
