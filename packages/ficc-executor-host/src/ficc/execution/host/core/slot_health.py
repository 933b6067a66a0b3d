"""Each slot's health, as its checks last found it: the rule of taking a slot out of the
offer and bringing it back.

A slot whose checks fail (its filesystem, its mount, its account, its layout) is out of
service: admission places nothing in it, the snapshot does not count it usable, and it
stays out until a check passes again. Without this a slot whose filesystem went away
under a running daemon still looked free, every prepare sent there failed at once and
freed it again, and a controller kept pouring its jobs into it.

`HealthBook` is pure: the caller runs the checks (off the event loop) and records what
each found, with the wall-clock time. `record` returns a `Change` exactly when a slot
goes out of service or comes back, so the daemon logs each transition once and never a
check that merely found the same again. The book has one writer, the event loop; the
readers take copies (`broken`, `state`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

__all__ = ["Change", "HealthBook", "SlotHealth"]


@dataclass(frozen=True)
class SlotHealth:
    """One slot's health: `reason` (the failed check's code) and `message` (what the
    administrator must do) are None while it is healthy. `since_ms`: when it entered
    this state; `checked_ms`: when a check last looked (None: not since the start)."""

    reason: str | None
    message: str | None
    since_ms: int
    checked_ms: int | None = None

    @property
    def healthy(self) -> bool:
        return self.reason is None


class Change(NamedTuple):
    """A slot went out of service (`broken` true, with the reason) or came back."""

    slot_id: str
    broken: bool
    reason: str | None
    message: str | None


class HealthBook:
    """The health of every slot of one daemon (see the module docstring).

    A slot the book has not seen fail is healthy since `started_ms` (the daemon's start:
    `serve` refuses to start with a slot that fails its checks).
    """

    def __init__(self, started_ms: int) -> None:
        self._started_ms = started_ms
        self._slots: dict[str, SlotHealth] = {}

    def state(self, slot_id: str) -> SlotHealth:
        """The slot's health now."""
        return self._slots.get(slot_id) or SlotHealth(None, None, self._started_ms)

    def record(self, slot_id: str, refusal: tuple[str, str] | None, now_ms: int) -> Change | None:
        """What one check of the slot found: None (it passed) or the refusal's (code,
        message). Returns the change when the slot's state changed, else None (a
        broken slot that fails again with another reason keeps its `since_ms`, and
        its new reason, without a change)."""
        before = self.state(slot_id)
        reason, message = refusal if refusal is not None else (None, None)
        changed = before.healthy != (reason is None)
        since = now_ms if changed else before.since_ms
        self._slots[slot_id] = SlotHealth(reason, message, since, now_ms)
        if not changed:
            return None
        return Change(slot_id, reason is not None, reason, message)

    def broken(self) -> dict[str, str]:
        """The slots out of service now, each with its reason (a copy)."""
        return {
            slot_id: health.reason
            for slot_id, health in self._slots.items()
            if health.reason is not None
        }
