"""sd_notify and the watchdog heartbeat, over a real datagram socket standing in for
systemd's NOTIFY_SOCKET (the daemon under real systemd is tested in tools/systemd)."""

from __future__ import annotations

import asyncio
import os
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from ficc.execution.host.ledger.store import AttemptRecord
from ficc.execution.host.linux import notify
from ficc.execution.host.runner.monitor import Monitor


@pytest.fixture
def supervisor(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[socket.socket]:
    """A bound datagram socket named by NOTIFY_SOCKET, as systemd sets it."""
    path = tmp_path / "notify.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(str(path))
        sock.setblocking(False)
        monkeypatch.setenv(notify.ENV, str(path))
        yield sock


def received(sock: socket.socket) -> list[str]:
    messages = []
    while True:
        try:
            messages.append(sock.recv(4096).decode())
        except BlockingIOError:
            return messages


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_heartbeat_pings_at_most_once_per_interval(supervisor: socket.socket) -> None:
    clock = Clock()
    heartbeat = notify.Heartbeat(30.0, clock)
    heartbeat.beat()
    assert received(supervisor) == ["WATCHDOG=1"]
    for step in (0.2, 10.0, 29.0):  # ticks within the interval: no more pings
        clock.now = 100.0 + step
        heartbeat.beat()
    assert received(supervisor) == []
    clock.now = 130.0
    heartbeat.beat()
    assert received(supervisor) == ["WATCHDOG=1"]


def test_no_watchdog_configured_means_no_ping(supervisor: socket.socket) -> None:
    notify.Heartbeat(None).beat()
    assert received(supervisor) == []


@pytest.mark.parametrize(
    ("usec", "pid", "expected"),
    [
        ("60000000", None, 30.0),
        ("60000000", "self", 30.0),
        ("60000000", "1", None),  # meant for another process
        ("0", None, None),
        ("abc", None, None),
        (None, None, None),
    ],
)
def test_the_interval_is_half_of_what_systemd_sets_for_this_process(
    monkeypatch: pytest.MonkeyPatch, usec: str | None, pid: str | None, expected: float | None
) -> None:
    for name, value in (("WATCHDOG_USEC", usec), ("WATCHDOG_PID", pid)):
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, str(os.getpid()) if value == "self" else value)
    assert notify.watchdog_interval() == expected


def test_a_vanished_supervisor_is_logged_not_raised(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv(notify.ENV, str(tmp_path / "gone.sock"))
    notify.Heartbeat(1.0).beat()
    assert "watchdog_failed" in caplog.text


class Hanging:
    """Monitor ops whose second `watched` never returns: a wedged tick."""

    def __init__(self) -> None:
        self.calls = 0
        self.hung = asyncio.Event()

    async def watched(self) -> list[AttemptRecord]:
        self.calls += 1
        if self.calls >= 2:
            self.hung.set()
            await asyncio.Event().wait()
        return []


def test_a_wedged_monitor_stops_feeding_the_watchdog(supervisor: socket.socket) -> None:
    """The pings come from completed monitor ticks: once a tick hangs, however live the
    event loop stays, no WATCHDOG=1 is sent any more (systemd then restarts us)."""
    clock = Clock()
    heartbeat = notify.Heartbeat(0.5, clock)

    def on_tick() -> None:
        heartbeat.beat()
        clock.now += 1.0  # every tick is a whole interval apart: each one may ping

    async def scenario() -> None:
        ops = Hanging()
        monitor = Monitor(ops, interval=0.0, on_tick=on_tick)  # type: ignore[arg-type]
        task = asyncio.get_running_loop().create_task(monitor.run())
        await ops.hung.wait()
        for _ in range(100):  # the loop keeps running other work
            await asyncio.sleep(0)
        assert monitor.ticks == 1
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(asyncio.wait_for(scenario(), 30))
    assert received(supervisor) == ["WATCHDOG=1"]
