"""What `status` shows of the running daemon beyond its snapshot's pages: the versions it
runs against the ones installed now, and each slot's health.

The daemon reports the versions it read when it started (`daemon: true`); this command
reads the installed metadata in its own process. After `pip install` of a release and
before the restart the two differ, and `status` says so: the daemon line names what
runs, never what merely lies on disk. A daemon older than this command refuses the
fields it does not know (`invalid_request`): `status` then says the running daemon is
older than what is installed, rather than guess its version.

Each slot's health (`slots: true`): a slot whose checks fail is out of the offer, and
its line says why and what to do.
"""

from __future__ import annotations

import datetime
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

from ficc.execution.client import Client
from ficc.execution.errors import ErrorCode
from ficc.execution.host.context.build import DISTRIBUTIONS, HOST, UNKNOWN, installed_versions
from ficc.execution.protocol import SnapshotRequest
from ficc.execution.wire import DaemonInfo, Error, ErrorReply, SlotState, SnapshotReply

__all__ = [
    "Running",
    "daemon_lines",
    "fetch_running",
    "running_json",
    "slot_lines",
    "slot_table",
]

_LABEL = 15
"""The width of `status`'s left-hand labels (`daemon         0.1.0`)."""


@dataclass(frozen=True)
class Running:
    """The running daemon as one snapshot with `slots: true, daemon: true` showed it
    (`daemon` and `slots` None: not reported, `refusal` says why when the daemon refused
    the request), and what this command's process finds installed."""

    daemon: DaemonInfo | None
    slots: list[SlotState] | None
    usable: dict[str, tuple[int, int]]
    """class -> (usable now, total)."""
    installed: dict[str, str]
    refusal: Error | None = None

    @property
    def version(self) -> str | None:
        """The version of ficc-executor-host the daemon runs (None: not reported)."""
        if self.daemon is None:
            return None
        return dict(_pairs(self.daemon)).get(HOST)

    def differences(self) -> list[tuple[str, str, str]]:
        """(distribution, running, installed) for each that differs."""
        if self.daemon is None:
            return []
        return [
            (name, version, self.installed.get(name, "not installed"))
            for name, version in _pairs(self.daemon)
            if self.installed.get(name, "not installed") != version
        ]


def _pairs(daemon: DaemonInfo) -> list[tuple[str, str]]:
    return [(v.distribution, v.version) for v in daemon.versions]


async def fetch_running(client: Client) -> Running:
    """One snapshot asking for the slots' health and what the daemon runs."""
    request = SnapshotRequest(
        version=1, id=secrets.token_hex(16), after=None, slots=True, daemon=True
    )
    reply = await client.request(request)
    installed = installed_versions(DISTRIBUTIONS)
    if isinstance(reply, ErrorReply):  # invalid_request: a daemon older than the fields
        return Running(None, None, {}, installed, reply.error)
    assert isinstance(reply, SnapshotReply)  # decode_reply picks it for "snapshot"
    usable = {
        c.class_: (c.usable, c.total)
        for c in reply.capacity.slot_classes
        if isinstance(c.usable, int)
    }
    daemon = None if isinstance(reply.daemon, msgspec.UnsetType) else reply.daemon
    slots = None if isinstance(reply.slots, msgspec.UnsetType) else reply.slots
    return Running(daemon, slots, usable, installed)


def daemon_lines(running: Running) -> list[str]:
    """The daemon's version and start, and one line per installed distribution that
    differs from what runs (restart the daemon to run it)."""
    if running.daemon is None:
        return [_label("daemon", _not_reported(running))]
    lines = [_label("daemon", f"{running.version}   started {_utc(running.daemon.started_at_ms)}")]
    for name, version, installed in running.differences():
        lines.append(
            _label(
                "  installed",
                f"{name} {installed}, but the daemon runs {version}: restart the daemon"
                " to run what is installed",
            )
        )
    if running.daemon.tasks is not None:
        lines.append(_label("  tasks", running.daemon.tasks))
    return lines


def _not_reported(running: Running) -> str:
    refusal = running.refusal
    if refusal is not None and refusal.code != ErrorCode.INVALID_REQUEST:
        return f"not reported ({refusal.code}: {refusal.message})"
    installed = running.installed.get(HOST, UNKNOWN)
    return (
        f"not reported: the running daemon is older than the installed {HOST} {installed};"
        " restart it to run what is installed"
    )


def slot_lines(running: Running) -> list[str]:
    """Each slot's health, what to do about each broken one, and the usable slots by
    class; nothing when the daemon did not report them."""
    if running.slots is None:
        return []
    out = ["", *slot_table(running.slots)]
    usable = ", ".join(f"{c} {n} of {total}" for c, (n, total) in sorted(running.usable.items()))
    out.append(_label("usable now", usable or "-"))
    return out


def slot_table(slots: Sequence[SlotState]) -> list[str]:
    """The slots' table, then what to do about each broken one."""
    headers = ["SLOT", "CLASS", "STATE", "FREE", "SINCE (UTC)", "REASON"]
    rows = [
        [
            s.id,
            s.class_,
            "ok" if s.healthy else "BROKEN",
            "yes" if s.free else "no",
            _utc(s.since_ms),
            s.reason or "-",
        ]
        for s in slots
    ]
    return [_table(headers, rows), *(f"  {s.id}: {_own(s)}" for s in slots if not s.healthy)]


def _own(state: SlotState) -> str:
    """A broken slot's message without the `slot ID: ` its line already starts with."""
    message = state.message or "-"
    return message.removeprefix(f"slot {state.id}: ")


def running_json(running: Running | None) -> dict[str, Any]:
    """The `--json` document's fields for the running daemon (null where not reported)."""
    if running is None:
        return {"daemon": None, "slots": None, "installed": None, "installed_differs": []}
    return {
        "daemon": None if running.daemon is None else msgspec.to_builtins(running.daemon),
        "slots": None if running.slots is None else msgspec.to_builtins(running.slots),
        "installed": running.installed,
        "installed_differs": [
            {"distribution": n, "running": r, "installed": i} for n, r, i in running.differences()
        ],
    }


def _label(label: str, value: str) -> str:
    return f"{label.ljust(_LABEL - 1)} {value}"


def _utc(when_ms: int) -> str:
    """RFC 3339 in UTC, to the second (the clock of the daemon's log lines)."""
    when = datetime.datetime.fromtimestamp(when_ms / 1000, datetime.UTC)
    return when.strftime("%Y-%m-%dT%H:%M:%SZ")


def _table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(r[i]) for r in [headers, *rows]) for i in range(len(headers))]
    lines = [
        "  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip()
        for r in [headers, *rows]
    ]
    return "\n".join(lines)
