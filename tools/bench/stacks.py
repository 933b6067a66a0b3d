"""Shares of a daemon's busy samples by what they were doing, from py-spy's collapsed
stacks (the file `FICC_BENCH_PYSPY` names during P8 or P9).

    python tools/bench/stacks.py p9.txt

Each sample goes to the first group whose frame appears in its stack. The groups are
the checks that the host and the Podman provider make so that nothing of a job is
left anywhere (walks of every task, of /proc, of the service's cgroup trees, and the
payload gate's reading of the live payload), then everything else. Their share times
the daemon's CPU per attempt is what those checks cost an attempt: the floor below
which no tuning of the rest can bring it.

py-spy counts a thread blocked in C (a queue's `get`, the event loop's poll, a
condition) as busy, so a sample whose innermost frame is one of those waits
(`WAITS`) is set aside, not counted. Waits for the disk (fsync) stay counted: what is
left is an upper bound on the CPU, and the checks' share a lower bound.
"""

from __future__ import annotations

import argparse
import collections
import pathlib

GROUPS = (
    ("the walks of every thread for a slot account (host and provider)", ("scan_tasks (",)),
    ("the provider's observe (walks of /proc)", (";processes_by_uid (",)),
    ("the service's cgroup trees (members, removal)", ("tree_pids (", "remove_tree (")),
    ("the payload gate (reading and checking the payload)", ("inspect_and_check (",)),
)
REST = "everything else"
WAITS = frozenset(
    {
        "Lane._work",  # an idle worker: the lane's queue
        "Spares._work",
        "_worker",  # concurrent.futures' idle worker
        "Runner.run",  # the event loop polling
        "Condition.wait",
        "Event.wait",
        "Thread.join",
        "_readable",  # poll(2) on a pipe
        "wait_until",  # sleeps between looks
    }
)


def _waiting(stack: str) -> bool:
    """Whether the innermost frame (`function (file:line)`) is one of `WAITS`."""
    return stack.rpartition(";")[2].partition(" (")[0] in WAITS


def shares(lines: list[str]) -> dict[str, int]:
    """Busy samples per group, `REST` last (waiting samples are left out)."""
    counted: collections.Counter[str] = collections.Counter()
    for line in lines:
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit() or _waiting(stack):
            continue
        group = next(
            (name for name, frames in GROUPS if any(frame in stack for frame in frames)), REST
        )
        counted[group] += int(count)
    return {name: counted[name] for name, _ in (*GROUPS, (REST, ()))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("stacks", type=pathlib.Path, help="py-spy --format raw output")
    args = parser.parse_args()
    counted = shares(args.stacks.read_text().splitlines())
    total = sum(counted.values()) or 1
    checks = total - counted[REST]
    for name, samples in counted.items():
        print(f"{samples / total:6.1%}  {samples:7d}  {name}")
    print(f"{checks / total:6.1%}  {checks:7d}  all the checks above")


if __name__ == "__main__":
    main()
