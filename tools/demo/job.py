"""The demo's job: a small text streamed in, a shell script over it, one output (pure).

The payload runs in the busybox test image: it reads the streamed input at
/inputs/poem.txt, prints a few facts about it on stdout, and writes an upper-cased
copy to /work/shout.txt, which is the attempt's storage on the host and the declared
output `shout`. The controller collects both afterwards.
"""

from __future__ import annotations

from dataclasses import dataclass

from demo.config import PROJECT
from demo.layout import PROVIDER, SLOT_CLASS
from ficc.execution.plan import InputObject, Limits, Plan, digest_of
from ficc_testkit.plans import make_plan
from ficc_testkit.units import MIB

INPUT_NAME = "poem.txt"
INPUT_TEXT = b"""\
The host runs other people's jobs as root,
so every step is checked before the next:
the plan is pinned, the lease is counted down,
the input streamed in chunks and hashed in full,
the provider pinned by digest, then prepared,
the payload held behind a static gate
until the live process proves its fence,
and only then released to do its work.
"""
CHUNK_BYTES = 100
"""Small on purpose, so the demo streams the text in several `input_write` requests."""

OUTPUT_NAME = "shout"
OUTPUT_PATH = "shout.txt"

SCRIPT = f"""\
echo "hello from the payload: $(busybox | head -n 1)"
echo "input {INPUT_NAME}: $(wc -l < /inputs/{INPUT_NAME}) lines, \
$(wc -w < /inputs/{INPUT_NAME}) words, $(wc -c < /inputs/{INPUT_NAME}) bytes"
set -- $(sha256sum /inputs/{INPUT_NAME})
echo "input sha256: $1"
tr a-z A-Z < /inputs/{INPUT_NAME} > /work/{OUTPUT_PATH}
echo "wrote /work/{OUTPUT_PATH}: $(wc -c < /work/{OUTPUT_PATH}) bytes"
"""
"""The payload's shell script (only the image's busybox applets: sh, echo, wc, ...)."""

LIMITS = Limits(
    cpu_millis=500,
    # Rootless Podman, conmon and the pause process share the service's memory and
    # process limits with the payload (docs/providers.md): leave them room.
    memory_bytes=256 * MIB,
    swap_bytes=0,
    processes=128,
    storage_bytes=64 * MIB,
    storage_inodes=1000,
    devices=[],
)


@dataclass(frozen=True)
class JobIds:
    """The controller's names for this job and its first attempt."""

    job_id: str
    attempt_id: str
    input_id: str


def input_object(ids: JobIds, data: bytes = INPUT_TEXT) -> InputObject:
    return InputObject(
        id=ids.input_id, name=INPUT_NAME, bytes=len(data), digest=digest_of(data), delivery="stream"
    )


def build_plan(
    ids: JobIds,
    *,
    deployment_id: str,
    node_id: str,
    offer_revision: int,
    provider_digest: str,
    image_id: str,
    data: bytes = INPUT_TEXT,
) -> Plan:
    """The immutable plan of the attempt, bound later by its digest in every fence."""
    return make_plan(
        deployment_id=deployment_id,
        node_id=node_id,
        project_id=PROJECT,
        job_id=ids.job_id,
        attempt_id=ids.attempt_id,
        offer_revision=offer_revision,
        name="demo-shout",
        slot_class=SLOT_CLASS,
        provider=PROVIDER,
        package_digest=provider_digest,
        image_digest=image_id,
        isolation="shared-kernel",
        argv=["/bin/sh", "-c", SCRIPT],
        environment={"LANG": "C"},
        cpu_millis=LIMITS.cpu_millis,
        memory_bytes=LIMITS.memory_bytes,
        swap_bytes=LIMITS.swap_bytes,
        processes=LIMITS.processes,
        storage_bytes=LIMITS.storage_bytes,
        storage_inodes=LIMITS.storage_inodes,
        devices=LIMITS.devices,
        inputs=[input_object(ids, data)],
        outputs={OUTPUT_NAME: OUTPUT_PATH},
    )
