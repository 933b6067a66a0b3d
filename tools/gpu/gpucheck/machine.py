"""What this machine has of what the check needs, said exactly.

The check runs on hosts that may lack root, loop devices (every slot is a filesystem
of its own, a loop-mounted image), Podman and runc (the job's container), a C compiler
(the provider's barrier is compiled when its wheel is built) or the GPU driver's
tools. It never installs anything: it names what is missing and runs the part that
needs none of it.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Machine:
    """What is present (each a reason string when missing, None when present)."""

    root: str | None
    loop: str | None
    podman: str | None
    compiler: str | None

    @property
    def daemon_missing(self) -> list[str]:
        """Why no daemon (and so no job) can run here, if anything."""
        return [why for why in (self.root, self.loop) if why]

    @property
    def podman_missing(self) -> list[str]:
        """Why the job cannot run in a Podman container here, if anything."""
        return [why for why in (*self.daemon_missing, self.podman, self.compiler) if why]


def look(*, without_podman: bool = False) -> Machine:
    """This machine, now (`without_podman`: as if Podman were not installed)."""
    root = None if os.geteuid() == 0 else "root (run it as root: accounts, cgroups, mounts)"
    loop = (
        None
        if Path("/dev/loop-control").exists()
        else "loop devices (`modprobe loop`: each slot is a loop-mounted filesystem)"
    )
    absent = [tool for tool in ("podman", "runc") if shutil.which(tool) is None]
    podman = f"{' and '.join(absent)} (`apt-get install podman runc`)" if absent else None
    if without_podman:
        podman = "Podman, left out (--without-podman)"
    compiler = (
        None
        if shutil.which("cc") or os.environ.get("FICC_PODMAN_WHEELS")
        else "a C compiler for the provider's barrier (`apt-get install gcc libc6-dev`), or"
        " FICC_PODMAN_WHEELS naming a directory with the provider's wheel built elsewhere"
    )
    return Machine(root, loop, podman, compiler)
