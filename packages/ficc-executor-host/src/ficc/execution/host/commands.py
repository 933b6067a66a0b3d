"""Administrator commands of the executor host (`python -m ficc.execution <command>`).

ficc-protocol's `__main__` handles `request` itself and hands every other command
here as `main(argv)`:

    serve --config PATH [--provider-path DIR ...]   the daemon, in the foreground
    status (--config PATH | --socket PATH)          a readable table of the snapshot
    provider-digest NAME [--path DIR ...]           the digest to pin for a provider

Exit status: 0 success, 1 a refusal (its stable code first on stderr), 2 a usage error
(argparse), 3 (status only) no trustworthy reply from the daemon.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib
import logging
import os
import secrets
import signal
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from ficc.execution.client import Client, ClientError
from ficc.execution.host import notify, provision
from ficc.execution.host.config import Config, check_host, load_config
from ficc.execution.host.errors import HostError
from ficc.execution.host.peercred import socket_paths
from ficc.execution.host.providers.digest import GROUP, compute_digest
from ficc.execution.host.server import Dispatcher, ServerLimits, serve, stderr_log
from ficc.execution.protocol import SnapshotRequest
from ficc.execution.wire import AttemptStatus, ErrorReply, SnapshotReply

EXIT_OK, EXIT_REFUSED, EXIT_TRANSPORT = 0, 1, 3
_DAEMON_MODULE = "ficc.execution.host.daemon"
_MAX_PAGES = 100_000  # 6.4 million attempts: a bound so a cursor bug cannot loop forever


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        result: int = args.run(args)
    except HostError as error:
        print(f"{error.code}: {error.message}", file=sys.stderr)
        return EXIT_REFUSED
    return result


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m ficc.execution")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    run = commands.add_parser(
        "serve",
        help="run the executor host daemon in the foreground",
        description="Load and check the configuration, open the ledger, recover, listen on "
        "the sockets and serve until SIGTERM or SIGINT. Under systemd (Type=notify) it "
        "reports READY=1 once every socket listens; its monitor pings the watchdog.",
    )
    run.add_argument("--config", required=True, help="the administrator's configuration file")
    run.add_argument(
        "--provider-path",
        action="append",
        metavar="DIR",
        help="search providers only in this site directory (repeatable; default: sys.path)",
    )
    run.set_defaults(run=_serve)

    status = commands.add_parser(
        "status",
        help="print the daemon's offer, capacity and attempts as a table",
        description="Ask the daemon for its snapshot (every page) and print it.",
    )
    where = status.add_mutually_exclusive_group(required=True)
    where.add_argument("--config", help="use admin.sock in this configuration's socket_dir")
    where.add_argument("--socket", help="the socket to ask (admin.sock or an owner socket)")
    status.add_argument("--timeout", type=float, default=30.0, help="seconds (default 30)")
    status.set_defaults(run=_status)

    digest = commands.add_parser(
        "provider-digest",
        help="print the package_digest to pin for an installed provider",
        description="Verify an installed provider distribution without importing it and "
        "print the digest to put in the configuration's providers[].package_digest.",
    )
    digest.add_argument("name", help=f"entry-point name in group {GROUP}")
    digest.add_argument(
        "--path",
        action="append",
        metavar="DIR",
        help="search only this site directory (repeatable; default: sys.path)",
    )
    digest.add_argument("--quiet", action="store_true", help="print only the digest")
    digest.set_defaults(run=_provider_digest)

    provision.add_parser(commands)
    return parser


# --- provider-digest ---------------------------------------------------------------------


def _provider_digest(args: argparse.Namespace) -> int:
    verified = compute_digest(args.name, args.path)
    if not args.quiet:
        rows = [
            ("distribution", verified.name),
            ("version", verified.version),
            ("entry point", f"{args.name} = {verified.distribution.entry_point}"),
            ("location", str(verified.distribution.site_dir)),
            ("files", str(len(verified.files))),
        ]
        for label, value in rows:
            print(f"{label:<16}{value}")
        print(f"{'package_digest':<16}", end="")
    print(verified.digest)
    return EXIT_OK


# --- serve ---------------------------------------------------------------------------------


class Daemon(Dispatcher, Protocol):
    """What `serve` needs from `ficc.execution.host.daemon.Daemon` beyond dispatching."""

    async def start(self) -> None: ...

    async def close(self) -> None: ...


def _open_daemon(config: Config, provider_path: list[str] | None) -> Daemon:
    """`Daemon.open(config, provider_path=...)`, imported only when serving."""
    module = importlib.import_module(_DAEMON_MODULE)
    daemon: Daemon = module.Daemon.open(config, provider_path=provider_path)
    return daemon


def _serve(args: argparse.Namespace) -> int:
    _log_json_lines()
    config = load_config(args.config)
    check_host(config)
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


def _log_json_lines() -> None:
    root = logging.getLogger()
    root.handlers[:] = [_JsonLines()]
    root.setLevel(logging.INFO)


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
    stderr_log(_line("info", "starting", pid=os.getpid()))
    daemon = (open_daemon or _open_daemon)(config, provider_path)
    try:
        await daemon.start()
        await _serve_until(daemon, config, limits or ServerLimits(), stop)
    finally:
        await daemon.close()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(signum)
        stderr_log(_line("info", "stopped"))


async def _serve_until(
    daemon: Daemon, config: Config, limits: ServerLimits, stop: asyncio.Event
) -> None:
    endpoints = list(socket_paths(config))

    def ready() -> None:
        status = f"serving {len(endpoints)} sockets in {config.socket_dir}"
        try:
            notify.ready(status)
        except (OSError, ValueError) as exc:  # systemd will time the start out; say why
            stderr_log(_line("error", "notify_failed", error=str(exc)))
        stderr_log(_line("info", "ready", sockets=[e.name for e in endpoints]))

    server = asyncio.ensure_future(serve(daemon, endpoints, limits=limits, ready=ready))
    stopped = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({server, stopped}, return_when=asyncio.FIRST_COMPLETED)
        if server.done():
            server.result()  # a listen refusal: raise it
            return
        with contextlib.suppress(OSError, ValueError):
            notify.stopping("stopping: finishing in-flight requests")
        stderr_log(_line("info", "stopping"))
    finally:
        for task in (server, stopped):
            task.cancel()
        for task in (server, stopped):
            with contextlib.suppress(asyncio.CancelledError):
                await task


def _line(level: str, event: str, **fields: Any) -> dict[str, Any]:
    return {"ts": time.time(), "level": level, "event": event, **fields}


# --- status --------------------------------------------------------------------------------


def _status(args: argparse.Namespace) -> int:
    path = args.socket
    if path is None:
        path = os.path.join(load_config(args.config).socket_dir, "admin.sock")
    client = Client(path, connect_timeout=args.timeout, read_timeout=args.timeout)
    try:
        pages = asyncio.run(fetch_snapshots(client))
    except ClientError as exc:
        print(f"transport: {type(exc).__name__}: {exc}", file=sys.stderr)
        return EXIT_TRANSPORT
    if isinstance(pages, ErrorReply):
        print(f"{pages.error.code}: {pages.error.message}", file=sys.stderr)
        return EXIT_REFUSED
    sys.stdout.write(format_status(pages, now_ms=time.time_ns() // 1_000_000))
    return EXIT_OK


async def fetch_snapshots(client: Client) -> list[SnapshotReply] | ErrorReply:
    """Every snapshot page, following `next` until it is null (or the first refusal)."""
    pages: list[SnapshotReply] = []
    after: str | None = None
    for _ in range(_MAX_PAGES):
        reply = await client.request(
            SnapshotRequest(version=1, id=secrets.token_hex(16), after=after)
        )
        if isinstance(reply, ErrorReply):
            return reply
        assert isinstance(reply, SnapshotReply)  # decode_reply picks it for "snapshot"
        pages.append(reply)
        if reply.next is None:
            return pages
        if after is not None and reply.next <= after:
            raise HostError("status_cursor", f"the snapshot cursor did not advance past {after}")
        after = reply.next
    raise HostError("status_cursor", f"more than {_MAX_PAGES} snapshot pages; giving up")


def format_status(pages: Sequence[SnapshotReply], *, now_ms: int) -> str:
    """A readable, stable text table of one snapshot (all its pages)."""
    first = pages[0]
    attempts = [a for page in pages for a in page.attempts]
    offer = first.offer
    res = offer.limits.resources
    avail = first.capacity.available
    out = [
        f"installation   {first.installation_id}",
        f"ledger         {first.ledger_id or '-'}   admission_version {first.admission_version}",
        f"lease ceiling  {first.maximum_lease_seconds} s"
        f"   input chunk {_bytes(first.input_chunk_bytes)}",
        "",
        f"offer          revision {offer.revision}   control {offer.control}",
        f"  projects     {_allow(offer.limits.projects)}",
        f"  runtimes     {_allow(offer.limits.runtimes)}",
        "",
        _table(
            ["RESOURCE", "OFFERED", "AVAILABLE"],
            [
                ["attempts", str(res.attempts), str(avail.attempts)],
                ["cpu", f"{res.cpu_millis} m", f"{avail.cpu_millis} m"],
                ["memory", _bytes(res.memory_bytes), _bytes(avail.memory_bytes)],
                ["swap", _bytes(res.swap_bytes), _bytes(avail.swap_bytes)],
                ["processes", str(res.processes), str(avail.processes)],
                ["storage", _bytes(res.storage_bytes), _bytes(avail.storage_bytes)],
                ["inodes", str(res.storage_inodes), str(avail.storage_inodes)],
            ],
        ),
        "",
        _table(
            ["SLOT CLASS", "TOTAL", "FREE", "BYTES", "INODES"],
            [
                [c.class_, str(c.total), str(c.free), _bytes(c.bytes), str(c.inodes)]
                for c in first.capacity.slot_classes
            ],
        ),
        "",
        _table(
            ["PROVIDER", "AVAILABLE", "PACKAGE DIGEST"],
            [
                [p.id, "yes" if p.available else "NO", p.package_digest]
                for p in first.capacity.providers
            ],
        ),
        "",
        f"attempts       {len(attempts)}",
    ]
    if attempts:
        out.append(_table(_ATTEMPT_HEADERS, [_attempt_row(a, now_ms) for a in attempts]))
    return "\n".join(out) + "\n"


_ATTEMPT_HEADERS = ["ATTEMPT", "GEN", "STATE", "READY", "OUTCOME", "REASON", "EXIT"]
_ATTEMPT_HEADERS += ["LEASE", "SLOT"]


def _attempt_row(a: AttemptStatus, now_ms: int) -> list[str]:
    return [
        a.attempt_id,
        str(a.generation),
        a.state,
        "yes" if a.ready else "no",
        a.outcome or "-",
        a.reason or "-",
        "-" if a.exit_code is None else str(a.exit_code),
        "-" if a.outcome is not None else _lease(a.lease_expires_at_ms, now_ms),
        a.slot or "-",
    ]


def _lease(expires_at_ms: int | None, now_ms: int) -> str:
    """Time left on an unsettled attempt's lease (a settled one shows `-`)."""
    if expires_at_ms is None:
        return "-"
    left = (expires_at_ms - now_ms) // 1000
    return f"{left} s" if left > 0 else "expired"


def _allow(values: Sequence[str] | None) -> str:
    if values is None:
        return "any within the ceiling"
    return ", ".join(values) if values else "none"


def _bytes(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def _table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in [headers, *rows]) for i in range(len(headers))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)) for r in rows]
    head = "  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True))
    return "\n".join(line.rstrip() for line in [head, *lines])


if __name__ == "__main__":
    sys.exit(main())
