"""`check-config`: every check `serve` makes before it starts, reported one by one,
without starting anything."""

from __future__ import annotations

import argparse
import importlib
import json
import sys

from ficc.execution.host.cli.exits import (
    EXIT_DEGRADED,
    EXIT_LEDGER_HELD,
    EXIT_OK,
    EXIT_REFUSED,
    error_json,
)
from ficc.execution.host.cli.serve import DAEMON_MODULE, checked_config
from ficc.execution.host.core.errors import HostError


def check_config_command(args: argparse.Namespace) -> int:
    try:
        config = checked_config(args.config)
        daemon = importlib.import_module(DAEMON_MODULE)
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
    unavailable = any(error is not None for _, error in providers)
    held = ledger == importlib.import_module(DAEMON_MODULE).LEDGER_HELD
    status, result = _outcome(refusal is not None, unavailable, held, args)
    if args.json:
        document = {
            "config": args.config,
            "result": result,
            "error": None if refusal is None else error_json(refusal),
            "ledger": ledger,
            "providers": [
                {"id": pid, "available": error is None,
                 "error": None if error is None else error_json(error)}
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
    print(f"{args.config}: {_verdict(unavailable, held)}")
    return status


def _outcome(
    refused: bool, unavailable: bool, held: bool, args: argparse.Namespace
) -> tuple[int, str]:
    """(exit status, `--json` result). An unavailable provider outranks a held ledger:
    the held ledger only says `serve` must wait for the running daemon to stop, while
    the provider stays unavailable after the restart too (a pin that no longer matches
    the upgraded files is found here, before that restart, not after it)."""
    if refused:
        return EXIT_REFUSED, "refused"
    if unavailable and not args.allow_unavailable_providers:
        return EXIT_DEGRADED, "provider_unavailable"
    if held:
        return EXIT_LEDGER_HELD, "ledger_busy"
    return EXIT_OK, "ok"


def _verdict(unavailable: bool, held: bool) -> str:
    """The last line: "in order" only when every provider is available, also under
    `--allow-unavailable-providers`, where an unavailable one no longer decides the
    exit status but must still be seen."""
    ledger_busy = "a running daemon holds the ledger (ledger_busy)"
    if unavailable and held:
        return f"a provider is unavailable, and {ledger_busy}"
    if unavailable:
        return "a provider is unavailable"
    if held:
        return f"in order, but {ledger_busy}"
    return "ok"
