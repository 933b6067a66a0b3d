"""What both service backends need to start a service and check its first process.

The cgroupfs backend and the systemd backend launch the same start shim, as the same
slot account, writing to the same output files; the checks that the shim runs where
and as whom it should are therefore one code, here.
"""

from __future__ import annotations

import os
import stat
import time
from collections.abc import Callable

from ficc.execution.host.core.codes import HostCode
from ficc.execution.host.core.errors import HostError
from ficc.execution.host.linux import procfs
from ficc.execution.host.service.interface import ServiceSpec

#: The shim's interpreter: it runs as the slot account, so it must be a system-wide,
#: root-owned Python (a daemon virtualenv under /root would not be executable).
DEFAULT_INTERPRETER = "/usr/bin/python3"


def open_output(path: str) -> int:
    """Open (creating root-owned 0600) a regular output file, never through a link.

    O_NONBLOCK keeps a planted FIFO from blocking the open; it is cleared after the
    file is known to be regular.
    """
    flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open(path, flags | os.O_NONBLOCK, 0o600)
    except OSError as error:
        raise HostError(
            HostCode.SERVICE_OUTPUT, f"cannot open output file {path}: {error}"
        ) from error
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode) or info.st_nlink != 1 or info.st_uid != os.geteuid():
        os.close(fd)
        raise HostError(
            HostCode.SERVICE_OUTPUT,
            f"{path} is not a regular, singly linked file owned by the daemon; remove it",
        )
    os.set_blocking(fd, True)
    return fd


def trusted_interpreter(path: str) -> str:
    """Resolve the shim interpreter and refuse one that someone else could replace."""
    real = os.path.realpath(path)
    try:
        info = os.stat(real)
    except OSError as error:
        raise HostError(
            HostCode.SERVICE_UNSUPPORTED, f"shim interpreter {path}: {error}"
        ) from error
    if not stat.S_ISREG(info.st_mode) or info.st_uid != 0 or info.st_mode & 0o022:
        raise HostError(
            HostCode.SERVICE_UNSUPPORTED,
            f"shim interpreter {real} must be a regular file owned by root and writable "
            "only by root",
        )
    return real


def check_credentials(pid: int, spec: ServiceSpec, *, groups: frozenset[str]) -> None:
    """The gated shim must already be exactly the slot account, with core dumps off and
    no supplementary group beyond `groups` (GIDs as /proc prints them). The cgroupfs
    shim has none; systemd gives `User=` the account's group list, which for a slot
    account is just its own primary GID: that grants nothing more, and the payload
    gate accepts it too."""
    status = procfs.status_fields(pid)
    uids, gids = status["Uid"].split(), status["Gid"].split()
    limits = procfs.limit_fields(pid)
    problems = []
    if uids != [str(spec.uid)] * 4 or gids != [str(spec.gid)] * 4:
        problems.append(f"credentials uid={uids} gid={gids}")
    if set(status["Groups"].split()) - groups:
        problems.append(f"supplementary groups {status['Groups']!r}")
    if limits.get("Max core file size") != ("0", "0"):
        problems.append(f"core limit {limits.get('Max core file size')}")
    nofile = str(spec.limits.nofile)
    if limits.get("Max open files") != (nofile, nofile):
        problems.append(f"nofile limit {limits.get('Max open files')}")
    if problems:
        raise HostError(
            HostCode.SERVICE_START,
            f"the start shim of {spec.name} is not confined as planned: {', '.join(problems)}",
        )


def wait_until(condition: Callable[[], bool], deadline: float) -> bool:
    """Poll `condition()` every 5 ms until true or the monotonic deadline passes."""
    while True:
        if condition():
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.005)
