"""`run`'s plan filling (cli/job_plan.py), without a daemon: which fields it fills,
that it never changes a pinned one, and each refusal's code and advice."""

from __future__ import annotations

import copy
import itertools
import json
from pathlib import Path
from typing import Any

import msgspec
import pytest

from ficc.execution.host.cli import job_plan
from ficc.execution.host.cli.job_plan import Choices, Host, LocalInput
from ficc.execution.host.core.codes import HostCode
from ficc.execution.host.core.errors import HostError
from ficc.execution.plan import EMPTY_DIGEST
from ficc.execution.wire import SnapshotReply

EXAMPLE = Path(__file__).resolve().parents[4] / "docs" / "examples" / "podman-first-job.json"
PIN = "sha256:" + "5c" * 32
IMAGE = "sha256:" + "61" * 32
DEPLOYMENT, NODE, PROJECT = "0d" * 16, "0e" * 16, "0f" * 16
FILE = LocalInput("greeting.txt", "/srv/greeting.txt", 12, "sha256:" + "ab" * 32)


def snapshot(**changes: Any) -> SnapshotReply:
    """A host with one class of 2 slots (1 free), the podman provider, revision 3."""
    document: dict[str, Any] = {
        "version": 1, "id": "12" * 16, "installation_id": "1f" * 16, "ledger_id": "2e" * 16,
        "admission_version": 1, "maximum_lease_seconds": 3600,
        "offer": {"revision": 3, "control": "active", "limits": {
            "resources": {"attempts": 4, "cpu_millis": 8000, "memory_bytes": 16 << 30,
                          "swap_bytes": 0, "processes": 4096, "storage_bytes": 100 << 30,
                          "storage_inodes": 1_000_000},
            "projects": [PROJECT], "runtimes": None}},
        "capacity": {
            "available": {"attempts": 3, "cpu_millis": 6000, "memory_bytes": 1 << 30,
                          "swap_bytes": 0, "processes": 4096, "storage_bytes": 100 << 30,
                          "storage_inodes": 1_000_000},
            "slot_classes": [{"class": "small", "total": 2, "free": 1, "bytes": 1 << 30,
                              "inodes": 10000}],
            "providers": [{"id": "podman", "package_digest": PIN, "available": True}]},
        "attempts": [], "next": None,
    }  # fmt: skip
    for path, value in changes.items():
        *parents, key = path.split("__")
        holder = document
        for parent in parents:
            holder = holder[parent]
        holder[key] = value
    return msgspec.convert(document, SnapshotReply)


def ids() -> Any:
    counter = itertools.count(1)
    return lambda: f"{next(counter):032x}"


def example() -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(EXAMPLE.read_text())
    return loaded


def fill(
    document: dict[str, Any], host: Host | None = None, choices: Choices | None = None
) -> job_plan.Filled:
    host = host or Host(snapshot(), DEPLOYMENT, NODE)
    choices = choices or Choices(image=IMAGE, inputs=[FILE])
    return job_plan.fill_plan(document, host, choices, ids())


def refusal(document: dict[str, Any], host: Host | None = None, **choices: Any) -> HostError:
    made = Choices(**({"image": IMAGE, "inputs": [FILE]} | choices))
    with pytest.raises(HostError) as raised:
        fill(document, host, made)
    return raised.value


def test_the_example_plan_is_filled_from_the_host_and_its_input_file() -> None:
    filled = fill(example())
    plan = filled.plan
    assert (plan.deployment_id, plan.node_id, plan.project_id) == (DEPLOYMENT, NODE, PROJECT)
    assert (plan.job_id, plan.attempt_id, plan.offer_revision) == (
        "0" * 31 + "1",
        "0" * 31 + "2",
        3,
    )
    runtime = plan.job.runtime
    assert (runtime.package_digest, runtime.image_digest, plan.job.slot_class) == (
        PIN,
        IMAGE,
        "small",
    )
    (item,) = plan.job.inputs
    assert (item.bytes, item.digest, item.delivery) == (12, FILE.digest, "stream")
    assert plan.job.limits.memory_bytes == 268435456  # pinned in the file: kept
    assert filled.filled == (
        "$.deployment_id", "$.node_id", "$.project_id", "$.job_id", "$.attempt_id",
        "$.offer_revision", "$.job.slot_class", "$.job.runtime.package_digest",
        "$.job.runtime.image_digest", "$.job.inputs[0].id", "$.job.inputs[0].bytes",
        "$.job.inputs[0].digest",
    )  # fmt: skip


def test_what_the_plan_pins_is_kept_as_written() -> None:
    document = example()
    document.update(attempt_id="aa" * 16, job_id="bb" * 16, project_id="cc" * 16, generation=4)
    plan = fill(document).plan
    assert (plan.attempt_id, plan.job_id, plan.project_id, plan.generation) == (
        "aa" * 16, "bb" * 16, "cc" * 16, 4,
    )  # fmt: skip


def test_the_document_is_not_changed() -> None:
    document = example()
    kept = copy.deepcopy(document)
    fill(document)
    assert document == kept


def test_a_flag_that_contradicts_a_pinned_field_is_refused() -> None:
    document = example()
    document["job"]["slot_class"] = "small"
    error = refusal(document, slot_class="large")
    assert error.code == HostCode.RUN_PLAN_MISMATCH
    assert (
        "$.job.slot_class is 'small' in the plan and 'large' on the command line" in error.message
    )


@pytest.mark.parametrize(
    ("field", "value", "says"),
    [
        ("offer_revision", 2, "the plan pins offer_revision 2; the host's offer is at revision 3"),
        ("node_id", "99" * 16, "this host serves deployment"),
    ],
)
def test_a_pinned_field_the_host_contradicts_is_refused(field: str, value: Any, says: str) -> None:
    document = example()
    document[field] = value
    error = refusal(document)
    assert (error.code, says in error.message) == (HostCode.RUN_PLAN_MISMATCH, True), error


def test_a_pinned_package_digest_must_be_the_hosts_pin() -> None:
    document = example()
    document["job"]["runtime"]["package_digest"] = "sha256:" + "00" * 32
    error = refusal(document)
    assert error.code == HostCode.RUN_PLAN_MISMATCH
    assert f"the host pins {PIN}" in error.message


def test_the_deployment_comes_from_the_configuration_or_a_flag() -> None:
    error = refusal(example(), Host(snapshot()))
    assert error.code == HostCode.RUN_PLAN_INCOMPLETE
    assert "give --deployment ID" in error.message


def test_an_image_must_be_named_unless_the_configuration_offers_one() -> None:
    error = refusal(example(), image=None)
    assert error.code == HostCode.RUN_NO_IMAGE
    assert "give --image DIGEST" in error.message
    configured = Host(snapshot(), DEPLOYMENT, NODE, images={"podman": [IMAGE]})
    plan = fill(example(), configured, Choices(inputs=[FILE])).plan
    assert plan.job.runtime.image_digest == IMAGE


@pytest.mark.parametrize(
    ("names", "code", "says"),
    [
        (["greeting.txt", "other.txt"], HostCode.RUN_INPUT_UNDECLARED,
         "declares no input 'other.txt'"),
        ([], HostCode.RUN_INPUT_NOT_GIVEN, "add --input greeting.txt=FILE"),
    ],
)  # fmt: skip
def test_inputs_match_the_plans_streamed_inputs(
    names: list[str], code: HostCode, says: str
) -> None:
    with pytest.raises(HostError) as raised:
        job_plan.match_inputs(example(), names)
    assert raised.value.code == code
    assert says in raised.value.message


def test_a_local_input_cannot_be_streamed() -> None:
    document = example()
    document["job"]["inputs"][0]["delivery"] = "local"
    with pytest.raises(HostError) as raised:
        job_plan.match_inputs(document, ["greeting.txt"])
    assert raised.value.code == HostCode.RUN_INPUT_UNDECLARED
    assert 'write "delivery": "stream"' in raised.value.message


def test_a_pinned_input_digest_must_be_the_files() -> None:
    document = example()
    document["job"]["inputs"][0].update(id="3c" * 16, bytes=12, digest=EMPTY_DIGEST)
    error = refusal(document)
    assert error.code == HostCode.RUN_INPUT_MISMATCH
    assert "leave digest open" in error.message


@pytest.mark.parametrize(
    ("changes", "code"),
    [
        ({"offer__control": "paused"}, HostCode.RUN_OFFER_CLOSED),
        ({"capacity__slot_classes": [{"class": "small", "total": 2, "free": 0, "bytes": 1,
                                      "inodes": 1}]}, HostCode.RUN_NO_FREE_SLOT),
        ({"capacity__providers": [{"id": "podman", "package_digest": PIN, "available": False}]},
         HostCode.RUN_PROVIDER_UNAVAILABLE),
    ],
)  # fmt: skip
def test_a_host_that_cannot_take_the_job_is_refused_before_anything_is_sent(
    changes: dict[str, Any], code: HostCode
) -> None:
    assert refusal(example(), Host(snapshot(**changes), DEPLOYMENT, NODE)).code == code


def test_an_image_and_a_command_line_fill_every_open_field() -> None:
    document = job_plan.template(["/bin/echo", "hi"], {"A": "1"}, [], {"out": "out.txt"})
    plan = fill(document, choices=Choices(image=IMAGE, limits={"memory_bytes": 64 << 20})).plan
    limits = plan.job.limits
    assert (plan.job.name, plan.job.runtime.provider, plan.job.runtime.isolation) == (
        "run", "podman", "shared-kernel",
    )  # fmt: skip
    # one attempt's share of the offer (8000 / 4 attempts), at most what is available
    assert (limits.cpu_millis, limits.memory_bytes, limits.processes) == (2000, 64 << 20, 1024)
    assert (limits.storage_bytes, limits.storage_inodes, limits.swap_bytes) == (1 << 30, 10000, 0)
    assert plan.job.outputs[0].path == "out.txt"


def test_the_smallest_of_the_share_and_a_cap_is_the_default() -> None:
    document = job_plan.template(["/bin/true"], {}, [], {})
    capped = Choices(image=IMAGE, at_most={"cpu_millis": 500, "memory_bytes": 1 << 40})
    limits = fill(document, choices=capped).plan.job.limits
    assert (limits.cpu_millis, limits.memory_bytes) == (500, 1 << 30)  # 1 GiB available


def test_a_plan_the_host_would_refuse_names_the_field() -> None:
    document = example()
    document["job"]["payload"]["argv"] = ["relative"]
    error = refusal(document)
    assert error.code == HostCode.RUN_PLAN_INVALID
    assert "argv" in error.message


@pytest.mark.parametrize(
    ("data", "says"),
    [(b'{"version": 1,', "is not a JSON plan"), (b"[1]", "is not a JSON object"),
     (b'{"a": 1, "a": 2}', "key 'a' appears twice")],
)  # fmt: skip
def test_a_file_that_is_not_a_plan_is_refused(data: bytes, says: str) -> None:
    with pytest.raises(HostError) as raised:
        job_plan.read_document(data, "plan.json")
    assert raised.value.code == HostCode.RUN_PLAN_INVALID
    assert says in raised.value.message


def test_every_fillable_field_is_documented() -> None:
    """docs/operations.md's table of filled fields is `FILLED`."""
    text = (EXAMPLE.parents[1] / "operations.md").read_text()
    table = text.split("<!-- run-filled -->", 1)[1].split("<!-- /run-filled -->", 1)[0]
    for field, source in job_plan.FILLED.items():
        assert f"| `{field}` | {source} |" in table, field
