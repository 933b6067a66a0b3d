"""The one shape every benchmark reports: a value, its baseline and their ratio."""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable


@dataclasses.dataclass(frozen=True)
class Figure:
    """One measured figure. `ratio` is value / baseline (or the inverse for rates).

    `target` is the bound docs/benchmarks.md gives the ratio and `higher_is_better` says which
    side of it passes; `met` is None when the figure is reported without a target.
    """

    id: str
    name: str
    value: float
    unit: str
    baseline: float
    ratio: float
    target: float | None = None
    higher_is_better: bool = False

    @property
    def met(self) -> bool | None:
        if self.target is None:
            return None
        return self.ratio >= self.target if self.higher_is_better else self.ratio <= self.target

    def line(self) -> str:
        bound = ""
        if self.target is not None:
            sign = ">=" if self.higher_is_better else "<="
            bound = f"  target {sign} {self.target:g}x  {'ok' if self.met else 'MISSED'}"
        return (
            f"{self.id:<3} {self.name:<48} {self.value:>12.4g} {self.unit:<6}"
            f" ratio {self.ratio:7.3f}x{bound}"
        )

    def as_dict(self) -> dict[str, object]:
        return {**dataclasses.asdict(self), "met": self.met}


def median_seconds(fn: Callable[[], object], repeat: int) -> float:
    """Median wall time of `repeat` calls; medians resist this machine's noise."""
    samples = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)
