"""Property tests: encode/decode is the identity on valid messages, and the request
decoder answers every generated or mutated frame with a request or a ProtocolError."""

from __future__ import annotations

import base64
import hashlib
import json
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ficc_protocol_examples as ex
from conftest import SOAK
from ficc.execution.errors import ProtocolError
from ficc.execution.plan import (
    EMPTY_DIGEST,
    InputObject,
    Job,
    Limits,
    Output,
    Payload,
    Plan,
    Runtime,
    decode_plan,
    encode_plan,
)
from ficc.execution.protocol import (
    CollectRequest,
    Fence,
    InputWrite,
    InputWriteRequest,
    PrepareAttempt,
    PrepareRequest,
    Read,
    Renewal,
    RenewRequest,
    decode_request,
    encode_request,
)
from ficc.execution.wire import AttemptRow, AttemptsReply, decode_reply, encode_reply

MESSAGES = 5_000 if SOAK else 100
MUTATIONS = 100_000 if SOAK else 5_000
U63 = 2**63 - 1


def sized(n: int) -> settings:
    """CI or soak size; no example database, so the tests write nothing to the tree."""
    return settings(
        max_examples=n, deadline=None, suppress_health_check=list(HealthCheck), database=None
    )


HEX = "0123456789abcdef"
LOWER = "abcdefghijklmnopqrstuvwxyz"


def _word(first: str, rest: str, max_size: int) -> st.SearchStrategy[str]:
    """A first character from `first`, then up to `max_size` from `rest` (fast, no regex)."""
    return st.builds(lambda a, b: a + b, st.sampled_from(first), st.text(rest, max_size=max_size))


ids = st.text(HEX, min_size=32, max_size=32)
digests = st.text(HEX, min_size=64, max_size=64).map(lambda h: "sha256:" + h)
names = _word(LOWER, LOWER + "0123456789_.-", 12)
counts = st.one_of(st.integers(0, U63), st.sampled_from([0, 1, 2**53 + 1, U63]))
positives = st.integers(1, U63)
exec_strings = st.text(
    st.characters(exclude_characters="\x00", exclude_categories=["Cs"]), max_size=12
)
_ALNUM = LOWER + LOWER.upper() + "0123456789"
components = _word(_ALNUM + "_", _ALNUM + "_.-", 8)


@st.composite
def input_objects(draw: st.DrawFn) -> InputObject:
    size = draw(counts)
    return InputObject(
        id=draw(ids),
        name=draw(_word(_ALNUM, _ALNUM + "_.-", 12)),
        bytes=size,
        digest=EMPTY_DIGEST if size == 0 else draw(digests.filter(lambda d: d != EMPTY_DIGEST)),
        delivery=draw(st.sampled_from(["local", "stream"])),
    )


@st.composite
def plans(draw: st.DrawFn) -> Plan:
    outputs = draw(
        st.lists(
            st.builds(
                Output, name=names, path=st.lists(components, min_size=1, max_size=3).map("/".join)
            ),
            max_size=4,
            unique_by=(lambda o: o.name, lambda o: o.path),
        )
    )
    return Plan(
        version=1,
        deployment_id=draw(ids),
        node_id=draw(ids),
        project_id=draw(ids),
        job_id=draw(ids),
        attempt_id=draw(ids),
        generation=draw(positives),
        offer_revision=draw(positives),
        job=Job(
            name=draw(names),
            slot_class=draw(names),
            runtime=Runtime(draw(names), draw(digests), draw(digests), draw(names), draw(names)),
            payload=Payload(
                argv=[
                    "/" + draw(exec_strings),
                    *draw(st.lists(exec_strings, max_size=4)),
                ],
                environment=draw(
                    st.dictionaries(
                        _word(_ALNUM[:52] + "_", _ALNUM + "_", 10),
                        exec_strings,
                        max_size=4,
                    )
                ),
            ),
            limits=Limits(
                cpu_millis=draw(positives),
                memory_bytes=draw(positives),
                swap_bytes=draw(counts),
                processes=draw(positives),
                storage_bytes=draw(positives),
                storage_inodes=draw(positives),
                devices=draw(st.lists(names, max_size=3, unique=True)),
            ),
            inputs=draw(
                st.lists(input_objects(), max_size=4, unique_by=(lambda i: i.id, lambda i: i.name))
            ),
            outputs=outputs,
            sensitive=draw(st.booleans()),
        ),
    )


@pytest.mark.soak
@sized(MESSAGES)
@given(plans())
def test_plan_encode_decode_identity(plan: Plan) -> None:
    data = encode_plan(plan)
    again = decode_plan(data)
    assert again == plan
    assert encode_plan(again) == data
    # The canonical form is the stdlib's sorted compact UTF-8 JSON as well.
    stdlib = json.dumps(json.loads(data), sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    assert stdlib.encode() == data


@pytest.mark.soak
@sized(MESSAGES)
@given(st.lists(plans(), min_size=1, max_size=2, unique_by=lambda p: p.attempt_id), ids, counts)
def test_prepare_and_renew_identity(batch: list[Plan], request_id: str, expires: int) -> None:
    attempts = []
    for plan in batch:
        fence = ex.fence(plan)
        lease = Renewal(fence.attempt_id, fence.generation, fence.plan_digest, 1, expires)
        attempts.append(PrepareAttempt(plan, lease))
    prepare = PrepareRequest(version=1, id=request_id, **ex.bindings(), attempts=attempts)
    data = encode_request(prepare)
    assert decode_request(data) == prepare
    renew = RenewRequest(version=1, id=request_id, leases=[a.lease for a in attempts])
    assert decode_request(encode_request(renew)) == renew
    reply = AttemptsReply(
        version=1,
        id=request_id,
        results=[AttemptRow(**ex.attempt_status(p, "prepared")) for p in batch],
    )
    assert decode_reply(encode_reply(reply), "prepare", rows=len(batch)) == reply


@pytest.mark.soak
@sized(MESSAGES)
@given(
    st.lists(
        st.tuples(ids, ids, st.integers(0, U63 - 64), st.binary(max_size=64)),
        min_size=1,
        max_size=8,
        unique_by=lambda t: (t[0], t[1]),
    ),
    positives,
    digests,
)
def test_input_write_identity(rows: list[Any], generation: int, digest: str) -> None:
    writes = [
        InputWrite(
            attempt_id=attempt,
            generation=generation,
            plan_digest=digest,
            object=obj,
            offset=offset,
            data=base64.b64encode(chunk).decode(),
            digest="sha256:" + hashlib.sha256(chunk).hexdigest(),
        )
        for attempt, obj, offset, chunk in rows
    ]
    request = InputWriteRequest(version=1, id=ex.REQUEST_ID, writes=writes)
    decoded = decode_request(encode_request(request))
    assert decoded == request
    assert isinstance(decoded, InputWriteRequest)
    assert [w.chunk for w in decoded.writes] == [r[3] for r in rows]


@pytest.mark.soak
@sized(MESSAGES)
@given(
    st.lists(
        st.tuples(
            ids,
            st.sampled_from(["stdout", "stderr", "output:result"]),
            st.integers(0, U63 - 16384),
            st.integers(1, 16384),
        ),
        min_size=1,
        max_size=64,
        unique_by=lambda t: t[:3],
    ),
)
def test_collect_identity(rows: list[Any]) -> None:
    f = Fence(ex.hexid(1), 1, EMPTY_DIGEST)
    reads = [Read(a, f.generation, f.plan_digest, o, off, n) for a, o, off, n in rows]
    request = CollectRequest(version=1, id=ex.REQUEST_ID, reads=reads)
    assert decode_request(encode_request(request)) == request


# --- R3: generated and mutated frames against the request decoder --------------------

SEEDS = [encode_request(r) for r in ex.requests().values()]


@st.composite
def mutated(draw: st.DrawFn) -> bytes:
    data = bytearray(draw(st.sampled_from(SEEDS)))
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.integers(0, 3))
        at = draw(st.integers(0, len(data)))
        if kind == 0 and at < len(data):  # flip a byte
            data[at] = draw(st.integers(0, 255))
        elif kind == 1:  # insert JSON-ish noise
            data[at:at] = draw(st.sampled_from([b"{", b"}", b"[", b'"', b",", b"0", b"-1",
                                                b"1e400", b"true", b"null", b"\\u0000", b"\xff",
                                                b"99999999999999999999", b'"x":1,']))  # fmt: skip
        elif kind == 2:  # delete a span
            del data[at : at + draw(st.integers(1, 16))]
        else:  # duplicate a span
            end = min(len(data), at + draw(st.integers(1, 64)))
            data[at:at] = data[at:end]
    return bytes(data)


@pytest.mark.soak
@sized(MUTATIONS)
@given(st.one_of(mutated(), st.binary(max_size=256)))
def test_decoder_answers_every_frame(frame: bytes) -> None:
    error: ProtocolError | None = None
    try:
        request = decode_request(frame)
    except ProtocolError as exc:
        error = exc
    if error is not None:
        assert error.code in REQUEST_CODES
        assert error.path.startswith("$")
        return
    # Whatever was accepted is a valid request that re-encodes canonically.
    assert decode_request(encode_request(request)) == request


REQUEST_CODES = {"bad_frame", "invalid_request", "unsupported_version", "unsupported_action"}
