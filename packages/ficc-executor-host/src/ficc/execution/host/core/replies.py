"""How the daemon writes a reply: the wire's canonical JSON, with read data as base64.

The bytes are exactly `wire.encode_reply`'s (sorted keys, compact, standard padded
base64 for a collect row's `data`). One thing differs in how they are made: a collect
row's data, wrapped in `Base64Data`, is written as base64 by pybase64 (SIMD) rather
than by msgspec, which was most of the daemon's work per collect request (0.83 ms a
MiB here, against under 0.1 ms). Every reply the daemon sends, and every reply a test
encodes as the daemon would, goes through `REPLY_ENCODER` or `encode_reply` here.
"""

from __future__ import annotations

import threading
from typing import Any

import msgspec
import pybase64

from ficc.execution.protocol import COLLECT_MAX_BYTES
from ficc.execution.wire import AnyReply

__all__ = ["REPLY_ENCODER", "Base64Data", "encode_reply"]


class Base64Data:
    """A buffer that a reply row carries as its `data`, written out as base64 text.

    `len()` is the length of the bytes (a row's own checks count them), whatever the
    item format of a view, and the buffer is not copied until it is encoded.
    """

    __slots__ = ("buffer",)

    def __init__(self, buffer: bytes | memoryview) -> None:
        self.buffer = memoryview(buffer).cast("B")

    def __len__(self) -> int:
        return len(self.buffer)

    def __repr__(self) -> str:
        return f"Base64Data(<{len(self.buffer)} bytes>)"


_PIECE_BYTES = 3 * 16 * 1024
"""Bytes encoded per pybase64 call (a multiple of 3: only the last piece is padded).

Why pieces: pybase64 returns a new object, and the packaged unit has glibc map every
block of 1 MiB or more afresh (MALLOC_MMAP_THRESHOLD_): one 1.3 MiB result was
page-faulted in for every reply, which cost most of what pybase64 saves. A 64 KiB piece
of text is a heap block glibc reuses (below the 128 KiB it keeps before it trims the
heap: 256 KiB pieces were already trimmed and faulted in again each time), copied into
a text buffer each encoding thread keeps. 0.08 ms a MiB, against 0.6 ms whole.
"""

_TEXT_MAX = 2 + 4 * -(-COLLECT_MAX_BYTES // 3)
"""The quoted base64 text of the largest read (1 MiB)."""

_QUOTE = ord('"')


class _Text(threading.local):
    """Each encoding thread's text buffer (the event loop's, in the daemon)."""

    def __init__(self) -> None:
        self.buffer = bytearray(_TEXT_MAX)


_TEXT = _Text()


def _quoted_base64(source: memoryview) -> bytes | memoryview:
    """The bytes of `source` (a view of bytes, as `Base64Data` holds) as a JSON string
    of standard padded base64, in this thread's buffer.

    The view is valid until this thread encodes again; msgspec copies it into the
    frame before it asks for the next one.
    """
    length = 2 + 4 * -(-len(source) // 3)
    if length > _TEXT_MAX:  # never for a collect row (1 MiB at most); correct anyway
        return b'"' + pybase64.b64encode(source) + b'"'
    text = memoryview(_TEXT.buffer)
    text[0] = text[length - 1] = _QUOTE
    at = 1
    for start in range(0, len(source), _PIECE_BYTES):
        piece = pybase64.b64encode(source[start : start + _PIECE_BYTES])
        text[at : at + len(piece)] = piece
        at += len(piece)
    return text[:length]


def _as_json(value: Any) -> Any:
    if isinstance(value, Base64Data):
        return msgspec.Raw(_quoted_base64(value.buffer))
    raise TypeError(f"a reply cannot carry {type(value).__name__}")


REPLY_ENCODER = msgspec.json.Encoder(order="sorted", enc_hook=_as_json)
"""The canonical settings of `wire.encode_reply`, with `encode_into`, knowing `Base64Data`."""


def encode_reply(reply: AnyReply) -> bytes:
    """The reply's bytes exactly as the daemon sends them (without the frame header)."""
    return REPLY_ENCODER.encode(reply)
