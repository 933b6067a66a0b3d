"""P8: control-plane latency: `renew` and `observe` of 64 attempts per request.

Value: 8 concurrent clients, each a process forked as the transport account, each with
its own 64 prepared and ready attempts (512 in all, on 512 slots), alternate a `renew`
of its 64 leases (a fresh, higher sequence each time) and an `observe` of the same 64
fences over transport.sock, one request per connection as the protocol says. Every
request is encoded before the clock starts; a request's latency is connect, send, and
the whole reply frame received. Every renew row must come back as an attempt row (no
refusal), checked after the timed loop.

Baseline: a bare frame echo over the same kind of socket: a tiny asyncio server
(uvloop, as the daemon) on a Unix socket in its own process reads one frame and writes
it back; the same 8 clients send it the same frames in the same pattern.

Figures: p50 and p99 of each action and of the echo; the target wants each p99 at most
10x the echo's p99 and each p50 at most 20x the echo's p50 (ratio = value / baseline,
lower is better). Full runs interleave 3 rounds (echo, then daemon, 100 renew +
100 observe per client each) and report the median of the rounds' percentiles: the
echo's p99 on 2 cores shared by 8 clients is mostly scheduling noise. A last line,
without a target, is the daemon's CPU (all its threads) per request against the echo
server's: the daemon is bound by its one interpreter, so this is what its latency
follows.

Set FICC_BENCH_PYSPY=FILE to record the daemon with py-spy during its rounds.
"""

from __future__ import annotations

import asyncio
import os
import pathlib
import shutil
import signal
import statistics
import tempfile
from collections.abc import Sequence

from daemon_support import (
    MIB,
    BenchHost,
    SlotPlan,
    bench_host,
    decode,
    profiled,
    timed_exchanges,
)
from figures import Figure

from ficc.execution.frames import HEADER
from ficc.execution.plan import Plan
from ficc.execution.protocol import ObserveRequest, RenewRequest, encode_request
from ficc_testkit.driver import fence, renewal
from ficc_testkit.plans import new_id
from ficc_testkit.waits import now_ms

CLIENTS = 8
ROWS = 64


def _frames(host: BenchHost, plans: Sequence[Plan], pairs: int) -> list[bytes]:
    """`pairs` x (renew, observe) of these plans, renew sequences 2, 3, ..."""

    fences = [fence(p) for p in plans]
    frames = []
    expires = now_ms() + 500_000
    for n in range(pairs):
        leases = [renewal(p, 2 + n, expires + n) for p in plans]
        frames.append(encode_request(RenewRequest(version=1, id=new_id(), leases=leases)))
        frames.append(encode_request(ObserveRequest(version=1, id=new_id(), attempts=fences)))
    return frames


def _run_clients(host: BenchHost, path: str, frames: list[list[bytes]]) -> list[list[float]]:
    """Each client's per-request latencies; all clients start together (a shared pipe)."""
    go_read, go_write = os.pipe()
    children = []
    for mine in frames:
        read_end, write_end = os.pipe()
        pid = os.fork()
        if pid == 0:  # child: drop to the transport account, wait for the start signal
            status = 0
            try:
                os.close(read_end)
                os.close(go_write)
                account = host.transport_account
                os.setgroups([])
                os.setresgid(account.gid, account.gid, account.gid)
                os.setresuid(account.uid, account.uid, account.uid)
                os.read(go_read, 1)
                _, latencies, replies = timed_exchanges(path, mine)
                for payload, reply in zip(mine, replies, strict=True):
                    _check(payload, reply)
                out = repr(latencies).encode()
            except BaseException as exc:
                out = b"X" + repr(exc).encode()
                status = 1
            with os.fdopen(write_end, "wb") as sink:
                sink.write(out)
            os._exit(status)
        os.close(write_end)
        children.append((pid, read_end))
    os.close(go_read)
    os.write(go_write, b"g" * len(children))
    os.close(go_write)
    results = []
    for pid, read_end in children:
        with os.fdopen(read_end, "rb") as source:
            data = source.read()
        os.waitpid(pid, 0)
        if data.startswith(b"X") or not data:
            raise RuntimeError(f"a P8 client failed: {data[1:].decode()}")
        results.append([float(x) for x in data.strip(b"[]").split(b",")])
    return results


def _check(request: bytes, reply: bytes) -> None:
    """The daemon answered every row with an attempt row (echo: the same bytes back)."""
    if reply == request:
        return
    body = decode(reply)
    rows = body.get("results")
    assert rows is not None, body.get("error", body)
    assert len(rows) == ROWS, body
    refused = [r for r in rows if "error" in r]
    assert not refused, refused[0]


async def _echo_server(path: str) -> None:
    async def one(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        header = await reader.readexactly(HEADER.size)
        (length,) = HEADER.unpack(header)
        payload = await reader.readexactly(length)
        writer.write(header + payload)
        await writer.drain()
        writer.close()

    server = await asyncio.start_unix_server(one, path, backlog=64)
    os.chmod(path, 0o666)
    async with server:
        await server.serve_forever()


def _start_echo(directory: str) -> tuple[int, str]:
    path = os.path.join(directory, "echo.sock")
    ready_read, ready_write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(ready_read)
        try:
            import uvloop  # noqa: PLC0415

            loop = uvloop.new_event_loop()

            async def main() -> None:
                task = asyncio.ensure_future(_echo_server(path))
                while not os.path.exists(path):
                    await asyncio.sleep(0.001)
                os.write(ready_write, b"r")
                await task

            loop.run_until_complete(main())
        finally:
            os._exit(0)
    os.close(ready_write)
    assert os.read(ready_read, 1) == b"r", "the echo server did not start"
    os.close(ready_read)
    return pid, path


def _cpu_seconds(pid: int) -> float:
    """CPU time of process `pid`'s live threads so far, from the scheduler's own
    nanosecond counts (/proc's tick counts are 10 ms coarse)."""
    total = 0
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/schedstat", "rb") as stat:
                total += int(stat.read().split()[0])
        except FileNotFoundError:  # the thread ended
            continue
    return total / 1e9


def _percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _round_percentiles(latencies: list[list[float]], step: int, first: int) -> tuple[float, float]:
    """(p50, p99) in ms of every client's requests `first::step` in one round."""
    samples = [x for client in latencies for x in client[first::step]]
    return _percentile(samples, 0.50) * 1000.0, _percentile(samples, 0.99) * 1000.0


def run(quick: bool) -> list[Figure]:
    pairs, rounds = (15, 1) if quick else (100, 3)
    slots = [SlotPlan("small", 16 * MIB) for _ in range(CLIENTS * ROWS)]
    echo_rounds, renew_rounds, observe_rounds = [], [], []
    echo_cpu = daemon_cpu = 0.0
    with bench_host(slots) as host:
        plans = [host.plan() for _ in range(CLIENTS * ROWS)]
        for start in range(0, len(plans), ROWS):
            host.prepare(plans[start : start + ROWS])
        host.wait_ready(plans)
        frames = [
            _frames(host, plans[i * ROWS : (i + 1) * ROWS], pairs * rounds) for i in range(CLIENTS)
        ]
        echo_dir = tempfile.mkdtemp(prefix="ficc-p8-echo-", dir=str(host.base))
        os.chmod(echo_dir, 0o755)
        echo_pid, echo_path = _start_echo(echo_dir)
        try:
            _run_clients(host, echo_path, [f[:4] for f in frames])  # warm-up
            for r in range(rounds):  # interleaved, so drift hits both sides alike
                mine = [f[r * 2 * pairs : (r + 1) * 2 * pairs] for f in frames]
                before = _cpu_seconds(echo_pid)
                echo_rounds.append(_round_percentiles(_run_clients(host, echo_path, mine), 1, 0))
                echo_cpu += _cpu_seconds(echo_pid) - before
                before = _cpu_seconds(host.pid)
                with profiled(host.pid):
                    daemon = _run_clients(host, host.transport, mine)
                daemon_cpu += _cpu_seconds(host.pid) - before
                renew_rounds.append(_round_percentiles(daemon, 2, 0))
                observe_rounds.append(_round_percentiles(daemon, 2, 1))
        finally:
            os.kill(echo_pid, signal.SIGKILL)
            os.waitpid(echo_pid, 0)
            shutil.rmtree(pathlib.Path(echo_dir), ignore_errors=True)
    echo50 = statistics.median(r[0] for r in echo_rounds)
    echo99 = statistics.median(r[1] for r in echo_rounds)
    figures = []
    for name, measured in (("renew", renew_rounds), ("observe", observe_rounds)):
        p50 = statistics.median(r[0] for r in measured)
        p99 = statistics.median(r[1] for r in measured)
        figures.append(
            Figure("P8", f"{name} 64 rows, 8 clients: p50 vs echo p50", p50, "ms", echo50,
                   p50 / echo50, target=20.0)
        )  # fmt: skip
        figures.append(
            Figure("P8", f"{name} 64 rows, 8 clients: p99 vs echo p99", p99, "ms", echo99,
                   p99 / echo99, target=10.0)
        )  # fmt: skip
    requests = CLIENTS * 2 * pairs * rounds
    figures.append(
        Figure("P8", "daemon CPU per request (renew and observe alike)",
               daemon_cpu / requests * 1000, "ms", echo_cpu / requests * 1000,
               daemon_cpu / echo_cpu)
    )  # fmt: skip
    return figures
