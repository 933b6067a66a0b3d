"""Provider contexts for tests that call a driver directly (no daemon, no layout)."""

from __future__ import annotations

import hashlib
from collections.abc import Callable

import msgspec

from ficc.execution import plan as planlib
from ficc.execution import provider as sdk
from ficc_testkit.plans import make_plan


def sample_plan(argv: tuple[str, ...] = ("/bin/true",), provider: str = "test") -> planlib.Plan:
    """A valid plan with fresh job and attempt IDs."""
    digest = "sha256:" + hashlib.sha256(b"pkg").hexdigest()
    return make_plan(
        argv=argv, provider=provider, package_digest=digest, image_digest=digest,
        isolation="shared-kernel", memory_bytes=64 << 20, storage_bytes=1 << 20,
        storage_inodes=100,
    )  # fmt: skip


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
