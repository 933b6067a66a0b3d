"""Slot health and the running daemon in a snapshot: asked for with `slots: true` and
`daemon: true`, never shown to a client that did not ask, and the administrator's
`check_slots`. The golden vectors of a client built before the fields existed stay
unchanged."""

from __future__ import annotations

import json

import msgspec
import pytest

import ficc_protocol_examples as ex
from ficc.execution import _schema
from ficc.execution.errors import ErrorCode, ProtocolError
from ficc.execution.protocol import (
    ACTIONS,
    CheckSlotsRequest,
    Sender,
    SnapshotRequest,
    decode_request,
    may_send,
)
from ficc.execution.wire import (
    DaemonInfo,
    SlotClass,
    SlotsReply,
    SlotState,
    SnapshotReply,
    decode_reply,
    encode_reply,
)

FILES = _schema.files()


def test_an_old_snapshot_request_asks_for_neither_and_keeps_its_bytes() -> None:
    data = ex.published("request-snapshot.json")
    request = decode_request(data)
    assert isinstance(request, SnapshotRequest)
    assert (request.slots, request.daemon) == (msgspec.UNSET, msgspec.UNSET)
    assert not request.wants_slots
    assert not request.wants_daemon
    assert b"slots" not in data
    assert b"daemon" not in data
    assert FILES["vectors/request-snapshot.json"] == data


def test_an_old_snapshot_reply_carries_neither_and_reencodes_byte_for_byte() -> None:
    data = ex.published("reply-snapshot.json")
    for absent in (b'"slots"', b'"daemon"', b'"usable"'):
        assert absent not in data
    reply = decode_reply(data, "snapshot")
    assert isinstance(reply, SnapshotReply)
    assert (reply.slots, reply.daemon) == (msgspec.UNSET, msgspec.UNSET)
    assert all(c.usable is msgspec.UNSET for c in reply.capacity.slot_classes)
    assert json.loads(encode_reply(reply)) == json.loads(data)


@pytest.mark.parametrize("field", ["slots", "daemon"])
def test_true_asks_and_false_is_the_old_meaning(field: str) -> None:
    asked = json.loads(ex.published(f"{field}-request-snapshot.json"))
    assert asked[field] is True
    wants = f"wants_{field}"
    assert getattr(decode_request(json.dumps(asked).encode()), wants)
    assert not getattr(decode_request(json.dumps({**asked, field: False}).encode()), wants)
    for bad in (1, "yes", None):
        with pytest.raises(ProtocolError) as refused:
            decode_request(json.dumps({**asked, field: bad}).encode())
        assert (refused.value.code, refused.value.path) == (ErrorCode.INVALID_REQUEST, f"$.{field}")


def test_the_slots_reply_counts_usable_slots_and_names_the_broken_one() -> None:
    reply = decode_reply(ex.published("slots-reply-snapshot.json"), "snapshot")
    assert isinstance(reply, SnapshotReply)
    assert [c.usable for c in reply.capacity.slot_classes] == [0]
    assert isinstance(reply.slots, list)
    broken = [s for s in reply.slots if not s.healthy]
    assert [(s.id, s.reason) for s in broken] == [("small-0", "slot_filesystem")]
    assert isinstance(reply.daemon, msgspec.UnsetType)


def test_the_daemon_reply_names_the_running_versions_and_start() -> None:
    reply = decode_reply(ex.published("daemon-reply-snapshot.json"), "snapshot")
    assert isinstance(reply, SnapshotReply)
    assert isinstance(reply.daemon, DaemonInfo)
    assert reply.daemon.started_at_ms > 0
    names = [v.distribution for v in reply.daemon.versions]
    assert names == ["ficc-executor-host", "ficc-protocol", "ficc-provider-sdk"]


def test_a_client_that_did_not_ask_refuses_a_field_it_does_not_know() -> None:
    """Why the fields are opt-in: every model forbids unknown fields."""
    document = json.loads(ex.published("slots-reply-snapshot.json"))
    document["slots"][0]["temperature"] = 40
    with pytest.raises(ProtocolError) as refused:
        decode_reply(json.dumps(document).encode(), "snapshot")
    assert refused.value.code == ErrorCode.INVALID_REPLY


def test_a_slot_state_has_a_reason_exactly_when_broken() -> None:
    with pytest.raises(ValueError, match="reason exactly"):
        SlotState(id="s0", class_="small", healthy=True, free=True, reason="slot_filesystem",
                  message=None, since_ms=1)  # fmt: skip
    with pytest.raises(ValueError, match="reason exactly"):
        SlotState(id="s0", class_="small", healthy=False, free=True, reason=None,
                  message=None, since_ms=1)  # fmt: skip


def test_usable_is_never_more_than_free() -> None:
    with pytest.raises(ValueError, match="usable"):
        SlotClass("small", total=2, free=1, bytes=1, inodes=1, usable=2)


def test_check_slots_is_the_administrators_alone() -> None:
    assert "check_slots" in ACTIONS
    senders = {s for s in Sender if may_send(s, "check_slots")}
    assert senders == {Sender.ADMINISTRATOR}
    request = decode_request(ex.published("request-check_slots.json"))
    assert isinstance(request, CheckSlotsRequest)
    reply = decode_reply(ex.published("reply-check_slots.json"), "check_slots")
    assert isinstance(reply, SlotsReply)
    assert [s.healthy for s in reply.slots] == [False, True]
