"""A real host around the Podman provider, for its tests and for benchmark P6.

Everything is real: a system slot account created with useradd, the host's attempt
layout (ficc.execution.host.storage.layout), its stager for streamed inputs, its cgroupfs
system service running the prepared argv as the slot account, its payload gate and
release marker, and rootless Podman with the registry-free test image
(tools/testimage/build.py). The steps follow the host runner (runner/preparing.py,
runner/starting.py) in order: prepare -> service -> start -> observe to `payload` ->
gate -> marker -> finished.
"""

from __future__ import annotations

import contextlib
import os
import posixpath
import secrets
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from ficc.execution import plan as planlib
from ficc.execution import provider as sdk
from ficc.execution.host.gate import checks as gate
from ficc.execution.host.gate.expectation import (
    PrepareResult,
    build_expectation,
    decode_prepare_result,
    service_spec,
)
from ficc.execution.host.linux import evidence as evidencelib
from ficc.execution.host.service.cgroupfs import CgroupfsService
from ficc.execution.host.service.interface import ServiceHandle
from ficc.execution.host.storage import layout
from ficc.execution.host.storage.staging import Stager
from ficc.execution.host.storage.streams import streams_of
from ficc_provider_podman import driver as podman_driver
from ficc_provider_podman.account import kill_leftovers
from ficc_testkit import plans, podman
from ficc_testkit.accounts import account_command
from ficc_testkit.digests import digest_of
from ficc_testkit.services import purge_cgroups
from ficc_testkit.slots import remove_tree

REPO = Path(__file__).resolve().parents[3]
ISOLATION = "shared-kernel"
NOFILE = 1024


@dataclass(frozen=True)
class Slot:
    id: str
    path: str
    uid: int
    gid: int


def build_image(out: Path, tag: str | None = None) -> dict[str, str]:
    """The busybox test image as an OCI archive (the test kit's, from this checkout)."""
    return podman.build_image(podman.Sources(REPO), out, tag)


@dataclass
class World:
    """One slot account with its slot directory, the image and a configured driver."""

    base: Path
    slot: Slot
    image: dict[str, str]
    service: CgroupfsService
    config: dict[str, Any]
    driver: podman_driver.Driver
    local_data: bytes
    local_id: str = field(default_factory=lambda: secrets.token_hex(16))

    @property
    def stager(self) -> Stager:
        return Stager(self.slot.path, self.slot.gid)


@contextlib.contextmanager
def world() -> Iterator[World]:
    """Create everything (user, directories, image, service backend); remove it all."""
    name = f"ficc-pp-{secrets.token_hex(3)}"
    base = Path(f"/tmp/{name}")
    base.mkdir()
    base.chmod(0o755)
    account_command("useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", name)
    service_base = f"ficc-pp-svc-{secrets.token_hex(3)}"
    service = CgroupfsService(service_base, stop_timeout=15.0)
    uid = int(subprocess.run(["id", "-u", name], capture_output=True, check=True).stdout)
    gid = int(subprocess.run(["id", "-g", name], capture_output=True, check=True).stdout)
    try:
        slot_path = base / "slot"
        slot_path.mkdir()
        slot_path.chmod(0o755)  # as provisioning makes it, whatever the umask
        image = build_image(base / "image")
        local = base / "local-input.txt"
        local_data = b"administrator-local input\n"
        local.write_bytes(local_data)
        local.chmod(0o644)
        w = World(
            base=base,
            slot=Slot("slot0", str(slot_path), uid, gid),
            image=image,
            service=service,
            config={},
            driver=None,  # type: ignore[arg-type]
            local_data=local_data,
        )
        w.config = {
            "images": [
                {
                    "digest": image["image_id"],
                    "archive": image["archive"],
                    "archive_sha256": image["archive_sha256"],
                    "image_id": image["image_id"],
                }
            ],
            "local_inputs": [
                {
                    "id": w.local_id,
                    "path": str(local),
                    "bytes": len(local_data),
                    "digest": digest_of(local_data),
                }
            ],
            "devices": [
                {"name": "full", "path": "/dev/full"},
                {"name": "zero", "path": "/dev/zero"},
            ],
            "runtime_devices": ["/dev/null", "/dev/random", "/dev/urandom"],
        }
        w.driver = podman_driver.configure(w.config)
        yield w
    finally:
        purge_cgroups(service, service_base)
        with contextlib.suppress(Exception):
            kill_leftovers(uid)
        # Podman's per-user leftovers go before the account (its UID may be reused).
        shutil.rmtree(f"/run/user/{uid}", ignore_errors=True)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(f"/dev/shm/libpod_rootless_lock_{uid}")
        account_command("userdel", name)
        remove_tree(base)


def make_plan(
    w: World,
    argv: list[str],
    *,
    streamed: bytes | None = None,
    local: bool = False,
    devices: tuple[str, ...] = ("full",),
    memory: int = 256 << 20,
    processes: int = 256,
    environment: dict[str, str] | None = None,
) -> planlib.Plan:
    inputs = []
    if streamed is not None:
        inputs.append(
            planlib.InputObject(
                secrets.token_hex(16), "data.txt", len(streamed), digest_of(streamed), "stream"
            )
        )
    if local:
        inputs.append(
            planlib.InputObject(w.local_id, "local.txt", len(w.local_data), digest_of(w.local_data))
        )
    return plans.make_plan(
        provider="podman", package_digest=digest_of(b"pkg"), image_digest=w.image["image_id"],
        isolation=ISOLATION, argv=argv, environment=environment or {"GREETING": "hello"},
        memory_bytes=memory, processes=processes, storage_bytes=1 << 30, storage_inodes=10000,
        devices=devices, inputs=inputs, outputs={"result": "out.txt"},
    )  # fmt: skip


@dataclass
class Attempt:
    """One attempt on the world's slot, driven step by step like the host runner."""

    w: World
    plan: planlib.Plan
    paths: layout.AttemptPaths
    checks: int = 0
    capabilities: list[sdk.InputCapability] = field(default_factory=list)
    result: PrepareResult | None = None
    handle: ServiceHandle | None = None
    ready: dict[str, Any] | None = None
    pid: int | None = None

    @property
    def id(self) -> str:
        return self.plan.attempt_id

    def context(self, check: Callable[[], None] | None = None) -> sdk.Context:
        """The context the host would build (a `PrepareContext` when `check` is given)."""
        slot = self.w.slot
        context = sdk.Context(
            attempt_id=self.id,
            plan=self.plan,
            plan_digest=planlib.plan_digest(self.plan),
            slot=sdk.Slot(
                id=slot.id,
                slot_class="cpu",
                path=slot.path,
                uid=slot.uid,
                gid=slot.gid,
                storage_bytes=1 << 30,
                storage_inodes=10000,
            ),
            storage=sdk.StorageBinding(path=self.paths.storage),
            attempt_directory=self.paths.root,
            provider_directory=self.paths.provider,
            control_directory=self.paths.control,
            release_marker=f"{self.paths.control}/release",
            logs=sdk.Logs(stdout=self.paths.stdout, stderr=self.paths.stderr),
            service=f"attempt-{self.id}",
            cgroup=f"/ficc/attempt-{self.id}/supervisor",
            supervisor=sdk.Supervisor(backend="cgroupfs", service=f"attempt-{self.id}"),
            inputs=tuple(self.capabilities),
        )
        if check is None:
            return context
        return sdk.PrepareContext(**msgspec.structs.asdict(context), check=check)

    def check(self) -> None:
        self.checks += 1

    def call(self, method: str, check: Callable[[], None] | None = None) -> dict[str, Any]:
        (reply,) = getattr(self.w.driver, method)([self.context(check)])
        assert isinstance(reply, dict)
        return reply


def new_attempt(w: World, plan: planlib.Plan, streamed: bytes | None = None) -> Attempt:
    """Admission side effects of the host: layout and (if any) the streamed input."""
    place = layout.Layout(w.slot)
    paths = place.create(plan.attempt_id)
    attempt = Attempt(w, plan, paths)
    if plan.streamed_inputs:
        assert streamed is not None
        stager = w.stager
        stager.register_attempt(plan.attempt_id, streams_of(plan.job.inputs))
        stager.prepare_attempt(plan.attempt_id)
        (obj,) = plan.streamed_inputs
        stager.write(plan.attempt_id, obj.id, 0, streamed, digest_of(streamed))
        attempt.capabilities = stager.capabilities(plan.attempt_id)
        attempt.stager = stager  # type: ignore[attr-defined]
    return attempt


def prepare(attempt: Attempt) -> PrepareResult:
    reply = attempt.call("prepare", check=attempt.check)
    assert "error" not in reply, reply
    attempt.result = decode_prepare_result(reply)
    return attempt.result


def create_service(attempt: Attempt, argv: list[str] | None = None) -> ServiceHandle:
    assert attempt.result is not None
    spec = service_spec(
        f"attempt-{attempt.id}",
        attempt.result,
        uid=attempt.w.slot.uid,
        gid=attempt.w.slot.gid,
        paths=attempt.paths,
        limits=attempt.plan.job.limits,
        nofile=NOFILE,
        argv=argv,
    )
    attempt.handle = attempt.w.service.create(spec)
    return attempt.handle


def await_payload(attempt: Attempt, timeout: float = 60.0) -> int:
    """Observe until the barrier's PID (recording the `ready` reply on the way)."""
    deadline = time.monotonic() + timeout
    while True:
        seen = attempt.call("observe")
        assert "error" not in seen, seen
        if seen["phase"] == "payload":
            attempt.pid = int(seen["pid"])
            return attempt.pid
        if seen["phase"] == "ready":
            attempt.ready = seen
        else:
            assert seen["phase"] == "waiting", seen
        assert time.monotonic() < deadline, "the barrier never came up"
        time.sleep(0.01)


def run_gate(attempt: Attempt, pid: int, name: str = gate.EVIDENCE_FILE) -> gate.Verdict:
    assert attempt.result is not None
    assert attempt.handle is not None
    service = attempt.w.service
    logs = tuple(
        evidencelib.FileIdentity(st.st_dev, st.st_ino)
        for st in (os.stat(p) for p in (attempt.paths.stdout, attempt.paths.stderr))
    )
    expectation = build_expectation(
        uid=attempt.w.slot.uid,
        gid=attempt.w.slot.gid,
        result=attempt.result,
        handle=attempt.handle,
        service_cgroup=posixpath.dirname(service.supervisor_cgroup(attempt.handle)),
        processes=attempt.plan.job.limits.processes,
        log_files=logs,
        nofile=NOFILE,
    )
    fd = os.open(attempt.paths.evidence, os.O_RDONLY | os.O_DIRECTORY)
    try:
        return gate.inspect_and_check(pid, expectation, fd, evidence_name=name)
    finally:
        os.close(fd)


def release_marker(attempt: Attempt) -> None:
    fd = os.open(attempt.paths.control, os.O_RDONLY | os.O_DIRECTORY)
    try:
        gate.write_release_marker(fd, "release", group=attempt.w.slot.gid)
    finally:
        os.close(fd)


def released(attempt: Attempt) -> int:
    """Run to the payload, pass the gate and write the release marker; the PID."""
    pid, verdict = run_to_payload(attempt)
    assert verdict.ok, verdict.failures
    release_marker(attempt)
    return pid


def await_finished(attempt: Attempt, timeout: float = 120.0) -> int:
    deadline = time.monotonic() + timeout
    while True:
        seen = attempt.call("observe")
        assert "error" not in seen, seen
        if seen["phase"] == "finished":
            return int(seen["exit_code"])
        assert time.monotonic() < deadline, f"the payload did not finish: {seen}"
        time.sleep(0.01)


def await_main_exit(attempt: Attempt, timeout: float = 60.0) -> int:
    """Wait until the service's main process (the wrapper around `podman run`) exits by
    itself, after the runtime's teardown: what the host's wind-down waits for. Podman's
    rootless pause process stays in the service until it is stopped."""
    assert attempt.handle is not None
    handle = attempt.handle
    deadline = time.monotonic() + timeout
    while (status := attempt.w.service.exit_status(handle)) is None:
        assert time.monotonic() < deadline, "the service's main process did not exit"
        time.sleep(0.02)
    return status


def cleanup(attempt: Attempt) -> bool:
    """Stop the service, confirm idle, release the provider, remove the layout."""
    idle = True
    if attempt.handle is not None:
        attempt.call("stop")
        attempt.w.service.stop(attempt.handle)
        idle = attempt.w.service.is_idle(attempt.handle, attempt.w.slot.uid)
        attempt.w.service.remove(attempt.handle)
        attempt.handle = None
    reply = attempt.call("release")
    assert reply == {"released": True}, reply
    if attempt.plan.streamed_inputs:
        attempt.stager.remove_attempt(attempt.id)  # type: ignore[attr-defined]
    layout.Layout(attempt.w.slot).remove(attempt.id)
    return idle


def run_to_payload(attempt: Attempt) -> tuple[int, gate.Verdict]:
    """prepare (if not yet) -> service -> start -> observe to payload -> gate."""
    if attempt.result is None:
        prepare(attempt)
    create_service(attempt)
    started = attempt.call("start")
    assert started == {"started": True}, started
    pid = await_payload(attempt)
    return pid, run_gate(attempt, pid)
