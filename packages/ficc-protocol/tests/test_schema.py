"""The published JSON Schema and golden vectors: generated from the models, stored in
docs/, checked by a real JSON Schema validator, and decoded by this package."""

from __future__ import annotations

import hashlib
import json
import pathlib
import subprocess
import sys
from typing import Any

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings

import ficc_protocol_examples as ex
from conftest import SOAK
from ficc.execution import _schema
from ficc.execution.plan import decode_plan, encode_plan, plan_digest
from ficc.execution.protocol import ACTIONS, decode_request, encode_request
from ficc.execution.wire import decode_reply, encode_reply
from test_properties import plans
from test_safe_types import BREAKS

HERE = pathlib.Path(__file__).parent
DOCS = HERE.parents[2] / "docs"
FILES = _schema.files()
SCHEMA = json.loads(FILES[_schema.SCHEMA_FILE])


def _validator(name: str) -> jsonschema.protocols.Validator:
    """A draft 2020-12 validator for one named definition of the schema."""
    root = {"$schema": SCHEMA["$schema"], "$ref": f"#/$defs/{name}", "$defs": SCHEMA["$defs"]}
    return jsonschema.Draft202012Validator(root)


PLAN, REQUEST, REPLY = _validator("Plan"), _validator("Request"), _validator("Reply")


def _vectors(prefix: str) -> dict[str, bytes]:
    return {
        path.split("/", 1)[1][len(prefix) : -len(".json")]: data
        for path, data in FILES.items()
        if path.startswith(f"{_schema.VECTORS}/{prefix}") and path.endswith(".json")
    }


def test_the_schema_is_a_valid_draft_2020_12_schema() -> None:
    assert SCHEMA["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    jsonschema.Draft202012Validator.check_schema(SCHEMA)


def _keywords(node: Any) -> set[str]:
    """Every keyword of a schema (the names under `properties` and `$defs` are not)."""
    found: set[str] = set()
    if isinstance(node, dict):
        for key, value in node.items():
            if key in ("properties", "$defs"):
                for inner in value.values():
                    found |= _keywords(inner)
            else:
                found.add(key)
                found |= _keywords(value)
    elif isinstance(node, list):
        for item in node:
            found |= _keywords(item)
    return found


def test_the_schema_uses_only_json_schema_keywords() -> None:
    """Strict validators (ajv) refuse a keyword they do not know, such as OpenAPI's
    `discriminator`; annotations that every validator knows are fine."""
    vocabulary = set(jsonschema.Draft202012Validator.VALIDATORS) | {
        "$schema", "$defs", "title", "description", "default", "examples",
        "contentEncoding", "contentMediaType",
    }  # fmt: skip
    assert _keywords(SCHEMA) <= vocabulary


def test_every_reply_and_row_requires_ok() -> None:
    """`ok` is in every reply and row (the decoder refuses one without it)."""
    with_ok = {
        name: definition
        for name, definition in SCHEMA["$defs"].items()
        if "ok" in definition.get("properties", {})
    }
    assert {"ErrorReply", "AttemptRow", "ErrorRow", "AttemptsReply"} <= set(with_ok)
    for name, definition in with_ok.items():
        assert "ok" in definition["required"], name
    document = json.loads(FILES[f"{_schema.VECTORS}/reply-observe.json"])
    del document["ok"]
    with pytest.raises(jsonschema.ValidationError):
        REPLY.validate(document)


def test_the_files_in_docs_are_what_the_models_generate() -> None:
    if not DOCS.exists():
        pytest.skip(f"{DOCS} is not part of this tree (an sdist has no docs/)")
    command = [sys.executable, "-m", "ficc.execution", "schema", "--check", str(DOCS)]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr


def test_check_names_a_changed_vector(tmp_path: pathlib.Path) -> None:
    base = [sys.executable, "-m", "ficc.execution", "schema"]
    subprocess.run([*base, "--write", str(tmp_path)], check=True)
    target = tmp_path / _schema.VECTORS / "request-start.json"
    target.write_text(target.read_text().replace('"start"', '"stop"'))
    check = [*base, "--check", str(tmp_path)]
    done = subprocess.run(check, capture_output=True, text=True, check=False)
    assert done.returncode == 1
    assert "request-start.json: differs" in done.stderr
    assert "--write" in done.stderr


def test_printing_the_schema_gives_the_schema_file() -> None:
    command = [sys.executable, "-m", "ficc.execution", "schema"]
    done = subprocess.run(command, capture_output=True, check=True)
    assert done.stdout == FILES[_schema.SCHEMA_FILE]


def test_every_action_has_a_request_and_a_reply_vector() -> None:
    actions = set(ACTIONS)  # a new action needs its examples in ficc.execution._schema
    assert set(_schema.example_requests()) == actions
    assert set(_vectors("request-")) == actions
    assert set(_vectors("reply-")) == actions | {"error"}


@pytest.mark.parametrize("action", sorted(_vectors("request-")))
def test_request_vectors_validate_and_round_trip(action: str) -> None:
    data = _vectors("request-")[action]
    document = json.loads(data)
    REQUEST.validate(document)
    request = decode_request(data)
    assert request.action == action
    assert json.loads(encode_request(request)) == document


@pytest.mark.parametrize("action", sorted(_vectors("reply-")))
def test_reply_vectors_validate_and_round_trip(action: str) -> None:
    data = _vectors("reply-")[action]
    document = json.loads(data)
    REPLY.validate(document)
    reply = decode_reply(data, "observe" if action == "error" else action)
    assert json.loads(encode_reply(reply)) == document


@pytest.mark.parametrize("action", ["observe", "snapshot"])
def test_usage_vectors_validate_and_round_trip(action: str) -> None:
    request = FILES[f"{_schema.VECTORS}/usage-request-{action}.json"]
    REQUEST.validate(json.loads(request))
    assert json.loads(encode_request(decode_request(request))) == json.loads(request)
    reply = FILES[f"{_schema.VECTORS}/usage-reply-{action}.json"]
    REPLY.validate(json.loads(reply))
    assert json.loads(encode_reply(decode_reply(reply, action))) == json.loads(reply)


@pytest.mark.parametrize("field", ["slots", "daemon"])
def test_opt_in_snapshot_vectors_validate_and_round_trip(field: str) -> None:
    request = FILES[f"{_schema.VECTORS}/{field}-request-snapshot.json"]
    REQUEST.validate(json.loads(request))
    assert json.loads(encode_request(decode_request(request))) == json.loads(request)
    reply = FILES[f"{_schema.VECTORS}/{field}-reply-snapshot.json"]
    REPLY.validate(json.loads(reply))
    assert json.loads(encode_reply(decode_reply(reply, "snapshot"))) == json.loads(reply)


@pytest.mark.parametrize("name", ["local-only", "streamed"])
def test_plan_vectors_are_the_golden_vectors(name: str) -> None:
    """The plan file is exactly the canonical bytes: its SHA-256 is the digest."""
    canonical = FILES[f"{_schema.VECTORS}/plan-{name}.json"]
    digest = FILES[f"{_schema.VECTORS}/plan-{name}.digest"].decode().strip()
    assert digest == "sha256:" + hashlib.sha256(canonical).hexdigest()
    assert canonical == (HERE / "vectors" / f"{name}.canonical.json").read_bytes()
    assert digest == (HERE / "vectors" / f"{name}.digest").read_text().strip()
    PLAN.validate(json.loads(canonical))
    assert plan_digest(decode_plan(canonical)) == digest


@pytest.mark.soak
@settings(
    max_examples=1000 if SOAK else 100,
    deadline=None,
    suppress_health_check=list(HealthCheck),
    database=None,
)
@given(plans())
def test_the_schema_accepts_every_plan_the_host_accepts(plan: Any) -> None:
    PLAN.validate(json.loads(encode_plan(plan)))


# Rules JSON Schema cannot state, which decode_plan checks: rules across several fields,
# and `2.0` for an integer (JSON Schema counts a number with no fraction as an integer).
_ACROSS_FIELDS = {
    "float count",
    "empty object with a digest",
    "nonempty object with the empty digest",
    "repeated input name",
    "repeated output path",
    "plan over 128 KiB",
}


@pytest.mark.parametrize("broken", sorted(set(BREAKS) - _ACROSS_FIELDS))
def test_the_schema_refuses_what_one_field_breaks(broken: str) -> None:
    document = BREAKS[broken](ex.to_dict(ex.plan(3)))
    assert not PLAN.is_valid(document)
