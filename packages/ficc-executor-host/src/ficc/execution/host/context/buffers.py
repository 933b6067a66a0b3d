"""Buffers the daemon reuses, and the one rule for reusing a buffer safely.

Why reuse at all: the packaged unit has glibc map every block of 1 MiB or more afresh
(MALLOC_MMAP_THRESHOLD_, so freed memory returns to the system), and a fresh buffer of
a few MiB costs hundreds of page faults, as much here as the work done with it. The
rule: a buffer is handed out again only when no view of it is alive (`unviewed`), so
nothing that still reads a request's frame or a reply's data can see it overwritten.
"""

from __future__ import annotations

import asyncio
import threading

from ficc.execution.frames import HEADER, REPLY_MAX

__all__ = [
    "KEPT_REQUEST_BYTES",
    "KEPT_REQUEST_IDLE_S",
    "ReadBuffers",
    "ReplyBuffers",
    "RequestBuffers",
    "unviewed",
]

KEPT_REQUEST_BYTES = 1 << 20
"""Request frames of at least this many bytes are received into a kept buffer."""
KEPT_REQUEST_IDLE_S = 5.0
"""A kept request buffer is dropped after this long without a large frame."""
_REPLY_BUFFER_MAX = 2 * (HEADER.size + REPLY_MAX)
"""Largest allocation a kept reply buffer may have (the encoder grows by doubling)."""


def unviewed(buffer: bytearray) -> bool:
    """Whether no view of `buffer` is alive (resizing it is refused while one is)."""
    try:
        buffer.append(0)
    except BufferError:
        return False
    del buffer[-1]
    return True


class ReadBuffers:
    """Reused buffers of `size` bytes to read into, safe to use from any thread.

    Why: the packaged unit makes malloc map every block of 1 MiB or more afresh
    (MALLOC_MMAP_THRESHOLD_), so a fresh 1 MiB `bytes` per read costs more in page
    faults than copying the data from the page cache. A buffer is handed out again
    only once no view of it is left, i.e. once the reply holding it was encoded and
    dropped; Python keeps that count already, since a bytearray refuses to resize
    while a view of it exists. At most `keep` buffers are kept (resident); past that,
    and for small reads, a read gets a fresh buffer of its own length.
    """

    def __init__(self, size: int, keep: int) -> None:
        self.size = size
        self._keep = keep
        self._kept: list[bytearray] = []
        self._lock = threading.Lock()

    def view(self, length: int) -> memoryview:
        """A writable view of `length` (<= size) bytes that no one else is using."""
        if not 0 <= length <= self.size:
            raise ValueError(f"a read of {length} bytes does not fit buffers of {self.size}")
        if length < self.size // 16:  # cheap to allocate; it would only hold a kept buffer
            return memoryview(bytearray(length))
        with self._lock:  # the view exists before another thread tests the same buffer
            for buffer in self._kept:
                if unviewed(buffer):
                    return memoryview(buffer)[:length]
            if len(self._kept) < self._keep:
                self._kept.append(bytearray(self.size))
                return memoryview(self._kept[-1])[:length]
        return memoryview(bytearray(length))


class ReplyBuffers:
    """Reply frames are encoded into reused buffers, at most `keep` of them kept idle.

    A collect reply is 1.4 MB: a fresh buffer per reply would cost some 350 page faults,
    several times what writing its base64 costs now. Kept buffers stay resident: at
    most `keep` times `_REPLY_BUFFER_MAX` bytes. Event-loop thread only.
    """

    def __init__(self, keep: int) -> None:
        self._keep = keep
        self._idle: list[bytearray] = []

    def take(self) -> bytearray:
        return self._idle.pop() if self._idle else bytearray()

    def give_back(self, buffer: bytearray) -> None:
        """Keep `buffer` for a later reply; only once nothing refers to its bytes."""
        if len(self._idle) < self._keep and buffer.__alloc__() <= _REPLY_BUFFER_MAX:
            self._idle.append(buffer)


class RequestBuffers:
    """Large request frames are received into one kept buffer, dropped when idle.

    Why: a fresh buffer for each 10.7 MB `input_write` frame (an 8 MiB chunk) costs
    some 2,700 page faults under the packaged unit's malloc settings, about 8 ms here,
    a tenth of the chunk's whole time in the daemon. One buffer of at least
    `smallest` bytes is kept after its request is done, handed out again only once no
    view of it is left (a received chunk's rows hold views until they let go of the
    frame), and dropped `idle_s` after the last large frame, so a daemon between
    streams holds none. Event-loop thread only.
    """

    def __init__(self, smallest: int, idle_s: float) -> None:
        self._smallest = smallest
        self._idle_s = idle_s
        self._kept: bytearray | None = None
        self._drop: asyncio.TimerHandle | None = None

    @property
    def holding(self) -> int:
        """Bytes kept now (0 once dropped)."""
        return len(self._kept) if self._kept is not None else 0

    def take(self, length: int) -> bytearray:
        """A buffer of exactly `length` bytes (stale ones: the frame overwrites them)."""
        if length < self._smallest:
            return bytearray(length)
        kept, self._kept = self._kept, None
        if kept is None or not unviewed(kept):
            return bytearray(length)
        if len(kept) > length:
            del kept[length:]
        elif len(kept) < length:
            kept.extend(bytes(length - len(kept)))
        return kept

    def give_back(self, buffer: bytearray | None) -> None:
        """Keep `buffer` (its request is done) until `idle_s` passes without another."""
        if buffer is None or len(buffer) < self._smallest:
            return
        self._kept = buffer
        if self._drop is not None:
            self._drop.cancel()
        self._drop = asyncio.get_running_loop().call_later(self._idle_s, self._forget)

    def _forget(self) -> None:
        self._kept = self._drop = None
