"""Every error code the daemon can send, produced through its real sockets.

One test per code of the inventory (error_codes.py) that is reachable through the
socket, each asserting the exact code; plus checks that the inventory covers every
`ErrorCode` member, every code docs/protocol.md documents and every code literal the
host package raises, and that everything it lists is documented.

One daemon serves the module (a fresh one per test would triple the runtime). Its
second slot is a 12 MiB tmpfs, so `slot_full` is a real full filesystem. After each
test every attempt is stopped, confirmed clean and released, so each test finds both
slots free (the first free slot of the class is `s0`, on the ordinary filesystem); at
the end, no request of the module may have been answered `internal`. The two tests
that restart a daemon (a removed slot, `input_changed`) use their own, from conftest.

Three codes only exist in a race the daemon cannot be made to lose on purpose
(`inputs_preparing`, `input_busy`, `lease_expired`): those tests repeat the race with
fresh attempts, within a deadline, until the code appears. Tampering tests (symlinks,
chattr, rlimits, a FIFO in place of the provider's call log) undo what they did in
`finally`, before the attempt is released.
"""

from __future__ import annotations

import ast
import base64
import contextlib
import json
import os
import re
import resource
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest

import error_codes
from ficc.execution.errors import ErrorCode
from ficc.execution.frames import HEADER, REQUEST_MAX
from ficc.execution.host.core.codes import HostCode
from ficc.execution.plan import Output, Plan, plan_digest
from ficc.execution.protocol import (
    CollectRequest,
    Fence,
    InputStatusRequest,
    InputWrite,
    InputWriteRequest,
    ObjectRef,
    ObserveRequest,
    Read,
    ReleaseRequest,
    SetOfferRequest,
    SnapshotRequest,
    StartRequest,
    StopRequest,
    encode_request,
)
from ficc.execution.wire import AttemptRow, ErrorRow, ReadsReply
from ficc_testkit.accounts import Accounts
from ficc_testkit.daemons import DaemonFailed, DaemonProcess
from ficc_testkit.digests import digest_of, fake
from ficc_testkit.driver import (
    StreamedInput,
    attempt,
    error_code,
    fence,
    frame,
    input_row,
    raw_exchange,
    row_code,
    rows,
    send,
)
from ficc_testkit.host import MINIMUM_LIMITS, PROVIDER_CALLS, Daemon, Layout
from ficc_testkit.plans import new_id
from ficc_testkit.slots import private_directory
from ficc_testkit.units import MIB
from ficc_testkit.waits import now_ms, wait_for
from ficc_testkit.wheels import InstalledProvider
from test_daemon_ledger_full import fill

ROOT = Path(__file__).resolve().parent.parent
HOST_SRC = ROOT / "packages" / "ficc-executor-host" / "src" / "ficc" / "execution" / "host"
PROTOCOL_DOC = ROOT / "docs" / "protocol.md"
ROOM_ON_S1 = 12 * MIB
CHUNK = 8 * MIB
SETTLED = {"succeeded", "failed", "cancelled", "expired", "unknown"}
RACE_DEADLINE = 30.0


# --- the module's daemon ------------------------------------------------------------


@pytest.fixture(scope="module")
def host(session_dir: Path, accounts: Accounts, provider: InstalledProvider) -> Iterator[Daemon]:
    """One daemon for the module; its slots are real filesystems."""
    base = private_directory(str(session_dir), "ec-")
    layout = Layout.create(base, accounts, provider)
    daemon = Daemon(layout, provider, accounts)
    status, bugs = None, []
    try:
        daemon.start()
        yield daemon
    finally:
        try:
            status = daemon.stop()
            bugs = [e for e in daemon.process.events() if e.get("code") == "internal"]
        finally:
            layout.destroy()
    assert status == 0, f"the daemon exited {status} on SIGTERM"
    assert not bugs, f"a refusal above was a daemon bug (`internal`): {bugs}"


@pytest.fixture
def d(host: Daemon, request: pytest.FixtureRequest) -> Iterator[Daemon]:
    """The module's daemon; every attempt the test made is released afterwards."""
    yield host
    try:
        release_everything(host)
    except BaseException:
        print(f"\n--- daemon log ---\n{host.process.log()}")
        raise
    failed = getattr(request.node, "report_call", None)
    if failed is not None and failed.failed:
        print(f"\n--- daemon log ---\n{host.process.log()}")


def all_attempts(d: Daemon) -> list[Any]:
    found: list[Any] = []
    after = None
    while True:
        page = d.snapshot(after)
        found += page.attempts
        after = page.next
        if after is None:
            return found


def fence_of(status: Any) -> Fence:
    return Fence(
        attempt_id=status.attempt_id, generation=status.generation, plan_digest=status.plan_digest
    )


def release_everything(d: Daemon) -> None:
    """Stop what is active, wait for confirmed cleanup, release every attempt."""
    active = [
        fence_of(a) for a in all_attempts(d) if a.state in ("prepared", "starting", "running")
    ]
    for i in range(0, len(active), 64):
        rows(d.as_admin(StopRequest(version=1, id=new_id(), attempts=active[i : i + 64])))

    def released() -> bool:
        pending = [a for a in all_attempts(d) if a.state != "released"]
        clean = [fence_of(a) for a in pending if a.state in SETTLED and a.cleanup_confirmed]
        if clean:
            d.as_admin(ReleaseRequest(version=1, id=new_id(), attempts=clean[:64]))
        return not pending

    wait_for(released, "every attempt of the test to be released")


# --- helpers ------------------------------------------------------------------------


def reply_code(result: dict[str, Any]) -> str:
    assert result.get("reply") is not None, f"no reply frame: {result}"
    document = json.loads(result["reply"])
    assert document["ok"] is False, document
    return str(document["error"]["code"])


def raw_request(d: Daemon, document: dict[str, Any]) -> str:
    return reply_code(raw_exchange(d.admin, frame(json.dumps(document).encode())))


def plan_of(d: Daemon, **kwargs: Any) -> Plan:
    """A plan for the current offer revision (tests change the offer)."""
    kwargs.setdefault("offer_revision", d.snapshot().offer.revision)
    return d.plan(**kwargs)


def admitted(d: Daemon, plan: Plan) -> AttemptRow:
    (row,) = rows(d.prepare([plan], sender=d.as_admin))
    return attempt(row)


def ready(d: Daemon, **kwargs: Any) -> Plan:
    """A prepared attempt whose provider preparation finished (`ready: true`)."""
    plan = plan_of(d, **kwargs)
    admitted(d, plan)
    d.wait_state(plan, lambda r: r.ready, "the attempt to be ready")
    return plan


def settled_clean(d: Daemon, plan: Plan) -> AttemptRow:
    """Stop the attempt and wait until it is settled with confirmed cleanup."""
    d.stop_attempt(plan)
    return d.wait_state(
        plan, lambda r: r.state in SETTLED and r.cleanup_confirmed, "a settled, clean attempt"
    )


def one_row(d: Daemon, kind: type[Any], plan: Plan) -> Any:
    (row,) = rows(d.as_admin(kind(version=1, id=new_id(), attempts=[fence(plan)])))
    return row


def error_of(row: Any) -> tuple[str, str]:
    assert isinstance(row, ErrorRow), f"expected a refusal, got {row}"
    return row.error.code, row.error.message


def slot_path(d: Daemon, slot_id: str | None) -> Path:
    (slot,) = [s for s in d.layout.document["slots"] if s["id"] == slot_id]
    return Path(slot["path"])


def slot_account(d: Daemon, slot_id: str | None) -> tuple[int, int]:
    (slot,) = [s for s in d.layout.document["slots"] if s["id"] == slot_id]
    return int(slot["uid"]), int(slot["gid"])


def attempt_dir(d: Daemon, plan: Plan) -> Path:
    row = attempt(d.observe(plan))
    return slot_path(d, row.slot) / "ficc" / plan.attempt_id


def staged_file(d: Daemon, plan: Plan, item: StreamedInput) -> Path:
    row = attempt(d.observe(plan))
    return slot_path(d, row.slot) / "ficc-staging" / plan.attempt_id / item.id


def staged(d: Daemon, plan: Plan, item: StreamedInput) -> Any:
    """input_status once staging is initialised (`inputs_preparing` until then)."""

    def status() -> Any:
        row = d.input_status(plan, item)
        return None if row_code(row) == "inputs_preparing" else row

    return wait_for(status, "staging to be initialised")


def write(d: Daemon, plan: Plan, item: StreamedInput, offset: int, data: bytes) -> Any:
    """One input_write row, sent as root on admin.sock (no fork: usable from threads)."""
    row = InputWrite(
        attempt_id=plan.attempt_id,
        generation=plan.generation,
        plan_digest=plan_digest(plan),
        object=item.id,
        offset=offset,
        data=base64.b64encode(data).decode(),
        digest=digest_of(data),
    )
    (result,) = rows(d.as_admin(InputWriteRequest(version=1, id=new_id(), writes=[row])))
    return result


def status_row(d: Daemon, plan: Plan, item: StreamedInput) -> Any:
    ref = ObjectRef(
        attempt_id=plan.attempt_id,
        generation=plan.generation,
        plan_digest=plan_digest(plan),
        object=item.id,
    )
    (result,) = rows(d.as_admin(InputStatusRequest(version=1, id=new_id(), objects=[ref])))
    return result


def set_offer(d: Daemon, control: str, limits: Any = None) -> None:
    revision = d.snapshot().offer.revision
    request = SetOfferRequest(
        version=1,
        id=new_id(),
        expected_revision=revision,
        control=control,  # type: ignore[arg-type]
        limits=limits,
    )
    reply = d.as_owner(request)
    assert error_code(reply) is None, reply


def collect(d: Daemon, plan: Plan, name: str, offset: int = 0) -> Any:
    read = Read(
        attempt_id=plan.attempt_id,
        generation=plan.generation,
        plan_digest=plan_digest(plan),
        object=name,
        offset=offset,
        length=4096,
    )
    reply = d.as_admin(CollectRequest(version=1, id=new_id(), reads=[read]))
    assert isinstance(reply, ReadsReply), reply
    (row,) = reply.results
    return row


def chattr(flag: str, path: Path) -> None:
    subprocess.run(["chattr", flag, str(path)], check=True, capture_output=True)


def with_project(plan: Plan, project_id: str) -> Plan:
    return msgspec.structs.replace(plan, project_id=project_id)


# --- whole request: framing, decoding, authority ------------------------------------


def test_bad_frame(d: Daemon) -> None:
    assert reply_code(raw_exchange(d.admin, frame(b"\xffnot json"))) == "bad_frame"


def test_frame_too_large(d: Daemon) -> None:
    result = raw_exchange(d.admin, HEADER.pack(REQUEST_MAX + 1))
    assert reply_code(result) == "frame_too_large"


def test_invalid_request(d: Daemon) -> None:
    document = {"version": 1, "id": new_id(), "action": "snapshot", "after": 5}
    assert raw_request(d, document) == "invalid_request"


def test_unsupported_version(d: Daemon) -> None:
    assert raw_request(d, {"version": 2, "id": new_id(), "action": "snapshot"}) == (
        "unsupported_version"
    )


def test_unsupported_action(d: Daemon) -> None:
    assert raw_request(d, {"version": 1, "id": new_id(), "action": "teleport"}) == (
        "unsupported_action"
    )


def test_not_authorized(d: Daemon) -> None:
    request = ObserveRequest(version=1, id=new_id(), attempts=[fence(plan_of(d))])
    assert error_code(send(d.owner, request, d.accounts["owner"])) == "not_authorized"


def test_bindings_changed(d: Daemon) -> None:
    plan = plan_of(d)
    reply = d.prepare([plan], bindings={**d.bindings(), "ledger_id": new_id()}, sender=d.as_admin)
    assert error_code(reply) == "bindings_changed"
    assert row_code(d.observe(plan)) == "unknown_attempt"  # nothing was written


def test_busy(d: Daemon) -> None:
    """48 connections (the per-socket bound) hold admin.sock; the 49th is refused."""
    held: list[socket.socket] = []
    try:
        for _ in range(48):
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.connect(d.admin)
            held.append(sock)
        request = encode_request(SnapshotRequest(version=1, id=new_id()))
        assert reply_code(raw_exchange(d.admin, frame(request))) == "busy"
    finally:
        for sock in held:
            sock.close()


def test_offer_revision(d: Daemon) -> None:
    revision = d.snapshot().offer.revision
    request = SetOfferRequest(
        version=1, id=new_id(), expected_revision=revision + 7, control="active"
    )
    assert error_code(d.as_owner(request)) == "offer_revision"


def test_offer_exceeds_ceiling(d: Daemon) -> None:
    offer = d.snapshot().offer
    resources = msgspec.structs.replace(offer.limits.resources, cpu_millis=10**9)
    limits = msgspec.structs.replace(offer.limits, resources=resources)
    request = SetOfferRequest(
        version=1, id=new_id(), expected_revision=offer.revision, control="active", limits=limits
    )
    assert error_code(d.as_owner(request)) == "offer_exceeds_ceiling"


def test_reconcile_refused(d: Daemon) -> None:
    admitted(d, plan_of(d))  # holds a slot: the host is not idle
    assert error_code(d.as_admin(d.reconcile_request([plan_of(d)]))) == "reconcile_refused"


# --- rows: fences and leases ------------------------------------------------------------


def test_unknown_attempt(d: Daemon) -> None:
    assert error_of(d.observe(plan_of(d)))[0] == "unknown_attempt"


def test_fence_mismatch(d: Daemon) -> None:
    plan = plan_of(d)
    admitted(d, plan)
    wrong = Fence(attempt_id=plan.attempt_id, generation=2, plan_digest=plan_digest(plan))
    (row,) = rows(d.as_admin(ObserveRequest(version=1, id=new_id(), attempts=[wrong])))
    assert error_of(row)[0] == "fence_mismatch"


def test_generation_conflict(d: Daemon) -> None:
    """reject_absent writes nothing for a conflicting generation (prepare, in contrast,
    records a durable rejection: see the admission detail test)."""
    first = plan_of(d)
    admitted(d, first)
    newer = plan_of(d, job_id=first.job_id, generation=2)
    (row,) = rows(d.reject_absent([newer], sender=d.as_admin))
    assert error_of(row)[0] == "generation_conflict"


def test_lease_sequence(d: Daemon) -> None:
    plan = plan_of(d)
    admitted(d, plan)
    assert error_of(d.renew(plan, 1, now_ms() + 200_000))[0] == "lease_sequence"


def test_lease_expired(d: Daemon) -> None:
    """A renewal whose expiry has passed ends the lease at once; a start sent right
    after it meets `lease_expired`, unless the monitor (every 200 ms) expired the
    attempt first (then `invalid_state`): repeat with a fresh attempt until it shows."""
    seen: list[str] = []
    deadline = time.monotonic() + RACE_DEADLINE
    while time.monotonic() < deadline:
        plan = ready(d)
        attempt(d.renew(plan, 2, now_ms() - 1000))
        code = error_of(one_row(d, StartRequest, plan))[0]
        seen.append(code)
        if code == "lease_expired":
            print(f"lease_expired on try {len(seen)}")
            return
        assert code == "invalid_state", seen
        release_everything(d)
    raise AssertionError(f"never lease_expired within {RACE_DEADLINE} s: {seen}")


# --- admission and offer ------------------------------------------------------------


def test_admission_rejected(d: Daemon) -> None:
    plan = with_project(plan_of(d), new_id())  # a project the offer does not list
    (row,) = rows(d.prepare([plan], sender=d.as_admin))
    code, message = error_of(row)
    assert code == "admission_rejected"
    assert message.startswith("admission_rejected: this project is not in the offer"), message
    assert attempt(d.observe(plan)).reason == "admission_rejected"  # durable


def admission_detail(d: Daemon, plan: Plan, expires_in_ms: int = 300_000) -> str:
    """The precise cause an admission_rejected row names first in its message."""
    (row,) = rows(d.prepare([plan], expires_in_ms=expires_in_ms, sender=d.as_admin))
    code, message = error_of(row)
    assert code == "admission_rejected", (code, message)
    return message.split(":", 1)[0]


def test_admission_detail_node_mismatch(d: Daemon) -> None:
    """A plan for another node (or deployment) is refused before anything else."""
    for field in ("node_id", "deployment_id"):
        plan = msgspec.structs.replace(plan_of(d), **{field: new_id()})
        assert admission_detail(d, plan) == "node_mismatch", field


def test_admission_detail_slot_capacity(d: Daemon) -> None:
    assert admission_detail(d, plan_of(d, slot_class="huge")) == "slot_capacity"


def test_admission_detail_provider_unavailable(d: Daemon) -> None:
    plan = plan_of(d)
    runtime = msgspec.structs.replace(plan.job.runtime, package_digest=fake("1"))
    plan = msgspec.structs.replace(plan, job=msgspec.structs.replace(plan.job, runtime=runtime))
    assert admission_detail(d, plan) == "provider_unavailable"


def test_admission_detail_limits_below_minimum(d: Daemon) -> None:
    """Refused with the figure to ask for, before any provider call and with nothing
    reserved: the provider stated its minimum when it was configured."""
    free = d.snapshot().capacity
    plan = plan_of(d, memory_bytes=MINIMUM_LIMITS["memory_bytes"] - 1)
    (row,) = rows(d.prepare([plan], sender=d.as_admin))
    code, message = error_of(row)
    assert code == "admission_rejected", (code, message)
    needed = MINIMUM_LIMITS["memory_bytes"]
    assert message.startswith(
        f"limits_below_minimum: memory_bytes {needed - 1} is below the {needed} the test"
        f" runtime needs; ask for at least {needed} (4 MiB)"
    ), message
    rejected = attempt(d.observe(plan))
    assert (rejected.state, rejected.reason, rejected.slot) == (
        "failed",
        "admission_rejected",
        None,
    )
    assert d.snapshot().capacity == free
    assert d.layout.provider_calls("probe", plan.attempt_id) == 0


def test_admission_detail_offer_revision(d: Daemon) -> None:
    assert admission_detail(d, plan_of(d, offer_revision=99)) == "offer_revision"


def test_admission_detail_offer_closed(d: Daemon) -> None:
    set_offer(d, "paused")
    try:
        plan = plan_of(d)
        assert admission_detail(d, plan) == "offer_closed"
    finally:
        set_offer(d, "active")


def test_admission_detail_lease_expired(d: Daemon) -> None:
    assert admission_detail(d, plan_of(d), expires_in_ms=-60_000) == "lease_expired"


def test_admission_detail_generation_conflict(d: Daemon) -> None:
    first = plan_of(d)
    admitted(d, first)
    newer = plan_of(d, job_id=first.job_id, generation=2)
    assert admission_detail(d, newer) == "generation_conflict"
    rejected = attempt(d.observe(newer))  # the refusal left its durable record
    assert (rejected.state, rejected.reason, rejected.slot) == (
        "failed",
        "admission_rejected",
        None,
    )


def test_admission_detail_unknown_not_acknowledged(d: Daemon) -> None:
    """An unknown outcome (here an acknowledged legacy absence on the idle host) must be
    acknowledged by the prepare row of the job's next generation."""
    first = plan_of(d)
    (row,) = rows(d.as_admin(d.reconcile_request([first])))
    assert attempt(row).outcome == "unknown"
    assert row_code(d.release(first)) is None
    retry = plan_of(d, job_id=first.job_id, generation=2)
    assert admission_detail(d, retry) == "unknown_not_acknowledged"


def test_offer_closed(d: Daemon) -> None:
    plan = ready(d)
    set_offer(d, "paused")
    try:
        assert error_of(one_row(d, StartRequest, plan))[0] == "offer_closed"
    finally:
        set_offer(d, "active")


@pytest.mark.parametrize("layout", [{"state_dir_min_free_bytes": 2**62}], indirect=True)
def test_ledger_full(daemon: Daemon) -> None:
    """A free-space floor no filesystem meets: admission is refused whole, nothing is
    recorded. (Its own daemon: the floor is configuration.)"""
    plan = daemon.plan()
    reply = daemon.prepare([plan])
    assert error_code(reply) == "ledger_full", reply
    assert error_code(daemon.reject_absent([daemon.plan()])) == "ledger_full"
    assert daemon.snapshot().attempts == []


def test_offer_changed(d: Daemon) -> None:
    plan = ready(d)
    original = d.snapshot().offer.limits
    smaller = msgspec.structs.replace(original.resources, memory_bytes=MIB)  # plan: 64 MiB
    set_offer(d, "active", msgspec.structs.replace(original, resources=smaller))
    try:
        assert error_of(one_row(d, StartRequest, plan))[0] == "offer_changed"
    finally:
        set_offer(d, "active", original)


# --- lifecycle ----------------------------------------------------------------------


@contextlib.contextmanager
def provider_calls_blocked(d: Daemon) -> Iterator[None]:
    """Every provider call blocks: the test provider opens its call log for appending at
    the start of every call, and the log is now a FIFO without a reader. On exit a
    reader releases the blocked call and the log becomes a regular file again."""
    log = d.layout.base / PROVIDER_CALLS
    saved = d.layout.base / "provider-calls.saved"
    if log.exists():
        os.rename(log, saved)
    else:
        saved.touch()
    fifo = d.layout.base / "provider-calls.fifo"
    os.mkfifo(fifo, 0o600)
    os.rename(fifo, log)
    try:
        yield
    finally:
        reader = os.open(log, os.O_RDONLY | os.O_NONBLOCK)  # unblocks the blocked open
        try:
            os.rename(saved, log)
            # the released call writes one short line into the pipe's buffer and goes on
            yield_until = time.monotonic() + 5
            while time.monotonic() < yield_until:
                with contextlib.suppress(BlockingIOError):
                    if os.read(reader, 4096):
                        break
                time.sleep(0.02)
        finally:
            os.close(reader)


def test_runtime_preparing(d: Daemon) -> None:
    plan = plan_of(d)
    with provider_calls_blocked(d):
        admitted(d, plan)

        def refusal() -> str | None:
            code = error_of(one_row(d, StartRequest, plan))[0]
            return None if code == "not_ready" else code  # before preparation begins

        assert wait_for(refusal, "preparation to begin") == "runtime_preparing"
    d.wait_state(plan, lambda r: r.ready, "preparation to finish once released")


def test_not_ready(d: Daemon) -> None:
    item = StreamedInput(os.urandom(1000))
    plan = plan_of(d, inputs=[item])
    admitted(d, plan)
    assert error_of(one_row(d, StartRequest, plan))[0] == "not_ready"


def test_invalid_state(d: Daemon) -> None:
    plan = plan_of(d)
    admitted(d, plan)
    assert attempt(d.stop_attempt(plan)).state == "cancelled"
    assert error_of(d.renew(plan, 2, now_ms() + 100_000))[0] == "invalid_state"


def test_not_terminal(d: Daemon) -> None:
    plan = plan_of(d)
    admitted(d, plan)
    assert error_of(d.release(plan))[0] == "not_terminal"


def test_cleanup_unconfirmed(d: Daemon) -> None:
    """A live process of the slot account keeps cleanup unconfirmed (quarantine)."""
    plan = ready(d)
    uid, gid = slot_account(d, attempt(d.observe(plan)).slot)
    stray = subprocess.Popen(
        ["setpriv", f"--reuid={uid}", f"--regid={gid}", "--clear-groups", "sleep", "600"]
    )
    try:
        wait_for(lambda: _runs_as(stray.pid, uid), "the stray process to run as the slot")
        d.stop_attempt(plan)
        assert error_of(d.release(plan))[0] == "cleanup_unconfirmed"
        assert not attempt(d.observe(plan)).cleanup_confirmed
    finally:
        stray.send_signal(signal.SIGKILL)
        stray.wait()


def _runs_as(pid: int, uid: int) -> bool:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("Uid:"):
                return int(line.split()[1]) == uid
    return False


def test_provider_failed(d: Daemon) -> None:
    """Release calls the provider's release; when it fails, the reservation stays."""
    plan = ready(d)
    settled_clean(d, plan)
    log = d.layout.base / PROVIDER_CALLS
    saved = d.layout.base / "provider-calls.saved"
    os.rename(log, saved)
    log.mkdir()  # opening the call log now fails: every provider call raises
    try:
        assert error_of(d.release(plan))[0] == "provider_failed"
        assert attempt(d.observe(plan)).slot is not None  # still reserved
    finally:
        log.rmdir()
        os.rename(saved, log)
    assert attempt(d.release(plan)).state == "released"


# --- streamed inputs ------------------------------------------------------------------


def test_inputs_preparing(d: Daemon) -> None:
    """Staging initialises after the prepare reply (64 files, fsynced); an input_status
    sent at once usually finds it still preparing. Repeat until it does."""
    seen: list[str | None] = []
    deadline = time.monotonic() + RACE_DEADLINE
    while time.monotonic() < deadline:
        items = [StreamedInput(os.urandom(1), name=f"in-{i}") for i in range(64)]
        plan = plan_of(d, inputs=items)
        admitted(d, plan)
        code = row_code(status_row(d, plan, items[-1]))
        seen.append(code)
        if code == "inputs_preparing":
            print(f"inputs_preparing on try {len(seen)}")
            return
        assert code is None, seen
        release_everything(d)
    raise AssertionError(f"never inputs_preparing within {RACE_DEADLINE} s: {seen}")


def test_input_busy(d: Daemon) -> None:
    """While an 8 MiB write of one object is in flight (hash, write, fsync, commit), a
    write to another object of the same attempt is refused `input_busy`. The probe
    writes at a wrong offset, so when it is not busy it changes nothing
    (`input_offset_changed`). Repeat with fresh attempts until the two overlap."""
    seen: set[str | None] = set()
    deadline = time.monotonic() + RACE_DEADLINE
    tries = 0
    while time.monotonic() < deadline:
        tries += 1
        if _busy_during_upload(d, seen):
            print(f"input_busy on try {tries}")
            return
        release_everything(d)
    raise AssertionError(f"never input_busy within {RACE_DEADLINE} s: {seen}")


def _busy_during_upload(d: Daemon, seen: set[str | None]) -> bool:
    """Upload a 24 MiB object in a thread while probing the attempt; True on input_busy."""
    big = StreamedInput(os.urandom(3 * CHUNK), name="big")
    probe = StreamedInput(b"0123456789", name="probe")
    plan = plan_of(d, inputs=[big, probe])
    admitted(d, plan)
    staged(d, plan, big)
    done = threading.Event()
    failures: list[BaseException] = []

    def upload() -> None:
        try:
            for offset in range(0, len(big.data), CHUNK):
                input_row(write(d, plan, big, offset, big.data[offset : offset + CHUNK]))
        except BaseException as exc:  # reported by the main thread
            failures.append(exc)
        finally:
            done.set()

    uploader = threading.Thread(target=upload)
    uploader.start()
    try:
        while not done.is_set():
            code = row_code(write(d, plan, probe, 7, b"x"))
            seen.add(code)
            if code == "input_busy":
                return True
            assert code == "input_offset_changed", seen
    finally:
        uploader.join()
    assert not failures, failures
    return False


def streamed(d: Daemon, size: int = 2000, **kwargs: Any) -> tuple[Plan, StreamedInput]:
    item = StreamedInput(os.urandom(size), **kwargs)
    plan = plan_of(d, inputs=[item])
    admitted(d, plan)
    staged(d, plan, item)
    return plan, item


def test_input_unknown(d: Daemon) -> None:
    plan, _ = streamed(d)
    assert error_of(status_row(d, plan, StreamedInput(b"not declared")))[0] == "input_unknown"


def test_input_offset_changed(d: Daemon) -> None:
    plan, item = streamed(d)
    assert error_of(write(d, plan, item, 5, item.data[5:100]))[0] == "input_offset_changed"


def test_input_digest_mismatch(d: Daemon) -> None:
    plan, item = streamed(d, declared_digest=digest_of(b"other bytes"))
    assert error_of(write(d, plan, item, 0, item.data))[0] == "input_digest_mismatch"


def test_input_size_mismatch(d: Daemon) -> None:
    plan, item = streamed(d)
    assert error_of(write(d, plan, item, 0, item.data + b"!"))[0] == "input_size_mismatch"


def test_input_complete(d: Daemon) -> None:
    plan, item = streamed(d)
    assert input_row(write(d, plan, item, 0, item.data)).complete
    assert error_of(write(d, plan, item, 0, item.data))[0] == "input_complete"


def test_input_failed(d: Daemon) -> None:
    plan, item = streamed(d, declared_digest=digest_of(b"other bytes"))
    assert error_of(write(d, plan, item, 0, item.data))[0] == "input_digest_mismatch"
    assert error_of(status_row(d, plan, item))[0] == "input_failed"


def test_slot_full(d: Daemon) -> None:
    """Slot s1's filesystem filled from outside to 12 MiB of room: the second 8 MiB
    chunk cannot fit."""
    admitted(d, plan_of(d))  # takes s0, so the next attempt gets s1
    filler = d.layout.slot_paths[1] / "filler"
    room = os.statvfs(d.layout.slot_paths[1])
    with open(filler, "wb") as out:
        out.truncate(0)
        os.posix_fallocate(out.fileno(), 0, room.f_bavail * room.f_frsize - ROOM_ON_S1)
    try:
        plan, item = streamed(d, size=2 * CHUNK)
        assert attempt(d.observe(plan)).slot == "s1"
        input_row(write(d, plan, item, 0, item.data[:CHUNK]))
        assert error_of(write(d, plan, item, CHUNK, item.data[CHUNK:]))[0] == "slot_full"
        d.wait_state(plan, lambda r: r.state == "failed", "the attempt to fail")
    finally:
        filler.unlink()


def test_a_preparation_on_a_full_slot_fails_with_slot_full(d: Daemon) -> None:
    """Slot s1's filesystem full to the last block before the attempt's layout is
    made: the attempt fails (reason `slot_full`) and is released like any other,
    instead of waiting in `prepared` for its lease to run out."""
    admitted(d, plan_of(d))  # takes s0, so the next attempt gets s1
    filler = d.layout.slot_paths[1] / "filler"
    fill(filler)
    try:
        _fails_on_s1(d, "slot_full")
    finally:
        filler.unlink()


def _fails_on_s1(d: Daemon, reason: str) -> None:
    """A new attempt lands on slot s1 and fails there with `reason`."""
    plan = plan_of(d)
    assert admitted(d, plan).slot == "s1"
    failed = d.wait_state(plan, lambda r: r.state != "prepared", "the attempt to fail")
    assert (failed.state, failed.reason) == ("failed", reason), failed


def test_a_read_only_slot_refuses_new_preparations(d: Daemon) -> None:
    """Slot s1 remounted read-only (as ext4 does after an error): a new attempt on it
    fails with `slot_filesystem` before anything is written there."""
    admitted(d, plan_of(d))  # takes s0, so the next attempt gets s1
    slot = d.layout.slot_paths[1]
    subprocess.run(["mount", "-o", "remount,ro", str(slot)], check=True)
    try:
        _fails_on_s1(d, "slot_filesystem")
    finally:
        subprocess.run(["mount", "-o", "remount,rw", str(slot)], check=True)


def test_input_storage_failed(d: Daemon) -> None:
    """A write past the daemon's file-size limit fails with EFBIG (Python ignores
    SIGXFSZ), an I/O error that is not a full filesystem."""
    plan, item = streamed(d, size=3 * CHUNK)
    assert attempt(d.observe(plan)).slot == "s0"
    ledger_files = [p for p in d.layout.state_dir.iterdir() if p.is_file()]
    # the ledger's reserve file is allocated once and never written again
    ledger_bytes = sum(p.stat().st_size for p in ledger_files if p.name != "ledger.reserve")
    assert ledger_bytes < 2 * CHUNK - 4 * MIB, "the limit below would also stop the ledger"
    pid = d.process.process.pid  # type: ignore[union-attr]
    original = resource.prlimit(pid, resource.RLIMIT_FSIZE)
    resource.prlimit(pid, resource.RLIMIT_FSIZE, (2 * CHUNK, original[1]))
    try:
        for offset in (0, CHUNK):
            input_row(write(d, plan, item, offset, item.data[offset : offset + CHUNK]))
        code = error_of(write(d, plan, item, 2 * CHUNK, item.data[2 * CHUNK :]))[0]
    finally:
        resource.prlimit(pid, resource.RLIMIT_FSIZE, original)
    assert code == "input_storage_failed"


def tampered_write(d: Daemon, tamper: Callable[[Path], Callable[[], None]]) -> str:
    """Write half an object, tamper with its staged file, write the rest: the code.

    `tamper(path)` changes the file and returns the function that undoes it (run
    before the attempt is released, so release finds only what staging creates)."""
    plan, item = streamed(d)
    input_row(write(d, plan, item, 0, item.data[:1000]))
    undo = tamper(staged_file(d, plan, item))
    try:
        return error_of(write(d, plan, item, 1000, item.data[1000:]))[0]
    finally:
        undo()


def test_input_changed(daemon: Daemon) -> None:
    """After a restart the stream's hash is rebuilt from the staged prefix on the next
    write; a prefix shortened since then is refused. (Its own daemon: it restarts.)"""
    item = StreamedInput(os.urandom(2000))
    plan = daemon.plan(inputs=[item])
    rows(daemon.prepare([plan]))
    staged(daemon, plan, item)
    input_row(write(daemon, plan, item, 0, item.data[:1000]))
    daemon.restart()
    assert input_row(staged(daemon, plan, item)).offset == 1000
    os.truncate(staged_file(daemon, plan, item), 500)
    assert error_of(write(daemon, plan, item, 1000, item.data[1000:]))[0] == "input_changed"


def _replace_with(make: Callable[[Path], None]) -> Callable[[Path], Callable[[], None]]:
    def tamper(path: Path) -> Callable[[], None]:
        path.unlink()
        make(path)
        return lambda: path.unlink(missing_ok=True)

    return tamper


def test_unsafe_path(d: Daemon) -> None:
    assert tampered_write(d, _replace_with(lambda p: p.symlink_to("/etc/hostname"))) == (
        "unsafe_path"
    )


def test_not_found(d: Daemon) -> None:
    assert tampered_write(d, _replace_with(lambda p: None)) == "not_found"


def test_not_regular_file(d: Daemon) -> None:
    assert tampered_write(d, _replace_with(lambda p: os.mkfifo(p, 0o600))) == "not_regular_file"


def test_hard_link_refused(d: Daemon) -> None:
    def tamper(path: Path) -> Callable[[], None]:
        other = path.parent.parent.parent / f"ec-link-{new_id()}"  # same filesystem
        os.link(path, other)
        return other.unlink

    assert tampered_write(d, tamper) == "hard_link_refused"


def test_wrong_owner(d: Daemon) -> None:
    def tamper(path: Path) -> Callable[[], None]:
        os.chown(path, d.accounts["other"].uid, -1)
        return lambda: os.chown(path, 0, -1)

    assert tampered_write(d, tamper) == "wrong_owner"


def test_io_error(d: Daemon) -> None:
    def tamper(path: Path) -> Callable[[], None]:
        chattr("+a", path)  # append-only: open(O_RDWR) without O_APPEND is EPERM
        return lambda: chattr("-a", path)

    assert tampered_write(d, tamper) == "io_error"


# --- release and cleanup of the attempt's files ---------------------------------------


def release_refused(d: Daemon, plan: Plan, tamper: Callable[[], Callable[[], None]]) -> str:
    """Settle the attempt, tamper, release (refused: its code), undo, release again."""
    settled_clean(d, plan)
    undo = tamper()
    try:
        code = error_of(d.release(plan))[0]
        assert attempt(d.observe(plan)).slot is not None  # the reservation stays
    finally:
        undo()
    assert attempt(d.release(plan)).state == "released"
    return code


def test_unexpected_entry(d: Daemon) -> None:
    plan = ready(d)
    foreign = attempt_dir(d, plan) / "foreign"

    def tamper() -> Callable[[], None]:
        foreign.write_bytes(b"not made by the host")
        return foreign.unlink

    assert release_refused(d, plan, tamper) == "unexpected_entry"


def test_layout_unsafe(d: Daemon) -> None:
    plan = ready(d)
    directory = attempt_dir(d, plan)

    def tamper() -> Callable[[], None]:
        os.chmod(directory, 0o700)
        return lambda: os.chmod(directory, 0o711)

    assert release_refused(d, plan, tamper) == "layout_unsafe"


def test_layout_cleanup_failed(d: Daemon) -> None:
    plan = ready(d)
    log = attempt_dir(d, plan) / "logs" / "stdout"

    def tamper() -> Callable[[], None]:
        chattr("+i", log)  # unlink: EPERM
        return lambda: chattr("-i", log)

    assert release_refused(d, plan, tamper) == "layout_cleanup_failed"


def test_staging_cleanup_failed(d: Daemon) -> None:
    plan, item = streamed(d)
    path = staged_file(d, plan, item)

    def tamper() -> Callable[[], None]:
        chattr("+i", path)
        return lambda: chattr("-i", path)

    assert release_refused(d, plan, tamper) == "staging_cleanup_failed"


def test_service_not_empty(d: Daemon) -> None:
    """A started attempt keeps its (empty) cgroups until release; a process that joins
    them after cleanup was confirmed makes release refuse to remove the service."""
    plan = ready(d)
    attempt(d.start_attempt(plan))  # the gate refuses the unconfined test runtime
    ended = d.wait_state(
        plan, lambda r: r.state in SETTLED and r.cleanup_confirmed, "a refused, clean start"
    )
    assert ended.reason is not None
    assert ended.reason.startswith("gate_"), ended
    name = f"ficc-work-{d.layout.installation_id}-{plan.attempt_id}"
    nodes = sorted(Path("/sys/fs/cgroup").glob(f"*/*/{name}"))
    assert nodes, f"no cgroup of {name}"
    stray = subprocess.Popen(["sleep", "600"])
    try:
        (nodes[0] / "cgroup.procs").write_text(f"{stray.pid}\n")
        assert error_of(d.release(plan))[0] == "service_not_empty"
        assert attempt(d.observe(plan)).slot is not None  # the reservation stays
    finally:
        stray.send_signal(signal.SIGKILL)
        stray.wait()
    assert attempt(d.release(plan)).state == "released"


def test_a_removed_slot_refuses_the_start(daemon: Daemon) -> None:
    """A record whose slot left the configuration across a restart: the daemon will
    not guess where its files are, nor answer it as a record that never ran (empty
    logs, complete); it refuses to start and says what to do. With the slot back, it
    starts and the attempt is released. (Its own daemon: it rewrites the configuration.)"""
    plan = daemon.plan()
    (row,) = rows(daemon.prepare([plan]))
    assert attempt(row).slot == "s0"
    settled_clean(daemon, plan)
    kept = dict(daemon.layout.document)
    document = dict(kept)
    document["slots"] = [s for s in document["slots"] if s["id"] != "s0"]
    for limits in ("ceiling", "initial_offer"):
        document[limits] = {**document[limits], "slots": 1}
    daemon.stop()
    daemon.layout.rewrite(document)
    daemon.process = DaemonProcess.of(daemon.layout, daemon.provider)
    with pytest.raises(DaemonFailed) as refused:
        daemon.start()
    message = str(refused.value)
    assert "slot_removed" in message, message
    assert "put each back" in message, message
    daemon.layout.rewrite(kept)
    daemon.process = DaemonProcess.of(daemon.layout, daemon.provider)
    daemon.start()
    assert attempt(daemon.release(plan)).state == "released"


# --- collect ----------------------------------------------------------------------------


def test_object_unknown(d: Daemon) -> None:
    plan = ready(d)
    assert error_of(collect(d, plan, "output:nope"))[0] == "object_unknown"


def test_object_unavailable(d: Daemon) -> None:
    plan = plan_of(d)
    job = msgspec.structs.replace(plan.job, outputs=[Output(name="result", path="out/r.txt")])
    plan = msgspec.structs.replace(plan, job=job)
    admitted(d, plan)
    d.wait_state(plan, lambda r: r.ready, "the attempt to be ready")
    assert error_of(collect(d, plan, "output:result"))[0] == "object_unavailable"


def test_object_changed(d: Daemon) -> None:
    """A never-run attempt's logs are empty and final: offset 5 cannot belong to them."""
    plan = with_project(plan_of(d), new_id())
    rows(d.prepare([plan], sender=d.as_admin))  # a durable admission rejection
    assert error_of(collect(d, plan, "stdout", offset=5))[0] == "object_changed"


# --- the inventory itself -------------------------------------------------------------


def documented_codes() -> set[str]:
    """The codes of the table in docs/protocol.md section 6."""
    text = PROTOCOL_DOC.read_text()
    section = text.split("## 6. Error codes", 1)[1].split("\n## ", 1)[0]
    return set(re.findall(r"^\| `([a-z][a-z0-9_]*)` \|", section, re.MULTILINE))


def host_code_literals() -> set[str]:
    """Every code the host package names: `ErrorCode.X` and `HostCode.X` (a code is never
    a string literal there: packages/ficc-executor-host/tests/core/test_codes.py)."""
    found: set[str] = set()
    enums = {"ErrorCode": ErrorCode, "HostCode": HostCode}
    for path in HOST_SRC.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id in enums
                and node.attr.isupper()
            ):
                found.add(enums[node.value.id][node.attr].value)
    return found


def test_the_host_codes_are_exactly_the_inventory_of_host_only_codes() -> None:
    assert sorted(c.value for c in HostCode) == sorted(error_codes.HOST_ONLY)


def test_the_inventory_covers_every_error_code_member() -> None:
    missing = {c.value for c in ErrorCode} - set(error_codes.BY_CODE)
    assert not missing, f"ErrorCode members missing from error_codes.py: {sorted(missing)}"


def test_the_inventory_covers_every_documented_code() -> None:
    missing = documented_codes() - set(error_codes.BY_CODE)
    assert not missing, f"codes docs/protocol.md documents, not inventoried: {sorted(missing)}"


def test_every_inventoried_code_is_documented() -> None:
    missing = set(error_codes.BY_CODE) - documented_codes()
    assert not missing, f"inventoried codes missing from docs/protocol.md: {sorted(missing)}"


def test_every_code_the_host_raises_is_inventoried_or_host_only() -> None:
    literals = host_code_literals()
    assert "slot_full" in literals  # the scan sees literal codes
    assert "lease_sequence" in literals
    assert "not_terminal" in literals
    assert "ledger_busy" in literals  # and HostCode attributes
    unlisted = literals - set(error_codes.BY_CODE) - set(error_codes.HOST_ONLY)
    assert not unlisted, f"host codes in neither ENTRIES nor HOST_ONLY: {sorted(unlisted)}"
    both = set(error_codes.HOST_ONLY) & set(error_codes.BY_CODE)
    assert not both, f"codes both host-only and sent: {sorted(both)}"


def test_every_startup_and_command_refusal_is_in_the_configuration_reference() -> None:
    """An operator reads a refusal of `serve`, `check-config`, `status` or
    `provision-slot` in docs/configuration.md, "Refusal codes"."""
    text = (ROOT / "docs" / "configuration.md").read_text()
    section = text.split("## Refusal codes", 1)[1].split("\n## ", 1)[0]
    documented = set(re.findall(r"^\| `([a-z][a-z0-9_]*)` \|", section, re.MULTILINE))
    startup = {
        code
        for code, why in error_codes.HOST_ONLY.items()
        if why.startswith("startup or command refusal")
    }
    startup |= {"host_path_missing", "host_path_unsafe", "slot_filesystem", "slot_identity"}
    assert sorted(startup - documented) == []


def test_every_entry_names_its_proof() -> None:
    tests = globals()
    for entry in error_codes.ENTRIES:
        if entry.kind in ("socket", "detail"):
            assert entry.test is not None, entry
            assert callable(tests.get(entry.test)), entry
        elif entry.kind == "unit":
            assert entry.unit, entry
        assert entry.why, entry
