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


def test_the_stack_summary_sets_waits_aside_and_groups_the_checks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.syspath_prepend(str(BENCH))
    import stacks  # noqa: PLC0415 (from tools/bench, put on the path just above)

    root = "thread (1): ficc-io_0;Thread.run (threading.py:982);Lane._work (host/lanes.py:170)"
    lines = [
        f"{root};_run_one (host/lanes.py:104);scan_tasks (provider/tasks.py:80) 7",
        f"{root};_run_one (host/lanes.py:104);live_processes_of (a.py:390);scan_tasks (t.py:1) 2",
        f"{root};_run_one (host/lanes.py:104);processes_by_uid (a.py:353) 3",
        f"{root};_run_one (host/lanes.py:104);fsync_dir (host/fsutil.py:246) 5",
        "thread (1): ficc-io_0;Thread.run (threading.py:982);Lane._work (host/lanes.py:169) 40",
        "thread (2): MainThread;Runner.run (asyncio/runners.py:118) 30",
        "not a sample",
    ]
    counted = stacks.shares(lines)
    assert counted["the walks of every thread for a slot account (host and provider)"] == 9
    assert counted["the provider's observe (walks of /proc)"] == 3
    assert counted[stacks.REST] == 5
    assert sum(counted.values()) == 17  # the 70 waiting samples are not counted
