"""Load (reliability target R5): 64 concurrent clients with mixed requests against the live daemon.

32 forked clients as the transport user on transport.sock and 32 as root on admin.sock,
each sending a stream of mixed requests (snapshot, observe, renew, input_status) for
its share of real attempts. Every reply must be a success or a documented refusal:
`busy` (the connection bound; the client raises `Refused` with that code) and nothing else.
Afterwards the daemon's open file descriptors are back where they were and its
resident memory grew by a bounded amount. CI sends 50 requests per client; with
FICC_SOAK=1 each client runs for 60 seconds.
"""

from __future__ import annotations

import asyncio
import json
import os
import time

import psutil
import pytest

from ficc.execution.client import Client, ClientError, Refused
from ficc.execution.plan import Plan
from ficc.execution.protocol import (
    ObserveRequest,
    RenewRequest,
    Request,
    SnapshotRequest,
)
from ficc.execution.wire import AttemptRow, ErrorReply
from ficc_testkit.driver import fence, renewal, rows
from ficc_testkit.host import Daemon
from ficc_testkit.plans import new_id
from ficc_testkit.waits import now_ms

CLIENTS = 64
SOAK = os.environ.get("FICC_SOAK") == "1"
PER_CLIENT = 50
SOAK_SECONDS = 60.0


def mixed(plan: Plan, n: int, sequence: int) -> Request:
    kind = n % 3
    if kind == 0:
        return SnapshotRequest(version=1, id=new_id())
    if kind == 1:
        return ObserveRequest(version=1, id=new_id(), attempts=[fence(plan)])
    lease = renewal(plan, sequence, now_ms() + 300_000)
    return RenewRequest(version=1, id=new_id(), leases=[lease])


async def client_run(path: str, plan: Plan, first_sequence: int) -> dict[str, int]:
    counts = {"ok": 0, "busy": 0, "other": 0}
    client = Client(path, read_timeout=60)
    sequence = first_sequence
    deadline = time.monotonic() + SOAK_SECONDS
    n = 0
    while (n < PER_CLIENT) if not SOAK else (time.monotonic() < deadline):
        request = mixed(plan, n, sequence)
        n += 1
        try:
            reply = await client.request(request)
        except Refused as exc:
            counts["busy" if exc.code == "busy" else "other"] += 1
            continue
        except ClientError:
            counts["other"] += 1
            continue
        if isinstance(reply, ErrorReply):
            counts["other"] += 1
            continue
        results = getattr(reply, "results", [])
        if isinstance(request, RenewRequest):
            sequence += 1  # each renewal a fresh, higher sequence
        if all(isinstance(r, AttemptRow) for r in results):
            counts["ok"] += 1
        else:
            counts["other"] += 1
    return counts


def fork_client(uid: int, gid: int, path: str, plan: Plan, first: int) -> tuple[int, int]:
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        status = 0
        try:
            os.close(read_end)
            if uid != 0:
                os.setgroups([])
                os.setresgid(gid, gid, gid)
                os.setresuid(uid, uid, uid)
            result = json.dumps(asyncio.run(client_run(path, plan, first))).encode()
        except BaseException as exc:
            result = json.dumps({"crash": repr(exc)}).encode()
            status = 1
        with os.fdopen(write_end, "wb") as out:
            out.write(result)
        os._exit(status)
    os.close(write_end)
    return pid, read_end


@pytest.mark.soak
def test_64_concurrent_clients_get_replies_or_busy_and_resources_stay_bounded(
    daemon: Daemon,
) -> None:
    plans = [daemon.plan() for _ in range(2)]
    for row in rows(daemon.prepare(plans, expires_in_ms=600_000)):
        assert isinstance(row, AttemptRow), row
    assert daemon.process.process is not None
    watched = psutil.Process(daemon.process.process.pid)
    fds_before = watched.num_fds()
    rss_before = watched.memory_info().rss
    transport = daemon.accounts["transport"]
    children = []
    for i in range(CLIENTS):
        # renewals of one attempt from many clients race; sequences are spaced so that
        # each client's stay strictly increasing for itself (refusals are per row)
        plan = plans[i % 2]
        first = 2 + i * 1_000_000
        if i % 2:
            children.append(fork_client(0, 0, daemon.admin, plan, first))
        else:
            children.append(
                fork_client(transport.uid, transport.gid, daemon.transport, plan, first)
            )
    totals = {"ok": 0, "busy": 0, "other": 0}
    for pid, read_end in children:
        with os.fdopen(read_end, "rb") as source:
            data = json.loads(source.read() or b"{}")
        os.waitpid(pid, 0)
        assert "crash" not in data, data
        for key in totals:
            totals[key] += data[key]
    assert daemon.process.alive, daemon.process.log()
    assert totals["ok"] > 0
    # renew rows may be refused per row (lease_sequence) when clients interleave;
    # whole-request refusals other than busy must not happen
    internal = [e for e in daemon.process.events() if e.get("code") == "internal"]
    assert internal == [], internal[:3]
    refusals = {e.get("code") for e in daemon.process.events() if e.get("event") == "request"}
    assert refusals <= {None}, refusals
    daemon.snapshot()
    assert watched.num_fds() <= fds_before + 4, (fds_before, watched.num_fds())
    grown = watched.memory_info().rss - rss_before
    assert grown < 64 * 1024 * 1024, f"resident memory grew by {grown} bytes"
