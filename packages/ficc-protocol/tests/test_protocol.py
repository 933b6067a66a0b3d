"""Request models: a valid example of each, every constraint, duplicates, exact paths."""

from __future__ import annotations

import base64
import copy
import hashlib
import json
from typing import Any

import pytest

import ficc_protocol_examples as ex
from ficc.execution._rows import _canonical_b64decode
from ficc.execution.errors import ErrorCode, ProtocolError
from ficc.execution.frames import REQUEST_MAX, FrameDecoder, encode_frame
from ficc.execution.plan import EMPTY_DIGEST
from ficc.execution.protocol import (
    ACTIONS,
    SENDERS,
    InputWriteRequest,
    Sender,
    decode_request,
    encode_request,
    may_send,
    validate_request,
)

EXAMPLES = ex.requests()
U63 = 2**63 - 1


def _doc(action: str) -> dict[str, Any]:
    return copy.deepcopy(ex.to_dict(EXAMPLES[action]))


def _refused(doc: Any, **kwargs: Any) -> ProtocolError:
    with pytest.raises(ProtocolError) as info:
        decode_request(json.dumps(doc).encode(), **kwargs)
    return info.value


def test_every_action_has_an_example() -> None:
    assert set(EXAMPLES) == ACTIONS


@pytest.mark.parametrize("action", sorted(ACTIONS))
def test_valid_example_round_trips(action: str) -> None:
    request, data = validate_request(EXAMPLES[action])
    assert request == EXAMPLES[action]
    assert request.action == action
    assert encode_request(request) == data  # deterministic
    # Spacing and key order do not matter on input; the encoding is canonical.
    pretty = json.dumps(json.loads(data), indent=3).encode()
    assert encode_request(decode_request(pretty)) == data


@pytest.mark.parametrize("action", sorted(ACTIONS))
def test_unknown_top_level_field_is_refused(action: str) -> None:
    doc = _doc(action)
    doc["extra"] = 1
    error = _refused(doc)
    assert (error.code, error.path) == (ErrorCode.INVALID_REQUEST, "$")
    assert "extra" in error.message
    assert error.request_id == ex.REQUEST_ID


ROW_FIELDS = {
    "prepare": "attempts",
    "renew": "leases",
    "start": "attempts",
    "observe": "attempts",
    "stop": "attempts",
    "release": "attempts",
    "collect": "reads",
    "input_status": "objects",
    "input_write": "writes",
    "reject_absent": "plans",
    "reconcile_absent": "plans",
}


@pytest.mark.parametrize("action", sorted(ROW_FIELDS))
def test_unknown_row_field_is_refused(action: str) -> None:
    doc = _doc(action)
    doc[ROW_FIELDS[action]][0]["fence"] = {}
    error = _refused(doc)
    assert error.path == f"$.{ROW_FIELDS[action]}[0]"
    assert "unknown field `fence`" in error.message


@pytest.mark.parametrize("action", sorted(ROW_FIELDS))
def test_rows_are_1_to_64(action: str) -> None:
    field = ROW_FIELDS[action]
    doc = _doc(action)
    doc[field] = []
    assert _refused(doc).path == f"$.{field}"
    doc[field] = [copy.deepcopy(_doc(action)[field][0]) for _ in range(65)]
    assert _refused(doc).path == f"$.{field}"


def _fresh_attempts(doc: dict[str, Any], field: str, count: int) -> None:
    """Give `count` copies of row 0 distinct attempt IDs (so only the count matters)."""
    rows = []
    for i in range(count):
        row = copy.deepcopy(doc[field][0])
        row["attempt_id"] = ex.hexid(5000 + i)
        rows.append(row)
    doc[field] = rows


@pytest.mark.parametrize(
    ("action", "field"),
    [("renew", "leases"), ("start", "attempts"), ("observe", "attempts"), ("stop", "attempts"),
     ("release", "attempts")],
)  # fmt: skip
def test_64_rows_pass_and_duplicate_attempts_fail(action: str, field: str) -> None:
    doc = _doc(action)
    _fresh_attempts(doc, field, 64)
    decode_request(json.dumps(doc).encode())
    doc[field][40]["attempt_id"] = doc[field][3]["attempt_id"]
    error = _refused(doc)
    assert (error.code, error.path) == (ErrorCode.INVALID_REQUEST, f"$.{field}[40].attempt_id")


@pytest.mark.parametrize("action", ["prepare", "reject_absent", "reconcile_absent"])
def test_duplicate_plans_fail(action: str) -> None:
    doc = _doc(action)
    field = ROW_FIELDS[action]
    doc[field].append(copy.deepcopy(doc[field][0]))
    error = _refused(doc)
    where = "plan.attempt_id" if action == "prepare" else "attempt_id"
    assert error.path == f"$.{field}[{len(doc[field]) - 1}].{where}"


def test_prepare_lease_must_be_the_plans_first_lease() -> None:
    for field, value in [
        ("sequence", 2),
        ("attempt_id", ex.hexid(999)),
        ("generation", 2),
        ("plan_digest", EMPTY_DIGEST),
    ]:
        doc = _doc("prepare")
        doc["attempts"][1]["lease"][field] = value
        assert _refused(doc).path == f"$.attempts[1].lease.{field}", field


@pytest.mark.parametrize("action", ["prepare", "reject_absent", "reconcile_absent"])
@pytest.mark.parametrize(
    ("field", "value"),
    [("installation_id", "x"), ("ledger_id", None), ("admission_version", 0),
     ("admission_version", True), ("admission_version", 2)],
)  # fmt: skip
def test_bindings_are_required_and_exact(action: str, field: str, value: Any) -> None:
    doc = _doc(action)
    doc[field] = value
    assert _refused(doc).path == f"$.{field}"
    del doc[field]
    assert "missing required field" in _refused(doc).message


def test_reconcile_requires_literal_acknowledgement() -> None:
    for value in (False, 1, "true", None):
        doc = _doc("reconcile_absent")
        doc["acknowledge_unknown"] = value
        assert _refused(doc).path == "$.acknowledge_unknown"
    doc = _doc("reconcile_absent")
    del doc["acknowledge_unknown"]
    assert "acknowledge_unknown" in _refused(doc).message


FENCE_VIOLATIONS = [
    ("attempt_id", "X" * 32),
    ("generation", 0),
    ("generation", True),
    ("generation", 1.5),
    ("generation", 2**63),
    ("plan_digest", "sha256:" + "a" * 63),
]


@pytest.mark.parametrize(("field", "value"), FENCE_VIOLATIONS)
@pytest.mark.parametrize("action", ["renew", "start", "collect", "input_status", "input_write"])
def test_inline_fence_fields_are_checked(action: str, field: str, value: Any) -> None:
    doc = _doc(action)
    doc[ROW_FIELDS[action]][0][field] = value
    assert _refused(doc).path == f"$.{ROW_FIELDS[action]}[0].{field}"


@pytest.mark.parametrize(
    ("field", "value"),
    [("sequence", 0), ("sequence", -1), ("expires_at_ms", -1), ("expires_at_ms", 2**63),
     ("expires_at_ms", 1.0e12), ("expires_at_ms", False)],
)  # fmt: skip
def test_renewal_fields(field: str, value: Any) -> None:
    doc = _doc("renew")
    doc["leases"][0][field] = value
    assert _refused(doc).path == f"$.leases[0].{field}"


# --- collect ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "value"),
    [("object", "stdin"), ("object", "output:"), ("object", "output:Bad"),
     ("object", "stdout\n"), ("offset", -1), ("offset", 2**63), ("length", 0),
     ("length", 1024 * 1024 + 1), ("length", True)],
)  # fmt: skip
def test_collect_read_fields(field: str, value: Any) -> None:
    doc = _doc("collect")
    doc["reads"][0][field] = value
    assert _refused(doc).path == f"$.reads[0].{field}"


def test_collect_total_is_at_most_1_mib() -> None:
    doc = _doc("collect")
    doc["reads"] = doc["reads"][:2]
    doc["reads"][0]["length"] = 512 * 1024
    doc["reads"][1]["length"] = 512 * 1024
    doc["reads"][1]["offset"] = 0
    decode_request(json.dumps(doc).encode())
    doc["reads"][1]["length"] += 1
    assert _refused(doc).path == "$.reads"


def test_collect_distinct_attempt_object_offset() -> None:
    doc = _doc("collect")
    same = copy.deepcopy(doc["reads"][0])
    doc["reads"].append(same)
    assert _refused(doc).path == "$.reads[3]"
    same["offset"] += 1  # another offset of the same object is a different read
    decode_request(json.dumps(doc).encode())


def test_collect_offset_plus_length_stays_in_range() -> None:
    doc = _doc("collect")
    doc["reads"][1]["offset"] = U63
    assert _refused(doc).path == "$.reads[1].length"


# --- input_status and input_write ---------------------------------------------------


def test_input_status_distinct_attempt_object() -> None:
    doc = _doc("input_status")
    doc["objects"].append(copy.deepcopy(doc["objects"][0]))
    assert _refused(doc).path == "$.objects[1]"
    doc["objects"][1]["object"] = ex.hexid(77)
    decode_request(json.dumps(doc).encode())
    doc["objects"][1]["object"] = "model.bin"
    assert _refused(doc).path == "$.objects[1].object"


def test_input_write_distinct_attempt_object() -> None:
    doc = _doc("input_write")
    doc["writes"][1] = copy.deepcopy(doc["writes"][0])
    doc["writes"][1]["offset"] = 10
    assert _refused(doc).path == "$.writes[1]"


def _write(data: bytes, b64: str | None = None, digest: str | None = None) -> dict[str, Any]:
    doc = _doc("input_write")
    doc["writes"] = doc["writes"][:1]
    doc["writes"][0]["data"] = base64.b64encode(data).decode() if b64 is None else b64
    doc["writes"][0]["digest"] = digest or "sha256:" + hashlib.sha256(data).hexdigest()
    return doc


@pytest.mark.parametrize(
    "b64",
    ["aGVsbG8", "aGVsbG9=", "aGVs bG8=", "aGVsbG8=\n", "aGVsbG8==", "aGVs-G8=", "aGVs_G8=",
     "=aGVsbG8", "aGVsbG8=aGVs", "aGVsbG8=====", "éGVsbG8="],
)  # fmt: skip
def test_input_write_data_must_be_canonical_base64(b64: str) -> None:
    doc = _write(b"hello", b64=b64)
    error = _refused(doc)
    assert (error.code, error.path) == (ErrorCode.INVALID_REQUEST, "$.writes[0].data"), b64


def test_canonical_base64_accepts_every_length() -> None:
    for n in range(0, 40):
        raw = bytes(range(n))
        assert _canonical_b64decode(base64.b64encode(raw).decode()) == raw


def test_input_write_digest_is_the_chunks() -> None:
    doc = _write(b"hello", digest=ex.plan(1).job.inputs[0].digest)
    assert _refused(doc).path == "$.writes[0].digest"


def test_empty_chunk_has_the_empty_digest() -> None:
    request = decode_request(json.dumps(_write(b"")).encode())
    assert isinstance(request, InputWriteRequest)
    assert request.writes[0].chunk == b""
    assert request.writes[0].digest == EMPTY_DIGEST
    assert _refused(_write(b"", digest="sha256:" + "0" * 64)).path == "$.writes[0].digest"


def test_decoded_chunk_is_kept() -> None:
    request = decode_request(json.dumps(_write(b"\x00\xff" * 10)).encode())
    assert isinstance(request, InputWriteRequest)
    assert request.writes[0].chunk == b"\x00\xff" * 10
    assert request.chunk_bytes == 20


def test_input_write_aggregate_bound_is_the_callers() -> None:
    data = _write(b"x" * 100)
    body = json.dumps(data).encode()
    decode_request(body, input_chunk_bytes=100)
    error = _refused(data, input_chunk_bytes=99)
    assert (error.code, error.path) == (ErrorCode.INVALID_REQUEST, "$.writes")


def test_input_write_absolute_bound_is_8_mib() -> None:
    doc = _doc("input_write")
    half = b"\x01" * (4 * 1024 * 1024)
    for i in range(2):
        doc["writes"][i]["data"] = base64.b64encode(half).decode()
        doc["writes"][i]["digest"] = "sha256:" + hashlib.sha256(half).hexdigest()
    frame = json.dumps(doc).encode()
    assert len(frame) <= REQUEST_MAX
    decode_request(frame)  # exactly 8 MiB
    doc["writes"][1]["data"] = base64.b64encode(half + b"\x01").decode()
    doc["writes"][1]["digest"] = "sha256:" + hashlib.sha256(half + b"\x01").hexdigest()
    assert _refused(doc, input_chunk_bytes=16 * 1024 * 1024).path == "$.writes"


def test_largest_offset_survives_a_frame_round_trip() -> None:
    doc = _doc("input_write")
    doc["writes"] = [_write(b"")["writes"][0]]
    doc["writes"][0]["offset"] = U63
    frame = encode_frame(encode_request(decode_request(json.dumps(doc).encode())), REQUEST_MAX)
    assert b"9223372036854775807" in frame
    (payload,) = FrameDecoder(REQUEST_MAX).feed(frame)
    request = decode_request(payload)
    assert isinstance(request, InputWriteRequest)
    assert request.writes[0].offset == U63
    doc["writes"][0]["offset"] = U63 + 1
    assert _refused(doc).path == "$.writes[0].offset"


# --- snapshot and set_offer ---------------------------------------------------------


def test_snapshot_after_is_optional_identity_or_null() -> None:
    doc = _doc("snapshot")
    del doc["after"]
    request = decode_request(json.dumps(doc).encode())
    assert request.after is None  # type: ignore[union-attr]
    doc["after"] = "zz"
    assert _refused(doc).path == "$.after"


@pytest.mark.parametrize(
    ("path", "value"),
    [("expected_revision", -1), ("control", "open"), ("limits.resources.attempts", -1),
     ("limits.resources.cpu_millis", 1.5), ("limits.projects", ["a"]),
     ("limits.runtimes", ["Podman"]), ("limits.resources", None)],
)  # fmt: skip
def test_set_offer_fields(path: str, value: Any) -> None:
    doc = _doc("set_offer")
    target = doc
    *parents, last = path.split(".")
    for key in parents:
        target = target[key]
    target[last] = value
    where = "$." + path
    if path.startswith("limits.projects") or path.startswith("limits.runtimes"):
        where += "[0]"
    assert _refused(doc).path == where


def test_set_offer_limits_optional_and_allow_lists_distinct() -> None:
    doc = _doc("set_offer")
    doc["limits"] = None
    decode_request(json.dumps(doc).encode())
    doc = _doc("set_offer")
    doc["limits"]["runtimes"] = ["podman", "podman"]
    assert _refused(doc).path == "$.limits"


# --- envelope -----------------------------------------------------------------------


def test_unsupported_version_is_named_with_the_request_id() -> None:
    for version in (2, 0, "1", True):
        doc = _doc("snapshot")
        doc["version"] = version
        error = _refused(doc)
        assert (error.code, error.path, error.request_id) == (
            ErrorCode.UNSUPPORTED_VERSION,
            "$.version",
            ex.REQUEST_ID,
        ), version


def test_unknown_action() -> None:
    doc = _doc("snapshot")
    doc["action"] = "format_disk"
    error = _refused(doc)
    assert (error.code, error.path) == (ErrorCode.UNSUPPORTED_ACTION, "$.action")
    del doc["action"]
    assert _refused(doc).code == ErrorCode.INVALID_REQUEST


def test_bad_request_id_is_not_echoed() -> None:
    doc = _doc("snapshot")
    doc["id"] = "not-an-id"
    error = _refused(doc)
    assert (error.path, error.request_id) == ("$.id", None)


@pytest.mark.parametrize("frame", [b"", b"{", b"\xff\xfe", b"[1,2", b'{"a":1}x', b"nul"])
def test_bad_json_is_bad_frame(frame: bytes) -> None:
    with pytest.raises(ProtocolError) as info:
        decode_request(frame)
    assert info.value.code == ErrorCode.BAD_FRAME


@pytest.mark.parametrize("frame", [b"[]", b"1", b'"prepare"', b"null", b"{}"])
def test_wrong_json_shape_is_invalid_request(frame: bytes) -> None:
    with pytest.raises(ProtocolError) as info:
        decode_request(frame)
    assert (info.value.code, info.value.path) == (ErrorCode.INVALID_REQUEST, "$")


def test_message_names_the_type_not_the_regex() -> None:
    doc = _doc("start")
    doc["attempts"][0]["attempt_id"] = "x"
    assert "Identity (32 lowercase hex" in _refused(doc).message


def test_deep_plan_error_path_is_exact() -> None:
    doc = _doc("prepare")
    doc["attempts"][1]["plan"]["job"]["limits"]["memory_bytes"] = -5
    error = _refused(doc)
    assert error.path == "$.attempts[1].plan.job.limits.memory_bytes"


def test_sender_matrix() -> None:
    transport = {a for a in ACTIONS if may_send(Sender.TRANSPORT, a)}
    assert transport == ACTIONS - {"reconcile_absent", "set_offer", "metrics", "check_slots"}
    assert {a for a in ACTIONS if may_send(Sender.OWNER, a)} == {"snapshot", "set_offer"}
    assert {a for a in ACTIONS if may_send(Sender.ADMINISTRATOR, a)} == ACTIONS
    assert not may_send(Sender.ADMINISTRATOR, "format_disk")
    assert set(SENDERS) == ACTIONS
