"""Every suite runs the daemon as the shipped unit runs it.

A test that passes only because its daemon inherited the test's umask (0022), HOME,
working directory or limits proves nothing about a host running the shipped unit
(UMask=0077, a clean environment, `/`, LimitNOFILE=16384, LimitCORE=0, `python -I`).
The kit reads those settings from the unit file; this checks the live daemon got them.
"""

from __future__ import annotations

import os
from pathlib import Path

from ficc_testkit.host import Daemon
from ficc_testkit.unit import SYSTEMD_PATH, shipped_settings


def _status(pid: int) -> dict[str, str]:
    lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    return dict(line.split(":\t", 1) for line in lines if ":\t" in line)


def _environment(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    pairs = (item.decode().split("=", 1) for item in raw if b"=" in item)
    return dict((name, value) for name, value in pairs)


def _limit(pid: int, name: str) -> str:
    for line in Path(f"/proc/{pid}/limits").read_text().splitlines():
        if line.startswith(name):
            return line.split()[len(name.split())]
    raise AssertionError(f"no {name} in /proc/{pid}/limits")


def test_the_daemon_runs_with_the_shipped_units_umask_environment_and_limits(
    daemon: Daemon,
) -> None:
    pid = daemon.process.pid
    settings = shipped_settings()
    assert int(_status(pid)["Umask"], 8) == settings.umask == 0o077
    environment = _environment(pid)
    assert environment["PATH"] == SYSTEMD_PATH
    assert environment["MALLOC_MMAP_THRESHOLD_"] == settings.environment["MALLOC_MMAP_THRESHOLD_"]
    for inherited in ("HOME", "LANG", "PYTHONPATH", "VIRTUAL_ENV", "PYTEST_CURRENT_TEST"):
        assert inherited not in environment, inherited
    assert os.readlink(f"/proc/{pid}/cwd") == "/"
    assert _limit(pid, "Max open files") == settings.limits["LimitNOFILE"]
    assert _limit(pid, "Max core file size") == settings.limits["LimitCORE"]
    command = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    assert b"-I" in command[: command.index(b"-m")], command
