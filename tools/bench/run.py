"""Run the benchmarks of docs/benchmarks.md and print one line per figure.

Each benchmark is a module `tools/bench/p<N>_*.py` with a function
`run(quick: bool) -> list[Figure]`. A figure is a value measured beside its
baseline in the same run; what counts is the ratio, never the absolute time.

    python tools/bench/run.py [--json FILE] [--only P1,P2] [--quick]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import pathlib
import sys

HERE = pathlib.Path(__file__).resolve().parent

from figures import Figure  # noqa: E402


def _modules(only: set[str]) -> list[pathlib.Path]:
    found = sorted(HERE.glob("p[0-9]*_*.py"), key=lambda p: int(p.name[1:].split("_")[0]))
    return [p for p in found if not only or p.name.split("_")[0].upper() in only]


def _load(path: pathlib.Path):  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location(path.stem, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load benchmark {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json", type=pathlib.Path, help="also write the figures here")
    parser.add_argument("--only", default="", help="comma-separated ids, e.g. P1,P2")
    parser.add_argument("--quick", action="store_true", help="smaller sizes, for a smoke run")
    args = parser.parse_args()
    only = {x.strip().upper() for x in args.only.split(",") if x.strip()}
    figures: list[Figure] = []
    failed = False
    for path in _modules(only):
        for figure in _load(path).run(args.quick):
            print(figure.line(), flush=True)
            figures.append(figure)
            failed |= figure.met is False
    if args.json:
        args.json.write_text(json.dumps([f.as_dict() for f in figures], indent=2) + "\n")
    if not figures:
        print("no benchmarks matched", file=sys.stderr)
        return 2
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
