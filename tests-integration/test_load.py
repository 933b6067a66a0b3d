"""Load (reliability target R5): 64 concurrent clients, mixed and malformed requests, for a while.

64 client processes (32 forked as the transport account on transport.sock, 32 as root
on admin.sock) each send, one connection per request as the protocol says, a seeded
random mix for the test's duration (10 s in CI, 60 s with FICC_SOAK=1):

- `snapshot`;
- `observe` of 1..8 real attempts;
- `renew` of its own view of a real attempt (sequences spaced per client, so renewals
  of one attempt from several clients may lose the race: `lease_sequence` per row);
- `input_status` of a real attempt's streamed input, not yet written;
- `collect` of attempts this host never saw (`unknown_attempt` per row);
- bad frames: bytes that are not JSON, an unknown action, an unsupported version, a
  request that fails validation, a length header over the 12 MiB bound.

Every reply must be exactly what the protocol documents for that request: the success
shape, a documented per-row refusal named above, the bad frame's own refusal code, or
`busy` (the connection bound; a reply with request ID zero). Afterwards the daemon is
alive and still answers, logged no `internal` failure, holds no more open file
descriptors than before the load (counted in /proc/PID/fd after a warm-up), and its
resident memory grew by a bounded amount.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import socket
import time
from collections import Counter
from typing import Any

import msgspec
import pytest

from ficc.execution.frames import HEADER, REPLY_MAX, REQUEST_MAX
from ficc.execution.plan import Plan
from ficc.execution.protocol import (
    CollectRequest,
    InputStatusRequest,
    ObjectRef,
    ObserveRequest,
    Read,
    RenewRequest,
    Request,
    SnapshotRequest,
    encode_request,
)
from ficc_testkit.digests import fake
from ficc_testkit.driver import StreamedInput, fence, renewal, row_code, rows
from ficc_testkit.host import Daemon
from ficc_testkit.plans import new_id
from ficc_testkit.waits import now_ms, wait_for

CLIENTS = 64
SOAK = os.environ.get("FICC_SOAK") == "1"
SECONDS = 60.0 if SOAK else 10.0
RSS_GROWTH_BOUND = 32 * 1024 * 1024
"""Resident growth allowed over the whole run: a leak of even a few hundred bytes per
request would pass it within a minute of load, a per-connection buffer leak would not."""

KINDS = ("snapshot", "observe", "renew", "input_status", "collect_unknown", "bad")
BAD_FRAMES: list[tuple[bytes, str]] = [
    (b"\xff\xfe not json", "bad_frame"),
    (b'{"version":1,"id":"' + b"a" * 32 + b'","action":"launch"}', "unsupported_action"),
    (b'{"version":2,"id":"' + b"a" * 32 + b'","action":"snapshot"}', "unsupported_version"),
    (b'{"version":1,"id":"' + b"a" * 32 + b'","action":"observe","attempts":[]}',
     "invalid_request"),
]  # fmt: skip
OVERSIZED = "frame_too_large"
ROW_REFUSALS = {
    "renew": {"lease_sequence"},
    "collect_unknown": {"unknown_attempt"},
}


@pytest.fixture
def world(daemon: Daemon) -> tuple[Daemon, list[Plan], Plan, StreamedInput]:
    """Four prepared attempts (one with a streamed input left unwritten)."""
    item = StreamedInput(os.urandom(4096))
    streamed = daemon.plan(inputs=[item])
    plans = [daemon.plan()]
    admitted = rows(daemon.prepare([*plans, streamed], expires_in_ms=590_000))
    assert all(row_code(r) is None for r in admitted), admitted
    wait_for(
        lambda: row_code(daemon.input_status(streamed, item)) != "inputs_preparing",
        "staging to be initialised",
    )
    return daemon, [*plans, streamed], streamed, item


def _frame(payload: bytes) -> bytes:
    return HEADER.pack(len(payload)) + payload


def _exchange(path: str, data: bytes) -> dict[str, Any] | None:
    """Send bytes, read one reply frame (None: closed without a reply)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(60)
        sock.connect(path)
        with contextlib.suppress(OSError):  # refused early: the refusal may be waiting
            sock.sendall(data)
        header = _recv(sock, HEADER.size)
        if header is None:
            return None
        (length,) = HEADER.unpack(header)
        assert 0 < length <= REPLY_MAX, length
        body = _recv(sock, length)
        assert body is not None, "the daemon closed inside a reply frame"
        return msgspec.json.decode(body)  # type: ignore[no-any-return]


def _recv(sock: socket.socket, n: int) -> bytes | None:
    data = b""
    while len(data) < n:
        try:
            chunk = sock.recv(n - len(data))
        except ConnectionResetError:
            chunk = b""
        if not chunk:
            return data or None
        data += chunk
    return data


class Client:
    """One client's loop: build a request of a random kind, send it, judge the reply."""

    def __init__(self, index: int, path: str, plans: list[Plan], streamed: Plan, item: str):
        self.rng = random.Random(index)
        self.path = path
        self.plans = plans
        self.streamed = streamed
        self.item = item
        self.sequence = 2 + index * 1_000_000
        self.counts: Counter[str] = Counter()
        self.unexpected: list[str] = []

    def request(self, kind: str) -> tuple[bytes, str | None, Request | None]:
        """(bytes to send, expected whole-request refusal code or None, request)."""
        if kind == "bad":
            if self.rng.random() < 0.2:
                return HEADER.pack(REQUEST_MAX + 1), OVERSIZED, None
            payload, code = self.rng.choice(BAD_FRAMES)
            return _frame(payload), code, None
        request: Request
        if kind == "snapshot":
            request = SnapshotRequest(version=1, id=new_id())
        elif kind == "observe":
            chosen = self.rng.sample(self.plans, self.rng.randint(1, len(self.plans)))
            request = ObserveRequest(version=1, id=new_id(), attempts=[fence(p) for p in chosen])
        elif kind == "renew":
            plan = self.rng.choice(self.plans)
            self.sequence += 1
            lease = renewal(plan, self.sequence, now_ms() + 580_000)
            request = RenewRequest(version=1, id=new_id(), leases=[lease])
        elif kind == "input_status":
            f = fence(self.streamed)
            ref = ObjectRef(attempt_id=f.attempt_id, generation=f.generation,
                            plan_digest=f.plan_digest, object=self.item)  # fmt: skip
            request = InputStatusRequest(version=1, id=new_id(), objects=[ref])
        else:
            read = Read(attempt_id=new_id(), generation=1, plan_digest=fake("e"),
                        object="stdout", offset=0, length=4096)  # fmt: skip
            request = CollectRequest(version=1, id=new_id(), reads=[read])
        return _frame(encode_request(request)), None, request

    def judge(self, kind: str, reply: dict[str, Any] | None, code: str | None, rid: str) -> None:
        if reply is None:
            self.unexpected.append(f"{kind}: closed without a reply")
            return
        error = reply.get("error")
        if error is not None and error.get("code") == "busy" and reply.get("id") == "0" * 32:
            self.counts["busy"] += 1
            return
        if code is not None:
            if error is None or error.get("code") != code:
                self.unexpected.append(f"{kind}: wanted {code}, got {reply}")
            else:
                self.counts[f"refused {code}"] += 1
            return
        if error is not None or reply.get("id") != rid:
            self.unexpected.append(f"{kind}: {reply}")
            return
        allowed = ROW_REFUSALS.get(kind, set())
        for row in reply.get("results", []):
            if "error" in row:
                if row["error"]["code"] not in allowed:
                    self.unexpected.append(f"{kind} row: {row}")
                    return
                self.counts[f"row {row['error']['code']}"] += 1
        self.counts[f"ok {kind}"] += 1

    def run(self, deadline: float) -> dict[str, Any]:
        while time.monotonic() < deadline:
            kind = self.rng.choice(KINDS)
            data, code, request = self.request(kind)
            reply = _exchange(self.path, data)
            self.judge(kind, reply, code, request.id if request is not None else "")
        return {"counts": dict(self.counts), "unexpected": self.unexpected[:10]}


def _fork(daemon: Daemon, index: int, world: Any, deadline: float) -> tuple[int, int]:
    _, plans, streamed, item = world
    transport = index % 2 == 0
    path = daemon.transport if transport else daemon.admin
    account = daemon.accounts["transport"] if transport else None
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        status = 0
        try:
            os.close(read_end)
            if account is not None:
                os.setgroups([])
                os.setresgid(account.gid, account.gid, account.gid)
                os.setresuid(account.uid, account.uid, account.uid)
            result = Client(index, path, plans, streamed, item.id).run(deadline)
        except BaseException as exc:  # reported by the parent
            result = {"crash": repr(exc)}
            status = 1
        with os.fdopen(write_end, "w") as out:
            json.dump(result, out)
        os._exit(status)
    os.close(write_end)
    return pid, read_end


def _fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/status", encoding="ascii") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


@pytest.mark.soak
def test_64_clients_of_mixed_and_malformed_requests_get_documented_replies(world: Any) -> None:
    daemon = world[0]
    assert daemon.process.process is not None
    pid = daemon.process.process.pid
    # warm-up: every kind once, so lazily opened files and threads exist before counting
    warm = Client(1, daemon.admin, world[1], world[2], world[3].id)
    warm.run(time.monotonic() + 1.0)
    assert warm.unexpected == [], warm.unexpected
    fds_before, rss_before = _fds(pid), _rss(pid)

    deadline = time.monotonic() + SECONDS
    children = [_fork(daemon, i, world, deadline) for i in range(CLIENTS)]
    totals: Counter[str] = Counter()
    unexpected: list[str] = []
    for child, read_end in children:
        with os.fdopen(read_end) as source:
            result = json.loads(source.read() or '{"crash": "no result"}')
        os.waitpid(child, 0)
        assert "crash" not in result, result
        totals.update(result["counts"])
        unexpected += result["unexpected"]
    print(f"replies: {dict(totals)}")

    assert unexpected == [], unexpected[:10]
    assert daemon.process.alive, daemon.process.log()
    for kind in KINDS[:-1]:
        assert totals[f"ok {kind}"] > 0, (kind, totals)
    assert daemon.snapshot().attempts  # still serving
    internal = [e for e in daemon.process.events() if e.get("code") == "internal"]
    assert internal == [], internal[:3]
    fds_after = wait_for(
        lambda: _fds(pid) if _fds(pid) <= fds_before else None,
        "the daemon's descriptors to return to their count",
        timeout=10,
    )
    assert fds_after <= fds_before
    grown = _rss(pid) - rss_before
    print(f"descriptors {fds_before} -> {fds_after}; resident growth {grown} bytes")
    assert grown < RSS_GROWTH_BOUND, f"resident memory grew by {grown} bytes"
