"""Stand-ins for the two parts of the daemon that need root, for tests of the logic
around them: a system service kept in memory and a runner that records what the
request handlers hand it.

A fake proves nothing about the kernel: the real backends are tested against real
cgroups and real systemd units (root), and these fakes only let the handlers' and the
runner's own decisions run in the fast lane. Like httpcore's mock backend, `FakeService`
implements the whole interface (`SystemService`), so a test sees a type error, not a
missing method, when the interface grows.
"""

# ruff: noqa: D102  (each method is the interface's, documented there: SystemService, RunnerPort)

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

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


@dataclasses.dataclass
class FakeUnit:
    """One service as the fake keeps it; a test sets `members` and `exit_status`."""

    spec: ServiceSpec
    members: set[int] = dataclasses.field(default_factory=set)
    exit_status: int | None = None
    stopped: bool = False


class FakeService:
    """A `SystemService` in memory: services by name, accounts with live processes."""

    backend = "fake"

    def __init__(self) -> None:
        self.units: dict[str, FakeUnit] = {}
        self.busy_accounts: set[int] = set()
        """UIDs that still have a process somewhere (not idle until killed)."""
        self.calls: list[tuple[str, str]] = []
        """(method, service name or uid) in call order."""

    def _handle(self, name: str) -> ServiceHandle:
        return ServiceHandle(name, self.backend, 2, {"unified": f"/fake/{name}"}, None, None)

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
        self._unit(handle)
        return CgroupUsage()

    def exit_status(self, handle: ServiceHandle) -> int | None:
        return self._unit(handle).exit_status

    def stop(self, handle: ServiceHandle) -> None:
        self.calls.append(("stop", handle.name))
        unit = self._unit(handle)
        unit.members.clear()
        unit.stopped = True

    def is_idle(self, handle: ServiceHandle, uid: int) -> bool:
        return not self._unit(handle).members and uid not in self.busy_accounts

    def remove(self, handle: ServiceHandle) -> None:
        self.calls.append(("remove", handle.name))
        self.units.pop(handle.name, None)

    def adopt(self, name: str) -> ServiceHandle | None:
        return self._handle(name) if name in self.units else None

    def supervisor_cgroup(self, handle: ServiceHandle) -> str:
        return f"{handle.cgroups['unified']}/supervisor"

    def planned_supervisor_cgroup(self, name: str) -> str:
        return f"/fake/{name}/supervisor"

    def account_idle(self, uid: int) -> bool:
        return uid not in self.busy_accounts

    def kill_account(self, uid: int, timeout: float | None = None) -> bool:
        self.calls.append(("kill_account", str(uid)))
        self.busy_accounts.discard(uid)
        return True

    def planned_cgroups(self, name: str) -> list[str]:
        return [f"/fake/{name}"]

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
