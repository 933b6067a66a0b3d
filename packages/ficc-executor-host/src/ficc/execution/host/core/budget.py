"""The request bytes the daemon buffers at once, and who may take them (pure).

A request frame's payload is received into one buffer of its declared length, so
the declared length is what a frame costs from its header on: it is reserved before
the buffer exists, and given back when the frame is done. Two rules keep any peer
from holding that memory against the others:

- **Pools by socket kind.** The transport's connections share the transport pool;
  the local owners' share theirs; the administrator's socket has a pool of its own.
  However many 12 MiB frames the transport announces, the administrator can still
  send any one request (`snapshot`, `set_offer`, `metrics`, `reconcile_absent`).
- **Progress.** A reservation is kept only while its bytes arrive: after a short
  grace, a frame must have received at least `min_rate` bytes per second since its
  header. A peer that announces a large frame and trickles loses its reservation
  (and its connection) within seconds, long before the 30 s read timeout. Over a
  local socket a real client sends a whole 12 MiB frame in milliseconds.

The server (the I/O shell) asks `take`, `give` and `too_slow`; nothing here reads a
socket or a clock.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from ficc.execution.host.core.authority import SocketKind


@dataclass(frozen=True)
class Progress:
    """The rule a reserved frame's arrival must keep (see the module docstring)."""

    grace_s: float = 2.0
    min_rate: float = 1024 * 1024

    def too_slow(self, received: int, elapsed_s: float) -> bool:
        """Whether `received` payload bytes `elapsed_s` after the header are too few."""
        return elapsed_s > self.grace_s and received < self.min_rate * (elapsed_s - self.grace_s)


class RequestBudget:
    """Reservations of request bytes, one pool per socket kind."""

    def __init__(self, pools: Mapping[SocketKind, int]) -> None:
        self._free = dict(pools)

    def take(self, kind: SocketKind, length: int) -> bool:
        """Reserve `length` bytes from `kind`'s pool; False when it has not that room."""
        if self._free[kind] < length:
            return False
        self._free[kind] -= length
        return True

    def give(self, kind: SocketKind, length: int) -> None:
        """Return a reservation made by `take`."""
        self._free[kind] += length

    def free(self, kind: SocketKind) -> int:
        return self._free[kind]


__all__ = ["Progress", "RequestBudget"]
