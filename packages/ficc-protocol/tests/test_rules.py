"""Batch-checked rules: each screen is safe, and a batch names its first offender exactly.

Plan strings carry their lengths in msgspec.Meta and a `Chars` rule that `check_plans`
applies to a whole batch at once (a per-value regex costs more than the decode). The
properties below are what makes that sound: a screen never passes a value its exact
pattern refuses, and a refused batch reports the same code and JSON path as before.
"""

from __future__ import annotations

import json
import re
from typing import Any

import msgspec
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

import ficc_protocol_examples as ex
from conftest import SOAK
from ficc.execution import plan as planlib
from ficc.execution._executor import plan_digests
from ficc.execution._rules import (
    DIGEST,
    ENV_NAME,
    EXEC_STRING,
    IDENTITY,
    INPUT_NAME,
    NAME,
    OUTPUT_PATH,
    Chars,
    _cross_fields_hold,
    _screen,
    check_plans,
    check_rules,
    deferred_checks,
)
from ficc.execution.errors import ErrorCode, ProtocolError
from ficc.execution.plan import EMPTY_DIGEST, Plan, decode_plan, plan_digest
from ficc.execution.protocol import PrepareAttempt, PrepareRequest, decode_request, encode_request

# (rule, min length, max length) as declared on the plan's string types.
RULES: list[tuple[Chars, int, int]] = [
    (IDENTITY, 32, 32),
    (DIGEST, 71, 71),
    (NAME, 1, 80),
    (EXEC_STRING, 0, 300),
    (ENV_NAME, 1, 128),
    (INPUT_NAME, 1, 128),
    (OUTPUT_PATH, 1, 1024),
]
EXAMPLES = settings(max_examples=5_000 if SOAK else 300, deadline=None, database=None)

# Characters that sit on the edges of the rules, plus anything at all.
_EDGES = "0123456789abcdefgzAFZ_.-/:sha256\x00\n\x1f\x7f\x80\x85\x9f\xa0\xc2é\u2028\ud800"
_chars = st.one_of(st.sampled_from(_EDGES), st.characters())
_text = st.text(_chars, max_size=90)
_parts = ["a", ".", "..", "", "b.c", "..d", ".e", "\x85", "\x7f", "é"]
_paths = st.lists(st.sampled_from(_parts), min_size=1, max_size=4).map("/".join)
_near_valid = st.one_of(
    _text,
    st.text(st.sampled_from("azAZ09_.-/: \x00\x85é"), min_size=1, max_size=40),
    st.builds(lambda body: "sha256:" + body, st.text(st.sampled_from("0123456789abcdefg:"))),
    _paths,
    _paths,
    _paths,
    st.text(st.sampled_from("0123456789abcdefAF"), min_size=32, max_size=32),
    st.text(st.sampled_from("0123456789abcdefg"), min_size=31, max_size=33),
    st.builds(
        str.__add__,
        st.sampled_from(["sha256:", "sha256;", "SHA256:", "sha25:6", ":sha256", ""]),
        st.text(st.sampled_from("0123456789abcdefAg:sh"), min_size=64, max_size=71),
    ),
    st.builds(
        lambda body: body + "sha256:",
        st.text(st.sampled_from("0123456789abcdef"), min_size=64, max_size=64),
    ),
    st.text(st.sampled_from("aZ9_.-"), min_size=1, max_size=6),
)


def _in_bounds(values: list[str], low: int, high: int) -> list[str]:
    return [v for v in values if low <= len(v) <= high]


# Every way to break a path (the screen's substring list), and near-miss digests and IDs.
_TRAPS = ["/a", "a/", "a//b", "./a", "a/./b", "a/.", ".", "../a", "a/../b", "a/..", "..",
          "a\nb", "a\x85b", "a\x7fb", "0" * 64 + "sha256:", "sha256:" + "A" * 64, "A" * 32,
          "1a", "_"]  # fmt: skip


@pytest.mark.soak
@pytest.mark.parametrize(("rule", "low", "high"), RULES, ids=lambda r: getattr(r, "pattern", r))
@EXAMPLES
@example(values=_TRAPS)
@given(values=st.lists(_near_valid, max_size=6))
def test_a_screen_never_passes_a_value_its_pattern_refuses(
    rule: Chars, low: int, high: int, values: list[str]
) -> None:
    values = _in_bounds(values, low, high)
    for value in values:
        if rule.screen([value]):
            assert rule.matches(value), value
    if values and rule.screen(values):
        assert all(rule.matches(v) for v in values), values


@pytest.mark.parametrize(
    ("rule", "value"),
    [
        (IDENTITY, "0123456789abcdef" * 2),
        (DIGEST, EMPTY_DIGEST),
        (NAME, "gpu.small-2_x"),
        (EXEC_STRING, "--flag=ä b\n"),
        (ENV_NAME, "_OMP_NUM_THREADS9"),
        (INPUT_NAME, "Model-1.bin"),
        (OUTPUT_PATH, "out/..x/.y/run.log"),
    ],
)
def test_ordinary_values_take_the_fast_path(rule: Chars, value: str) -> None:
    """The point of a screen: common valid values pass it without the regex."""
    assert rule.matches(value)
    assert rule.screen([value, value])


def test_the_example_batch_passes_every_screen_at_once() -> None:
    plans = [ex.plan(i) for i in range(1, 9)]
    assert _screen(plans, Plan)
    assert _cross_fields_hold(plans)


def _prepare_doc(rows: int = 6) -> dict[str, Any]:
    plans = [ex.plan(i) for i in range(1, rows + 1)]
    request = PrepareRequest(
        version=1,
        id=ex.REQUEST_ID,
        **ex.bindings(),
        attempts=[PrepareAttempt(p, ex.renewal(p)) for p in plans],
    )
    return json.loads(encode_request(request))


def _set(doc: dict[str, Any], path: str, value: Any) -> None:
    keys: list[Any] = [int(k) if k.isdigit() else k for k in path.split(".")]
    target: Any = doc
    for key in keys[:-1]:
        target = target[key]
    target[keys[-1]] = value


def _refused(doc: Any) -> ProtocolError:
    with pytest.raises(ProtocolError) as info:
        decode_request(json.dumps(doc).encode())
    return info.value


# (path below `attempts.4.plan`, bad value, JSON path below `$.attempts[4].plan`, words)
IN_A_BATCH = [
    ("job_id", "G" * 32, ".job_id", "an Identity"),
    ("job.runtime.image_digest", "sha256:" + "A" * 64, ".job.runtime.image_digest", "a Digest"),
    ("job.slot_class", "Gpu", ".job.slot_class", "a Name"),
    ("job.limits.devices", ["ok", "no/"], ".job.limits.devices[1]", "a Name"),
    ("job.inputs.1.name", "-x", ".job.inputs[1].name", "an input name"),
    ("job.outputs.0.path", "a/./b", ".job.outputs[0].path", "a relative output path"),
    ("job.outputs.0.path", "a\x9fb", ".job.outputs[0].path", "a relative output path"),
    ("job.payload.argv", ["/bin/x", "a\x00"], ".job.payload.argv[1]", "without NUL"),
    ("job.payload.environment", {"A": "\x00"}, ".job.payload.environment[...]", "without NUL"),
    ("job.payload.environment", {"9A": "v"}, ".job.payload.environment", "object key"),
    ("job.payload.argv", ["bin/x"], ".job.payload", "absolute"),
    ("job.limits.devices", ["a", "a"], ".job.limits", "more than once"),
    ("job.inputs.0.bytes", 0, ".job.inputs[0]", "0 bytes"),
    ("job.inputs.1.digest", EMPTY_DIGEST, ".job.inputs[1]", "0 bytes"),
    ("job.outputs", [{"name": "a", "path": "x"}, {"name": "b", "path": "x"}], ".job", "more than"),
]


@pytest.mark.parametrize(("field", "value", "where", "words"), IN_A_BATCH)
def test_a_bad_value_in_one_row_is_named_exactly(
    field: str, value: Any, where: str, words: str
) -> None:
    doc = _prepare_doc()
    _set(doc, f"attempts.4.plan.{field}", value)
    error = _refused(doc)
    assert (error.code, error.path) == (ErrorCode.INVALID_REQUEST, f"$.attempts[4].plan{where}")
    assert words in error.message
    assert error.request_id == ex.REQUEST_ID


def test_a_bad_lease_pattern_is_named_exactly() -> None:
    doc = _prepare_doc()
    doc["attempts"][2]["lease"]["plan_digest"] = "sha256:" + "Z" * 64
    error = _refused(doc)
    assert error.path == "$.attempts[2].lease.plan_digest"
    assert "a Digest" in error.message


def test_the_first_bad_row_is_named() -> None:
    doc = _prepare_doc()
    _set(doc, "attempts.5.plan.job.name", "Bad")
    _set(doc, "attempts.3.plan.job.outputs.0.name", "Bad")
    assert _refused(doc).path == "$.attempts[3].plan.job.outputs[0].name"


def test_cautious_screens_still_accept_valid_values() -> None:
    """Values a screen cannot vouch for (non-ASCII paths, shared input IDs, empty
    objects, a literal backslash-u0000 in argv) are accepted after the exact check."""
    doc = _prepare_doc(3)
    plans = [row["plan"] for row in doc["attempts"]]
    plans[0]["job"]["outputs"][0]["path"] = "résultats/£.tar"
    plans[1]["job"]["payload"]["argv"].append("\\u0000")
    plans[2]["job"]["inputs"][0].update(bytes=0, digest=EMPTY_DIGEST)
    plans[2]["job"]["inputs"][0]["id"] = plans[1]["job"]["inputs"][0]["id"]
    for row in doc["attempts"]:
        plan = msgspec.json.decode(json.dumps(row["plan"]).encode(), type=Plan)
        row["lease"]["plan_digest"] = plan_digest(plan)
    request = decode_request(json.dumps(doc).encode())
    assert isinstance(request, PrepareRequest)
    assert request.attempts[0].plan.job.outputs[0].path == "résultats/£.tar"


def test_decode_plan_reports_batch_rules_like_msgspec() -> None:
    doc = ex.to_dict(ex.plan(1))
    doc["job"]["inputs"][0]["name"] = "a b"
    with pytest.raises(msgspec.ValidationError, match=r"- at `\$\.job\.inputs\[0\]\.name`"):
        decode_plan(json.dumps(doc).encode())


def test_check_plans_accepts_what_it_should_and_names_the_index() -> None:
    good = [ex.plan(i) for i in range(1, 4)]
    check_plans(good)
    doc = ex.to_dict(ex.plan(9))
    doc["node_id"] = "n" * 32
    with deferred_checks():  # as inside a request: the batch check comes after
        bad = msgspec.json.decode(json.dumps(doc).encode(), type=Plan)
    with pytest.raises(ValueError, match=re.escape("- at `$.node_id`")) as info:
        check_plans([*good, bad])
    assert info.value.index == 3  # type: ignore[attr-defined]


def test_json_schema_still_shows_the_patterns() -> None:
    schema = json.dumps(msgspec.json.schema(Plan))
    for rule in (IDENTITY, DIGEST, NAME, ENV_NAME, INPUT_NAME, OUTPUT_PATH):
        assert json.dumps(rule.pattern) in schema, rule.pattern


def test_batch_digests_equal_single_digests() -> None:
    plans = [ex.plan(i, streamed=i % 2 == 0) for i in range(1, 6)]
    assert plan_digests(plans) == [plan_digest(p) for p in plans]
    assert plan_digests([]) == []


def test_an_oversized_plan_is_named_by_its_row() -> None:
    doc = _prepare_doc(4)
    doc["attempts"][2]["plan"]["job"]["payload"]["argv"] = ["/bin/x"] + ["y" * 1000] * 140
    error = _refused(doc)
    assert (error.code, error.path) == (ErrorCode.INVALID_REQUEST, "$.attempts[2].plan")
    assert "more than 131072" in error.message


def test_a_rule_in_an_unsupported_shape_fails_loudly() -> None:
    """A rule the batch checker could not reach must not be silently unchecked."""

    class Optional_(msgspec.Struct):
        name: planlib._Name | None  # type: ignore[name-defined]

    with pytest.raises(TypeError, match="unsupported"):
        check_rules([Optional_(None)], Optional_)
