"""The runner against real parts: ledger, cgroups, slot account, provider, gate.

Everything is real: a ledger in a root-owned directory under /run, a slot on a real
directory with a real non-root slot account, the cgroupfs service with a base name
of its own, and the test provider built into a wheel, installed into a root-owned
prefix and loaded through the pinning loader (runtime `service`: its barrier is a
plain shell in the attempt's service). The provider appends one line per driver row
to a call log, which is how "start is never called again" is counted.

Waiting is always on a real condition with a deadline (`until`), never a sleep.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import json
import os
import secrets
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Coroutine, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any, NamedTuple

import msgspec
import pytest

from ficc.execution import plan as planlib
from ficc.execution.host.api import handlers
from ficc.execution.host.cli import provision
from ficc.execution.host.config.host import open_image_parent
from ficc.execution.host.config.model import Config
from ficc.execution.host.context.parts import HostContext, ProviderRuntime, SlotRuntime, Workers
from ficc.execution.host.core import lifecycle
from ficc.execution.host.core.errors import HostError
from ficc.execution.host.core.leases import Lease
from ficc.execution.host.gate import checks as gate
from ficc.execution.host.gate.expectation import decode_prepare_result
from ficc.execution.host.ledger.store import (
    Admitted,
    Applied,
    AttemptRecord,
    HostFacts,
    Ledger,
    PrepareRow,
    RecordedUsage,
    SlotSpec,
)
from ficc.execution.host.linux.clock import BootClock
from ficc.execution.host.providers import compute_digest, load_provider
from ficc.execution.host.providers import loader as loader_module
from ficc.execution.host.providers.loader import LoadedProvider
from ficc.execution.host.runner import batching, starting
from ficc.execution.host.runner.deadlines import Deadlines
from ficc.execution.host.runner.pipeline import RELEASE_MARKER, Runner, Settings
from ficc.execution.host.runner.starting import AFTER_EXIT_LOOKS
from ficc.execution.host.service import reaper
from ficc.execution.host.service.cgroupfs import CgroupfsService
from ficc.execution.host.service.interface import ServiceHandle
from ficc.execution.host.storage.layout import Layout, service_name
from ficc.execution.host.storage.slot_files import ReservedSlot
from ficc.execution.host.storage.staging import Stager
from ficc.execution.host.storage.streams import streams_of
from ficc.execution.protocol import Fence, OfferLimits, Renewal, RenewRequest, Resources, Sender
from ficc.execution.wire import AttemptRow, ErrorRow
from ficc_testkit import plans, wheels
from ficc_testkit.accounts import temporary_account
from lease_support import SteppedClock
from runner_support import running, until

pytestmark = pytest.mark.root(
    "the runner tests need root (cgroups, a slot account, root-owned installs)"
)

ROOT = Path(__file__).resolve().parents[4]
PROVIDER_SOURCE = ROOT / "tests-integration" / "providers" / "ficc-test-provider"
MODULE = "ficc_test_provider"
INSTALLATION = "1" * 32
SHA = "sha256:" + "a" * 64
BIG = 2**40
SLOT_BYTES = 256 << 20
SLOT_INODES = 10_000
HOLD = {"FICC_TEST_PROVIDER_HOLD": "1"}
MALFORMED = "FICC_TEST_PROVIDER_MALFORMED"
LATE = "FICC_TEST_PROVIDER_LATE"
HANG = "FICC_TEST_PROVIDER_HANG"
FAST = Settings(tick=0.05, provider_timeout=30.0, start_timeout=30.0, observe_interval=0.02)


# --- module fixtures: slot account, installed provider ------------------------------


@pytest.fixture(scope="module")
def slot_account() -> Iterator[tuple[int, int]]:
    """A system account of our own, so no other test's processes count against idle."""
    with temporary_account("ficc-t-r") as account:
        yield account.uid, account.gid


@dataclass
class Installed:
    loaded: LoadedProvider
    call_log: Path
    context_log: Path

    def calls(self, method: str, attempt_id: str) -> int:
        if not self.call_log.exists():
            return 0
        return self.call_log.read_text().splitlines().count(f"{method} {attempt_id}")

    def contexts(self, method: str, attempt_id: str) -> list[dict[str, Any]]:
        """The contexts the provider received for `method` rows of the attempt."""
        if not self.context_log.exists():
            return []
        records = map(json.loads, self.context_log.read_text().splitlines())
        return [
            r["context"]
            for r in records
            if r["method"] == method and r["context"].get("attempt_id") == attempt_id
        ]


@pytest.fixture(scope="module")
def provider(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Installed]:
    """The test provider as a real distribution in a root-owned prefix, loaded once
    through the pin (a provider can be imported only once per process)."""
    out = tmp_path_factory.mktemp("runner-wheel")
    site = wheels.install_into(wheels.build_wheel(PROVIDER_SOURCE, out), out / "prefix")
    call_log, context_log = out / "calls.log", out / "contexts.log"
    configuration = {
        "runtime": "service",
        "call_log": str(call_log),
        "context_log": str(context_log),
        "devices": {"null": "/dev/null"},
        "negative_devices": ["/dev/zero"],
    }
    digest = compute_digest("test", [str(site)]).digest
    loaded = load_provider("test", digest, configuration, [str(site)])
    try:
        yield Installed(loaded, call_log, context_log)
    finally:
        for name in [m for m in sys.modules if m == MODULE or m.startswith(MODULE + ".")]:
            del sys.modules[name]
        sys.meta_path[:] = [
            f for f in sys.meta_path if not isinstance(f, loader_module._PinnedFinder)
        ]


# --- the world of one test ------------------------------------------------------------


def offer_limits() -> OfferLimits:
    resources = Resources(**dict.fromkeys(Resources.__struct_fields__, BIG))
    return OfferLimits(resources, projects=None, runtimes=None)


def make_config(slot: Path, state: Path, uid: int, gid: int, filesystem_uuid: str) -> Config:
    allowance = {
        "cpu_millis": BIG, "memory_bytes": BIG, "swap_bytes": BIG, "processes": 4096,
        "slots": 4, "devices": ["null", "gpu"], "projects": ["2" * 32], "runtimes": ["test"],
    }  # fmt: skip
    return msgspec.convert(
        {
            "installation_id": INSTALLATION,
            "deployment_id": "3" * 32,
            "node_id": "4" * 32,
            "mode": "managed",
            "transport_uid": 65000,
            "local_owner_uids": [],
            "maximum_lease_seconds": 3600,
            "state_dir": str(state),
            "socket_dir": str(state.parent / "sockets"),
            "supervisor": "cgroupfs",
            "slots": [
                {
                    "id": "slot0",
                    "class": "cpu",
                    "generation": 1,
                    "path": str(slot),
                    "uid": uid,
                    "gid": gid,
                    "storage_bytes": SLOT_BYTES,
                    "storage_inodes": SLOT_INODES,
                    "filesystem_uuid": filesystem_uuid,
                }
            ],
            "ceiling": allowance,
            "initial_offer": {**allowance, "control": "active"},
            "providers": [{"id": "test", "package_digest": SHA, "configuration": {}}],
        },
        Config,
    )


class Terms(NamedTuple):
    """The lease terms of a renewal row."""

    sequence: int
    expires_at_ms: int


class World:
    """Ledger, slot, service backend and context of one test; torn down afterwards."""

    def __init__(self, installed: Installed, uid: int, gid: int) -> None:
        self.installed = installed
        self.uid, self.gid = uid, gid
        self.base = Path(tempfile.mkdtemp(prefix="ficc-runner-", dir="/run"))
        self.base.chmod(0o755)
        self.state = self.base / "state"
        self.state.mkdir(mode=0o700)
        self.slot = self.base / "slot0"
        made = provision.create_image_slot(
            str(self.base / "slot0.img"), str(self.slot), SLOT_BYTES, SLOT_INODES
        )
        self.filesystem_uuid = made.filesystem_uuid
        self.cgroup_base = f"ficc-t-run-{os.getpid()}-{secrets.token_hex(3)}"
        self.config = make_config(self.slot, self.state, uid, gid, self.filesystem_uuid)
        self.clock = BootClock()
        ledger = Ledger.create(str(self.state), INSTALLATION, offer_limits(), offer_limits())
        self.ctx = self._context(ledger)

    def _context(self, ledger: Ledger) -> HostContext:
        stager = Stager(str(self.slot), self.gid)
        slot = SlotRuntime(
            "slot0",
            "cpu",
            str(self.slot),
            self.uid,
            self.gid,
            SLOT_BYTES,
            SLOT_INODES,
            self.filesystem_uuid,
            stager,
            ReservedSlot(self.config.slots[0], open_image_parent),
        )
        digest = self.installed.loaded.verified.digest
        return HostContext(
            config=self.config,
            ledger=ledger,
            clock=self.clock,
            slots={"slot0": slot},
            providers={"test": ProviderRuntime("test", digest, self.installed.loaded, None)},
            service=CgroupfsService(self.cgroup_base, stop_timeout=15.0),
            workers=Workers(),
        )

    def restart(self) -> None:
        """A new daemon over the same ledger file and cgroup base (nothing in memory)."""
        self.ctx.ledger.close()
        self.ctx.workers.shutdown()
        self.ctx = self._context(Ledger.open(str(self.state), INSTALLATION))

    # -- attempts ------------------------------------------------------------------

    def plan(
        self,
        *,
        devices: tuple[str, ...] = ("null",),
        inputs: tuple[planlib.InputObject, ...] = (),
        environment: dict[str, str] | None = None,
        argv: tuple[str, ...] = ("/bin/true",),
        slot_class: str = "cpu",
    ) -> planlib.Plan:
        return plans.make_plan(
            argv=argv, environment=environment, slot_class=slot_class, devices=devices,
            inputs=inputs, package_digest=SHA, image_digest=SHA, deployment_id="3" * 32,
            node_id="4" * 32, project_id="2" * 32, cpu_millis=500,
        )  # fmt: skip

    def admit(self, plan: planlib.Plan, lease_seconds: float = 600.0) -> Fence:
        """What the prepare handler does before it calls `runner.admitted`."""
        now = self.clock.now()
        lease = Lease(now.boot_id, 1, 10**13, now.boottime_ns + int(lease_seconds * 1e9), 10**13)
        facts = HostFacts(
            slots=[SlotSpec("slot0", "cpu", SLOT_BYTES, 10**6)],
            devices=frozenset({"null", "gpu"}),
            ceiling=offer_limits(),
            now=now,
        )
        ledger = self.ctx.ledger
        (row,) = ledger.admit_batch(ledger.bindings(), [PrepareRow(plan, lease)], facts)
        assert isinstance(row, Admitted), row
        assert row.new
        self.ctx.slots["slot0"].stager.register_attempt(
            plan.attempt_id, streams_of(plan.job.inputs)
        )
        return row.record.fence

    def start(self, fence: Fence) -> None:
        """What the start handler does before it calls `runner.start_requested`."""
        (row,) = self.ctx.ledger.start_batch([fence], self.clock.now())
        assert isinstance(row, Applied), row
        assert row.changed

    def end_lease(self, fence: Fence) -> None:
        """A renewal whose expiry has passed: the controller ends the lease now. (Tests
        end leases this way instead of racing a short deadline.)"""
        rows = [(fence, Terms(sequence=2, expires_at_ms=1))]
        (row,) = self.ctx.ledger.renew_batch(rows, self.clock.now(), 3600)
        assert isinstance(row, Applied), row
        assert row.changed

    def record(self, attempt_id: str) -> AttemptRecord:
        record = self.ctx.ledger.get(attempt_id)
        assert record is not None
        return record

    def service_name(self, attempt_id: str) -> str:
        return service_name(INSTALLATION, attempt_id)

    def attempt_dir(self, attempt_id: str) -> Path:
        return Path(Layout(self.ctx.slots["slot0"]).attempt_dir(attempt_id))

    # -- teardown ------------------------------------------------------------------

    def close(self) -> None:
        service = self.ctx.service
        assert isinstance(service, CgroupfsService)
        try:
            for hierarchy in service.layout.hierarchies:
                top = Path(hierarchy.mount, self.cgroup_base)
                if not top.is_dir():
                    continue
                for entry in top.iterdir():
                    handle = service.adopt(entry.name)
                    if handle is not None:
                        service.stop(handle)
                        service.remove(handle)
                top.rmdir()
        finally:
            with contextlib.suppress(Exception):
                self.ctx.ledger.close()
            self.ctx.workers.shutdown()
            provision.remove_slot(str(self.slot))
            shutil.rmtree(self.base)


@pytest.fixture
def world(provider: Installed, slot_account: tuple[int, int]) -> Iterator[World]:
    built = World(provider, *slot_account)
    try:
        yield built
    finally:
        built.close()


# --- helpers ---------------------------------------------------------------------------


def state_of(world: World, attempt_id: str) -> Callable[[], bool]:
    return lambda: (
        world.record(attempt_id).status.state != "prepared" or world.record(attempt_id).status.ready
    )


async def ready(world: World, runner: Runner, fence: Fence) -> None:
    """Hand the admitted attempt to the runner and wait until it is prepared and ready."""
    runner.admitted([fence.attempt_id])
    await until(state_of(world, fence.attempt_id), "ready")


async def ready_and_started(world: World, runner: Runner, fence: Fence) -> None:
    """`ready`, then the start as the handler records it and hands it to the runner."""
    await ready(world, runner, fence)
    world.start(fence)
    runner.start_requested([fence.attempt_id])


def settled_and_clean(world: World, attempt_id: str) -> Callable[[], bool]:
    def check() -> bool:
        status = world.record(attempt_id).status
        return status.state in lifecycle.SETTLED and status.cleanup_confirmed

    return check


def service_idle(world: World, attempt_id: str) -> bool:
    service = world.ctx.service
    handle = service.adopt(world.service_name(attempt_id))
    if handle is None:
        return service.account_idle(world.uid)
    return service.is_idle(handle, world.uid)


# --- prepare ---------------------------------------------------------------------------


def test_prepare_without_streams_reaches_ready_with_a_persisted_checked_result(
    world: World,
) -> None:
    plan = world.plan()
    fence = world.admit(plan)

    async def scenario() -> None:
        runner = Runner(world.ctx, settings=FAST)
        runner.admitted([fence.attempt_id])
        await until(state_of(world, fence.attempt_id), "prepare finished")
        await runner.close()

    asyncio.run(scenario())
    status = world.record(fence.attempt_id).status
    assert (status.state, status.ready, status.preparing) == ("prepared", True, False)
    data = world.ctx.ledger.prepare_result(fence.attempt_id)
    assert data is not None
    result = decode_prepare_result(msgspec.json.decode(data))
    assert result.barrier.path == os.path.realpath("/bin/sh")
    assert [(d.name, d.path, d.major, d.minor) for d in result.devices] == [
        ("null", "/dev/null", 1, 3)
    ]
    assert (result.positive_devices, result.negative_devices) == (["/dev/null"], ["/dev/zero"])
    attempt = world.attempt_dir(fence.attempt_id)
    assert (attempt / "storage").stat().st_uid == world.uid
    assert world.installed.calls("probe", fence.attempt_id) == 1
    assert world.installed.calls("prepare", fence.attempt_id) == 1


def test_prepare_waits_for_streamed_inputs_then_runs_by_itself(world: World) -> None:
    data = b"streamed input bytes"
    stream = planlib.InputObject(
        id=secrets.token_hex(16),
        name="data.bin",
        bytes=len(data),
        digest=planlib.digest_of(data),
        delivery="stream",
    )
    plan = world.plan(inputs=(stream,))
    fence = world.admit(plan)
    stager = world.ctx.slots["slot0"].stager

    async def scenario() -> None:
        runner = Runner(world.ctx, settings=FAST)
        runner.admitted([fence.attempt_id])
        # Staging initialised (status answers), provider not called: inputs incomplete.
        await until(lambda: _staged(stager, fence.attempt_id, stream.id), "staging is ready")
        assert world.installed.calls("prepare", fence.attempt_id) == 0
        assert not world.record(fence.attempt_id).status.ready

        def commit(state: Any) -> None:
            world.ctx.ledger.commit_stream(fence, state, 0)

        chunk = planlib.digest_of(data)
        await world.ctx.workers.io(
            stager.write, fence.attempt_id, stream.id, 0, data, chunk, commit=commit
        )
        runner.inputs_complete(fence.attempt_id)
        await until(state_of(world, fence.attempt_id), "prepare finished")
        await runner.close()

    asyncio.run(scenario())
    status = world.record(fence.attempt_id).status
    assert (status.state, status.ready) == ("prepared", True)
    assert world.installed.calls("prepare", fence.attempt_id) == 1


def _write_stream(world: World, fence: Fence, data: bytes) -> planlib.InputObject:
    """Upload a streamed input completely, as the input_write handler does."""
    plan = planlib.decode_plan(world.ctx.ledger.plan_bytes(fence.attempt_id) or b"")
    (stream,) = plan.streamed_inputs
    stager = world.ctx.slots["slot0"].stager
    stager.write(
        fence.attempt_id,
        stream.id,
        0,
        data,
        planlib.digest_of(data),
        commit=lambda state: world.ctx.ledger.commit_stream(fence, state, 0),
    )
    return stream


def test_a_staged_input_changed_after_preparation_refuses_start(world: World) -> None:
    data = b"input that will be tampered with"
    stream = planlib.InputObject(
        id=secrets.token_hex(16),
        name="data.bin",
        bytes=len(data),
        digest=planlib.digest_of(data),
        delivery="stream",
    )
    fence = world.admit(world.plan(inputs=(stream,)))
    attempt_id = fence.attempt_id
    stager = world.ctx.slots["slot0"].stager

    async def scenario() -> None:
        async with running(Runner(world.ctx, settings=FAST)) as runner:
            runner.admitted([attempt_id])
            await until(lambda: _staged(stager, attempt_id, stream.id), "staging is ready")
            await world.ctx.workers.io(_write_stream, world, fence, data)
            runner.inputs_complete(attempt_id)
            await until(state_of(world, attempt_id), "ready")
            staged = world.slot / "ficc-staging" / attempt_id / stream.id
            os.utime(staged, ns=(0, 0))  # same bytes, another mtime: not the recorded file
            world.start(fence)
            runner.start_requested([attempt_id])
            await until(settled_and_clean(world, attempt_id), "refused and cleaned")

    asyncio.run(scenario())
    status = world.record(attempt_id).status
    assert (status.state, status.reason) == ("failed", "input_changed")
    assert world.ctx.service.adopt(world.service_name(attempt_id)) is None  # never created
    assert world.installed.calls("start", attempt_id) == 0


def test_a_check_refusal_during_prepare_is_recorded_as_its_own_code(world: World) -> None:
    fence = world.admit(world.plan())
    world.end_lease(fence)

    async def scenario() -> None:
        runner = Runner(world.ctx, settings=FAST)  # no monitor: check() must see it
        runner.admitted([fence.attempt_id])
        await until(state_of(world, fence.attempt_id), "prepare finished")
        await runner.close()

    asyncio.run(scenario())
    status = world.record(fence.attempt_id).status
    assert (status.state, status.reason) == ("failed", "lease_expired")
    assert world.installed.calls("prepare", fence.attempt_id) == 1


def _staged(stager: Stager, attempt_id: str, object_id: str) -> bool:
    try:
        stager.status(attempt_id, object_id)
    except Exception:
        return False
    return True


def test_provider_prepare_failure_fails_the_attempt_then_cleanup_is_confirmed(
    world: World,
) -> None:
    plan = world.plan(devices=("gpu",))  # admitted, but the provider maps no "gpu" node
    fence = world.admit(plan)

    async def scenario() -> None:
        async with running(Runner(world.ctx, settings=FAST)) as runner:
            runner.admitted([fence.attempt_id])
            await until(settled_and_clean(world, fence.attempt_id), "failed and cleaned")

    asyncio.run(scenario())
    status = world.record(fence.attempt_id).status
    assert (status.state, status.outcome, status.reason) == ("failed", "failed", "provider_failed")
    assert status.cleanup_confirmed
    assert not status.quarantined


class _Respawner:
    """A root thread outside the host's reach that starts a process of the slot account
    again each time the last one dies: the account cannot be made idle while it runs."""

    def __init__(self, uid: int, gid: int) -> None:
        self.uid, self.gid = uid, gid
        self.stopping = threading.Event()
        self.spawned = 0
        self.child: subprocess.Popen[bytes] | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self.stopping.is_set():
            # The account's IDs are taken in the forked child before exec, so the
            # replacement runs as the account within moments of the last one's death.
            self.child = subprocess.Popen(
                ["/bin/sleep", "1000"], stdin=subprocess.DEVNULL,
                user=self.uid, group=self.gid, extra_groups=[],
            )  # fmt: skip
            self.spawned += 1
            self.child.wait()

    def __enter__(self) -> _Respawner:
        self.thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.stop()

    def stop(self) -> None:
        self.stopping.set()
        if self.child is not None:
            self.child.kill()
        self.thread.join(10)


def test_cleanup_kills_a_stray_process_of_the_slot_account(world: World) -> None:
    """A process of the slot account outside any service (a provider command's
    leftover) is killed by cleanup, which then confirms the slot idle."""
    stray = subprocess.Popen(
        ["setpriv", f"--reuid={world.uid}", f"--regid={world.gid}", "--clear-groups",
         "sleep", "1000"],
        stdin=subprocess.DEVNULL,
    )  # fmt: skip
    fence = world.admit(world.plan(devices=("gpu",)))  # fails in provider prepare

    async def scenario() -> None:
        await until(lambda: _runs_as(stray.pid, world.uid), "the stray process runs")
        async with running(Runner(world.ctx, settings=FAST)) as runner:
            runner.admitted([fence.attempt_id])
            await until(settled_and_clean(world, fence.attempt_id), "cleanup confirmed")

    try:
        asyncio.run(scenario())
        assert stray.wait(timeout=10) == -signal.SIGKILL
    finally:
        stray.kill()
        stray.wait()
    status = world.record(fence.attempt_id).status
    assert (status.cleanup_confirmed, status.quarantined) == (True, False)


def test_unconfirmed_cleanup_quarantines_and_is_retried_until_idle(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A slot account that runs again however often it is killed keeps the slot from
    being idle: the attempt is quarantined, and cleanup is retried until it is."""
    monkeypatch.setattr(world.ctx.service, "_stop_timeout", 0.5)
    fence = world.admit(world.plan(devices=("gpu",)))  # fails in provider prepare
    attempt_id = fence.attempt_id

    async def scenario() -> None:
        with _Respawner(world.uid, world.gid) as respawner:
            await until(lambda: respawner.spawned >= 1, "the first stray process")
            async with running(Runner(world.ctx, settings=FAST)) as runner:
                runner.admitted([attempt_id])
                await until(lambda: world.record(attempt_id).status.quarantined, "quarantined")
                assert not world.record(attempt_id).status.cleanup_confirmed
                assert respawner.spawned > 1  # cleanup killed what it found
                respawner.stop()
                await until(settled_and_clean(world, attempt_id), "cleanup confirmed")

    asyncio.run(scenario())
    status = world.record(attempt_id).status
    assert (status.state, status.cleanup_confirmed, status.quarantined) == ("failed", True, False)


def _runs_as(pid: int, uid: int) -> bool:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    uids = next(line for line in status.splitlines() if line.startswith("Uid:")).split()[1:]
    return uids == [str(uid)] * 4


# --- start and the gate -------------------------------------------------------------------


def test_gate_refuses_the_unconfined_test_provider_and_never_releases_the_payload(
    world: World,
) -> None:
    """The required end-to-end pipeline test."""
    plan = world.plan()
    fence = world.admit(plan)
    attempt_id = fence.attempt_id

    async def scenario() -> None:
        async with running(Runner(world.ctx, settings=FAST)) as runner:
            await ready_and_started(world, runner, fence)
            runner.start_requested([attempt_id])  # a second start is ignored
            await until(settled_and_clean(world, attempt_id), "refused and cleaned")

    asyncio.run(scenario())
    status = world.record(attempt_id).status
    assert (status.state, status.outcome) == ("failed", "failed")
    assert status.reason is not None
    assert status.reason.startswith("gate_"), status.reason
    attempt = world.attempt_dir(attempt_id)
    evidence = attempt / "evidence" / gate.EVIDENCE_FILE
    recorded = msgspec.json.decode(evidence.read_bytes())
    assert recorded["status"]["uid"]["real"] == world.uid  # the barrier ran as the slot
    assert not (attempt / "control" / RELEASE_MARKER).exists()
    # The closed device policy was real: the prepared node opened, the other was refused.
    devices = (attempt / "storage" / ".ficc-test-provider" / "devices").read_text().split("\n")
    assert "1 /dev/null" in devices
    assert "0 /dev/zero" in devices
    assert service_idle(world, attempt_id)
    assert world.installed.calls("start", attempt_id) == 1


def test_release_after_a_refused_start_removes_layout_and_service(world: World) -> None:
    plan = world.plan()
    fence = world.admit(plan)
    attempt_id = fence.attempt_id

    async def scenario() -> None:
        async with running(Runner(world.ctx, settings=FAST)) as runner:
            await ready_and_started(world, runner, fence)
            await until(settled_and_clean(world, attempt_id), "refused and cleaned")
            await runner.release(attempt_id)

    asyncio.run(scenario())
    world.ctx.ledger.apply(fence, lifecycle.Release())
    assert not world.attempt_dir(attempt_id).exists()
    assert world.ctx.service.adopt(world.service_name(attempt_id)) is None
    assert world.installed.calls("release", attempt_id) == 1
    status = world.record(attempt_id).status
    assert (status.state, status.outcome) == ("released", "failed")


# --- stops and leases -----------------------------------------------------------------------


def _held_attempt(world: World) -> Fence:
    """An attempt whose barrier reports no PID: it stays `starting` until stopped."""
    return world.admit(world.plan(environment=HOLD))


def _barrier_waiting(world: World, attempt_id: str) -> Callable[[], bool]:
    """The barrier runs (it reported its device opens) and the start pipeline has
    called provider start and is observing (observe only follows start)."""
    devices = world.attempt_dir(attempt_id) / "storage" / ".ficc-test-provider" / "devices"
    return lambda: devices.exists() and world.installed.calls("observe", attempt_id) > 0


def test_lease_expiry_during_start_stops_the_service_and_records_expired(world: World) -> None:
    fence = _held_attempt(world)
    attempt_id = fence.attempt_id

    async def scenario() -> None:
        async with running(Runner(world.ctx, settings=FAST)) as runner:
            await ready_and_started(world, runner, fence)
            await until(_barrier_waiting(world, attempt_id), "the barrier runs")
            assert world.record(attempt_id).status.state == "starting"
            world.end_lease(fence)
            await until(settled_and_clean(world, attempt_id), "expired and cleaned")

    asyncio.run(scenario())
    status = world.record(attempt_id).status
    assert (status.state, status.outcome, status.reason) == ("expired", "expired", "lease_expired")
    assert service_idle(world, attempt_id)
    assert not (world.attempt_dir(attempt_id) / "control" / RELEASE_MARKER).exists()


def test_stop_during_start_cancels_and_confirms_cleanup(world: World) -> None:
    fence = _held_attempt(world)
    attempt_id = fence.attempt_id

    async def scenario() -> None:
        async with running(Runner(world.ctx, settings=FAST)) as runner:
            await ready_and_started(world, runner, fence)
            await until(_barrier_waiting(world, attempt_id), "the barrier runs")
            applied = world.ctx.ledger.apply(fence, lifecycle.StopRequested())
            assert applied.record.status.stop_pending == "cancelled"
            runner.stop_requested([attempt_id])
            await until(settled_and_clean(world, attempt_id), "cancelled and cleaned")

    asyncio.run(scenario())
    status = world.record(attempt_id).status
    assert (status.state, status.outcome) == ("cancelled", "cancelled")
    assert service_idle(world, attempt_id)


# --- running attempts ---------------------------------------------------------------------
#
# The test provider can never pass the gate, so a `running` attempt is made the only
# other way there is: the start pipeline of a held attempt is interrupted (as a dying
# daemon would), and the test records `Started` and writes the release marker itself,
# standing in for a passed gate. A fresh runner then takes over the live service.


def _released_by_hand(world: World, fence: Fence) -> dict[str, ServiceHandle]:
    """Start the payload with one runner, release it by hand (the test provider does not
    pass the gate); the runner's service handles are returned to hand to the next one."""
    attempt_id = fence.attempt_id
    handles: dict[str, ServiceHandle] = {}

    async def interrupted_start() -> None:
        runner = Runner(world.ctx, settings=FAST)
        await ready_and_started(world, runner, fence)
        await until(_barrier_waiting(world, attempt_id), "the barrier runs")
        handles.update(runner._handles)
        await runner.close()

    asyncio.run(interrupted_start())
    world.ctx.ledger.apply(fence, lifecycle.Started())
    attempt = world.attempt_dir(attempt_id)
    control = os.open(attempt / "control", os.O_RDONLY | os.O_DIRECTORY)
    try:
        gate.write_release_marker(control, RELEASE_MARKER, group=world.gid)
    finally:
        os.close(control)
    (attempt / "storage" / ".ficc-test-provider" / "go").touch()
    return handles


def test_monitor_records_the_payload_exit_code_and_confirms_cleanup(world: World) -> None:
    fence = world.admit(world.plan(environment=HOLD, argv=("/bin/sh", "-c", "exit 3")))
    _released_by_hand(world, fence)

    async def monitor() -> None:
        async with running(Runner(world.ctx, settings=FAST)):
            await until(settled_and_clean(world, fence.attempt_id), "finished and cleaned")

    asyncio.run(monitor())
    status = world.record(fence.attempt_id).status
    assert (status.state, status.outcome, status.exit_code) == ("failed", "failed", 3)
    assert status.reason == "exited"
    assert service_idle(world, fence.attempt_id)
    assert world.installed.calls("start", fence.attempt_id) == 1


def test_the_service_of_a_payload_that_exited_is_left_to_end_by_itself(world: World) -> None:
    """The runtime tears down after the exit was reported (Podman removing the
    container): cleanup waits for the service's main process instead of killing it."""
    teardown = {**HOLD, "FICC_TEST_PROVIDER_TEARDOWN": "teardown"}
    fence = world.admit(world.plan(environment=teardown, argv=("/bin/sh", "-c", "exit 3")))
    handles = _released_by_hand(world, fence)

    async def monitor() -> None:
        runner = Runner(world.ctx, settings=FAST)
        runner._handles.update(handles)  # the main process is known, as in one daemon
        async with running(runner):
            await until(settled_and_clean(world, fence.attempt_id), "finished and cleaned")

    asyncio.run(monitor())
    status = world.record(fence.attempt_id).status
    assert (status.state, status.exit_code) == ("failed", 3)
    storage = world.attempt_dir(fence.attempt_id) / "storage" / ".ficc-test-provider"
    assert (storage / "torn-down").exists()
    assert service_idle(world, fence.attempt_id)


def test_a_teardown_that_outlasts_the_wind_down_is_stopped(world: World) -> None:
    stuck = {**HOLD, "FICC_TEST_PROVIDER_TEARDOWN": "stuck"}
    fence = world.admit(world.plan(environment=stuck, argv=("/bin/sh", "-c", "exit 0")))
    handles = _released_by_hand(world, fence)
    short = Settings(tick=0.05, provider_timeout=30.0, start_timeout=30.0, wind_down=0.5)

    async def monitor() -> None:
        runner = Runner(world.ctx, settings=short)
        runner._handles.update(handles)
        async with running(runner):
            await until(settled_and_clean(world, fence.attempt_id), "finished and cleaned")

    asyncio.run(monitor())
    status = world.record(fence.attempt_id).status
    assert (status.state, status.exit_code) == ("succeeded", 0)
    assert service_idle(world, fence.attempt_id)


def test_lease_expiry_while_running_stops_the_payload(world: World) -> None:
    fence = world.admit(world.plan(environment=HOLD, argv=("/bin/sleep", "1000")))
    _released_by_hand(world, fence)
    pid = world.attempt_dir(fence.attempt_id) / "storage" / ".ficc-test-provider" / "pid"

    async def monitor() -> None:
        async with running(Runner(world.ctx, settings=FAST)):
            await until(pid.exists, "the payload runs")
            assert world.record(fence.attempt_id).status.state == "running"
            world.end_lease(fence)
            await until(settled_and_clean(world, fence.attempt_id), "expired and cleaned")

    asyncio.run(monitor())
    status = world.record(fence.attempt_id).status
    assert (status.state, status.outcome, status.exit_code) == ("expired", "expired", None)
    assert service_idle(world, fence.attempt_id)


def test_a_payload_that_vanishes_without_an_exit_report_is_unknown(world: World) -> None:
    fence = world.admit(world.plan(environment=HOLD, argv=("/bin/sleep", "1000")))
    _released_by_hand(world, fence)
    attempt_id = fence.attempt_id
    service = world.ctx.service

    async def monitor() -> None:
        async with running(Runner(world.ctx, settings=FAST)):
            pid = world.attempt_dir(attempt_id) / "storage" / ".ficc-test-provider" / "pid"
            await until(pid.exists, "the barrier reported its PID")
            handle = service.adopt(world.service_name(attempt_id))
            assert handle is not None
            await world.ctx.workers.io(service.stop, handle)  # killed behind our back
            await until(settled_and_clean(world, attempt_id), "unknown and cleaned")

    asyncio.run(monitor())
    status = world.record(attempt_id).status
    assert (status.state, status.outcome, status.reason) == (
        "unknown",
        "unknown",
        "outcome_unreadable",
    )
    assert status.exit_code is None
    assert world.installed.calls("start", attempt_id) == 1


def test_a_payload_that_ends_while_the_provider_answers_keeps_its_exit_code(
    world: World,
) -> None:
    """The provider looks, finds no exit report, and before its reply reaches the
    runner the payload ends and its service empties. The exit report was written inside
    the service, so the next look reads it: the outcome is the exit code, not unknown."""
    payload = ("/bin/sh", "-c", "while [ ! -e end ]; do sleep 0.02; done; exit 3")
    fence = world.admit(world.plan(environment={**HOLD, LATE: "1"}, argv=payload))
    _released_by_hand(world, fence)
    attempt_id = fence.attempt_id
    storage = world.attempt_dir(attempt_id) / "storage"
    status_dir = storage / ".ficc-test-provider"
    service = world.ctx.service

    async def monitor() -> None:
        async with running(Runner(world.ctx, settings=FAST)):
            await until((status_dir / "observing").exists, "the provider found no exit")
            (storage / "end").touch()
            handle = service.adopt(world.service_name(attempt_id))
            assert handle is not None
            await until(lambda: not service.members(handle), "the service is empty")
            assert (status_dir / "exit").read_text() == "3\n"
            (status_dir / "answer").touch()
            await until(settled_and_clean(world, attempt_id), "finished and cleaned")

    asyncio.run(monitor())
    status = world.record(attempt_id).status
    assert (status.state, status.reason, status.exit_code) == ("failed", "exited", 3)
    assert world.installed.calls("start", attempt_id) == 1


def test_a_service_emptied_by_the_lease_reaper_at_the_deadline_is_expired_not_unknown(
    world: World,
) -> None:
    """The tick decided to observe while the lease was current; the deadline passes and
    the lease reaper kills the service before the runner looks at it. An empty service
    and no exit report then prove nothing about the payload: the expiry is recorded."""
    fence = world.admit(world.plan(environment=HOLD, argv=("/bin/sleep", "1000")))
    _released_by_hand(world, fence)
    attempt_id = fence.attempt_id
    service = world.ctx.service
    name = world.service_name(attempt_id)
    occupied = service.occupied
    armed, fired = threading.Event(), threading.Event()

    def reaped_first(handle: Any) -> bool:
        if armed.is_set() and not fired.is_set() and handle.name == name:
            fired.set()
            world.ctx.workers.db_blocking(world.end_lease, fence)
            for top in service.planned_cgroups(name):
                reaper.kill_tree(top)
            asyncio.run(until(lambda: not occupied(handle), "the reaper emptied the service"))
        return occupied(handle)

    service.occupied = reaped_first  # type: ignore[method-assign]
    pid = world.attempt_dir(attempt_id) / "storage" / ".ficc-test-provider" / "pid"

    async def monitor() -> None:
        async with running(Runner(world.ctx, settings=FAST)):
            await until(pid.exists, "the payload runs")
            armed.set()
            await until(settled_and_clean(world, attempt_id), "expired and cleaned")

    try:
        asyncio.run(monitor())
    finally:
        del service.occupied
    status = world.record(attempt_id).status
    assert fired.is_set()
    assert (status.state, status.reason, status.exit_code) == ("expired", "lease_expired", None)


def _ended_before_the_runner_looked(world: World, code: int, *, leftover: bool = False) -> Fence:
    """A running attempt whose payload already exited with `code` (its exit report
    written) while no runner was watching; its service is empty, or with `leftover`
    still has a process the payload left behind."""
    script = f"sleep 1000 & exit {code}" if leftover else f"exit {code}"
    fence = world.admit(world.plan(environment=HOLD, argv=("/bin/sh", "-c", script)))
    _released_by_hand(world, fence)
    status_dir = world.attempt_dir(fence.attempt_id) / "storage" / ".ficc-test-provider"
    handle = world.ctx.service.adopt(world.service_name(fence.attempt_id))
    assert handle is not None

    def ended() -> bool:
        members = world.ctx.service.members(handle)
        return (status_dir / "exit").exists() and bool(members) == leftover

    asyncio.run(until(ended, "the payload exited (its service as expected)"))
    return fence


def _settle(world: World, attempt_id: str) -> lifecycle.Status:
    async def monitor() -> None:
        async with running(Runner(world.ctx, settings=FAST)):
            await until(settled_and_clean(world, attempt_id), "settled and cleaned")

    asyncio.run(monitor())
    return world.record(attempt_id).status


def test_an_unverifiable_storage_binding_is_never_handed_to_observe_stop_or_release(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Once the storage binding of a running attempt can no longer be verified (as for
    probe, prepare and start), no provider call gets it: the outcome is lost
    (`storage_unverified`), the service is stopped without the provider's stop, and
    the release is refused (`layout_unsafe`, the reservation kept) until it verifies."""
    fence = world.admit(world.plan(environment=HOLD, argv=("/bin/sleep", "1000")))
    _released_by_hand(world, fence)
    attempt_id = fence.attempt_id
    calls = {m: world.installed.calls(m, attempt_id) for m in ("observe", "stop", "release")}
    files = world.ctx.slots["slot0"].files

    def unverifiable(attempt_id: str, limits: Any) -> Any:
        raise HostError("storage_unverified", "not on the slot's reserved filesystem")

    monkeypatch.setattr(files, "storage_binding", unverifiable)

    async def scenario() -> list[HostError | None]:
        async with running(Runner(world.ctx, settings=FAST)) as runner:
            await until(settled_and_clean(world, attempt_id), "settled and cleaned")
            refused = await runner.release_batch([attempt_id])
            assert world.installed.calls("release", attempt_id) == calls["release"]
            monkeypatch.undo()
            return [*refused, *await runner.release_batch([attempt_id])]

    refused, released = asyncio.run(scenario())
    status = world.record(attempt_id).status
    assert (status.state, status.reason) == ("unknown", "storage_unverified")
    assert world.installed.calls("observe", attempt_id) == calls["observe"]
    assert world.installed.calls("stop", attempt_id) == calls["stop"]
    assert isinstance(refused, HostError)
    assert refused.code == "layout_unsafe"
    assert released is None
    assert world.installed.calls("release", attempt_id) == calls["release"] + 1


def test_a_stop_after_the_payload_ended_by_itself_keeps_its_exit_code(world: World) -> None:
    fence = _ended_before_the_runner_looked(world, 3)
    world.ctx.ledger.apply(fence, lifecycle.StopRequested())
    status = _settle(world, fence.attempt_id)
    assert (status.state, status.reason, status.exit_code) == ("failed", "exited", 3)


def test_a_stop_right_after_the_payload_ended_keeps_its_exit_while_the_service_runs(
    world: World,
) -> None:
    """The gated process ended and its exit is reported, but the service still has a
    process (as while Podman tears a container down): a stop in the moments after the
    end looks once before it kills, and the payload keeps its exit."""
    fence = _ended_before_the_runner_looked(world, 3, leftover=True)
    world.ctx.ledger.apply(fence, lifecycle.StopRequested())

    async def stop() -> None:
        runner = Runner(world.ctx, settings=FAST)  # its monitor loop is not running
        runner._starter._payload_ended.add(fence.attempt_id)  # as its pidfd watch does
        record = world.record(fence.attempt_id)
        await runner.stop(record)
        await runner.close()

    asyncio.run(stop())
    status = _settle(world, fence.attempt_id)
    assert (status.state, status.reason, status.exit_code) == ("failed", "exited", 3)


def test_a_deadline_passed_after_the_payload_ended_by_itself_keeps_its_exit_code(
    world: World,
) -> None:
    fence = _ended_before_the_runner_looked(world, 0)
    world.end_lease(fence)
    status = _settle(world, fence.attempt_id)
    assert (status.state, status.reason, status.exit_code) == ("succeeded", "exited", 0)


def _alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie, which the daemon has not waited for yet, does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"


def test_an_exit_report_caused_by_the_daemons_own_kill_is_never_taken_for_an_exit(
    world: World,
) -> None:
    """The first stop kills the payload but its barrier (here held stopped) survives, so
    the stop is retried on a later tick. Meanwhile the barrier reports the payload's
    death by SIGKILL as an exit (137) and leaves an empty service: that report is the
    daemon's own doing, and the attempt stays `cancelled`."""
    fence = world.admit(world.plan(environment=HOLD, argv=("/bin/sleep", "1000")))
    _released_by_hand(world, fence)
    attempt_id = fence.attempt_id
    status_dir = world.attempt_dir(attempt_id) / "storage" / ".ficc-test-provider"
    asyncio.run(until((status_dir / "pid").exists, "the barrier reported its PID"))
    barrier = int((status_dir / "pid").read_text())
    children = Path(f"/proc/{barrier}/task/{barrier}/children")
    asyncio.run(until(lambda: children.read_text().strip(), "the payload runs"))
    service = world.ctx.service
    stop, members = service.stop, service.members
    stops: list[str] = []
    looks_after_the_first_stop = 0

    def first_stop_leaves_the_barrier(handle: Any) -> None:
        if stops:
            stop(handle)
            return
        stops.append(handle.name)
        os.kill(barrier, signal.SIGSTOP)
        for child in children.read_text().split():
            os.kill(int(child), signal.SIGKILL)

    def barrier_reports_on_the_second_look(handle: Any) -> set[int]:
        nonlocal looks_after_the_first_stop
        if stops:
            looks_after_the_first_stop += 1
            if looks_after_the_first_stop == 2:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(barrier, signal.SIGCONT)

                def ended() -> bool:
                    exited = (status_dir / "exit").exists() or not _alive(barrier)
                    return exited and not members(handle)

                asyncio.run(until(ended, "the barrier is gone"))
        return members(handle)

    service.stop = first_stop_leaves_the_barrier  # type: ignore[method-assign]
    service.members = barrier_reports_on_the_second_look  # type: ignore[method-assign]
    world.ctx.ledger.apply(fence, lifecycle.StopRequested())
    try:
        status = _settle(world, attempt_id)
    finally:
        del service.stop, service.members
    assert len(stops) == 1
    assert (status.state, status.reason, status.exit_code) == ("cancelled", "stopped", None)


def test_a_payload_whose_observe_hangs_past_its_timeout_is_stopped_at_once(
    world: World,
) -> None:
    """The outcome is `unknown` at the timeout, and the payload is stopped then, not at
    its lease deadline, although the hung call still runs; cleanup is confirmed only
    once that call returned."""
    environment = {**HOLD, HANG: "observe:hold"}
    fence = world.admit(world.plan(environment=environment, argv=("/bin/sleep", "1000")))
    _released_by_hand(world, fence)
    attempt_id = fence.attempt_id
    service = world.ctx.service

    async def stopped() -> None:
        handle = service.adopt(world.service_name(attempt_id))
        assert handle is not None
        await until(lambda: not service.members(handle), "the payload was stopped")

    state = "unknown"
    status = _cleaned_only_after_the_held_observe(world, attempt_id, state, stopped)
    assert (status.state, status.reason) == ("unknown", "provider_timeout")


@pytest.mark.parametrize("method", ["probe", "prepare"])
def test_a_preparation_whose_provider_call_hangs_past_its_timeout_fails_it(
    world: World, method: str
) -> None:
    """A probe or prepare row held past the provider timeout fails the attempt
    `provider_timeout` at the timeout (nothing ran: no replay, no start); its cleanup
    is confirmed only once the held call returned."""
    fence = world.admit(world.plan(environment={HANG: f"{method}:hold"}))
    attempt_id = fence.attempt_id
    storage = world.attempt_dir(attempt_id) / "storage"
    short = Settings(tick=0.05, provider_timeout=0.5, start_timeout=30.0)

    async def scenario() -> None:
        async with running(Runner(world.ctx, settings=short)) as runner:
            runner.admitted([attempt_id])
            await until(lambda: world.record(attempt_id).status.state == "failed", "failed")
            assert (storage / f"held-{method}").exists()
            assert not world.record(attempt_id).status.cleanup_confirmed
            (storage / f"go-{method}").touch()
            await until(settled_and_clean(world, attempt_id), "cleaned after the call returned")
            assert await runner.release_batch([attempt_id]) == [None]

    asyncio.run(scenario())
    status = world.record(attempt_id).status
    assert (status.state, status.reason) == ("failed", "provider_timeout")
    assert world.installed.calls("start", attempt_id) == 0


def test_a_release_whose_provider_call_hangs_past_its_timeout_keeps_the_reservation(
    world: World,
) -> None:
    """The release row takes longer than the provider timeout: the release is refused
    `provider_timeout` (the handler then keeps the reservation). Once the call has
    returned, the same release with a provider that answers in time goes through."""
    fence = world.admit(world.plan(environment={HANG: "release:1"}))
    attempt_id = fence.attempt_id
    short = Settings(tick=0.05, provider_timeout=0.5, start_timeout=30.0)
    patient = Settings(tick=0.05, provider_timeout=30.0, start_timeout=30.0)

    async def scenario() -> tuple[list[HostError | None], list[HostError | None]]:
        async with running(Runner(world.ctx, settings=short)) as runner:
            await ready(world, runner, fence)
            world.ctx.ledger.apply(fence, lifecycle.StopRequested())
            runner.stop_requested([attempt_id])
            await until(settled_and_clean(world, attempt_id), "cancelled and cleaned")
            timed_out = await runner.release_batch([attempt_id])
            batcher = runner._batcher
            await until(lambda: not batcher.in_flight.running(attempt_id), "the call returned")
        async with running(Runner(world.ctx, settings=patient)) as runner:
            return timed_out, await runner.release_batch([attempt_id])

    timed_out, released = asyncio.run(scenario())
    (refusal,) = timed_out
    assert isinstance(refusal, HostError)
    assert refusal.code == "provider_timeout"
    assert released == [None]
    assert world.installed.calls("release", attempt_id) == 2


@pytest.mark.parametrize("contradicted", ["/dev/null", "/dev/zero"])
def test_a_device_open_result_contradicting_the_prepared_devices_never_releases(
    world: World, monkeypatch: pytest.MonkeyPatch, contradicted: str
) -> None:
    """The runner's device-open results, as the start pipeline reads them from observe,
    say the prepared positive device was refused (or the negative one opened): the
    start fails `gate_device` and the payload is never released."""
    fence = world.admit(world.plan(devices=("null",)))
    observation = starting.observation_of

    def contradicting(result: Any) -> Any:
        seen = observation(result)
        if seen.devices is None:
            return seen
        devices = [
            msgspec.structs.replace(d, opened=not d.opened) if d.path == contradicted else d
            for d in seen.devices
        ]
        assert any(d.path == contradicted for d in devices), devices
        return msgspec.structs.replace(seen, devices=devices)

    monkeypatch.setattr(starting, "observation_of", contradicting)
    _start_with_passing_gate(world, fence, lambda: None)
    status = world.record(fence.attempt_id).status
    assert (status.state, status.reason) == ("failed", "gate_device")
    assert not (world.attempt_dir(fence.attempt_id) / "control" / RELEASE_MARKER).exists()
    assert world.installed.calls("start", fence.attempt_id) == 1


async def _nothing_more() -> None:
    pass


def _cleaned_only_after_the_held_observe(
    world: World,
    attempt_id: str,
    state: str,
    while_held: Callable[[], Coroutine[Any, Any, None]] = _nothing_more,
) -> lifecycle.Status:
    """Run the monitor with a short provider timeout until the attempt is in `state`;
    while its observe is still held, `while_held` runs and cleanup is not confirmed;
    then the observe returns, and the attempt's cleanup is confirmed."""
    storage = world.attempt_dir(attempt_id) / "storage"
    short = Settings(tick=0.05, provider_timeout=0.5, start_timeout=30.0)

    async def scenario() -> None:
        async with running(Runner(world.ctx, settings=short)):
            await until(lambda: world.record(attempt_id).status.state == state, state)
            assert (storage / "held-observe").exists()
            await while_held()
            assert not world.record(attempt_id).status.cleanup_confirmed
            (storage / "go-observe").touch()
            await until(settled_and_clean(world, attempt_id), "cleaned after observe returned")

    asyncio.run(scenario())
    return world.record(attempt_id).status


def _reaped_while_no_runner_watched(world: World, environment: dict[str, str]) -> Fence:
    """A running attempt whose lease ended and whose service the lease reaper emptied
    while no runner was watching."""
    fence = world.admit(
        world.plan(environment={**HOLD, **environment}, argv=("/bin/sleep", "1000"))
    )
    _released_by_hand(world, fence)
    name = world.service_name(fence.attempt_id)
    handle = world.ctx.service.adopt(name)
    assert handle is not None
    asyncio.run(until(lambda: world.ctx.service.members(handle), "the payload runs"))
    world.end_lease(fence)
    for top in world.ctx.service.planned_cgroups(name):
        reaper.kill_tree(top)
    asyncio.run(until(lambda: not world.ctx.service.members(handle), "the reaper emptied it"))
    return fence


def test_a_stop_whose_look_for_an_exit_fails_still_stops(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    fence = _reaped_while_no_runner_watched(world, {})

    def unreadable() -> None:
        raise OSError("cannot read the usage of the slot")

    monkeypatch.setattr(world.ctx.slots["slot0"].files, "usage", unreadable)
    status = _settle(world, fence.attempt_id)
    assert (status.state, status.reason) == ("expired", "lease_expired")


def test_a_reaped_service_whose_observe_times_out_is_expired_not_unknown(world: World) -> None:
    """The look before the stop finds the service empty; the provider's observe then
    hangs past its timeout. The lease was over, so this proves nothing about the
    payload: the expiry is recorded, and cleanup waits for the hung call."""
    fence = _reaped_while_no_runner_watched(world, {HANG: "observe:hold"})
    status = _cleaned_only_after_the_held_observe(world, fence.attempt_id, "expired")
    assert (status.state, status.reason) == ("expired", "lease_expired")


# --- the renewal and the reaper at the deadline --------------------------------------


class _ReaperRace(NamedTuple):
    """What a renewal sent while the reaper decided at the old deadline came to."""

    answer: AttemptRow | ErrorRow
    reaped: bool
    alive: bool
    status: lifecycle.Status


def _renewal_against_the_reaper(world: World, step: str | None) -> _ReaperRace:
    """A held payload runs with its deadline handed to the reaper. A reaper pass runs
    with its clock at that deadline (the daemon's clock is still before it, as for a
    renewal received a moment before the deadline); the renewal is sent through the
    handler at the reaper's `step` ("due": it has read the deadline and found it due;
    "intent": its intent is there, the second reading not yet made), or, for None, once
    the pass is over. The monitor then settles whatever follows."""
    fence = world.admit(world.plan(environment=HOLD, argv=("/bin/sleep", "1000")))
    _released_by_hand(world, fence)
    attempt_id = fence.attempt_id
    name = world.service_name(attempt_id)
    handle = world.ctx.service.adopt(name)
    assert handle is not None
    asyncio.run(until(lambda: world.ctx.service.members(handle), "the payload runs"))
    lease = world.record(attempt_id).lease
    assert lease is not None
    boot_id, deadline = lease.boot_id, lease.deadline_boottime_ns
    directory = str(world.state / "deadlines")
    at_step, go = threading.Event(), threading.Event()
    written = reaper.write_deadline

    def write_then_go(*args: Any) -> None:
        written(*args)
        go.set()  # the reaper goes on once the daemon moved the deadline

    def pause_at(reached: str, _name: str) -> None:
        if reached == step:
            at_step.set()
            assert go.wait(30), "the renewal never moved the deadline"

    renewal = Renewal(attempt_id, fence.generation, fence.plan_digest, 2, 10**13)
    request = RenewRequest(version=1, id=plans.new_id(), leases=[renewal])
    outcome: dict[str, Any] = {}

    async def scenario() -> None:
        async with running(Runner(world.ctx, settings=FAST)) as runner:
            await runner._deadlines.set(await runner._attempt(world.record(attempt_id)))
            reaper.write_deadline = write_then_go  # type: ignore[assignment]
            loop = asyncio.get_running_loop()
            reaping = loop.run_in_executor(
                None,
                functools.partial(reaper.reap_once, directory, boot_id, deadline, hook=pause_at),
            )
            if step is None:
                await reaping
            else:
                await loop.run_in_executor(None, at_step.wait, 30)
            reply = await handlers.renew(world.ctx, runner, Sender.TRANSPORT, request)
            await reaping
            outcome["answer"] = reply.results[0]  # type: ignore[union-attr]
            outcome["reaped"] = reaper.reaped(directory, name)
            outcome["alive"] = bool(world.ctx.service.members(handle))
            if outcome["reaped"] or not outcome["alive"]:
                await until(settled_and_clean(world, attempt_id), "settled and cleaned")

    try:
        asyncio.run(scenario())
    finally:
        reaper.write_deadline = written  # type: ignore[assignment]
    return _ReaperRace(status=world.record(attempt_id).status, **outcome)


def test_a_service_the_reaper_stopped_is_expired_even_before_the_ledger_says_so(
    world: World,
) -> None:
    """The reaper decided at the deadline it holds and emptied the service, and the
    monitor looks before anything recorded the expiry (the lease in the ledger still
    reads current, as when a renewal was committed but not yet refused): its evidence
    makes the attempt `expired`, not `unknown` (`outcome_unreadable`)."""
    fence = world.admit(world.plan(environment=HOLD, argv=("/bin/sleep", "1000")))
    _released_by_hand(world, fence)
    attempt_id = fence.attempt_id
    handle = world.ctx.service.adopt(world.service_name(attempt_id))
    assert handle is not None
    asyncio.run(until(lambda: world.ctx.service.members(handle), "the payload runs"))
    lease = world.record(attempt_id).lease
    assert lease is not None
    directory = str(world.state / "deadlines")

    async def scenario() -> None:
        async with running(Runner(world.ctx, settings=FAST)) as runner:
            await runner._deadlines.set(await runner._attempt(world.record(attempt_id)))
            await asyncio.get_running_loop().run_in_executor(
                None, reaper.reap_once, directory, lease.boot_id, lease.deadline_boottime_ns
            )
            await until(settled_and_clean(world, attempt_id), "settled and cleaned")

    asyncio.run(scenario())
    status = world.record(attempt_id).status
    assert (status.state, status.reason) == ("expired", "lease_expired")


def test_a_renewal_after_the_reaper_killed_is_refused_and_the_attempt_ends_expired(
    world: World,
) -> None:
    """The reaper decided at the old deadline before the renewal moved it: the renewal
    is refused `lease_expired` (never answered OK), and the attempt the reaper stopped
    ends `expired`, not `unknown`."""
    race = _renewal_against_the_reaper(world, None)
    assert race.reaped
    assert not race.alive
    assert isinstance(race.answer, ErrorRow), race.answer
    assert race.answer.error.code == "lease_expired"
    assert (race.status.state, race.status.reason) == ("expired", "lease_expired")


@pytest.mark.parametrize("step", ["due", "intent"])
def test_a_renewal_while_the_reaper_decides_at_the_old_deadline_is_honoured(
    world: World, step: str
) -> None:
    """The renewal moves the deadline after the reaper found the old one due, before
    (`due`) or after (`intent`) the reaper made its intent known: the renewal is
    answered OK only because the reaper then judges by the new deadline; the payload
    runs on, and no evidence of a kill is left."""
    race = _renewal_against_the_reaper(world, step)
    assert isinstance(race.answer, AttemptRow), race.answer
    assert race.answer.lease_sequence == 2
    assert not race.reaped
    assert race.alive
    assert race.status.state == "running"


def test_a_renewal_answered_while_the_deadline_is_first_handed_over_reaches_the_reaper(
    world: World,
) -> None:
    """The start hands the lease deadline to the reaper; a renewal (here: ending the
    lease now) is committed and answered while that hand-over is still writing the old
    deadline. The reaper's file must end with the renewed deadline, not the old one."""
    fence = world.admit(world.plan())
    attempt_id = fence.attempt_id
    deadlines = Deadlines(world.ctx)
    keeper = deadlines._keeper()
    write = keeper.set
    writing, written = threading.Event(), threading.Event()

    def slow_write(*args: Any) -> None:
        writing.set()
        assert written.wait(30), "the test never let the first hand-over finish"
        write(*args)

    keeper.set = slow_write  # type: ignore[method-assign]

    async def scenario() -> None:
        async with running(Runner(world.ctx, settings=FAST)) as runner:
            await ready(world, runner, fence)
            world.start(fence)
            attempt = await runner._attempt(world.record(attempt_id))
        handover = asyncio.get_running_loop().create_task(deadlines.set(attempt))
        await until(writing.is_set, "the first hand-over writes")
        world.end_lease(fence)
        renewal = asyncio.get_running_loop().create_task(deadlines.sync([world.record(attempt_id)]))
        written.set()
        await handover
        await renewal
        try:
            path = Path(keeper.directory) / (attempt.service + reaper.SUFFIX)
            parsed = reaper.parse(path.read_text())
            assert parsed is not None
            lease = world.record(attempt_id).lease
            assert lease is not None
            assert parsed[1] == lease.deadline_boottime_ns
        finally:
            await deadlines.drop(attempt)

    asyncio.run(scenario())


@pytest.mark.parametrize("ended", ["being stopped", "expired", "expired and cleaned up"])
def test_a_renewal_whose_attempt_expired_before_its_hand_over_is_refused(
    world: World, ended: str
) -> None:
    """Between a renewal's commit and its hand-over to the reaper, the monitor may find
    the service stopped at the old deadline and record the expiry (a stop pending, or
    already `expired`), and cleanup may take the deadline back: the hand-over still
    names the attempt as one the reaper stopped, so the renewal is refused
    `lease_expired`, never answered OK for an attempt that ends expired."""
    fence = world.admit(world.plan())
    attempt_id = fence.attempt_id
    deadlines = Deadlines(world.ctx)

    async def scenario() -> frozenset[str]:
        async with running(Runner(world.ctx, settings=FAST)) as runner:
            await ready(world, runner, fence)
            world.start(fence)
            attempt = await runner._attempt(world.record(attempt_id))
        await deadlines.set(attempt)
        terms = Terms(sequence=2, expires_at_ms=10**13)
        (row,) = world.ctx.ledger.renew_batch([(fence, terms)], world.clock.now(), 3600)
        assert isinstance(row, Applied), row
        assert row.changed
        world.ctx.ledger.apply(fence, lifecycle.LeaseExpired())
        if ended != "being stopped":
            world.ctx.ledger.apply(fence, lifecycle.Stopped())
        if ended == "expired and cleaned up":
            await deadlines.drop(attempt)
        try:
            return await deadlines.renewed([row.record])
        finally:
            await deadlines.drop(attempt)

    late = asyncio.run(scenario())
    assert late == {attempt_id}
    expected = "starting" if ended == "being stopped" else "expired"
    assert world.record(attempt_id).status.state == expected


def test_an_unavailable_provider_fails_preparation(world: World) -> None:
    world.ctx.providers["test"] = ProviderRuntime(
        "test", SHA, None, HostError("provider_digest_mismatch", "not the pinned files")
    )
    fence = world.admit(world.plan())

    async def scenario() -> None:
        async with running(Runner(world.ctx, settings=FAST)) as runner:
            runner.admitted([fence.attempt_id])
            await until(settled_and_clean(world, fence.attempt_id), "failed and cleaned")

    asyncio.run(scenario())
    status = world.record(fence.attempt_id).status
    assert (status.state, status.reason) == ("failed", "provider_unavailable")
    assert world.installed.calls("probe", fence.attempt_id) == 0


@pytest.mark.parametrize("method", ["probe", "start"])
def test_a_reply_the_sdk_would_not_build_fails_the_attempt_as_malformed(
    world: World, method: str
) -> None:
    """Probe and start replies are decoded with the SDK's Structs: `{"ok": "yes"}` is
    not a probe failure and `{"started": "yes"}` never reaches the gate."""
    fence = world.admit(world.plan(environment={MALFORMED: method}))
    attempt_id = fence.attempt_id

    async def scenario() -> None:
        async with running(Runner(world.ctx, settings=FAST)) as runner:
            runner.admitted([attempt_id])
            if method == "start":
                await until(state_of(world, attempt_id), "ready")
                world.start(fence)
                runner.start_requested([attempt_id])
            await until(settled_and_clean(world, attempt_id), "failed and cleaned")

    asyncio.run(scenario())
    status = world.record(attempt_id).status
    assert (status.state, status.reason) == ("failed", "provider_malformed")
    assert world.installed.calls("observe", attempt_id) == 0


def test_a_malformed_release_reply_keeps_the_attempt_unreleased(world: World) -> None:
    fence = world.admit(world.plan(devices=("gpu",), environment={MALFORMED: "release"}))
    attempt_id = fence.attempt_id

    async def scenario() -> None:
        async with running(Runner(world.ctx, settings=FAST)) as runner:
            runner.admitted([attempt_id])
            await until(settled_and_clean(world, attempt_id), "failed and cleaned")
            with pytest.raises(HostError) as refused:
                await runner.release(attempt_id)
            assert refused.value.code == "provider_malformed"

    asyncio.run(scenario())
    assert world.attempt_dir(attempt_id).exists()  # nothing removed after the bad reply


# --- no-resource records -------------------------------------------------------------------


def test_release_of_an_admission_rejection_calls_no_provider(world: World) -> None:
    plan = world.plan(slot_class="gpu")  # no slot of that class: rejected durably
    now = world.clock.now()
    lease = Lease(now.boot_id, 1, 10**13, now.boottime_ns + 10**12, 10**13)
    facts = HostFacts(
        slots=[SlotSpec("slot0", "cpu", SLOT_BYTES, 10**6)],
        devices=frozenset({"null"}),
        ceiling=offer_limits(),
        now=now,
    )
    ledger = world.ctx.ledger
    (row,) = ledger.admit_batch(ledger.bindings(), [PrepareRow(plan, lease)], facts)
    assert not isinstance(row, Admitted)

    async def release() -> None:
        runner = Runner(world.ctx, settings=FAST)
        await runner.release(plan.attempt_id)
        await runner.close()

    asyncio.run(release())
    assert world.record(plan.attempt_id).status.reason == lifecycle.ADMISSION_REJECTED
    assert world.installed.calls("release", plan.attempt_id) == 0


# --- restart ----------------------------------------------------------------------------------


def test_a_restarted_daemon_starts_a_reaper_for_a_deadline_left_behind(world: World) -> None:
    """A deadline file written by an earlier daemon, and no reaper running (it died, or
    exited): recovery starts one, whatever follows (no new deadline may ever come)."""
    directory = str(world.state / "deadlines")
    reaper.prepare_directory(directory)
    now = world.clock.now()
    reaper.write_deadline(
        directory, "ficc-work-left-behind", now.boot_id, now.boottime_ns + 10**12, []
    )
    assert not reaper.reaper_running(directory)

    async def scenario() -> None:
        runner = Runner(world.ctx, settings=FAST)
        try:
            await runner.recover()
            await until(lambda: reaper.reaper_running(directory), "a reaper runs")
        finally:
            await runner.close()

    asyncio.run(scenario())


def test_recover_turns_starting_into_unknown_stops_the_service_and_never_starts_again(
    world: World,
) -> None:
    fence = _held_attempt(world)
    attempt_id = fence.attempt_id

    async def first_daemon() -> None:
        runner = Runner(world.ctx, settings=FAST)
        await ready_and_started(world, runner, fence)
        await until(_barrier_waiting(world, attempt_id), "the barrier runs")
        await runner.close()  # the daemon "dies": its service keeps running

    asyncio.run(first_daemon())
    name = world.service_name(attempt_id)
    handle = world.ctx.service.adopt(name)
    assert handle is not None
    assert world.ctx.service.members(handle), "the service survives"
    assert world.installed.calls("start", attempt_id) == 1

    world.restart()

    async def second_daemon() -> None:
        async with running(Runner(world.ctx, settings=FAST)) as runner:
            await runner.recover()
            await until(settled_and_clean(world, attempt_id), "unknown and cleaned")

    asyncio.run(second_daemon())
    status = world.record(attempt_id).status
    assert (status.state, status.outcome, status.reason) == (
        "unknown",
        "unknown",
        lifecycle.EXECUTOR_RESTARTED,
    )
    assert service_idle(world, attempt_id)
    assert world.installed.calls("start", attempt_id) == 1, "start was called again"
    assert not (world.attempt_dir(attempt_id) / "control" / RELEASE_MARKER).exists()
    # what the service used is recorded by the cleanup, before it stopped the service;
    # the wall time is not known to this daemon (it never saw a release)
    recorded = world.ctx.ledger.usage_of([attempt_id])[attempt_id]
    assert recorded.recorded
    assert recorded.usage.cpu_user_us is not None
    assert recorded.usage.processes_peak is not None
    assert recorded.usage.wall_ms is None


# --- batching provider rows (a recording driver: pure batching logic) -----------------------


class RecordingDriver:
    """Replies `{"n": ...}` per row and records the size of every call."""

    def __init__(self) -> None:
        self.batches: list[tuple[str, int]] = []
        self.release = threading.Event()

    def _reply(self, method: str, contexts: list[dict[str, Any]]) -> list[dict[str, Any]]:
        self.batches.append((method, len(contexts)))
        if method == "stop":  # a hung provider call, until the test lets it go
            self.release.wait(30)
        return [{"n": context["n"]} for context in contexts]

    def __getattr__(self, method: str) -> Any:
        return lambda contexts: self._reply(method, contexts)


class _Row(dict[str, Any]):
    """A driver row of the fake provider: a dict, with the attempt it belongs to."""

    attempt_id = ""


def _row(n: int, attempt_id: str = "") -> _Row:
    row = _Row(n=n)
    row.attempt_id = attempt_id or f"attempt-{n}"
    return row


def _batcher(driver: Any, timeout: float = 30.0, max_late_calls: int = 64) -> tuple[Any, Workers]:
    loaded = LoadedProvider("fake", None, None, driver)  # type: ignore[arg-type]
    workers = Workers()
    other = LoadedProvider("other", None, None, driver)  # type: ignore[arg-type]
    providers = {
        "fake": ProviderRuntime("fake", SHA, loaded, None),
        "other": ProviderRuntime("other", SHA, other, None),
    }
    ctx = SimpleNamespace(providers=providers, workers=workers)
    return batching.Batcher(ctx, timeout, max_late_calls), workers  # type: ignore[arg-type]


def test_rows_of_one_loop_turn_go_out_as_batches_of_at_most_64() -> None:
    driver = RecordingDriver()
    batcher, workers = _batcher(driver)

    async def scenario() -> list[Any]:
        rows = [batcher.call("fake", "observe", _row(n)) for n in range(70)]
        rows += [batcher.call("fake", "probe", _row(n)) for n in range(3)]
        return list(await asyncio.gather(*rows))

    try:
        results = asyncio.run(scenario())
    finally:
        workers.shutdown()
    assert [r.reply["n"] for r in results] == [*range(70), *range(3)]
    assert sorted(driver.batches) == [("observe", 6), ("observe", 64), ("probe", 3)]


def test_a_cohort_sends_rows_of_different_loop_turns_as_one_call() -> None:
    """Members reach their call after unequal work; one leaves without calling. The
    rows still go out as one call, once the last member has called or left."""
    driver = RecordingDriver()
    batcher, workers = _batcher(driver)

    async def member(cohort: Any, n: int) -> Any:
        with cohort.ticket() as ticket:
            for _ in range(n):  # unequal work: n loop turns before the call
                await asyncio.sleep(0)
            if n == 3:
                return None  # drops out before its call
            return (await ticket.call("fake", "start", _row(n))).reply["n"]

    async def scenario() -> list[Any]:
        cohort = batcher.cohort(5)
        return list(await asyncio.gather(*(member(cohort, n) for n in range(5))))

    try:
        results = asyncio.run(scenario())
    finally:
        workers.shutdown()
    assert results == [0, 1, 2, None, 4]
    assert driver.batches == [("start", 4)]


def test_without_a_cohort_rows_of_different_loop_turns_go_out_apart() -> None:
    """The control for the test above: the plain batcher groups one loop turn only."""
    driver = RecordingDriver()
    batcher, workers = _batcher(driver)

    async def member(n: int) -> Any:
        for _ in range(n * 20):
            await asyncio.sleep(0)
        return await batcher.call("fake", "start", _row(n))

    async def scenario() -> None:
        await asyncio.gather(*(member(n) for n in range(3)))

    try:
        asyncio.run(scenario())
    finally:
        workers.shutdown()
    assert len(driver.batches) > 1


def test_starts_waiting_for_their_payload_observe_on_one_shared_beat() -> None:
    """A start that begins waiting while another waits joins that one's beat, so both
    wake in the same loop turn (and their observe rows go out together); a waiter that
    is cancelled does not cancel the beat for the others."""
    runner = Runner(SimpleNamespace(), settings=Settings(observe_interval=0.05))  # type: ignore[arg-type]

    async def scenario() -> None:
        first = asyncio.ensure_future(runner._starter._next_observation())
        await asyncio.sleep(0)
        beat = runner._starter._beat
        assert beat is not None
        assert not beat.done()
        second = asyncio.ensure_future(runner._starter._next_observation())
        third = asyncio.ensure_future(runner._starter._next_observation())
        await asyncio.sleep(0)
        assert runner._starter._beat is beat  # joined, not a beat of its own
        third.cancel()
        await asyncio.gather(first, second)
        assert beat.done()
        assert not beat.cancelled()
        later = asyncio.ensure_future(runner._starter._next_observation())
        await asyncio.sleep(0)
        assert runner._starter._beat is not beat  # after a beat, the next waiter starts a new one
        await later

    asyncio.run(scenario())


def test_of_two_releases_of_one_attempt_only_the_first_may_kill_its_leftovers() -> None:
    """A controller may resend a release while the first still runs; the second must
    not kill what runs as the slot account (the first's provider commands)."""
    runner = Runner(SimpleNamespace(), settings=Settings())  # type: ignore[arg-type]
    seen: list[tuple[str, bool]] = []
    going = asyncio.Event()

    async def releasing(attempt_id: str, ticket: Any, *, first: bool) -> None:
        seen.append((attempt_id, first))
        await going.wait()

    runner._release_resources = releasing  # type: ignore[method-assign]

    async def scenario() -> None:
        one = asyncio.ensure_future(runner.release_batch(["a" * 32]))
        await asyncio.sleep(0)
        two = asyncio.ensure_future(runner.release_batch(["a" * 32, "b" * 32]))
        await asyncio.sleep(0)
        going.set()
        await asyncio.gather(one, two)
        await runner.release_batch(["a" * 32])  # later, alone again: first

    asyncio.run(scenario())
    assert seen == [("a" * 32, True), ("a" * 32, False), ("b" * 32, True), ("a" * 32, True)]


def test_the_shared_beat_slows_down_when_observing_gets_expensive(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The pause before the next shared observation is `observe_interval`, or four
    times the CPU the last observe call spent when that is longer."""
    runner = Runner(SimpleNamespace(), settings=Settings(observe_interval=0.01))  # type: ignore[arg-type]
    pauses: list[float] = []

    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        real = loop.call_later

        def recording(delay: float, *args: Any) -> Any:
            pauses.append(delay)
            return real(0, *args)

        monkeypatch.setattr(loop, "call_later", recording)
        await runner._starter._next_observation()
        runner._starter._observe_cost = 0.05
        await runner._starter._next_observation()

    asyncio.run(scenario())
    assert pauses == [0.01, 0.2]


class CpuDriver:
    """`observe` waits without using a CPU; `probe` uses one for `BURN` seconds."""

    BURN = 0.05

    def observe(self, contexts: list[dict[str, Any]]) -> list[dict[str, Any]]:
        threading.Event().wait(4 * self.BURN)
        return [{} for _ in contexts]

    def probe(self, contexts: list[dict[str, Any]]) -> list[dict[str, Any]]:
        end = time.thread_time() + self.BURN
        while time.thread_time() < end:
            hashlib.sha256(b"x" * 4096).digest()
        return [{} for _ in contexts]


def test_the_batcher_keeps_the_cpu_not_the_wall_time_of_each_last_call() -> None:
    """What the shared observation pause grows with: a call that waits (for a CPU
    busy elsewhere, say) costs the host nothing."""
    batcher, workers = _batcher(CpuDriver())

    async def scenario() -> None:
        await batcher.call("fake", "observe", _row(1))
        await batcher.call("fake", "probe", _row(1))

    try:
        asyncio.run(scenario())
    finally:
        workers.shutdown()
    assert batcher.cpu_seconds[("fake", "observe")] < CpuDriver.BURN
    assert batcher.cpu_seconds[("fake", "probe")] >= CpuDriver.BURN


def test_a_hung_provider_call_leaves_its_rows_timed_out() -> None:
    driver = RecordingDriver()
    batcher, workers = _batcher(driver, timeout=0.2)

    async def scenario() -> list[Any]:
        return list(await asyncio.gather(*(batcher.call("fake", "stop", _row(n)) for n in (1, 2))))

    try:
        results = asyncio.run(scenario())
        assert [r.code for r in results] == ["provider_timeout"] * 2
    finally:
        driver.release.set()
        workers.shutdown()


def test_an_attempt_whose_call_runs_past_its_timeout_gets_no_second_call_until_it_ends() -> None:
    """The hung call's thread runs on: its attempt counts as running (no cleanup may be
    confirmed), its next rows but `stop` are refused without reaching the provider while
    other attempts' rows go out, and once the hung call returns the attempt is free."""
    driver = RecordingDriver()
    batcher, workers = _batcher(driver, timeout=0.2)
    flight = batcher.in_flight

    async def scenario() -> None:
        (hung,) = await asyncio.gather(batcher.call("fake", "stop", _row(1)))
        assert hung.code == "provider_timeout"
        assert flight.running("attempt-1")
        assert flight.late("attempt-1")
        again, other = await asyncio.gather(
            batcher.call("fake", "observe", _row(1)), batcher.call("fake", "observe", _row(2))
        )
        assert again.code == "provider_timeout"
        assert "still runs" in again.message
        assert other.ok
        assert other.reply == {"n": 2}
        assert driver.batches == [("stop", 1), ("observe", 1)]  # attempt-1's row never sent
        stopped = await batcher.call("fake", "stop", _row(1))  # a stop still goes out
        assert stopped.code == "provider_timeout"
        assert driver.batches.count(("stop", 1)) == 2
        driver.release.set()
        await until(lambda: not flight.running("attempt-1"), "the hung call returned")
        assert not flight.late("attempt-1")
        assert flight.late_calls("fake") == 0
        assert (await batcher.call("fake", "observe", _row(1))).ok

    try:
        asyncio.run(scenario())
    finally:
        driver.release.set()
        workers.shutdown()


def test_past_the_bound_of_calls_left_running_no_provider_call_is_made() -> None:
    driver = RecordingDriver()
    batcher, workers = _batcher(driver, timeout=0.2, max_late_calls=2)

    async def scenario() -> tuple[Any, Any]:
        for n in (1, 2):
            assert (await batcher.call("fake", "stop", _row(n))).code == "provider_timeout"
        refused = await batcher.call("fake", "observe", _row(3))
        return refused, await batcher.call("other", "observe", _row(4))

    try:
        refused, other = asyncio.run(scenario())
        assert refused.code == "provider_unavailable"
        assert "restart the daemon" in refused.message
        assert other.ok  # another provider's calls still go out
        assert driver.batches == [("stop", 1), ("stop", 1), ("observe", 1)]
    finally:
        driver.release.set()
        workers.shutdown()


def test_an_unknown_provider_fails_its_rows_without_a_call() -> None:
    driver = RecordingDriver()
    batcher, workers = _batcher(driver)
    try:
        result = asyncio.run(batcher.call("absent", "probe", _row(1)))
    finally:
        workers.shutdown()
    assert result.code == "provider_unavailable"
    assert driver.batches == []


def test_the_monitor_is_woken_when_a_released_service_main_process_exits(world: World) -> None:
    """The end of a payload is seen at once, not at the next monitor tick: the runner
    watches the service's main process with a pidfd and wakes the monitor on exit."""
    read_end, write_end = os.pipe()
    child = subprocess.Popen(["/bin/sh", "-c", "read _ <&3"], pass_fds=(read_end,))
    os.close(read_end)

    async def scenario() -> None:
        runner = Runner(world.ctx, settings=FAST)
        woken = asyncio.Event()
        runner.monitor.wake = woken.set  # type: ignore[method-assign]
        runner._starter._wake_on_exit(child.pid)
        await asyncio.sleep(0)
        assert not woken.is_set()  # the process still runs
        os.close(write_end)  # now it exits
        await asyncio.wait_for(woken.wait(), timeout=30)
        assert runner._starter._exit_watches == set()  # the pidfd is closed again
        await runner.close()

    try:
        asyncio.run(scenario())
    finally:
        child.kill()
        child.wait()


def test_the_end_of_the_gated_payload_brings_looks_forward_while_it_runs(world: World) -> None:
    """A provider may report an exit before the service ends (the Podman provider reads
    the container's status while Podman still tears it down): the end of the process
    the gate checked wakes the monitor, then again every `observe_interval` while the
    attempt is still `running`, at most AFTER_EXIT_LOOKS times."""
    fence = world.admit(world.plan(environment=HOLD, argv=("/bin/sleep", "1000")))
    _released_by_hand(world, fence)
    read_end, write_end = os.pipe()
    payload = subprocess.Popen(["/bin/sh", "-c", "read _ <&3"], pass_fds=(read_end,))
    os.close(read_end)

    async def scenario() -> None:
        runner = Runner(world.ctx, settings=FAST)  # its monitor loop is not running
        wakes: list[None] = []
        runner.monitor.wake = lambda: wakes.append(None)  # type: ignore[method-assign]
        starter = runner._starter
        pidfd = os.pidfd_open(payload.pid)
        starter._watch(pidfd, functools.partial(starter._spawn_looks, fence.attempt_id))
        await asyncio.sleep(0)
        assert wakes == []  # the payload still runs
        os.close(write_end)  # now it ends
        await until(lambda: len(wakes) >= 3, "looks after the payload's end")
        assert starter._exit_watches == set()
        assert starter.payload_ended(fence.attempt_id)  # a stop now looks first
        world.ctx.ledger.apply(fence, lifecycle.Finished(exit_code=0))  # the monitor's record
        await until(lambda: not runner._tasks, "the looks stop")
        assert len(wakes) < AFTER_EXIT_LOOKS
        assert not starter.payload_ended(fence.attempt_id)
        await runner.close()

    async def cleaned() -> None:
        async with running(Runner(world.ctx, settings=FAST)):
            await until(settled_and_clean(world, fence.attempt_id), "cleaned")

    try:
        asyncio.run(scenario())
    finally:
        payload.kill()
        payload.wait()
    asyncio.run(cleaned())


# --- start authority at the release marker ---------------------------------------------
#
# The test provider never passes the gate, so these runners stand in a passing verdict
# for the gate's; everything else (ledger, service, barrier, marker) is real. `during`
# runs while the gate would, i.e. after the start was accepted and before the marker.


def _passing_gate(ctx: HostContext, during: Callable[[], None]) -> Runner:
    runner = Runner(ctx, settings=FAST)

    def run_gate(*args: Any) -> gate.Verdict:
        during()
        return gate.Verdict(ok=True, failures=())

    runner._starter._run_gate = run_gate  # type: ignore[method-assign, assignment]
    return runner


def _start_with_passing_gate(world: World, fence: Fence, during: Callable[[], None]) -> None:
    attempt_id = fence.attempt_id

    async def scenario() -> None:
        async with running(_passing_gate(world.ctx, during)) as runner:
            await ready_and_started(world, runner, fence)
            await until(settled_and_clean(world, attempt_id), "settled and cleaned")

    asyncio.run(scenario())


def _start_with_passing_gate_authorized_after(
    world: World, fence: Fence, first: Callable[[], object]
) -> None:
    """`_start_with_passing_gate`, with `first` run on the ledger thread right before the
    ledger authorizes the release (after the start pipeline last read the record)."""
    ledger = world.ctx.ledger
    authorize = ledger.authorize_release

    def after_first(f: Fence, now: Any, ceiling: Any = None, **release: Any) -> str | None:
        first()
        return authorize(f, now, ceiling, **release)

    ledger.authorize_release = after_first  # type: ignore[method-assign]
    try:
        _start_with_passing_gate(world, fence, lambda: None)
    finally:
        del ledger.authorize_release


def test_a_stop_committed_just_before_the_release_is_authorized_never_releases(
    world: World,
) -> None:
    """The stop handler's commit lands after the start pipeline last read the record but
    before the ledger authorizes the release: the marker is never written."""
    fence = world.admit(world.plan())
    _start_with_passing_gate_authorized_after(
        world, fence, lambda: world.ctx.ledger.apply(fence, lifecycle.StopRequested())
    )
    status = world.record(fence.attempt_id).status
    assert not (world.attempt_dir(fence.attempt_id) / "control" / RELEASE_MARKER).exists()
    assert (status.state, status.reason) == ("cancelled", "stopped")


def test_a_lease_that_runs_out_while_the_release_waits_for_the_ledger_never_releases(
    world: World,
) -> None:
    """The gate passed with the lease current; the release then waits for the ledger
    thread (busy with input commits, say) until past the deadline. The lease is judged
    inside the transaction that would write the marker: never released, `expired`."""
    fence = world.admit(world.plan())
    clock = SteppedClock()
    world.ctx.clock = clock  # type: ignore[assignment]
    _start_with_passing_gate_authorized_after(
        world,
        fence,
        lambda: clock.advance(1200),  # the lease was 600 s
    )
    status = world.record(fence.attempt_id).status
    assert not (world.attempt_dir(fence.attempt_id) / "control" / RELEASE_MARKER).exists()
    assert (status.state, status.reason) == ("expired", "lease_expired")


def test_a_marker_that_appears_only_after_the_deadline_is_refused_and_expires(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The deadline passes while the marker is being written: the clock is read again
    once it is there, the start is never recorded, and the attempt ends `expired`."""
    fence = world.admit(world.plan())
    clock = SteppedClock()
    world.ctx.clock = clock  # type: ignore[assignment]
    write_marker = gate.write_release_marker

    def slow_marker(*args: Any, **kwargs: Any) -> None:
        write_marker(*args, **kwargs)
        clock.advance(1200)

    monkeypatch.setattr(gate, "write_release_marker", slow_marker)
    ledger = world.ctx.ledger
    apply = ledger.apply
    events: list[str] = []

    def recorded(f: Fence, event: lifecycle.AnyEvent, usage: Any = None) -> Applied:
        events.append(event.name)
        return apply(f, event, usage)

    ledger.apply = recorded  # type: ignore[method-assign]
    try:
        _start_with_passing_gate(world, fence, lambda: None)
    finally:
        del ledger.apply
    status = world.record(fence.attempt_id).status
    assert "started" not in events
    assert (status.state, status.reason) == ("expired", "lease_expired")


def test_an_expiry_judged_on_records_read_before_a_renewal_is_not_recorded(
    world: World,
) -> None:
    """The monitor read the records, then a renewal moved the deadline, then the
    monitor's clock passed the old deadline: the expiry's own transaction sees the
    renewed lease, records nothing and stops nothing."""
    fence = world.admit(world.plan(), lease_seconds=60)
    clock = SteppedClock()
    world.ctx.clock = clock  # type: ignore[assignment]

    async def scenario() -> None:
        runner = Runner(world.ctx, settings=FAST)
        watched = runner.watched

        async def renewed_after_the_read() -> list[AttemptRecord]:
            records = await watched()
            rows = [(fence, Terms(sequence=2, expires_at_ms=10**13))]
            (row,) = world.ctx.ledger.renew_batch(rows, clock, 3600)
            assert isinstance(row, Applied), row
            clock.advance(120)
            return records

        runner.watched = renewed_after_the_read  # type: ignore[method-assign]
        try:
            await runner.monitor.tick()
        finally:
            await runner.close()

    asyncio.run(scenario())
    status = world.record(fence.attempt_id).status
    assert (status.state, status.stop_pending) == ("prepared", None)


def test_a_barrier_that_dies_after_the_gate_is_never_released(world: World) -> None:
    """The gate passed, then the barrier died (an OOM kill, say) before the marker: its
    exit must never be taken for the payload's. The start fails `barrier_exited` (the
    payload never ran) and the marker is never written."""
    fence = world.admit(world.plan())
    runner = Runner(world.ctx, settings=FAST)

    def gate_then_death(*args: Any) -> gate.Verdict:
        pid = args[3]
        pidfd = os.pidfd_open(pid)
        try:
            os.kill(pid, signal.SIGKILL)
            assert select.select([pidfd], [], [], 30)[0], "the barrier did not die"
        finally:
            os.close(pidfd)
        return gate.Verdict(ok=True, failures=())

    runner._starter._run_gate = gate_then_death  # type: ignore[method-assign, assignment]

    async def scenario() -> None:
        async with running(runner):
            await ready_and_started(world, runner, fence)
            await until(settled_and_clean(world, fence.attempt_id), "settled and cleaned")

    asyncio.run(scenario())
    status = world.record(fence.attempt_id).status
    assert not (world.attempt_dir(fence.attempt_id) / "control" / RELEASE_MARKER).exists()
    assert (status.state, status.reason) == ("failed", "barrier_exited")


@pytest.mark.parametrize(
    ("failure", "reason"),
    [
        (HostError("ledger_full", "no space left for the write"), "ledger_full"),
        (RuntimeError("a bug"), "internal_error"),
    ],
)
def test_a_release_whose_start_cannot_be_recorded_is_unknown_and_stopped(
    world: World, failure: Exception, reason: str
) -> None:
    """The marker is written, then `Started` cannot be recorded (a full `state_dir`, a
    bug): the payload may have run, so the outcome is `unknown` (never `failed`, which
    reads "never ran") and the service is stopped, not left running unwatched."""
    fence = world.admit(world.plan(argv=("/bin/sleep", "1000")))
    ledger = world.ctx.ledger
    apply = ledger.apply

    def started_fails(f: Fence, event: lifecycle.AnyEvent, usage: Any = None) -> Any:
        if isinstance(event, lifecycle.Started):
            raise failure
        return apply(f, event, usage)

    ledger.apply = started_fails  # type: ignore[method-assign]
    try:
        _start_with_passing_gate(world, fence, lambda: None)
    finally:
        del ledger.apply
    status = world.record(fence.attempt_id).status
    assert (world.attempt_dir(fence.attempt_id) / "control" / RELEASE_MARKER).exists()
    assert (status.state, status.reason) == ("unknown", reason)
    assert service_idle(world, fence.attempt_id)


def test_with_unchanged_authority_the_payload_is_released(world: World) -> None:
    """The control for the two tests below: the stand-in gate reaches the marker."""
    fence = world.admit(world.plan())
    _start_with_passing_gate(world, fence, lambda: None)
    status = world.record(fence.attempt_id).status
    assert (status.state, status.reason, status.exit_code) == ("succeeded", "exited", 0)
    assert (world.attempt_dir(fence.attempt_id) / "control" / RELEASE_MARKER).exists()


def test_what_a_released_payload_used_is_recorded_when_its_exit_is(world: World) -> None:
    """The exit and what the attempt used are one transaction: CPU and memory from its
    service's cgroups, the slot's bytes and inodes, and the wall time from the release
    to the exit (the payload spins for 0.3 s of CPU)."""
    spin = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.3: pass"
    fence = world.admit(world.plan(argv=("/usr/bin/python3", "-I", "-S", "-c", spin)))
    ledger = world.ctx.ledger
    apply = ledger.apply
    seen: list[tuple[str, Any]] = []

    def recording(f: Fence, event: lifecycle.AnyEvent, usage: Any = None) -> Any:
        seen.append((event.name, usage))
        return apply(f, event, usage)

    ledger.apply = recording  # type: ignore[method-assign]
    try:
        _start_with_passing_gate(world, fence, lambda: None)
    finally:
        del ledger.apply
    status = world.record(fence.attempt_id).status
    assert (status.state, status.reason, status.exit_code) == ("succeeded", "exited", 0)
    (finished,) = [usage for name, usage in seen if name == "finished"]
    recorded = ledger.usage_of([fence.attempt_id])[fence.attempt_id]
    assert recorded == RecordedUsage(True, finished)
    used = recorded.usage
    assert used.cpu_user_us is not None
    assert used.cpu_system_us is not None
    assert used.cpu_user_us + used.cpu_system_us >= 300_000, used
    assert used.memory_peak_bytes is not None
    assert used.memory_peak_bytes > 0
    assert used.oom_kills == 0
    assert used.storage_bytes is not None
    assert used.storage_bytes > 0
    assert used.storage_inodes is not None
    assert used.storage_inodes > 0
    assert used.wall_ms is not None
    assert 300 <= used.wall_ms < 60_000, used


def test_a_ready_observation_with_the_pid_is_gated_without_waiting_for_payload(
    world: World,
) -> None:
    """The provider reports the barrier's PID in `ready` and never `payload`: that
    PID is the one the gate judges (a host waiting for `payload` would time out)."""
    fence = world.admit(world.plan(environment={"FICC_TEST_PROVIDER_READY_PID": "1"}))
    _start_with_passing_gate(world, fence, lambda: None)
    status = world.record(fence.attempt_id).status
    assert (status.state, status.reason, status.exit_code) == ("succeeded", "exited", 0)


@pytest.mark.parametrize("control", ["paused", "draining", "stopped"])
def test_an_offer_closed_before_the_marker_cancels_and_never_releases(
    world: World, control: str
) -> None:
    fence = world.admit(world.plan())
    ledger = world.ctx.ledger

    def close_offer() -> None:
        offer = ledger.offer()
        ledger.set_offer(offer.revision, control, None, offer_limits())  # type: ignore[arg-type]

    _start_with_passing_gate(world, fence, close_offer)
    status = world.record(fence.attempt_id).status
    assert (status.state, status.outcome, status.reason) == (
        "cancelled",
        "cancelled",
        "offer_closed",
    )
    assert not (world.attempt_dir(fence.attempt_id) / "control" / RELEASE_MARKER).exists()
    assert not (
        world.attempt_dir(fence.attempt_id) / "storage" / ".ficc-test-provider" / "exit"
    ).exists()
    assert service_idle(world, fence.attempt_id)
    assert world.installed.calls("start", fence.attempt_id) == 1


def test_an_offer_that_stops_covering_the_attempt_cancels_before_the_marker(
    world: World,
) -> None:
    fence = world.admit(world.plan())
    ledger = world.ctx.ledger

    def shrink_offer() -> None:
        offer = ledger.offer()
        small = msgspec.structs.replace(offer.limits.resources, memory_bytes=1 << 20)
        limits = msgspec.structs.replace(offer.limits, resources=small)
        ledger.set_offer(offer.revision, "active", limits, offer_limits())

    _start_with_passing_gate(world, fence, shrink_offer)
    status = world.record(fence.attempt_id).status
    assert (status.state, status.reason) == ("cancelled", "offer_changed")
    assert not (world.attempt_dir(fence.attempt_id) / "control" / RELEASE_MARKER).exists()


def test_a_new_offer_revision_that_still_covers_the_attempt_releases_it(world: World) -> None:
    fence = world.admit(world.plan())
    ledger = world.ctx.ledger

    def reoffer() -> None:
        offer = ledger.offer()
        ledger.set_offer(offer.revision, "active", None, offer_limits())

    _start_with_passing_gate(world, fence, reoffer)
    status = world.record(fence.attempt_id).status
    assert (status.state, status.reason) == ("succeeded", "exited")
    assert (world.attempt_dir(fence.attempt_id) / "control" / RELEASE_MARKER).exists()


# --- the provider context ----------------------------------------------------------------

SLOT_FIELDS = {"id", "slot_class", "path", "uid", "gid", "storage_bytes", "storage_inodes"}
STORAGE_FIELDS = {"path", "device", "inode", "bytes", "inodes"}


def _check_common(world: World, context: dict[str, Any], plan: planlib.Plan) -> None:
    """What every context holds: plan, digest, slot, verified storage binding, owned
    attempt directory, exact service name, cgroup and supervisor service."""
    attempt_id = plan.attempt_id
    assert context["plan"] == msgspec.to_builtins(plan)
    assert context["plan_digest"] == planlib.plan_digest(plan)
    assert set(context["slot"]) == SLOT_FIELDS
    assert (context["slot"]["id"], context["slot"]["uid"]) == ("slot0", world.uid)
    storage = context["storage"]
    assert set(storage) == STORAGE_FIELDS
    found = os.stat(storage["path"])
    assert (storage["device"], storage["inode"]) == (found.st_dev, found.st_ino)
    assert found.st_dev == os.stat(world.slot).st_dev  # on the slot's filesystem
    assert (storage["bytes"], storage["inodes"]) == (64 << 20, 1000)
    directory = world.attempt_dir(attempt_id)
    assert context["attempt_directory"] == str(directory)
    assert os.stat(directory).st_uid == 0  # owned by the host
    assert context["service"] == world.service_name(attempt_id)
    service = world.ctx.service
    assert context["cgroup"] == service.planned_supervisor_cgroup(context["service"])
    assert context["supervisor"] == {"backend": "cgroupfs", "service": context["service"]}
    assert context["inputs"] == []


def test_every_context_holds_what_the_provider_contract_lists(world: World) -> None:
    plan = world.plan()
    fence = world.admit(plan)
    attempt_id = fence.attempt_id

    async def until_settled() -> None:
        async with running(Runner(world.ctx, settings=FAST)) as runner:
            await ready_and_started(world, runner, fence)
            await until(settled_and_clean(world, attempt_id), "refused by the gate, cleaned")

    asyncio.run(until_settled())
    persisted = world.ctx.ledger.prepare_result(attempt_id)
    assert persisted is not None
    prepared = msgspec.json.decode(persisted)
    (probe,) = world.installed.contexts("probe", attempt_id)
    (prepare,) = world.installed.contexts("prepare", attempt_id)
    for context in (probe, prepare):
        _check_common(world, context, plan)
        assert context["prepared"] is None
    assert prepare["check"] == "<callable>"
    assert "check" not in probe
    for method in ("start", "observe", "stop"):
        contexts = world.installed.contexts(method, attempt_id)
        assert contexts, f"the provider was never called with {method}"
        for context in contexts:
            _check_common(world, context, plan)
            assert context["prepared"] == prepared
            assert "check" not in context

    async def release() -> None:
        await Runner(world.ctx, settings=FAST).release(attempt_id)

    expected = world.installed.contexts("probe", attempt_id)[0]["storage"]
    asyncio.run(release())
    (released,) = world.installed.contexts("release", attempt_id)
    assert released["prepared"] == prepared
    assert released["storage"] == expected  # verified, just before the layout went
    assert released["service"] == world.service_name(attempt_id)


@pytest.mark.parametrize(
    ("interval", "cost", "pause"),
    [
        (0.01, 0.0, 0.01),  # cheap observations: the configured interval
        (0.01, 0.02, 0.08),  # four times the last call
        (0.01, 300.0, starting.MAX_OBSERVATION_PAUSE),  # a timed-out call: capped
        (1.0, 300.0, 1.0),  # a configured interval above the cap stands
    ],
)
def test_the_shared_observation_pause_grows_with_its_cost_and_is_capped(
    interval: float, cost: float, pause: float
) -> None:
    assert starting.observation_pause(interval, cost) == pytest.approx(pause)
