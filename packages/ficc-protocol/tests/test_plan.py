"""The immutable plan: golden vectors, every constraint, exact integers."""

from __future__ import annotations

import copy
import hashlib
import json
import pathlib
from typing import Any

import msgspec
import pytest

import ficc_protocol_examples as ex
from ficc.execution.plan import (
    EMPTY_DIGEST,
    PLAN_MAX_BYTES,
    Plan,
    PlanTooLarge,
    decode_plan,
    encode_plan,
    plan_digest,
)
from ficc.execution.protocol import explain

VECTORS = pathlib.Path(__file__).parent / "vectors"
NAMES = sorted(p.name.removesuffix(".plan.json") for p in VECTORS.glob("*.plan.json"))


def test_vectors_present() -> None:
    assert {"local-only", "local-explicit", "streamed", "unicode"} <= set(NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_golden_vector(name: str) -> None:
    source = (VECTORS / f"{name}.plan.json").read_bytes()
    canonical = (VECTORS / f"{name}.canonical.json").read_bytes()
    digest = (VECTORS / f"{name}.digest").read_text().strip()
    plan = decode_plan(source)
    assert encode_plan(plan) == canonical
    assert plan_digest(plan) == digest
    assert digest == "sha256:" + hashlib.sha256(canonical).hexdigest()
    # The canonical bytes decode to the same plan and re-encode to themselves.
    assert encode_plan(decode_plan(canonical)) == canonical


@pytest.mark.parametrize("name", NAMES)
def test_canonical_form_is_reproducible_without_msgspec(name: str) -> None:
    """Any JSON library reproduces the bytes: sorted keys, compact, UTF-8, no local."""
    source = json.loads((VECTORS / f"{name}.plan.json").read_bytes())
    for item in source["job"]["inputs"]:
        if item.get("delivery") == "local":
            del item["delivery"]
    stdlib = json.dumps(source, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    assert stdlib.encode() == (VECTORS / f"{name}.canonical.json").read_bytes()


def test_local_delivery_is_omitted_and_stream_is_kept() -> None:
    local = (VECTORS / "local-only.canonical.json").read_bytes()
    explicit = (VECTORS / "local-explicit.canonical.json").read_bytes()
    assert local == explicit
    assert b"delivery" not in local
    assert b'"delivery":"stream"' in (VECTORS / "streamed.canonical.json").read_bytes()


def test_plan_made_in_code_matches_decoded() -> None:
    plan = ex.plan(1)
    assert decode_plan(encode_plan(plan)) == plan
    assert plan.streamed_inputs == [i for i in plan.job.inputs if i.delivery == "stream"]


def test_digest_follows_the_plan_not_a_cache() -> None:
    plan = ex.plan(1)
    first = plan_digest(plan)
    plan.job.payload.argv.append("--more")  # lists inside a frozen struct can change
    assert plan_digest(plan) != first
    assert plan_digest(decode_plan(msgspec.json.encode(plan))) == plan_digest(plan)


def _valid() -> dict[str, Any]:
    return ex.to_dict(ex.plan(1))


def _set(doc: dict[str, Any], path: str, value: Any) -> None:
    keys: list[Any] = [int(k) if k.isdigit() else k for k in path.split(".")]
    target: Any = doc
    for key in keys[:-1]:
        target = target[key]
    if value is _DELETE:
        del target[keys[-1]]
    else:
        target[keys[-1]] = value


_DELETE = object()
D = "sha256:" + "ab" * 32

# (path, bad value, JSON path msgspec must name)
VIOLATIONS: list[tuple[str, Any, str]] = [
    ("version", 2, "$.version"),
    ("version", True, "$.version"),
    ("version", _DELETE, "$"),
    ("deployment_id", "A" * 32, "$.deployment_id"),
    ("node_id", "a" * 31, "$.node_id"),
    ("project_id", "a" * 33, "$.project_id"),
    ("job_id", "g" * 32, "$.job_id"),
    ("attempt_id", "a" * 32 + "\n", "$.attempt_id"),
    ("generation", 0, "$.generation"),
    ("generation", 2**63, "$.generation"),
    ("generation", 1.0, "$.generation"),
    ("generation", True, "$.generation"),
    ("generation", "1", "$.generation"),
    ("offer_revision", 0, "$.offer_revision"),
    ("job.name", "Render", "$.job.name"),
    ("job.name", "a" * 81, "$.job.name"),
    ("job.slot_class", "", "$.job.slot_class"),
    ("job.runtime.provider", "1podman", "$.job.runtime.provider"),
    ("job.runtime.package_digest", "sha256:" + "AB" * 32, "$.job.runtime.package_digest"),
    ("job.runtime.image_digest", "sha512:" + "ab" * 32, "$.job.runtime.image_digest"),
    ("job.runtime.isolation", "a b", "$.job.runtime.isolation"),
    ("job.runtime.network", None, "$.job.runtime.network"),
    ("job.payload.argv", [], "$.job.payload.argv"),
    ("job.payload.argv", ["/bin/x"] * 257, "$.job.payload.argv"),
    ("job.payload.argv", ["bin/echo"], "$.job.payload"),
    ("job.payload.argv", ["/bin/echo", "a\x00b"], "$.job.payload.argv[1]"),
    ("job.payload.environment", {"1X": "v"}, "$.job.payload.environment"),
    ("job.payload.environment", {"X-Y": "v"}, "$.job.payload.environment"),
    ("job.payload.environment", {"X": "a\x00"}, "$.job.payload.environment[...]"),
    ("job.payload.environment", {f"V{i}": "" for i in range(65)}, "$.job.payload.environment"),
    ("job.limits.cpu_millis", 0, "$.job.limits.cpu_millis"),
    ("job.limits.memory_bytes", -1, "$.job.limits.memory_bytes"),
    ("job.limits.memory_bytes", 2**63, "$.job.limits.memory_bytes"),
    ("job.limits.swap_bytes", -1, "$.job.limits.swap_bytes"),
    ("job.limits.processes", False, "$.job.limits.processes"),
    ("job.limits.storage_bytes", 0, "$.job.limits.storage_bytes"),
    ("job.limits.storage_inodes", 1e3, "$.job.limits.storage_inodes"),
    ("job.limits.devices", ["gpu", "gpu"], "$.job.limits"),
    ("job.limits.devices", ["GPU"], "$.job.limits.devices[0]"),
    ("job.inputs.0.id", "x", "$.job.inputs[0].id"),
    ("job.inputs.0.name", ".hidden", "$.job.inputs[0].name"),
    ("job.inputs.0.name", "a/b", "$.job.inputs[0].name"),
    ("job.inputs.0.bytes", -1, "$.job.inputs[0].bytes"),
    ("job.inputs.0.bytes", 0, "$.job.inputs[0]"),
    ("job.inputs.0.digest", EMPTY_DIGEST, "$.job.inputs[0]"),
    ("job.inputs.0.delivery", "remote", "$.job.inputs[0].delivery"),
    ("job.inputs.0.delivery", None, "$.job.inputs[0].delivery"),
    ("job.inputs.1.id", ex.hexid(901), "$.job"),
    ("job.inputs.1.name", "model.bin", "$.job"),
    ("job.outputs.0.name", "Result", "$.job.outputs[0].name"),
    ("job.outputs.0.path", "/abs", "$.job.outputs[0].path"),
    ("job.outputs.0.path", "a/../b", "$.job.outputs[0].path"),
    ("job.outputs.0.path", "..", "$.job.outputs[0].path"),
    ("job.outputs.0.path", "./a", "$.job.outputs[0].path"),
    ("job.outputs.0.path", "a//b", "$.job.outputs[0].path"),
    ("job.outputs.0.path", "a/", "$.job.outputs[0].path"),
    ("job.outputs.0.path", "", "$.job.outputs[0].path"),
    ("job.outputs.0.path", "a\nb", "$.job.outputs[0].path"),
    ("job.outputs.0.path", "a\x85b", "$.job.outputs[0].path"),
    ("job.outputs.0.path", "a" * 1025, "$.job.outputs[0].path"),
    (
        "job.outputs",
        [{"name": "a", "path": "x"}, {"name": "a", "path": "y"}],
        "$.job",
    ),
    (
        "job.outputs",
        [{"name": "a", "path": "x"}, {"name": "b", "path": "x"}],
        "$.job",
    ),
    ("job.outputs", [{"name": f"o{i}", "path": f"p{i}"} for i in range(65)], "$.job.outputs"),
    ("job.sensitive", 0, "$.job.sensitive"),
    ("job.sensitive", "false", "$.job.sensitive"),
]


@pytest.mark.parametrize(("path", "value", "where"), VIOLATIONS)
def test_each_constraint_is_enforced(path: str, value: Any, where: str) -> None:
    doc = _valid()
    _set(doc, path, value)
    with pytest.raises(msgspec.ValidationError) as info:
        decode_plan(json.dumps(doc).encode())
    assert explain(info.value)[1] == where, str(info.value)


def test_input_limit_is_64() -> None:
    doc = _valid()
    doc["job"]["inputs"] = [
        {"id": ex.hexid(5000 + i), "name": f"f{i}", "bytes": 1, "digest": D} for i in range(65)
    ]
    with pytest.raises(msgspec.ValidationError, match=r"\$\.job\.inputs`"):
        decode_plan(json.dumps(doc).encode())
    doc["job"]["inputs"].pop()
    decode_plan(json.dumps(doc).encode())


@pytest.mark.parametrize(
    "path",
    ["extra", "job.extra", "job.runtime.extra", "job.payload.extra", "job.limits.extra",
     "job.inputs.0.extra", "job.outputs.0.extra"],
)  # fmt: skip
def test_unknown_fields_are_refused(path: str) -> None:
    doc = _valid()
    _set(doc, path, 1)
    with pytest.raises(msgspec.ValidationError, match="unknown field `extra`"):
        decode_plan(json.dumps(doc).encode())


@pytest.mark.parametrize(
    "path",
    ["job.name", "job.runtime", "job.payload.environment", "job.limits.devices", "job.sensitive"],
)
def test_missing_fields_are_refused(path: str) -> None:
    doc = _valid()
    _set(doc, path, _DELETE)
    with pytest.raises(msgspec.ValidationError, match="missing required field"):
        decode_plan(json.dumps(doc).encode())


def test_empty_object_is_valid_with_the_empty_digest() -> None:
    doc = _valid()
    doc["job"]["inputs"][0].update(bytes=0, digest=EMPTY_DIGEST)
    assert decode_plan(json.dumps(doc).encode()).job.inputs[0].bytes == 0


def test_largest_integers_survive_exactly() -> None:
    doc = _valid()
    doc["generation"] = 2**63 - 1
    doc["job"]["inputs"][0]["bytes"] = 2**63 - 1
    data = json.dumps(doc).encode()
    plan = decode_plan(data)
    assert plan.generation == 2**63 - 1
    assert b'"bytes":9223372036854775807' in encode_plan(plan)
    assert decode_plan(encode_plan(plan)) == plan


def test_128_kib_bound() -> None:
    doc = _valid()
    doc["job"]["payload"]["argv"] = ["/bin/x"] + ["y" * 1000] * 130
    with pytest.raises(PlanTooLarge):
        decode_plan(json.dumps(doc).encode())
    doc["job"]["payload"]["argv"] = ["/bin/x"] + ["y" * 1000] * 120
    plan = decode_plan(json.dumps(doc).encode())
    assert len(encode_plan(plan)) <= PLAN_MAX_BYTES


def test_a_plan_is_immutable() -> None:
    plan = ex.plan(1)
    with pytest.raises(AttributeError):
        plan.generation = 2  # type: ignore[misc]


def test_changing_any_field_changes_the_digest() -> None:
    base = plan_digest(ex.plan(1))
    doc = _valid()
    changed = copy.deepcopy(doc)
    changed["job"]["limits"]["processes"] += 1
    other = msgspec.json.decode(json.dumps(changed).encode(), type=Plan)
    assert plan_digest(other) != base
