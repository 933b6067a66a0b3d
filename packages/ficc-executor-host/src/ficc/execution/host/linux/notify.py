"""sd_notify(3) without libsystemd: READY=1, STOPPING=1, STATUS=..., WATCHDOG=1.

Under a `Type=notify` unit systemd passes `NOTIFY_SOCKET`: a datagram socket path,
or an abstract-namespace name written with a leading `@`. Outside systemd the variable
is unset and every call is a no-op, so the same daemon runs in a terminal or a test.
The integration tests use a datagram socket of their own to wait for READY=1.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Callable

ENV = "NOTIFY_SOCKET"


def _address(value: str) -> str:
    if value.startswith("@"):
        return "\0" + value[1:]  # abstract namespace
    if value.startswith("/"):
        return value
    raise ValueError(f"{ENV}={value!r} is neither an absolute path nor an @abstract name")


def notify(*assignments: str) -> bool:
    """Send `KEY=value` lines in one datagram; False when not under a notify supervisor.

    Raises OSError (or ValueError for a malformed NOTIFY_SOCKET) when a supervisor is
    named but cannot be told: under systemd that would end in a start timeout, so the
    caller should know.
    """
    value = os.environ.get(ENV)
    if not value:
        return False
    message = "\n".join(assignments).encode()
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
        sock.connect(_address(value))
        sock.sendall(message)
    return True


def ready(status: str) -> bool:
    return notify("READY=1", f"STATUS={status}")


def stopping(status: str) -> bool:
    return notify("STOPPING=1", f"STATUS={status}")


def watchdog() -> bool:
    return notify("WATCHDOG=1")


def watchdog_interval() -> float | None:
    """Seconds between WATCHDOG=1 pings (half the configured timeout), or None.

    systemd sets WATCHDOG_USEC (and WATCHDOG_PID, which must be this process) when the
    unit has `WatchdogSec=`.
    """
    usec = os.environ.get("WATCHDOG_USEC", "")
    pid = os.environ.get("WATCHDOG_PID", "")
    if not usec.isdigit() or int(usec) == 0:
        return None
    if pid and (not pid.isdigit() or int(pid) != os.getpid()):
        return None
    return int(usec) / 2_000_000


class Heartbeat:
    """WATCHDOG=1 from the monitor: called after every completed monitor tick, it pings
    at most once per `interval` (half of WatchdogSec).

    The ping proves more than a responsive event loop: the monitor is what enforces
    leases and stops, so if its ticks stop completing (a wedged loop, a call that never
    returns) the pings stop, and systemd kills and restarts the daemon. That is safe:
    a restart never replays work. With no watchdog configured (`interval` None) this
    does nothing.
    """

    def __init__(self, interval: float | None, clock: Callable[[], float] = time.monotonic) -> None:
        self._interval = interval
        self._clock = clock
        self._last: float | None = None

    @classmethod
    def from_environment(cls) -> Heartbeat:
        return cls(watchdog_interval())

    def beat(self) -> None:
        if self._interval is None:
            return
        now = self._clock()
        if self._last is not None and now - self._last < self._interval:
            return
        self._last = now
        try:
            watchdog()
        except (OSError, ValueError) as error:  # systemd will restart us; say why
            logging.getLogger(__name__).error("watchdog_failed: %s", error)


__all__ = ["ENV", "Heartbeat", "notify", "ready", "stopping", "watchdog", "watchdog_interval"]


def systemd_is_init() -> bool:
    """Whether this host was booted with systemd as its init (sd_booted(3)'s test), so
    advice may name `systemctl` and `journalctl`."""
    return os.path.isdir("/run/systemd/system")
