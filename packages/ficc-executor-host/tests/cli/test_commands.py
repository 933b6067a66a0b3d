"""`serve` and `status` (commands.py), with a fake daemon that implements the contract.

`run_daemon` is driven for real: real sockets under /run, a real sd_notify datagram
socket (abstract namespace, as systemd may pass), a real SIGTERM to this process. The
core (`ficc.execution.host.daemon.root`) is replaced by the fake through `open_daemon`; the
integration tests in tests-integration/ run the real one as a separate process.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import platform
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path
from typing import Any

import pytest

from ficc.execution.client import Client
from ficc.execution.host.cli import commands, serve
from ficc.execution.host.cli.serve import run_daemon
from ficc.execution.host.cli.status import (
    Selection,
    fetch_snapshots,
    format_status,
    since_argument,
    with_selection,
)
from ficc.execution.host.config.load import parse_config
from ficc.execution.host.config.model import Config
from ficc.execution.host.core.errors import HostError
from ficc.execution.host.daemon import logs
from ficc.execution.host.daemon.server import ServerLimits
from ficc.execution.protocol import AnyRequest, OfferLimits, Resources, Sender, SnapshotRequest
from ficc.execution.wire import (
    AnyReply,
    AttemptStatus,
    Capacity,
    Offer,
    ProviderInfo,
    SlotClass,
    SnapshotReply,
    Usage,
    error_reply,
)
from ficc_testkit.units import MIB

RFC3339 = re.compile(r"\A\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}Z\Z")
NOW_MS = 1_800_000_000_000
RESOURCES = Resources(
    attempts=4,
    cpu_millis=2000,
    memory_bytes=4 << 30,
    swap_bytes=0,
    processes=512,
    storage_bytes=20 << 30,
    storage_inodes=200_000,
)


def status_row(n: int, **fields: Any) -> AttemptStatus:
    values: dict[str, Any] = {
        "attempt_id": f"{n:032x}",
        "generation": 1,
        "plan_digest": "sha256:" + "d" * 64,
        "state": "prepared",
        "ready": False,
        "outcome": None,
        "reason": None,
        "exit_code": None,
        "lease_sequence": 1,
        "lease_expires_at_ms": NOW_MS + 90_500,
        "slot": "small-0",
        "staged_bytes": 0,
        "stdout_bytes": 0,
        "stderr_bytes": 0,
        "cleanup_confirmed": False,
    }
    values.update(fields)
    return AttemptStatus(**values)


def page(
    attempts: list[AttemptStatus], next_cursor: str | None, rid: str = "9" * 32
) -> SnapshotReply:
    return SnapshotReply(
        version=1,
        id=rid,
        installation_id="1" * 32,
        ledger_id="2" * 32,
        admission_version=1,
        maximum_lease_seconds=600,
        input_chunk_bytes=8 * MIB,
        offer=Offer(3, "paused", OfferLimits(RESOURCES, ["3" * 32], ["test"])),
        capacity=Capacity(
            available=RESOURCES,
            slot_classes=[
                SlotClass(class_="small", total=2, free=1, bytes=20 << 30, inodes=200_000)
            ],
            providers=[
                ProviderInfo("test", "sha256:" + "a" * 64, True),
                ProviderInfo("podman", "sha256:" + "b" * 64, False),
            ],
        ),
        attempts=attempts,
        next=next_cursor,
    )


# --- status: the table ------------------------------------------------------------------


def test_status_table_shows_bindings_offer_capacity_providers_and_attempts() -> None:
    first = page([status_row(1)], next_cursor=f"{1:032x}")
    second = page(
        [
            status_row(2, state="running", ready=True),
            status_row(
                3,
                state="released",
                outcome="failed",
                reason="gate_namespace",
                exit_code=None,
                lease_expires_at_ms=NOW_MS - 1,
                slot=None,
                cleanup_confirmed=True,
            ),
            status_row(
                4, state="released", outcome="succeeded", exit_code=0, slot=None, ready=True
            ),
        ],
        next_cursor=None,
    )
    text = format_status([first, second], now_ms=NOW_MS, daemon_version="9.8.7")
    lines = text.splitlines()
    assert lines[0] == "daemon         9.8.7"
    assert lines[1] == f"installation   {'1' * 32}"
    assert lines[2] == f"ledger         {'2' * 32}   admission_version 1"
    assert lines[3] == "lease ceiling  600 s   input chunk 8.0 MiB"
    assert "offer          revision 3   control paused" in lines
    assert f"  projects     {'3' * 32}" in lines
    assert "  runtimes     test" in lines
    assert any(line.split() == ["memory", "4.0", "GiB", "4.0", "GiB"] for line in lines)
    assert any(line.split() == ["small", "2", "1", "20.0", "GiB", "200000"] for line in lines)
    assert any(line.split()[:2] == ["podman", "UNAVAILABLE"] for line in lines)
    assert "attempts       4" in lines
    header = next(line for line in lines if line.startswith("ATTEMPT"))
    assert header.split() == [
        "ATTEMPT", "CHANGED", "(UTC)", "GEN", "STATE", "READY", "OUTCOME", "REASON", "EXIT",
        "LEASE", "SLOT", "CPU", "PEAK", "MEM", "OOM",
    ]  # fmt: skip
    attempt_lines = [line for line in lines if line[:32].isalnum() and len(line) > 32]
    rows = {line.split()[0]: line.split() for line in attempt_lines}
    assert len(rows) == 4
    assert rows[f"{1:032x}"][1:] == [
        "-", "1", "prepared", "no", "-", "-", "-", "90", "s", "small-0", "-", "-", "-",
    ]  # fmt: skip
    assert rows[f"{2:032x}"][3:5] == ["running", "yes"]
    assert rows[f"{3:032x}"][1:] == [
        "-", "1", "released", "-", "failed", "gate_namespace", "-", "-", "-", "-", "-", "-",
    ]  # fmt: skip
    # a settled attempt's lease no longer matters, even while its deadline is ahead
    assert rows[f"{4:032x}"][8] == "-"
    assert rows[f"{4:032x}"][4] == "-"  # nor does `ready`, once released
    # columns line up: every attempt row starts its STATE column where the header does
    column = header.index("STATE")
    for line in attempt_lines:
        assert line[column - 2 : column] == "  "
        assert line[column] != " "


def test_status_table_shows_cpu_peak_memory_and_oom_kills() -> None:
    """Recorded figures as they are, a live reading marked `~`, unknown ones `-`."""
    oom = Usage(final=True, cpu_user_us=1_250_000, cpu_system_us=40_000,
                memory_peak_bytes=160 << 20, oom_kills=1)  # fmt: skip
    live = Usage(final=False, cpu_user_us=500_000, cpu_system_us=0, memory_peak_bytes=3 << 30)
    attempts = [
        status_row(
            1, state="failed", outcome="failed", reason="memory_exhausted", exit_code=137, usage=oom
        ),
        status_row(2, state="running", ready=True, usage=live),
        status_row(3, state="unknown", outcome="unknown", usage=Usage(final=True, oom_kills=0)),
    ]
    lines = format_status([page(attempts, None)], now_ms=NOW_MS).splitlines()
    rows = {line.split()[0]: line.split() for line in lines if line[:32].isalnum()}
    assert rows[f"{1:032x}"][-5:] == ["1.29", "s", "160.0", "MiB", "1"]
    assert rows[f"{2:032x}"][-5:] == ["~0.50", "s", "~3.0", "GiB", "-"]
    assert rows[f"{3:032x}"][-3:] == ["-", "-", "0"]


def test_status_table_without_attempts_says_so() -> None:
    text = format_status([page([], None)], now_ms=NOW_MS)
    assert "attempts       0" in text.splitlines()
    assert "ATTEMPT" not in text


def test_status_lists_attempts_by_their_last_change_in_utc() -> None:
    """Oldest change first, records the host made before it kept times first of all;
    the time is RFC 3339 in UTC, to the second, as the log lines are."""
    attempts = [
        status_row(1, changed_at_ms=1_800_000_060_000),
        status_row(2, changed_at_ms=1_800_000_000_999),
        status_row(3),
    ]
    lines = format_status([page(attempts, None)], now_ms=NOW_MS).splitlines()
    rows = [line.split()[:2] for line in lines if line[:32].isalnum() and len(line) > 32]
    assert rows == [
        [f"{3:032x}", "-"],
        [f"{2:032x}", "2027-01-15T08:00:00Z"],
        [f"{1:032x}", "2027-01-15T08:01:00Z"],
    ]


def test_status_shows_live_attempts_unless_asked_for_the_history() -> None:
    live = status_row(1, changed_at_ms=NOW_MS - 3_600_000)
    old = status_row(2, state="released", outcome="succeeded", slot=None,
                     changed_at_ms=NOW_MS - 3 * 86_400_000)  # fmt: skip
    recent = status_row(3, state="released", outcome="failed", slot=None,
                        changed_at_ms=NOW_MS - 60_000)  # fmt: skip
    pages = [page([live, old, recent], None)]

    def shown(selection: Selection) -> list[str]:
        kept, _ = selection.apply(pages)
        return [a.attempt_id[-1] for p in kept for a in p.attempts]

    assert shown(Selection()) == ["1"]
    assert shown(Selection(show_all=True)) == ["1", "2", "3"]
    assert shown(Selection(since_ms=NOW_MS - 7_200_000)) == ["1", "3"]
    kept, hidden = Selection().apply(pages)
    text = with_selection(format_status(kept, now_ms=NOW_MS), Selection(), hidden)
    assert "attempts       1   live (not released); 2 more with --all" in text.splitlines()


@pytest.mark.parametrize(
    ("given", "ago_ms"),
    [("90s", 90_000), ("30m", 1_800_000), ("2h", 7_200_000), ("3d", 259_200_000)],
)
def test_since_takes_a_duration_back_from_now(given: str, ago_ms: int) -> None:
    before = time.time_ns() // 1_000_000
    since = since_argument(given)
    assert before - ago_ms <= since <= time.time_ns() // 1_000_000 - ago_ms


def test_since_takes_an_rfc_3339_time_and_refuses_anything_else() -> None:
    assert since_argument("2027-01-15T08:00:00Z") == 1_800_000_000_000
    assert since_argument("2027-01-15T09:00:00+01:00") == 1_800_000_000_000
    for bad in ("2027-01-15T08:00:00", "yesterday", "2w", "-2h"):
        with pytest.raises(argparse.ArgumentTypeError, match="neither a duration"):
            since_argument(bad)


# --- serve: the real shell around a fake daemon --------------------------------------------


class FakeDaemon:
    """The contract; snapshots come in two pages so `status` must follow `next`."""

    def __init__(self) -> None:
        self.started = False
        self.closed = False
        self.calls: list[tuple[Sender, str]] = []

    async def start(self) -> None:
        self.started = True

    async def close(self) -> None:
        self.closed = True

    def input_chunk_bytes(self) -> int:
        return 8 * MIB

    async def dispatch(self, sender: Sender, uid: int, request: AnyRequest) -> AnyReply:
        self.calls.append((sender, request.action))
        if isinstance(request, SnapshotRequest):
            if request.after is None:
                return page([status_row(1)], f"{1:032x}", request.id)
            return page([status_row(2)], None, request.id)
        return error_reply(request.id, "unknown_attempt", "fake")


pytestmark = pytest.mark.root("needs root: sockets are owned per role under /run")


@pytest.fixture
def socket_dir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="ficc-t-commands-", dir="/run"))
    os.chmod(path, 0o711)
    try:
        yield path
    finally:
        shutil.rmtree(path)


def config_for(socket_dir: Path) -> Config:
    doc = f"""{{
      "installation_id": "{"1" * 32}", "deployment_id": "{"4" * 32}", "node_id": "{"5" * 32}",
      "mode": "voluntary", "transport_uid": 3999990, "local_owner_uids": [3999991],
      "maximum_lease_seconds": 600, "state_dir": "/run/ficc-t-commands-unused-state",
      "socket_dir": "{socket_dir}", "supervisor": "cgroupfs",
      "slots": [{{"id": "small-0", "class": "small", "generation": 1,
                  "path": "/run/ficc-t-commands-unused-slot", "uid": 3999992, "gid": 3999992,
                  "storage_bytes": 1, "storage_inodes": 1,
                  "filesystem_uuid": "00000000-0000-4000-8000-000000000001"}}],
      "ceiling": {{"cpu_millis": 1, "memory_bytes": 1, "swap_bytes": 0, "processes": 1,
                   "slots": 1, "devices": [], "projects": [], "runtimes": ["test"]}},
      "initial_offer": {{"control": "active", "cpu_millis": 1, "memory_bytes": 1,
                   "swap_bytes": 0, "processes": 1, "slots": 1, "devices": [], "projects": [],
                   "runtimes": []}},
      "providers": [{{"id": "test", "package_digest": "sha256:{"a" * 64}"}}]
    }}"""
    return parse_config(doc.encode(), ".json")


@pytest.fixture
def notifications(monkeypatch: pytest.MonkeyPatch) -> Iterator[socket.socket]:
    """A datagram socket in the abstract namespace, passed as NOTIFY_SOCKET=@name."""
    name = f"ficc-t-notify-{os.getpid()}-{os.urandom(4).hex()}"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind("\0" + name)
    sock.setblocking(False)
    monkeypatch.setenv("NOTIFY_SOCKET", "@" + name)
    monkeypatch.setenv("WATCHDOG_USEC", "200000")
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid()))
    try:
        yield sock
    finally:
        sock.close()


async def next_notification(sock: socket.socket) -> set[str]:
    async with asyncio.timeout(30):
        data = await asyncio.get_running_loop().sock_recv(sock, 4096)
    return set(data.decode().split("\n"))


async def until(sock: socket.socket, line: str) -> set[str]:
    while line not in (message := await next_notification(sock)):
        pass
    return message


def test_serve_listens_notifies_serves_and_stops_on_sigterm(
    socket_dir: Path, notifications: socket.socket, capsys: pytest.CaptureFixture[str]
) -> None:
    fake = FakeDaemon()
    config = config_for(socket_dir)
    admin = str(socket_dir / "admin.sock")

    async def main() -> None:
        daemon = asyncio.ensure_future(
            run_daemon(config, limits=ServerLimits(), open_daemon=lambda c, p: fake)
        )
        ready = await until(notifications, "READY=1")
        assert any(line.startswith("STATUS=serving 3 sockets") for line in ready)
        assert fake.started
        assert gc.get_freeze_count() > 0  # what startup made is set aside
        # No WATCHDOG=1 here: the pings come from the monitor's ticks (test_notify.py,
        # and the daemon under real systemd in tools/systemd/tests/test_daemon_unit.py).
        pages = await fetch_snapshots(Client(admin))
        assert isinstance(pages, list)
        assert [a.attempt_id for p in pages for a in p.attempts] == [f"{1:032x}", f"{2:032x}"]
        status = await asyncio.to_thread(commands.main, ["status", "--socket", admin])
        assert status == 0
        os.kill(os.getpid(), signal.SIGTERM)
        await until(notifications, "STOPPING=1")
        async with asyncio.timeout(30):
            await daemon
        assert fake.closed

    assert gc.get_freeze_count() == 0
    asyncio.run(main())
    assert gc.get_freeze_count() == 0  # and given back when it stops
    out, err = capsys.readouterr()
    assert "attempts       2   live (not released)" in out.splitlines()
    events = [line for line in err.splitlines() if line.startswith("{")]
    assert any('"event":"ready"' in e for e in events)
    assert any('"event":"stopped"' in e for e in events)
    # status: every snapshot page, then one snapshot asking for the slots and the daemon
    assert fake.calls == [(Sender.ADMINISTRATOR, "snapshot")] * 5
    assert not os.path.exists(admin) or _refused(admin)


def _refused(path: str) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        return sock.connect_ex(path) != 0


def test_a_listen_refusal_closes_the_daemon_and_propagates(socket_dir: Path) -> None:
    fake = FakeDaemon()
    (socket_dir / "transport.sock").mkdir()  # something that is not a stale socket
    with pytest.raises(HostError, match=r"^socket_unsafe:"):
        asyncio.run(run_daemon(config_for(socket_dir), open_daemon=lambda c, p: fake))
    assert fake.started
    assert fake.closed


def test_serve_prints_a_startup_refusal_and_exits_1(
    socket_dir: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def refuse(config: Config, path: list[str] | None) -> Any:
        raise HostError("ledger_unsafe", "the ledger file is a symbolic link; remove it")

    monkeypatch.setattr(serve, "checked_config", lambda path: config_for(socket_dir))
    monkeypatch.setattr(serve, "_open_daemon", refuse)
    assert commands.main(["serve", "--config", "/etc/ficc/x.json"]) == 1
    lines = [json.loads(line) for line in capsys.readouterr().err.splitlines()]
    assert all(RFC3339.match(line["ts"]) for line in lines)
    assert lines[0]["event"] == "starting"
    assert lines[0]["version"] == metadata.version("ficc-executor-host")
    refused = lines[-1]
    assert (refused["level"], refused["event"], refused["code"]) == (
        "error",
        "refused",
        "ledger_unsafe",
    )
    assert refused["message"] == "the ledger file is a symbolic link; remove it"


def test_serve_refuses_an_unsafe_configuration_before_opening_anything(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert commands.main(["serve", "--config", "/tmp/ficc-t-absent.json"]) == 1
    # the versions first, even when serve never gets past its configuration
    starting, line = [json.loads(line) for line in capsys.readouterr().err.splitlines()]
    assert (starting["event"], starting["version"]) == (
        "starting",
        metadata.version("ficc-executor-host"),
    )
    assert (line["level"], line["event"], line["code"]) == (
        "error",
        "refused",
        "config_unsafe_file",
    )
    # /tmp is shared: the advice is to move the file, never to change /tmp
    assert "chmod" not in line["message"]
    assert "move it below a directory only root can write" in line["message"]


def test_status_reports_a_missing_socket_as_a_transport_failure(
    socket_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert commands.main(["status", "--socket", str(socket_dir / "admin.sock")]) == 3
    assert "ConnectFailed" in capsys.readouterr().err


# --- the systemd unit ------------------------------------------------------------------------

UNIT = Path(__file__).resolve().parents[2] / "packaging" / "ficc-executor-host.service"


def unit_settings() -> dict[str, list[str]]:
    settings: dict[str, list[str]] = {}
    for line in UNIT.read_text().splitlines():
        if "=" in line and not line.startswith(("#", "[")):
            key, _, value = line.partition("=")
            settings.setdefault(key.strip(), []).append(value.strip())
    return settings


def test_the_unit_runs_serve_as_a_notify_service_with_a_watchdog() -> None:
    settings = unit_settings()
    assert settings["Type"] == ["notify"]
    assert settings["NotifyAccess"] == ["main"]
    assert settings["WatchdogSec"] == ["60s"]
    (exec_start,) = settings["ExecStart"]
    assert " -I -m ficc.execution serve --config " in exec_start
    assert settings["Restart"] == ["on-failure"]
    assert settings["KillMode"] == ["mixed"]
    assert settings["NoNewPrivileges"] == ["yes"]
    assert settings["ProtectSystem"] == ["strict"]
    assert "ProtectControlGroups" not in settings  # the cgroupfs backend writes cgroups
    assert "/sys/fs/cgroup" in settings["ReadWritePaths"]
    # the directories check_host requires, with exactly its modes
    assert settings["StateDirectoryMode"] == ["0700"]
    assert settings["RuntimeDirectoryMode"] == ["0711"]


def test_systemd_accepts_the_unit(tmp_path: Path) -> None:
    """`systemd-analyze verify` on the unit, with ExecStart pointed at this Python."""
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed (apt-get install systemd)")
    text = UNIT.read_text().replace("/opt/ficc/venv/bin/python", os.path.realpath(sys.executable))
    unit = tmp_path / UNIT.name
    unit.write_text(text)
    result = subprocess.run(
        [analyze, "verify", "--man=no", str(unit)], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stderr
    assert result.stderr.strip() == "", result.stderr


# --- the console command ----------------------------------------------------------------------

COMMAND = Path(sys.executable).parent / "ficc-executor"
SUBCOMMANDS = [
    "serve",
    "check-config",
    "status",
    "metrics",
    "check-slots",
    "provider-digest",
    "provision-slot",
    "run",
    "smoke-test",
    "request",
    "upload",
]


def run_command(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(COMMAND), *argv], capture_output=True, text=True, check=False, timeout=60
    )


def test_one_help_lists_every_subcommand() -> None:
    assert COMMAND.exists(), "the ficc-executor console script is not installed"
    shown = run_command("--help")
    assert shown.returncode == 0
    listed = [line.split()[0] for line in shown.stdout.splitlines() if re.match(r"    \S", line)]
    assert listed == SUBCOMMANDS
    module = subprocess.run(
        [sys.executable, "-m", "ficc.execution", "--help"], capture_output=True, text=True,
        check=False, timeout=60,
    )  # fmt: skip
    assert module.stdout.replace("python -m ficc.execution", "ficc-executor") == shown.stdout


def test_a_mistyped_command_gets_the_closest_ones() -> None:
    shown = run_command("stauts", "--config", "/etc/ficc/x.toml")
    assert shown.returncode == 2
    assert "unknown command 'stauts'; did you mean 'status'?" in shown.stderr
    far = run_command("frobnicate")
    assert far.returncode == 2
    assert "did you mean" not in far.stderr
    assert "smoke-test" in far.stderr  # the list of commands instead


def test_upload_is_a_subcommand_of_the_console_command() -> None:
    shown = run_command("upload", "--help")
    assert shown.returncode == 0, shown.stderr
    assert "--plan" in shown.stdout
    assert "--input" in shown.stdout


def test_request_help_is_under_the_console_command_name() -> None:
    shown = run_command("request", "--help")
    assert shown.returncode == 0
    assert shown.stdout.startswith("usage: ficc-executor request ")


def test_provision_slot_help_says_what_the_filesystem_is_made_with() -> None:
    """The description is the module's own: every line of it, not cut at its colon."""
    shown = run_command("provision-slot", "--help")
    assert shown.returncode == 0
    for made_with in ("`-m 0`", "`-N storage_inodes`", "`nodev,nosuid`", "`nofail`"):
        assert made_with in shown.stdout
    assert "tests and tools" not in shown.stdout  # the part for developers stays out


@pytest.mark.parametrize("argv", [[], *([name] for name in SUBCOMMANDS)])
def test_version_everywhere(argv: list[str]) -> None:
    expected = (
        f"ficc-executor {metadata.version('ficc-executor-host')} "
        f"(ficc-protocol {metadata.version('ficc-protocol')}, Python {platform.python_version()})"
    )
    shown = run_command(*argv, "--version")
    assert (shown.returncode, shown.stdout.strip()) == (0, expected), shown.stderr


def test_serve_log_level_hides_lines_below_it(
    socket_dir: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def refuse(config: Config, path: list[str] | None) -> Any:
        raise HostError("ledger_unsafe", "the ledger file is a symbolic link; remove it")

    monkeypatch.setattr(serve, "checked_config", lambda path: config_for(socket_dir))
    monkeypatch.setattr(serve, "_open_daemon", refuse)
    try:
        argv = ["serve", "--config", "/etc/ficc/x.json", "--log-level", "error"]
        assert commands.main(argv) == 1
    finally:
        logs.set_level("info")
    events = [json.loads(line)["event"] for line in capsys.readouterr().err.splitlines()]
    assert events == ["refused"]  # no `starting` (info)


def test_status_explains_a_daemon_that_is_not_running(socket_dir: Path) -> None:
    shown = run_command("status", "--socket", str(socket_dir / "admin.sock"))
    assert shown.returncode == 3
    assert "ConnectFailed" in shown.stderr
    assert f"hint: no daemon is listening on {socket_dir / 'admin.sock'}" in shown.stderr
    # the advice fits the host: systemctl only where systemd is the init
    if os.path.isdir("/run/systemd/system"):
        assert "systemctl status ficc-executor-host" in shown.stderr
    else:
        assert "systemctl" not in shown.stderr
        assert "ficc-executor serve --config PATH" in shown.stderr
    metrics = run_command("metrics", "--socket", str(socket_dir / "admin.sock"))
    assert metrics.returncode == 3
    assert "hint: no daemon is listening" in metrics.stderr


def test_status_json_reports_an_absent_daemon_as_json(socket_dir: Path) -> None:
    shown = run_command("status", "--socket", str(socket_dir / "admin.sock"), "--json")
    assert shown.returncode == 3
    error = json.loads(shown.stdout)["error"]
    assert error["code"] == "transport"
    assert "hint: no daemon is listening" in error["message"]
    assert "hint: no daemon is listening" in shown.stderr


NOBODY = 65534


def _as_nobody(*argv: str) -> tuple[int, str]:
    """`ficc-executor ARGV` run by a real unprivileged account in a forked child: its
    exit status and stderr."""
    read_end, write_end = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover - the child reports through its exit status
        code = 99
        try:
            os.close(read_end)
            sys.stderr = os.fdopen(write_end, "w")  # not pytest's capture of the parent
            os.setgroups([])
            os.setresgid(NOBODY, NOBODY, NOBODY)
            os.setresuid(NOBODY, NOBODY, NOBODY)
            code = commands.main(list(argv))
            sys.stderr.flush()
        finally:
            os._exit(code)
    os.close(write_end)
    with os.fdopen(read_end) as shown:
        stderr = shown.read()
    _, status = os.waitpid(child, 0)
    return os.waitstatus_to_exitcode(status), stderr


@pytest.mark.root("needs root: a real unprivileged user is refused by the socket's mode")
def test_status_tells_a_user_who_may_not_use_the_socket_so(socket_dir: Path) -> None:
    """A root-only socket that is listening: the kernel refuses a non-root connect
    (EACCES); the hint says whose socket it is, not that no daemon is running."""
    admin = socket_dir / "admin.sock"
    listening = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listening.bind(str(admin))
    os.chmod(admin, 0o600)
    listening.listen()
    try:
        code, stderr = _as_nobody("status", "--socket", str(admin))
    finally:
        listening.close()
    assert code == 3, stderr
    assert "Permission denied" in stderr
    assert f"hint: {admin} is not yours to use: admin.sock is root's" in stderr
    assert "no daemon is listening" not in stderr


@pytest.mark.root("needs root: the configuration is root's, read by a real other user")
def test_a_configuration_only_root_may_read_says_to_run_as_root(socket_dir: Path) -> None:
    config = socket_dir / "host.json"
    config.write_text("{}")
    os.chmod(config, 0o600)
    os.chmod(socket_dir, 0o755)  # like /etc/ficc: the file, not the directory, is private
    code, stderr = _as_nobody("status", "--config", str(config))
    assert code == 1, stderr
    assert stderr.startswith(f"config_unreadable: {config}: Permission denied; run the command")
    assert "as root" in stderr
    os.chmod(socket_dir, 0o700)  # a directory the user cannot even open: the same advice
    code, stderr = _as_nobody("status", "--config", str(config))
    assert code == 1, stderr
    assert f"cannot open {socket_dir}: Permission denied; run the command as root" in stderr


def test_status_json_carries_every_page(
    socket_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    fake = FakeDaemon()
    config = config_for(socket_dir)
    admin = str(socket_dir / "admin.sock")

    async def main() -> int:
        stop = asyncio.Event()
        served = asyncio.ensure_future(serve._serve_until(fake, config, ServerLimits(), stop))
        await _until_listening(admin)
        try:
            return await asyncio.to_thread(commands.main, ["status", "--socket", admin, "--json"])
        finally:
            stop.set()
            await served

    assert asyncio.run(main()) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["daemon_version"] is None  # the fake's snapshot carries no `daemon`
    ids = [a["attempt_id"] for page in shown["pages"] for a in page["attempts"]]
    assert ids == [f"{1:032x}", f"{2:032x}"]
    assert shown["pages"][0]["capacity"]["providers"][1] == {
        "id": "podman", "package_digest": "sha256:" + "b" * 64, "available": False,
    }  # fmt: skip


async def _until_listening(path: str) -> None:
    async with asyncio.timeout(30):
        while not os.path.exists(path) or _refused(path):
            await asyncio.sleep(0.01)


def test_an_unexpected_failure_of_serve_is_a_json_line_too(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def broken(path: str) -> Config:
        raise RuntimeError("a bug")

    monkeypatch.setattr(serve, "checked_config", broken)
    assert commands.main(["serve", "--config", "/etc/ficc/x.json"]) == 1
    starting, line = [json.loads(line) for line in capsys.readouterr().err.splitlines()]
    assert starting["event"] == "starting"
    assert (line["level"], line["event"], line["error"]) == (
        "error",
        "failed",
        "RuntimeError('a bug')",
    )
    assert "RuntimeError: a bug" in line["traceback"]


def test_the_status_table_has_every_column_when_only_status_is_imported() -> None:
    """The header list is whole where it is defined, not completed by another module."""
    probe = "from ficc.execution.host.cli import status; print('|'.join(status.ATTEMPT_HEADERS))"
    headers = (
        subprocess.run(
            [sys.executable, "-I", "-c", probe], check=True, capture_output=True, text=True
        )
        .stdout.strip()
        .split("|")
    )
    assert headers == [
        "ATTEMPT", "CHANGED (UTC)", "GEN", "STATE", "READY", "OUTCOME", "REASON", "EXIT",
        "LEASE", "SLOT", "CPU", "PEAK MEM", "OOM",
    ]  # fmt: skip
