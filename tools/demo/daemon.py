"""The executor host daemon as a child process of the demo.

Started exactly as an administrator's service manager would start it:
`python -m ficc.execution serve --config FILE --provider-path SITE`, with
NOTIFY_SOCKET pointing at a datagram socket the demo listens on. The daemon says
READY=1 there once it has recovered and every socket listens (sd_notify, the way it
tells systemd). Its structured log (JSON lines) goes to a file in the run directory.
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from demo.layout import RunLayout

READY_TIMEOUT = 120.0
STOP_TIMEOUT = 60.0


class DaemonFailed(Exception):
    """The daemon exited early, never became ready, or did not stop cleanly."""


class DaemonProcess:
    """One daemon child: start() waits for READY=1; stop() always leaves none running."""

    def __init__(self, layout: RunLayout, provider_site: Path) -> None:
        self.layout = layout
        self.provider_site = provider_site
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int | None:
        return None if self.process is None else self.process.pid

    def start(self) -> float:
        """Start the daemon and wait for READY=1; returns the seconds it took."""
        started = time.monotonic()
        path = self.layout.notify_socket
        path.unlink(missing_ok=True)
        notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
        notify.bind(str(path))
        env = {k: v for k, v in os.environ.items() if not k.startswith(("NOTIFY_", "WATCHDOG_"))}
        env["NOTIFY_SOCKET"] = str(path)
        command = [sys.executable, "-m", "ficc.execution", "serve"]
        command += ["--config", str(self.layout.config_file)]
        command += ["--provider-path", str(self.provider_site)]
        with notify, open(self.layout.daemon_log, "ab") as log:
            self.process = subprocess.Popen(
                command,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                env=env,
                start_new_session=True,  # Ctrl-C reaches the demo, which stops it cleanly
            )
            self.layout.daemon_pid.write_text(f"{self.process.pid}\n")
            self._wait_ready(notify)
        return time.monotonic() - started

    def _wait_ready(self, notify: socket.socket) -> None:
        assert self.process is not None
        deadline = time.monotonic() + READY_TIMEOUT
        while time.monotonic() < deadline:
            readable, _, _ = select.select([notify], [], [], 0.2)
            if readable and "READY=1" in notify.recv(4096).decode(errors="replace").split("\n"):
                return
            if self.process.poll() is not None:
                raise DaemonFailed(
                    f"the daemon exited with status {self.process.returncode} before READY=1"
                )
        raise DaemonFailed(f"the daemon did not report READY=1 within {READY_TIMEOUT:.0f} s")

    def stop(self) -> int | None:
        """SIGTERM, wait, SIGKILL if it does not stop; returns its exit status."""
        process = self.process
        if process is None:
            return None
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
                raise DaemonFailed(
                    f"the daemon ignored SIGTERM for {STOP_TIMEOUT:.0f} s and was killed"
                ) from None
        self.layout.daemon_pid.unlink(missing_ok=True)
        return process.returncode

    def log_tail(self, lines: int = 15, notable: int = 30) -> str:
        """The log's warnings, errors and refusals, then its last lines.

        Every request is logged; the lines that explain a failure are the ones above
        `info` or carrying a refusal code, so they come first.
        """
        try:
            text = self.layout.daemon_log.read_text(errors="replace")
        except FileNotFoundError:
            return "(the daemon wrote no log)"
        all_lines = text.splitlines()
        marked = [line for line in all_lines if _notable(line)][-notable:]
        out = []
        if marked:
            out += [f"-- warnings, errors and refusals ({len(marked)} most recent):", *marked]
        out += [f"-- last {min(lines, len(all_lines))} of {len(all_lines)} lines:"]
        out += all_lines[-lines:]
        return "\n".join(out)


def _notable(line: str) -> bool:
    """A JSON log line above info level or with a refusal code; any non-JSON line."""
    try:
        record = json.loads(line)
    except ValueError:
        return bool(line.strip())
    if not isinstance(record, dict):
        return True
    return record.get("level") not in ("info", "debug") or record.get("code") is not None
