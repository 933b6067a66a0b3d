"""What the runtime printed, as the daemon logs it: bounded, printable, whole lines; and
the barrier's report of a payload it could not execute, in the host's words only."""

from __future__ import annotations

from pathlib import Path

import pytest

from ficc.execution.host.runner.runtime_errors import exec_failure, sanitized
from ficc_testkit.fakes import FakeSlotFiles


def test_control_characters_are_shown_as_question_marks() -> None:
    assert sanitized(b"a\x1b[31mred\x07\tok\r\n", cut=False) == "a?[31mred?\tok?"


def test_invalid_utf8_is_replaced_not_refused() -> None:
    assert sanitized(b"bad \xff byte\n", cut=False) == "bad \ufffd byte"


def test_a_tail_that_starts_mid_line_drops_the_partial_line() -> None:
    assert sanitized(b"tial line\nwhole line\n", cut=True) == "whole line"


def test_a_tail_of_one_partial_line_is_kept() -> None:
    assert sanitized(b"only a part of one long line\n", cut=True) == "only a part of one long line"


# --- the barrier's report of a payload that could not be executed ----------------------

ATTEMPT = "a1" * 16
PROGRAM = "/opt/job/render"
REPORT = f"ficc-barrier: cannot execute {PROGRAM}: No such file or directory (errno 2)\n"
needs_root = pytest.mark.root("the log is opened as the daemon does: owned by root")


def _with_stderr(tmp_path: Path, data: bytes) -> FakeSlotFiles:
    files = FakeSlotFiles(tmp_path)
    files.create(ATTEMPT)
    Path(files.paths(ATTEMPT).stderr).write_bytes(data)
    return files


@needs_root
def test_the_barriers_report_is_shown_in_the_hosts_words(tmp_path: Path) -> None:
    files = _with_stderr(tmp_path, b"runtime notice\n" + REPORT.encode())
    said = exec_failure(files, ATTEMPT, PROGRAM, 127)
    assert said == REPORT.rstrip("\n")


@needs_root
def test_the_reason_is_the_hosts_text_for_the_number_not_the_logs(tmp_path: Path) -> None:
    forged = f"ficc-barrier: cannot execute {PROGRAM}: secret=hunter2 (errno 13)\n"
    said = exec_failure(_with_stderr(tmp_path, forged.encode()), ATTEMPT, PROGRAM, 126)
    assert said == f"ficc-barrier: cannot execute {PROGRAM}: Permission denied (errno 13)"
    assert "hunter2" not in said


@needs_root
@pytest.mark.parametrize(
    ("data", "program", "status"),
    [
        (REPORT.encode() + b"the payload ran after all\n", PROGRAM, 127),  # not the end
        (REPORT.encode(), "/opt/job/other", 127),  # another program than the plan's
        (REPORT.encode(), PROGRAM, 126),  # ENOENT is 127, never 126
        (REPORT.encode(), PROGRAM, 1),  # not a status the barrier uses
        (REPORT.replace("errno 2", "errno 9999").encode(), PROGRAM, 126),  # no such errno
        (b"sh: render: not found\n", PROGRAM, 127),  # the payload's own 127
        (b"x" + REPORT.encode(), PROGRAM, 127),  # not at the start of a line
    ],
)
def test_anything_but_the_report_itself_gives_nothing(
    tmp_path: Path, data: bytes, program: str, status: int
) -> None:
    assert exec_failure(_with_stderr(tmp_path, data), ATTEMPT, program, status) == ""


def test_no_log_gives_nothing(tmp_path: Path) -> None:
    assert exec_failure(FakeSlotFiles(tmp_path), ATTEMPT, PROGRAM, 127) == ""
