"""The demo's pure parts (tools/demo/) against the real parsers they must satisfy.

The demo (`tools/dev demo`) writes an administrator configuration and builds a plan;
if either drifted from what the daemon, the protocol or the Podman provider accept,
the demo would fail only at run time, on a fresh machine, in front of a newcomer.
These tests run the same values through `ficc.execution.host.config.load.parse_config`,
the plan codec, request validation and the provider's configuration schema.
"""

from __future__ import annotations

import base64
import json
import sys
from pathlib import Path

import msgspec
import pytest

from ficc.execution.host.config.load import parse_config
from ficc.execution.host.config.model import Config
from ficc.execution.host.core.errors import HostError
from ficc.execution.plan import Plan, decode_plan, digest_of, encode_plan, plan_digest
from ficc.execution.protocol import (
    INPUT_CHUNK_MAX_BYTES,
    InputWrite,
    InputWriteRequest,
    PrepareAttempt,
    PrepareRequest,
    Renewal,
    validate_request,
)
from ficc_provider_podman.config import Config as PodmanConfig
from ficc_testkit.driver import chunks

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))

from demo import config as democonfig
from demo import job
from demo.layout import DEFAULT_BASE, DISK_BASE, PROVIDER, SLOT_CLASS, RunLayout
from ficc_testkit.digests import fake

LAYOUT = RunLayout(DEFAULT_BASE / "run-20260101-000000")
FILESYSTEM_UUID = "6d1f0c2e-3b4a-4c5d-8e9f-0a1b2c3d4e5f"
TRANSPORT = democonfig.Account("ficc-demo-transport", 990, 990)
SLOT = democonfig.Account("ficc-demo-slot", 989, 989)
DIGEST = fake("ab")
IMAGE = democonfig.Image(
    archive=str(LAYOUT.image_dir / "ficc-test.oci.tar"),
    archive_sha256=fake("cd"),
    image_id=fake("ef"),
)
IDS = democonfig.Identities()
JOB_IDS = job.JobIds("1" * 32, "2" * 32, "3" * 32)


def document(**changes: object) -> dict[str, object]:
    doc = democonfig.admin_config(
        LAYOUT,
        IDS,
        transport=TRANSPORT,
        slot=SLOT,
        provider_digest=DIGEST,
        image=IMAGE,
        filesystem_uuid=FILESYSTEM_UUID,
    )
    doc.update(changes)
    return doc


def parsed(doc: dict[str, object]) -> Config:
    return parse_config(json.dumps(doc).encode(), ".json")


def demo_plan() -> Plan:
    return job.build_plan(
        JOB_IDS,
        deployment_id=IDS.deployment_id,
        node_id=IDS.node_id,
        offer_revision=1,
        provider_digest=DIGEST,
        image_id=IMAGE.image_id,
    )


def test_the_daemon_accepts_the_demo_configuration() -> None:
    config = parsed(document())
    assert config.transport_uid == TRANSPORT.uid
    (slot,) = config.slots
    assert (slot.slot_class, slot.path, slot.uid, slot.gid) == (
        SLOT_CLASS,
        str(LAYOUT.slot_dir),
        SLOT.uid,
        SLOT.gid,
    )
    assert config.initial_offer.control == "active"
    assert config.initial_offer.runtimes == (PROVIDER,)
    (provider,) = config.providers
    assert (provider.id, provider.package_digest) == (PROVIDER, DIGEST)
    assert config.state_dir == str(LAYOUT.state_dir)
    assert config.socket_dir == str(LAYOUT.socket_dir)


def test_the_parser_is_strict_about_what_the_demo_varies() -> None:
    """The check above is meaningful: the same document with the accounts swapped in
    a way the daemon forbids (transport = slot account) is refused."""
    bad = document(transport_uid=SLOT.uid)
    with pytest.raises(HostError) as refused:
        parsed(bad)
    assert refused.value.code == "config_conflict"


def test_the_podman_provider_accepts_its_configuration() -> None:
    configuration = democonfig.provider_configuration(IMAGE)
    config = msgspec.convert(configuration, PodmanConfig, strict=True)
    image = config.image(IMAGE.image_id)
    assert image is not None
    assert (image.archive, image.archive_sha256, image.image_id) == (
        IMAGE.archive,
        IMAGE.archive_sha256,
        IMAGE.image_id,
    )


def test_the_demo_plan_survives_the_canonical_codec() -> None:
    plan = demo_plan()
    assert decode_plan(encode_plan(plan)) == plan
    assert plan_digest(plan) == plan_digest(decode_plan(encode_plan(plan)))


def test_the_demo_plan_fits_the_demo_offer_and_slot() -> None:
    """What admission checks, with the demo's own numbers: the plan is admissible."""
    plan = demo_plan()
    config = parsed(document())
    offer, (slot,) = config.initial_offer, config.slots
    limits = plan.job.limits
    assert plan.job.slot_class == slot.slot_class
    assert plan.project_id in offer.projects
    assert plan.job.runtime.provider in offer.runtimes
    assert plan.job.runtime.package_digest == config.providers[0].package_digest
    assert limits.cpu_millis <= offer.cpu_millis
    assert limits.memory_bytes <= offer.memory_bytes
    assert limits.swap_bytes <= offer.swap_bytes
    assert limits.processes <= offer.processes
    assert limits.storage_bytes <= slot.storage_bytes
    assert limits.storage_inodes <= slot.storage_inodes
    assert set(limits.devices) <= set(offer.devices)
    podman = msgspec.convert(config.providers[0].configuration, PodmanConfig, strict=True)
    assert podman.image(plan.job.runtime.image_digest) is not None


def test_the_prepare_and_input_requests_validate() -> None:
    plan = demo_plan()
    digest = plan_digest(plan)
    fence = {"attempt_id": JOB_IDS.attempt_id, "generation": 1, "plan_digest": digest}
    prepare = PrepareRequest(
        version=1,
        id="4" * 32,
        installation_id=IDS.installation_id,
        ledger_id="5" * 32,
        admission_version=1,
        attempts=[
            PrepareAttempt(
                plan=plan,
                lease=Renewal(**fence, sequence=1, expires_at_ms=1_900_000_000_000),
            )
        ],
    )
    validate_request(prepare)
    (declared,) = plan.job.inputs
    pieces = list(chunks(job.INPUT_TEXT, job.CHUNK_BYTES))
    assert len(pieces) > 1, "the demo should show a stream in several chunks"
    assert b"".join(chunk for _, chunk in pieces) == job.INPUT_TEXT
    assert (declared.bytes, declared.digest) == (len(job.INPUT_TEXT), digest_of(job.INPUT_TEXT))
    for offset, chunk in pieces:
        assert len(chunk) <= INPUT_CHUNK_MAX_BYTES
        write = InputWrite(
            **fence,
            object=declared.id,
            offset=offset,
            data=base64.b64encode(chunk).decode(),
            digest=digest_of(chunk),
        )
        validate_request(InputWriteRequest(version=1, id="6" * 32, writes=[write]))


def test_the_run_directory_is_where_the_daemon_allows_it() -> None:
    """Under /run, never below /tmp (group/other-writable ancestors are refused)."""
    assert DEFAULT_BASE.is_relative_to("/run")
    for path in (LAYOUT.config_file, LAYOUT.state_dir, LAYOUT.socket_dir, LAYOUT.slot_dir):
        assert path.is_relative_to(LAYOUT.root)
        assert not path.is_relative_to("/tmp")


def test_the_slot_image_is_on_disk_and_the_slot_is_its_mount() -> None:
    """/run is often a small tmpfs: the slot's image file goes under /var/lib, and the
    slot path (its mount point) stays in the run directory."""
    assert LAYOUT.slot_image.is_relative_to(DISK_BASE / LAYOUT.root.name)
    (slot,) = parsed(document()).slots
    assert slot.path == str(LAYOUT.slot_dir)
    assert slot.filesystem_uuid == FILESYSTEM_UUID
