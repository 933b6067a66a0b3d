"""The executor host daemon as a child process of the demo.

Started exactly as an administrator's service manager would start it:
`python -m ficc.execution serve --config FILE --provider-path SITE`, with
NOTIFY_SOCKET pointing at a datagram socket the demo listens on. The daemon says
READY=1 there once it has recovered and every socket listens (sd_notify, the way it
tells systemd). Its structured log (JSON lines) goes to a file in the run directory.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from demo.layout import RunLayout
from ficc_testkit import daemons


class DaemonFailed(Exception):
    """The daemon exited early, never became ready, or did not stop cleanly."""


def _reason(failure: daemons.DaemonFailed) -> str:
    """The kit's failure without the log it appends (the demo shows its own tail)."""
    return str(failure).split("\n", 1)[0].rstrip(":")


class DaemonProcess:
    """One daemon child (the test kit's driver): start() waits for READY=1; stop()
    always leaves none running."""

    def __init__(self, layout: RunLayout, provider_site: Path) -> None:
        self.layout = layout
        self.child = daemons.DaemonProcess(
            layout.config_file,
            provider_site,
            run_dir=layout.root,
            log_path=layout.daemon_log,
            new_session=True,  # Ctrl-C reaches the demo, which stops it cleanly
        )

    @property
    def pid(self) -> int | None:
        return None if self.child.process is None else self.child.process.pid

    def start(self) -> float:
        """Start the daemon and wait for READY=1; returns the seconds it took."""
        started = time.monotonic()
        pid = self.child.spawn()
        self.layout.daemon_pid.write_text(f"{pid}\n")
        try:
            self.child.wait_ready()
        except daemons.DaemonFailed as failure:
            raise DaemonFailed(_reason(failure)) from None
        return time.monotonic() - started

    def stop(self) -> int | None:
        """SIGTERM, wait, SIGKILL if it does not stop; returns its exit status."""
        if self.child.process is None:
            return None
        try:
            status = self.child.stop()
        except daemons.DaemonFailed as failure:
            raise DaemonFailed(_reason(failure)) from None
        self.layout.daemon_pid.unlink(missing_ok=True)
        return status

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
