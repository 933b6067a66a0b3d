"""`python -m ficc.execution COMMAND`: the protocol's own commands.

    request --socket PATH     send one reviewed JSON request (stdin) and print the reply
    schema [--write DIR | --check DIR]
                              print the JSON Schema (2020-12) of every plan, request and
                              reply; or write it and the golden vectors into DIR, or
                              compare DIR with them (exit 1 on any difference)
    upload --socket PATH --plan PLAN --input ID|NAME FILE
                              stream FILE into a declared streamed input of a prepared
                              attempt in input_chunk_bytes chunks, progress on stderr,
                              resuming from input_status after any interruption

`request` reads one request from stdin, refuses it locally unless it is a valid version-1
request (duplicate JSON keys included, so what was reviewed is what is sent), sends it,
and prints the reply as JSON on stdout. Exit status:

    0  the request was accepted and every row succeeded
    1  the executor refused the request or at least one row (codes on stderr)
    2  usage error or an invalid request (nothing was sent)
    3  transport failure: no trustworthy reply (the request may have been applied)

Every other subcommand (serve, status, provider-digest, ...) belongs to the
ficc-executor-host distribution and is handed to `ficc.execution.host.commands`.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import json
import pathlib
import sys
from collections.abc import Sequence
from importlib import metadata
from typing import Any

from ficc.execution import _schema, _upload
from ficc.execution.client import Client, ClientError, Refused, RequestInvalid
from ficc.execution.errors import ErrorCode, ProtocolError
from ficc.execution.frames import REQUEST_MAX
from ficc.execution.protocol import decode_request
from ficc.execution.wire import AnyReply, ErrorReply, ErrorRow, encode_reply

EXIT_OK, EXIT_REFUSED, EXIT_USAGE, EXIT_TRANSPORT = 0, 1, 2, 3
_HOST_COMMANDS = "ficc.execution.host.commands"


def _refuse_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    keys = [k for k, _ in pairs]
    if len(set(keys)) != len(keys):
        dup = next(k for k in keys if keys.count(k) > 1)
        raise ValueError(f"key {dup!r} appears twice in one object")
    return dict(pairs)


def _read_request(data: bytes) -> Any:
    """Validate locally. Raises ProtocolError; duplicate keys are refused as well.

    The executor's decoder keeps the last of duplicate keys; a reviewer reading the
    JSON may see the first. Refusing them here keeps "reviewed" equal to "sent".
    """
    request = decode_request(data)
    try:
        json.loads(data, object_pairs_hook=_refuse_duplicates)
    except ValueError as exc:
        raise ProtocolError(ErrorCode.INVALID_REQUEST, str(exc)) from None
    return request


def _refusals(reply: AnyReply) -> list[str]:
    if isinstance(reply, ErrorReply):
        return [f"{reply.error.code}: {reply.error.message}"]
    rows = getattr(reply, "results", [])
    return [
        f"row {i}: {row.error.code}: {row.error.message}"
        for i, row in enumerate(rows)
        if isinstance(row, ErrorRow)
    ]


def request_command(argv: Sequence[str], prog: str = "python -m ficc.execution request") -> int:
    """`python -m ficc.execution request`: send one JSON request read from stdin.

    `prog` is the name the usage line shows (`ficc-executor request` when the host's
    console command runs it)."""
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Send one JSON request from stdin to an executor socket.",
    )
    parser.add_argument("--version", action="version", version=_version())
    parser.add_argument("--socket", required=True, help="the executor's Unix socket")
    parser.add_argument("--timeout", type=float, default=30.0, help="seconds (default 30)")
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:
        return EXIT_OK if exc.code == 0 else EXIT_USAGE
    data = sys.stdin.buffer.read(REQUEST_MAX + 1)
    if len(data) > REQUEST_MAX:
        print("invalid_request: stdin is larger than one request frame", file=sys.stderr)
        return EXIT_USAGE
    try:
        request = _read_request(data)
    except ProtocolError as exc:
        print(f"{exc.code}: {exc.message} (at {exc.path})", file=sys.stderr)
        return EXIT_USAGE
    client = Client(args.socket, connect_timeout=args.timeout, read_timeout=args.timeout)
    try:
        reply = asyncio.run(client.request(request))
    except RequestInvalid as exc:
        print(f"{exc.error.code}: {exc.error.message} (at {exc.error.path})", file=sys.stderr)
        return EXIT_USAGE
    except Refused as exc:  # refused before it was read: not applied
        print(f"{exc.code}: {exc.message}", file=sys.stderr)
        return EXIT_REFUSED
    except ClientError as exc:
        print(f"transport: {type(exc).__name__}: {exc}", file=sys.stderr)
        return EXIT_TRANSPORT
    sys.stdout.buffer.write(encode_reply(reply) + b"\n")
    sys.stdout.flush()
    refusals = _refusals(reply)
    for line in refusals:
        print(line, file=sys.stderr)
    return EXIT_REFUSED if refusals else EXIT_OK


def schema_command(argv: Sequence[str]) -> int:
    """Print the schema, or write / compare the schema and golden vectors in a directory."""
    parser = argparse.ArgumentParser(
        prog="python -m ficc.execution schema",
        description="The JSON Schema (2020-12) of protocol version 1, and its golden vectors.",
    )
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--write", type=pathlib.Path, metavar="DIR", help="write the files here")
    where.add_argument("--check", type=pathlib.Path, metavar="DIR", help="compare with DIR")
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:
        return EXIT_OK if exc.code == 0 else EXIT_USAGE
    if args.write is not None:
        for name, data in _schema.files().items():
            path = args.write / name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)
        return EXIT_OK
    if args.check is not None:
        problems = _schema.differences(_generated_files(args.check))
        for line in problems:
            print(f"{args.check}/{line}", file=sys.stderr)
        if problems:
            print(
                f"regenerate: python -m ficc.execution schema --write {args.check}", file=sys.stderr
            )
        return EXIT_REFUSED if problems else EXIT_OK
    sys.stdout.buffer.write(_schema.files()[_schema.SCHEMA_FILE])
    return EXIT_OK


def _generated_files(root: pathlib.Path) -> dict[str, bytes]:
    """The schema and every file in the vectors directory below `root`, by relative path."""
    paths = [root / _schema.SCHEMA_FILE, *sorted((root / _schema.VECTORS).glob("*"))]
    return {str(p.relative_to(root)): p.read_bytes() for p in paths if p.is_file()}


def _version() -> str:
    try:
        return f"ficc-protocol {metadata.version('ficc-protocol')}"
    except metadata.PackageNotFoundError:  # a source tree on sys.path, not installed
        return "ficc-protocol (not installed)"


def main(argv: Sequence[str] | None = None) -> int:
    """`request` here; everything else (help and --version included) is the host's
    `ficc-executor` command when ficc-executor-host is installed."""
    args = list(sys.argv[1:] if argv is None else argv)
    command, rest = (args[0], args[1:]) if args else ("", [])
    if command == "request":
        return request_command(rest)
    if command == "schema":
        return schema_command(rest)
    if command == "upload":
        return _upload.upload_command(rest)
    try:
        host = importlib.import_module(_HOST_COMMANDS)
    except ModuleNotFoundError as exc:
        if exc.name not in ("ficc.execution.host", _HOST_COMMANDS):
            raise
        if command in ("", "-h", "--help"):
            print(__doc__)
            return EXIT_OK if args else EXIT_USAGE
        if command == "--version":
            print(_version())
            return EXIT_OK
        print(f"install ficc-executor-host for `{command}`", file=sys.stderr)
        return EXIT_USAGE
    return int(host.main(args))


if __name__ == "__main__":
    raise SystemExit(main())
