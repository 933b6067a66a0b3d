"""P9: many jobs at once, N short attempts in N slots of one class, N = 8 and 32.

Value: through the real daemon with the real Podman provider (attempt_support.podman_host
with 32 slots of one class, every slot a real slot filesystem and its own account), one
forked client as the transport account does what a controller would, in batches: ONE
`prepare` request of N rows, `observe` of the N fences (one request, every 50 ms) until
all are ready, ONE `start` of N rows, `observe` until all are terminal with their
cleanup confirmed, ONE `release` of N rows. Timed from sending prepare to the release
reply. Payloads: `/bin/true`, and `/bin/sleep 2`.

Baseline: N `podman run --rm` of the same image with the provider's isolation flags
(attempt_support.bare_argv), one per slot account in its own storage, all started at
once; timed from the first spawn until the last exits. Removing each account's pause
process afterwards is not timed.

Also reported: the daemon's CPU seconds per attempt over the timed round, from
/proc/PID/stat: its own threads (utime + stime), and with what its reaped children
used added (cutime + cstime: each service's main process, i.e. the `podman run` of
the job itself, and the provider's own Podman commands). Their baseline is the CPU
of one bare `podman run` (getrusage of this process's reaped children); conmon and
the containers are re-parented and counted on neither side.

Rounds: one untimed warm-up round of 32 (it loads the image into every slot's Podman
storage), then for each payload and N: rounds alternating attempt and baseline, the
median of 1 (quick) or 3, first on the idle host, then again with 4,000 idle threads
running in another process (both sides under the same background). Targets: attempt /
baseline at most 1.3x at both N and under both backgrounds; the daemon's own CPU per
attempt at most 0.2x a bare run's, with its children at most 1.3x.

Set FICC_BENCH_PYSPY=FILE to record the daemon with `py-spy record --format raw`
(collapsed stacks, on-CPU samples only) during the timed rounds.

Where the time went before the batching work (2026-12-01, one quick round per case:
8 x `true` 3.9x, 32 x `true` 4.0x, 8 x `sleep 2` 2.1x, 32 x `sleep 2` 3.5x; the
daemon's own threads 0.25-0.34 CPU s per attempt, about what a bare `podman run`
costs): start to settled alone was 2.2-2.5x the whole baseline, release 0.8x (one
`podman rm` after another), prepare to ready 0.7x (one `podman image inspect` after
another). The rows of one request reached the provider one at a time: each
attempt's work before its call takes a different time. py-spy on the daemon during
all four cases (`FICC_BENCH_PYSPY`, 200 Hz), as shares of the samples where a daemon
thread was busy: the provider's `observe`, every 10 ms for every starting attempt,
each row walking all of /proc for its account 20%; the payload gate interpreting the
same seccomp filter (a few hundred BPF instructions, ~115 evaluations) for every
attempt 17%; the host's cleanup check reading the status of every task on the host
per attempt 13%; ledger 8%; socket server 8%; the rest of the gate 6%; reading
service members 5%; creating services 4%; the provider's Podman commands 4% (most
of their cost is the Podman processes themselves, outside the daemon).

After (same day, same kind of run; the daemon's own threads 0.14-0.21 CPU s per
attempt): the busy samples for the same 80 attempts fell from 11,195 to 9,272 and
spread out: ledger 10%, the provider's `observe` 9% (one walk of /proc per
call, calls on a shared beat that backs off when a call is expensive), reading the
service cgroup trees' members 9%, socket server 9%, gate 8% (no BPF interpretation
left: the judgement of the one filter set is kept), creating services 7%, the cleanup
idle check 6% (it still reads every task's status on the host, now two lines of
each), handing work to and from the worker threads ~9%, directory fsyncs of the
attempt layout and evidence 4%, decoding each attempt's plan again on every
observation 3%. The wall time is CPU: N Podman starts fill both cores, and each
attempt costs about three bare runs of CPU (see docs/benchmarks.md): the job's own
`podman run`, the provider's `podman rm` at release (a second rootless Podman start;
the release phase alone is about half the baseline), the start shim's interpreter,
and the daemon's threads.

The provider's `podman rm` at release is gone when the removal is proven: the job runs
`podman run --rm`, the host leaves the service's main process a few seconds to finish
that removal (its wind-down), and the release reads the slot's files instead of
starting Podman again (the wrapper's exit status, the container ID, Podman's BoltDB
state database, containers-storage's container list; see the provider's removal.py).
`podman rm` runs only when any of that disagrees. The lease reaper starts once for a
batch and stays between batches (see P6).

Needs root, podman, runc and busybox-static; creates and removes its own accounts.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence

import attempt_support as p6
from daemon_support import profiled
from figures import Figure

from ficc.execution.client import Client
from ficc.execution.protocol import (
    Fence,
    ObserveRequest,
    PrepareAttempt,
    PrepareRequest,
    ReleaseRequest,
    StartRequest,
)
from ficc.execution.provider import taskindex, tasks
from ficc.execution.wire import AttemptRow, ErrorReply, ErrorRow
from ficc_provider_podman import config as podman_config
from ficc_provider_podman.account import SlotAccount
from ficc_testkit.accounts import run_as
from ficc_testkit.driver import TERMINAL, fence, renewal
from ficc_testkit.plans import new_id
from ficc_testkit.podman import PodmanWorld
from ficc_testkit.waits import now_ms

SIZES = (8, 32)
PAYLOADS = {"true": ("/bin/true",), "sleep 2": ("/bin/sleep", "2")}
SLOT_BYTES = 128 * 1024 * 1024
POLL_S = 0.05
"""A controller's pace for a batch (P6, one attempt, polls every 10 ms)."""
PHASE_TIMEOUT_S = 300.0
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def _cpu_seconds(pid: int) -> tuple[float, float]:
    """(own utime+stime, reaped children's cutime+cstime) of `pid`, in seconds."""
    with open(f"/proc/{pid}/stat", encoding="ascii") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    utime, stime, cutime, cstime = (int(x) for x in fields[11:15])
    return (utime + stime) / CLOCK_TICKS, (cutime + cstime) / CLOCK_TICKS


def _batched_round(world: PodmanWorld, count: int, payload: tuple[str, ...]) -> dict[str, float]:
    """One timed round of `count` attempts through the daemon (see the docstring)."""
    plans = [p6.true_plan(world, payload) for _ in range(count)]
    expires = now_ms() + 300_000
    request = PrepareRequest(
        version=1,
        id=new_id(),
        **world.bindings(),
        attempts=[PrepareAttempt(plan=p, lease=renewal(p, 1, expires)) for p in plans],
    )
    socket = world.socket
    pid = world.process.process.pid  # type: ignore[union-attr]
    own, children = _cpu_seconds(pid)
    raw = run_as(world.transport, lambda: json.dumps(asyncio.run(_round(socket, request))).encode())
    own_after, children_after = _cpu_seconds(pid)
    result = json.loads(raw)
    world.plans.clear()
    if result.pop("error"):
        for plan in plans:
            world.finish(plan)
        raise RuntimeError(f"the benchmark round did not finish: {raw!r}")
    result["cpu_own"] = own_after - own
    result["cpu_children"] = children_after - children
    return result


async def _round(socket: str, prepare: PrepareRequest) -> dict[str, object]:
    """Runs in the transport account's child: the timed round."""
    client = Client(socket, read_timeout=PHASE_TIMEOUT_S)
    fences = [fence(a.plan) for a in prepare.attempts]
    began = time.perf_counter()
    _rows(await client.request(prepare))
    ready = await _poll(client, fences, lambda r: r.ready or r.state != "prepared")
    readied = time.perf_counter()
    _rows(await client.request(StartRequest(version=1, id=new_id(), attempts=fences)))
    done = await _poll(client, fences, lambda r: r.state in TERMINAL and r.cleanup_confirmed)
    finished = time.perf_counter()
    released = _rows(await client.request(ReleaseRequest(version=1, id=new_id(), attempts=fences)))
    ended = time.perf_counter()
    error = None
    if any((r.state, r.ready) != ("prepared", True) for r in ready):
        error = f"not ready: {[r for r in ready if not r.ready][:1]}"
    elif any((r.state, r.exit_code) != ("succeeded", 0) for r in done):
        error = f"not succeeded: {[r for r in done if r.exit_code != 0][:1]}"
    elif any(r.state != "released" for r in released):
        error = f"not released: {released[:1]}"
    return {
        "whole": ended - began,
        "prepare_to_ready": readied - began,
        "start_to_settled": finished - readied,
        "release": ended - finished,
        "error": error,
    }


async def _poll(
    client: Client, fences: list[Fence], accept: Callable[[AttemptRow], bool]
) -> list[AttemptRow]:
    deadline = time.monotonic() + PHASE_TIMEOUT_S
    while True:
        request = ObserveRequest(version=1, id=new_id(), attempts=fences)
        rows = _rows(await client.request(request))
        if all(accept(r) for r in rows):
            return rows
        if time.monotonic() > deadline:
            raise RuntimeError(f"no progress within {PHASE_TIMEOUT_S} s: {rows[:2]}")
        await asyncio.sleep(POLL_S)


def _rows(reply: object) -> list[AttemptRow]:
    if isinstance(reply, ErrorReply):
        raise RuntimeError(f"refused: {reply.error.code}: {reply.error.message}")
    found = []
    for row in reply.results:  # type: ignore[attr-defined]
        if isinstance(row, ErrorRow):
            raise RuntimeError(f"row refused: {row.error.code}: {row.error.message}")
        assert isinstance(row, AttemptRow), row
        found.append(row)
    return found


def _bare_round(world: PodmanWorld, count: int, payload: tuple[str, ...]) -> tuple[float, float]:
    """`count` bare `podman run --rm`, one per slot account, started at once: (seconds,
    CPU seconds of the reaped `podman run` processes)."""
    config = podman_config.load(world.layout.config.providers[0].configuration)
    slots = [
        SlotAccount(account.uid, account.gid, str(path))
        for account, path in zip(world.slots, world.layout.slot_paths, strict=True)
    ][:count]
    argvs = [p6.bare_argv(slot, config, world.image, payload) for slot in slots]
    cpu = _children_cpu()
    start = time.perf_counter()
    children = [
        subprocess.Popen(argv, stdout=subprocess.DEVNULL, cwd=slot.config_home)
        for argv, slot in zip(argvs, slots, strict=True)
    ]
    statuses = [child.wait() for child in children]
    elapsed = time.perf_counter() - start
    cpu = _children_cpu() - cpu
    for slot in slots:
        p6.bare_cleanup(slot)
    if any(statuses):
        raise RuntimeError(f"a bare podman run failed: {statuses}")
    return elapsed, cpu


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _figures(
    label: str, count: int, rounds: Sequence[dict[str, float]], bares: Sequence[tuple[float, float]]
) -> list[Figure]:
    baseline = statistics.median(b[0] for b in bares)
    bare_cpu = statistics.median(b[1] for b in bares) / count
    whole = statistics.median(r["whole"] for r in rounds)
    cpu = statistics.median(r["cpu_own"] for r in rounds) / count
    cpu_children = statistics.median(r["cpu_children"] for r in rounds) / count
    phases = {
        k: statistics.median(r[k] for r in rounds)
        for k in ("prepare_to_ready", "start_to_settled", "release")
    }
    name = f"{count} x `{label}` batched via daemon vs {count} podman run"
    figures = [Figure("P9", name, whole * 1000, "ms", baseline * 1000, whole / baseline, 1.3)]
    for phase, value in phases.items():
        figures.append(
            Figure("P9", f"  {phase}", value * 1000, "ms", baseline * 1000, value / baseline)
        )
    figures.append(
        Figure(
            "P9",
            "  daemon CPU s per attempt (own threads)",
            cpu,
            "s",
            bare_cpu,
            cpu / bare_cpu,
            0.2,
        )
    )
    figures.append(
        Figure(
            "P9",
            "  + its reaped children (shims, podman runs, provider's podman)",
            cpu + cpu_children,
            "s",
            bare_cpu,
            (cpu + cpu_children) / bare_cpu,
            1.3,
        )
    )
    return figures


BUSY_HOST_THREADS = 4000
"""The second background: idle threads elsewhere on the host, as a workstation with a
browser or a server with a database has (a walk of /proc costs in proportion)."""

_IDLE_THREADS = r"""
import sys, threading
threading.stack_size(64 << 10)
hold = threading.Event()
for _ in range(int(sys.argv[1])):
    threading.Thread(target=hold.wait, daemon=True).start()
print("idle", flush=True)
sys.stdin.read()
"""


@contextlib.contextmanager
def idle_threads(count: int) -> Iterator[None]:
    """`count` idle threads in another process for as long as the block runs."""
    if not count:
        yield
        return
    holder = subprocess.Popen(
        [sys.executable, "-c", _IDLE_THREADS, str(count)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    try:
        assert holder.stdout is not None
        assert holder.stdout.readline() == b"idle\n"
        yield
    finally:
        holder.kill()
        holder.wait()


def _check_cost(repeat: int) -> Figure:
    """CPU of one "is anything of this account left?" answer with 4,000 idle threads on
    the host: from the kernel-fed task index (what the daemon uses) against a walk of
    every thread (what it did before, and does where the proc connector is missing)."""
    told = taskindex.Told()
    if told.start() is not None:
        raise RuntimeError("the proc connector is not available (run the benchmarks as root)")
    try:
        with idle_threads(BUSY_HOST_THREADS):
            told_cpu = _cpu_of(lambda: told.live_tasks({2**31 - 3}), repeat)
            walk_cpu = _cpu_of(lambda: tasks.live_tasks({2**31 - 3}), repeat)
    finally:
        told.close()
    name = f"slot-account check, {BUSY_HOST_THREADS:,} idle threads: task index vs walk"
    return Figure("P9", name, told_cpu * 1000, "ms", walk_cpu * 1000, told_cpu / walk_cpu)


def _cpu_of(check: Callable[[], object], repeat: int) -> float:
    """The median CPU seconds (this process's) of one call of `check`."""
    samples = []
    for _ in range(repeat):
        begun = time.process_time()
        check()
        samples.append(time.process_time() - begun)
    return statistics.median(samples)


def run(quick: bool) -> list[Figure]:
    repeat = 1 if quick else 3
    figures: list[Figure] = [_check_cost(5 if quick else 21)]
    with p6.podman_host(slots=max(SIZES), slot_bytes=SLOT_BYTES) as world:
        pid = world.process.process.pid  # type: ignore[union-attr]
        _batched_round(world, max(SIZES), PAYLOADS["true"])  # loads the image: not timed
        with profiled(pid):
            for background in (0, BUSY_HOST_THREADS):
                with idle_threads(background):
                    for label, payload in PAYLOADS.items():
                        for count in SIZES:
                            rounds, bares = [], []
                            for _ in range(repeat):
                                rounds.append(_batched_round(world, count, payload))
                                bares.append(_bare_round(world, count, payload))
                            where = (
                                f", {background:,} idle threads on the host" if background else ""
                            )
                            figures += _figures(label + where, count, rounds, bares)
    return figures
