"""What an attempt used: asked for with `usage: true`, never shown to a client that did
not ask, and the golden vectors of a client built before the field existed unchanged."""

from __future__ import annotations

import json

import msgspec
import pytest

import ficc_protocol_examples as ex
from ficc.execution import _schema
from ficc.execution.errors import ErrorCode, ProtocolError
from ficc.execution.protocol import ObserveRequest, SnapshotRequest, decode_request
from ficc.execution.wire import (
    AttemptRow,
    AttemptsReply,
    PayloadUsage,
    Usage,
    decode_reply,
    encode_reply,
)

FILES = _schema.files()


@pytest.mark.parametrize("action", ["observe", "snapshot"])
def test_an_old_request_is_read_as_not_asking_and_keeps_its_bytes(action: str) -> None:
    data = ex.published(f"request-{action}.json")
    request = decode_request(data)
    assert isinstance(request, ObserveRequest | SnapshotRequest)
    assert request.usage is msgspec.UNSET
    assert not request.wants_usage
    assert b"usage" not in data
    assert FILES[f"vectors/request-{action}.json"] == data  # the golden vector is unchanged


@pytest.mark.parametrize("action", ["observe", "snapshot"])
def test_usage_true_asks_and_false_is_the_old_meaning(action: str) -> None:
    asked = json.loads(ex.published(f"usage-request-{action}.json"))
    assert asked["usage"] is True
    assert decode_request(json.dumps(asked).encode()).wants_usage  # type: ignore[union-attr]
    plain = decode_request(json.dumps({**asked, "usage": False}).encode())
    assert not plain.wants_usage  # type: ignore[union-attr]
    for bad in (1, "yes", None):
        with pytest.raises(ProtocolError) as refused:
            decode_request(json.dumps({**asked, "usage": bad}).encode())
        assert (refused.value.code, refused.value.path) == (ErrorCode.INVALID_REQUEST, "$.usage")


@pytest.mark.parametrize("action", ["observe", "snapshot"])
def test_old_replies_carry_no_usage_and_reencode_byte_for_byte(action: str) -> None:
    data = ex.published(f"reply-{action}.json")
    assert b"usage" not in data
    reply = decode_reply(data, action)
    assert json.loads(encode_reply(reply)) == json.loads(data)
    rows = reply.results if isinstance(reply, AttemptsReply) else reply.attempts  # type: ignore[union-attr]
    assert all(row.usage is msgspec.UNSET for row in rows)


def test_a_row_with_usage_round_trips_and_unknown_figures_stay_absent() -> None:
    data = ex.published("usage-reply-observe.json")
    reply = decode_reply(data, "observe", rows=1)
    assert isinstance(reply, AttemptsReply)
    (row,) = reply.results
    assert isinstance(row, AttemptRow)
    assert isinstance(row.usage, Usage)
    assert row.usage.final
    assert row.usage.cpu_user_us == 12_400_000
    partial = msgspec.structs.replace(row, usage=Usage(final=False, oom_kills=0))
    encoded = json.loads(encode_reply(msgspec.structs.replace(reply, results=[partial])))
    assert encoded["results"][0]["usage"] == {"final": False, "oom_kills": 0}


def test_a_client_that_did_not_ask_refuses_a_usage_figure_it_does_not_know() -> None:
    """Why the field is opt-in: rows forbid unknown fields, so an unasked `usage`
    (or an unknown figure inside it) is an invalid reply."""
    document = json.loads(ex.published("usage-reply-observe.json"))
    document["results"][0]["usage"]["gpu_seconds"] = 1
    with pytest.raises(ProtocolError) as refused:
        decode_reply(json.dumps(document).encode(), "observe")
    assert refused.value.code == ErrorCode.INVALID_REPLY
    document["results"][0]["usage"] = {"cpu_user_us": 1}  # `final` is required
    with pytest.raises(ProtocolError):
        decode_reply(json.dumps(document).encode(), "observe")


# --- the payload's own share: `payload_usage: true` --------------------------------------


@pytest.mark.parametrize("action", ["observe", "snapshot"])
def test_payload_usage_asks_for_usage_with_its_payload_part(action: str) -> None:
    data = ex.published(f"payload-usage-request-{action}.json")
    request = decode_request(data)
    assert isinstance(request, ObserveRequest | SnapshotRequest)
    assert (request.wants_usage, request.wants_payload_usage) == (True, True)
    assert FILES[f"vectors/payload-usage-request-{action}.json"] == data
    for name in ("request", "usage-request"):
        plain = decode_request(ex.published(f"{name}-{action}.json"))
        assert not plain.wants_payload_usage  # type: ignore[union-attr]


@pytest.mark.parametrize("action", ["observe", "snapshot"])
def test_only_a_client_that_asked_for_the_payload_receives_it(action: str) -> None:
    """A client that asked only for `usage` never sees `payload` (its `Usage` refuses
    unknown fields); one that asked reads the payload's figures beside the service's."""
    assert b"payload" not in ex.published(f"usage-reply-{action}.json")
    reply = decode_reply(ex.published(f"payload-usage-reply-{action}.json"), action)
    rows = reply.results if isinstance(reply, AttemptsReply) else reply.attempts  # type: ignore[union-attr]
    for row in rows:
        assert isinstance(row.usage, Usage)
        assert isinstance(row.usage.payload, PayloadUsage)
        assert isinstance(row.usage.cpu_user_us, int)
        assert isinstance(row.usage.payload.cpu_user_us, int)
        assert row.usage.payload.cpu_user_us <= row.usage.cpu_user_us


def test_an_unread_payload_figure_stays_absent() -> None:
    used = Usage(final=True, cpu_user_us=5, payload=PayloadUsage(cpu_user_us=2))
    assert msgspec.to_builtins(used) == {
        "final": True,
        "cpu_user_us": 5,
        "payload": {"cpu_user_us": 2},
    }
    assert msgspec.to_builtins(Usage(final=True, payload=PayloadUsage())) == {
        "final": True,
        "payload": {},
    }
