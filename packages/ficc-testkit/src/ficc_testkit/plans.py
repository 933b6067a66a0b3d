"""One builder of valid plans for every test: each suite states only what it varies.

Needs ficc-protocol installed (every test environment has it); it is not declared as a
dependency so that this package installs before the project's own wheels.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterable, Mapping

import msgspec

from ficc.execution import plan as planlib
from ficc_testkit.digests import fake

DIGEST = fake("ab")
"""A well-formed package or image digest for plans whose runtime is never pinned."""


def new_id() -> str:
    """A fresh 32-hex identity (installation, deployment, node, job, attempt, object)."""
    return secrets.token_hex(16)


def make_plan(
    *,
    argv: Iterable[str] = ("/bin/true",),
    environment: Mapping[str, str] | None = None,
    provider: str = "test",
    package_digest: str = DIGEST,
    image_digest: str = DIGEST,
    isolation: str = "strict",
    network: str = "none",
    slot_class: str = "cpu",
    name: str = "job",
    job_id: str | None = None,
    attempt_id: str | None = None,
    generation: int = 1,
    offer_revision: int = 1,
    deployment_id: str = "1" * 32,
    node_id: str = "2" * 32,
    project_id: str = "3" * 32,
    cpu_millis: int = 1000,
    memory_bytes: int = 256 << 20,
    swap_bytes: int = 0,
    processes: int = 64,
    storage_bytes: int = 64 << 20,
    storage_inodes: int = 1000,
    devices: Iterable[str] = (),
    inputs: Iterable[planlib.InputObject] = (),
    outputs: Mapping[str, str] | None = None,
    sensitive: bool = False,
) -> planlib.Plan:
    """A valid plan with fresh job and attempt IDs unless given."""
    return planlib.Plan(
        version=1,
        deployment_id=deployment_id,
        node_id=node_id,
        project_id=project_id,
        job_id=job_id or new_id(),
        attempt_id=attempt_id or new_id(),
        generation=generation,
        offer_revision=offer_revision,
        job=planlib.Job(
            name=name,
            slot_class=slot_class,
            runtime=planlib.Runtime(provider, package_digest, image_digest, isolation, network),
            payload=planlib.Payload(argv=list(argv), environment=dict(environment or {})),
            limits=planlib.Limits(
                cpu_millis=cpu_millis,
                memory_bytes=memory_bytes,
                swap_bytes=swap_bytes,
                processes=processes,
                storage_bytes=storage_bytes,
                storage_inodes=storage_inodes,
                devices=list(devices),
            ),
            inputs=list(inputs),
            outputs=[planlib.Output(n, p) for n, p in (outputs or {}).items()],
            sensitive=sensitive,
        ),
    )


def with_environment(plan: planlib.Plan, **environment: str) -> planlib.Plan:
    """The plan with this payload environment (the test provider's failure switches)."""
    payload = msgspec.structs.replace(plan.job.payload, environment=environment)
    return msgspec.structs.replace(plan, job=msgspec.structs.replace(plan.job, payload=payload))
