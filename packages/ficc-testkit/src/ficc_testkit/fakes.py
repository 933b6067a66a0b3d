"""Stand-ins for the parts of the daemon that need root or a real provider, for tests
of the logic around them: a system service kept in memory (`FakeService`), a slot's
attempt files on a plain directory (`FakeSlotFiles`), a provider driver that answers
as a test scripts it (`ScriptedDriver`), and a runner that records what the request
handlers hand it (`RecordingRunner`).

A fake proves nothing about the kernel: the real backends are tested against real
cgroups and real systemd units, the real slot files against a real reserved filesystem
(root), and these fakes only let the handlers' and the runner's own decisions run in
the fast lane. Like httpcore's mock backend, each implements its whole interface
(`SystemService`, `SlotFiles`, `RunnerPort`), so a test sees a type error, not a
missing method, when the interface grows.
"""

# ruff: noqa: D102  (each method is the interface's, documented there: SystemService, RunnerPort)

from __future__ import annotations

import dataclasses
import os
import posixpath
import shutil
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ficc.execution import plan as planlib
from ficc.execution import provider as sdk
from ficc.execution.errors import ErrorCode
from ficc.execution.host.api.port import RunnerPort
from ficc.execution.host.core.errors import HostError
from ficc.execution.host.ledger.store import AttemptRecord, ResourceUsage
from ficc.execution.host.service.interface import (
    CgroupUsage,
    Controls,
    ServiceHandle,
    ServiceSpec,
    SystemService,
)
from ficc.execution.host.service.reaper import CGROUP_ROOT
from ficc.execution.host.storage import slotfs
from ficc.execution.host.storage.layout import (
    ATTEMPTS_DIRECTORY,
    LOGS,
    PARTS,
    STDERR,
    STDOUT,
    STORAGE,
    AttemptPaths,
    Layout,
    Part,
)
from ficc.execution.host.storage.slot_files import SlotFiles
from ficc.execution.host.storage.staging import STAGING_DIRECTORY


@dataclasses.dataclass
class FakeUnit:
    """One service as the fake keeps it; a test sets `members`, `exit_status` and
    `usage` (what its cgroups' counters read)."""

    spec: ServiceSpec
    members: set[int] = dataclasses.field(default_factory=set)
    exit_status: int | None = None
    stopped: bool = False
    usage: CgroupUsage = dataclasses.field(default_factory=CgroupUsage)
    payload: int | None = None
    """The PID `place_payload` moved into the payload's own node."""


class FakeService:
    """A `SystemService` in memory: services by name, accounts with live processes."""

    backend = "fake"

    def __init__(self) -> None:
        self.units: dict[str, FakeUnit] = {}
        self.busy_accounts: set[int] = set()
        """UIDs that still have a process somewhere (not idle until killed)."""
        self.unkillable: set[int] = set()
        """UIDs whose processes survive `kill_account` (it then answers not idle)."""
        self.calls: list[tuple[str, str]] = []
        """(method, service name or uid) in call order."""

    def _handle(self, name: str) -> ServiceHandle:
        return ServiceHandle(name, self.backend, 2, {"unified": self._cgroup(name)}, None, None)

    @staticmethod
    def _cgroup(name: str) -> str:
        """Where the service's cgroup would be: under the cgroup root, as the lease
        reaper requires of a deadline's cgroups, but never made (nothing is there)."""
        return posixpath.join(CGROUP_ROOT, "ficc-fake-services", name)

    def _unit(self, handle: ServiceHandle) -> FakeUnit:
        unit = self.units.get(handle.name)
        if unit is None:
            raise HostError("service_missing", f"no fake service {handle.name}")
        return unit

    def create(self, spec: ServiceSpec) -> ServiceHandle:
        if spec.name in self.units:
            raise HostError("service_exists", f"fake service {spec.name} exists")
        self.calls.append(("create", spec.name))
        self.units[spec.name] = FakeUnit(spec)
        return self._handle(spec.name)

    def controls(self, handle: ServiceHandle) -> Controls:
        limits = self._unit(handle).spec.limits
        return Controls(
            backend=self.backend,
            cgroup_version=2,
            memory_bytes=limits.memory_bytes,
            swap_bytes=limits.swap_bytes,
            processes=limits.processes,
            cpu_millis=limits.cpu_millis,
            devices=[],
            cgroups=dict(handle.cgroups),
        )

    def members(self, handle: ServiceHandle) -> set[int]:
        return set(self._unit(handle).members)

    def occupied(self, handle: ServiceHandle) -> bool:
        return bool(self._unit(handle).members)

    def usage(self, handle: ServiceHandle) -> CgroupUsage:
        return self._unit(handle).usage

    def place_payload(self, handle: ServiceHandle, pid: int) -> None:
        self.calls.append(("place_payload", handle.name))
        self._unit(handle).payload = pid

    def exit_status(self, handle: ServiceHandle) -> int | None:
        return self._unit(handle).exit_status

    def stop(self, handle: ServiceHandle) -> None:
        self.calls.append(("stop", handle.name))
        unit = self._unit(handle)
        unit.members.clear()
        unit.stopped = True

    def is_idle(self, handle: ServiceHandle, uid: int) -> bool:
        return not self._unit(handle).members and self.account_idle(uid)

    def remove(self, handle: ServiceHandle) -> None:
        self.calls.append(("remove", handle.name))
        self.units.pop(handle.name, None)

    def adopt(self, name: str) -> ServiceHandle | None:
        return self._handle(name) if name in self.units else None

    def supervisor_cgroup(self, handle: ServiceHandle) -> str:
        return f"{handle.cgroups['unified']}/supervisor"

    def planned_supervisor_cgroup(self, name: str) -> str:
        return f"{self._cgroup(name)}/supervisor"

    def account_idle(self, uid: int) -> bool:
        return uid not in self.busy_accounts and uid not in self.unkillable

    def kill_account(self, uid: int, timeout: float | None = None) -> bool:
        self.calls.append(("kill_account", str(uid)))
        if uid in self.unkillable:
            return False
        self.busy_accounts.discard(uid)
        return True

    def planned_cgroups(self, name: str) -> list[str]:
        return [self._cgroup(name)]

    def place_reaper(self, pid: int) -> list[str]:
        return []

    def reaper_unit(self, installation_id: str) -> str | None:
        return None

    def start_reaper(self, unit: str, command: list[str], directory: str) -> bool:
        return False


def _is_a_system_service(service: FakeService) -> SystemService:
    return service  # mypy holds the fake to the whole interface here


@dataclasses.dataclass
class RecordingRunner:
    """A `RunnerPort` that records what the handlers hand the runner (`calls`, in
    order), and answers as a test sets it up."""

    calls: list[tuple[str, tuple[str, ...]]] = dataclasses.field(default_factory=list)
    release_error: HostError | None = None
    """What `release_batch` answers for every attempt (None: released)."""
    reaped: set[str] = dataclasses.field(default_factory=set)
    """Attempts the lease reaper already stopped (`leases_renewed` reports them)."""
    live: dict[str, ResourceUsage] = dataclasses.field(default_factory=dict)
    """What `usage_now` reads for an attempt (absent: its service is not readable)."""
    kept_details: dict[str, str] = dataclasses.field(default_factory=dict)
    """What `details` answers for an attempt (the runtime's words of a failed start)."""

    def admitted(self, attempt_ids: Sequence[str]) -> None:
        self.calls.append(("admitted", tuple(attempt_ids)))

    def inputs_complete(self, attempt_id: str) -> None:
        self.calls.append(("inputs_complete", (attempt_id,)))

    def start_requested(self, attempt_ids: Sequence[str]) -> None:
        self.calls.append(("start_requested", tuple(attempt_ids)))

    def stop_requested(self, attempt_ids: Sequence[str]) -> None:
        self.calls.append(("stop_requested", tuple(attempt_ids)))

    def settled(self, attempt_ids: Sequence[str]) -> None:
        self.calls.append(("settled", tuple(attempt_ids)))

    async def release_batch(self, attempt_ids: Sequence[str]) -> list[HostError | None]:
        self.calls.append(("release", tuple(attempt_ids)))
        return [self.release_error] * len(attempt_ids)

    async def leases_renewed(self, records: Sequence[AttemptRecord]) -> frozenset[str]:
        ids = tuple(r.attempt_id for r in records)
        self.calls.append(("leases_renewed", ids))
        return frozenset(ids) & self.reaped

    async def usage_now(self, records: Sequence[AttemptRecord]) -> dict[str, ResourceUsage]:
        self.calls.append(("usage_now", tuple(r.attempt_id for r in records)))
        return {r.attempt_id: self.live[r.attempt_id] for r in records if r.attempt_id in self.live}

    def details(self, attempt_ids: Sequence[str]) -> dict[str, str]:
        return {a: self.kept_details[a] for a in attempt_ids if a in self.kept_details}


def _is_a_runner_port(runner: RecordingRunner) -> RunnerPort:
    return runner  # mypy holds the recorder to the whole port here


class FakeSlotFiles:
    """The attempt directories of one slot on a plain directory: no ownership changes
    and no check of the filesystem, so a test needs no root. A test makes a method
    refuse (`refusals`, by method name), the slot full (`full`) or sets what is in use
    on it (`used`). A missing part is `not_found`, as in the real layout."""

    def __init__(self, slot: Path) -> None:
        self.slot = slot
        self.refusals: dict[str, HostError] = {}
        self.full = False
        self.used = (0, 0)
        """What `in_use` reads: (bytes, inodes) in use on the slot's filesystem."""
        self.calls: list[tuple[str, str]] = []
        """(method, attempt ID or "") in call order, for the methods that change or
        check something."""
        self._paths = Layout(_SlotAt(str(slot)))

    def _called(self, method: str, attempt_id: str = "") -> None:
        self.calls.append((method, attempt_id))
        refusal = self.refusals.get(method)
        if refusal is not None:
            raise refusal

    def _dir(self, attempt_id: str) -> Path:
        return Path(self._paths.attempt_dir(attempt_id))

    def paths(self, attempt_id: str) -> AttemptPaths:
        return self._paths.paths(attempt_id)

    def verify(self) -> None:
        self._called("verify")

    def check(self) -> None:
        self._called("check")

    def create(self, attempt_id: str) -> AttemptPaths:
        self._called("create", attempt_id)
        for part in PARTS:
            (self._dir(attempt_id) / part.name).mkdir(parents=True, exist_ok=True)
        for name in (STDOUT, STDERR):
            (self._dir(attempt_id) / LOGS.name / name).touch()
        return self.paths(attempt_id)

    def storage_binding(self, attempt_id: str, limits: planlib.Limits) -> sdk.StorageBinding:
        self._called("storage_binding", attempt_id)
        fd = self.open_part(attempt_id, STORAGE)
        try:
            found = os.fstat(fd)
        finally:
            os.close(fd)
        return sdk.StorageBinding(
            path=self.paths(attempt_id).storage,
            device=found.st_dev,
            inode=found.st_ino,
            bytes=limits.storage_bytes,
            inodes=limits.storage_inodes,
        )

    def open_part(self, attempt_id: str, part: Part) -> int:
        flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
        try:
            return os.open(self._dir(attempt_id) / part.name, flags)
        except FileNotFoundError:
            where = f"{part.name} of attempt {attempt_id}"
            raise HostError(ErrorCode.NOT_FOUND, f"no {where}") from None

    def in_use(self) -> tuple[int, int]:
        return self.used

    def usage(self) -> slotfs.Usage:
        self._called("usage")
        free = 0 if self.full else 1 << 30
        return slotfs.Usage(free_bytes=free, free_inodes=free)

    def storage_freed(self, attempt_id: str) -> bool:
        return not (self._dir(attempt_id) / STORAGE.name).exists()

    def free_payload_data(self, attempt_id: str) -> None:
        self._called("free_payload_data", attempt_id)
        for part in (STORAGE, LOGS):
            shutil.rmtree(self._dir(attempt_id) / part.name, ignore_errors=True)

    def remove(self, attempt_id: str) -> None:
        self._called("remove", attempt_id)
        shutil.rmtree(self._dir(attempt_id), ignore_errors=True)

    def leftovers(self) -> list[str]:
        return sorted(
            f"{top}/{entry.name}"
            for top in (ATTEMPTS_DIRECTORY, STAGING_DIRECTORY)
            if (self.slot / top).is_dir()
            for entry in (self.slot / top).iterdir()
        )

    def exists(self, attempt_id: str) -> bool:
        """Whether the attempt's directory is there (for a test's assertions)."""
        return self._dir(attempt_id).exists()


@dataclasses.dataclass(frozen=True)
class _SlotAt:
    path: str
    uid: int = os.getuid()
    gid: int = os.getgid()


def _is_slot_files(files: FakeSlotFiles) -> SlotFiles:
    return files  # mypy holds the fake to the whole port here


Script = Callable[[Any], dict[str, Any]]
"""A scripted row: the row's context in, the provider's reply (a dict) out; it may
raise `sdk.Refused` (a refusal of this row) or block (a provider that hangs)."""


class ScriptedDriver:
    """A provider driver in this process, answering each row as the test scripts it.

    Unscripted rows succeed as a well-behaved provider's would: probe is ok, prepare
    returns a barrier (the host's own `/bin/sh`, which the gate's checks of a prepare
    result accept), start is started, observe reports `waiting` (no payload process
    exists to report), stop, collect and release succeed. `script[(method,
    attempt_id)]` replaces a row's answer; `calls` records every row, (method, attempt
    ID), in call order."""

    def __init__(self) -> None:
        self.script: dict[tuple[str, str], Script] = {}
        self.calls: list[tuple[str, str]] = []
        self._lock = threading.Lock()

    def count(self, method: str, attempt_id: str) -> int:
        """How many rows of `method` the attempt got."""
        with self._lock:
            return self.calls.count((method, attempt_id))

    def _rows(self, method: str, contexts: list[Any], default: Script) -> list[dict[str, Any]]:
        replies = []
        for context in contexts:
            with self._lock:
                self.calls.append((method, context.attempt_id))
            row = self.script.get((method, context.attempt_id), default)
            try:
                replies.append(row(context))
            except sdk.Refused as refused:
                replies.append(sdk.refusal(refused.code, refused.message))
        return replies

    def probe(self, contexts: list[Any]) -> list[dict[str, Any]]:
        return self._rows("probe", contexts, lambda _: sdk.reply(sdk.ProbeReply(ok=True)))

    def prepare(self, contexts: list[Any]) -> list[dict[str, Any]]:
        return self._rows("prepare", contexts, _prepared)

    def start(self, contexts: list[Any]) -> list[dict[str, Any]]:
        return self._rows("start", contexts, lambda _: sdk.reply(sdk.StartReply(started=True)))

    def observe(self, contexts: list[Any]) -> list[dict[str, Any]]:
        waiting = sdk.Observation(phase="waiting")
        return self._rows("observe", contexts, lambda _: sdk.reply(waiting))

    def stop(self, contexts: list[Any]) -> list[dict[str, Any]]:
        return self._rows("stop", contexts, lambda _: sdk.reply(sdk.StopReply(stopped=True)))

    def collect(self, contexts: list[Any]) -> list[dict[str, Any]]:
        return self._rows("collect", contexts, lambda _: sdk.reply(sdk.CollectReply(ok=True)))

    def release(self, contexts: list[Any]) -> list[dict[str, Any]]:
        released = sdk.ReleaseReply(released=True)
        return self._rows("release", contexts, lambda _: sdk.reply(released))


def _prepared(context: Any) -> dict[str, Any]:
    shell = os.path.realpath("/bin/sh")
    found = os.stat(shell)
    identity = sdk.Identity(device=found.st_dev, inode=found.st_ino)
    return sdk.reply(
        sdk.PrepareResult(
            argv=[shell, "-c", "exit 0"],
            barrier=sdk.BarrierSpec(path=shell, identity=identity),
            devices=[],
            mounts=[],
            generated_targets=[],
            positive_devices=[],
            negative_devices=[],
        )
    )
