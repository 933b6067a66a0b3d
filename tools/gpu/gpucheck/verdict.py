"""The one verdict line, and the exit status that goes with it.

A job lent `gpuN` must have opened every node of gpuN's bundle (its own and the ones
its kind shares) and been refused every other GPU of the kind, as the runner's own
device-open results show; where the job ran `nvidia-smi -L`, it must have listed one
GPU. Only a job run in a Podman container, that ended well, can pass: the test
provider's run shows the device policy but runs no program of the job (partial).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ficc_provider_podman.bundles import Bundles

PASS, FAIL, NO_GPU, PARTIAL = 0, 1, 2, 3
"""Exit statuses: the job saw exactly its GPU; it did not (or the run failed); there is
no GPU; something the check needs is missing, and it ran only the part it could."""


@dataclass(frozen=True)
class Verdict:
    word: str
    status: int
    line: str


def stamp(started: float) -> str:
    """The time of the verdict, and how long the check took."""
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    return f"at {now} ({time.monotonic() - started:.1f} s)"


def no_gpu(what: str, started: float) -> Verdict:
    return Verdict(
        "no-gpu",
        NO_GPU,
        f"VERDICT no-gpu: no GPU is present on this host ({what}) {stamp(started)}",
    )


def not_run(name: str, missing: list[str], started: float) -> Verdict:
    return Verdict(
        "partial",
        PARTIAL,
        f"VERDICT partial: {name}'s bundle resolved; no job ran (missing: {'; '.join(missing)})"
        f" {stamp(started)}",
    )


def judge(
    name: str,
    bundles: Bundles,
    opened: dict[str, bool],
    *,
    ran: bool,
    ended: str,
    smi: list[str],
    started: float,
) -> Verdict:
    """The verdict on one job's device opens (`ran`: its programs ran, in Podman)."""
    bundle = bundles.by_name[name]
    mine = [node.path for node in (*bundle.nodes, *bundle.shared)]
    others = [node.path for node in bundles.grant([name]).others]
    unopened = [path for path in mine if opened.get(path) is not True]
    reached = [path for path in others if opened.get(path) is not False]
    listed = [line for line in smi if line.startswith("GPU ")]
    problems = []
    if unopened:
        problems.append(f"did not open {', '.join(unopened)}")
    if reached:
        problems.append(f"was not refused {', '.join(reached)}")
    if ran and ended != "succeeded":
        problems.append(f"ended {ended}")
    if ran and smi and len(listed) != 1:
        problems.append(f"nvidia-smi -L listed {len(listed)} GPUs")
    saw = f"the job holding {name} opened {', '.join(mine)}"
    refused = f"was refused {', '.join(others)}" if others else "had no other GPU of its kind"
    shown = f"; nvidia-smi -L: {listed[0]}" if ran and len(listed) == 1 else ""
    if problems:
        return Verdict(
            "fail",
            FAIL,
            f"VERDICT fail: the job holding {name} {'; '.join(problems)} {stamp(started)}",
        )
    if not ran:
        return Verdict(
            "partial",
            PARTIAL,
            f"VERDICT partial: {saw} and {refused} (device policy only: no container ran)"
            f" {stamp(started)}",
        )
    return Verdict("pass", PASS, f"VERDICT pass: {saw} and {refused}{shown} {stamp(started)}")
