"""Every public way of decoding a plan agrees with `decode_plan`, and nothing the host
would refuse gets canonical bytes or a digest.

The property test draws valid plans, breaks each in one of many ways (or not at all),
and asks every path: `decode_plan`, `msgspec.json.decode(..., type=Plan)`,
`msgspec.convert(obj, Plan)`, a `prepare` request carrying the plan, `encode_plan` and
`plan_digest`. They must all accept, or all refuse.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ficc_protocol_examples as ex
from conftest import SOAK
from ficc.execution._rules import deferred_checks
from ficc.execution.errors import ProtocolError
from ficc.execution.plan import (
    EMPTY_DIGEST,
    Plan,
    PlanTooLarge,
    decode_plan,
    digest_of,
    encode_plan,
    plan_digest,
)
from ficc.execution.protocol import Fence, Renewal, decode_request
from test_properties import plans

CASES = 5_000 if SOAK else 400
U63 = 2**63 - 1

Doc = dict[str, Any]


def _set(doc: Doc, path: str, value: Any) -> Doc:
    """A copy of `doc` with the value at dotted `path` replaced (list indexes as digits)."""
    doc = copy.deepcopy(doc)
    *parents, last = path.split(".")
    node: Any = doc
    for key in parents:
        node = node[int(key)] if isinstance(node, list) else node[key]
    if isinstance(node, list):
        node[int(last)] = value
    else:
        node[last] = value
    return doc


def _argv(doc: Doc) -> list[str]:
    return list(doc["job"]["payload"]["argv"])


# Each breaks one rule the host enforces; `None` where it does not apply to this plan.
BREAKS: dict[str, Callable[[Doc], Doc | None]] = {
    "upper-case attempt ID": lambda d: _set(d, "attempt_id", "Z" * 32),
    "short job ID": lambda d: _set(d, "job_id", "a" * 31),
    "upper-case job name": lambda d: _set(d, "job.name", "Render"),
    "name too long": lambda d: _set(d, "job.slot_class", "a" * 81),
    "digest in upper case": lambda d: _set(d, "job.runtime.image_digest", "sha256:" + "A" * 64),
    "relative argv[0]": lambda d: _set(d, "job.payload.argv", ["bin/sh", *_argv(d)[1:]]),
    "NUL in argv": lambda d: _set(d, "job.payload.argv", [*_argv(d), "a\x00b"]),
    "bad environment name": lambda d: _set(d, "job.payload.environment", {"9X": "v"}),
    "repeated device": lambda d: _set(d, "job.limits.devices", ["gpu0", "gpu0"]),
    "generation 0": lambda d: _set(d, "generation", 0),
    "boolean count": lambda d: _set(d, "job.limits.swap_bytes", True),
    "count past 2^63-1": lambda d: _set(d, "job.limits.swap_bytes", U63 + 1),
    "float count": lambda d: _set(d, "job.limits.processes", 2.0),
    "unknown field": lambda d: {**d, "extra": 1},
    "version 2": lambda d: _set(d, "version", 2),
    "bad delivery": lambda d: (
        _set(d, "job.inputs.0.delivery", "push") if d["job"]["inputs"] else None
    ),
    "empty object with a digest": lambda d: (
        _set(_set(d, "job.inputs.0.bytes", 0), "job.inputs.0.digest", "sha256:" + "1" * 64)
        if d["job"]["inputs"]
        else None
    ),
    "nonempty object with the empty digest": lambda d: (
        _set(_set(d, "job.inputs.0.bytes", 5), "job.inputs.0.digest", EMPTY_DIGEST)
        if d["job"]["inputs"]
        else None
    ),
    "repeated input name": lambda d: (
        _set(d, "job.inputs", [*d["job"]["inputs"], {**d["job"]["inputs"][0], "id": "f" * 32}])
        if d["job"]["inputs"] and d["job"]["inputs"][0]["id"] != "f" * 32
        else None
    ),
    "output path with ..": lambda d: _set(d, "job.outputs", [{"name": "o", "path": "a/../b"}]),
    "output path with a control character": lambda d: _set(
        d, "job.outputs", [{"name": "o", "path": "a\x85b"}]
    ),
    "repeated output path": lambda d: _set(
        d, "job.outputs", [{"name": "o", "path": "x"}, {"name": "p", "path": "x"}]
    ),
    "plan over 128 KiB": lambda d: _set(
        d, "job.payload.argv", [*_argv(d)[:1], *["x" * 1000] * 140][:256]
    ),
}


def _accepts(call: Callable[[], Any]) -> Any:
    """The call's result, or None when it refused (with a refusal of the documented kinds)."""
    try:
        return call()
    except (msgspec.ValidationError, PlanTooLarge, ProtocolError):
        return None


def _prepare(doc: Doc) -> bytes:
    """A one-row prepare carrying `doc`, its lease bound to the plan as sent."""
    try:  # the canonical bytes are the plan document with sorted keys
        digest = digest_of(msgspec.json.encode(doc, order="sorted"))
    except (TypeError, OverflowError):
        digest = "sha256:" + "0" * 64
    attempt_id = doc.get("attempt_id")
    generation = doc.get("generation")
    lease = {
        "attempt_id": attempt_id if isinstance(attempt_id, str) else "0" * 32,
        "generation": generation if type(generation) is int and generation > 0 else 1,
        "plan_digest": digest,
        "sequence": 1,
        "expires_at_ms": 1,
    }
    request = {
        "version": 1,
        "id": ex.REQUEST_ID,
        "action": "prepare",
        "installation_id": ex.INSTALLATION,
        "ledger_id": ex.LEDGER,
        "admission_version": 1,
        "attempts": [{"plan": doc, "lease": lease}],
    }
    return json.dumps(request, ensure_ascii=False).encode()


def _all_paths_agree(doc: Doc) -> bool:
    """Ask every public path about `doc`; assert they agree; return whether they accept."""
    data = json.dumps(doc, ensure_ascii=False).encode()
    by_decode_plan = _accepts(lambda: decode_plan(data))
    by_msgspec = _accepts(lambda: msgspec.json.decode(data, type=Plan))
    by_convert = _accepts(lambda: msgspec.convert(json.loads(data), Plan))
    by_request = _accepts(lambda: decode_request(_prepare(doc)))
    verdicts = [x is not None for x in (by_decode_plan, by_msgspec, by_convert, by_request)]
    assert verdicts in ([True] * 4, [False] * 4), verdicts
    if by_decode_plan is not None:
        canonical = encode_plan(by_decode_plan)
        assert encode_plan(by_msgspec) == encode_plan(by_convert) == canonical
        assert plan_digest(by_convert) == digest_of(canonical)
        return True
    # A plan the host refuses gets no bytes and no digest, even when msgspec's own
    # checks pass and only the rules across fields or characters are broken.
    with deferred_checks():
        unchecked = _accepts(lambda: msgspec.json.decode(data, type=Plan))
    if unchecked is not None:
        assert _accepts(lambda: encode_plan(unchecked)) is None
        assert _accepts(lambda: plan_digest(unchecked)) is None
    return False


@pytest.mark.soak
@settings(max_examples=CASES, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(plans(), st.sampled_from([None, *BREAKS]))
def test_every_public_path_agrees_with_decode_plan(plan: Plan, broken: str | None) -> None:
    doc = ex.to_dict(plan)
    if broken is not None:
        mutated = BREAKS[broken](doc)
        if mutated is None:
            return
        doc = mutated
    accepted = _all_paths_agree(doc)
    if broken is None:
        assert accepted
    elif broken != "plan over 128 KiB" or len(json.dumps(doc)) > 128 * 1024:
        assert not accepted, broken


@pytest.mark.parametrize("broken", sorted(BREAKS))
def test_each_break_is_refused_everywhere(broken: str) -> None:
    doc = BREAKS[broken](ex.to_dict(ex.plan(3)))
    assert doc is not None
    assert not _all_paths_agree(doc)


def test_a_plan_built_in_python_with_bad_types_gets_no_digest() -> None:
    """msgspec checks no types in a constructor: `encode_plan` decodes its bytes again."""
    good = ex.plan(1)
    with deferred_checks():
        bad = msgspec.structs.replace(good, generation=0)
    with pytest.raises(msgspec.ValidationError, match="generation"):
        plan_digest(bad)


@pytest.mark.parametrize("how", ["constructor", "replace"])
def test_a_plan_built_in_python_that_breaks_a_rule_gets_no_digest(how: str) -> None:
    """An upper-case attempt ID: refused when built, and by the encoder and the digest
    even when it was built where checks are deferred (as a request's decoder does)."""
    good = ex.plan(1)
    fields = {name: getattr(good, name) for name in good.__struct_fields__}

    def build() -> Plan:
        if how == "constructor":
            return Plan(**{**fields, "attempt_id": "Z" * 32})
        return msgspec.structs.replace(good, attempt_id="Z" * 32)

    with pytest.raises(ValueError, match=r"attempt_id"):
        build()
    with deferred_checks():
        bad = build()
    for refuse in (encode_plan, plan_digest):
        with pytest.raises(msgspec.ValidationError, match=r"attempt_id"):
            refuse(bad)
        with deferred_checks(), pytest.raises(msgspec.ValidationError, match=r"attempt_id"):
            refuse(bad)


def test_building_a_plan_that_breaks_a_rule_fails_at_once() -> None:
    good = ex.plan(1)
    with pytest.raises(ValueError, match=r"an absolute path"):
        msgspec.structs.replace(
            good,
            job=msgspec.structs.replace(
                good.job, payload=msgspec.structs.replace(good.job.payload, argv=["sh"])
            ),
        )


def test_a_renewal_checks_its_patterns_like_a_fence() -> None:
    row = {"attempt_id": "Z" * 32, "generation": 1, "plan_digest": EMPTY_DIGEST}
    with pytest.raises(msgspec.ValidationError):
        msgspec.convert(row, Fence)
    with pytest.raises(msgspec.ValidationError, match=r"attempt_id"):
        msgspec.convert({**row, "sequence": 1, "expires_at_ms": 0}, Renewal)
    with pytest.raises(msgspec.ValidationError, match=r"plan_digest"):
        msgspec.json.decode(
            json.dumps({**row, "attempt_id": "a" * 32, "plan_digest": "sha256:X", "sequence": 1,
                        "expires_at_ms": 0}).encode(),
            type=Renewal,
        )  # fmt: skip


def test_refusals_name_the_type_in_words() -> None:
    doc = _set(ex.to_dict(ex.plan(1)), "attempt_id", "Z" * 32)
    with pytest.raises(msgspec.ValidationError) as info:
        decode_plan(json.dumps(doc).encode())
    assert "regex" in str(info.value)  # msgspec's own words, for msgspec callers
    with pytest.raises(ProtocolError) as refused:
        decode_request(_prepare(doc))
    assert refused.value.message == "Expected an Identity (32 lowercase hex characters)"
    assert refused.value.path == "$.attempts[0].plan.attempt_id"
