"""`status` and `metrics`: ask a running daemon over its socket and print a table (or
its JSON), with transport failures explained."""

from __future__ import annotations

import argparse
import asyncio
import datetime
import errno
import json
import os
import re
import secrets
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass

import msgspec

from ficc.execution.client import Client, ClientError, ConnectFailed
from ficc.execution.errors import ErrorCode
from ficc.execution.host.cli.exits import (
    EXIT_OK,
    EXIT_REFUSED,
    EXIT_TRANSPORT,
    MAX_PAGES,
    TRANSPORT,
    json_refusal,
)
from ficc.execution.host.cli.running import (
    Running,
    daemon_lines,
    fetch_running,
    running_json,
    slot_lines,
    slot_table,
)
from ficc.execution.host.config.load import load_config
from ficc.execution.host.core.codes import HostCode
from ficc.execution.host.core.errors import HostError
from ficc.execution.host.linux.notify import systemd_is_init
from ficc.execution.protocol import CheckSlotsRequest, MetricsRequest, SnapshotRequest
from ficc.execution.wire import (
    TERMINAL,
    AttemptStatus,
    ErrorReply,
    MetricsReply,
    SlotsReply,
    SnapshotReply,
    Usage,
)


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
        pages = asyncio.run(fetch_snapshots(client, changed=True))
        if isinstance(pages, ErrorReply) and pages.error.code == ErrorCode.INVALID_REQUEST:
            pages = asyncio.run(fetch_snapshots(client))  # a daemon older than this command
        running = None if isinstance(pages, ErrorReply) else asyncio.run(fetch_running(client))
        daemon_version = None if running is None else running.version
    except ClientError as exc:
        print(transport_failure(exc, path), file=sys.stderr)
        json_refusal(args, TRANSPORT, transport_failure(exc, path))
        return EXIT_TRANSPORT
    if isinstance(pages, ErrorReply):
        print(f"{pages.error.code}: {pages.error.message}", file=sys.stderr)
        json_refusal(args, pages.error.code, pages.error.message)
        return EXIT_REFUSED
    selection = Selection(show_all=args.all, since_ms=args.since)
    pages, hidden = selection.apply(pages)
    if args.json:
        document = {
            "daemon_version": daemon_version,
            "pages": [msgspec.to_builtins(p) for p in pages],
            **running_json(running),
        }
        print(json.dumps(document, sort_keys=True))
        return EXIT_OK
    now_ms = time.time_ns() // 1_000_000
    text = format_status(pages, now_ms=now_ms, daemon_version=daemon_version, running=running)
    sys.stdout.write(with_selection(text, selection, hidden))
    return EXIT_OK


async def fetch_metrics(client: Client) -> MetricsReply | ErrorReply:
    reply = await client.request(MetricsRequest(version=1, id=secrets.token_hex(16)))
    assert isinstance(reply, (MetricsReply, ErrorReply))  # decode_reply picks it
    return reply


def _daemon(daemon_version: str | None, running: Running | None) -> list[str]:
    """The `daemon` line: what the running daemon reported of itself (`cli/running.py`)."""
    if running is not None:
        return daemon_lines(running)
    return [f"daemon         {daemon_version or '-'}"]


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


def check_slots_command(args: argparse.Namespace) -> int:
    """`check-slots`: the administrator asks the daemon to check every slot now (a
    repaired slot is back in the offer at once) and sees each one's health. Exit 0 when
    every slot is in service, 1 otherwise (each broken one's code and message on
    stderr), 3 without a trustworthy reply."""
    path = _socket_of(args)
    client = Client(path, connect_timeout=args.timeout, read_timeout=args.timeout)
    request = CheckSlotsRequest(version=1, id=secrets.token_hex(16))
    try:
        reply = asyncio.run(client.request(request))
    except ClientError as exc:
        print(transport_failure(exc, path), file=sys.stderr)
        json_refusal(args, TRANSPORT, transport_failure(exc, path))
        return EXIT_TRANSPORT
    if isinstance(reply, ErrorReply):
        print(f"{reply.error.code}: {reply.error.message}", file=sys.stderr)
        json_refusal(args, reply.error.code, reply.error.message)
        return EXIT_REFUSED
    assert isinstance(reply, SlotsReply)  # decode_reply picks it for "check_slots"
    if args.json:
        print(json.dumps({"slots": msgspec.to_builtins(reply.slots)}, sort_keys=True))
    else:
        sys.stdout.write("\n".join(slot_table(reply.slots)) + "\n")
    broken = [s for s in reply.slots if not s.healthy]
    for state in broken:
        print(f"{state.reason}: {state.message}", file=sys.stderr)
    return EXIT_REFUSED if broken else EXIT_OK


async def fetch_snapshots(
    client: Client, *, changed: bool = False
) -> list[SnapshotReply] | ErrorReply:
    """Every snapshot page with what each attempt used (`usage: true`) and, with
    `changed`, when each attempt's status last changed, following `next` until it is
    null (or the first refusal)."""
    pages: list[SnapshotReply] = []
    after: str | None = None
    asked = {"usage": True, **({"changed": True} if changed else {})}
    for _ in range(MAX_PAGES):
        reply = await client.request(
            SnapshotRequest(version=1, id=secrets.token_hex(16), after=after, **asked)
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
    pages: Sequence[SnapshotReply],
    *,
    now_ms: int,
    daemon_version: str | None = None,
    running: Running | None = None,
) -> str:
    """A readable, stable text table of one snapshot (all its pages); with `running`,
    what the daemon runs against what is installed, and each slot's health."""
    first = pages[0]
    attempts = [a for page in pages for a in page.attempts]
    offer = first.offer
    res = offer.limits.resources
    avail = first.capacity.available
    out = [
        *_daemon(daemon_version, running),
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
        *([] if running is None else slot_lines(running)),
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
        out.append(_attempts_table(attempts, now_ms))
    return "\n".join(out) + "\n"


ATTEMPT_HEADERS = ["ATTEMPT", "CHANGED (UTC)", "GEN", "STATE", "READY", "OUTCOME", "REASON"]
ATTEMPT_HEADERS += ["EXIT", "LEASE", "SLOT", "CPU", "PEAK MEM", "OOM"]


def _attempt_row(a: AttemptStatus, now_ms: int) -> list[str]:
    return [
        a.attempt_id,
        _changed_cell(a),
        str(a.generation),
        a.state,
        _ready_cell(a),
        a.outcome or "-",
        a.reason or "-",
        "-" if a.exit_code is None else str(a.exit_code),
        "-" if a.outcome is not None else _lease(a.lease_expires_at_ms, now_ms),
        a.slot or "-",
        *_usage_cells(a.usage),
    ]


def _attempts_table(attempts: Sequence[AttemptStatus], now_ms: int) -> str:
    """The attempts by the time of their last change, oldest first (a record the host
    made before it recorded times first of all, by ID): a host that ran for months
    lists its history in the order it happened, the live attempts last."""
    ordered = sorted(attempts, key=lambda a: (_changed_ms(a), a.attempt_id))
    return _table(ATTEMPT_HEADERS, [_attempt_row(a, now_ms) for a in ordered])


def _changed_ms(a: AttemptStatus) -> int:
    """The time to order and choose by; -1 (before every time) where the host has none,
    so records older than its clock come first and `--since` never picks them."""
    return a.changed_at_ms if isinstance(a.changed_at_ms, int) else -1


def _changed_cell(a: AttemptStatus) -> str:
    """When the status last changed; `-` when the host has no time for it."""
    return _utc(a.changed_at_ms) if isinstance(a.changed_at_ms, int) else "-"


def _utc(when_ms: int) -> str:
    """RFC 3339 in UTC, to the second, as the daemon's log lines are: one clock for
    both, whatever the host's time zone."""
    when = datetime.datetime.fromtimestamp(when_ms / 1000, datetime.UTC)
    return when.strftime("%Y-%m-%dT%H:%M:%SZ")


def _ready_cell(a: AttemptStatus) -> str:
    """`ready` means something only until the attempt ends: an ended or released
    attempt shows `-` (the record keeps the last value, which says nothing then)."""
    if a.state in TERMINAL or a.state == "released":
        return "-"
    return "yes" if a.ready else "no"


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


# --- which attempts: live ones by default, the history with --all or --since ------------


@dataclass(frozen=True)
class Selection:
    """Which attempts `status` shows: those not released (the live ones), every one
    (`--all`), or those whose status changed at or after `since_ms` (`--since`,
    released ones included). A host that ran for months holds every attempt it ever
    admitted, and its operator asks first about what is live now."""

    show_all: bool = False
    since_ms: int | None = None

    def keeps(self, a: AttemptStatus) -> bool:
        if self.since_ms is not None:
            return _changed_ms(a) >= self.since_ms
        return self.show_all or a.state != "released"

    def apply(self, pages: list[SnapshotReply]) -> tuple[list[SnapshotReply], int]:
        """The pages with only the kept attempts (each page otherwise as the daemon
        sent it), and how many were left out."""
        kept = [
            msgspec.structs.replace(page, attempts=[a for a in page.attempts if self.keeps(a)])
            for page in pages
        ]
        hidden = sum(len(p.attempts) for p in pages) - sum(len(p.attempts) for p in kept)
        return kept, hidden

    def describe(self) -> str:
        if self.since_ms is not None:
            return f"changed since {_utc(self.since_ms)}"
        return "every attempt" if self.show_all else "live (not released)"


def with_selection(text: str, selection: Selection, hidden: int) -> str:
    """`text` with its `attempts` line saying which attempts are shown and how many are
    left out, so a short list is never mistaken for the whole ledger."""
    more = f"; {hidden} more with --all" if hidden else ""
    lines = [
        f"{line}   {selection.describe()}{more}" if line.startswith("attempts       ") else line
        for line in text.split("\n")
    ]
    return "\n".join(lines)


_DURATION = re.compile(r"\A(?P<count>[0-9]{1,9})(?P<unit>[smhd])\Z")
_UNIT_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def since_argument(text: str) -> int:
    """`--since`: a duration back from now (`90s`, `30m`, `2h`, `3d`) or an RFC 3339 time
    with its offset (`2026-12-01T10:00:00Z`), as Unix milliseconds."""
    duration = _DURATION.match(text)
    if duration is not None:
        seconds = int(duration["count"]) * _UNIT_SECONDS[duration["unit"]]
        return time.time_ns() // 1_000_000 - seconds * 1000
    try:
        when = datetime.datetime.fromisoformat(text)
    except ValueError:
        when = None
    if when is None or when.tzinfo is None:
        raise argparse.ArgumentTypeError(
            f"{text!r} is neither a duration (90s, 30m, 2h, 3d) nor an RFC 3339 time with"
            " its offset (2026-12-01T10:00:00Z, 2026-12-01T11:00:00+01:00)"
        )
    return int(when.timestamp() * 1000)


def add_filters(parser: argparse.ArgumentParser) -> None:
    """`status`'s choice of attempts (see `Selection`)."""
    parser.add_argument(
        "--all", action="store_true",
        help="every attempt the ledger holds, released ones too (default: live ones only)",
    )  # fmt: skip
    parser.add_argument(
        "--since", type=since_argument, metavar="WHEN",
        help="attempts whose status changed since WHEN, released ones too: a duration"
        " back from now (30m, 2h, 3d) or an RFC 3339 time (2026-12-01T10:00:00Z)",
    )  # fmt: skip
