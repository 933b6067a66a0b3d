"""What the runtime printed, as the daemon logs it: bounded, printable, whole lines."""

from __future__ import annotations

from ficc.execution.host.runner.runtime_errors import sanitized


def test_control_characters_are_shown_as_question_marks() -> None:
    assert sanitized(b"a\x1b[31mred\x07\tok\r\n", cut=False) == "a?[31mred?\tok?"


def test_invalid_utf8_is_replaced_not_refused() -> None:
    assert sanitized(b"bad \xff byte\n", cut=False) == "bad \ufffd byte"


def test_a_tail_that_starts_mid_line_drops_the_partial_line() -> None:
    assert sanitized(b"tial line\nwhole line\n", cut=True) == "whole line"


def test_a_tail_of_one_partial_line_is_kept() -> None:
    assert sanitized(b"only a part of one long line\n", cut=True) == "only a part of one long line"
