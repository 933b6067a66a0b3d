"""Random schedules of lease decisions against a small model of what is promised.

One attempt, a real ledger, the lease reaper's real decision code on a real deadline
directory (its cgroups are none: what is checked is its decision, its evidence), and a
clock the schedule moves. The steps are those of the daemon and the reaper, split
where they really interleave: a renewal's ledger transaction and its hand-over to the
reaper are two steps, a reaper pass pauses where it found a deadline due and where its
intent is there, the monitor reads a record and later expires it. Each schedule runs
random steps and checks, after each, the promises:

- a decision recorded in the ledger (start, input commit, renewal, expiry) holds only
  if the lease was current (start, commit, renewal) or over (expiry) at the clock
  reading of that decision;
- the reaper never decides to kill before the deadline of the last renewal answered
  OK (or the start's);
- no renewal is answered OK once the reaper has decided, and a renewal the reaper came
  before is refused and leaves the attempt's expiry recorded.

The schedule count and seed are printed (CI size here, `nox -s soak` runs more); a
failing schedule is printed step by step, and FICC_LEASE_SEED reruns a seed.
"""

from __future__ import annotations

import collections
import json
import os
import queue
import random
import shutil
import threading
from collections.abc import Callable
from pathlib import Path

import msgspec
import pytest

from ficc.execution import plan as planlib
from ficc.execution.host.core import leases
from ficc.execution.host.core import lifecycle as lc
from ficc.execution.host.core.errors import HostError
from ficc.execution.host.core.leases import Lease, Now
from ficc.execution.host.ledger.store import (
    Admitted,
    Applied,
    HostFacts,
    PrepareRow,
    SlotSpec,
)
from ficc.execution.host.service import reaper
from ficc.execution.protocol import Fence, OfferLimits, Resources
from ficc_testkit import plans
from ficc_testkit.plans import new_id
from ledger_support import create_ledger

SOAK = os.environ.get("FICC_SOAK") == "1"
SCHEDULES = 5_000 if SOAK else 250
STEPS = 60
DEFAULT_SEED = 20261203
SEED = int(os.environ.get("FICC_LEASE_SEED", str(DEFAULT_SEED)))

INSTALLATION = "1" * 32
BOOT = "8d7c2e55-0000-4000-8000-0000000000aa"
MS = 1_000_000
START_NS = 10**12
WALL_NS = 1_800_000_000_000 * MS
MAX_LEASE = 3600
BIG = 2**40
SHA = "sha256:" + "a" * 64
DATA = b"ab"
SERVICE = "ficc-work-schedule"


class Terms(msgspec.Struct, frozen=True):
    sequence: int
    expires_at_ms: int


class ManualClock:
    """A clock the schedule moves; boot and wall time move together."""

    def __init__(self) -> None:
        self.boottime_ns = START_NS

    def now(self) -> Now:
        return Now(BOOT, self.boottime_ns, WALL_NS + self.boottime_ns - START_NS)


class ReaperPass:
    """One `reap_once` in a thread of its own, paused at each hook until stepped."""

    def __init__(self, directory: str, now_ns: int) -> None:
        self._permits: queue.Queue[None] = queue.Queue()
        self._events: queue.Queue[str] = queue.Queue()
        self.at = ""
        self.done = False
        self.now_ns = now_ns
        self._thread = threading.Thread(target=self._run, args=(directory,), daemon=True)
        self._thread.start()
        self._wait()

    def _run(self, directory: str) -> None:
        try:
            reaper.reap_once(directory, BOOT, self.now_ns, hook=self._hook)
        finally:
            self._events.put("done")

    def _hook(self, step: str, name: str) -> None:
        self._events.put(step)
        self._permits.get(timeout=30)

    def _wait(self) -> None:
        self.at = self._events.get(timeout=30)
        if self.at == "done":
            self.done = True
            self._thread.join(timeout=30)

    def step(self) -> None:
        assert not self.done
        self._permits.put(None)
        self._wait()


class World:
    """One attempt and everything that decides about its lease."""

    def __init__(self, root: Path, rng: random.Random, seen: collections.Counter[str]) -> None:
        self.rng = rng
        self.seen = seen
        """How often each interleaving worth checking occurred (over all schedules)."""
        self.log: list[str] = []
        state = root / "state"
        state.mkdir(mode=0o700, parents=True)
        os.chmod(state, 0o700)
        self.directory = str(root / "deadlines")
        reaper.prepare_directory(self.directory)
        everything = OfferLimits(
            Resources(**dict.fromkeys(Resources.__struct_fields__, BIG)), None, None
        )
        self.ledger = create_ledger(state, INSTALLATION, everything, everything)
        self.clock = ManualClock()
        self.obj = planlib.InputObject(
            id=new_id(), name="data.bin", bytes=len(DATA), digest=SHA, delivery="stream"
        )
        plan = plans.make_plan(
            inputs=(self.obj,), package_digest=SHA, image_digest=SHA, deployment_id="3" * 32,
            node_id="4" * 32, project_id="2" * 32, memory_bytes=1 << 30, storage_bytes=1 << 30,
        )  # fmt: skip
        self.fence = Fence(plan.attempt_id, plan.generation, planlib.plan_digest(plan))
        now = self.clock.now()
        first = leases.grant(Terms(1, self._wall_ms(rng.randint(50, 400) * MS)), now, MAX_LEASE)
        facts = HostFacts(
            slots=[SlotSpec("slot0", "cpu", 1 << 34, 10**6)],
            devices=frozenset(),
            ceiling=everything,
            now=now,
        )
        (row,) = self.ledger.admit_batch(self.ledger.bindings(), [PrepareRow(plan, first)], facts)
        assert isinstance(row, Admitted), row
        self.sequence = 1
        self.offset = 0
        self.started = False
        self.promised: int | None = None
        """The deadline of the last renewal answered OK once the reaper holds one."""
        self.handover: Lease | None = None
        """A renewal recorded in the ledger, not yet handed to the reaper."""
        self.reaping: ReaperPass | None = None
        self.stale: leases.Lease | None = None
        self.reaped = False
        self.refused_late = False

    def close(self) -> None:
        while self.reaping is not None and not self.reaping.done:
            self.reaping.step()
        self.ledger.close()

    # -- helpers ---------------------------------------------------------------------

    def _wall_ms(self, ahead_ns: int) -> int:
        return max(0, (self.clock.now().wall_ns + ahead_ns) // MS)

    def _lease(self) -> Lease:
        record = self.ledger.get(self.fence.attempt_id)
        assert record is not None
        assert record.lease is not None
        return record.lease

    def _current(self) -> bool:
        return leases.is_current(self._lease(), self.clock.now())

    def _status(self) -> lc.Status:
        record = self.ledger.get(self.fence.attempt_id)
        assert record is not None
        return record.status

    def _note(self, step: str) -> None:
        self.log.append(f"t={self.clock.boottime_ns - START_NS} {step}")

    # -- the steps -------------------------------------------------------------------

    def tick(self) -> None:
        deadline = self._lease().deadline_boottime_ns
        targets = ["ms", "10ms", "deadline", "just_before", "promised", "stale", "none"]
        target = self.rng.choice(targets)
        now = self.clock.boottime_ns
        if target == "ms":
            now += MS
        elif target == "10ms":
            now += 10 * MS
        elif target == "deadline":
            now = max(now, deadline)
        elif target == "just_before":
            now = max(now, deadline - 1)
        elif target == "promised" and self.promised is not None:
            now = max(now, self.promised)  # the reaper's deadline, maybe not the ledger's
        elif target == "stale" and self.stale is not None:
            now = max(now, self.stale.deadline_boottime_ns)  # what the monitor last read
        self.clock.boottime_ns = now
        self._note(f"tick {target}")

    def commit(self) -> None:
        status = self._status()
        if status.state != "prepared" or status.ready or self.offset == len(DATA):
            return
        current = self._current()
        self._note(f"commit offset {self.offset} (lease current: {current})")
        refusal = None
        try:
            self.ledger.commit_input_offset(
                self.fence, self.obj.id, self.offset, self.offset + 1, when=self.clock
            )
        except HostError as error:
            refusal = error.code
        if refusal is not None:
            assert refusal == "lease_expired", refusal
            assert not current, "an input commit refused with the lease current"
            return
        assert current, "an input commit recorded with the lease over"
        self.offset += 1
        if self.offset == len(DATA):
            self.ledger.apply(self.fence, lc.PrepareBegun())
            self.ledger.apply(self.fence, lc.PrepareOk(result=b"{}"))

    def start(self) -> None:
        current = self._current()
        (row,) = self.ledger.start_batch([self.fence], self.clock)
        self._note(f"start (lease current: {current}): {row}")
        if isinstance(row, Applied) and row.changed:
            assert current, "a start recorded with the lease over"
            self.seen["started"] += 1
            lease = self._lease()
            reaper.write_deadline(
                self.directory, SERVICE, lease.boot_id, lease.deadline_boottime_ns, []
            )
            self.started = True
            self.promised = lease.deadline_boottime_ns
        elif isinstance(row, HostError) and row.code == "lease_expired":
            assert not current, "a start refused lease_expired with the lease current"

    def renew_commit(self) -> None:
        if self.handover is not None:
            return
        ahead = self.rng.choice([-10 * MS, 0, 5 * MS, 50 * MS, 500 * MS])
        renewal = Terms(self.sequence + 1, self._wall_ms(ahead))
        current = self._current()
        (row,) = self.ledger.renew_batch([(self.fence, renewal)], self.clock, MAX_LEASE)
        self._note(f"renew commit +{ahead} (lease current: {current}): {type(row).__name__}")
        if isinstance(row, HostError):
            if row.code == "lease_expired":
                assert not current, "a renewal refused lease_expired with the lease current"
            return
        assert current, "a renewal recorded with the lease over"
        self.sequence += 1
        lease = row.record.lease
        assert lease is not None
        if self.started:
            self.handover = lease
        else:
            self._answered_ok(lease)

    def renew_handover(self) -> None:
        lease = self.handover
        if lease is None:
            return
        self.handover = None
        if self.reaping is not None and not self.reaping.done:
            self.seen[f"hand-over while the reaper is at {self.reaping.at}"] += 1
        moved = reaper.move(
            self.directory,
            SERVICE,
            lease.boot_id,
            lease.deadline_boottime_ns,
            [],
            pause=self._daemon_waits,
        )
        self._note(f"renew hand-over: {'moved' if moved else 'refused, reaped'}")
        self.seen["renewal answered OK" if moved else "renewal refused: reaped"] += 1
        if moved:
            assert not self.reaped, "a renewal answered OK after the reaper decided"
            self._answered_ok(lease)
            self.promised = lease.deadline_boottime_ns
        else:
            self.ledger.apply(self.fence, lc.LeaseExpired())
            self.refused_late = True
            status = self._status()
            assert status.stop_pending == "expired" or status.state == "expired", status

    def _answered_ok(self, lease: Lease) -> None:
        assert not self.reaped, "a renewal answered OK after the reaper decided"

    def _daemon_waits(self, _seconds: float) -> None:
        """`move` found the reaper's intent: the daemon waits, the reaper decides."""
        assert self.reaping is not None, "an intent with no reaper deciding"
        assert self.reaping.at == "intent", self.reaping.at
        self._reaper_goes_on()

    def reaper_begin(self) -> None:
        if self.reaping is not None and not self.reaping.done:
            return
        self._note("reaper pass begins")
        self.reaping = ReaperPass(self.directory, self.clock.boottime_ns)
        self._after_reaper_step()

    def reaper_step(self) -> None:
        if self.reaping is None or self.reaping.done:
            return
        self._reaper_goes_on()

    def _reaper_goes_on(self) -> None:
        assert self.reaping is not None
        self._note(f"reaper goes on from {self.reaping.at}")
        self.reaping.step()
        self._after_reaper_step()

    def _after_reaper_step(self) -> None:
        evidence = Path(self.directory) / (SERVICE + reaper.REAPED)
        if self.reaped or not evidence.exists():
            return
        self.reaped = True
        self.seen["reaper decided"] += 1
        judged = json.loads(evidence.read_text())
        self._note(f"reaper decided: {judged}")
        assert self.promised is not None
        assert judged["at"] >= self.promised, (
            f"the reaper decided at {judged['at']}, before the promised {self.promised}"
        )

    def monitor_read(self) -> None:
        self.stale = self._lease()
        self._note("monitor reads the record")

    def monitor_expire(self) -> None:
        if self.stale is None or leases.is_current(self.stale, self.clock.now()):
            return
        if self._status().state not in lc.ACTIVE:
            return
        current = self._current()
        applied = self.ledger.expire(self.fence, self.clock)
        self._note(f"monitor expires (lease current: {current}): {applied is not None}")
        assert (applied is not None) == (not current), "expiry against the recorded lease"
        self.seen["expiry recorded" if current is False else "stale expiry not recorded"] += 1
        self.stale = None

    def steps(self) -> list[tuple[Callable[[], None], int]]:
        """Each step with its weight: staging and the start first, then the steps whose
        interleavings matter once the reaper holds a deadline."""
        if not self.started:
            return [(self.tick, 1), (self.commit, 4), (self.start, 3), (self.renew_commit, 1),
                    (self.monitor_read, 1), (self.monitor_expire, 1)]  # fmt: skip
        return [(self.tick, 3), (self.renew_commit, 3), (self.renew_handover, 3),
                (self.reaper_begin, 3), (self.reaper_step, 3), (self.monitor_read, 2),
                (self.monitor_expire, 2)]  # fmt: skip


def run_schedule(root: Path, seed: int, seen: collections.Counter[str]) -> None:
    rng = random.Random(seed)
    world = World(root, rng, seen)
    try:
        for _ in range(STEPS):
            steps, weights = zip(*world.steps(), strict=True)
            rng.choices(steps, weights)[0]()
    except AssertionError as failure:
        trace = "\n".join(world.log)
        raise AssertionError(f"schedule seed {seed}: {failure}\n{trace}") from failure
    finally:
        world.close()
        shutil.rmtree(root)


@pytest.mark.soak
def test_random_schedules_keep_every_lease_promise(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """CI size here; `nox -s soak` (FICC_SOAK=1) runs the soak size."""
    with capsys.disabled():
        print(f"\nlease schedules: {SCHEDULES} schedules of {STEPS} steps, seed {SEED}")
    seeds = random.Random(SEED)
    seen: collections.Counter[str] = collections.Counter()
    for index in range(SCHEDULES):
        run_schedule(tmp_path / f"s{index}", seeds.getrandbits(64), seen)
    with capsys.disabled():
        print("lease schedules covered: " + ", ".join(f"{k} {v}" for k, v in sorted(seen.items())))
    if SEED != DEFAULT_SEED:
        return  # another seed reproduces a failure; coverage is checked at the default one
    for interleaving in (
        "started",
        "reaper decided",
        "renewal answered OK",
        "renewal refused: reaped",
        "hand-over while the reaper is at due",
        "hand-over while the reaper is at intent",
        "expiry recorded",
        "stale expiry not recorded",
    ):
        assert seen[interleaving], f"no schedule reached: {interleaving}"
