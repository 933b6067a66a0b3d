"""`acknowledged_unknown` on a prepare row: golden request vectors and its rules.

The field is omitted when empty, so a prepare without acknowledgements has exactly the
bytes it had before the field existed, and the plan (and its digest) never changes.
"""

from __future__ import annotations

import json
import pathlib
from typing import Any

import pytest

from ficc.execution.errors import ProtocolError
from ficc.execution.plan import plan_digest
from ficc.execution.protocol import (
    ACKNOWLEDGED_MAX,
    PrepareRequest,
    decode_request,
    encode_request,
)

VECTORS = pathlib.Path(__file__).parent / "vectors"
PLAN_DIGEST = (VECTORS / "local-only.digest").read_text().strip()


def _vector(name: str) -> tuple[bytes, bytes]:
    return (
        (VECTORS / f"{name}.request.json").read_bytes(),
        (VECTORS / f"{name}.canonical.json").read_bytes(),
    )


@pytest.mark.parametrize("name", ["prepare-plain", "prepare-acknowledged"])
def test_golden_prepare_request(name: str) -> None:
    source, canonical = _vector(name)
    request = decode_request(source)
    assert isinstance(request, PrepareRequest)
    assert encode_request(request) == canonical
    assert encode_request(decode_request(canonical)) == canonical
    # The acknowledgement is beside the plan, never in it.
    assert plan_digest(request.attempts[0].plan) == PLAN_DIGEST


def test_empty_acknowledgement_is_omitted() -> None:
    source, canonical = _vector("prepare-plain")
    request = decode_request(source)
    assert isinstance(request, PrepareRequest)
    assert request.attempts[0].acknowledged_unknown == []
    assert b"acknowledged_unknown" not in canonical
    # An explicit empty list is the same request with the same bytes.
    explicit = json.loads(source)
    explicit["attempts"][0]["acknowledged_unknown"] = []
    assert encode_request(decode_request(json.dumps(explicit).encode())) == canonical


def test_acknowledged_ids_are_kept_in_order() -> None:
    source, canonical = _vector("prepare-acknowledged")
    request = decode_request(source)
    assert isinstance(request, PrepareRequest)
    assert (
        request.attempts[0].acknowledged_unknown
        == json.loads(source)["attempts"][0]["acknowledged_unknown"]
    )
    assert b'"acknowledged_unknown":["2a2a' in canonical


def _mutated(change: Any) -> bytes:
    document = json.loads(_vector("prepare-acknowledged")[0])
    change(document["attempts"][0])
    return json.dumps(document).encode()


@pytest.mark.parametrize(
    ("change", "path"),
    [
        (
            lambda row: row["acknowledged_unknown"].append(row["acknowledged_unknown"][0]),
            "$.attempts[0].acknowledged_unknown",
        ),
        (
            lambda row: row["acknowledged_unknown"].append(row["plan"]["attempt_id"]),
            "$.attempts[0].acknowledged_unknown",
        ),
        (
            lambda row: row["acknowledged_unknown"].append("NOT-AN-ID"),
            "$.attempts[0].acknowledged_unknown[2]",
        ),
        (
            lambda row: row.__setitem__(
                "acknowledged_unknown", [f"{n:032x}" for n in range(ACKNOWLEDGED_MAX + 1)]
            ),
            "$.attempts[0].acknowledged_unknown",
        ),
    ],
    ids=["duplicate", "itself", "not-an-identity", "too-many"],
)
def test_invalid_acknowledgements_are_refused(change: Any, path: str) -> None:
    with pytest.raises(ProtocolError) as refused:
        decode_request(_mutated(change))
    assert refused.value.code == "invalid_request"
    assert refused.value.path == path
