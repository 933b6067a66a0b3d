"""Frames: a 4-byte unsigned big-endian length, then that many bytes of UTF-8 JSON.

`FrameDecoder` is sans-I/O: feed it whatever bytes arrived, get back the complete
frames. It refuses length 0 and any length above its bound as soon as it has seen the
four length bytes, so it never buffers more than 4 + bound bytes, whatever a peer
sends. The asyncio helpers below are thin shells over it for one-frame exchanges.
"""

from __future__ import annotations

import asyncio
import struct
from typing import Any, Protocol

from ficc.execution.errors import ErrorCode, ProtocolError

MIB = 1024 * 1024
REQUEST_MAX = 12 * MIB
"""Largest request payload."""
REPLY_MAX = 2 * MIB
"""Largest reply payload."""
HEADER = struct.Struct(">I")


class FrameError(ProtocolError):
    """A framing failure: `bad_frame` (length 0, truncated) or `frame_too_large`."""


def check_length(length: int, max_length: int) -> None:
    """Refuse a declared length before a single payload byte is buffered."""
    if length == 0:
        raise FrameError(ErrorCode.BAD_FRAME, "a frame has length 0")
    if length > max_length:
        raise FrameError(
            ErrorCode.FRAME_TOO_LARGE, f"a frame of {length} bytes is over the {max_length} bound"
        )


def encode_frame(payload: bytes, max_length: int) -> bytes:
    """Length prefix + payload; refuses an empty or oversized payload."""
    check_length(len(payload), max_length)
    return HEADER.pack(len(payload)) + payload


class EncodesInto(Protocol):
    """What `encode_frame_into` needs of an encoder (a `msgspec.json.Encoder` has it)."""

    def encode_into(self, obj: Any, buffer: bytearray, offset: int = 0, /) -> None: ...


def encode_frame_into(
    encoder: EncodesInto, value: object, buffer: bytearray, max_length: int
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
    check_length(length, max_length)
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
    """Incremental decoder. After an error it stays failed: the stream is unusable."""

    def __init__(self, max_length: int) -> None:
        if not 1 <= max_length <= 0xFFFFFFFF:
            raise ValueError("max_length must fit the 4-byte length")
        self.max_length = max_length
        self._buffer = bytearray()
        self._need: int | None = None  # payload length once the header is read
        self._failed: FrameError | None = None

    @property
    def buffered(self) -> int:
        """Bytes held now; never more than 4 + max_length."""
        return len(self._buffer)

    @property
    def idle(self) -> bool:
        """True between frames: EOF here is clean, anywhere else is truncation."""
        return not self._buffer and self._need is None

    def feed(self, data: bytes) -> list[bytes]:
        """Consume `data`; return every frame it completes, in order.

        Raises FrameError (and keeps raising it) on a length of 0 or above the bound;
        frames completed earlier in the same call are returned first and the error is
        raised by the next call. Bytes beyond a bad header are never buffered.
        """
        if self._failed is not None:
            raise self._failed
        frames: list[bytes] = []
        view = memoryview(data)
        while view:
            if self._need is None:
                take = 4 - len(self._buffer)
                self._buffer += view[:take]
                view = view[take:]
                if len(self._buffer) < 4:
                    break
                (length,) = HEADER.unpack(self._buffer)
                self._buffer.clear()
                try:
                    check_length(length, self.max_length)
                except FrameError as exc:
                    self._failed = exc
                    if frames:  # hand over the good frames; the error comes next call
                        return frames
                    raise
                self._need = length
            take = self._need - len(self._buffer)
            self._buffer += view[:take]
            view = view[take:]
            if len(self._buffer) == self._need:
                frames.append(bytes(self._buffer))
                self._buffer.clear()
                self._need = None
        return frames

    def eof(self) -> None:
        """The peer closed: fine between frames, `bad_frame` inside one."""
        if self._failed is not None:
            raise self._failed
        if self._need is not None:
            raise FrameError(
                ErrorCode.BAD_FRAME,
                f"the peer closed after {len(self._buffer)} of {self._need} frame bytes",
            )
        if self._buffer:
            raise FrameError(ErrorCode.BAD_FRAME, "the peer closed inside a frame header")


async def read_frame(reader: asyncio.StreamReader, max_length: int, timeout: float) -> bytes:
    """Read exactly one frame within `timeout` seconds.

    Raises FrameError (bad length, or `bad_frame` when the peer closes mid-frame),
    EOFError when the peer closes before any byte, TimeoutError on timeout.
    """
    async with asyncio.timeout(timeout):
        try:
            header = await reader.readexactly(4)
        except asyncio.IncompleteReadError as exc:
            if not exc.partial:
                raise EOFError("the peer closed the connection without a frame") from None
            raise FrameError(ErrorCode.BAD_FRAME, "the peer closed inside a frame header") from None
        (length,) = HEADER.unpack(header)
        check_length(length, max_length)
        try:
            return await reader.readexactly(length)
        except asyncio.IncompleteReadError as exc:
            raise FrameError(
                ErrorCode.BAD_FRAME,
                f"the peer closed after {len(exc.partial)} of {length} frame bytes",
            ) from None


async def write_frame(
    writer: asyncio.StreamWriter, payload: bytes, max_length: int, timeout: float
) -> None:
    """Write one frame and wait until it is flushed, within `timeout` seconds."""
    frame = encode_frame(payload, max_length)
    async with asyncio.timeout(timeout):
        writer.write(frame)
        await writer.drain()


__all__ = [
    "HEADER",
    "REPLY_MAX",
    "REQUEST_MAX",
    "EncodesInto",
    "FrameDecoder",
    "FrameError",
    "check_length",
    "encode_frame",
    "encode_frame_into",
    "read_frame",
    "write_frame",
]
