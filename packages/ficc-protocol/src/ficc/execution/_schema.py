"""The JSON Schema of protocol version 1 and its golden vectors, generated from the models.

`python -m ficc.execution schema` prints the schema; `--write DIR` writes the schema
and the vectors (`protocol-v1.schema.json`, `vectors/...`) and `--check DIR` compares
them with what the models generate now. Both come from the msgspec models, so a new
field shows up in the next regeneration without anyone writing it by hand.

The schema (draft 2020-12) checks shapes, types, bounds and character rules, so a
controller in any language can validate a document. A few rules span fields and are
not expressible there (distinct input IDs and names, 0 bytes exactly with the empty
digest, a lease bound to its plan's digest, ...): `decode_plan` and `decode_request`
check those too.
"""

from __future__ import annotations

import base64
import copy
import hashlib
import json
import re
from typing import Any

import msgspec

from ficc.execution import wire
from ficc.execution.plan import (
    EMPTY_DIGEST,
    U63_MAX,
    InputObject,
    Job,
    Limits,
    Output,
    Payload,
    Plan,
    Runtime,
    digest_of,
    encode_plan,
    plan_digest,
)
from ficc.execution.protocol import (
    AnyRequest,
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
    Request,
    Resources,
    SetOfferRequest,
    SnapshotRequest,
    StartRequest,
    StopRequest,
    validate_request,
)

SCHEMA_FILE = "protocol-v1.schema.json"
VECTORS = "vectors"
_DRAFT = "https://json-schema.org/draft/2020-12/schema"
_REF = "#/$defs/{name}"
_BATCHES = {
    "AttemptsReply": (wire.AttemptsReply, wire.AttemptRow),
    "InputsReply": (wire.InputsReply, wire.InputRow),
    "ReadsReply": (wire.ReadsReply, wire.ReadRow),
}


# --- the schema ---------------------------------------------------------------------


def schema() -> dict[str, Any]:
    """The whole contract as one JSON Schema document.

    The document accepts any plan, request or reply; `$defs` names each one (`Plan`,
    `Request`, `Reply`, and every model by its class name) for a narrower check,
    e.g. `{"$ref": "#/$defs/Plan"}`.
    """
    types: list[Any] = [
        Plan,
        AnyRequest,
        wire.ErrorReply,
        wire.SnapshotReply,
        wire.OfferReply,
        wire.MetricsReply,
        wire.SlotsReply,
        wire.AttemptRow,
        wire.InputRow,
        wire.ReadRow,
        wire.ErrorRow,
        wire._RawBatch,
    ]
    found, defs = msgspec.json.schema_components(types, ref_template=_REF)
    raw = defs.pop("_RawBatch")
    for name, (reply, row) in _BATCHES.items():
        defs[name] = _batch(raw, reply, row)
    replies = ["ErrorReply", *_BATCHES, "SnapshotReply", "OfferReply", "MetricsReply", "SlotsReply"]
    defs["Request"] = found[1]
    defs["Reply"] = {"anyOf": [{"$ref": _REF.format(name=n)} for n in replies]}
    for definition in defs.values():
        _require_ok(definition)
    document = {
        "$schema": _DRAFT,
        "title": "ficc execution protocol, version 1",
        "description": "Every plan, request and reply of protocol version 1.",
        "anyOf": [{"$ref": _REF.format(name=n)} for n in ("Plan", "Request", "Reply")],
        "$defs": dict(sorted(defs.items())),
    }
    return _portable(document)  # type: ignore[no-any-return]


def _batch(raw: dict[str, Any], reply: type, row: type) -> dict[str, Any]:
    """A batch reply: the envelope, and rows that are each a success row or an error row."""
    shape = copy.deepcopy(raw)
    shape["title"] = reply.__name__
    shape["description"] = reply.__doc__ or ""
    shape["properties"]["results"]["items"] = {
        "anyOf": [{"$ref": _REF.format(name=row.__name__)}, {"$ref": _REF.format(name="ErrorRow")}]
    }
    return shape


def _require_ok(definition: dict[str, Any]) -> None:
    """Every reply and row carries `ok`: the models give it a default only so that
    Python code need not spell it, and `decode_reply` refuses a document without it."""
    if "ok" in definition.get("properties", {}):
        required = definition.setdefault("required", [])
        if "ok" not in required:
            required.append("ok")
            required.sort()


def _portable(node: Any) -> Any:
    """Only JSON Schema 2020-12, as every implementation reads it.

    Regex anchors in ECMA-262 form (`^` and `$`): the models anchor with `\\A` and `\\Z`
    because in Python `$` also matches before a final newline; in ECMA-262 without the
    multiline flag `$` matches only at the end. And no `discriminator`: an OpenAPI
    keyword that strict validators (ajv) refuse; the `action` constant of each request
    already tells them apart.
    """
    if isinstance(node, dict):
        return {
            key: _ecma(value) if key == "pattern" else _portable(value)
            for key, value in node.items()
            if key != "discriminator"
        }
    if isinstance(node, list):
        return [_portable(item) for item in node]
    return node


def _ecma(pattern: str) -> str:
    return re.sub(r"\\A", "^", re.sub(r"\\Z", "$", pattern))


# --- the golden vectors -------------------------------------------------------------


def _id(n: int) -> str:
    return f"{n:032x}"


def _hex(byte: str) -> str:
    return byte * 16


_REQUEST_ID = _hex("12")
_INSTALLATION = _hex("a1")
_LEDGER = _hex("b2")
_STREAM = _hex("5e")


def example_plan(*, streamed: bool) -> Plan:
    """The plans of the golden vectors `local-only` and `streamed`.

    They equal the package's own vectors of the same name, byte for byte.
    """
    inputs = [
        InputObject(
            id=_hex("3c"),
            name="scene.blend",
            bytes=1 << 20,
            digest="sha256:4f48f7207cebf92638debb5694e4a8677350cf88a9e98e73c6c466b6b1d43890",
        )
    ]
    if streamed:
        inputs += [
            InputObject(
                id=_STREAM,
                name="frames-src.tar",
                bytes=U63_MAX,
                digest="sha256:5e580eee1a39851ef636172a5b2939d4a51eeeeaa62dd4e01128d5ab0dc008ea",
                delivery="stream",
            ),
            InputObject(
                id=_hex("6f"), name="empty.txt", bytes=0, digest=EMPTY_DIGEST, delivery="stream"
            ),
        ]
    return Plan(
        version=1,
        deployment_id=_hex("0d"),
        node_id=_hex("0e"),
        project_id=_hex("0f"),
        job_id=_hex("1a"),
        attempt_id=_hex("4d") if streamed else _hex("2b"),
        generation=1,
        offer_revision=1,
        job=Job(
            name="render",
            slot_class="small",
            runtime=Runtime(
                provider="podman",
                package_digest="sha256:5c4c1964340aca5b65393bbe9d3249cdd71be26665b3320ad694f034f2743283",
                image_digest="sha256:6105d6cc76af400325e94d588ce511be5bfdbb73b437dc51eca43917d7a43e3d",
                isolation="rootless",
                network="none",
            ),
            payload=Payload(
                argv=["/usr/bin/render", "--frames", "1-100"],
                environment={"A_FIRST": "1", "LANG": "C.UTF-8"},
            ),
            limits=Limits(
                cpu_millis=2000,
                memory_bytes=4 << 30,
                swap_bytes=0,
                processes=128,
                storage_bytes=10 << 30,
                storage_inodes=100_000,
                devices=[],
            ),
            inputs=inputs,
            outputs=[Output(name="frames", path="out/frames.tar")],
            sensitive=False,
        ),
    )


def _fence(plan: Plan) -> Fence:
    return Fence(plan.attempt_id, plan.generation, plan_digest(plan))


def _renewal(plan: Plan, sequence: int) -> Renewal:
    fence = _fence(plan)
    return Renewal(
        fence.attempt_id, fence.generation, fence.plan_digest, sequence, 1_800_000_000_000
    )


def _resources() -> Resources:
    return Resources(
        attempts=4,
        cpu_millis=8000,
        memory_bytes=16 << 30,
        swap_bytes=0,
        processes=4096,
        storage_bytes=100 << 30,
        storage_inodes=1_000_000,
    )


def example_requests() -> dict[str, Request]:
    """One valid request per action."""
    plan = example_plan(streamed=True)
    fence = _fence(plan)
    ref = (fence.attempt_id, fence.generation, fence.plan_digest)
    chunk = b"the first bytes of frames-src.tar"
    base: dict[str, Any] = {"version": 1, "id": _REQUEST_ID}
    bound: dict[str, Any] = {
        **base,
        "installation_id": _INSTALLATION,
        "ledger_id": _LEDGER,
        "admission_version": 1,
    }
    return {
        "prepare": PrepareRequest(**bound, attempts=[PrepareAttempt(plan, _renewal(plan, 1))]),
        "renew": RenewRequest(**base, leases=[_renewal(plan, 2)]),
        "start": StartRequest(**base, attempts=[fence]),
        "observe": ObserveRequest(**base, attempts=[fence]),
        "stop": StopRequest(**base, attempts=[fence]),
        "release": ReleaseRequest(**base, attempts=[fence]),
        "collect": CollectRequest(
            **base, reads=[Read(*ref, "stdout", 0, 65536), Read(*ref, "output:frames", 0, 65536)]
        ),
        "input_status": InputStatusRequest(**base, objects=[ObjectRef(*ref, _STREAM)]),
        "input_write": InputWriteRequest(
            **base,
            writes=[
                InputWrite(
                    *ref,
                    object=_STREAM,
                    offset=0,
                    data=base64.b64encode(chunk).decode(),
                    digest=digest_of(chunk),
                )
            ],
        ),
        "reject_absent": RejectAbsentRequest(**bound, plans=[plan]),
        "reconcile_absent": ReconcileAbsentRequest(**bound, plans=[plan], acknowledge_unknown=True),
        "snapshot": SnapshotRequest(**base, after=None),
        "set_offer": SetOfferRequest(
            **base,
            expected_revision=3,
            control="active",
            limits=OfferLimits(resources=_resources(), projects=[_hex("0f")], runtimes=["podman"]),
        ),
        "metrics": MetricsRequest(**base),
        "check_slots": CheckSlotsRequest(**base),
    }


def _attempt(plan: Plan, state: str, **changes: Any) -> dict[str, Any]:
    fence = _fence(plan)
    row: dict[str, Any] = {
        "attempt_id": fence.attempt_id,
        "generation": fence.generation,
        "plan_digest": fence.plan_digest,
        "state": state,
        "ready": False,
        "outcome": None,
        "reason": None,
        "exit_code": None,
        "lease_sequence": 1,
        "lease_expires_at_ms": 1_800_000_000_000,
        "slot": "small-1",
        "staged_bytes": 0,
        "stdout_bytes": 0,
        "stderr_bytes": 0,
        "cleanup_confirmed": False,
    }
    return {**row, **changes}


def _attempts(plan: Plan, state: str, **changes: Any) -> wire.AttemptsReply:
    row = wire.AttemptRow(**_attempt(plan, state, **changes))
    return wire.AttemptsReply(version=1, id=_REQUEST_ID, results=[row])


def example_replies() -> dict[str, wire.AnyReply]:
    """One valid reply per action (its success shape), and `error`: a refused request."""
    plan = example_plan(streamed=True)
    fence = _fence(plan)
    env: dict[str, Any] = {"version": 1, "id": _REQUEST_ID}
    offer = wire.Offer(
        revision=3,
        control="active",
        limits=OfferLimits(resources=_resources(), projects=None, runtimes=None),
    )
    chunk = b"the first bytes of frames-src.tar"
    whole = "sha256:5e580eee1a39851ef636172a5b2939d4a51eeeeaa62dd4e01128d5ab0dc008ea"
    input_row = wire.InputRow(
        attempt_id=fence.attempt_id,
        generation=fence.generation,
        plan_digest=fence.plan_digest,
        object=_STREAM,
        offset=len(chunk),
        bytes=U63_MAX,
        digest=whole,
        complete=False,
    )
    stdout = b"frame 1 of 100\n"
    finished = {"outcome": "succeeded", "reason": "exited", "exit_code": 0}
    return {
        "prepare": _attempts(plan, "prepared"),
        "renew": _attempts(plan, "prepared", ready=True, lease_sequence=2),
        "start": _attempts(plan, "starting"),
        "observe": _attempts(plan, "running", stdout_bytes=len(stdout)),
        "stop": _attempts(plan, "cancelled", outcome="cancelled", reason="stopped"),
        "release": _attempts(plan, "released", cleanup_confirmed=True, slot=None, **finished),
        "collect": wire.ReadsReply(
            **env,
            results=[
                wire.ReadRow(
                    attempt_id=fence.attempt_id,
                    generation=fence.generation,
                    plan_digest=fence.plan_digest,
                    object="stdout",
                    offset=0,
                    data=stdout,
                    next_offset=len(stdout),
                    eof=True,
                    complete=True,
                    identity=digest_of(b"an opaque file identity"),
                ),
                wire.error_row("object_unavailable", "output `frames` does not exist yet"),
            ],
        ),
        "input_status": wire.InputsReply(**env, results=[input_row]),
        "input_write": wire.InputsReply(**env, results=[input_row]),
        "reject_absent": _attempts(
            plan,
            "failed",
            outcome="failed",
            reason="admission_rejected",
            slot=None,
            lease_sequence=0,
            lease_expires_at_ms=None,
            cleanup_confirmed=True,
        ),
        "reconcile_absent": _attempts(
            plan,
            "unknown",
            outcome="unknown",
            reason="legacy_absence_acknowledged",
            slot=None,
            lease_sequence=0,
            lease_expires_at_ms=None,
            cleanup_confirmed=True,
        ),
        "snapshot": wire.SnapshotReply(
            **env,
            installation_id=_INSTALLATION,
            ledger_id=_LEDGER,
            admission_version=1,
            maximum_lease_seconds=600,
            input_chunk_bytes=8 << 20,
            offer=offer,
            capacity=wire.Capacity(
                available=_resources(),
                slot_classes=[
                    wire.SlotClass("small", total=2, free=1, bytes=1 << 30, inodes=10**4)
                ],
                providers=[wire.ProviderInfo("podman", plan.job.runtime.package_digest, True)],
            ),
            attempts=[wire.AttemptStatus(**_attempt(plan, "running"))],
            next=None,
        ),
        "set_offer": wire.OfferReply(**env, offer=offer),
        "metrics": wire.MetricsReply(
            **env, text='# TYPE ficc_slots_free gauge\nficc_slots_free{class="small"} 1\n'
        ),
        "check_slots": wire.SlotsReply(**env, slots=_slot_states()),
        "error": wire.error_reply(_REQUEST_ID, "not_authorized", "this socket may not send it"),
    }


def usage_examples() -> dict[str, tuple[Request, wire.AnyReply]]:
    """`observe` and `snapshot` asking for `usage: true`, and their replies: a live
    reading of a running attempt and the final figures of a finished one."""
    plan = example_plan(streamed=True)
    base: dict[str, Any] = {"version": 1, "id": _REQUEST_ID}
    final = wire.Usage(
        final=True,
        cpu_user_us=12_400_000,
        cpu_system_us=800_000,
        memory_peak_bytes=1_288_490_188,
        oom_kills=0,
        processes_peak=37,
        storage_bytes=734_003_200,
        storage_inodes=412,
        wall_ms=13_710,
    )
    live = wire.Usage(final=False, cpu_user_us=2_100_000, cpu_system_us=90_000,
                      memory_peak_bytes=402_653_184, oom_kills=0, processes_peak=12)  # fmt: skip
    finished = {"outcome": "succeeded", "reason": "exited", "exit_code": 0}
    observe = _attempt(plan, "succeeded", **finished, stdout_bytes=15, usage=final)
    snapshot = example_replies()["snapshot"]
    assert isinstance(snapshot, wire.SnapshotReply)
    return {
        "observe": (
            ObserveRequest(**base, attempts=[_fence(plan)], usage=True),
            wire.AttemptsReply(**base, results=[wire.AttemptRow(**observe)]),
        ),
        "snapshot": (
            SnapshotRequest(**base, after=None, usage=True),
            msgspec.structs.replace(
                snapshot, attempts=[wire.AttemptStatus(**_attempt(plan, "running", usage=live))]
            ),
        ),
    }


def payload_usage_examples() -> dict[str, tuple[Request, wire.AnyReply]]:
    """`observe` and `snapshot` asking for `payload_usage: true`, and their replies: the
    `usage` examples with the payload's own share (`usage.payload`), which a client
    that asked only for `usage` never receives."""
    own = {
        True: wire.PayloadUsage(
            cpu_user_us=10_900_000, cpu_system_us=310_000, memory_peak_bytes=1_241_513_984
        ),
        False: wire.PayloadUsage(cpu_user_us=1_700_000, cpu_system_us=20_000),
    }
    found: dict[str, tuple[Request, wire.AnyReply]] = {}
    for action, (request, reply) in usage_examples().items():
        asked = msgspec.structs.replace(request, usage=msgspec.UNSET, payload_usage=True)
        found[action] = (asked, _with_payload(reply, own))
    return found


def _with_payload(reply: wire.AnyReply, own: dict[bool, wire.PayloadUsage]) -> wire.AnyReply:
    """`reply` with each row's `usage` given its payload part (`own[final]`)."""

    def row(status: Any) -> Any:
        used = status.usage
        return msgspec.structs.replace(
            status, usage=msgspec.structs.replace(used, payload=own[used.final])
        )

    if isinstance(reply, wire.AttemptsReply):
        return msgspec.structs.replace(reply, results=[row(r) for r in reply.results])
    assert isinstance(reply, wire.SnapshotReply)
    return msgspec.structs.replace(reply, attempts=[row(a) for a in reply.attempts])


def _slot_states() -> list[wire.SlotState]:
    """The example snapshot's two slots of class `small`: one free but out of service,
    one held by the running attempt (so none of the class is usable)."""
    broken = (
        "slot small-0: /srv/ficc/slots/small-0 is not the root of its own filesystem (it is"
        " inside /); if its filesystem exists but is not mounted, mount it again"
    )
    return [
        wire.SlotState(
            id="small-0",
            class_="small",
            healthy=False,
            free=True,
            reason="slot_filesystem",
            message=broken,
            since_ms=1_799_999_990_000,
        ),
        wire.SlotState(
            id="small-1",
            class_="small",
            healthy=True,
            free=False,
            reason=None,
            message=None,
            since_ms=1_799_999_000_000,
        ),
    ]


def opt_in_examples() -> dict[str, tuple[Request, wire.AnyReply]]:
    """`snapshot` asking for `slots: true` and for `daemon: true`, and their replies:
    what a client built before those fields never sends and never receives."""
    base: dict[str, Any] = {"version": 1, "id": _REQUEST_ID}
    snapshot = example_replies()["snapshot"]
    assert isinstance(snapshot, wire.SnapshotReply)
    classes = [msgspec.structs.replace(c, usable=0) for c in snapshot.capacity.slot_classes]
    capacity = msgspec.structs.replace(snapshot.capacity, slot_classes=classes)
    running = wire.DaemonInfo(
        started_at_ms=1_799_990_000_000,
        versions=[
            wire.RunningVersion("ficc-executor-host", "0.1.0"),
            wire.RunningVersion("ficc-protocol", "0.1.0"),
            wire.RunningVersion("ficc-provider-sdk", "0.1.0"),
        ],
    )
    return {
        "slots": (
            SnapshotRequest(**base, after=None, slots=True),
            msgspec.structs.replace(snapshot, capacity=capacity, slots=_slot_states()),
        ),
        "daemon": (
            SnapshotRequest(**base, after=None, daemon=True),
            msgspec.structs.replace(snapshot, daemon=running),
        ),
    }


def _pretty(data: bytes) -> bytes:
    """A document as reviewers read it: sorted keys, two-space indent, UTF-8."""
    text = json.dumps(json.loads(data), indent=2, sort_keys=True, ensure_ascii=False)
    return (text + "\n").encode()


def files() -> dict[str, bytes]:
    """Every generated file, by its path below the docs directory."""
    out = {SCHEMA_FILE: _pretty(msgspec.json.encode(schema()))}
    for name, streamed in (("local-only", False), ("streamed", True)):
        canonical = encode_plan(example_plan(streamed=streamed))
        out[f"{VECTORS}/plan-{name}.json"] = canonical  # exactly the bytes the digest covers
        out[f"{VECTORS}/plan-{name}.digest"] = digest_of(canonical).encode() + b"\n"
    for action, request in example_requests().items():
        _, data = validate_request(request)
        out[f"{VECTORS}/request-{action}.json"] = _pretty(data)
    requests = example_requests()
    for action, reply in example_replies().items():
        data = wire.encode_reply(reply)
        rows = requests[action].row_count if action in requests else None
        wire.decode_reply(data, action if action != "error" else "observe", rows=rows or None)
        out[f"{VECTORS}/reply-{action}.json"] = _pretty(data)
    for name, examples in (("usage", usage_examples), ("payload-usage", payload_usage_examples)):
        for action, (request, reply) in examples().items():
            _, data = validate_request(request)
            out[f"{VECTORS}/{name}-request-{action}.json"] = _pretty(data)
            data = wire.encode_reply(reply)
            wire.decode_reply(data, action, rows=request.row_count or None)
            out[f"{VECTORS}/{name}-reply-{action}.json"] = _pretty(data)
    for field, (request, reply) in opt_in_examples().items():
        _, data = validate_request(request)
        out[f"{VECTORS}/{field}-request-snapshot.json"] = _pretty(data)
        data = wire.encode_reply(reply)
        wire.decode_reply(data, "snapshot")
        out[f"{VECTORS}/{field}-reply-snapshot.json"] = _pretty(data)
    return out


def differences(found: dict[str, bytes]) -> list[str]:
    """What differs between `found` (path -> bytes on disk) and what the models generate."""
    expected = files()
    problems = [f"{path}: missing" for path in sorted(set(expected) - set(found))]
    problems += [f"{path}: not generated" for path in sorted(set(found) - set(expected))]
    problems += [
        f"{path}: differs (sha256 {hashlib.sha256(found[path]).hexdigest()[:12]})"
        for path in sorted(set(expected) & set(found))
        if found[path] != expected[path]
    ]
    return problems
