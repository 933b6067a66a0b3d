"""The daemon's view of its slots' health: the checks, where they run, what they log.

A slot's health check is `SlotFiles.check()` (storage/slot_files.py): the checks `serve`
runs at startup and before an attempt's storage is used, of the slot as a whole. The
daemon runs it for every slot on its own schedule (`slot_check_seconds`, daemon/root.py)
and at once on the administrator's `check_slots`; the runner records what an attempt's
own check of its slot found (a slot that broke between two scheduled checks is known at
the first attempt that meets it). The rule is `core.slot_health.HealthBook`.

Where it runs: each slot's check is blocking file I/O, so it runs in the daemon's I/O
threads, one slot at a time (the pool stays free for staging and collect), never on the
event loop. It only reads (and allocates an image's holes again, as each attempt's own
check does), and it accepts a directory the host is making right now, so it never
races an attempt's own use of its slot. One round runs at a time: an administrator's
request waits for a scheduled round under way, then checks again, so a check that began
before a repair never overwrites one made after it.

Each transition is one JSON log line: `slot_out_of_service` (warning: `slot`, `class`,
`code`, `message`) when a slot goes, `slot_in_service` (info) when it comes back.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING

from ficc.execution.host.core.codes import HostCode
from ficc.execution.host.core.errors import HostError
from ficc.execution.host.core.slot_health import Change, HealthBook
from ficc.execution.host.core.slot_health import SlotHealth as Health
from ficc.execution.host.storage.slot_files import SlotFiles

if TYPE_CHECKING:  # parts holds a SlotHealth in its HostContext
    from ficc.execution.host.context.parts import SlotRuntime, Workers

__all__ = ["SLOT_REFUSALS", "Health", "SlotHealth", "refusal_of"]

_log = logging.getLogger(__name__)

SLOT_REFUSALS = frozenset({HostCode.SLOT_FILESYSTEM, HostCode.SLOT_IDENTITY})
"""Refusals of an attempt's own check of its slot that say the slot itself is broken."""


def _now_ms() -> int:
    return time.time_ns() // 1_000_000


def refusal_of(files: SlotFiles) -> HostError | None:
    """Run the slot's health check (in an I/O thread); its refusal, or None."""
    try:
        files.check()
    except HostError as error:
        return error
    return None


class SlotHealth:
    """Every slot's health in the running daemon (see the module docstring). Used on
    the event loop only."""

    def __init__(self) -> None:
        self.book = HealthBook(_now_ms())
        self._round = asyncio.Lock()
        self._provider_found: dict[str, HostError] = {}

    async def check(
        self, workers: Workers, slots: Iterable[SlotRuntime], *, administrator: bool = False
    ) -> None:
        """Check each slot now and record what each check found. The administrator's
        request also forgets what a provider found (the administrator says it is
        repaired; the provider's next prepare there tells again if it is not)."""
        async with self._round:
            for slot in slots:
                if administrator:
                    self._provider_found.pop(slot.id, None)
                self.record(slot, await workers.io(refusal_of, slot.files))

    def record(self, slot: SlotRuntime, refusal: HostError | None) -> None:
        """What a check of `slot` found (or, when it passes, what its provider found and
        the administrator has not yet checked again); logs the change if its state
        changed."""
        refusal = refusal or self._provider_found.get(slot.id)
        found = None if refusal is None else (str(refusal.code), refusal.message)
        change = self.book.record(slot.id, found, _now_ms())
        if change is not None:
            _log_change(slot, change)

    def attempt_found(self, slot: SlotRuntime, error: HostError) -> None:
        """An attempt's own check of its slot refused: the slot is broken if the
        refusal says so (a full slot, say, is the attempt's affair, not the slot's)."""
        if error.code in SLOT_REFUSALS:
            self.record(slot, error)

    def provider_found(self, slot: SlotRuntime, code: str, message: str) -> None:
        """The slot's provider refused because it cannot reset its part of the slot's
        files (`sdk.SLOT_FILES_STUCK`): every job placed there would fail the same way,
        and the host's own checks cannot see it, so the slot stays out of the offer
        until the administrator's check (`ficc-executor check-slots`)."""
        self._provider_found[slot.id] = HostError(code, message)
        self.record(slot, None)

    def broken(self) -> dict[str, str]:
        """The slots out of service now, each with its reason."""
        return self.book.broken()

    def states(self, slot_ids: Iterable[str]) -> dict[str, Health]:
        """The health of each slot now (a copy: a reader in another thread takes it)."""
        return {slot_id: self.book.state(slot_id) for slot_id in slot_ids}


def _log_change(slot: SlotRuntime, change: Change) -> None:
    fields = {"slot": slot.id, "class": slot.slot_class}
    if change.broken:
        _log.warning(
            "slot %s is out of service: %s: %s",
            slot.id,
            change.reason,
            change.message,
            extra={
                "fields": {
                    "event": "slot_out_of_service",
                    **fields,
                    "code": change.reason,
                    "message": change.message,
                }
            },
        )
    else:
        _log.info(
            "slot %s is back in service: its checks pass again",
            slot.id,
            extra={"fields": {"event": "slot_in_service", **fields}},
        )
