"""The kernel-fed task index against the truth, under storms.

A storm process forks, clones threads, changes credentials thread by thread
(`setresuid` between two slot accounts with the raw system call, so a thread's IDs
differ from its leader's, which stays root's), execs and exits as fast as it can,
while the test compares, at many instants, a full walk of every thread on the host
with the index's answer: every process the walk found holding an account's task and
still alive after the index answered must be in that answer. Then the same with the
reader held back (the lock it needs taken away) and a small socket buffer, so that
the kernel drops events: the index must notice, walk again, and still miss nothing.
"""

from __future__ import annotations

import os
import platform
import select
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from ficc.execution.provider import tasks
from ficc.execution.provider.taskindex import Told
from ficc_testkit.accounts import Account, temporary_account

pytestmark = pytest.mark.root("the proc connector and setresuid need root")

STORM = Path(__file__).with_name("storm.py")
SYS_SETRESUID = {"x86_64": 117, "aarch64": 147}
COMPARISONS = 300


@dataclass
class Tally:
    """What the comparisons saw."""

    compared: int = 0
    missed: int = 0
    extra: int = 0
    instants: int = 0


@pytest.fixture
def accounts() -> Iterator[tuple[Account, Account]]:
    with temporary_account("ficc-ti-") as one, temporary_account("ficc-ti-") as two:
        yield one, two


def _unified_root() -> Path:
    """Where the unified (v2) cgroup tree is mounted (`/sys/fs/cgroup/unified` on a
    hybrid host, `/sys/fs/cgroup` on a unified one)."""
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        fields = line.split(" - ")
        if fields[1].split()[0] == "cgroup2":
            return Path(fields[0].split()[4])
    pytest.fail("no cgroup2 mount: the storm is frozen through a v2 cgroup")


class Storm:
    """The storm process and everything it forks, in a v2 cgroup of their own, which
    the test freezes for an exact comparison and kills at the end."""

    def __init__(self, accounts: tuple[Account, Account]) -> None:
        self.cgroup = _unified_root() / f"ficc-storm-{os.getpid()}"
        self.cgroup.mkdir()
        number = SYS_SETRESUID[platform.machine()]
        command = f"echo $$ > {self.cgroup}/cgroup.procs && exec {sys.executable} -I {STORM}"
        self.process = subprocess.Popen(
            ["sh", "-c", f"{command} {number} {accounts[0].uid} {accounts[1].uid}"],
            stdout=subprocess.PIPE,
            stdin=subprocess.PIPE,
        )
        self._expect("storming")

    def _expect(self, line: str) -> None:
        assert self.process.stdout is not None
        assert self.process.stdout.readline().decode().strip() == line

    def round(self) -> None:
        """Let every worker loop `storm.ROUND` more times."""
        assert self.process.stdin is not None
        self.process.stdin.write(b"round\n")
        self.process.stdin.flush()
        self._expect("round")

    def frozen(self, value: bool) -> None:
        """Freeze (or thaw) every task of the storm and wait until the kernel says so."""
        (self.cgroup / "cgroup.freeze").write_text("1" if value else "0")
        events = self.cgroup / "cgroup.events"
        while f"frozen {int(value)}" not in events.read_text():
            select.select([], [], [], 0.001)  # a look each millisecond at the kernel's flag

    def kill(self) -> None:
        (self.cgroup / "cgroup.kill").write_text("1")
        self.process.wait()
        while "populated 0" not in (self.cgroup / "cgroup.events").read_text():
            select.select([], [], [], 0.001)
        self.cgroup.rmdir()


@pytest.fixture
def storm(accounts: tuple[Account, Account]) -> Iterator[Storm]:
    if platform.machine() not in SYS_SETRESUID:
        pytest.skip(f"the storm knows setresuid's number on {sorted(SYS_SETRESUID)} only")
    running = Storm(accounts)
    try:
        yield running
    finally:
        running.kill()


def _compare(told: Told, storm: Storm, accounts: tuple[Account, Account], tally: Tally) -> None:
    """One instant: the storm frozen, for each account and both, a walk's processes
    and the index's must be the same set."""
    storm.frozen(True)
    try:
        for uids in ({accounts[0].uid}, {accounts[1].uid}, {a.uid for a in accounts}):
            walked = {pid for _, pid in tasks.live_tasks(uids)}
            told_pids = {pid for _, pid in told.live_tasks(uids)}
            tally.compared += len(walked)
            tally.missed += len(walked - told_pids)
            tally.extra += len(told_pids - walked)
    finally:
        storm.frozen(False)
    tally.instants += 1


def test_the_index_misses_no_task_of_a_storm(
    accounts: tuple[Account, Account], storm: Storm
) -> None:
    told = Told()
    assert told.start() is None
    tally = Tally()
    try:
        for instant in range(COMPARISONS):
            if instant % 15 == 0:
                storm.round()  # however slow the machine, the storm has stormed
            _compare(told, storm, accounts, tally)
        stats = told.stats()
    finally:
        told.close()
    print(f"\nstorm: {tally} events={stats.events} lost={stats.lost} resyncs={stats.resyncs}")
    assert stats.events > 1000, "the storm made the kernel announce too little to prove much"
    assert tally.compared > COMPARISONS
    assert (tally.missed, tally.extra) == (0, 0)


def test_lost_events_make_the_index_walk_again_and_still_miss_nothing(
    accounts: tuple[Account, Account], storm: Storm
) -> None:
    told = Told(receive_buffer=4096)
    assert told.start() is None
    tally = Tally()
    try:
        for _ in range(20):
            with told._lock:  # the reader falls behind: the kernel must drop events
                storm.round()
            for _ in range(COMPARISONS // 20):
                _compare(told, storm, accounts, tally)
        stats = told.stats()
    finally:
        told.close()
    print(f"\nheld back: {tally} events={stats.events} lost={stats.lost} resyncs={stats.resyncs}")
    assert stats.lost > 0
    assert stats.resyncs > 1
    assert (tally.missed, tally.extra) == (0, 0)
