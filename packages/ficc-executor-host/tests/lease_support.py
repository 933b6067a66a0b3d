"""A boot clock a test can move on at the exact point of an interleaving."""

from __future__ import annotations

from ficc.execution.host.core.leases import Now
from ficc.execution.host.linux.clock import BootClock

NS_PER_S = 1_000_000_000


class SteppedClock:
    """The real boot clock, `ahead` nanoseconds later (boot and wall time alike): a
    test moves time on where the race it reproduces lets time pass, instead of
    waiting for a real deadline."""

    def __init__(self) -> None:
        self._real = BootClock()
        self.boot_id = self._real.boot_id
        self.ahead = 0

    def now(self) -> Now:
        now = self._real.now()
        return Now(self.boot_id, now.boottime_ns + self.ahead, now.wall_ns + self.ahead)

    def advance(self, seconds: float) -> None:
        self.ahead += int(seconds * NS_PER_S)
