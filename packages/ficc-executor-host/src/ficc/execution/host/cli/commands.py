"""The `ficc-executor` command (also `python -m ficc.execution <command>`).

ficc-protocol's `__main__` handles `request` itself and hands every other command
here as `main(argv)`; the `ficc-executor` console script enters at `console_main`:

    serve --config PATH [--provider-path DIR ...] [--log-level L]   the daemon
    check-config --config PATH [--provider-path DIR ...]   every check serve makes
    status (--config PATH | --socket PATH) [--json]        the daemon's snapshot
    metrics (--config PATH | --socket PATH)                Prometheus text format
    provider-digest NAME [--path DIR ...] [--json]         the digest to pin
    request --socket PATH                                  one JSON request from stdin

Exit status: 0 success, 1 a refusal (its stable code first on stderr), 2 a usage error
(argparse), 3 no trustworthy reply from the daemon, 4 (check-config) every check
passed but a provider is unavailable.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import difflib
import errno
import gc
import importlib
import json
import logging
import os
import platform
import secrets
import signal
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from importlib import metadata
from typing import Any, Protocol

import msgspec

from ficc.execution.client import Client, ClientError, ConnectFailed
from ficc.execution.host.cli import provision, smoke
from ficc.execution.host.config.host import check_accounts, check_host, check_metrics_textfile
from ficc.execution.host.config.load import load_config
from ficc.execution.host.config.model import Config
from ficc.execution.host.core import metrics
from ficc.execution.host.core.codes import HostCode
from ficc.execution.host.core.errors import HostError
from ficc.execution.host.daemon import logs
from ficc.execution.host.daemon.peercred import socket_paths
from ficc.execution.host.daemon.server import Dispatcher, ServerLimits, serve, stderr_log
from ficc.execution.host.linux import notify
from ficc.execution.host.linux.notify import systemd_is_init
from ficc.execution.host.providers.digest import GROUP, compute_digest
from ficc.execution.protocol import PROTOCOL_VERSION, MetricsRequest, SnapshotRequest
from ficc.execution.wire import AttemptStatus, ErrorReply, MetricsReply, SnapshotReply, Usage

EXIT_OK, EXIT_REFUSED, EXIT_USAGE, EXIT_TRANSPORT, EXIT_DEGRADED = 0, 1, 2, 3, 4
EXIT_LEDGER_HELD = 5
"""check-config: the configuration is in order, but a running daemon holds the ledger."""
_DAEMON_MODULE = "ficc.execution.host.daemon.root"
_PROTOCOL_MAIN = "ficc.execution.__main__"
_MAX_PAGES = 100_000  # 6.4 million attempts: a bound so a cursor bug cannot loop forever
PROG = "ficc-executor"


def versions() -> dict[str, str]:
    """Installed versions of the distributions this command is made of."""
    found: dict[str, str] = {}
    for name in ("ficc-executor-host", "ficc-protocol"):
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:  # a source tree on sys.path, not installed
            found[name] = "unknown"
    return found


def version_line() -> str:
    """`ficc-executor 0.1.0 (ficc-protocol 0.1.0, Python 3.11.2)`."""
    found = versions()
    return (
        f"{PROG} {found['ficc-executor-host']} (ficc-protocol {found['ficc-protocol']}, "
        f"Python {platform.python_version()})"
    )


def console_main() -> None:
    """The `ficc-executor` console command."""
    raise SystemExit(main())


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    if args_list[:1] in (["request"], ["upload"]):
        return _protocol_command(args_list[0], args_list[1:])
    parser = _parser()
    unknown = _unknown_command(parser, args_list)
    if unknown is not None:
        print(unknown, file=sys.stderr)
        return EXIT_USAGE
    args = parser.parse_args(args_list)
    try:
        result: int = args.run(args)
    except HostError as error:
        if args.command == "serve":  # the daemon's stderr is a JSON-lines log
            stderr_log(_line("error", "refused", code=error.code, message=error.message))
        else:
            print(f"{error.code}: {error.message}", file=sys.stderr)
            _json_refusal(args, error.code, error.message)
        return EXIT_REFUSED
    except Exception as error:
        if args.command != "serve":
            raise
        # a bug, not a refusal; still one JSON line, so the journal stays parseable
        failure = "".join(traceback.format_exception(error))
        stderr_log(_line("error", "failed", error=repr(error), traceback=failure))
        return EXIT_REFUSED
    return result


def _protocol_command(name: str, argv: list[str]) -> int:
    """`request` and `upload` belong to ficc-protocol (a controller may vendor them
    without the host); here they are the same commands under `ficc-executor`."""
    if argv[:1] == ["--version"]:
        print(version_line())
        return EXIT_OK
    protocol_main = importlib.import_module(_PROTOCOL_MAIN)
    if name == "upload":
        return int(protocol_main.main(["upload", *argv]))
    return int(protocol_main.request_command(argv, prog=f"{PROG} request"))


def _unknown_command(parser: argparse.ArgumentParser, argv: list[str]) -> str | None:
    """For a mistyped command, the refusal with the closest known commands ("did you
    mean"), which argparse alone does not offer; None when the command is known."""
    if not argv or argv[0].startswith("-"):
        return None
    known = [
        name
        for action in parser._subparsers._group_actions  # type: ignore[union-attr]
        if isinstance(action, argparse._SubParsersAction)
        for name in action.choices
    ]
    if argv[0] in known:
        return None
    close = difflib.get_close_matches(argv[0], known, n=3, cutoff=0.6)
    hint = f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
    return (
        f"{PROG}: unknown command {argv[0]!r}{hint} (the commands: {', '.join(sorted(known))};"
        f" `{PROG} --help` says what each does)"
    )


def _command(commands: Any, name: str, help_text: str, description: str) -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = commands.add_parser(
        name, help=help_text, description=description
    )
    parser.add_argument("--version", action="version", version=version_line())
    return parser


def _daemon_address(parser: argparse.ArgumentParser) -> None:
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--config", help="use admin.sock in this configuration's socket_dir")
    where.add_argument("--socket", help="the socket to ask (admin.sock or an owner socket)")
    parser.add_argument("--timeout", type=float, default=30.0, help="seconds (default 30)")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="The ficc executor host: a root daemon that runs other people's jobs "
        "under leases, with pinned providers. Every command has --help and --version.",
    )
    parser.add_argument("--version", action="version", version=version_line())
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    run = _command(
        commands,
        "serve",
        "run the executor host daemon in the foreground",
        "Load and check the configuration, open the ledger, recover, listen on "
        "the sockets and serve until SIGTERM or SIGINT. Under systemd (Type=notify) it "
        "reports READY=1 once every socket listens; its monitor pings the watchdog. "
        "Logs are JSON lines on stderr.",
    )
    run.add_argument("--config", required=True, help="the administrator's configuration file")
    _provider_path(run)
    run.add_argument(
        "--log-level",
        choices=logs.LEVELS,
        default="info",
        help="write log lines at this level and above (default: info)",
    )
    run.set_defaults(run=_serve)

    check = _command(
        commands,
        "check-config",
        "run every check serve runs before it listens, then exit",
        "Check the configuration file, the host paths and accounts it names, the ledger "
        "and each provider's pin and configure(), with the same messages serve gives; "
        "nothing is changed. Exit 0: "
        "serve would start with every provider available; 1: serve would refuse to "
        "start; 4: serve would start, but a provider would be unavailable; 5: all is in "
        "order, but a running daemon holds the ledger, so serve would refuse now.",
    )
    check.add_argument("--config", required=True, help="the administrator's configuration file")
    _provider_path(check)
    check.add_argument("--json", action="store_true", help="print one JSON object")
    check.add_argument(
        "--allow-unavailable-providers",
        action="store_true",
        help="exit 0 rather than 4 when only a provider is unavailable (the unit uses "
        "this: the daemon must run to recover and release attempts even then)",
    )
    check.set_defaults(run=_check_config)

    status = _command(
        commands,
        "status",
        "print the daemon's offer, capacity and attempts as a table",
        "Ask the daemon for its snapshot (every page) and print it.",
    )
    _daemon_address(status)
    status.add_argument("--json", action="store_true", help="print every page as JSON")
    status.set_defaults(run=_status)

    metrics_command = _command(
        commands,
        "metrics",
        "print the daemon's metrics in the Prometheus text format",
        "Ask the daemon (administrator socket only) for its metrics and print them in "
        "the Prometheus text exposition format.",
    )
    _daemon_address(metrics_command)
    metrics_command.set_defaults(run=_metrics)

    digest = _command(
        commands,
        "provider-digest",
        "print the package_digest to pin for an installed provider",
        "Verify an installed provider distribution without importing it and "
        "print the digest to put in the configuration's providers[].package_digest.",
    )
    digest.add_argument("name", help=f"entry-point name in group {GROUP}")
    digest.add_argument(
        "--path",
        action="append",
        metavar="DIR",
        help="search only this site directory (repeatable; default: sys.path)",
    )
    shown = digest.add_mutually_exclusive_group()
    shown.add_argument("--quiet", action="store_true", help="print only the digest")
    shown.add_argument("--json", action="store_true", help="print one JSON object")
    digest.set_defaults(run=_provider_digest)

    provision.add_parser(commands, version_line())
    smoke.add_parser(commands, version_line())

    commands.add_parser(
        "request",
        help="send one reviewed JSON request from stdin (see `request --help`)",
        add_help=False,
    )
    commands.add_parser(
        "upload",
        help="stage a streamed input of a prepared attempt from a file (see `upload --help`)",
        add_help=False,
    )
    return parser


def _provider_path(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--provider-path",
        action="append",
        metavar="DIR",
        help="search providers only in this site directory (repeatable; default: sys.path)",
    )


# --- provider-digest ---------------------------------------------------------------------


def _provider_digest(args: argparse.Namespace) -> int:
    verified = compute_digest(args.name, args.path)
    if args.json:
        document = {
            "id": args.name,
            "distribution": verified.name,
            "version": verified.version,
            "entry_point": verified.distribution.entry_point,
            "location": str(verified.distribution.site_dir),
            "files": len(verified.files),
            "package_digest": verified.digest,
        }
        print(json.dumps(document, sort_keys=True))
        return EXIT_OK
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
    """What `serve` needs from `ficc.execution.host.daemon.root.Daemon` beyond dispatching."""

    async def start(self) -> None: ...

    async def close(self) -> None: ...


def _open_daemon(config: Config, provider_path: list[str] | None) -> Daemon:
    """`Daemon.open(config, provider_path=...)`, imported only when serving."""
    module = importlib.import_module(_DAEMON_MODULE)
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
        _line(
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


def _serve(args: argparse.Namespace) -> int:
    logs.set_level(args.log_level)
    _log_json_lines(args.log_level)
    _log_starting()  # first, so even a refused configuration is logged with the versions
    config = checked_config(args.config)
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    with asyncio.Runner(loop_factory=_loop_factory()) as runner:
        runner.run(run_daemon(config, args.provider_path))
    return EXIT_OK


# --- check-config --------------------------------------------------------------------------


def _check_config(args: argparse.Namespace) -> int:
    try:
        config = checked_config(args.config)
        daemon = importlib.import_module(_DAEMON_MODULE)
        ledger: str = daemon.check_ledger(config)
    except HostError as error:
        return _report_check(args, error, None, [])
    providers = daemon.check_providers(config, args.provider_path)
    return _report_check(args, None, ledger, providers)


def _report_check(
    args: argparse.Namespace,
    refusal: HostError | None,
    ledger: str | None,
    providers: list[tuple[str, HostError | None]],
) -> int:
    """Print the outcome (text or JSON) and choose the exit status."""
    unavailable = [(pid, error) for pid, error in providers if error is not None]
    held = ledger == importlib.import_module(_DAEMON_MODULE).LEDGER_HELD
    if refusal is not None:
        status, result = EXIT_REFUSED, "refused"
    elif held:
        status, result = EXIT_LEDGER_HELD, "ledger_busy"
    elif unavailable and not args.allow_unavailable_providers:
        status, result = EXIT_DEGRADED, "provider_unavailable"
    else:
        status, result = EXIT_OK, "ok"
    if args.json:
        document = {
            "config": args.config,
            "result": result,
            "error": None if refusal is None else _error_json(refusal),
            "ledger": ledger,
            "providers": [
                {"id": pid, "available": error is None,
                 "error": None if error is None else _error_json(error)}
                for pid, error in providers
            ],
        }  # fmt: skip
        print(json.dumps(document, sort_keys=True))
        return status
    if refusal is not None:
        print(f"{refusal.code}: {refusal.message}", file=sys.stderr)
        return status
    print(f"ledger: {ledger}")
    for pid, error in providers:
        shown = "available" if error is None else f"unavailable: {error.code}: {error.message}"
        print(f"provider {pid}: {shown}", file=sys.stderr if error else sys.stdout)
    verdict = {
        EXIT_OK: "ok",
        EXIT_DEGRADED: "a provider is unavailable",
        EXIT_LEDGER_HELD: "in order, but a running daemon holds the ledger (ledger_busy)",
    }[status]
    print(f"{args.config}: {verdict}")
    return status


def _error_json(error: HostError) -> dict[str, str]:
    return {"code": error.code, "message": error.message}


TRANSPORT = "transport"
"""The code of a `--json` refusal when the daemon could not be reached at all."""


def _json_refusal(args: argparse.Namespace, code: str, message: str) -> None:
    """With `--json`, a refusal is also one JSON object on stdout, so a script that
    parses stdout never meets an empty or a text answer (`check-config` has its own)."""
    if getattr(args, "json", False) and args.command != "check-config":
        print(json.dumps({"error": {"code": code, "message": message}}, sort_keys=True))


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
    daemon = (open_daemon or _open_daemon)(config, provider_path)
    try:
        await daemon.start()
        await _serve_until(daemon, config, limits or ServerLimits(), stop)
    finally:
        await daemon.close()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(signum)
        gc.unfreeze()
        stderr_log(_line("info", "stopped"))


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
            stderr_log(_line("error", "notify_failed", error=str(exc)))
        stderr_log(_line("info", "ready", sockets=[e.name for e in endpoints]))

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


def _socket_of(args: argparse.Namespace) -> str:
    if args.socket is not None:
        return str(args.socket)
    return os.path.join(load_config(args.config).socket_dir, "admin.sock")


def transport_failure(exc: ClientError, path: str) -> str:
    """What went wrong talking to the daemon, and what to do when it is not running."""
    line = f"transport: {type(exc).__name__}: {exc}"
    if not isinstance(exc, ConnectFailed):
        return line
    # the client raises ConnectFailed `from None`: the OSError stays in the context
    found = exc.__cause__ or exc.__context__
    cause = found.errno if isinstance(found, OSError) else None
    if cause in (errno.EACCES, errno.EPERM):
        line += (
            f"\nhint: {path} is not yours to use: admin.sock is root's (run the command as"
            " root), and owner-<uid>.sock belongs to that local owner"
        )
    elif cause is None or cause in (errno.ENOENT, errno.ECONNREFUSED):
        why_not = (
            "`systemctl status ficc-executor-host` and "
            "`journalctl -u ficc-executor-host -p warning` show why not"
            if systemd_is_init()
            else "start it with `ficc-executor serve --config PATH` (its log is its stderr)"
        )
        line += (
            f"\nhint: no daemon is listening on {path}. Is it running? {why_not}; "
            "`ficc-executor check-config --config PATH` checks its configuration"
        )
    return line


def _status(args: argparse.Namespace) -> int:
    path = _socket_of(args)
    client = Client(path, connect_timeout=args.timeout, read_timeout=args.timeout)
    try:
        pages = asyncio.run(fetch_snapshots(client))
        daemon_version = None
        if not isinstance(pages, ErrorReply) and os.path.basename(path) == "admin.sock":
            daemon_version = asyncio.run(fetch_version(client))
    except ClientError as exc:
        print(transport_failure(exc, path), file=sys.stderr)
        _json_refusal(args, TRANSPORT, transport_failure(exc, path))
        return EXIT_TRANSPORT
    if isinstance(pages, ErrorReply):
        print(f"{pages.error.code}: {pages.error.message}", file=sys.stderr)
        _json_refusal(args, pages.error.code, pages.error.message)
        return EXIT_REFUSED
    if args.json:
        document = {
            "daemon_version": daemon_version,
            "pages": [msgspec.to_builtins(p) for p in pages],
        }
        print(json.dumps(document, sort_keys=True))
        return EXIT_OK
    now_ms = time.time_ns() // 1_000_000
    sys.stdout.write(format_status(pages, now_ms=now_ms, daemon_version=daemon_version))
    return EXIT_OK


async def fetch_metrics(client: Client) -> MetricsReply | ErrorReply:
    reply = await client.request(MetricsRequest(version=1, id=secrets.token_hex(16)))
    assert isinstance(reply, (MetricsReply, ErrorReply))  # decode_reply picks it
    return reply


async def fetch_version(client: Client) -> str | None:
    """The daemon's version from its metrics (`ficc_build_info`); None if refused."""
    reply = await fetch_metrics(client)
    if isinstance(reply, ErrorReply):
        return None
    for line in reply.text.splitlines():
        if line.startswith('ficc_build_info{version="'):
            return line.split('"', 2)[1]
    return None


def _metrics(args: argparse.Namespace) -> int:
    path = _socket_of(args)
    client = Client(path, connect_timeout=args.timeout, read_timeout=args.timeout)
    try:
        reply = asyncio.run(fetch_metrics(client))
    except ClientError as exc:
        print(transport_failure(exc, path), file=sys.stderr)
        return EXIT_TRANSPORT
    if isinstance(reply, ErrorReply):
        print(f"{reply.error.code}: {reply.error.message}", file=sys.stderr)
        return EXIT_REFUSED
    sys.stdout.write(reply.text)
    return EXIT_OK


async def fetch_snapshots(client: Client) -> list[SnapshotReply] | ErrorReply:
    """Every snapshot page with what each attempt used (`usage: true`), following `next`
    until it is null (or the first refusal)."""
    pages: list[SnapshotReply] = []
    after: str | None = None
    for _ in range(_MAX_PAGES):
        reply = await client.request(
            SnapshotRequest(version=1, id=secrets.token_hex(16), after=after, usage=True)
        )
        if isinstance(reply, ErrorReply):
            return reply
        assert isinstance(reply, SnapshotReply)  # decode_reply picks it for "snapshot"
        pages.append(reply)
        if reply.next is None:
            return pages
        if after is not None and reply.next <= after:
            raise HostError(
                HostCode.STATUS_CURSOR, f"the snapshot cursor did not advance past {after}"
            )
        after = reply.next
    raise HostError(HostCode.STATUS_CURSOR, f"more than {_MAX_PAGES} snapshot pages; giving up")


def format_status(
    pages: Sequence[SnapshotReply], *, now_ms: int, daemon_version: str | None = None
) -> str:
    """A readable, stable text table of one snapshot (all its pages)."""
    first = pages[0]
    attempts = [a for page in pages for a in page.attempts]
    offer = first.offer
    res = offer.limits.resources
    avail = first.capacity.available
    out = [
        f"daemon         {daemon_version or '- (its version is shown on admin.sock)'}",
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
                [p.id, "yes" if p.available else "UNAVAILABLE", p.package_digest]
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
_ATTEMPT_HEADERS += ["LEASE", "SLOT", "CPU", "PEAK MEM", "OOM"]


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
        *_usage_cells(a.usage),
    ]


def _usage_cells(usage: Usage | msgspec.UnsetType) -> list[str]:
    """CPU time (user and system), peak memory and OOM kills; `-` where unknown. A live
    reading (the payload still runs) is marked with `~`."""
    if isinstance(usage, msgspec.UnsetType):
        return ["-", "-", "-"]
    live = "" if usage.final else "~"
    user, system = usage.cpu_user_us, usage.cpu_system_us
    cpu = "-"
    if isinstance(user, int) and isinstance(system, int):
        cpu = f"{live}{(user + system) / 1_000_000:.2f} s"
    peak = usage.memory_peak_bytes
    memory = f"{live}{_bytes(peak)}" if isinstance(peak, int) else "-"
    oom = str(usage.oom_kills) if isinstance(usage.oom_kills, int) else "-"
    return [cpu, memory, oom]


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
