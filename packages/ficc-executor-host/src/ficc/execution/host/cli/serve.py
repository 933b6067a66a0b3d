"""`serve`: the daemon in the foreground, as its unit runs it; JSON log lines, the
event loop, readiness and the watchdog, and a clean stop on SIGTERM."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import importlib
import logging
import os
import platform
import signal
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any, Protocol

from ficc.execution.host.cli.exits import (
    EXIT_OK,
)
from ficc.execution.host.cli.versions import versions
from ficc.execution.host.config.host import check_accounts, check_host, check_metrics_textfile
from ficc.execution.host.config.load import load_config
from ficc.execution.host.config.model import Config
from ficc.execution.host.core import metrics
from ficc.execution.host.daemon import logs
from ficc.execution.host.daemon.peercred import socket_paths
from ficc.execution.host.daemon.server import Dispatcher, ServerLimits, serve, stderr_log
from ficc.execution.host.linux import notify
from ficc.execution.protocol import PROTOCOL_VERSION
from ficc.execution.provider import taskindex, tasks

DAEMON_MODULE = "ficc.execution.host.daemon.root"


class Daemon(Dispatcher, Protocol):
    """What `serve` needs from `ficc.execution.host.daemon.root.Daemon` beyond dispatching."""

    async def start(self) -> None: ...

    async def close(self) -> None: ...


def _open_daemon(config: Config, provider_path: list[str] | None) -> Daemon:
    """`Daemon.open(config, provider_path=...)`, imported only when serving."""
    module = importlib.import_module(DAEMON_MODULE)
    daemon: Daemon = module.Daemon.open(config, provider_path=provider_path)
    return daemon


def checked_config(path: str) -> Config:
    """The configuration at `path`, after every host check that needs no ledger.

    `serve` and `check-config` both call this, so check-config runs exactly the checks
    serve runs before it opens anything.
    """
    config = load_config(path)
    check_host(config)
    check_accounts(config)
    check_metrics_textfile(config)
    return config


def _log_starting() -> None:
    found = versions()
    stderr_log(
        log_line(
            "info",
            "starting",
            pid=os.getpid(),
            version=found["ficc-executor-host"],
            ficc_protocol_version=found["ficc-protocol"],
            protocol=PROTOCOL_VERSION,
            python=platform.python_version(),
        )
    )


SWITCH_INTERVAL_S = 0.001
"""How long a thread that holds the GIL may keep it from one that waits (Python's
default is 5 ms). The event loop, the ledger thread and the I/O threads hand the GIL
to each other many times a request (every SQLite step and file read gives it up), and
at 5 ms each hand-off could cost a request milliseconds: 64-row observes from 8
clients answered in 12-18 ms at the default, 8-12 ms at 1 ms (P8)."""


def serve_command(args: argparse.Namespace) -> int:
    logs.set_level(args.log_level)
    _log_json_lines(args.log_level)
    _log_starting()  # first, so even a refused configuration is logged with the versions
    config = checked_config(args.config)
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    with asyncio.Runner(loop_factory=_loop_factory()) as runner:
        runner.run(run_daemon(config, args.provider_path))
    return EXIT_OK


class _JsonLines(logging.Handler):
    """The daemon's `logging` records as JSON lines, like the server's own events."""

    def emit(self, record: logging.LogRecord) -> None:
        line: dict[str, Any] = {
            "ts": record.created,
            "level": record.levelname.lower(),
            "event": "log",
            "logger": record.name,
            "message": record.getMessage(),
        }
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict):
            line.update(fields)  # a structured event: its own `event` name and fields
        if record.exc_info:
            line["traceback"] = "".join(traceback.format_exception(*record.exc_info))
        try:
            stderr_log(line)
        except Exception:  # a log line must never take the daemon down
            self.handleError(record)


def _log_json_lines(level: str = "info") -> None:
    root = logging.getLogger()
    root.handlers[:] = [_JsonLines()]
    root.setLevel(level.upper())


def _loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop's loop when it is installed (it is a dependency), else asyncio's."""
    try:
        uvloop = importlib.import_module("uvloop")
    except ImportError:  # pragma: no cover - uvloop is a declared dependency
        return None
    factory: Callable[[], asyncio.AbstractEventLoop] = uvloop.new_event_loop
    return factory


async def run_daemon(
    config: Config,
    provider_path: list[str] | None = None,
    *,
    limits: ServerLimits | None = None,
    open_daemon: Callable[[Config, list[str] | None], Daemon] | None = None,
) -> None:
    """Open, recover, listen, report READY=1, serve until SIGTERM/SIGINT, close.

    A refusal while opening or listening (a HostError) propagates after whatever was
    opened is closed again; `main` prints it and exits 1.
    """
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    told = start_task_index()
    daemon = (open_daemon or _open_daemon)(config, provider_path)
    try:
        await daemon.start()
        await _serve_until(daemon, config, limits or ServerLimits(), stop)
    finally:
        await daemon.close()
        stop_task_index(told)
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(signum)
        gc.unfreeze()
        stderr_log(log_line("info", "stopped"))


def start_task_index() -> taskindex.Told | None:
    """Let the kernel tell this process of every fork, exec, credential change and
    exit (the proc connector), so that "is anything of this slot account left?"
    (the cleanup's, the release's and the provider's checks) is answered from an index
    instead of a walk of every thread on the host. Subscribed before the recovery's
    first cleanup check; where the connector cannot be had, the checks walk as
    before, and the log says why."""
    told = taskindex.Told()
    why = told.start()
    if why is not None:
        tasks.SHARED.use(None, why)
        stderr_log(log_line("warning", "task_index", source="walks of /proc", reason=why))
        return None
    tasks.SHARED.use(told)
    metrics.PROCESS.task_index = told
    stderr_log(log_line("info", "task_index", source="process events", tasks=told.stats().tasks))
    return told


def stop_task_index(told: taskindex.Told | None) -> None:
    """Back to walks, then close the connector's socket."""
    if told is not None:
        tasks.SHARED.use(None, "the daemon stopped its task index")
        metrics.PROCESS.task_index = None
        told.close()


def _set_startup_aside() -> None:
    """Once ready: collect, then put every object startup made (modules, the
    configuration, the providers, what recovery read) out of the cyclic collector's
    sight (`gc.freeze`). They live as long as the daemon, and a full collection
    stops every thread while it walks them: 18 ms once the daemon was serving (P8),
    1 ms with them set aside. The stop gives them back (`gc.unfreeze`)."""
    gc.collect()
    gc.freeze()


async def _serve_until(
    daemon: Daemon, config: Config, limits: ServerLimits, stop: asyncio.Event
) -> None:
    endpoints = list(socket_paths(config))

    def ready() -> None:
        _set_startup_aside()
        status = f"serving {len(endpoints)} sockets in {config.socket_dir}"
        try:
            notify.ready(status)
        except (OSError, ValueError) as exc:  # systemd will time the start out; say why
            stderr_log(log_line("error", "notify_failed", error=str(exc)))
        stderr_log(log_line("info", "ready", sockets=[e.name for e in endpoints]))

    def log(record: dict[str, Any]) -> None:
        metrics.PROCESS.observe_log(record)
        stderr_log(record)

    server = asyncio.ensure_future(serve(daemon, endpoints, limits=limits, ready=ready, log=log))
    stopped = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({server, stopped}, return_when=asyncio.FIRST_COMPLETED)
        if server.done():
            server.result()  # a listen refusal: raise it
            return
        with contextlib.suppress(OSError, ValueError):
            notify.stopping("stopping: finishing in-flight requests")
        stderr_log(log_line("info", "stopping"))
    finally:
        for task in (server, stopped):
            task.cancel()
        for task in (server, stopped):
            with contextlib.suppress(asyncio.CancelledError):
                await task


def log_line(level: str, event: str, **fields: Any) -> dict[str, Any]:
    return {"ts": time.time(), "level": level, "event": event, **fields}
