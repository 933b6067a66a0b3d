"""docs/operations.md, "Without systemd": the guide's start script, run as written (its
paths set to this test's daemon), gives the daemon the shipped unit's settings, keeps
its log in the file it names, and stops it cleanly on SIGTERM."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from ficc_testkit.host import Layout
from ficc_testkit.waits import wait_for
from ficc_testkit.wheels import InstalledProvider

ROOT = Path(__file__).resolve().parents[1]
COMMAND = Path(sys.executable).parent / "ficc-executor"
STOP_TIMEOUT = 60  # the unit's TimeoutStopSec=, a hang guard here


def the_guides_start_script(settings: dict[str, str]) -> str:
    """The script of "Without systemd", with each `NAME=value` line of `settings`
    replaced (the script's own paths are the guide's production ones)."""
    guide = (ROOT / "docs" / "operations.md").read_text()
    section = guide.split("### Without systemd", 1)[1].split("\n## ", 1)[0]
    found = re.search(r"```sh\n(#!/bin/sh\n.*?)```", section, re.S)
    assert found is not None, "the section has no start script"
    script = found.group(1)
    for name, value in settings.items():
        script, count = re.subn(rf"^{name}=\S+", f"{name}={value}", script, flags=re.M)
        assert count == 1, f"the script sets no {name}"
    return script


def events(log: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in log.read_text().splitlines() if line.startswith("{")]


def ready(log: Path) -> bool:
    return log.exists() and "ready" in {e["event"] for e in events(log)}


def test_the_guides_start_script_runs_the_daemon_as_the_unit_does_and_sigterm_stops_it(
    layout: Layout, provider: InstalledProvider
) -> None:
    log = layout.base / "daemon.log"
    script = layout.base / "ficc-executor-host"
    script.write_text(the_guides_start_script({
        "PYTHON": sys.executable, "CONFIG": str(layout.config_path),
        "STATE_DIR": str(layout.state_dir), "SOCKET_DIR": str(layout.socket_dir),
        "LOG": str(log),
    }))  # fmt: skip
    script.chmod(0o700)
    started = subprocess.Popen(
        [str(script), "--provider-path", str(provider.site)],
        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        env={"PATH": os.environ["PATH"]}, umask=0o022,
    )  # fmt: skip
    try:
        wait_for(lambda: started.poll() is not None or ready(log), "the daemon's ready line")
        assert started.poll() is None, started.communicate()
        # `exec`: the supervisor's PID is the daemon's own, with the unit's settings
        status = Path(f"/proc/{started.pid}/status").read_text()
        assert re.search(r"^Umask:\s+0077$", status, re.M), status
        environment = Path(f"/proc/{started.pid}/environ").read_bytes().split(b"\0")
        assert b"MALLOC_MMAP_THRESHOLD_=1048576" in environment
        assert not [v for v in environment if v.startswith((b"HOME=", b"PYTHON"))]
        limits = Path(f"/proc/{started.pid}/limits").read_text()
        assert re.search(r"^Max open files\s+16384\s+16384", limits, re.M), limits
        assert re.search(r"^Max core file size\s+0\s+0", limits, re.M), limits
        oom_score_adj = Path(f"/proc/{started.pid}/oom_score_adj").read_text().strip()
        assert (log.stat().st_mode & 0o777) == 0o600
        asked = subprocess.run(
            [str(COMMAND), "status", "--config", str(layout.config_path)],
            capture_output=True, text=True, check=False, timeout=120,
        )  # fmt: skip
        assert asked.returncode == 0, asked.stderr

        started.send_signal(signal.SIGTERM)
        assert started.wait(timeout=STOP_TIMEOUT) == 0
    finally:
        if started.poll() is None:
            started.kill()
            started.wait()
    _, stderr = started.communicate()
    assert f"{layout.config_path}: " in stderr.decode()  # check-config's report
    # lowered as the unit's OOMScoreAdjust=-500 does, or (without CAP_SYS_RESOURCE) said so
    lowered = oom_score_adj == "-500"
    assert lowered != ("OOM score not lowered" in stderr.decode()), (oom_score_adj, stderr)
    lines = events(log)
    assert [e["event"] for e in lines][-2:] == ["stopping", "stopped"]
    assert all(set(e) >= {"ts", "level", "event"} for e in lines)
