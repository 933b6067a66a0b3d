"""Valid example messages for the tests: one builder per model, small and explicit.

Tests mutate these (as JSON dicts) to violate exactly one constraint at a time.
"""

from __future__ import annotations

import base64
import hashlib
import pathlib
from typing import Any

import msgspec

from ficc.execution.plan import (
    EMPTY_DIGEST,
    InputObject,
    Job,
    Limits,
    Output,
    Payload,
    Plan,
    Runtime,
    digest_of,
    plan_digest,
)
from ficc.execution.protocol import (
    CheckSlotsRequest,
    CollectRequest,
    Fence,
    InputStatusRequest,
    InputWrite,
    InputWriteRequest,
    MetricsRequest,
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
    SetOfferRequest,
    SnapshotRequest,
    StartRequest,
    StopRequest,
)
from ficc.execution.wire import (
    AttemptRow,
    AttemptsReply,
    AttemptStatus,
    Capacity,
    Error,
    ErrorReply,
    ErrorRow,
    InputRow,
    InputsReply,
    Offer,
    OfferReply,
    ProviderInfo,
    ReadRow,
    ReadsReply,
    SlotClass,
    SnapshotReply,
)

U63 = 2**63 - 1
VECTORS = pathlib.Path(__file__).resolve().parents[3] / "docs" / "vectors"
"""The published request and reply documents (docs/vectors)."""


def published(name: str) -> bytes:
    """One published vector's bytes, as a controller in another language reads them."""
    return (VECTORS / name).read_bytes()


REQUEST_ID = "12" * 16
INSTALLATION = "a1" * 16
LEDGER = "b2" * 16
STREAM_ID = "5e" * 16


def hexid(n: int) -> str:
    return f"{n:032x}"


def plan(n: int = 1, *, streamed: bool = True) -> Plan:
    inputs = [InputObject(id=hexid(900 + n), name="model.bin", bytes=3, digest=digest_of(b"abc"))]
    if streamed:
        inputs.append(
            InputObject(
                id=STREAM_ID, name="data.tar", bytes=U63, digest=digest_of(b"x"), delivery="stream"
            )
        )
    return Plan(
        version=1,
        deployment_id=hexid(1),
        node_id=hexid(2),
        project_id=hexid(3),
        job_id=hexid(100 + n),
        attempt_id=hexid(200 + n),
        generation=1,
        offer_revision=1,
        job=Job(
            name="render",
            slot_class="small",
            runtime=Runtime(
                provider="podman",
                package_digest=digest_of(b"pkg"),
                image_digest=digest_of(b"img"),
                isolation="rootless",
                network="none",
            ),
            payload=Payload(argv=["/bin/echo", "hi"], environment={"LANG": "C.UTF-8"}),
            limits=Limits(
                cpu_millis=1000,
                memory_bytes=1 << 30,
                swap_bytes=0,
                processes=64,
                storage_bytes=1 << 30,
                storage_inodes=10_000,
                devices=[],
            ),
            inputs=inputs,
            outputs=[Output(name="result", path="out/result.txt")],
            sensitive=False,
        ),
    )


def fence(p: Plan) -> Fence:
    return Fence(attempt_id=p.attempt_id, generation=p.generation, plan_digest=plan_digest(p))


def renewal(p: Plan, sequence: int = 1, expires: int = 1_800_000_000_000) -> Renewal:
    f = fence(p)
    return Renewal(f.attempt_id, f.generation, f.plan_digest, sequence, expires)


def chunk_write(p: Plan, data: bytes, offset: int = 0, obj: str = STREAM_ID) -> InputWrite:
    f = fence(p)
    return InputWrite(
        attempt_id=f.attempt_id,
        generation=f.generation,
        plan_digest=f.plan_digest,
        object=obj,
        offset=offset,
        data=base64.b64encode(data).decode(),
        digest="sha256:" + hashlib.sha256(data).hexdigest(),
    )


def read(p: Plan, obj: str = "stdout", offset: int = 0, length: int = 1024) -> Read:
    f = fence(p)
    return Read(f.attempt_id, f.generation, f.plan_digest, obj, offset, length)


def resources() -> Resources:
    return Resources(
        attempts=4,
        cpu_millis=8000,
        memory_bytes=16 << 30,
        swap_bytes=0,
        processes=4096,
        storage_bytes=100 << 30,
        storage_inodes=1_000_000,
    )


def bindings() -> dict[str, Any]:
    return {"installation_id": INSTALLATION, "ledger_id": LEDGER, "admission_version": 1}


def requests() -> dict[str, Any]:
    """One valid request per action."""
    p1, p2 = plan(1), plan(2)
    base: dict[str, Any] = {"version": 1, "id": REQUEST_ID}
    return {
        "prepare": PrepareRequest(
            **base,
            **bindings(),
            attempts=[PrepareAttempt(p1, renewal(p1)), PrepareAttempt(p2, renewal(p2))],
        ),
        "renew": RenewRequest(**base, leases=[renewal(p1, 2), renewal(p2, 5)]),
        "start": StartRequest(**base, attempts=[fence(p1), fence(p2)]),
        "observe": ObserveRequest(**base, attempts=[fence(p1)]),
        "stop": StopRequest(**base, attempts=[fence(p1)]),
        "release": ReleaseRequest(**base, attempts=[fence(p2)]),
        "collect": CollectRequest(
            **base, reads=[read(p1), read(p1, "output:result", U63 - 1024), read(p2, "stderr")]
        ),
        "input_status": InputStatusRequest(**base, objects=[ObjectRef(*_f(p1), STREAM_ID)]),
        "input_write": InputWriteRequest(
            **base, writes=[chunk_write(p1, b"hello", 5), chunk_write(p2, b"", 0)]
        ),
        "reject_absent": RejectAbsentRequest(**base, **bindings(), plans=[p1, p2]),
        "reconcile_absent": ReconcileAbsentRequest(
            **base, **bindings(), plans=[p1], acknowledge_unknown=True
        ),
        "snapshot": SnapshotRequest(**base, after=hexid(7)),
        "metrics": MetricsRequest(**base),
        "check_slots": CheckSlotsRequest(**base),
        "set_offer": SetOfferRequest(
            **base,
            expected_revision=3,
            control="draining",
            limits=OfferLimits(resources=resources(), projects=[hexid(3)], runtimes=["podman"]),
        ),
    }


def _f(p: Plan) -> tuple[str, int, str]:
    f = fence(p)
    return (f.attempt_id, f.generation, f.plan_digest)


def attempt_status(p: Plan, state: str = "running", **changes: Any) -> dict[str, Any]:
    f = fence(p)
    terminal = state in ("succeeded", "failed", "cancelled", "expired", "unknown")
    row: dict[str, Any] = {
        "attempt_id": f.attempt_id,
        "generation": f.generation,
        "plan_digest": f.plan_digest,
        "state": state,
        "ready": False,
        "outcome": state if terminal else None,
        "reason": None,
        "exit_code": None,
        "lease_sequence": 1,
        "lease_expires_at_ms": 1_800_000_000_000,
        "slot": "slot-1",
        "staged_bytes": U63,
        "stdout_bytes": 10,
        "stderr_bytes": 0,
        "cleanup_confirmed": False,
    }
    row.update(changes)
    return row


def replies() -> dict[str, Any]:
    """One valid reply per shape, keyed by the action that gets it."""
    p1 = plan(1)
    f = fence(p1)
    env: dict[str, Any] = {"version": 1, "id": REQUEST_ID}
    err = ErrorRow(error=Error(code="fence_mismatch", message="the plan digest differs"))
    offer = Offer(
        revision=3,
        control="active",
        limits=OfferLimits(resources=resources(), projects=None, runtimes=None),
    )
    return {
        "prepare": AttemptsReply(
            **env,
            results=[
                AttemptRow(**attempt_status(p1, "prepared", ready=True)),
                err,
            ],
        ),
        "release": AttemptsReply(
            **env,
            results=[AttemptRow(**attempt_status(p1, "released", outcome="unknown"))],
        ),
        "input_write": InputsReply(
            **env,
            results=[
                InputRow(
                    attempt_id=f.attempt_id,
                    generation=1,
                    plan_digest=f.plan_digest,
                    object=STREAM_ID,
                    offset=U63,
                    bytes=U63,
                    digest=digest_of(b"x"),
                    complete=True,
                ),
                err,
            ],
        ),
        "collect": ReadsReply(
            **env,
            results=[
                ReadRow(
                    attempt_id=f.attempt_id,
                    generation=1,
                    plan_digest=f.plan_digest,
                    object="stdout",
                    offset=U63 - 5,
                    data=b"hello",
                    next_offset=U63,
                    eof=True,
                    complete=True,
                    identity=digest_of(b"stdout-identity"),
                ),
                ReadRow(
                    attempt_id=f.attempt_id,
                    generation=1,
                    plan_digest=f.plan_digest,
                    object="stderr",
                    offset=0,
                    data=b"",
                    next_offset=0,
                    eof=True,
                    complete=True,
                    identity=EMPTY_DIGEST,
                ),
            ],
        ),
        "snapshot": SnapshotReply(
            **env,
            installation_id=INSTALLATION,
            ledger_id=LEDGER,
            admission_version=1,
            maximum_lease_seconds=600,
            input_chunk_bytes=8 << 20,
            offer=offer,
            capacity=Capacity(
                available=resources(),
                slot_classes=[SlotClass("small", total=2, free=1, bytes=1 << 30, inodes=10_000)],
                providers=[ProviderInfo("podman", digest_of(b"pkg"), True)],
            ),
            attempts=[
                AttemptStatus(**attempt_status(plan(1))),
                AttemptStatus(**attempt_status(plan(2), "failed", reason="admission_rejected")),
            ],
            next=hexid(202),
        ),
        "set_offer": OfferReply(**env, offer=offer),
        "error": ErrorReply(
            **env, error=Error(code="not_authorized", message="this socket may not send it")
        ),
    }


def to_dict(model: Any) -> Any:
    """A model as plain JSON data, for mutation."""
    return msgspec.json.decode(msgspec.json.encode(model))
