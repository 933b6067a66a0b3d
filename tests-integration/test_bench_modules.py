"""Every benchmark module loads and exposes `run(quick)`.

Benchmarks run only under `nox -s bench`, so a broken one would otherwise go unnoticed
until someone measures; loading each module here catches the breakage in CI (a
signature change in the code a benchmark calls at import time, a renamed import).
"""

from __future__ import annotations

import importlib.util
import inspect
import pathlib
import sys

import pytest

BENCH = pathlib.Path(__file__).resolve().parent.parent / "tools" / "bench"
MODULES = sorted(BENCH.glob("p[0-9]*_*.py"))


def test_there_is_one_benchmark_per_performance_target() -> None:
    ids = sorted({path.name.split("_")[0].upper() for path in MODULES})
    assert ids == [f"P{n}" for n in range(1, 10)]


@pytest.mark.parametrize("path", MODULES, ids=lambda p: p.stem)
def test_the_benchmark_module_loads(path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(BENCH))
    spec = importlib.util.spec_from_file_location(f"bench_{path.stem}", path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)
    spec.loader.exec_module(module)
    assert list(inspect.signature(module.run).parameters) == ["quick"]
