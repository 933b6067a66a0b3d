"""Waiting for a condition, never for a length of time.

A test that sleeps to win a race passes or fails by luck; every wait here polls a real
condition until it holds or a bound runs out, and the failure says what was awaited.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

WAIT_TIMEOUT = 60.0
"""The default bound of a wait, in seconds."""
POLL_INTERVAL = 0.05
"""The pause between two polls: short, so a wait ends soon after its condition holds."""


def wait_for(
    condition: Callable[[], T | None],
    what: str = "the condition",
    timeout: float = WAIT_TIMEOUT,
    interval: float = POLL_INTERVAL,
) -> T:
    """Poll `condition` until it returns something truthy, and return that.

    Raises AssertionError naming `what` once `timeout` seconds have passed without it.
    """
    deadline = time.monotonic() + timeout
    while True:
        result = condition()
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(interval)


def now_ms() -> int:
    """Wall-clock milliseconds since the epoch: the clock leases' `expires_at_ms` use."""
    return time.time_ns() // 1_000_000
