"""How the demo shows what happened: one line per step, then a summary table (pure).

A step line names the protocol step and the attempt's record right after it, as the
daemon reported it: `state`, `ready` (meaningful while prepared), `outcome` (set once
the attempt is terminal, kept through release) and a short detail.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ficc.execution.wire import AttemptStatus

COLUMNS = [("STEP", 22), ("STATE", 11), ("READY", 7), ("OUTCOME", 11)]


@dataclass(frozen=True)
class Step:
    """One step as the controller saw it."""

    name: str
    state: str
    ready: str
    outcome: str
    detail: str
    seconds: float


def of_record(name: str, record: AttemptStatus | None, detail: str, seconds: float) -> Step:
    """A step whose state columns come from the attempt's record (or `-` before one)."""
    if record is None:
        return Step(name, "-", "-", "-", detail, seconds)
    ready = ("yes" if record.ready else "no") if record.state == "prepared" else "-"
    return Step(name, record.state, ready, record.outcome or "-", detail, seconds)


def header() -> str:
    cells = "".join(title.ljust(width) for title, width in COLUMNS)
    return f"  {cells}DETAIL"


def line(step: Step) -> str:
    values = [step.name, step.state, step.ready, step.outcome]
    cells = "".join(v.ljust(w) for v, (_, w) in zip(values, COLUMNS, strict=True))
    return f"  {cells}{step.detail}"


def summary(steps: Sequence[Step]) -> str:
    """The closing table: each step, the state it left, and how long it took."""
    width = max([len("STEP"), *(len(s.name) for s in steps)]) + 2
    rows = [f"  {'STEP'.ljust(width)}{'STATE'.ljust(11)}{'DURATION':>10}"]
    for step in steps:
        rows.append(f"  {step.name.ljust(width)}{step.state.ljust(11)}{step.seconds:>9.2f}s")
    total = sum(s.seconds for s in steps)
    rows.append(f"  {'total'.ljust(width)}{''.ljust(11)}{total:>9.2f}s")
    return "\n".join(rows)


def indented(text: str, prefix: str = "  | ") -> str:
    """A block of collected text, marked so it stands apart from the demo's own lines."""
    lines = text.splitlines() or [""]
    return "\n".join(prefix + line for line in lines)
