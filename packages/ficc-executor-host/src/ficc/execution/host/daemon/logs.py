"""The daemon's log lines: one JSON object per line on stderr.

Every line has `ts` (RFC 3339, UTC, microseconds), `level` and `event`. When stderr is
the journal (systemd sets `JOURNAL_STREAM` to the device and inode of that stream),
each line starts with its syslog priority (`<3>` error ... `<7>` debug), which journald
strips and records, so `journalctl -p err` selects errors. Lines below the configured
level (`serve --log-level`) are not written.

`render` is pure (record in, text out); `emit` is the only function that writes.
"""

from __future__ import annotations

import datetime
import os
import sys
from typing import Any, TextIO

import msgspec

LEVELS = ("debug", "info", "warning", "error")
PRIORITY = {"critical": 2, "error": 3, "warning": 4, "notice": 5, "info": 6, "debug": 7}
"""syslog priorities of the levels (RFC 5424); an unknown level is logged as error."""

_RANK = {"debug": 0, "info": 1, "notice": 1, "warning": 2, "error": 3, "critical": 4}
_threshold = {"rank": _RANK["info"]}


def set_level(level: str) -> None:
    """Write only lines at `level` or above (one of LEVELS)."""
    if level not in LEVELS:
        raise ValueError(f"log level {level!r} is not one of {', '.join(LEVELS)}")
    _threshold["rank"] = _RANK[level]


def enabled(level: str) -> bool:
    return _RANK.get(level, _RANK["error"]) >= _threshold["rank"]


def rfc3339(timestamp: float) -> str:
    """`2026-12-01T10:05:31.123456Z`: UTC, microseconds, the way journald and jq sort."""
    moment = datetime.datetime.fromtimestamp(timestamp, datetime.UTC)
    return moment.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def render(record: dict[str, Any], *, journal: bool) -> str:
    """One line (with its newline); `ts` given as seconds since the epoch is converted."""
    line = dict(record)
    ts = line.get("ts")
    if isinstance(ts, (int, float)) and not isinstance(ts, bool):
        line["ts"] = rfc3339(float(ts))
    level = str(line.get("level", "error"))
    text = msgspec.json.encode(line).decode()
    prefix = f"<{PRIORITY.get(level, PRIORITY['error'])}>" if journal else ""
    return f"{prefix}{text}\n"


def stream_is_journal(stream: TextIO) -> bool:
    """Whether `stream` is the journal stream systemd connected (JOURNAL_STREAM=dev:ino)."""
    expected = os.environ.get("JOURNAL_STREAM", "")
    device, _, inode = expected.partition(":")
    if not (device.isdigit() and inode.isdigit()):
        return False
    try:
        info = os.fstat(stream.fileno())
    except (OSError, ValueError):
        return False
    return (info.st_dev, info.st_ino) == (int(device), int(inode))


def emit(record: dict[str, Any]) -> None:
    """Write one record to stderr if its level is enabled."""
    if not enabled(str(record.get("level", "error"))):
        return
    sys.stderr.write(render(record, journal=stream_is_journal(sys.stderr)))
    sys.stderr.flush()
