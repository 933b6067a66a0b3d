"""The `ficc-executor` command (also `python -m ficc.execution <command>`).

ficc-protocol's `__main__` handles `request` itself and hands every other command
here as `main(argv)`; the `ficc-executor` console script enters at `console_main`:

    serve --config PATH [--provider-path DIR ...] [--log-level L]   the daemon
    check-config --config PATH [--provider-path DIR ...]   every check serve makes
    status (--config PATH | --socket PATH) [--all] [--since WHEN] [--json]
                                                           the daemon's snapshot
    metrics (--config PATH | --socket PATH)                Prometheus text format
    check-slots (--config PATH | --socket PATH) [--json]   check every slot now
    provider-digest NAME [--path DIR ...] [--json]         the digest to pin
    run (--plan FILE | [--image DIGEST] -- ARGV) [--input NAME=FILE ...]
                                                           one job, end to end
    request --socket PATH                                  one JSON request from stdin

Exit status: 0 success, 1 a refusal (its stable code first on stderr), 2 a usage error
(argparse), 3 no trustworthy reply from the daemon, 4 (check-config) every check
passed but a provider is unavailable.
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import json
import sys
import traceback
from collections.abc import Sequence
from typing import Any

from ficc.execution.host.cli import provision, smoke
from ficc.execution.host.cli import run as run_job
from ficc.execution.host.cli.check_config import check_config_command
from ficc.execution.host.cli.exits import (
    EXIT_OK,
    EXIT_REFUSED,
    EXIT_USAGE,
    json_refusal,
)
from ficc.execution.host.cli.serve import log_line, serve_command
from ficc.execution.host.cli.status import (
    add_filters,
    check_slots_command,
    print_metrics,
    status_command,
)
from ficc.execution.host.cli.versions import PROG, version_line
from ficc.execution.host.core.errors import HostError
from ficc.execution.host.daemon import logs
from ficc.execution.host.daemon.server import stderr_log
from ficc.execution.host.providers.digest import GROUP, compute_digest

_PROTOCOL_MAIN = "ficc.execution.__main__"


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
    try:
        args = parser.parse_args(args_list)
    except SystemExit as stop:
        if args_list[:1] == ["run"] and stop.code == EXIT_USAGE:
            return run_job.EXIT_REFUSED  # `run` exits with the job's status, 2 included
        raise
    try:
        result: int = args.run(args)
    except HostError as error:
        if args.command == "serve":  # the daemon's stderr is a JSON-lines log
            stderr_log(log_line("error", "refused", code=error.code, message=error.message))
        else:
            print(f"{error.code}: {error.message}", file=sys.stderr)
            json_refusal(args, error.code, error.message)
        return EXIT_REFUSED
    except Exception as error:
        if args.command != "serve":
            raise
        # a bug, not a refusal; still one JSON line, so the journal stays parseable
        failure = "".join(traceback.format_exception(error))
        stderr_log(log_line("error", "failed", error=repr(error), traceback=failure))
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
    run.set_defaults(run=serve_command)

    check = _command(
        commands,
        "check-config",
        "run every check serve runs before it listens, then exit",
        "Check the configuration file, the host paths and accounts it names, the ledger "
        "and each provider's pin and configure(), with the same messages serve gives; "
        "nothing is changed. Exit 0: "
        "serve would start with every provider available; 1: serve would refuse to "
        "start; 4: serve would start, but a provider would be unavailable (also while a "
        "running daemon holds the ledger); 5: all is in order, but a running daemon holds "
        "the ledger, so serve would refuse now.",
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
    check.set_defaults(run=check_config_command)

    status = _command(
        commands,
        "status",
        "print the daemon's offer, capacity and attempts as a table",
        "Ask the daemon for its snapshot (every page) and print it: the attempts not"
        " released yet, by the time of their last change (UTC); --all or --since for the"
        " history.",
    )
    _daemon_address(status)
    status.add_argument(
        "--json", action="store_true",
        help="print every page as JSON (with the attempts --all or --since choose)",
    )  # fmt: skip
    add_filters(status)
    status.set_defaults(run=status_command)

    metrics_command = _command(
        commands,
        "metrics",
        "print the daemon's metrics in the Prometheus text format",
        "Ask the daemon (administrator socket only) for its metrics and print them in "
        "the Prometheus text exposition format.",
    )
    _daemon_address(metrics_command)
    metrics_command.set_defaults(run=print_metrics)

    check_slots = _command(
        commands,
        "check-slots",
        "check every slot now and print each one's health",
        "Ask the daemon (administrator socket only) to check every slot now: a slot whose"
        " checks pass again is back in the offer at once, without waiting for the next"
        " scheduled check. Exit 0 when every slot is in service, 1 otherwise.",
    )
    _daemon_address(check_slots)
    check_slots.add_argument("--json", action="store_true", help="print the slots as JSON")
    check_slots.set_defaults(run=check_slots_command)

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
    run_job.add_parser(commands, version_line())
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


# --- check-config --------------------------------------------------------------------------


# --- status --------------------------------------------------------------------------------


if __name__ == "__main__":
    sys.exit(main())
