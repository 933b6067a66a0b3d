"""Malformed input against the live daemon (reliability target R3).

Generated and mutated frames go to admin.sock (the socket that may send every action,
so authority is never the reason for a refusal): random bytes, cut and oversized
length headers, valid JSON of the wrong shape, and mutations of valid requests
(flipped bytes, cut, spliced, values swapped for other types). Each case must get a
valid reply frame (almost always an error; a mutation can happen to stay valid) or a
closed connection; the daemon must keep running, and a snapshot must succeed after
every hundred cases and at the end. 500 cases in CI, 10,000 with FICC_SOAK=1.
"""

from __future__ import annotations

import base64
import json
import os
import random
from collections.abc import Callable

import pytest

from ficc.execution.frames import HEADER, REQUEST_MAX
from ficc.execution.protocol import (
    InputWrite,
    InputWriteRequest,
    ObserveRequest,
    PrepareAttempt,
    PrepareRequest,
    SnapshotRequest,
    encode_request,
)
from ficc.execution.wire import read_envelope
from ficc_testkit.digests import digest_of
from ficc_testkit.driver import fence, frame, raw_exchange, renewal
from ficc_testkit.host import Daemon
from ficc_testkit.plans import new_id

CASES = 10_000 if os.environ.get("FICC_SOAK") == "1" else 500
SEED = int(os.environ.get("FICC_SEED", "20261129"))


def valid_requests(daemon: Daemon) -> list[bytes]:
    plan = daemon.plan()
    data = os.urandom(64)
    write = InputWrite(
        **{k: getattr(fence(plan), k) for k in ("attempt_id", "generation", "plan_digest")},
        object=new_id(),
        offset=0,
        data=base64.b64encode(data).decode(),
        digest=digest_of(data),
    )
    bindings = daemon.bindings()
    return [
        encode_request(SnapshotRequest(version=1, id=new_id())),
        encode_request(ObserveRequest(version=1, id=new_id(), attempts=[fence(plan)])),
        encode_request(InputWriteRequest(version=1, id=new_id(), writes=[write])),
        encode_request(
            PrepareRequest(
                version=1,
                id=new_id(),
                **bindings,
                attempts=[PrepareAttempt(plan=plan, lease=renewal(plan, 1, 2**40))],
            )
        ),
    ]


def random_json(rng: random.Random, depth: int = 0) -> object:
    kind = rng.randrange(7 if depth < 4 else 4)
    if kind == 0:
        return rng.randrange(-(2**70), 2**70)
    if kind == 1:
        return rng.choice([None, True, False, 1.5, -0.0, "", "snapshot", "0" * 32])
    if kind == 2:
        return "".join(chr(rng.randrange(1, 0x2FF)) for _ in range(rng.randrange(40)))
    if kind == 3:
        return rng.random() * 10 ** rng.randrange(-5, 30)
    if kind == 4:
        return [random_json(rng, depth + 1) for _ in range(rng.randrange(5))]
    keys = ["version", "id", "action", "after", "attempts", "writes", "plans", "x"]
    return {rng.choice(keys): random_json(rng, depth + 1) for _ in range(rng.randrange(6))}


def mutate(rng: random.Random, payload: bytes) -> bytes:
    data = bytearray(payload)
    for _ in range(rng.randrange(1, 4)):
        op = rng.randrange(5)
        at = rng.randrange(len(data)) if data else 0
        if op == 0 and data:
            data[at] = rng.randrange(256)
        elif op == 1:
            del data[at : at + rng.randrange(1, 64)]
        elif op == 2:
            piece = data[rng.randrange(len(data) or 1) :][: rng.randrange(1, 64)]
            data[at:at] = piece
        elif op == 3:
            data[at:at] = rng.choice([b'"', b"{", b"]", b",", b"\\u0000", b"1e999", b"null"])
        else:
            data = data[:at]
    return bytes(data)


def swap_value(rng: random.Random, payload: bytes) -> bytes:
    """Replace one field of a valid request with a random JSON value."""
    document = json.loads(payload)

    def walk(node: object) -> None:
        if isinstance(node, dict) and node:
            key = rng.choice(sorted(node))
            if rng.random() < 0.5 or not isinstance(node[key], dict | list):
                node[key] = random_json(rng)
            else:
                walk(node[key])
        elif isinstance(node, list) and node:
            walk(rng.choice(node))

    walk(document)
    return json.dumps(document).encode()


def generators(valid: list[bytes]) -> list[Callable[[random.Random], bytes]]:
    return [
        lambda rng: frame(os.urandom(rng.randrange(1, 4096))),
        lambda rng: HEADER.pack(rng.randrange(1, 1 << 20)) + os.urandom(rng.randrange(0, 512)),
        lambda rng: HEADER.pack(rng.randrange(REQUEST_MAX + 1, 1 << 32)),
        lambda rng: HEADER.pack(0),
        lambda rng: os.urandom(rng.randrange(1, 4)),
        lambda rng: frame(json.dumps(random_json(rng)).encode()),
        lambda rng: frame(mutate(rng, rng.choice(valid)) or b"x"),
        lambda rng: frame(swap_value(rng, rng.choice(valid))),
    ]


def check_outcome(result: dict[str, object], case: bytes) -> None:
    assert "errno" not in result, f"connect failed ({result}); the daemon stopped accepting"
    reply = result.get("reply")
    if reply is None:
        return  # a closed connection is an acceptable answer
    assert isinstance(reply, bytes)
    version, reply_id = read_envelope(reply)
    assert version == 1, (reply[:200], case[:200])
    assert isinstance(reply_id, str)
    assert len(reply_id) == 32
    document = json.loads(reply)
    if document["ok"] is False and "error" in document:
        assert document["error"]["code"], document


@pytest.mark.soak
def test_malformed_frames_get_an_error_or_a_close_and_the_daemon_keeps_serving(
    daemon: Daemon,
) -> None:
    rng = random.Random(SEED)
    valid = valid_requests(daemon)
    makers = generators(valid)
    codes: dict[str, int] = {}
    for n in range(CASES):
        case = makers[n % len(makers)](rng)
        result = raw_exchange(daemon.admin, case)
        check_outcome(result, case)
        reply = result.get("reply")
        if isinstance(reply, bytes):
            document = json.loads(reply)
            code = document["error"]["code"] if document.get("ok") is False else "ok"
            codes[code] = codes.get(code, 0) + 1
        if n % 100 == 99:
            assert daemon.process.alive, daemon.process.log()
            assert daemon.snapshot().installation_id == daemon.layout.installation_id
    assert daemon.process.alive, daemon.process.log()
    daemon.snapshot()
    # the generators reach the refusals they aim at
    for code in ("bad_frame", "frame_too_large", "invalid_request"):
        assert codes.get(code, 0) > 0, codes
    internal = [e for e in daemon.process.events() if e.get("code") == "internal"]
    assert internal == [], internal[:3]
