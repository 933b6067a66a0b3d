"""`detail` on observe rows: asked for with `detail: true`, absent otherwise."""

from __future__ import annotations

import msgspec
import pytest

from ficc.execution.protocol import ObserveRequest, decode_request, encode_request
from ficc.execution.wire import DETAIL_MAX, AttemptRow
from ficc_protocol_examples import attempt_status, fence, plan

ID = "1" * 32


def test_an_observe_without_detail_keeps_its_bytes() -> None:
    plain = ObserveRequest(version=1, id=ID, attempts=[fence(plan())])
    assert b'"detail"' not in encode_request(plain)
    assert not plain.wants_detail
    asked = msgspec.structs.replace(plain, detail=True)
    decoded = decode_request(encode_request(asked))
    assert isinstance(decoded, ObserveRequest)
    assert decoded.wants_detail


def test_a_row_carries_a_bounded_detail() -> None:
    row = attempt_status(plan(), "failed", reason="barrier_exited")
    assert "detail" not in msgspec.json.decode(msgspec.json.encode(
        msgspec.convert(row, AttemptRow)))  # fmt: skip
    data = msgspec.json.encode({**row, "detail": "runc create failed"})
    assert msgspec.json.decode(data, type=AttemptRow).detail == "runc create failed"
    too_long = msgspec.json.encode({**row, "detail": "x" * (DETAIL_MAX + 1)})
    with pytest.raises(msgspec.ValidationError, match="detail"):
        msgspec.json.decode(too_long, type=AttemptRow)
