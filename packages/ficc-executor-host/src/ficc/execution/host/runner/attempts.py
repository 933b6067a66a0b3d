"""One attempt as the runner sees it, and the steps every part of the runner shares.

`Attempt` gathers what the runner needs of an attempt: its record, plan, slot,
layout and service name. `AttemptWork` is the ground the runner's parts stand on (the
coordinator `pipeline.Runner`, the prepare pipeline `preparing.Preparer` and the
start pipeline `starting.Starter`), built from the parts they share (`Shared`):
blocking calls go through the daemon's threads (`HostWork`: the ledger thread, the
file I/O pool) so the event loop never blocks; an attempt is loaded from the ledger;
its provider context is built; and every outcome is recorded in the ledger as a
lifecycle event, waking the monitor when the attempt ended.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable, Sequence
from typing import Any, Final, TypeVar, cast

import msgspec

from ficc.execution import plan as planlib
from ficc.execution import provider as sdk
from ficc.execution.errors import ErrorCode
from ficc.execution.host.context.parts import PROVIDER_CALL_TIMEOUT_S, HostContext, SlotRuntime
from ficc.execution.host.core import leases, lifecycle
from ficc.execution.host.core.codes import HostCode
from ficc.execution.host.core.errors import HostError
from ficc.execution.host.core.records import ResourceUsage
from ficc.execution.host.gate.expectation import DEFAULT_NOFILE
from ficc.execution.host.ledger.store import AttemptRecord
from ficc.execution.host.providers.driver import RowResult
from ficc.execution.host.runner.batching import PROVIDER_TIMEOUT, Batcher
from ficc.execution.host.runner.monitor import TICK_SECONDS, Monitor
from ficc.execution.host.service.interface import CgroupUsage, ServiceHandle, SystemService
from ficc.execution.host.storage.layout import AttemptPaths, provider_context, service_name
from ficc.execution.host.storage.slot_files import SlotFiles
from ficc.execution.provider import Observation

__all__ = [
    "INTERNAL_ERROR",
    "Attempt",
    "AttemptWork",
    "Decoded",
    "HostWork",
    "Settings",
    "Shared",
    "WallTimes",
    "decoded_reply",
    "gather_logged",
    "observation_of",
    "row_error",
]

_log = logging.getLogger(__name__)

INTERNAL_ERROR: Final = "internal_error"
"""A bug in the host, not a refusal: the attempt fails closed and is cleaned up."""
_R = TypeVar("_R", bound=msgspec.Struct)


@dataclasses.dataclass(frozen=True)
class Settings:
    """Timing and host policy of the runner (the daemon may take them from config)."""

    tick: float = TICK_SECONDS
    provider_timeout: float = PROVIDER_CALL_TIMEOUT_S
    start_timeout: float = 120.0
    """How long start waits for the barrier's PID."""
    observe_interval: float = 0.01
    rescan_ticks: int = 25
    """Every this many ticks the monitor reads every record, not just the watched ones."""
    wind_down: float = 5.0
    """How long the service's main process may outlive a payload that exited by itself
    before cleanup stops the service: the runtime's own teardown (Podman removes the
    container, which spares the release a second start of Podman). Longer means
    stuck: it is killed."""
    nofile: int = DEFAULT_NOFILE
    user_namespace: bool = True
    cgroup_namespace: bool = True


# --- provider replies ---------------------------------------------------------------


def observation_of(result: RowResult) -> Observation:
    if result.reply is None:
        raise HostError(result.code or ErrorCode.PROVIDER_FAILED, result.message or "")
    return decoded_reply(result, "observe", Observation)


def decoded_reply(result: RowResult, method: str, kind: type[_R]) -> _R:
    """A row's reply as its SDK Struct, or `provider_malformed`."""
    try:
        return sdk.decode_reply(method, result.reply, kind)
    except (msgspec.ValidationError, ValueError) as error:
        raise HostError(HostCode.PROVIDER_MALFORMED, f"{method} returned {error}") from error


PASSED_THROUGH = frozenset(
    {PROVIDER_TIMEOUT, ErrorCode.PROVIDER_UNAVAILABLE, ErrorCode.INPUT_CHANGED}
)
"""Provider refusal codes kept as the attempt's reason: each means to a controller what
the host's own code means (`input_changed`: a staged input is no longer the file that
completed, found by the provider's check of its own link). Any other becomes
`provider_failed` (`probe_failed` for probe), with the provider's message in the log."""


def row_error(result: RowResult, method: str) -> HostError:
    code = result.code or ErrorCode.PROVIDER_FAILED
    if code not in PASSED_THROUGH:
        code = HostCode.PROBE_FAILED if method == "probe" else ErrorCode.PROVIDER_FAILED
    return HostError(code, f"provider {method}: {result.message or 'no reply'}")


# --- one attempt, as the runner sees it ---------------------------------------------


@dataclasses.dataclass(frozen=True)
class Attempt:
    record: AttemptRecord
    plan: planlib.Plan
    slot: SlotRuntime
    paths: AttemptPaths
    service: str

    @property
    def id(self) -> str:
        return self.record.attempt_id

    @property
    def provider(self) -> str:
        return self.plan.job.runtime.provider

    @property
    def files(self) -> SlotFiles:
        """The attempt directories of its slot."""
        return self.slot.files


class HostWork:
    """Work on the host context whose blocking calls run in the daemon's threads."""

    def __init__(self, ctx: HostContext) -> None:
        self._ctx = ctx

    async def _db(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await self._ctx.workers.db(fn, *args)

    async def _io(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await self._ctx.workers.io(fn, *args)


@dataclasses.dataclass(eq=False)
class WallTimes:
    """Boot-clock instants (ns) of each payload's release and of its end, as this daemon
    saw them: what an attempt's `wall_ms` is measured between. Kept in memory only: a
    payload that outlives its daemon ends `unknown`, and its wall time is not known."""

    released: dict[str, int] = dataclasses.field(default_factory=dict)
    ended: dict[str, int] = dataclasses.field(default_factory=dict)

    def wall_ms(self, attempt_id: str, now_ns: int) -> int | None:
        """From release to the payload's end (or to `now_ns` while it runs); None when
        this daemon did not see the release."""
        released = self.released.get(attempt_id)
        if released is None:
            return None
        return max(0, self.ended.get(attempt_id, now_ns) - released) // 1_000_000

    def forget(self, attempt_id: str) -> None:
        self.released.pop(attempt_id, None)
        self.ended.pop(attempt_id, None)


class Decoded:
    """What never changes of an attempt once recorded, decoded once: its plan (fixed at
    admission) and its prepared result (fixed by `prepare_ok`).

    Why: the runner reads both on every observe of a starting attempt (every 10 ms)
    and at every step after it; reading them from the ledger and decoding them each
    time was a tenth of the daemon's busy time with short jobs. Neither is ever
    rewritten, and records are never deleted, so an attempt ID names one plan and one
    prepared result for the ledger's life. Bounded by the bytes
    they were decoded from (`MOST_BYTES`, the oldest go first), and an attempt's are
    dropped at its release. The storage binding is still verified on every use.
    """

    MOST_BYTES: Final = 2 << 20

    def __init__(self) -> None:
        self._kept: dict[tuple[str, str], tuple[Any, int]] = {}
        """(kind, attempt ID) -> (value, bytes), oldest first."""
        self._bytes = 0

    def plan(self, attempt_id: str) -> planlib.Plan | None:
        found = self._kept.get(("plan", attempt_id))
        return None if found is None else cast(planlib.Plan, found[0])

    def prepared(self, attempt_id: str) -> sdk.PrepareResult | None:
        found = self._kept.get(("prepared", attempt_id))
        return None if found is None else cast(sdk.PrepareResult, found[0])

    def keep_plan(self, attempt_id: str, plan: planlib.Plan, size: int) -> None:
        self._keep(("plan", attempt_id), plan, size)

    def keep_prepared(self, attempt_id: str, prepared: sdk.PrepareResult, size: int) -> None:
        self._keep(("prepared", attempt_id), prepared, size)

    def forget(self, attempt_id: str) -> None:
        for key in (("plan", attempt_id), ("prepared", attempt_id)):
            found = self._kept.pop(key, None)
            if found is not None:
                self._bytes -= found[1]

    def _keep(self, key: tuple[str, str], value: object, size: int) -> None:
        if key in self._kept or size > self.MOST_BYTES:
            return
        self._kept[key] = (value, size)
        self._bytes += size
        while self._bytes > self.MOST_BYTES:
            self._bytes -= self._kept.pop(next(iter(self._kept)))[1]


@dataclasses.dataclass(frozen=True, eq=False)
class Shared:
    """The parts every part of the runner works with; one of each per runner."""

    ctx: HostContext
    settings: Settings
    batcher: Batcher
    monitor: Monitor
    handles: dict[str, ServiceHandle]
    """attempt ID -> the service this daemon created for it (until its release)."""
    walls: WallTimes = dataclasses.field(default_factory=WallTimes)
    details: dict[str, str] = dataclasses.field(default_factory=dict)
    """attempt ID -> what the runtime printed when its start failed before the release
    (shown on observe rows that ask for `detail`; until the release or a restart)."""
    decoded: Decoded = dataclasses.field(default_factory=Decoded)


class AttemptWork(HostWork):
    """A part of the runner: the shared parts, and the steps every part takes on an
    attempt (see the module docstring)."""

    def __init__(self, shared: Shared) -> None:
        super().__init__(shared.ctx)
        self._settings = shared.settings
        self._batcher = shared.batcher
        self._monitor = shared.monitor
        self._handles = shared.handles
        self._walls = shared.walls
        self._details = shared.details
        self._decoded = shared.decoded

    async def _apply(
        self,
        record: AttemptRecord,
        event: lifecycle.AnyEvent,
        usage: ResourceUsage | None = None,
    ) -> bool:
        """Record an event (with the usage it settles with); False (logged) when the
        lifecycle refuses it."""
        try:
            await self._db(self._ctx.ledger.apply, record.fence, event, usage)
        except HostError as error:
            _log.info("attempt %s: %s not recorded (%s)", record.attempt_id, event.name, error)
            return False
        if event.name in ("prepare_failed", "start_failed", "outcome_lost", "finished"):
            self._monitor.wake()
        return True

    async def _refused(
        self, record: AttemptRecord, event: lifecycle.AnyEvent, error: HostError
    ) -> None:
        """Record a failure; the ledger keeps only its code, so the operator's log gets
        the message that says what went wrong (a provider's refusal text, with what its
        runtime printed, say), at error priority: a prepare or start that failed needs
        the administrator's eyes (`journalctl -u ficc-executor-host -p err`)."""
        _log.error("attempt %s: %s: %s", record.attempt_id, event.name, error)
        await self._apply(record, event)

    async def _usage(self, attempt: Attempt, handle: ServiceHandle | None) -> ResourceUsage:
        """What the attempt used up to now: its service's counters (none without a
        service), the slot's bytes and inodes in use, and the wall time since release."""
        wall = self._walls.wall_ms(attempt.id, self._ctx.clock.now().boottime_ns)
        used: ResourceUsage = await self._io(
            _read_usage, self._ctx.service, handle, attempt.slot, wall
        )
        return used

    def lease_current(self, record: AttemptRecord) -> bool:
        lease = record.lease
        return lease is not None and leases.is_current(lease, self._ctx.clock.now())

    async def _service(self, attempt: Attempt) -> ServiceHandle | None:
        """The attempt's service: the handle this daemon created, or adopted by name."""
        return self._handles.get(attempt.id) or await self._io(
            self._ctx.service.adopt, attempt.service
        )

    async def _attempt(self, record: AttemptRecord) -> Attempt:
        plan = self._decoded.plan(record.attempt_id)
        if plan is None:
            data = await self._db(self._ctx.ledger.plan_bytes, record.attempt_id)
            plan = planlib.decode_plan(data)
            self._decoded.keep_plan(record.attempt_id, plan, len(data))
        if record.slot_id is None or record.slot_id not in self._ctx.slots:
            raise HostError(
                ErrorCode.SLOT_UNKNOWN, f"attempt {record.attempt_id} holds no configured slot"
            )
        slot = self._ctx.slots[record.slot_id]
        name = service_name(self._ctx.config.installation_id, record.attempt_id)
        return Attempt(record, plan, slot, slot.files.paths(record.attempt_id), name)

    def _context(
        self,
        attempt: Attempt,
        storage: sdk.StorageBinding,
        inputs: Sequence[sdk.InputCapability] = (),
        prepared: sdk.PrepareResult | None = None,
    ) -> sdk.Context:
        """The provider context of the contract (prepare adds `check`; later ones `prepared`)."""
        return provider_context(
            plan=attempt.plan,
            plan_digest=attempt.record.plan_digest,
            slot=attempt.slot,
            paths=attempt.paths,
            service=attempt.service,
            cgroup=self._ctx.service.planned_supervisor_cgroup(attempt.service),
            backend=self._ctx.service.backend,
            storage=storage,
            inputs=inputs,
            prepared=prepared,
        )

    async def _later_context(
        self,
        attempt: Attempt,
        *,
        inputs: Sequence[sdk.InputCapability] = (),
    ) -> sdk.Context:
        """Context for start/observe/stop/release: with the persisted prepared result and
        the storage binding verified, as for probe and prepare. A binding that cannot be
        verified is never handed to a provider: `storage_unverified` (start and release
        refuse, observe records the outcome as lost, a stop kills the service without
        the provider's stop), so no provider acts on a path the daemon cannot vouch for."""
        prepared = self._decoded.prepared(attempt.id)
        if prepared is None:
            data = await self._db(self._ctx.ledger.prepare_result, attempt.id)
            if data is not None:
                prepared = msgspec.json.decode(data, type=sdk.PrepareResult)
                self._decoded.keep_prepared(attempt.id, prepared, len(data))
        try:
            storage = await self._io(
                attempt.files.storage_binding, attempt.id, attempt.plan.job.limits
            )
        except OSError as error:
            raise HostError(
                HostCode.STORAGE_UNVERIFIED,
                f"the storage binding of attempt {attempt.id} cannot be verified ({error});"
                " check the slot's filesystem and the attempt directory",
            ) from error
        return self._context(attempt, storage, inputs, prepared)

    async def _inputs(self, attempt: Attempt) -> list[sdk.InputCapability]:
        if not attempt.plan.streamed_inputs:
            return []
        caps: list[sdk.InputCapability] = await self._io(
            attempt.slot.stager.capabilities, attempt.id
        )
        return caps


# --- blocking helpers (run in worker threads) ---------------------------------------


def _read_usage(
    service: SystemService, handle: ServiceHandle | None, slot: SlotRuntime, wall_ms: int | None
) -> ResourceUsage:
    """The blocking part of `AttemptWork._usage`. What cannot be read is None (logged:
    a counter that fails to read is worth an operator's look, never a guess)."""
    counters = CgroupUsage()
    if handle is not None:
        try:
            counters = service.usage(handle)
        except (HostError, OSError) as error:
            _log.warning("service %s: usage not readable: %s", handle.name, error)
    storage: tuple[int | None, int | None] = (None, None)
    try:
        storage = slot.files.in_use()
    except OSError as error:
        _log.warning("slot %s: usage not readable: %s", slot.path, error)
    return ResourceUsage(
        **msgspec.structs.asdict(counters),
        storage_bytes=storage[0],
        storage_inodes=storage[1],
        wall_ms=wall_ms,
    )


async def gather_logged(jobs: Any) -> None:
    for result in await asyncio.gather(*jobs, return_exceptions=True):
        if isinstance(result, Exception):
            _log.error("runner job failed: %r", result)
        elif isinstance(result, BaseException):
            raise result
