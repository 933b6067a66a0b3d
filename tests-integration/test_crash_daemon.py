"""Crash safety (reliability target R2): SIGKILL the real daemon at random points, restart, check.

A seeded RNG drives a workload of whole attempt lives through the real daemon (admin
socket, root, so no fork per request): prepare batches (some rows beyond the two free
slots are refused durably), streamed inputs written chunk by chunk, start (the gate
refuses the unconfined test runtime, so start runs service creation, observation and
the gate, then fails), attempts held `starting` with their barrier process alive as
the slot account (`FICC_TEST_PROVIDER_HOLD`), stop, and release.

Each kill picks a phase (admission, staging, start, running, release) and the n-th
request of that phase; the daemon gets SIGKILL either right after that request's reply
(the reply is an acknowledgement; the runner's work after it is in flight) or while the
request may still be in flight (the client waits for the reply up to a random bound,
then kills: an unanswered request may or may not have been applied). The daemon is then
started again (waiting for READY=1, never a sleep) and the invariants are checked:

- no attempt lost: every prepare row that was acknowledged (admitted, or refused with
  a durable `admission_rejected` record) is in the ledger;
- nothing replayed: the test provider's call log shows at most one `probe`, `prepare`
  and `start` per attempt, across every restart;
- every acknowledged input offset is durable (`input_status`, or `staged_bytes`);
- uncertain work is `unknown`: right after a restart no attempt is starting or running,
  and one last seen starting or running is settled;
- once every settled attempt's cleanup is confirmed, no process of either slot account
  is alive (the killed daemon's services were adopted and stopped);
- no request ever failed inside the daemon (`internal`).

CI: 50 kills; FICC_SOAK=1: 1,000. FICC_CRASH_SEED picks another seed.
"""

from __future__ import annotations

import collections
import os
import random
import select
import shutil
import socket
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import psutil
import pytest

from ficc.execution.frames import HEADER, REPLY_MAX
from ficc.execution.plan import Payload, Plan
from ficc.execution.protocol import (
    InputStatusRequest,
    InputWrite,
    InputWriteRequest,
    ObjectRef,
    ObserveRequest,
    PrepareAttempt,
    PrepareRequest,
    ReleaseRequest,
    Request,
    SnapshotRequest,
    StartRequest,
    StopRequest,
    validate_request,
)
from ficc.execution.wire import (
    AttemptRow,
    AttemptStatus,
    ErrorRow,
    InputRow,
    SnapshotReply,
    decode_reply,
)
from ficc_testkit.accounts import Accounts
from ficc_testkit.daemons import DaemonProcess
from ficc_testkit.digests import digest_of
from ficc_testkit.driver import StreamedInput, fence, fence_fields, renewal, send
from ficc_testkit.host import PROVIDER_CALLS, Daemon, Layout, ensure_accounts
from ficc_testkit.plans import new_id
from ficc_testkit.slots import private_directory
from ficc_testkit.waits import now_ms, wait_for
from ficc_testkit.wheels import InstalledProvider

SOAK = os.environ.get("FICC_SOAK") == "1"
KILLS = int(os.environ.get("FICC_CRASH_KILLS", "1000" if SOAK else "50"))
SEED = int(os.environ.get("FICC_CRASH_SEED", "4202611"))
PHASES = ("admission", "staging", "start", "running", "release")
CHUNK = 64 * 1024
HOLD = {"FICC_TEST_PROVIDER_HOLD": "1"}
LIVE = {"starting", "running"}
SETTLED = {"succeeded", "failed", "cancelled", "expired", "unknown"}


class Killed(Exception):
    """The daemon was just killed; the current workload ends here."""


@dataclass
class Acknowledged:
    """What the test knows from acknowledgements, across every restart."""

    must_exist: set[str] = field(default_factory=set)
    offsets: dict[tuple[str, str], int] = field(default_factory=dict)
    last_live: set[str] = field(default_factory=set)
    plans: dict[str, Plan] = field(default_factory=dict)
    items: dict[str, StreamedInput] = field(default_factory=dict)


class Crasher:
    """The workload, the kill switch and the checks around one daemon layout."""

    def __init__(self, daemon: Daemon, rng: random.Random) -> None:
        self.daemon = daemon
        self.rng = rng
        self.known = Acknowledged()
        self.kills: collections.Counter[str] = collections.Counter()
        self.in_flight_kills = 0
        self.phase_counts: collections.Counter[str] = collections.Counter()
        self.target: tuple[str, int] | None = None
        self.logs: list[str] = []
        slots = [daemon.accounts["slot0"], daemon.accounts["slot1"]]
        self.slot_uids = {account.uid for account in slots}

    # --- requests and the kill switch -------------------------------------------------

    def arm(self) -> None:
        phase = self.rng.choice(PHASES)
        self.target = (phase, self.rng.randint(1, 2))
        self.phase_counts.clear()

    def request(self, phase: str, request: Request) -> Any:
        """Send as the administrator; the armed request is the one the daemon dies on."""
        self.phase_counts[phase] += 1
        assert self.target is not None
        if (phase, self.phase_counts[phase]) != self.target:
            reply = send(self.daemon.admin, request)
            self.note(request, reply)
            return reply
        self.kills[phase] += 1
        if self.rng.random() < 0.5:
            reply = send(self.daemon.admin, request)
            self.note(request, reply)
            self.kill()
        else:
            reply = self.send_and_kill(request, self.rng.choice([0.0, self.rng.uniform(0.0, 0.01)]))
            if reply is not None:
                self.note(request, reply)
        raise Killed(phase)

    def send_and_kill(self, request: Request, wait: float) -> Any:
        """Send, wait for the reply at most `wait` seconds, SIGKILL; the reply if whole."""
        _, payload = validate_request(request)
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.connect(self.daemon.admin)
            sock.sendall(HEADER.pack(len(payload)) + payload)
            select.select([sock], [], [], wait)
            self.kill()
            data = _read_all(sock)
        if len(data) < HEADER.size:
            self.in_flight_kills += 1
            return None
        (length,) = HEADER.unpack(data[: HEADER.size])
        assert 0 < length <= REPLY_MAX
        if len(data) < HEADER.size + length:
            self.in_flight_kills += 1
            return None
        return decode_reply(data[HEADER.size :], request.action, rows=request.row_count or None)

    def kill(self) -> None:
        self.daemon.process.kill()
        self.logs.append(self.daemon.process.log(tail=100_000))

    def restart(self) -> None:
        self.daemon.process = DaemonProcess.of(self.daemon.layout, self.daemon.provider)
        self.daemon.process.start()

    def note(self, request: Request, reply: Any) -> None:
        """Remember what the reply acknowledged."""
        results = getattr(reply, "results", None)
        if results is None:
            return
        if isinstance(request, PrepareRequest):
            for row, item in zip(results, request.attempts, strict=True):
                durable = isinstance(row, AttemptRow) or (
                    isinstance(row, ErrorRow) and row.error.code == "admission_rejected"
                )
                if durable:
                    self.known.must_exist.add(item.plan.attempt_id)
        elif isinstance(request, InputWriteRequest):
            for row, write in zip(results, request.writes, strict=True):
                if isinstance(row, InputRow):
                    key = (write.attempt_id, write.object)
                    self.known.offsets[key] = max(self.known.offsets.get(key, 0), row.offset)
        for row in results:
            if isinstance(row, AttemptRow):
                if row.state in LIVE:
                    self.known.last_live.add(row.attempt_id)
                else:
                    self.known.last_live.discard(row.attempt_id)

    # --- the workload -------------------------------------------------------------------

    def plan(self, kind: str) -> Plan:
        item = StreamedInput(os.urandom(3 * CHUNK - 100)) if kind == "stream" else None
        plan = self.daemon.plan(inputs=[item] if item else [])
        if kind == "hold":
            job = msgspec.structs.replace(plan.job, payload=Payload(argv=["/bin/true"],
                                                                    environment=HOLD))  # fmt: skip
            plan = msgspec.structs.replace(plan, job=job)
        self.known.plans[plan.attempt_id] = plan
        if item is not None:
            self.known.items[plan.attempt_id] = item
        return plan

    def workload(self) -> None:
        """One batch of attempt lives, from prepare to release (raises Killed)."""
        kinds = [
            self.rng.choice(["plain", "stream", "hold"]) for _ in range(self.rng.randint(1, 3))
        ]
        plans = [self.plan(kind) for kind in kinds]
        expires = now_ms() + 300_000
        prepare = PrepareRequest(
            version=1,
            id=new_id(),
            **self.daemon.bindings(),
            attempts=[PrepareAttempt(plan=p, lease=renewal(p, 1, expires)) for p in plans],
        )
        reply = self.request("admission", prepare)
        admitted = [
            p for p, r in zip(plans, reply.results, strict=True) if isinstance(r, AttemptRow)
        ]
        for plan in admitted:
            if plan.attempt_id in self.known.items:
                self.stage(plan, self.known.items[plan.attempt_id])
        ready = [
            p
            for p in admitted
            if self.wait_for(p, "admission", lambda r: r.ready or r.state != "prepared").ready
        ]
        if ready:
            self.request("start", _fenced(StartRequest, ready))
        for plan in ready:
            if plan.job.payload.environment:
                self.hold(plan)
            else:
                self.wait_for(plan, "start", lambda r: r.state not in LIVE)
        self.finish(admitted)

    def stage(self, plan: Plan, item: StreamedInput) -> None:
        ref = ObjectRef(**fence_fields(plan), object=item.id)

        def status() -> Any:
            request = InputStatusRequest(version=1, id=new_id(), objects=[ref])
            (row,) = self.request("staging", request).results
            return (
                row
                if not (isinstance(row, ErrorRow) and row.error.code == "inputs_preparing")
                else None
            )

        row = wait_for(status, "staging to be initialised")
        assert isinstance(row, InputRow), row
        offset = row.offset
        while offset < len(item.data):
            data = item.data[offset : offset + CHUNK]
            write = InputWrite(**fence_fields(plan), object=item.id, offset=offset,
                               data=_b64(data), digest=digest_of(data))  # fmt: skip
            (row,) = self.request(
                "staging", InputWriteRequest(version=1, id=new_id(), writes=[write])
            ).results
            assert isinstance(row, InputRow), row
            offset = row.offset

    def hold(self, plan: Plan) -> None:
        """The barrier is alive as the slot account; observe it a few times, then stop."""

        def barrier_running() -> bool:
            if self.slot_processes():
                return True
            # Not through self.request: looking must not move the armed kill point.
            (row,) = send(self.daemon.admin, _fenced(ObserveRequest, [plan])).results
            if isinstance(row, AttemptRow) and row.state not in LIVE:
                log = self.daemon.process.log(tail=6000)
                raise AssertionError(f"the held attempt ended before its barrier ran: {row}\n{log}")
            return False

        wait_for(barrier_running, "the held barrier to run")
        for _ in range(2):
            self.observe("running", plan)
        self.request("release", _fenced(StopRequest, [plan]))

    def finish(self, plans: list[Plan]) -> None:
        """Stop what is left, wait for confirmed cleanup, release everything."""
        live = [p for p in plans if self.observe("release", p).state not in SETTLED | {"released"}]
        if live:
            self.request("release", _fenced(StopRequest, live))
        for plan in plans:
            self.wait_for(plan, "release", lambda r: r.state == "released" or (
                r.state in SETTLED and r.cleanup_confirmed))  # fmt: skip
        if plans:
            self.request("release", _fenced(ReleaseRequest, plans))

    def observe(self, phase: str, plan: Plan) -> AttemptRow:
        (row,) = self.request(phase, _fenced(ObserveRequest, [plan])).results
        assert isinstance(row, AttemptRow), row
        return row

    def wait_for(self, plan: Plan, phase: str, accept: Any) -> AttemptRow:
        def check() -> AttemptRow | None:
            row = self.observe(phase, plan)
            return row if accept(row) else None

        return wait_for(check, f"attempt {plan.attempt_id} in phase {phase}")  # type: ignore[no-any-return]

    # --- after a restart: the invariants, then a clean host ------------------------------

    def records(self) -> dict[str, AttemptStatus]:
        found: dict[str, AttemptStatus] = {}
        after = None
        while True:
            reply = send(self.daemon.admin, SnapshotRequest(version=1, id=new_id(), after=after))
            assert isinstance(reply, SnapshotReply), reply
            found.update((a.attempt_id, a) for a in reply.attempts)
            after = reply.next
            if after is None:
                return found

    def check_invariants(self) -> None:
        records = self.records()
        lost = self.known.must_exist - set(records)
        assert not lost, f"acknowledged attempts lost after a restart: {sorted(lost)}"
        live = {a: r.state for a, r in records.items() if r.state in LIVE}
        assert not live, f"uncertain attempts not unknown after a restart: {live}"
        for attempt_id in self.known.last_live:
            assert records[attempt_id].state in SETTLED | {"released"}, records[attempt_id]
        self.check_no_replay(records)
        self.check_offsets(records)
        self.known.last_live.clear()
        self.wait_cleanup()
        left = self.slot_processes()
        if left:
            after = {a: (r.state, r.reason, r.cleanup_confirmed) for a, r in self.records().items()}
            raise AssertionError(
                f"processes of a killed attempt outlived confirmed cleanup: {left}\n"
                f"records: {after}\nkilled daemon's log:\n{self.logs[-1][-6000:]}\n"
                f"restarted daemon's log:\n{self.daemon.process.log()}"
            )

    def check_no_replay(self, records: dict[str, AttemptStatus]) -> None:
        try:
            lines = (self.daemon.layout.base / PROVIDER_CALLS).read_text().splitlines()
        except FileNotFoundError:
            lines = []
        calls = collections.Counter(lines)
        for attempt_id in records:
            for method in ("probe", "prepare", "start"):
                count = calls[f"{method} {attempt_id}"]
                assert count <= 1, f"provider {method} called {count} times for {attempt_id}"

    def check_offsets(self, records: dict[str, AttemptStatus]) -> None:
        for (attempt_id, object_id), acked in self.known.offsets.items():
            record = records[attempt_id]
            if record.state == "released":
                continue
            assert record.staged_bytes >= acked, (record, acked)
            if record.state != "prepared":
                continue
            plan = self.known.plans[attempt_id]
            ref = ObjectRef(**fence_fields(plan), object=object_id)

            def status(ref: ObjectRef = ref) -> Any:
                request = InputStatusRequest(version=1, id=new_id(), objects=[ref])
                (row,) = send(self.daemon.admin, request).results
                preparing = isinstance(row, ErrorRow) and row.error.code == "inputs_preparing"
                return None if preparing else row

            try:
                row = wait_for(status, "input_status after a restart")
            except AssertionError as exc:
                raise AssertionError(f"{exc}: {record}\n{self.daemon.process.log()}") from None
            assert isinstance(row, InputRow), row
            assert row.offset >= acked, f"acknowledged offset {acked} lost: {row}"

    def wait_cleanup(self) -> None:
        def confirmed() -> bool:
            return all(
                r.cleanup_confirmed
                for r in self.records().values()
                if r.state in SETTLED and r.slot is not None
            )

        wait_for(confirmed, "cleanup of every settled attempt to be confirmed")

    def clean_host(self) -> None:
        """Stop and release every attempt left over, so both slots are free again."""
        records = self.records()
        prepared = [self.known.plans[a] for a, r in records.items() if r.state == "prepared"]
        if prepared:
            send(self.daemon.admin, _fenced(StopRequest, prepared))
        self.wait_cleanup()
        pending = [self.known.plans[a] for a, r in self.records().items() if r.state != "released"]
        for start in range(0, len(pending), 64):
            batch = pending[start : start + 64]
            reply = send(self.daemon.admin, _fenced(ReleaseRequest, batch))
            for plan, row in zip(batch, reply.results, strict=True):
                # A directory left half-created by a kill is finished by the daemon
                # itself (layout._finish_half_created): release must simply succeed.
                assert isinstance(row, AttemptRow), (plan.attempt_id, row)

    def slot_processes(self) -> list[str]:
        found = []
        for process in psutil.process_iter(["uids", "status", "cmdline"]):
            try:
                if (
                    process.info["uids"].real in self.slot_uids
                    and process.info["status"] != psutil.STATUS_ZOMBIE
                ):
                    found.append(f"{process.pid} {process.info['cmdline']}")
            except (psutil.Error, AttributeError):
                continue
        return found

    def internal_failures(self) -> list[str]:
        bad = []
        for log in [*self.logs, self.daemon.process.log(tail=100_000)]:
            for line in log.splitlines():
                if '"internal"' in line or "handler_failed" in line or "request_failed" in line:
                    bad.append(line)
        return bad


def _read_all(sock: socket.socket) -> bytes:
    sock.settimeout(10)
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except OSError:
        pass
    return data


def _fenced(kind: type[Request], plans: list[Plan]) -> Request:
    return kind(version=1, id=new_id(), attempts=[fence(p) for p in plans])  # type: ignore[call-arg]


def _b64(data: bytes) -> str:
    import base64  # noqa: PLC0415

    return base64.b64encode(data).decode("ascii")


CRASH_PREFIX = "ficc-cr-"
"""The crash test's own accounts: "no process of the slot accounts" must not see the
processes other test sessions run as the shared `ficc-it-*` accounts."""


@pytest.fixture(scope="module")
def crash_accounts() -> Iterator[Accounts]:
    made = ensure_accounts(CRASH_PREFIX)
    try:
        yield made
    finally:
        made.remove()


@pytest.fixture
def crash_daemon(
    session_dir: Path, provider: InstalledProvider, crash_accounts: Accounts
) -> Iterator[Daemon]:
    """A daemon this test kills and restarts itself; killed at the end, with anything
    left running as its slot accounts."""
    base = private_directory(str(session_dir), "crash-")
    layout = Layout.create(base, crash_accounts, provider)
    running = Daemon(layout, provider, crash_accounts)
    running.start()
    try:
        yield running
    finally:
        running.process.kill()
        slots = {crash_accounts["slot0"].uid, crash_accounts["slot1"].uid}
        for process in psutil.process_iter(["uids"]):
            try:
                if process.info["uids"].real in slots:
                    process.kill()
            except (psutil.Error, AttributeError):
                continue
        layout.destroy()


@pytest.mark.soak
def test_sigkill_at_random_points_loses_nothing_and_replays_nothing(crash_daemon: Daemon) -> None:
    crasher = Crasher(crash_daemon, random.Random(SEED))
    for _ in range(KILLS):
        crasher.arm()
        try:
            while True:
                crasher.workload()
        except Killed:
            pass
        crasher.restart()
        crasher.check_invariants()
        crasher.clean_host()
    assert sum(crasher.kills.values()) == KILLS
    assert set(crasher.kills) == set(PHASES), crasher.kills
    print(f"kills by phase: {dict(crasher.kills)}; in flight: {crasher.in_flight_kills}")
    assert crasher.internal_failures() == []


def test_a_ready_attempt_keeps_its_staged_inputs_across_a_restart(crash_daemon: Daemon) -> None:
    daemon = crash_daemon
    item = StreamedInput(os.urandom(2 * CHUNK))
    plan = daemon.plan(inputs=[item])
    daemon.prepare([plan])
    ref = ObjectRef(**fence_fields(plan), object=item.id)

    def status() -> Any:
        request = InputStatusRequest(version=1, id=new_id(), objects=[ref])
        (row,) = send(daemon.admin, request).results
        preparing = isinstance(row, ErrorRow) and row.error.code == "inputs_preparing"
        return None if preparing else row

    wait_for(status, "staging to be initialised")
    for offset in range(0, len(item.data), CHUNK):
        data = item.data[offset : offset + CHUNK]
        write = InputWrite(**fence_fields(plan), object=item.id, offset=offset,
                           data=_b64(data), digest=digest_of(data))  # fmt: skip
        (row,) = send(
            daemon.admin, InputWriteRequest(version=1, id=new_id(), writes=[write])
        ).results
        assert isinstance(row, InputRow), row
    daemon.wait_state(plan, lambda r: r.ready, "readiness")
    daemon.process.kill()
    daemon.process = DaemonProcess.of(daemon.layout, daemon.provider)
    daemon.process.start()

    row = wait_for(status, "input_status after the restart", timeout=10)
    assert isinstance(row, InputRow), row
    assert (row.offset, row.complete) == (len(item.data), True)
    send(daemon.admin, _fenced(StartRequest, [plan]))
    ended = daemon.wait_state(plan, lambda r: r.state not in LIVE | {"prepared"}, "the start")
    assert ended.reason != "attempt_not_staged", ended


def test_a_half_created_attempt_directory_does_not_wedge_release(crash_daemon: Daemon) -> None:
    """The crash loop hits this for real (about 1 kill in 100); here the state it leaves
    is made directly: the attempt directory as `os.mkdir(name, 0o700)` created it, before
    the `fchmod` to 0711 that the SIGKILL prevented (and so before any part inside it)."""
    daemon = crash_daemon
    plan = daemon.plan()
    (row,) = send(daemon.admin, _prepare(daemon, plan)).results
    assert isinstance(row, AttemptRow), row
    daemon.wait_state(plan, lambda r: r.ready or r.state != "prepared", "readiness")
    daemon.process.kill()
    slot = daemon.layout.slot_paths[int((row.slot or "s0")[1:])]
    attempt_dir = slot / "ficc" / plan.attempt_id
    shutil.rmtree(attempt_dir)
    os.mkdir(attempt_dir, 0o700)
    daemon.process = DaemonProcess.of(daemon.layout, daemon.provider)
    daemon.process.start()

    send(daemon.admin, _fenced(StopRequest, [plan]))
    daemon.wait_state(plan, lambda r: r.state in SETTLED and r.cleanup_confirmed, "cleanup")
    (released,) = send(daemon.admin, _fenced(ReleaseRequest, [plan])).results
    assert isinstance(released, AttemptRow), released
    assert released.state == "released"


def _prepare(daemon: Daemon, plan: Plan) -> PrepareRequest:
    lease = renewal(plan, 1, now_ms() + 300_000)
    return PrepareRequest(
        version=1,
        id=new_id(),
        **daemon.bindings(),
        attempts=[PrepareAttempt(plan=plan, lease=lease)],
    )
