"""The daemon's composition root: build every part once, recover, dispatch requests.

`Daemon.open(config)` builds, synchronously and in order: the host checks
(`check_host`), the ledger (opened, or created on the very first start), the
providers (each verified against its pin and loaded; a refusal makes that provider
unavailable, recorded with its code, and is not fatal), one stager per slot, the
system-service backend, the worker threads, the `HostContext` and the runner.
The context captures what the daemon runs (its versions and its start) once, here,
before it serves (`context/build.py`). `start()` runs startup recovery
(`Runner.recover`) and then the monitor loop and the slots' health checks every
`slot_check_seconds` (`context/slot_health.py`);
`dispatch()` is the one entry point of the server; `close()` stops everything.

The ledger is created only when the state directory holds neither a ledger nor the
marker left by a previous one (`ledger.created`, written right after creation). A
missing ledger after one existed is refused (`ledger_missing`), never silently
recreated: a new ledger has a new `ledger_id`, and every controller binding saved
against the old one would silently stop proving anything.

Supervisors: `systemd` (transient units bound to the daemon's own unit) or `cgroupfs`
(cgroups the daemon creates itself); `auto` picks `systemd` when PID 1 is systemd.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Callable, Sequence
from typing import Protocol

from ficc.execution._executor import ReceivedRequest
from ficc.execution.errors import ErrorCode
from ficc.execution.host.api import handlers, inputs, port, reports
from ficc.execution.host.api import slots as slot_reports
from ficc.execution.host.config import ceiling
from ficc.execution.host.config.host import check_host, open_image_parent
from ficc.execution.host.config.model import Config, Provider
from ficc.execution.host.context.parts import HostContext, ProviderRuntime, SlotRuntime, Workers
from ficc.execution.host.core import metrics
from ficc.execution.host.core.codes import HostCode
from ficc.execution.host.core.errors import HostError
from ficc.execution.host.ledger import space as ledger_space
from ficc.execution.host.ledger.store import LEDGER_FILE, Ledger
from ficc.execution.host.linux import fsutil, notify
from ficc.execution.host.linux.clock import BootClock
from ficc.execution.host.providers.loader import load_provider
from ficc.execution.host.service.cgroupfs import CgroupfsService
from ficc.execution.host.service.interface import SystemService
from ficc.execution.host.service.systemd import SystemdService
from ficc.execution.host.storage.slot_files import ReservedSlot
from ficc.execution.host.storage.staging import Stager
from ficc.execution.protocol import Sender
from ficc.execution.wire import AnyReply

__all__ = [
    "LEDGER_HELD",
    "LEDGER_MARKER",
    "Daemon",
    "RunnerLike",
    "check_ledger",
    "check_ledger_present",
    "check_providers",
    "open_ledger",
    "service_backend",
]

_log = logging.getLogger(__name__)

LEDGER_MARKER = "ledger.created"
"""Written in the state directory right after the ledger is created; never removed."""


class RunnerLike(port.RunnerPort, Protocol):
    """The runner as the daemon drives it (pipeline.Runner)."""

    async def recover(self) -> None: ...
    async def run(self) -> None: ...
    async def close(self) -> None: ...


RunnerFactory = Callable[[HostContext], RunnerLike]


def _default_runner(ctx: HostContext) -> RunnerLike:
    from ficc.execution.host.runner.pipeline import (  # noqa: PLC0415 - keeps the import cheap
        Runner,
        Settings,
    )

    # The monitor feeds systemd's watchdog: its ticks stopping is what must restart us.
    settings = Settings(provider_timeout=float(ctx.config.provider_timeout_seconds))
    beat = notify.Heartbeat.from_environment().beat
    runner: RunnerLike = Runner(ctx, settings=settings, on_tick=beat)
    return runner


class Daemon:
    """The running executor host (see the module docstring)."""

    def __init__(self, ctx: HostContext, runner: RunnerLike) -> None:
        self.ctx = ctx
        self.runner = runner
        self._monitor: asyncio.Task[None] | None = None
        self._textfile: asyncio.Task[None] | None = None
        self._slot_checks: asyncio.Task[None] | None = None
        self._closed = False

    @classmethod
    def open(
        cls,
        config: Config,
        *,
        provider_path: list[str] | None = None,
        runner_factory: RunnerFactory | None = None,
        service: SystemService | None = None,
        host_check: Callable[[Config], None] = check_host,
    ) -> Daemon:
        """Build every part (synchronously). Refusals raise HostError with their code.
        `host_check` is `check_host`; a unit test of request handling may check only
        the directories (`config.check_directories`)."""
        host_check(config)
        clock = BootClock()
        ledger = open_ledger(config)
        try:
            providers = load_providers(config, provider_path)
            slots = {
                s.id: SlotRuntime(
                    id=s.id,
                    slot_class=s.slot_class,
                    path=s.path,
                    uid=s.uid,
                    gid=s.gid,
                    storage_bytes=s.storage_bytes,
                    storage_inodes=s.storage_inodes,
                    filesystem_uuid=s.filesystem_uuid,
                    stager=Stager(s.path, s.gid),
                    files=ReservedSlot(s, open_image_parent),
                )
                for s in config.slots
            }
            backend = service if service is not None else service_backend(config.supervisor)
            ctx = HostContext(
                config=config,
                ledger=ledger,
                clock=clock,
                slots=slots,
                providers=providers,
                service=backend,
                workers=Workers(),
            )
            runner = (runner_factory or _default_runner)(ctx)
        except BaseException:
            ledger.close()
            raise
        return cls(ctx, runner)

    async def start(self) -> None:
        """Startup recovery (before the server listens), then the monitor loop, the
        slots' health checks (and the metrics textfile writer when `metrics_textfile`
        is configured)."""
        await self.runner.recover()
        loop = asyncio.get_running_loop()
        self._monitor = loop.create_task(self.runner.run())
        self._slot_checks = loop.create_task(check_slots_forever(self.ctx))
        if self.ctx.config.metrics_textfile is not None:
            self._textfile = loop.create_task(write_metrics_textfile(self.ctx))

    async def dispatch(self, sender: Sender, uid: int, request: ReceivedRequest) -> AnyReply:
        """Answer one request (authority already checked by the server)."""
        return await handlers.handle(self.ctx, self.runner, sender, request)

    def input_chunk_bytes(self) -> int:
        return inputs.INPUT_CHUNK_BYTES

    async def close(self) -> None:
        """Stop the monitor and the runner's tasks, the worker threads, the ledger."""
        if self._closed:
            return
        self._closed = True
        for task in (self._textfile, self._slot_checks, self._monitor):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        for group in self.ctx.groups.values():
            await group.close()
        await self.runner.close()
        await asyncio.get_running_loop().run_in_executor(None, self.ctx.workers.shutdown)
        self.ctx.ledger.close()


# --- parts -----------------------------------------------------------------------------

METRICS_TEXTFILE_SECONDS = 15.0
"""How often `metrics_textfile` is rewritten (node_exporter reads it when scraped)."""


async def write_metrics_textfile(
    ctx: HostContext, interval: float = METRICS_TEXTFILE_SECONDS
) -> None:
    """Rewrite `metrics_textfile` atomically (mode 0644) every `interval` seconds; a
    failed write is logged and retried on the next round, never fatal."""
    path = ctx.config.metrics_textfile
    assert path is not None
    directory, name = os.path.split(path)
    while True:
        try:
            health = slot_reports.health_now(ctx)
            facts = await ctx.workers.db(reports.metric_facts, ctx, health)
            text = metrics.render(facts, metrics.PROCESS).encode()
            await asyncio.to_thread(_replace_file, directory, name, text)
        except (OSError, HostError) as error:
            _log.warning("metrics_textfile %s not written: %s", path, error)
        await asyncio.sleep(interval)


async def check_slots_forever(ctx: HostContext) -> None:
    """Check every slot's health every `slot_check_seconds` (context/slot_health.py): a
    broken slot stays out of the offer until a check passes. A round that fails
    unexpectedly is logged and the next one runs: the schedule must not die of it."""
    while True:
        await asyncio.sleep(ctx.config.slot_check_seconds)
        try:
            await ctx.slot_health.check(ctx.workers, ctx.slots.values())
        except Exception:
            _log.exception("the slots' health check failed; retrying on the next round")


def _replace_file(directory: str, name: str, data: bytes) -> None:
    dir_fd = fsutil.open_dir(directory)
    try:
        fsutil.atomic_replace(dir_fd, name, data, 0o644)
    finally:
        os.close(dir_fd)


def check_ledger_present(config: Config) -> tuple[bool, bool]:
    """(ledger exists, marker exists); refuses a ledger that existed and is gone."""
    state_fd = fsutil.open_dir(config.state_dir)
    try:
        has_ledger = fsutil.exists_at(state_fd, LEDGER_FILE)
        has_marker = fsutil.exists_at(state_fd, LEDGER_MARKER)
    finally:
        os.close(state_fd)
    if not has_ledger and has_marker:
        raise HostError(
            HostCode.LEDGER_MISSING,
            f"{config.state_dir}/{LEDGER_FILE} is missing but {LEDGER_MARKER} shows a ledger"
            " existed: restore it from backup; a new ledger would silently invalidate every"
            " saved admission binding",
        )
    return has_ledger, has_marker


def check_ledger(config: Config) -> str:
    """The ledger checks `serve` makes before it listens, changing nothing: a ledger that
    existed is still there, opens, passes its integrity check and belongs to this
    installation. Returns what was found; a ledger another process holds is not opened a
    second time (that daemon checked it when it started), and is answered LEDGER_HELD,
    because serve would refuse to start while it is held. On a full
    filesystem the check cannot open the ledger without spending its reserve, which it
    must not do: if the reserve is there, `serve` will spend it and check the ledger
    itself, so that is no refusal; without one, `serve` could not open it either."""
    has_ledger, _ = check_ledger_present(config)
    if not has_ledger:
        return "none yet (serve creates it on its first start)"
    try:
        ledger = Ledger.open(config.state_dir, config.installation_id, spend_reserve=False)
        try:
            check_slots_kept(config, ledger)
        finally:
            ledger.close()
    except HostError as error:
        if error.code == ErrorCode.LEDGER_FULL and _has_reserve(config.state_dir):
            return (
                f"not checked: {config.state_dir}'s filesystem is full and opening the ledger"
                f" needs the space of {ledger_space.RESERVE_FILE}, which only serve spends;"
                " serve opens and checks it, with admission closed until there is room for"
                " the reserve again: free space on that filesystem"
            )
        if error.code != HostCode.LEDGER_BUSY:
            raise
        return LEDGER_HELD
    return "ok"


LEDGER_HELD = (
    "held by a running daemon: serve would refuse to start now (ledger_busy); the rest of"
    " the configuration is checked. Stop that daemon before starting one with this"
    " configuration (an upgrade checks the new release this way while the old one runs)"
)
"""check_ledger's answer when another process holds the ledger (check-config exit 5)."""


def _has_reserve(state_dir: str) -> bool:
    state_fd = fsutil.open_dir(state_dir)
    try:
        return ledger_space.has_reserve(state_fd)
    finally:
        os.close(state_fd)


def open_ledger(config: Config) -> Ledger:
    """Open the ledger, or create it on the very first start (see the module docstring)."""
    has_ledger, has_marker = check_ledger_present(config)
    if has_ledger:
        ledger = Ledger.open(config.state_dir, config.installation_id)
    else:
        ledger = Ledger.create(
            config.state_dir,
            config.installation_id,
            ceiling.initial_limits(config),
            ceiling.ceiling_limits(config),
            config.initial_offer.control,
        )
    try:
        check_slots_kept(config, ledger)
        ledger.bound_space(config.space_bounds())
        if not has_marker:
            _write_marker(config.state_dir, ledger.bindings().ledger_id)
    except BaseException:
        ledger.close()
        raise
    return ledger


def check_slots_kept(config: Config, ledger: Ledger) -> None:
    """Refuse to start (`slot_removed`) while the ledger holds an unreleased attempt on
    a slot the configuration no longer has: its files, its account's processes and its
    release are found only through the slot's configuration, and without it the
    daemon would answer that attempt as if it never ran (empty logs, no cleanup)."""
    occupied, _ = ledger.reservations()
    missing = sorted(occupied - {s.id for s in config.slots})
    if missing:
        raise HostError(
            HostCode.SLOT_REMOVED,
            f"the ledger holds unreleased attempts on slot(s) {', '.join(missing)}, which"
            " the configuration no longer has: put each back (same id, path, account and"
            " filesystem) and start the daemon, release those attempts, then remove the"
            " slot from the configuration",
        )


def _write_marker(state_dir: str, ledger_id: str) -> None:
    state_fd = fsutil.open_dir(state_dir)
    try:
        fsutil.atomic_replace(state_fd, LEDGER_MARKER, f"{ledger_id}\n".encode(), 0o600)
    finally:
        os.close(state_fd)


def check_providers(
    config: Config, provider_path: Sequence[str] | None
) -> list[tuple[str, HostError | None]]:
    """Each provider's id and its refusal (None: available), as `serve` would load it."""
    return [(p.id, _load_one(p, provider_path).refusal) for p in config.providers]


def _load_one(provider: Provider, provider_path: Sequence[str] | None) -> ProviderRuntime:
    pin = provider.package_digest
    try:
        loaded = load_provider(provider.id, pin, provider.configuration, provider_path)
    except HostError as error:
        return ProviderRuntime(provider.id, pin, None, error)
    return ProviderRuntime(provider.id, pin, loaded, None)


def load_providers(
    config: Config, provider_path: Sequence[str] | None
) -> dict[str, ProviderRuntime]:
    """Verify and load each configured provider; a refusal makes it unavailable
    (reported in the log, `status`, the snapshot and the metrics; not fatal)."""
    providers: dict[str, ProviderRuntime] = {}
    for provider in config.providers:
        runtime = _load_one(provider, provider_path)
        if runtime.refusal is not None:
            _log.error("provider %s unavailable: %s", provider.id, runtime.refusal)
        providers[provider.id] = runtime
    return providers


def _pid1_is_systemd() -> bool:
    try:
        with open("/proc/1/comm", "rb") as comm:
            return comm.read(64).strip() == b"systemd"
    except OSError:
        return False


def service_backend(supervisor: str, *, bound_to_daemon: bool = True) -> SystemService:
    """The system-service backend the configuration asks for. The daemon's attempt
    units are bound to its own unit (a daemon stop stops them); a tool run from a
    shell (the conformance kit) cleans up its own and is in no service unit."""
    if supervisor == "auto":
        supervisor = "systemd" if _pid1_is_systemd() else "cgroupfs"
    if supervisor == "systemd":
        return SystemdService(bind_to_own_unit=bound_to_daemon)
    return CgroupfsService()
