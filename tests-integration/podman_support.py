"""The Podman end-to-end suites' use of the kit's Podman world (ficc_testkit.podman).

The world is built from this checkout (`SOURCES`), or, inside the systemd container of
tools/systemd/run.py (which has no compiler), with the provider's wheel built outside
(FICC_PODMAN_WHEELS). What is pytest's lives here: the skip of a machine without
Podman, and the per-test cleanup of the shared world.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from ficc_testkit import podman
from ficc_testkit.accounts import processes_of
from ficc_testkit.podman import PodmanLayout, PodmanWorld, Sources

ROOT = Path(__file__).resolve().parent.parent
PREBUILT_WHEELS = os.environ.get("FICC_PODMAN_WHEELS", "")
SOURCES = Sources(ROOT, Path(PREBUILT_WHEELS) if PREBUILT_WHEELS else None)
BACKENDS = tuple(os.environ.get("FICC_E2E_BACKENDS", "cgroupfs").split(","))
"""The system-service backends the end-to-end suite runs with. Default: cgroupfs (this
workplace has no systemd as PID 1); tools/systemd/run.py sets `systemd` inside its
container, where the daemon runs as the shipped unit."""

NEEDS_PODMAN = pytest.mark.skipif(
    shutil.which("podman") is None
    or shutil.which("runc") is None
    or (shutil.which("cc") is None and not PREBUILT_WHEELS),
    reason="needs podman, runc and a C compiler (apt-get install podman runc gcc libc6-dev "
    "busybox-static)",
)
"""The skip of every suite built on this world: it needs real Podman and the barrier."""


def podman_world(
    backend: str = "cgroupfs",
    slot_bytes: int = podman.SLOT_BYTES,
    slot_inodes: int = podman.SLOT_INODES,
) -> contextlib.AbstractContextManager[PodmanWorld]:
    """The kit's world built from this checkout (see ficc_testkit.podman)."""
    return podman.podman_world(SOURCES, backend, slot_bytes, slot_inodes)


def podman_layout(backend: str = "cgroupfs") -> contextlib.AbstractContextManager[PodmanLayout]:
    """The world without a daemon, built from this checkout."""
    return podman.podman_layout(SOURCES, backend)


def each_test(request: pytest.FixtureRequest, world: PodmanWorld) -> Iterator[PodmanWorld]:
    """A test's use of the shared world: after it, every attempt it planned is stopped
    and released (the next test finds its slot free) and no slot-account process may be
    left. A failing test shows the daemon's log."""
    first = len(world.plans)
    yield world
    report = getattr(request.node, "report_call", None)
    if report is not None and report.failed:
        print(f"\n--- daemon log ---\n{world.process.log(80)}")
    for plan in world.plans[first:]:
        world.finish(plan)
    for account in world.slots:
        assert processes_of(account.uid) == [], f"{account.name} has processes left"


def children_cpu_us(times_output: bytes) -> int:
    """The CPU time (user plus system, microseconds) of a shell's children, from the
    last line of its `times` builtin (`0m1.230000s 0m0.010000s`): what the payload's own
    processes used, measured inside the container, apart from Podman's share."""
    last = times_output.decode().splitlines()[-1]
    pairs = re.findall(r"(\d+)m([\d.]+)s", last)
    return sum(int(minutes) * 60_000_000 + round(float(s) * 1e6) for minutes, s in pairs)
