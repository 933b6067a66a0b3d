"""`ficc-hoststate inspect DIR --host-id ID [--json]`: verify and show, read-only.

(`python -m ficc.hoststate` is the same command.)

It applies every check `acquire` applies but never takes the lock and never writes:
it opens `host.lock` and `state.json` read-only and reads one snapshot, which is
always a complete file because saves replace it by an atomic rename. There is no
write command.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from importlib import metadata

from . import marker
from .errors import HostStateError
from .lock import check_platform
from .model import Operation, check_host_id
from .root import Root, read_all
from .session import LOCK_FILE, STATE_FILE, marker_mismatch, snapshot_missing
from .snapshot import MAX_BYTES, decode

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


def version() -> str:
    """`ficc-hoststate X.Y.Z`, from the installed distribution's metadata."""
    try:
        return f"ficc-hoststate {metadata.version('ficc-hoststate')}"
    except metadata.PackageNotFoundError:  # a source tree on sys.path, not installed
        return "ficc-hoststate (not installed)"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ficc-hoststate",
        description="Read-only inspection of a host operation registry.",
    )
    parser.add_argument("--version", action="version", version=version())
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    inspect = commands.add_parser(
        "inspect", help="verify the store and list its operations", description=__doc__
    )
    inspect.add_argument("--version", action="version", version=version())
    inspect.add_argument("directory", help="the host's state directory")
    inspect.add_argument("--host-id", required=True, help="the host ID the store must belong to")
    inspect.add_argument("--json", action="store_true", help="print one JSON object")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """`ficc-hoststate inspect`: print what a state directory holds; exit 1 on a refusal."""
    args = _parser().parse_args(argv)
    try:
        found = inspect_store(args.directory, args.host_id)
        print(render_json(*found) if args.json else render(*found), flush=True)
    except BrokenPipeError:  # e.g. piped into `head`: the reader left, nothing to report
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_OK
    except HostStateError as exc:
        print(f"inspect failed: {exc}", file=sys.stderr)
        if args.json:  # a script reading stdout gets the refusal as JSON too
            error = {"code": exc.code, "message": str(exc)}
            print(json.dumps({"error": error}, sort_keys=True), flush=True)
        return EXIT_USAGE if exc.code == "invalid_argument" else EXIT_FAILED
    return EXIT_OK


def inspect_store(directory: str, host_id: str) -> tuple[str, list[Operation], str]:
    """(directory, operations, marker note); raises the same errors `acquire` would."""
    check_host_id(host_id)
    check_platform()
    root = Root.open(directory)
    try:
        marked_for = _read_marker(root)
        if marked_for is not None and marked_for != host_id:
            raise marker_mismatch(directory, marked_for, host_id)
        data = root.read(STATE_FILE, MAX_BYTES)
    finally:
        root.close()
    if data is None:
        if marked_for is not None:
            raise snapshot_missing(directory)
        return directory, [], "empty store: never initialized (no marker, no snapshot)"
    operations = decode(data, host_id)
    note = "initialized" if marked_for else "marker missing: the next acquire rewrites it"
    return directory, operations, f"{note}; state.json {len(data)} bytes, checksum verified"


def _read_marker(root: Root) -> str | None:
    fd = root.open_existing(LOCK_FILE)
    if fd is None:
        return None
    try:
        return marker.decode(read_all(fd, LOCK_FILE, marker.MAX_BYTES))
    finally:
        os.close(fd)


def render(directory: str, operations: list[Operation], note: str) -> str:
    """A readable table: one row per operation, columns aligned."""
    rows = [("ID", "STATUS", "REVISION", "PLAN HASH")]
    rows += [(op.id, op.status.value, str(op.revision), op.plan_hash) for op in operations]
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    lines = [f"{directory}: {len(operations)} operations; {note}", ""]
    lines += [
        "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in rows
    ]
    return "\n".join(lines)


def render_json(directory: str, operations: list[Operation], note: str) -> str:
    """The same facts as `render`, as one JSON object for scripts."""
    document = {
        "directory": directory,
        "note": note,
        "operations": [
            {"id": op.id, "status": op.status.value, "revision": op.revision,
             "plan_hash": op.plan_hash}
            for op in operations
        ],
    }  # fmt: skip
    return json.dumps(document, sort_keys=True)


def console_main() -> None:
    """The `ficc-hoststate` console command."""
    raise SystemExit(main())
