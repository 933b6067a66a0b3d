"""Real processes: the lock across processes, kill -9, and the R1 crash loop."""

from __future__ import annotations

import os
import pathlib
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator

import pytest

import ficc.hoststate as hs
from ficc.hoststate import Status, acquire
from ficc.hoststate.model import can_transition
from hs_mutator import mutate, op_name, stop_at_marker
from hs_support import HOST, plan, soak_size

TESTS = pathlib.Path(__file__).resolve().parent


def python_child(code: str) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), *sys.path])}
    return subprocess.Popen(
        [sys.executable, "-c", f"import hs_mutator as m; {code}"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip


@pytest.fixture
def holder(store: pathlib.Path) -> Iterator[subprocess.Popen[str]]:
    """Another process holding the host lock (it says "held" once it does)."""
    child = python_child(f"m.hold({str(store)!r})")
    assert child.stdout is not None
    assert child.stdout.readline() == "held\n"
    yield child
    if child.poll() is None:
        child.kill()
    child.wait()


def fork(body: Callable[[], None]) -> int:
    """Run `body` in a forked child that can never return into pytest."""
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            body()
        except BaseException as exc:
            sys.stderr.write(f"child failed: {exc!r}\n")
            code = 1
        finally:
            os._exit(code)
    return pid


def test_second_acquire_in_another_process_is_refused(
    store: pathlib.Path, holder: subprocess.Popen[str]
) -> None:
    with pytest.raises(hs.Locked):
        acquire(store, HOST)
    assert holder.poll() is None


def test_kill_9_of_the_holder_releases_the_lock(
    store: pathlib.Path, holder: subprocess.Popen[str]
) -> None:
    with pytest.raises(hs.Locked):
        acquire(store, HOST)
    holder.send_signal(signal.SIGKILL)
    assert holder.wait() == -signal.SIGKILL
    with acquire(store, HOST) as s:  # the kernel released it when the process died
        s.begin("op-1", plan(1))


def test_other_process_refused_while_we_hold(store: pathlib.Path) -> None:
    with acquire(store, HOST):
        child = python_child(f"m.try_acquire({str(store)!r})")
        out, _ = child.communicate()
        assert out.strip() == "locked"
    child = python_child(f"m.try_acquire({str(store)!r})")
    out, _ = child.communicate()
    assert out.strip() == "acquired"


def test_forked_child_cannot_use_the_parents_session(store: pathlib.Path) -> None:
    with acquire(store, HOST) as s:
        s.begin("op-1", plan(1))
        r, w = os.pipe()

        def child() -> None:
            os.close(r)
            try:
                s.get("op-1")
                os.write(w, b"usable")
            except hs.Closed:
                os.write(w, b"closed")

        pid = fork(child)
        os.close(w)
        assert os.read(r, 100) == b"closed"
        os.close(r)
        assert os.waitpid(pid, 0)[1] == 0
        with pytest.raises(hs.Locked):  # the child's exit did not release our lock
            acquire(store, HOST)
        assert s.advance("op-1", 1, Status.RUNNING).revision == 2


def test_forked_grandchild_does_not_keep_the_lock_alive(store: pathlib.Path) -> None:
    """The holder forks (without exec) and is killed; its child must not hold the lock."""
    report_r, report_w = os.pipe()
    block_r, block_w = os.pipe()

    def grandchild() -> None:
        os.write(report_w, b"ready\n")  # its fork hook has run: the copied fd is closed
        os.read(block_r, 1)  # EOF once the test closes the last write end

    def holder() -> None:
        os.close(block_w)
        os.close(report_r)
        with acquire(store, HOST):
            pid = fork(grandchild)
            os.write(report_w, f"{pid}\n".encode())
            os.read(block_r, 1)

    pid = fork(holder)
    os.close(report_w)
    os.close(block_r)
    lines = b""
    while lines.count(b"\n") < 2:  # the grandchild's pid and its "ready", in any order
        lines += os.read(report_r, 100)
    grandchild_pid = next(int(x) for x in lines.split() if x.isdigit())
    os.close(report_r)
    try:
        with pytest.raises(hs.Locked):
            acquire(store, HOST)
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        os.kill(grandchild_pid, 0)  # still alive, with a copy of the holder's memory
        with acquire(store, HOST) as s:
            s.begin("op-1", plan(1))
    finally:
        os.close(block_w)  # the grandchild reads EOF and exits


def test_crash_between_first_snapshot_and_marker_is_repaired(store: pathlib.Path) -> None:
    report_r, report_w = os.pipe()
    wait_r, wait_w = os.pipe()
    pid = fork(lambda: stop_at_marker(str(store), report_w, wait_r))
    os.close(report_w)
    os.close(wait_r)
    assert os.read(report_r, 100) == b"at-marker\n"
    os.kill(pid, signal.SIGKILL)
    assert os.waitpid(pid, 0)[1] == signal.SIGKILL
    os.close(report_r)
    os.close(wait_w)
    assert (store / "host.lock").read_bytes() == b""  # killed before the marker
    assert (store / "state.json").exists()
    with acquire(store, HOST) as s:
        op = s.get("op-1")
        assert (op.status, op.revision) == (Status.QUEUED, 1)
    assert b'"host_id":"host-a"' in (store / "host.lock").read_bytes()


# --- R1: kill -9 at random points of a mutation loop -------------------------------


class Acks:
    """The parent's record of what the child acknowledged, and the checks after a kill."""

    def __init__(self) -> None:
        self.ops: dict[str, tuple[int, Status]] = {}
        self.count = 0

    def add(self, line: str) -> None:
        op_id, revision, status = line.split()
        self.ops[op_id] = (int(revision), Status(status))
        self.count += 1

    def next_index(self) -> int:
        """The number of the first operation the child has not acknowledged."""
        return max((int(k.split("-")[1]) + 1 for k in self.ops), default=0)

    def check_against(self, session: hs.Session, first_unseen: str) -> None:
        """Every acknowledged transition is present; at most one unacknowledged step."""
        ahead = []
        for op_id, (revision, status) in self.ops.items():
            stored = session.get(op_id)
            assert stored.revision >= revision, f"{op_id}: acked r{revision} lost"
            if stored.revision == revision:
                assert stored.status is status, f"{op_id}: acked {status}, got {stored}"
            else:
                assert stored.revision == revision + 1, f"{op_id}: jumped {revision}->{stored}"
                assert can_transition(status, stored.status), f"{op_id}: {status}->{stored}"
                ahead.append(op_id)
            self.ops[op_id] = (stored.revision, stored.status)
        try:
            extra = session.get(first_unseen)
        except hs.NotFound:
            pass
        else:  # a begin that completed on disk but was killed before its ack
            assert (extra.status, extra.revision) == (Status.QUEUED, 1)
            ahead.append(first_unseen)
            self.ops[first_unseen] = (1, Status.QUEUED)
        assert len(ahead) <= 1, f"more than one unacknowledged change: {ahead}"


def read_acks(fd: int, want: int, acks: Acks, buffer: list[bytes]) -> bool:
    """Read until `want` more acknowledgements arrived (True) or the pipe closed."""
    target = acks.count + want
    while acks.count < target:
        chunk = os.read(fd, 65536)
        if not chunk:
            return False
        buffer.append(chunk)
        *lines, rest = b"".join(buffer).split(b"\n")
        buffer[:] = [rest]
        for line in lines:
            acks.add(line.decode())
    return True


@pytest.mark.soak
def test_r1_kill_9_at_random_points(store: pathlib.Path) -> None:
    kills = soak_size(ci=200, soak=5000)
    rng = random.Random(20261129)
    acks = Acks()
    for round_no in range(kills):
        ack_r, ack_w = os.pipe()
        nxt = acks.next_index()
        pid = fork(lambda: mutate(str(store), round_no, max(nxt - 1, 0), ack_w))  # noqa: B023
        os.close(ack_w)
        buffer: list[bytes] = []
        alive = read_acks(ack_r, rng.randint(0, 12), acks, buffer)
        assert alive, f"round {round_no}: the mutating child died on its own"
        spin_until = time.perf_counter() + rng.uniform(0, 0.002)  # sub-ms kill jitter
        while time.perf_counter() < spin_until:
            pass
        os.kill(pid, signal.SIGKILL)
        _, status = os.waitpid(pid, 0)
        assert os.WIFSIGNALED(status), f"round {round_no}: child exited ({status}), see stderr"
        assert os.WTERMSIG(status) == signal.SIGKILL
        read_acks(ack_r, 1 << 30, acks, buffer)  # acks written before the kill count too
        os.close(ack_r)
        with acquire(store, HOST) as session:  # every reopen succeeds (verified snapshot)
            acks.check_against(session, op_name(acks.next_index()))
    assert acks.count > kills, "the loop acknowledged too little to mean anything"
    remnants = [p.name for p in store.iterdir() if ".tmp." in p.name]
    print(f"R1: {kills} kills, {acks.count} acknowledged calls, {len(acks.ops)} operations,"
          f" {len(remnants)} temporary remnants left by kills (ignored)")  # fmt: skip
