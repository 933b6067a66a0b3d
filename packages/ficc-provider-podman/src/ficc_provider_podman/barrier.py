"""The installed trusted barrier: where it is, what it is, and how it exits.

The host's payload gate compares the live payload's `/proc/PID/exe` with the
barrier's recorded identity, so the provider records that identity at prepare
time from the file this module names.
"""

from __future__ import annotations

import enum
import os
import pathlib
import struct

BARRIER = pathlib.Path(__file__).resolve().parent / "_bin" / "ficc-barrier"

_PT_INTERP = 3
_ELF_MAGIC = b"\x7fELF"


class BarrierExit(enum.IntEnum):
    """The barrier's own exit codes. 119-123 are the barrier's alone; 126 and 127 are
    a shell's codes for a program that cannot be executed or does not exist, which the
    barrier uses when the payload's `execve` fails (after one `EXEC_FAILURE` line on
    stderr) and a payload may use too. Anything else is the payload's."""

    PROBE_FAILED = 119
    USAGE = 120
    MARKER_UNSAFE = 121
    MARKER_TOKEN = 122
    WAIT_FAILED = 123
    EXEC_DENIED = 126
    EXEC_MISSING = 127


EXEC_FAILURE = "ficc-barrier: cannot execute {path}: {reason} (errno {errno})"
"""The line the barrier writes to stderr when the payload's `execve` fails."""


class BarrierMissing(RuntimeError):
    """The barrier was not built into this installation."""


def barrier_path() -> pathlib.Path:
    """The installed barrier; refuses a link or a missing file."""
    try:
        st = os.lstat(BARRIER)
    except FileNotFoundError:
        raise BarrierMissing(
            f"{BARRIER} is missing: reinstall ficc-provider-podman from a wheel built "
            "on this machine (the build compiles the barrier; it needs a C compiler)"
        ) from None
    if not os.path.isfile(BARRIER) or os.path.islink(BARRIER) or st.st_nlink != 1:
        raise BarrierMissing(f"{BARRIER} is not a plain regular file; reinstall the provider")
    return BARRIER


def has_dynamic_loader(path: os.PathLike[str] | str) -> bool:
    """True when the ELF file asks for a program interpreter (PT_INTERP).

    A static barrier has none, so nothing outside the file itself runs before it.
    Only 64-bit little-endian ELF is accepted; anything else counts as unsafe.
    """
    with open(path, "rb") as f:
        header = f.read(64)
        if len(header) < 64 or header[:4] != _ELF_MAGIC or header[4] != 2 or header[5] != 1:
            return True
        (phoff,) = struct.unpack_from("<Q", header, 0x20)
        phentsize, phnum = struct.unpack_from("<HH", header, 0x36)
        f.seek(phoff)
        table = f.read(phentsize * phnum)
    if len(table) != phentsize * phnum:
        return True
    return any(
        struct.unpack_from("<I", table, i * phentsize)[0] == _PT_INTERP for i in range(phnum)
    )
