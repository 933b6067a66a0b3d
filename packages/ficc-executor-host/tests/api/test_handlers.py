"""Every action's handler against a real ledger, real stagers and real slot directories.

The daemon is built with `Daemon.open` from a real configuration whose directories are
under /run (the host checks refuse group/other-writable ancestors such as /tmp). Only
the runner is replaced, by a recording fake: these are unit tests of the handlers, and
the runner's own work (provider calls, services) is tested with the pipeline.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import os
import secrets
import shutil
import subprocess
import threading
import time
from collections.abc import Callable, Coroutine, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

import msgspec
import pytest

from ficc.execution import plan as planlib
from ficc.execution import provider as sdk
from ficc.execution._executor import (
    ReceivedInputWrite,
    ReceivedInputWriteRequest,
    receive_request,
)
from ficc.execution.host.config.host import check_directories
from ficc.execution.host.config.load import parse_config
from ficc.execution.host.config.model import Config
from ficc.execution.host.context.parts import HostContext, ProviderRuntime
from ficc.execution.host.core import lifecycle as lc
from ficc.execution.host.core.errors import HostError
from ficc.execution.host.core.records import ResourceUsage
from ficc.execution.host.core.replies import encode_reply
from ficc.execution.host.daemon.root import LEDGER_MARKER, Daemon, check_ledger, service_backend
from ficc.execution.host.ledger.store import LEDGER_FILE
from ficc.execution.host.providers.loader import LoadedProvider
from ficc.execution.host.service.cgroupfs import CgroupfsService
from ficc.execution.host.service.systemd import SystemdService
from ficc.execution.host.storage.layout import Layout, service_name
from ficc.execution.protocol import (
    CollectRequest,
    Fence,
    InputStatusRequest,
    InputWrite,
    InputWriteRequest,
    ObjectRef,
    ObserveRequest,
    OfferLimits,
    PrepareAttempt,
    PrepareRequest,
    Read,
    ReconcileAbsentRequest,
    RejectAbsentRequest,
    ReleaseRequest,
    Renewal,
    RenewRequest,
    Resources,
    Sender,
    SetOfferRequest,
    SnapshotRequest,
    StartRequest,
    StopRequest,
    encode_request,
    validate_request,
)
from ficc.execution.provider import tasks
from ficc.execution.wire import (
    AttemptRow,
    AttemptsReply,
    ErrorReply,
    ErrorRow,
    InputRow,
    InputsReply,
    OfferReply,
    SnapshotReply,
    Usage,
    decode_reply,
)
from ficc_testkit import plans, tamper
from ficc_testkit.fakes import RecordingRunner
from ficc_testkit.plans import new_id
from lease_support import SteppedClock

pytestmark = pytest.mark.root("the daemon needs root: root-owned state, slot accounts, cgroups")

T = TypeVar("T")

INSTALLATION = "0123456789abcdef0123456789abcdef"
PROJECT = "3123456789abcdef0123456789abcdef"
PIN = "sha256:" + "ab" * 32
SLOT_BASE_UID = 61_750
SHA = "sha256:" + "c" * 64
GiB = 1 << 30


def run(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(coro)


def sha(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


# --- the host under test -------------------------------------------------------------


class FakeRunner(RecordingRunner):
    """The kit's recording runner, also as the daemon's server drives it."""

    def __init__(self, ctx: HostContext) -> None:
        super().__init__()
        self.ctx = ctx

    async def recover(self) -> None:
        self.calls.append(("recover", ()))

    async def run(self) -> None:
        await asyncio.Event().wait()

    async def close(self) -> None:
        self.calls.append(("close", ()))

    def named(self, name: str) -> list[tuple[str, ...]]:
        return [args for call, args in self.calls if call == name]


def make_config(root: Path, slots: int = 2, **overrides: Any) -> Config:
    """A real configuration: state, sockets and slots below `root` (under /run)."""
    document: dict[str, Any] = {
        "installation_id": INSTALLATION,
        "deployment_id": "1123456789abcdef0123456789abcdef",
        "node_id": "2123456789abcdef0123456789abcdef",
        "mode": "voluntary",
        "transport_uid": SLOT_BASE_UID - 2,
        "local_owner_uids": [SLOT_BASE_UID - 1],
        "maximum_lease_seconds": 600,
        "state_dir": str(root / "state"),
        "socket_dir": str(root / "sockets"),
        "supervisor": "cgroupfs",
        "slots": [
            {
                "id": f"slot{i}",
                "class": "cpu",
                "generation": 1,
                "path": str(root / "slots" / f"slot{i}"),
                "uid": SLOT_BASE_UID + i,
                "gid": SLOT_BASE_UID + i,
                "storage_bytes": 1 << 34,
                "storage_inodes": 100_000,
                "filesystem_uuid": f"{i:08x}-0000-4000-8000-000000000000",
            }
            for i in range(slots)
        ],
        "ceiling": {
            "cpu_millis": 8000,
            "memory_bytes": 16 * GiB,
            "swap_bytes": 0,
            "processes": 4096,
            "slots": slots,
            "devices": [],
            "projects": [PROJECT],
            "runtimes": ["test"],
        },
        "initial_offer": {
            "control": "active",
            "cpu_millis": 4000,
            "memory_bytes": 8 * GiB,
            "swap_bytes": 0,
            "processes": 2048,
            "slots": slots,
            "devices": [],
            "projects": [PROJECT],
            "runtimes": ["test"],
        },
        "providers": [{"id": "test", "package_digest": PIN, "configuration": {}}],
    }
    document.update(overrides)
    return parse_config(msgspec.json.encode(document), ".json")


@pytest.fixture
def host_root() -> Iterator[Path]:
    """A fresh root-owned tree under /run: state 0700, sockets 0711, slots 0755."""
    root = Path("/run") / f"ficc-t-handlers-{secrets.token_hex(6)}"
    root.mkdir(mode=0o755)
    os.chmod(root, 0o755)
    (root / "state").mkdir(mode=0o700)
    (root / "sockets").mkdir(mode=0o711)
    os.chmod(root / "sockets", 0o711)
    (root / "slots").mkdir(mode=0o755)
    for i in range(3):
        (root / "slots" / f"slot{i}").mkdir(mode=0o755)
        os.chmod(root / "slots" / f"slot{i}", 0o755)
    yield root
    shutil.rmtree(root, ignore_errors=True)


MINIMUMS = sdk.MinimumLimits(memory_bytes=64 << 20, processes=8)
"""What the stub provider states its runtime needs (every plan here asks for more)."""


def stub_provider(minimums: sdk.MinimumLimits | None) -> ProviderRuntime:
    """The provider as admission sees it: configured, loaded, and what it states."""
    loaded = LoadedProvider("test", None, None, None, minimums)  # type: ignore[arg-type]
    return ProviderRuntime("test", PIN, loaded, None)


class Host:
    """A daemon built for real, with the recording runner and a stub-loaded provider."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.daemon = Daemon.open(config, runner_factory=FakeRunner, host_check=check_directories)
        self.ctx = self.daemon.ctx
        # The provider itself is exercised by the pipeline tests; admission only needs
        # to know it is configured and loaded, so mark it loaded.
        self.ctx.providers["test"] = stub_provider(MINIMUMS)
        runner = self.daemon.runner
        assert isinstance(runner, FakeRunner)
        self.runner = runner

    def send(self, request: Any, sender: Sender = Sender.TRANSPORT) -> Any:
        """Dispatch as the server would, and decode the reply exactly as a client would."""
        _, payload = validate_request(request)
        return self.send_frame(payload, sender)

    def send_frame(self, payload: bytes, sender: Sender = Sender.TRANSPORT) -> Any:
        received = receive_request(payload)  # the server's decoding call
        reply = run(self.daemon.dispatch(sender, 0, received))
        rows = received.row_count or None
        return decode_reply(encode_reply(reply), received.action, rows=rows)

    def bindings(self) -> dict[str, Any]:
        b = self.ctx.ledger.bindings()
        return {"installation_id": b.installation_id, "ledger_id": b.ledger_id,
                "admission_version": 1}  # fmt: skip

    def prepare(self, *plans: planlib.Plan, expires_in_ms: int = 60_000) -> AttemptsReply:
        rows = [PrepareAttempt(plan=p, lease=first_lease(p, expires_in_ms)) for p in plans]
        reply = self.send(PrepareRequest(version=1, id=new_id(), attempts=rows, **self.bindings()))
        assert isinstance(reply, AttemptsReply), reply
        return reply

    def apply(self, plan: planlib.Plan, *events: lc.AnyEvent) -> None:
        for event in events:
            self.ctx.ledger.apply(fence(plan), event)

    def ready(self, plan: planlib.Plan) -> None:
        self.apply(plan, lc.PrepareBegun(), lc.PrepareOk(result=b"{}"))

    def close(self) -> None:
        run(self.daemon.close())


@pytest.fixture
def host(host_root: Path) -> Iterator[Host]:
    h = Host(make_config(host_root))
    yield h
    h.close()


def make_plan(
    *,
    inputs: Sequence[planlib.InputObject] = (),
    outputs: Sequence[planlib.Output] = (),
    provider: str = "test",
    package_digest: str = PIN,
    cpu_millis: int = 1000,
    job_id: str | None = None,
    generation: int = 1,
) -> planlib.Plan:
    return plans.make_plan(
        inputs=inputs, provider=provider, package_digest=package_digest, image_digest=SHA,
        cpu_millis=cpu_millis, job_id=job_id, generation=generation,
        deployment_id="1123456789abcdef0123456789abcdef",
        node_id="2123456789abcdef0123456789abcdef", project_id=PROJECT, memory_bytes=GiB,
        storage_bytes=GiB, outputs={o.name: o.path for o in outputs},
    )  # fmt: skip


def fence(plan: planlib.Plan) -> Fence:
    return Fence(plan.attempt_id, plan.generation, planlib.plan_digest(plan))


def first_lease(plan: planlib.Plan, expires_in_ms: int = 60_000, sequence: int = 1) -> Renewal:
    f = fence(plan)
    expires = time.time_ns() // 1_000_000 + expires_in_ms
    return Renewal(f.attempt_id, f.generation, f.plan_digest, sequence, expires)


def stream(data: bytes, name: str = "data.bin") -> planlib.InputObject:
    return planlib.InputObject(
        id=new_id(), name=name, bytes=len(data), digest=sha(data), delivery="stream"
    )


def row_ok(reply: Any, index: int = 0) -> Any:
    row = reply.results[index]
    assert not isinstance(row, ErrorRow), row
    return row


def row_code(reply: Any, index: int = 0) -> str:
    row = reply.results[index]
    assert isinstance(row, ErrorRow), row
    return str(row.error.code)


def fences_request(kind: Any, *plans: planlib.Plan) -> Any:
    return kind(version=1, id=new_id(), attempts=[fence(p) for p in plans])


# --- prepare -------------------------------------------------------------------------


def test_prepare_admits_and_hands_new_attempts_to_the_runner(host: Host) -> None:
    plan = make_plan()
    row = row_ok(host.prepare(plan))
    assert isinstance(row, AttemptRow)
    assert (row.state, row.ready, row.outcome, row.slot) == ("prepared", False, None, "slot0")
    assert (row.lease_sequence, row.cleanup_confirmed) == (1, False)
    assert host.runner.named("admitted") == [(plan.attempt_id,)]
    # a repeated prepare returns the record as it is, deadline included, and is not new
    record = host.ctx.ledger.get(plan.attempt_id)
    again = row_ok(host.prepare(plan, expires_in_ms=300_000))
    assert again.lease_expires_at_ms == row.lease_expires_at_ms
    assert host.ctx.ledger.get(plan.attempt_id) == record
    assert host.runner.named("admitted") == [(plan.attempt_id,)]


def test_a_plan_below_the_providers_minimum_is_rejected_before_anything_is_reserved(
    host: Host,
) -> None:
    """No provider call and no slot: a durable failed record whose message names the
    figure to ask for; a provider that states nothing (written before the statement
    existed) admits the same plan."""
    plan = make_plan()
    small = msgspec.structs.replace(plan.job.limits, memory_bytes=8 << 20)
    plan = msgspec.structs.replace(plan, job=msgspec.structs.replace(plan.job, limits=small))
    free = host.ctx.ledger.reservations()
    reply = host.prepare(plan)
    assert row_code(reply) == "admission_rejected"
    assert reply.results[0].error.message.startswith(
        "limits_below_minimum: memory_bytes 8388608 is below the 67108864 the test runtime"
        " needs; ask for at least 67108864 (64 MiB)"
    )
    assert host.runner.named("admitted") == []
    assert host.ctx.ledger.reservations() == free
    _rejected_durably(host, plan, "limits_below_minimum")
    host.ctx.providers["test"] = stub_provider(None)
    again = make_plan()
    again = msgspec.structs.replace(again, job=msgspec.structs.replace(again.job, limits=small))
    assert isinstance(row_ok(host.prepare(again)), AttemptRow)


def _rejected_durably(host: Host, plan: planlib.Plan, detail: str) -> None:
    """The refusal left its durable failed record: no slot, cleanup confirmed."""
    record = host.ctx.ledger.get(plan.attempt_id)
    assert record is not None
    assert (record.status.state, record.status.reason, record.slot_id) == (
        "failed",
        "admission_rejected",
        None,
    )
    assert record.detail == detail
    assert record.status.cleanup_confirmed


def test_prepare_with_changed_bindings_writes_nothing(host: Host) -> None:
    plan = make_plan()
    rows = [PrepareAttempt(plan=plan, lease=first_lease(plan))]
    bindings = host.bindings() | {"ledger_id": new_id()}
    reply = host.send(PrepareRequest(version=1, id=new_id(), attempts=rows, **bindings))
    assert isinstance(reply, ErrorReply)
    assert reply.error.code == "bindings_changed"
    assert host.ctx.ledger.page() == ([], None)
    assert host.runner.named("admitted") == []


@pytest.mark.parametrize(
    ("change", "detail"),
    [
        ({"provider": "other"}, "provider_unavailable"),
        ({"package_digest": "sha256:" + "0" * 64}, "provider_unavailable"),
        ({"cpu_millis": 5000}, "admission_rejected"),  # above the offer's 4000
    ],
)
def test_refusals_before_any_provider_call_are_durable(
    host: Host, change: dict[str, Any], detail: str
) -> None:
    plan = make_plan(**change)
    reply = host.prepare(plan)
    assert row_code(reply) == "admission_rejected"
    assert detail in reply.results[0].error.message
    _rejected_durably(host, plan, detail)
    assert host.runner.named("admitted") == []
    # repeating it returns the durable rejection; it can never start
    again = row_ok(host.prepare(plan))
    assert (again.state, again.reason) == ("failed", "admission_rejected")
    assert row_code(host.send(fences_request(StartRequest, plan))) == "admission_rejected"


def test_an_unavailable_provider_is_refused_with_its_code(host_root: Path) -> None:
    h = Host(make_config(host_root))
    try:
        h.ctx.providers["test"] = ProviderRuntime(
            "test", PIN, None, HostError("provider_digest_mismatch", "tampered")
        )
        reply = h.prepare(make_plan())
        assert row_code(reply) == "admission_rejected"
        assert "provider_digest_mismatch" in reply.results[0].error.message
    finally:
        h.close()


def test_slot_exhaustion_and_expired_first_lease(host: Host) -> None:
    plans = [make_plan() for _ in range(3)]
    reply = host.prepare(*plans)
    assert [row_ok(reply, i).slot for i in range(2)] == ["slot0", "slot1"]
    assert row_code(reply, 2) == "admission_rejected"
    assert "attempts: 2 reserved + 1 asked > 2 offered" in reply.results[2].error.message
    late = make_plan()
    assert row_code(host.prepare(late, expires_in_ms=-1000)) == "admission_rejected"
    assert host.ctx.ledger.get(late.attempt_id).detail == "lease_expired"  # type: ignore[union-attr]


def test_generation_conflict_leaves_its_durable_rejection(host: Host) -> None:
    first = make_plan()
    host.prepare(first)
    later = make_plan(job_id=first.job_id, generation=2)
    reply = host.prepare(later)
    assert row_code(reply) == "admission_rejected"
    assert reply.results[0].error.message.startswith("generation_conflict: ")
    record = host.ctx.ledger.get(later.attempt_id)
    assert record is not None
    assert (record.status.reason, record.detail, record.slot_id) == (
        "admission_rejected",
        "generation_conflict",
        None,
    )
    assert host.runner.named("admitted") == [(first.attempt_id,)]


def test_a_retry_after_unknown_is_admitted_only_with_its_acknowledgement(host: Host) -> None:
    first = make_plan()
    host.prepare(first)
    host.ready(first)
    host.send(fences_request(StartRequest, first))
    host.apply(first, lc.Started(), lc.OutcomeLost(reason="provider_timeout"))
    host.apply(first, lc.CleanupConfirmed(), lc.Release())
    silent = make_plan(job_id=first.job_id, generation=2)
    reply = host.prepare(silent)
    assert row_code(reply) == "admission_rejected"
    assert reply.results[0].error.message.startswith("unknown_not_acknowledged: ")
    host.apply(silent, lc.Release())
    retry = make_plan(job_id=first.job_id, generation=3)
    row = PrepareAttempt(
        plan=retry, lease=first_lease(retry), acknowledged_unknown=[first.attempt_id]
    )
    request = PrepareRequest(version=1, id=new_id(), attempts=[row], **host.bindings())
    admitted = row_ok(host.send(request))
    assert (admitted.state, admitted.reason) == ("prepared", None)


def test_rows_report_the_expiry_the_host_enforces(host: Host) -> None:
    """A lease asked until the end of time is capped at maximum_lease_seconds (600 s
    here); every row says when the host will stop the work, not what was asked."""
    cap_ms = host.config.maximum_lease_seconds * 1000
    plan = make_plan()
    before_ms = time.time_ns() // 1_000_000
    endless = 2**63 - 1
    first = first_lease(plan)
    first = Renewal(first.attempt_id, first.generation, first.plan_digest, 1, endless)
    request = PrepareRequest(
        version=1, id=new_id(), attempts=[PrepareAttempt(plan=plan, lease=first)],
        **host.bindings(),
    )  # fmt: skip
    prepared = row_ok(host.send(request))
    after_ms = time.time_ns() // 1_000_000
    assert before_ms + cap_ms <= prepared.lease_expires_at_ms <= after_ms + cap_ms
    renewal = Renewal(first.attempt_id, first.generation, first.plan_digest, 2, endless)
    renewed = row_ok(host.send(RenewRequest(version=1, id=new_id(), leases=[renewal])))
    later_ms = time.time_ns() // 1_000_000
    assert after_ms + cap_ms <= renewed.lease_expires_at_ms <= later_ms + cap_ms
    # an identical duplicate keeps the deadline, and reports the same effective expiry
    again = row_ok(host.send(RenewRequest(version=1, id=new_id(), leases=[renewal])))
    assert again.lease_expires_at_ms == renewed.lease_expires_at_ms
    (listed,) = [a for a in host.send(SnapshotRequest(version=1, id=new_id())).attempts
                 if a.attempt_id == plan.attempt_id]  # fmt: skip
    assert listed.lease_expires_at_ms == renewed.lease_expires_at_ms


# --- renew, start, observe, stop, release ------------------------------------------


def test_renew_sequences_and_duplicates(host: Host) -> None:
    plan = make_plan()
    host.prepare(plan)
    two = first_lease(plan, 120_000, sequence=2)
    renewed = row_ok(host.send(RenewRequest(version=1, id=new_id(), leases=[two])))
    assert (renewed.lease_sequence, renewed.lease_expires_at_ms) == (2, two.expires_at_ms)
    # The runner (and through it the lease reaper) hears of the renewal before the reply.
    assert host.runner.named("leases_renewed") == [(plan.attempt_id,)]
    deadline = host.ctx.ledger.get(plan.attempt_id).lease  # type: ignore[union-attr]
    duplicate = row_ok(host.send(RenewRequest(version=1, id=new_id(), leases=[two])))
    assert duplicate.lease_sequence == 2
    assert host.ctx.ledger.get(plan.attempt_id).lease == deadline  # type: ignore[union-attr]
    stale = first_lease(plan, 200_000, sequence=2)
    code = row_code(host.send(RenewRequest(version=1, id=new_id(), leases=[stale])))
    assert code == "lease_sequence"
    other = Renewal(new_id(), 1, SHA, 2, two.expires_at_ms)
    assert row_code(host.send(RenewRequest(version=1, id=new_id(), leases=[other]))) == (
        "unknown_attempt"
    )


def test_renewals_that_arrive_while_the_ledger_is_busy_share_one_transaction(
    host_root: Path,
) -> None:
    """Group commit: while one renewal's transaction waits for the ledger thread, the
    renewals that arrive go together in the next transaction (one ordinal, one fsync),
    and each still gets its own answer."""
    host = Host(make_config(host_root, slots=4))
    first, *later = [make_plan() for _ in range(4)]
    host.prepare(first, *later)
    busy, free = threading.Event(), threading.Event()

    def hold() -> None:
        busy.set()
        free.wait()

    def dispatch(plan: planlib.Plan) -> asyncio.Future[Any]:
        request = RenewRequest(version=1, id=new_id(), leases=[first_lease(plan, 120_000, 2)])
        received = receive_request(validate_request(request)[1])
        return asyncio.ensure_future(host.daemon.dispatch(Sender.TRANSPORT, 0, received))

    async def turns_until(condition: Callable[[], bool]) -> bool:
        for _ in range(10_000):  # loop turns, not time
            if condition():
                return True
            await asyncio.sleep(0)
        return False

    async def scenario() -> list[Any]:
        held = asyncio.ensure_future(host.ctx.workers.db(hold))
        await asyncio.to_thread(busy.wait)
        replies = [dispatch(first)]
        group = lambda: host.ctx.groups.get("renew")  # noqa: E731
        in_flight = await turns_until(lambda: (g := group()) is not None and not g._waiting)
        replies += [dispatch(plan) for plan in later]
        queued = await turns_until(lambda: len(group()._waiting) == len(later))  # type: ignore[union-attr]
        free.set()
        await held
        assert (in_flight, queued) == (True, True)
        return list(await asyncio.gather(*replies))

    try:
        replies = run(scenario())
        ordinal = {p.attempt_id: host.ctx.ledger.get(p.attempt_id).updated for p in [first, *later]}  # type: ignore[union-attr]
    finally:
        host.close()
    for plan, reply in zip([first, *later], replies, strict=True):
        (row,) = decode_reply(encode_reply(reply), "renew", rows=1).results
        assert not isinstance(row, ErrorRow), row
        assert (row.attempt_id, row.lease_sequence) == (plan.attempt_id, 2)
    assert len({ordinal[p.attempt_id] for p in later}) == 1
    assert ordinal[first.attempt_id] != ordinal[later[0].attempt_id]


def test_a_renewal_the_reaper_came_before_is_refused_and_expires_the_attempt(host: Host) -> None:
    """The runner reports that the reaper had already decided to stop the service at
    the old deadline: that row is refused `lease_expired` (never OK), its expiry is
    recorded and the runner is told to stop it; the other row is renewed."""
    reaped, other = make_plan(), make_plan()
    host.prepare(reaped, other)
    for plan in (reaped, other):
        host.ready(plan)
    host.send(fences_request(StartRequest, reaped, other))
    host.runner.reaped = {reaped.attempt_id}
    leases = [first_lease(p, 120_000, sequence=2) for p in (reaped, other)]
    reply = host.send(RenewRequest(version=1, id=new_id(), leases=leases))
    assert row_code(reply, 0) == "lease_expired"
    assert row_ok(reply, 1).lease_sequence == 2
    status = host.ctx.ledger.get(reaped.attempt_id).status  # type: ignore[union-attr]
    assert (status.state, status.stop_pending) == ("starting", "expired")
    assert host.runner.named("stop_requested") == [(reaped.attempt_id,)]


def _clock_passes_while_queued(host: Host, ahead_s: int) -> SteppedClock:
    """The host's clock becomes a stepped one; the next request's first wait for the
    ledger thread lasts `ahead_s` seconds (as behind a busy ledger thread)."""
    clock = SteppedClock()
    host.ctx.clock = clock  # type: ignore[assignment]
    workers = host.ctx.workers
    db = workers.db

    async def queued(fn: Any, *args: Any, **kwargs: Any) -> Any:
        workers.db = db  # type: ignore[method-assign]
        clock.advance(ahead_s)
        return await db(fn, *args, **kwargs)

    workers.db = queued  # type: ignore[method-assign]
    return clock


def test_a_lease_that_runs_out_while_the_renewal_waits_for_the_ledger_is_not_revived(
    host: Host,
) -> None:
    plan = make_plan()
    host.prepare(plan, expires_in_ms=60_000)
    _clock_passes_while_queued(host, 120)
    renewal = first_lease(plan, 3_600_000, sequence=2)
    reply = host.send(RenewRequest(version=1, id=new_id(), leases=[renewal]))
    assert row_code(reply) == "lease_expired"
    assert host.ctx.ledger.get(plan.attempt_id).lease.sequence == 1  # type: ignore[union-attr]


def test_a_lease_that_runs_out_while_the_start_waits_for_the_ledger_refuses_it(
    host: Host,
) -> None:
    plan = make_plan()
    host.prepare(plan, expires_in_ms=60_000)
    host.ready(plan)
    _clock_passes_while_queued(host, 120)
    assert row_code(host.send(fences_request(StartRequest, plan))) == "lease_expired"
    assert host.runner.named("start_requested") == []


def test_a_lease_that_runs_out_while_an_input_request_waits_for_the_ledger_closes_it(
    host: Host,
) -> None:
    data = b"payload"
    obj = stream(data)
    plan = make_plan(inputs=[obj])
    host.prepare(plan, expires_in_ms=60_000)
    stage(host, plan)
    _clock_passes_while_queued(host, 120)
    assert status_of(host, plan, obj).error.code == "lease_expired"
    _clock_passes_while_queued(host, 240)
    assert row_code(write(host, write_row(plan, obj, 0, data))) == "lease_expired"


def test_a_chunk_whose_lease_runs_out_before_its_commit_is_not_committed(host: Host) -> None:
    """The rows were authorized with the lease current; the chunk's commit, after its
    bytes were written and synced, comes once the deadline has passed: the commit
    transaction judges the lease again and refuses it."""
    data = b"payload"
    obj = stream(data)
    plan = make_plan(inputs=[obj])
    host.prepare(plan, expires_in_ms=60_000)
    stage(host, plan)
    clock = SteppedClock()
    host.ctx.clock = clock  # type: ignore[assignment]
    workers = host.ctx.workers
    blocking = workers.db_blocking

    def late_commit(fn: Any, *args: Any, **kwargs: Any) -> Any:
        clock.advance(120)
        return blocking(fn, *args, **kwargs)

    workers.db_blocking = late_commit  # type: ignore[method-assign]
    assert row_code(write(host, write_row(plan, obj, 0, data))) == "lease_expired"
    assert host.ctx.ledger.inputs(plan.attempt_id)[0].offset == 0


def test_start_needs_ready_and_starts_once(host: Host) -> None:
    plan = make_plan()
    host.prepare(plan)
    assert row_code(host.send(fences_request(StartRequest, plan))) == "not_ready"
    host.apply(plan, lc.PrepareBegun())
    assert row_code(host.send(fences_request(StartRequest, plan))) == "runtime_preparing"
    host.apply(plan, lc.PrepareOk(result=b"{}"))
    started = row_ok(host.send(fences_request(StartRequest, plan)))
    assert started.state == "starting"
    assert host.runner.named("start_requested") == [(plan.attempt_id,)]
    again = row_ok(host.send(fences_request(StartRequest, plan)))
    assert again.state == "starting"
    assert host.runner.named("start_requested") == [(plan.attempt_id,)]  # never twice


def test_start_refused_when_the_offer_no_longer_allows_it(host: Host) -> None:
    plan = make_plan()
    host.prepare(plan)
    host.ready(plan)
    paused = SetOfferRequest(version=1, id=new_id(), expected_revision=1, control="paused")
    assert isinstance(host.send(paused, Sender.OWNER), OfferReply)
    assert row_code(host.send(fences_request(StartRequest, plan))) == "offer_closed"
    assert host.runner.named("start_requested") == []


def test_observe_checks_fences(host: Host) -> None:
    plan = make_plan()
    host.prepare(plan)
    wrong = Fence(plan.attempt_id, 2, fence(plan).plan_digest)
    missing = Fence(new_id(), 1, SHA)
    reply = host.send(ObserveRequest(version=1, id=new_id(), attempts=[fence(plan), missing]))
    assert row_ok(reply, 0).state == "prepared"
    assert row_code(reply, 1) == "unknown_attempt"
    reply = host.send(ObserveRequest(version=1, id=new_id(), attempts=[wrong]))
    assert row_code(reply) == "fence_mismatch"


def test_mixed_batches_answer_each_row_as_alone(host: Host) -> None:
    """Renew and observe read a batch at once: every row still gets its own answer."""
    plans = [make_plan() for _ in range(3)]
    host.prepare(*plans)  # two slots: the third is a failed admission_rejected record
    wrong = Fence(plans[1].attempt_id, 2, fence(plans[1]).plan_digest)
    fences = [fence(plans[0]), Fence(new_id(), 1, SHA), wrong, fence(plans[2])]

    def answers(reply: Any) -> list[Any]:
        return [row.error.code if isinstance(row, ErrorRow) else row for row in reply.results]

    def observe(*attempts: Fence) -> Any:
        return host.send(ObserveRequest(version=1, id=new_id(), attempts=list(attempts)))

    together = answers(observe(*fences))
    assert together == [answers(observe(f))[0] for f in fences]
    codes = [row.state if isinstance(row, AttemptRow) else row for row in together]
    assert codes == ["prepared", "unknown_attempt", "fence_mismatch", "failed"]

    def renewal(f: Fence, sequence: int) -> Renewal:
        return Renewal(f.attempt_id, f.generation, f.plan_digest, sequence, 10**13 + sequence)

    renewals = [renewal(f, 2) for f in fences]
    renewed = answers(host.send(RenewRequest(version=1, id=new_id(), leases=renewals)))
    assert renewed[1:] == ["unknown_attempt", "fence_mismatch", "invalid_state"]
    assert renewed[0].lease_sequence == 2
    assert renewed[0] == answers(observe(*fences))[0]  # what was committed


def test_an_observe_of_cached_records_is_answered_without_the_ledger_thread(
    host: Host, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Once read, the rows a client polls come from the ledger's record cache on the
    event loop; a write that changes them (a renewal, a staged chunk) shows at once."""
    data = b"x" * 100
    obj = stream(data)
    plans = [make_plan(inputs=[obj]), make_plan()]
    host.prepare(*plans)
    stage(host, plans[0])
    ledger_calls: list[str] = []
    db = host.ctx.workers.db

    async def counted(fn: Any, *args: Any, **kwargs: Any) -> Any:
        ledger_calls.append(getattr(fn, "__name__", repr(fn)))
        return await db(fn, *args, **kwargs)

    monkeypatch.setattr(host.ctx.workers, "db", counted)

    def observe() -> list[Any]:
        reply = host.send(fences_request(ObserveRequest, *plans))
        return [row_ok(reply, i) for i in range(len(plans))]

    first = observe()
    assert ledger_calls == ["read_rows"]  # the first read fills the cache
    assert observe() == first
    assert ledger_calls == ["read_rows"]
    row_ok(write(host, write_row(plans[0], obj, 0, data[:40])))
    renewal = first_lease(plans[1], 120_000, sequence=2)
    row_ok(host.send(RenewRequest(version=1, id=new_id(), leases=[renewal])))
    ledger_calls.clear()
    staged, renewed = observe()
    assert (staged.staged_bytes, renewed.lease_sequence) == (40, 2)
    assert ledger_calls == ["read_rows"]  # the chunk's commit let go of its attempt
    assert observe() == [staged, renewed]
    assert ledger_calls == ["read_rows"]


def test_usage_is_shown_only_when_asked_live_while_running_then_final(host: Host) -> None:
    running, waiting, rejected = make_plan(), make_plan(), make_plan(provider="other")
    host.prepare(running, waiting, rejected)
    host.ready(running)
    row_ok(host.send(fences_request(StartRequest, running)))
    host.apply(running, lc.Started())
    host.runner.live[running.attempt_id] = ResourceUsage(cpu_user_us=5, storage_bytes=4096)

    def observe(*, usage: bool | None) -> list[Any]:
        asked = {} if usage is None else {"usage": usage}
        request = ObserveRequest(version=1, id=new_id(), attempts=[fence(p) for p in
                                 (running, waiting, rejected)], **asked)  # fmt: skip
        reply = host.send(request)
        assert (b'"usage"' in encode_reply(reply)) is bool(usage)
        return [row.usage for row in reply.results]

    assert observe(usage=None) == [msgspec.UNSET] * 3
    assert observe(usage=False) == [msgspec.UNSET] * 3
    assert host.runner.named("usage_now") == []  # nothing read when not asked
    assert observe(usage=True) == [
        Usage(final=False, cpu_user_us=5, storage_bytes=4096),  # live, unknowns absent
        Usage(final=False),  # never started: nothing yet
        Usage(final=True),  # rejected at admission: nothing ran, nothing will
    ]
    assert host.runner.named("usage_now") == [(running.attempt_id, waiting.attempt_id)]
    used = ResourceUsage(cpu_user_us=7, cpu_system_us=1, oom_kills=1, wall_ms=30)
    host.ctx.ledger.apply(fence(running), lc.Finished(exit_code=137, oom_killed=True), used)
    host.runner.live.clear()
    final = Usage(final=True, cpu_user_us=7, cpu_system_us=1, oom_kills=1, wall_ms=30)
    assert observe(usage=True)[0] == final
    listed = host.send(SnapshotRequest(version=1, id=new_id(), usage=True)).attempts
    assert {a.attempt_id: a.usage for a in listed}[running.attempt_id] == final
    plain = host.send(SnapshotRequest(version=1, id=new_id()))
    assert all(a.usage is msgspec.UNSET for a in plain.attempts)
    assert b'"usage"' not in encode_reply(plain)
    row = row_ok(host.send(fences_request(ObserveRequest, running)))
    assert (row.state, row.reason, row.exit_code) == ("failed", "memory_exhausted", 137)


def test_stop_and_release(host: Host) -> None:
    plan = make_plan()
    host.prepare(plan)
    assert row_code(host.send(fences_request(ReleaseRequest, plan))) == "not_terminal"
    stopped = row_ok(host.send(fences_request(StopRequest, plan)))
    assert (stopped.state, stopped.outcome, stopped.cleanup_confirmed) == (
        "cancelled",
        "cancelled",
        False,
    )
    assert host.runner.named("stop_requested") == [(plan.attempt_id,)]
    assert row_code(host.send(fences_request(ReleaseRequest, plan))) == "cleanup_unconfirmed"
    host.apply(plan, lc.CleanupConfirmed())
    host.runner.release_error = HostError("layout_cleanup_failed", "disk gone")
    assert row_code(host.send(fences_request(ReleaseRequest, plan))) == "layout_cleanup_failed"
    assert host.ctx.ledger.get(plan.attempt_id).status.state == "cancelled"  # type: ignore[union-attr]
    host.runner.release_error = None
    released = row_ok(host.send(fences_request(ReleaseRequest, plan)))
    assert (released.state, released.outcome, released.slot) == ("released", "cancelled", None)
    calls = len(host.runner.named("release"))
    again = row_ok(host.send(fences_request(ReleaseRequest, plan)))
    assert again.state == "released"
    assert len(host.runner.named("release")) == calls  # nothing left to release
    # the slot is free again
    assert row_ok(host.prepare(make_plan(), make_plan()), 1).slot is not None


def test_no_resource_records_release_without_the_runner(host: Host) -> None:
    plan = make_plan(provider="other")
    host.prepare(plan)
    released = row_ok(host.send(fences_request(ReleaseRequest, plan)))
    assert (released.state, released.outcome, released.reason) == (
        "released",
        "failed",
        "admission_rejected",
    )
    assert host.runner.named("release") == []


# --- streamed inputs -----------------------------------------------------------------


def write_row(plan: planlib.Plan, obj: planlib.InputObject, offset: int, data: bytes) -> InputWrite:
    f = fence(plan)
    return InputWrite(
        f.attempt_id,
        f.generation,
        f.plan_digest,
        obj.id,
        offset,
        base64.b64encode(data).decode(),
        sha(data),
    )


def status_of(host: Host, plan: planlib.Plan, obj: planlib.InputObject) -> Any:
    f = fence(plan)
    ref = ObjectRef(f.attempt_id, f.generation, f.plan_digest, obj.id)
    reply = host.send(InputStatusRequest(version=1, id=new_id(), objects=[ref]))
    assert isinstance(reply, InputsReply)
    return reply.results[0]


def write(host: Host, *rows: InputWrite) -> InputsReply:
    reply = host.send(InputWriteRequest(version=1, id=new_id(), writes=list(rows)))
    assert isinstance(reply, InputsReply)
    return reply


def stage(host: Host, plan: planlib.Plan) -> None:
    """What the runner does after admission: initialise the staging directory."""
    record = host.ctx.ledger.get(plan.attempt_id)
    assert record is not None
    assert record.slot_id is not None
    host.ctx.slots[record.slot_id].stager.prepare_attempt(plan.attempt_id)


def test_an_empty_stream_is_reported_before_its_empty_write_then_completed_by_it(
    host: Host,
) -> None:
    empty = stream(b"", "empty.bin")
    plan = make_plan(inputs=[empty])
    host.prepare(plan)
    stage(host, plan)
    before = status_of(host, plan, empty)
    assert isinstance(before, InputRow), before
    assert (before.offset, before.bytes, before.complete) == (0, 0, False)
    written = row_ok(write(host, write_row(plan, empty, 0, b"")))
    assert (written.offset, written.complete) == (0, True)
    assert status_of(host, plan, empty).complete


def test_input_upload_resumes_after_a_lost_acknowledgement(host: Host) -> None:
    first, second = b"a" * 1000 + b"b" * 500, b"second object"
    obj, other = stream(first, "first.bin"), stream(second, "second.bin")
    plan = make_plan(inputs=[obj, other])
    host.prepare(plan)
    assert row_code(write(host, write_row(plan, obj, 0, first[:1000]))) == "inputs_preparing"
    status = status_of(host, plan, obj)
    assert isinstance(status, ErrorRow)
    assert status.error.code == "inputs_preparing"
    stage(host, plan)
    assert status_of(host, plan, obj).offset == 0
    row = row_ok(write(host, write_row(plan, obj, 0, first[:1000])))
    assert (row.offset, row.complete) == (1000, False)
    # the acknowledgement is "lost": the client resends at 0 and is told to re-read
    assert row_code(write(host, write_row(plan, obj, 0, first[:1000]))) == ("input_offset_changed")
    resumed = status_of(host, plan, obj)
    assert isinstance(resumed, InputRow)
    assert (resumed.offset, resumed.bytes, resumed.digest) == (1000, 1500, obj.digest)
    # two rows of one attempt in one request run one after the other
    reply = write(host, write_row(plan, obj, 1000, first[1000:]), write_row(plan, other, 0, second))
    assert [row_ok(reply, i).complete for i in range(2)] == [True, True]
    assert host.runner.named("inputs_complete") == [(plan.attempt_id,)]
    assert row_code(write(host, write_row(plan, obj, 1500, b""))) == "input_complete"
    observed = row_ok(host.send(fences_request(ObserveRequest, plan)))
    assert observed.staged_bytes == len(first) + len(second)
    recorded = {i.object_id: i for i in host.ctx.ledger.inputs(plan.attempt_id)}
    assert recorded[obj.id].complete
    assert recorded[obj.id].identity is not None


def test_both_decoded_forms_of_input_write_are_written(host: Host) -> None:
    """The server gives the handler a ReceivedInputWriteRequest, or an InputWriteRequest
    when the base64 is spelled with JSON escapes; both write the same bytes."""
    data = b"\xff" * 3000 + b"tail"
    obj = stream(data)
    plan = make_plan(inputs=[obj])
    host.prepare(plan)
    stage(host, plan)
    rows = [write_row(plan, obj, 0, data[:3000]), write_row(plan, obj, 3000, data[3000:])]
    first = encode_request(InputWriteRequest(version=1, id=new_id(), writes=rows[:1]))
    assert isinstance(receive_request(first), ReceivedInputWriteRequest)
    assert row_ok(host.send_frame(first)).offset == 3000
    escaped = encode_request(InputWriteRequest(version=1, id=new_id(), writes=rows[1:]))
    escaped = escaped.replace(b"d", b"\\u0064")  # 'd' is in keys, base64 and hex alike
    assert isinstance(receive_request(escaped), InputWriteRequest)
    assert row_ok(host.send_frame(escaped)).complete
    record = host.ctx.ledger.get(plan.attempt_id)
    assert record is not None
    assert record.slot_id is not None
    staged = host.ctx.slots[record.slot_id].stager.status(plan.attempt_id, obj.id)
    assert (staged.offset, staged.complete) == (len(data), True)


def test_a_received_chunk_is_written_in_pieces_and_the_frame_let_go(
    host: Host, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The handler streams the pieces to the stager (never decoding the chunk whole)
    and releases the frame once the write is done."""

    def whole(row: ReceivedInputWrite) -> bytes:
        raise AssertionError("the daemon decoded a received chunk whole")

    monkeypatch.setattr(ReceivedInputWrite, "chunk", property(whole))
    data = os.urandom(2 * 1024 * 1024 + 5)
    obj = stream(data)
    plan = make_plan(inputs=[obj])
    host.prepare(plan)
    stage(host, plan)
    frame = bytearray(encode_request(InputWriteRequest(version=1, id=new_id(), writes=[
        write_row(plan, obj, 0, data)])))  # fmt: skip
    received = receive_request(frame)  # type: ignore[arg-type]  # the server passes a bytearray
    assert isinstance(received, ReceivedInputWriteRequest)
    assert len(list(received.writes[0].chunk_pieces())) > 2
    reply = run(host.daemon.dispatch(Sender.TRANSPORT, 0, received))
    assert isinstance(reply, InputsReply), reply
    assert isinstance(reply.results[0], InputRow)
    assert reply.results[0].complete
    frame.extend(b" ")  # raises BufferError while a row still holds a view of the frame
    record = host.ctx.ledger.get(plan.attempt_id)
    assert record is not None
    assert record.slot_id is not None
    staged = host.ctx.slots[record.slot_id].stager
    assert staged.status(plan.attempt_id, obj.id).complete


def test_a_wrong_digest_fails_the_attempt(host: Host) -> None:
    data = b"declared bytes"
    obj = stream(data)
    plan = make_plan(inputs=[obj])
    host.prepare(plan)
    stage(host, plan)
    assert row_code(write(host, write_row(plan, obj, 0, b"X" * len(data)))) == (
        "input_digest_mismatch"
    )
    record = host.ctx.ledger.get(plan.attempt_id)
    assert record is not None
    assert (record.status.state, record.status.reason) == ("failed", "input_digest_mismatch")
    assert row_code(write(host, write_row(plan, obj, 0, data))) == "input_failed"
    status = status_of(host, plan, obj)
    assert isinstance(status, ErrorRow)
    assert status.error.code == "input_failed"


def staged_file(host: Host, plan: planlib.Plan, obj: planlib.InputObject) -> Path:
    record = host.ctx.ledger.get(plan.attempt_id)
    assert record is not None
    assert record.slot_id is not None
    return Path(host.ctx.slots[record.slot_id].path, "ficc-staging", plan.attempt_id, obj.id)


@pytest.mark.parametrize(
    "change", [tamper.touch, tamper.replace_with_copy], ids=["touched", "replaced"]
)
def test_a_start_is_refused_in_its_row_when_a_staged_input_changed(
    host: Host, change: Callable[[Path], None]
) -> None:
    """The start row itself answers input_changed, naming the input: the attempt fails
    at once (never started, cleanup handed to the runner), and a repeated start answers
    the same. An intact attempt of the same request starts."""
    data = b"staged bytes"
    changed, intact = stream(data, "changed.bin"), stream(data, "intact.bin")
    plan, other = make_plan(inputs=[changed]), make_plan(inputs=[intact])
    host.prepare(plan, other)
    for p, obj in ((plan, changed), (other, intact)):
        stage(host, p)
        assert row_ok(write(host, write_row(p, obj, 0, data))).complete
        host.ready(p)
    change(staged_file(host, plan, changed))

    reply = host.send(fences_request(StartRequest, plan, other))
    assert row_code(reply, 0) == "input_changed"
    message = reply.results[0].error.message
    assert "'changed.bin'" in message
    assert "release the attempt and retry the job as a new attempt" in message
    assert row_ok(reply, 1).state == "starting"
    assert host.runner.named("start_requested") == [(other.attempt_id,)]
    assert host.runner.named("settled") == [(plan.attempt_id,)]
    record = host.ctx.ledger.get(plan.attempt_id)
    assert record is not None
    status = record.status
    assert (status.state, status.outcome, status.reason) == ("failed", "failed", "input_changed")
    assert not status.start_requested
    observed = row_ok(host.send(fences_request(ObserveRequest, plan)))
    assert (observed.state, observed.reason) == ("failed", "input_changed")

    again = host.send(fences_request(StartRequest, plan))
    assert row_code(again) == "input_changed"
    assert "retry the job as a new attempt" in again.results[0].error.message
    assert host.runner.named("start_requested") == [(other.attempt_id,)]  # never started


def test_inputs_need_a_current_lease_and_an_open_offer(host: Host) -> None:
    data = b"payload"
    obj = stream(data)
    plan = make_plan(inputs=[obj])
    host.prepare(plan, expires_in_ms=500)
    stage(host, plan)
    deadline = host.ctx.ledger.get(plan.attempt_id).lease.deadline_boottime_ns  # type: ignore[union-attr]
    while time.clock_gettime_ns(time.CLOCK_BOOTTIME) < deadline:
        time.sleep(0.05)  # waits for a real deadline to pass; nothing races here
    assert row_code(write(host, write_row(plan, obj, 0, data))) == "lease_expired"
    fresh = make_plan(inputs=[stream(data)])
    host.prepare(fresh)
    stage(host, fresh)
    stopped = SetOfferRequest(version=1, id=new_id(), expected_revision=1, control="stopped")
    assert isinstance(host.send(stopped, Sender.OWNER), OfferReply)
    code = row_code(write(host, write_row(fresh, fresh.job.inputs[0], 0, data)))
    assert code == "offer_closed"


# --- snapshot and set_offer ---------------------------------------------------------


def test_snapshot_pages_over_200_attempts(host: Host) -> None:
    plans = [make_plan() for _ in range(230)]
    for start in range(0, len(plans), 64):
        batch = plans[start : start + 64]
        reply = host.send(
            RejectAbsentRequest(version=1, id=new_id(), plans=batch, **host.bindings())
        )
        assert all(row_ok(reply, i).reason == "admission_rejected" for i in range(len(batch)))
    live = make_plan()
    host.prepare(live)
    seen: list[str] = []
    after = None
    pages = 0
    while True:
        reply = host.send(SnapshotRequest(version=1, id=new_id(), after=after), Sender.OWNER)
        assert isinstance(reply, SnapshotReply)
        assert len(reply.attempts) <= 64
        seen += [a.attempt_id for a in reply.attempts]
        pages += 1
        if reply.next is None:
            break
        after = reply.next
    assert seen == sorted(p.attempt_id for p in [*plans, live])
    assert pages == 4
    assert reply.bindings() == host.bindings()
    assert (reply.maximum_lease_seconds, reply.input_chunk_bytes) == (600, 8 << 20)
    assert reply.offer.revision == 1
    (cpu,) = reply.capacity.slot_classes
    assert (cpu.class_, cpu.total, cpu.free, cpu.bytes) == ("cpu", 2, 1, 1 << 34)
    assert reply.capacity.available.attempts == 1
    assert reply.capacity.available.cpu_millis == 3000
    (provider,) = reply.capacity.providers
    assert (provider.id, provider.package_digest, provider.available) == ("test", PIN, True)


def test_set_offer_within_the_ceiling(host: Host) -> None:
    limits = OfferLimits(
        Resources(
            attempts=2,
            cpu_millis=8000,
            memory_bytes=16 * GiB,
            swap_bytes=0,
            processes=4096,
            storage_bytes=1 << 35,
            storage_inodes=200_000,
        ),
        projects=[PROJECT],
        runtimes=["test"],
    )
    request = SetOfferRequest(
        version=1, id=new_id(), expected_revision=1, control="draining", limits=limits
    )
    reply = host.send(request, Sender.OWNER)
    assert isinstance(reply, OfferReply)
    assert (reply.offer.revision, reply.offer.control, reply.offer.limits) == (
        2,
        "draining",
        limits,
    )
    above = msgspec.structs.replace(
        limits, resources=msgspec.structs.replace(limits.resources, cpu_millis=8001)
    )
    too_much = SetOfferRequest(
        version=1, id=new_id(), expected_revision=2, control="active", limits=above
    )
    refused = host.send(too_much, Sender.OWNER)
    assert isinstance(refused, ErrorReply)
    assert refused.error.code == "offer_exceeds_ceiling"
    stale = SetOfferRequest(version=1, id=new_id(), expected_revision=1, control="active")
    refused = host.send(stale, Sender.ADMINISTRATOR)
    assert isinstance(refused, ErrorReply)
    assert refused.error.code == "offer_revision"
    assert host.ctx.ledger.offer().revision == 2


# --- reconcile_absent ----------------------------------------------------------------


def reconcile(host: Host, *plans: planlib.Plan) -> Any:
    request = ReconcileAbsentRequest(
        version=1, id=new_id(), plans=list(plans), acknowledge_unknown=True, **host.bindings()
    )
    return host.send(request, Sender.ADMINISTRATOR)


def test_reconcile_absent_on_an_idle_host(host: Host) -> None:
    plan = make_plan()
    reply = reconcile(host, plan)
    row = row_ok(reply)
    assert (row.state, row.outcome, row.reason, row.slot, row.cleanup_confirmed) == (
        "unknown",
        "unknown",
        "legacy_absence_acknowledged",
        None,
        True,
    )
    again = row_ok(reconcile(host, plan))
    assert again == row  # an existing record is returned unchanged
    released = row_ok(host.send(fences_request(ReleaseRequest, plan)))
    assert (released.state, released.outcome) == ("released", "unknown")


def test_reconcile_absent_refuses_a_leftover_attempt_directory(host: Host) -> None:
    slot = host.ctx.slots["slot1"]
    Layout(slot).create(new_id())
    reply = reconcile(host, make_plan())
    assert isinstance(reply, ErrorReply)
    assert reply.error.code == "reconcile_refused"
    assert "slot1 retains ficc/" in reply.error.message


#: a slot process that makes itself non-dumpable: its /proc files are then root's
NON_DUMPABLE = (
    "import ctypes, sys, time; ctypes.CDLL(None).prctl(4, 0, 0, 0, 0);"  # PR_SET_DUMPABLE 0
    " sys.stdout.write('ready'); sys.stdout.flush(); time.sleep(300)"
)


def test_a_non_dumpable_process_of_a_slot_account_is_still_found(host: Host) -> None:
    """The scan reads each thread's credentials, not who owns its /proc files."""
    slot = host.ctx.slots["slot0"]
    command = ["setpriv", f"--reuid={slot.uid}", f"--regid={slot.gid}", "--clear-groups"]
    child = subprocess.Popen(
        [*command, "/usr/bin/python3", "-c", NON_DUMPABLE], stdout=subprocess.PIPE
    )
    try:
        assert child.stdout is not None
        assert child.stdout.read(5) == b"ready"
        assert os.stat(f"/proc/{child.pid}/status").st_uid == 0  # what an owner filter sees
        assert (slot.uid, child.pid) in tasks.live_tasks({slot.uid})
        reply = reconcile(host, make_plan())
        assert isinstance(reply, ErrorReply)
        assert f"process {child.pid}" in reply.error.message
    finally:
        child.kill()
        child.wait()


def test_reconcile_absent_refuses_a_live_process_of_a_slot_account(host: Host) -> None:
    slot = host.ctx.slots["slot0"]
    child = subprocess.Popen(
        [
            "setpriv",
            f"--reuid={slot.uid}",
            f"--regid={slot.gid}",
            "--clear-groups",
            "sleep",
            "300",
        ]
    )
    try:
        deadline = time.monotonic() + 10
        while (slot.uid, child.pid) not in tasks.live_tasks({slot.uid}):
            assert time.monotonic() < deadline, "setpriv never became the slot account"
            time.sleep(0.01)
        plan = make_plan()
        reply = reconcile(host, plan)
        assert isinstance(reply, ErrorReply)
        assert reply.error.code == "reconcile_refused"
        assert f"process {child.pid}" in reply.error.message
        assert host.ctx.ledger.get(plan.attempt_id) is None
    finally:
        child.kill()
        child.wait()
    assert row_ok(reconcile(host, make_plan())).state == "unknown"


def test_reconcile_absent_refuses_while_a_reservation_is_held(host: Host) -> None:
    host.prepare(make_plan())
    reply = reconcile(host, make_plan())
    assert isinstance(reply, ErrorReply)
    assert reply.error.code == "reconcile_refused"


def test_reject_absent_refuses_changed_bindings(host: Host) -> None:
    bindings = host.bindings() | {"installation_id": new_id()}
    reply = host.send(RejectAbsentRequest(version=1, id=new_id(), plans=[make_plan()], **bindings))
    assert isinstance(reply, ErrorReply)
    assert reply.error.code == "bindings_changed"
    assert host.ctx.ledger.page() == ([], None)


# --- the daemon's ledger and supervisor choices ------------------------------------


def test_the_ledger_is_created_once_and_never_silently_recreated(host_root: Path) -> None:
    config = make_config(host_root)
    first = Host(config)
    ledger_id = first.ctx.ledger.bindings().ledger_id
    first.close()
    state = host_root / "state"
    assert (state / LEDGER_MARKER).read_text() == f"{ledger_id}\n"
    second = Host(config)
    assert second.ctx.ledger.bindings().ledger_id == ledger_id
    assert second.runner.named("recover") == []  # recovery runs in start(), not open()
    second.close()
    (state / LEDGER_FILE).unlink()
    for suffix in ("-wal", "-shm"):
        (state / (LEDGER_FILE + suffix)).unlink(missing_ok=True)
    with pytest.raises(HostError) as caught:
        Daemon.open(config, runner_factory=FakeRunner, host_check=check_directories)
    assert caught.value.code == "ledger_missing"


def test_a_slot_removed_under_an_unreleased_attempt_refuses_the_start(host_root: Path) -> None:
    """The ledger holds an attempt on slot1; the configuration lost slot1. The daemon
    (and `check-config`'s ledger check) refuse, naming the slot and what to do; once
    the attempt is released, the slot may go."""
    first = Host(make_config(host_root))
    kept, removed = make_plan(), make_plan()
    first.prepare(kept, removed)
    assert first.ctx.ledger.get(removed.attempt_id).slot_id == "slot1"  # type: ignore[union-attr]
    first.close()
    smaller = make_config(host_root, slots=1)
    with pytest.raises(HostError) as refused:
        Daemon.open(smaller, runner_factory=FakeRunner, host_check=check_directories)
    assert refused.value.code == "slot_removed"
    assert "slot1" in refused.value.message
    assert "put each back" in refused.value.message
    with pytest.raises(HostError) as checked:
        check_ledger(smaller)
    assert checked.value.code == "slot_removed"
    again = Host(make_config(host_root))
    again.apply(removed, lc.StopRequested(), lc.CleanupConfirmed())
    assert row_ok(again.send(fences_request(ReleaseRequest, removed))).state == "released"
    again.close()
    without = Host(smaller)
    try:
        # Released, then its slot removed: its logs are unavailable, never "empty and
        # complete" as for a record that never ran.
        f = fence(removed)
        read = Read(f.attempt_id, f.generation, f.plan_digest, "stdout", 0, 1024)
        reply = without.send(CollectRequest(version=1, id=new_id(), reads=[read]))
        assert row_code(reply) == "object_unavailable"
    finally:
        without.close()


def test_the_initial_offer_control_is_applied_on_creation(host_root: Path) -> None:
    config = make_config(host_root)
    paused = msgspec.structs.replace(
        config, initial_offer=msgspec.structs.replace(config.initial_offer, control="paused")
    )
    h = Host(paused)
    try:
        assert h.ctx.ledger.offer().control == "paused"
    finally:
        h.close()


def test_the_systemd_supervisor_is_refused_outside_a_systemd_unit(host_root: Path) -> None:
    """Attempt units are bound to the daemon's own unit; a daemon that is not in one
    could be stopped while its work runs on, so it refuses to open."""
    config = msgspec.structs.replace(make_config(host_root), supervisor="systemd")
    with pytest.raises(HostError) as caught:
        Daemon.open(config, runner_factory=FakeRunner, host_check=check_directories)
    assert caught.value.code == "service_unsupported"
    # and the ledger lock was released: the daemon can open with a usable supervisor
    Host(make_config(host_root)).close()


def test_start_runs_recovery_then_the_monitor(host_root: Path) -> None:
    h = Host(make_config(host_root))

    async def scenario() -> None:
        await h.daemon.start()
        assert h.runner.named("recover") == [()]
        await h.daemon.close()

    run(scenario())
    assert h.runner.named("close") == [()]


# --- collect through the handler ------------------------------------------------------


def test_collect_reads_logs_and_outputs_of_a_real_record(host: Host) -> None:
    plan = make_plan(outputs=[planlib.Output("result", "result.txt")])
    rejected = make_plan(provider="other")
    host.prepare(plan, rejected)
    record = host.ctx.ledger.get(plan.attempt_id)
    assert record is not None
    assert record.slot_id is not None
    paths = Layout(host.ctx.slots[record.slot_id]).create(plan.attempt_id)  # as the runner does
    Path(paths.stdout).write_bytes(b"hello\n")
    Path(paths.storage, "result.txt").write_bytes(b"42")

    def reads(*rows: tuple[planlib.Plan, str, int]) -> Any:
        items = [
            Read(p.attempt_id, p.generation, planlib.plan_digest(p), name, offset, 1024)
            for p, name, offset in rows
        ]
        return host.send(CollectRequest(version=1, id=new_id(), reads=items))

    reply = reads((plan, "stdout", 0), (plan, "output:result", 1), (rejected, "stderr", 0))
    out, result, empty = (row_ok(reply, i) for i in range(3))
    assert (out.data, out.eof, out.complete) == (b"hello\n", True, False)
    assert result.data == b"2"
    assert (empty.data, empty.complete) == (b"", True)
    refusals = reads((plan, "output:nope", 0), (rejected, "output:result", 0))
    assert [row_code(refusals, 0), row_code(refusals, 1)] == [
        "object_unknown",
        "object_unavailable",
    ]
    observed = row_ok(host.send(fences_request(ObserveRequest, plan)))
    assert (observed.stdout_bytes, observed.stderr_bytes) == (0, 0)  # no service wrote them
    host.ready(plan)
    assert row_ok(host.send(fences_request(StartRequest, plan))).state == "starting"
    observed = row_ok(host.send(fences_request(ObserveRequest, plan)))
    assert (observed.stdout_bytes, observed.stderr_bytes) == (6, 0)


def test_every_collect_checks_its_fence_and_state_against_the_ledger(host: Host) -> None:
    """Plans are kept decoded between requests; the records they are checked with are not."""
    plan = make_plan(outputs=[planlib.Output("result", "result.txt")])
    host.prepare(plan)
    record = host.ctx.ledger.get(plan.attempt_id)
    assert record is not None
    assert record.slot_id is not None
    paths = Layout(host.ctx.slots[record.slot_id]).create(plan.attempt_id)
    Path(paths.storage, "result.txt").write_bytes(b"42")
    digest = planlib.plan_digest(plan)

    def collect(generation: int = plan.generation, plan_digest: str = digest) -> Any:
        read = Read(plan.attempt_id, generation, plan_digest, "output:result", 0, 1024)
        return host.send(CollectRequest(version=1, id=new_id(), reads=[read]))

    first = row_ok(collect())
    assert (first.data, first.eof, first.complete) == (b"42", True, False)
    assert row_code(collect(generation=plan.generation + 1)) == "fence_mismatch"
    assert row_code(collect(plan_digest="sha256:" + "0" * 64)) == "fence_mismatch"
    host.apply(plan, lc.StopRequested(), lc.CleanupConfirmed())  # settled since the first read
    assert row_ok(collect()).complete


def test_reconcile_absent_refuses_a_leftover_service_of_a_known_attempt(host: Host) -> None:
    """A released attempt whose service tree is still there (a real cgroup directory)."""
    plan = make_plan()
    host.prepare(plan)
    host.apply(plan, lc.StopRequested(), lc.CleanupConfirmed())
    row_ok(host.send(fences_request(ReleaseRequest, plan)))
    service = host.ctx.service
    assert isinstance(service, CgroupfsService)
    hierarchy = service.layout.hierarchies[0]
    base = Path(hierarchy.mount) / "ficc"
    base.mkdir(exist_ok=True)
    node = base / service_name(INSTALLATION, plan.attempt_id)
    node.mkdir()
    try:
        reply = reconcile(host, make_plan())
        assert isinstance(reply, ErrorReply)
        assert reply.error.code == "reconcile_refused"
        assert f"service {node.name} still exists" in reply.error.message
    finally:
        node.rmdir()
    assert row_ok(reconcile(host, make_plan())).state == "unknown"


def test_inputs_resume_from_the_ledger_after_a_restart(host_root: Path) -> None:
    config = make_config(host_root)
    data = os.urandom(3000)
    obj = stream(data)
    plan = make_plan(inputs=[obj])
    first = Host(config)
    try:
        first.prepare(plan)
        stage(first, plan)
        row_ok(write(first, write_row(plan, obj, 0, data[:1000])))
        undeclared = msgspec.structs.replace(
            write_row(plan, obj, 1000, data[1000:]), object=new_id()
        )
        assert row_code(write(first, undeclared)) == "input_unknown"
    finally:
        first.close()
    second = Host(config)  # a restarted daemon: its stagers know nothing yet
    try:
        waiting = status_of(second, plan, obj)
        assert isinstance(waiting, ErrorRow)
        assert waiting.error.code == "inputs_preparing"
        # what recovery does: register the ledger's states and prepare the directory again
        record = second.ctx.ledger.get(plan.attempt_id)
        assert record is not None
        assert record.slot_id is not None
        stager = second.ctx.slots[record.slot_id].stager
        states = [i.stream_state() for i in second.ctx.ledger.inputs(plan.attempt_id)]
        stager.register_attempt(plan.attempt_id, states)
        stager.prepare_attempt(plan.attempt_id)
        assert status_of(second, plan, obj).offset == 1000
        done = row_ok(write(second, write_row(plan, obj, 1000, data[1000:])))
        assert (done.offset, done.complete) == (3000, True)
        assert second.runner.named("inputs_complete") == [(plan.attempt_id,)]
    finally:
        second.close()


def test_auto_supervisor_picks_cgroupfs_without_systemd_as_pid_1() -> None:
    with open("/proc/1/comm", "rb") as comm:
        if comm.read().strip() == b"systemd":
            pytest.skip("PID 1 is systemd here; auto picks the systemd backend")
    assert isinstance(service_backend("auto"), CgroupfsService)
    with pytest.raises(HostError) as caught:
        service_backend("systemd")
    assert caught.value.code == "service_unsupported"
    # A tool outside any service unit (the conformance kit) binds its units to none.
    assert isinstance(service_backend("systemd", bound_to_daemon=False), SystemdService)


def test_detail_is_shown_only_when_asked_and_only_where_the_runner_keeps_one(
    host: Host,
) -> None:
    failed, quiet = make_plan(), make_plan()
    host.prepare(failed, quiet)
    host.runner.kept_details[failed.attempt_id] = "runc create failed: permission denied"

    def observe(**asked: bool) -> Any:
        request = ObserveRequest(version=1, id=new_id(), attempts=[fence(failed), fence(quiet)],
                                 **asked)  # fmt: skip
        return host.send(request)

    plain = observe()
    assert [row.detail for row in plain.results] == [msgspec.UNSET] * 2
    assert b'"detail"' not in encode_reply(plain)  # an old client's reply is unchanged
    assert [row.detail for row in observe(detail=False).results] == [msgspec.UNSET] * 2
    asked = observe(detail=True)
    assert [row.detail for row in asked.results] == [
        "runc create failed: permission denied",
        msgspec.UNSET,  # nothing went wrong in its runtime: no detail
    ]
