"""Reply models: a valid example of each shape, every constraint, batch rows, snapshots."""

from __future__ import annotations

import base64
import copy
import json
from typing import Any

import msgspec
import pytest

import ficc_protocol_examples as ex
from ficc.execution.errors import ErrorCode, ProtocolError
from ficc.execution.frames import REPLY_MAX, FrameDecoder, encode_frame
from ficc.execution.protocol import ACTIONS
from ficc.execution.wire import (
    AttemptRow,
    AttemptsReply,
    ErrorReply,
    ErrorRow,
    InputRow,
    ReadRow,
    SnapshotReply,
    decode_reply,
    encode_reply,
    error_reply,
    error_row,
    read_envelope,
)

EXAMPLES = ex.replies()
U63 = 2**63 - 1


def _doc(kind: str) -> dict[str, Any]:
    return copy.deepcopy(ex.to_dict(EXAMPLES[kind]))


def _action(kind: str) -> str:
    return "prepare" if kind == "error" else kind


def _refused(doc: Any, action: str, rows: int | None = None) -> ProtocolError:
    with pytest.raises(ProtocolError) as info:
        decode_reply(json.dumps(doc).encode(), action, rows=rows)
    return info.value


@pytest.mark.parametrize("kind", sorted(EXAMPLES))
def test_valid_example_round_trips_through_a_frame(kind: str) -> None:
    data = encode_reply(EXAMPLES[kind])
    (payload,) = FrameDecoder(REPLY_MAX).feed(encode_frame(data, REPLY_MAX))
    reply = decode_reply(payload, _action(kind))
    assert reply == EXAMPLES[kind]
    assert encode_reply(reply) == data


@pytest.mark.parametrize("kind", sorted(EXAMPLES))
def test_unknown_fields_refused(kind: str) -> None:
    doc = _doc(kind)
    doc["extra"] = True
    error = _refused(doc, _action(kind))
    assert (error.code, error.path) == (ErrorCode.INVALID_REPLY, "$")


@pytest.mark.parametrize("kind", ["prepare", "input_write", "collect"])
def test_unknown_row_fields_refused(kind: str) -> None:
    for i in range(2):
        doc = _doc(kind)
        doc["results"][i]["extra"] = 1
        assert _refused(doc, kind).path == f"$.results[{i}]"


def test_error_reply_is_accepted_for_any_action() -> None:
    data = encode_reply(EXAMPLES["error"])
    for action in ACTIONS:
        reply = decode_reply(data, action)
        assert isinstance(reply, ErrorReply)
        assert reply.error.code == "not_authorized"


def test_every_action_has_a_reply_shape() -> None:
    for action in ACTIONS:
        with pytest.raises(ProtocolError) as info:
            decode_reply(b'{"version":1,"id":"' + ex.REQUEST_ID.encode() + b'","ok":true}', action)
        assert info.value.code == ErrorCode.INVALID_REPLY
    with pytest.raises(ProtocolError) as info:
        decode_reply(encode_reply(EXAMPLES["prepare"]), "format_disk")
    assert info.value.code == ErrorCode.UNSUPPORTED_ACTION


def test_rows_are_ok_or_error_in_order() -> None:
    reply = decode_reply(encode_reply(EXAMPLES["prepare"]), "prepare", rows=2)
    assert isinstance(reply, AttemptsReply)
    assert isinstance(reply.results[0], AttemptRow)
    assert isinstance(reply.results[1], ErrorRow)
    assert reply.results[1].error.code == "fence_mismatch"


def test_row_count_must_match_the_request() -> None:
    error = _refused(_doc("prepare"), "prepare", rows=3)
    assert error.path == "$.results"


@pytest.mark.parametrize(
    ("field", "value", "where"),
    [
        ("version", 2, "$.version"),
        ("version", True, "$.version"),
        ("id", "x", "$.id"),
        ("ok", 1, "$.ok"),
    ],
)
def test_envelope_fields(field: str, value: Any, where: str) -> None:
    doc = _doc("prepare")
    doc[field] = value
    assert _refused(doc, "prepare").path == where


def test_error_code_is_a_name_and_message_bounded() -> None:
    doc = _doc("error")
    doc["error"]["code"] = "Not Authorized"
    assert _refused(doc, "start").path == "$.error.code"
    doc = _doc("error")
    doc["error"]["message"] = "x" * 4097
    assert _refused(doc, "start").path == "$.error.message"
    doc = _doc("prepare")
    doc["results"][1]["error"]["code"] = ""
    assert _refused(doc, "prepare").path == "$.results[1].error.code"


def _attempt_doc(**changes: Any) -> dict[str, Any]:
    doc = _doc("prepare")
    doc["results"][0].update(changes)
    return doc


@pytest.mark.parametrize(
    ("changes", "where"),
    [
        ({"state": "paused"}, "$.results[0].state"),
        ({"state": "succeeded", "outcome": "failed"}, "$.results[0]"),
        ({"state": "released", "outcome": None}, "$.results[0]"),
        ({"state": "running", "outcome": "unknown", "ready": False}, "$.results[0]"),
        ({"outcome": "released"}, "$.results[0].outcome"),
        ({"exit_code": 256}, "$.results[0].exit_code"),
        ({"exit_code": -1}, "$.results[0].exit_code"),
        ({"reason": "Bad"}, "$.results[0].reason"),
        ({"lease_sequence": -1}, "$.results[0].lease_sequence"),
        ({"staged_bytes": 2**63}, "$.results[0].staged_bytes"),
        ({"cleanup_confirmed": None}, "$.results[0].cleanup_confirmed"),
        ({"generation": 0}, "$.results[0].generation"),
        ({"ok": False}, "$.results[0]"),
    ],
)
def test_attempt_row_constraints(changes: dict[str, Any], where: str) -> None:
    assert _refused(_attempt_doc(**changes), "prepare").path == where


def test_released_keeps_outcome_and_unknown_stays_unknown() -> None:
    reply = decode_reply(encode_reply(EXAMPLES["release"]), "release")
    assert isinstance(reply, AttemptsReply)
    row = reply.results[0]
    assert isinstance(row, AttemptRow)
    assert (row.state, row.outcome) == ("released", "unknown")


@pytest.mark.parametrize(
    ("changes", "where"),
    [
        ({"offset": U63, "bytes": U63 - 1, "complete": False}, "$.results[0]"),
        ({"offset": 5, "bytes": 10, "complete": True}, "$.results[0]"),
        ({"offset": 10, "bytes": 10, "complete": False}, "$.results[0]"),
        ({"offset": 2**63}, "$.results[0].offset"),
        ({"object": "stdout"}, "$.results[0].object"),
    ],
)
def test_input_row_constraints(changes: dict[str, Any], where: str) -> None:
    doc = _doc("input_write")
    doc["results"][0].update(changes)
    assert _refused(doc, "input_write").path == where


@pytest.mark.parametrize("complete", [False, True])
def test_an_empty_object_is_reported_before_and_after_its_empty_write(complete: bool) -> None:
    """`input_status` of a declared empty stream before its empty write: offset 0 of 0
    bytes, not yet complete (the upload tool then sends the empty write)."""
    doc = _doc("input_write")
    doc["results"][0].update({"offset": 0, "bytes": 0, "complete": complete})
    reply = decode_reply(msgspec.json.encode(doc), "input_status")
    row = reply.results[0]  # type: ignore[union-attr]
    assert isinstance(row, InputRow)
    assert (row.offset, row.bytes, row.complete) == (0, 0, complete)


def test_input_row_keeps_u63_offsets_exact() -> None:
    reply = decode_reply(encode_reply(EXAMPLES["input_write"]), "input_status")
    row = reply.results[0]  # type: ignore[union-attr]
    assert isinstance(row, InputRow)
    assert row.offset == row.bytes == U63


@pytest.mark.parametrize(
    ("changes", "where"),
    [
        ({"data": "aGVsbG9="}, "$.results[0].data"),  # non-canonical
        ({"data": "aGVsbG8"}, "$.results[0].data"),  # unpadded
        ({"data": "aGVs bG8="}, "$.results[0].data"),  # whitespace
        ({"data": "aGVsbG8-"}, "$.results[0].data"),  # url-safe alphabet
        ({"next_offset": U63 - 1}, "$.results[0]"),
        ({"eof": False, "complete": True}, "$.results[0]"),
        ({"object": "output:"}, "$.results[0].object"),
        ({"identity": "abc"}, "$.results[0].identity"),
        ({"data": "A" * (1398104 + 4)}, "$.results[0].data"),
        ({"data": "AAAA" * (1398104 // 4)}, "$.results[0].data"),  # 1 MiB + 2 bytes
    ],
)
def test_read_row_constraints(changes: dict[str, Any], where: str) -> None:
    doc = _doc("collect")
    doc["results"][0].update(changes)
    assert _refused(doc, "collect").path == where


@pytest.mark.parametrize(
    ("spelling", "canonical"),
    [
        ("aGVsbG8=", True),
        ("aGVsbG\\u0038=", True),  # a JSON escape inside, same string
        ("aGVsbG\\u0039=", False),  # the same escape hiding nonzero unused bits
        ("aGVsbG8\\u003d", True),
    ],
)
def test_read_row_base64_spelling_through_json_escapes(spelling: str, canonical: bool) -> None:
    doc = _doc("collect")
    frame = json.dumps(doc).replace('"aGVsbG8="', f'"{spelling}"').encode()
    if canonical:
        assert decode_reply(frame, "collect").results[0].data == b"hello"  # type: ignore[union-attr]
    else:
        with pytest.raises(ProtocolError) as info:
            decode_reply(frame, "collect")
        assert (info.value.code, info.value.path) == ("invalid_reply", "$.results[0].data")


@pytest.mark.parametrize("size", [0, 1, 2, 3, 4, 5, 1 << 20])
def test_read_row_bytes_travel_as_standard_padded_base64(size: int) -> None:
    chunk = bytes(range(256)) * (size // 256) + bytes(range(size % 256))
    row = msgspec.structs.replace(EXAMPLES["collect"].results[1], data=chunk, next_offset=size)
    frame = encode_reply(msgspec.structs.replace(EXAMPLES["collect"], results=[row]))
    assert json.loads(frame)["results"][0]["data"] == base64.b64encode(chunk).decode()
    assert decode_reply(frame, "collect", rows=1).results[0] == row


def test_read_row_data_and_largest_offsets() -> None:
    reply = decode_reply(encode_reply(EXAMPLES["collect"]), "collect")
    first, empty = reply.results  # type: ignore[union-attr]
    assert isinstance(first, ReadRow)
    assert isinstance(empty, ReadRow)
    assert first.data == b"hello"
    assert first.next_offset == U63
    assert empty.data == b""
    assert empty.complete
    assert empty.eof


def test_one_mib_read_fits_a_reply_frame() -> None:
    doc = _doc("collect")
    doc["results"] = [doc["results"][1]]
    doc["results"][0].update(
        data=base64.b64encode(b"\x00" * (1 << 20)).decode(), next_offset=1 << 20
    )
    data = json.dumps(doc).encode()
    assert len(data) <= REPLY_MAX
    assert decode_reply(data, "collect", rows=1).results[0].data == b"\x00" * (1 << 20)  # type: ignore[union-attr]


# --- snapshot -----------------------------------------------------------------------


def test_snapshot_bindings() -> None:
    reply = decode_reply(encode_reply(EXAMPLES["snapshot"]), "snapshot")
    assert isinstance(reply, SnapshotReply)
    assert reply.bindings() == {
        "installation_id": ex.INSTALLATION,
        "ledger_id": ex.LEDGER,
        "admission_version": 1,
    }


def test_old_saved_snapshot_is_readable_but_proves_no_binding() -> None:
    doc = _doc("snapshot")
    doc.update(ledger_id=None, admission_version=0)
    del doc["input_chunk_bytes"]
    reply = decode_reply(json.dumps(doc).encode(), "snapshot")
    assert isinstance(reply, SnapshotReply)
    assert reply.input_chunk_bytes == 1024 * 1024
    with pytest.raises(ProtocolError) as info:
        reply.bindings()
    assert info.value.code == ErrorCode.BINDINGS_CHANGED


@pytest.mark.parametrize(
    ("changes", "where"),
    [
        ({"ledger_id": None}, "$"),
        ({"admission_version": 0}, "$"),
        ({"admission_version": 2}, "$.admission_version"),
        ({"admission_version": True}, "$.admission_version"),
        ({"maximum_lease_seconds": 0}, "$.maximum_lease_seconds"),
        ({"input_chunk_bytes": 0}, "$.input_chunk_bytes"),
        ({"input_chunk_bytes": 8 * 1024 * 1024 + 1}, "$.input_chunk_bytes"),
        ({"next": "zz"}, "$.next"),
    ],
)
def test_snapshot_constraints(changes: dict[str, Any], where: str) -> None:
    doc = _doc("snapshot")
    doc.update(changes)
    assert _refused(doc, "snapshot").path == where


def test_snapshot_attempts_ordered_bounded_and_without_ok() -> None:
    doc = _doc("snapshot")
    doc["attempts"].reverse()
    assert _refused(doc, "snapshot").path == "$"
    doc = _doc("snapshot")
    doc["attempts"].append(copy.deepcopy(doc["attempts"][1]))
    assert _refused(doc, "snapshot").path == "$"
    doc = _doc("snapshot")
    doc["attempts"][0]["ok"] = True
    assert _refused(doc, "snapshot").path == "$.attempts[0]"
    doc = _doc("snapshot")
    base = doc["attempts"][0]
    doc["attempts"] = [dict(base, attempt_id=ex.hexid(i)) for i in range(65)]
    assert _refused(doc, "snapshot").path == "$.attempts"
    doc["attempts"].pop()
    decode_reply(json.dumps(doc).encode(), "snapshot")


@pytest.mark.parametrize(
    ("path", "value"),
    [
        ("offer.control", "open"),
        ("offer.revision", -1),
        ("capacity.available.attempts", True),
        ("capacity.slot_classes.0.class", "Small"),
        ("capacity.slot_classes.0.free", 3),
        ("capacity.providers.0.package_digest", "sha256:"),
        ("capacity.providers.0.available", "yes"),
    ],
)
def test_snapshot_nested_constraints(path: str, value: Any) -> None:
    doc = _doc("snapshot")
    target: Any = doc
    keys: list[Any] = [int(k) if k.isdigit() else k for k in path.split(".")]
    for key in keys[:-1]:
        target = target[key]
    target[keys[-1]] = value
    error = _refused(doc, "snapshot")
    assert error.path.startswith("$." + path.split(".", maxsplit=1)[0]), error


def test_error_helpers_build_valid_refusals() -> None:
    reply = error_reply(None, ErrorCode.BAD_FRAME, "x" * 5000)
    assert reply.id == "0" * 32
    decoded = decode_reply(encode_reply(reply), "snapshot")
    assert isinstance(decoded, ErrorReply)
    assert (decoded.error.code, len(decoded.error.message)) == ("bad_frame", 4096)
    batch = AttemptsReply(version=1, id=ex.REQUEST_ID, results=[error_row("input_busy", "later")])
    assert decode_reply(encode_reply(batch), "start", rows=1) == batch


def test_read_envelope_is_lenient() -> None:
    assert read_envelope(b'{"version":7,"id":"x","ok":"?","more":1}') == (7, "x")
    with pytest.raises(ProtocolError):
        read_envelope(b"[")


@pytest.mark.parametrize("frame", [b"{", b"\xff", b"[" * 100_000, b'{"ok":' * 100_000])
def test_bad_reply_json(frame: bytes) -> None:
    with pytest.raises(ProtocolError) as info:
        decode_reply(frame, "prepare")
    assert info.value.code in (ErrorCode.BAD_FRAME, ErrorCode.INVALID_REPLY)
