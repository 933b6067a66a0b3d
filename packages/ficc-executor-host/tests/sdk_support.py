"""Provider contexts for tests that call a driver directly (no daemon, no layout)."""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Callable

import msgspec

from ficc.execution import plan as planlib
from ficc.execution.host import sdk


def sample_plan(argv: tuple[str, ...] = ("/bin/true",), provider: str = "test") -> planlib.Plan:
    """A valid plan with fresh job and attempt IDs."""
    digest = "sha256:" + hashlib.sha256(b"pkg").hexdigest()
    return planlib.Plan(
        version=1,
        deployment_id="1" * 32,
        node_id="2" * 32,
        project_id="3" * 32,
        job_id=secrets.token_hex(16),
        attempt_id=secrets.token_hex(16),
        generation=1,
        offer_revision=1,
        job=planlib.Job(
            name="job",
            slot_class="cpu",
            runtime=planlib.Runtime(provider, digest, digest, "shared-kernel", "none"),
            payload=planlib.Payload(argv=list(argv), environment={}),
            limits=planlib.Limits(
                cpu_millis=1000,
                memory_bytes=64 << 20,
                swap_bytes=0,
                processes=64,
                storage_bytes=1 << 20,
                storage_inodes=100,
                devices=[],
            ),
            inputs=[],
            outputs=[],
            sensitive=False,
        ),
    )


def sample_context(
    plan: planlib.Plan | None = None, *, root: str = "/nonexistent/ficc"
) -> sdk.Context:
    """A complete context for `plan` whose paths lie under `root` (nothing is created)."""
    plan = plan or sample_plan()
    attempt = f"{root}/{plan.attempt_id}"
    service = f"ficc-test-{plan.attempt_id}"
    return sdk.Context(
        attempt_id=plan.attempt_id,
        plan=plan,
        plan_digest=planlib.plan_digest(plan),
        slot=sdk.Slot(
            id="slot0",
            slot_class="cpu",
            path=root,
            uid=65534,
            gid=65534,
            storage_bytes=1 << 30,
            storage_inodes=10000,
        ),
        storage=sdk.StorageBinding(path=f"{attempt}/storage"),
        attempt_directory=attempt,
        provider_directory=f"{attempt}/provider",
        control_directory=f"{attempt}/control",
        release_marker=f"{attempt}/control/release",
        logs=sdk.Logs(stdout=f"{attempt}/logs/stdout", stderr=f"{attempt}/logs/stderr"),
        service=service,
        cgroup=f"/ficc/{service}/supervisor",
        supervisor=sdk.Supervisor(backend="cgroupfs", service=service),
    )


def with_check(context: sdk.Context, check: Callable[[], None]) -> sdk.PrepareContext:
    """The prepare context of `context`."""
    return sdk.PrepareContext(**msgspec.structs.asdict(context), check=check)
