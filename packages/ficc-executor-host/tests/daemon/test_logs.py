"""Log lines (logs.py): JSON, RFC 3339, level filter, syslog priority on the journal.

The journal check uses a real file as stderr and JOURNAL_STREAM set to its device and
inode, which is exactly how systemd tells a service that stderr is the journal; the
real journald reading these priorities is tested under systemd (tools/systemd).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from ficc.execution.host.daemon import logs

RECORD = {"ts": 1_800_000_000.25, "level": "warning", "event": "busy", "socket": "admin"}


@pytest.fixture(autouse=True)
def default_level() -> Iterator[None]:
    yield
    logs.set_level("info")


def test_a_line_is_json_with_an_rfc3339_utc_time() -> None:
    line = logs.render(RECORD, journal=False)
    assert line.endswith("\n")
    parsed = json.loads(line)
    assert parsed == {**RECORD, "ts": "2027-01-15T08:00:00.250000Z"}


@pytest.mark.parametrize(
    ("level", "priority"), [("error", 3), ("warning", 4), ("info", 6), ("debug", 7)]
)
def test_on_the_journal_each_line_starts_with_its_syslog_priority(
    level: str, priority: int
) -> None:
    line = logs.render({**RECORD, "level": level}, journal=True)
    assert line.startswith(f"<{priority}>{{")
    assert json.loads(line[3:])["level"] == level


def test_an_unknown_level_is_logged_as_an_error() -> None:
    assert logs.render({**RECORD, "level": "odd"}, journal=True).startswith("<3>")


def test_the_level_filter() -> None:
    logs.set_level("warning")
    assert not logs.enabled("info")
    assert logs.enabled("warning")
    assert logs.enabled("error")
    logs.set_level("debug")
    assert logs.enabled("debug")
    with pytest.raises(ValueError, match="is not one of debug, info, warning, error"):
        logs.set_level("loud")


def _emit_in_child(stderr: Path, journal_stream: str | None) -> str:
    """Run `logs.emit` in a child whose stderr is `stderr`; return what it wrote."""
    env = {k: v for k, v in os.environ.items() if k != "JOURNAL_STREAM"}
    if journal_stream is not None:
        env["JOURNAL_STREAM"] = journal_stream
    code = (
        "from ficc.execution.host.daemon import logs\n"
        "logs.emit({'ts': 0.0, 'level': 'error', 'event': 'e'})\n"
        "logs.emit({'ts': 0.0, 'level': 'debug', 'event': 'hidden'})\n"
    )
    with open(stderr, "wb") as out:
        subprocess.run([sys.executable, "-c", code], stderr=out, env=env, check=True, timeout=60)
    return stderr.read_text()


def test_emit_prefixes_only_when_stderr_is_the_journal_stream(tmp_path: Path) -> None:
    target = tmp_path / "stderr"
    target.touch()
    info = os.stat(target)
    journal = _emit_in_child(target, f"{info.st_dev}:{info.st_ino}")
    assert journal == '<3>{"ts":"1970-01-01T00:00:00.000000Z","level":"error","event":"e"}\n'
    other = _emit_in_child(target, f"{info.st_dev}:{info.st_ino + 1}")  # another stream
    assert other == '{"ts":"1970-01-01T00:00:00.000000Z","level":"error","event":"e"}\n'
    assert _emit_in_child(target, None) == other
