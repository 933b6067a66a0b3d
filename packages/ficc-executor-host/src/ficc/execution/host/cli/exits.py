"""What every command answers with when it stops: its exit statuses, and a refusal as
one JSON object on stdout with `--json`."""

from __future__ import annotations

import argparse
import json

from ficc.execution.host.core.errors import HostError

EXIT_OK, EXIT_REFUSED, EXIT_USAGE, EXIT_TRANSPORT, EXIT_DEGRADED = 0, 1, 2, 3, 4
EXIT_LEDGER_HELD = 5
"""check-config: the configuration is in order, but a running daemon holds the ledger."""
MAX_PAGES = 100_000  # 6.4 million attempts: a bound so a cursor bug cannot loop forever


def error_json(error: HostError) -> dict[str, str]:
    return {"code": error.code, "message": error.message}


TRANSPORT = "transport"
"""The code of a `--json` refusal when the daemon could not be reached at all."""


def json_refusal(args: argparse.Namespace, code: str, message: str) -> None:
    """With `--json`, a refusal is also one JSON object on stdout, so a script that
    parses stdout never meets an empty or a text answer (`check-config` has its own)."""
    if getattr(args, "json", False) and args.command != "check-config":
        print(json.dumps({"error": {"code": code, "message": message}}, sort_keys=True))
