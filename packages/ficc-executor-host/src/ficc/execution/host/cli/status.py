"""`status` and `metrics`: ask a running daemon over its socket and print a table (or
its JSON), with transport failures explained."""

from __future__ import annotations

import argparse
import asyncio
import errno
import json
import os
import secrets
import sys
import time
from collections.abc import Sequence

import msgspec

from ficc.execution.client import Client, ClientError, ConnectFailed
from ficc.execution.host.cli.exits import (
    EXIT_OK,
    EXIT_REFUSED,
    EXIT_TRANSPORT,
    MAX_PAGES,
    TRANSPORT,
    json_refusal,
)
from ficc.execution.host.config.load import load_config
from ficc.execution.host.core.codes import HostCode
from ficc.execution.host.core.errors import HostError
from ficc.execution.host.linux.notify import systemd_is_init
from ficc.execution.protocol import MetricsRequest, SnapshotRequest
from ficc.execution.wire import AttemptStatus, ErrorReply, MetricsReply, SnapshotReply, Usage


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


def status_command(args: argparse.Namespace) -> int:
    path = _socket_of(args)
    client = Client(path, connect_timeout=args.timeout, read_timeout=args.timeout)
    try:
        pages = asyncio.run(fetch_snapshots(client))
        daemon_version = None
        if not isinstance(pages, ErrorReply) and os.path.basename(path) == "admin.sock":
            daemon_version = asyncio.run(fetch_version(client))
    except ClientError as exc:
        print(transport_failure(exc, path), file=sys.stderr)
        json_refusal(args, TRANSPORT, transport_failure(exc, path))
        return EXIT_TRANSPORT
    if isinstance(pages, ErrorReply):
        print(f"{pages.error.code}: {pages.error.message}", file=sys.stderr)
        json_refusal(args, pages.error.code, pages.error.message)
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


def print_metrics(args: argparse.Namespace) -> int:
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
    for _ in range(MAX_PAGES):
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
    raise HostError(HostCode.STATUS_CURSOR, f"more than {MAX_PAGES} snapshot pages; giving up")


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
        out.append(_table(ATTEMPT_HEADERS, [_attempt_row(a, now_ms) for a in attempts]))
    return "\n".join(out) + "\n"


ATTEMPT_HEADERS = ["ATTEMPT", "GEN", "STATE", "READY", "OUTCOME", "REASON", "EXIT"]
ATTEMPT_HEADERS += ["LEASE", "SLOT", "CPU", "PEAK MEM", "OOM"]


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
