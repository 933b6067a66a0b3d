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
    unavailable = [(pid, error) for pid, error in providers if error is not None]
    held = ledger == importlib.import_module(DAEMON_MODULE).LEDGER_HELD
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
    verdict = {
        EXIT_OK: "ok",
        EXIT_DEGRADED: "a provider is unavailable",
        EXIT_LEDGER_HELD: "in order, but a running daemon holds the ledger (ledger_busy)",
    }[status]
    print(f"{args.config}: {verdict}")
    return status
