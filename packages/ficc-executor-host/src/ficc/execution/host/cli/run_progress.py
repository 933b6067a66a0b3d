"""What `ficc-executor run` shows while it follows a job: step lines, and a progress
line (phase, elapsed time, bytes uploaded).

On a terminal the progress line is one line rewritten in place, with each step line
printed above it; otherwise (a log, a pipe) every line is a plain line of its own: the
step lines, and the progress line whenever `PLAIN_EVERY_S` passed without a line, so a
log shows the job is alive (and how far an upload got) without a line per poll.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TextIO

from ficc.execution.host.cli.job_steps import Phase

PLAIN_EVERY_S = 10.0
CLEAR = "\r\x1b[K"
"""Carriage return, then erase to the end of the line."""


def size(count: int) -> str:
    """`43 B`, `1.5 KiB`, `12.0 MiB`, `3.2 GiB`."""
    if count < 1 << 10:
        return f"{count} B"
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if count >= 1 << shift:
            return f"{count / (1 << shift):.1f} {unit}"
    raise AssertionError("unreachable")


class ProgressLine:
    """The `job_shell.Reporter` of `run`."""

    def __init__(
        self,
        stream: TextIO,
        upload_total: int,
        *,
        tty: bool | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.stream = stream
        self.tty = stream.isatty() if tty is None else tty
        self.clock = clock
        self.started = clock()
        self.upload_total = upload_total
        self.done: dict[str, int] = {}
        self.current: Phase | None = None
        self.shown_at = self.started
        self.drawn = False

    def elapsed(self) -> str:
        """`[  12.3 s]`: the time since the command started."""
        return f"[{self.clock() - self.started:6.1f} s]"

    def line(self) -> str:
        """The progress line: phase, elapsed time and (with inputs) bytes uploaded."""
        phase = self.current.value if self.current is not None else "starting"
        shown = f"{self.elapsed()} {phase}"
        if self.upload_total:
            uploaded = sum(self.done.values())
            shown += f", uploaded {size(uploaded)} of {size(self.upload_total)}"
        return shown

    def note(self, text: str) -> None:
        """A step line of its own (above the progress line on a terminal)."""
        prefix = CLEAR if self.tty and self.drawn else ""
        self.stream.write(f"{prefix}{self.elapsed()} {text}\n")
        self.drawn, self.shown_at = False, self.clock()
        self._draw()

    def phase(self, phase: Phase) -> None:
        """The job's phase, after each step."""
        self.current = phase
        self._show()

    def uploaded(self, name: str, done: int, total: int) -> None:
        """Bytes of one input the host holds durably."""
        self.done[name] = done
        self._show()

    def close(self) -> None:
        """Leave the terminal's line clean for what follows."""
        if self.tty and self.drawn:
            self.stream.write(CLEAR)
            self.stream.flush()
        self.drawn = False

    def _show(self) -> None:
        if self.tty:
            self._draw()
        elif self.clock() - self.shown_at >= PLAIN_EVERY_S:
            self.shown_at = self.clock()
            self.stream.write(self.line() + "\n")
            self.stream.flush()

    def _draw(self) -> None:
        if self.tty and self.current is not None:
            self.stream.write(CLEAR + self.line())
            self.drawn = True
        self.stream.flush()


__all__ = ["PLAIN_EVERY_S", "ProgressLine", "size"]
