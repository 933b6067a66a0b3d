"""The real lease clock: the kernel's boot ID, CLOCK_BOOTTIME and the wall clock.

This is the only module of the lease logic that touches the system; `leases` takes
its readings as plain `Now` values.
"""

from __future__ import annotations

import os
import re
import time

from ficc.execution.host.core.codes import HostCode
from ficc.execution.host.core.errors import HostError
from ficc.execution.host.core.leases import BOOT_ID_PATTERN, Now

BOOT_ID_PATH = "/proc/sys/kernel/random/boot_id"
_BOOT_ID = re.compile(BOOT_ID_PATTERN)


def read_boot_id(path: str = BOOT_ID_PATH) -> str:
    """Read the boot ID; it is fixed for the life of this process, so read it once."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        try:
            raw = os.read(fd, 64)
        finally:
            os.close(fd)
    except OSError as error:
        raise HostError(
            HostCode.CLOCK_UNAVAILABLE,
            f"cannot read {path}: {error.strerror}; the host needs procfs",
        ) from None
    boot_id = raw.decode("ascii", "replace").strip()
    if not _BOOT_ID.match(boot_id):
        raise HostError(
            HostCode.CLOCK_UNAVAILABLE, f"{path} does not hold a boot ID: {boot_id[:40]!r}"
        )
    return boot_id


class BootClock:
    """Reads `Now` from the kernel: (boot ID, CLOCK_BOOTTIME, wall clock)."""

    def __init__(self, boot_id_path: str = BOOT_ID_PATH) -> None:
        self.boot_id = read_boot_id(boot_id_path)

    def now(self) -> Now:
        """One reading; boot time and wall time are taken back to back."""
        boottime_ns = time.clock_gettime_ns(time.CLOCK_BOOTTIME)
        wall_ns = time.time_ns()
        return Now(boot_id=self.boot_id, boottime_ns=boottime_ns, wall_ns=wall_ns)
