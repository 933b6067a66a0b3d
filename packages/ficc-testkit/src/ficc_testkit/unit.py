"""The process settings of the shipped systemd unit, so every test runs the daemon as
production does.

A daemon started by a test inherits the test's umask (usually 0022), its environment
(HOME, LANG, a venv's PATH, PYTHON* variables), its working directory and its limits.
Under the shipped unit it gets none of these: systemd starts it with `UMask=0077`, a
clean environment (PATH and what the unit's `Environment=` lines add, no HOME), `/` as
its working directory, the unit's `Limit*=` values and Python's isolated mode (`-I`).
A test that passes only because its daemon had a kinder umask proves nothing, so the
test kit reads these settings from the unit file itself (never from a copy of them)
and starts every daemon with them.
"""

from __future__ import annotations

import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path

UNIT = "ficc-executor-host.service"
SYSTEMD_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
"""The PATH systemd gives a system service (its compiled-in default)."""

LIMITS = {"LimitNOFILE": "nofile", "LimitCORE": "core"}
"""The unit's `Limit*=` settings the kit applies, and prlimit's name for each."""


@dataclass(frozen=True)
class UnitSettings:
    """What the shipped unit sets for the daemon's process."""

    umask: int
    environment: dict[str, str] = field(default_factory=dict)
    limits: dict[str, str] = field(default_factory=dict)
    python_flags: tuple[str, ...] = ()

    def command(self, python: str, *arguments: str) -> list[str]:
        """`python -m ficc.execution ARGUMENTS` under the unit's limits (prlimit execs
        the daemon, so the PID is the daemon's own)."""
        limits = [f"--{LIMITS[key]}={value}:{value}" for key, value in self.limits.items()]
        wrapper = ["prlimit", *limits, "--"] if limits else []
        return [*wrapper, python, *self.python_flags, "-m", "ficc.execution", *arguments]

    def process_environment(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        """The daemon's whole environment: systemd's PATH, the unit's `Environment=`
        lines, then `extra` (a test's own additions, such as NOTIFY_SOCKET)."""
        return {"PATH": SYSTEMD_PATH, **self.environment, **(extra or {})}


def parse_unit(text: str) -> UnitSettings:
    """The `[Service]` settings of a unit file that shape the daemon's process."""
    umask: int | None = None
    environment: dict[str, str] = {}
    limits: dict[str, str] = {}
    flags: tuple[str, ...] = ()
    section = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            section = line
            continue
        if section != "[Service]" or "=" not in line:
            continue
        key, value = (part.strip() for part in line.split("=", 1))
        if key == "UMask":
            umask = int(value, 8)
        elif key == "Environment":
            for assignment in shlex.split(value):
                name, _, setting = assignment.partition("=")
                environment[name] = setting
        elif key in LIMITS:
            limits[key] = value
        elif key == "ExecStart" and value:
            flags = _python_flags(shlex.split(value))
    if umask is None:
        raise ValueError("the unit sets no UMask= (systemd would use 0022); set one")
    return UnitSettings(umask, environment, limits, flags)


def _python_flags(argv: list[str]) -> tuple[str, ...]:
    """The interpreter options between the Python and `-m` in an ExecStart= line."""
    if "-m" not in argv:
        return ()
    return tuple(arg for arg in argv[1 : argv.index("-m")] if arg.startswith("-"))


def shipped_unit_file(root: Path | None = None) -> Path:
    """The unit file ficc-executor-host ships: in the repository at `root` (or the one
    this kit sits in), else where its installed wheel put it (`share/ficc-executor-host/`
    under the environment)."""
    for candidate in (root, Path(__file__).resolve().parents[4]):
        if candidate is None:
            continue
        packaged = candidate / "packages" / "ficc-executor-host" / "packaging" / UNIT
        if packaged.exists():
            return packaged
    return Path(sys.prefix) / "share" / "ficc-executor-host" / UNIT


def shipped_settings(root: Path | None = None) -> UnitSettings:
    """The shipped unit's settings (see the module docstring)."""
    return parse_unit(shipped_unit_file(root).read_text())
