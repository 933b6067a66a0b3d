"""The ledger cannot fill the host: a state_dir filled from outside, through the real daemon.

`state_dir` is the root of a small ext4 filesystem in a loop-mounted image file (made
without root-reserved blocks, so a root writer can fill it to the last block), mounted
`nodev,nosuid` and always unmounted, also when the test fails. While the daemon runs,
another process fills that filesystem until the kernel answers ENOSPC. Then admission
(`prepare`, `reject_absent`) is refused with `ledger_full` and writes no record, while
snapshot, observe, renew, start, stop and release of attempts admitted before go on
(the ledger spends its reserve file). After a restart the ledger passes its integrity
check and holds exactly the records it held; once space is freed, admission reopens
and the reserve is made again.

The filesystem may also fill while the daemon is stopped. A clean stop deletes SQLite's
write-ahead log and shared-memory index, and opening the ledger makes them again, so a
restart spends the reserve for that, starts with admission closed and reopens it once
space is freed; `check-config` never spends the reserve. Without a reserve, `serve` and
`check-config` refuse with `ledger_full`. A first start on a full filesystem refuses
with `ledger_full` and leaves no ledger behind, so the start after space was freed
creates one.

Another test fills the ledger itself up to `ledger_max_bytes`, without a full disk.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import sqlite3
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from ficc.execution.plan import Plan, plan_digest
from ficc.execution.protocol import CollectRequest, Read
from ficc.execution.wire import TERMINAL, AttemptRow, ReadRow, ReadsReply
from ficc_testkit.accounts import Accounts
from ficc_testkit.daemons import DaemonFailed, DaemonProcess
from ficc_testkit.driver import attempt, error_code, row_code, rows
from ficc_testkit.host import Daemon, Layout
from ficc_testkit.plans import new_id
from ficc_testkit.slots import private_directory
from ficc_testkit.units import MIB
from ficc_testkit.waits import now_ms
from ficc_testkit.wheels import InstalledProvider

IMAGE_BYTES = 64 * MIB
MIN_FREE = 4 * MIB
LEDGER_FILE = "ledger.sqlite3"
RESERVE_FILE = "ledger.reserve"


@contextlib.contextmanager
def small_ext4(base: Path) -> Iterator[Path]:
    """A fresh 64 MiB ext4 filesystem mounted at base/ledgerfs, root-owned 0700."""
    image, mount = base / "ledgerfs.img", base / "ledgerfs"
    mount.mkdir()
    subprocess.run(["truncate", "-s", str(IMAGE_BYTES), str(image)], check=True)
    subprocess.run(["mkfs.ext4", "-q", "-F", "-m", "0", str(image)], check=True)
    subprocess.run(["mount", "-o", "loop,nodev,nosuid", str(image), str(mount)], check=True)
    try:
        os.chmod(mount, 0o700)
        yield mount
    finally:
        unmounted = subprocess.run(["umount", str(mount)], check=False, capture_output=True)
        if unmounted.returncode != 0:  # still busy (a failed test's daemon): detach lazily
            subprocess.run(["umount", "-l", str(mount)], check=True)


@pytest.fixture
def layout(
    request: pytest.FixtureRequest,
    session_dir: Path,
    accounts: Accounts,
    provider: InstalledProvider,
) -> Iterator[Layout]:
    """The usual layout, with state_dir on its own small filesystem."""
    base = private_directory(str(session_dir), "lf-")
    try:
        with small_ext4(base) as state_dir:
            overrides = {"state_dir": str(state_dir), "state_dir_min_free_bytes": MIN_FREE}
            overrides |= getattr(request, "param", {})
            made = Layout.create(base, accounts, provider, **overrides)
            try:
                yield made
            finally:
                made.destroy()
    finally:
        subprocess.run(["rm", "-rf", "--one-file-system", str(base)], check=False)


def state_dir(daemon: Daemon) -> Path:
    return Path(daemon.layout.document["state_dir"])


def fill(path: Path) -> int:
    """Write `path` until the filesystem refuses (ENOSPC): full to the last block."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    written = 0
    try:
        for size in (1 << 20, 4096, 1):
            block = b"\xa5" * size
            with pytest.raises(OSError) as full:  # noqa: PT012 - write until refused
                while True:
                    written += os.write(fd, block)
            assert full.value.errno == errno.ENOSPC, full.value
        os.fsync(fd)
    finally:
        os.close(fd)
    assert os.statvfs(path.parent).f_bavail == 0
    return written


def settled(daemon: Daemon, plan: object, state: str) -> AttemptRow:
    return daemon.wait_state(
        plan,  # type: ignore[arg-type]
        lambda r: r.state in TERMINAL and r.cleanup_confirmed,
        f"{state} with cleanup confirmed",
    )


def collect_stdout(daemon: Daemon, plan: Plan) -> ReadRow:
    read = Read(
        attempt_id=plan.attempt_id,
        generation=plan.generation,
        plan_digest=plan_digest(plan),
        object="stdout",
        offset=0,
        length=4096,
    )
    reply = daemon.as_transport(CollectRequest(version=1, id=new_id(), reads=[read]))
    assert isinstance(reply, ReadsReply), reply
    (row,) = reply.results
    assert isinstance(row, ReadRow), row
    return row


def quick_check(path: Path) -> str:
    db = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        return str(db.execute("PRAGMA quick_check").fetchone()[0])
    finally:
        db.close()


def test_a_full_state_dir_refuses_admission_and_the_rest_goes_on(daemon: Daemon) -> None:
    ledger_dir = state_dir(daemon)
    assert (ledger_dir / RESERVE_FILE).stat().st_blocks * 512 >= 8 * MIB  # allocated
    started, stopped = daemon.plan(), daemon.plan()  # one per slot
    rows(daemon.prepare([started, stopped]))
    for plan in (started, stopped):
        ready = daemon.wait_state(plan, lambda r: r.ready or r.state != "prepared", "ready")
        assert (ready.state, ready.ready) == ("prepared", True), ready
    before = {a.attempt_id for a in daemon.snapshot().attempts}

    fill(ledger_dir / "filler")

    # admission is refused whole, with its code, and records nothing
    refused = daemon.plan()
    reply = daemon.prepare([refused])
    assert error_code(reply) == "ledger_full", reply
    message = reply.error.message  # type: ignore[union-attr]
    assert message.startswith("admission refused"), message
    assert "state_dir_min_free_bytes" in message
    assert error_code(daemon.reject_absent([daemon.plan()])) == "ledger_full"
    assert row_code(daemon.observe(refused)) == "unknown_attempt"
    assert {a.attempt_id for a in daemon.snapshot().attempts} == before
    # a repeated prepare of an admitted plan still answers with its record
    (again,) = rows(daemon.prepare([stopped]))
    assert attempt(again).attempt_id == stopped.attempt_id

    # everything else about admitted attempts goes on: renew, start (refused by the
    # gate, recorded by the monitor), stop, cleanup, release
    renewed = attempt(daemon.renew(started, 2, now_ms() + 600_000))
    assert renewed.lease_sequence == 2
    attempt(daemon.start_attempt(started))
    ended = settled(daemon, started, "failed")
    assert ended.state == "failed", ended
    assert collect_stdout(daemon, started).data == b""  # never ran: nothing written
    attempt(daemon.stop_attempt(stopped))
    assert settled(daemon, stopped, "cancelled").state == "cancelled"
    for plan, outcome in ((started, "failed"), (stopped, "cancelled")):
        released = attempt(daemon.release(plan))
        assert (released.state, released.outcome) == ("released", outcome)
    assert not (ledger_dir / RESERVE_FILE).exists()  # spent to let those writes through
    assert error_code(daemon.prepare([refused])) == "ledger_full"
    settled_rows = daemon.snapshot().attempts

    # a restart on the still full filesystem: the ledger opens cleanly, records unchanged
    assert daemon.stop() == 0
    assert quick_check(ledger_dir / LEDGER_FILE) == "ok"
    daemon.process = DaemonProcess.of(daemon.layout, daemon.provider)
    daemon.start()
    assert daemon.snapshot().attempts == settled_rows
    assert error_code(daemon.prepare([refused])) == "ledger_full"

    # space freed: admission reopens and the reserve is made again
    (ledger_dir / "filler").unlink()
    (row,) = rows(daemon.prepare([refused]))
    assert attempt(row).state == "prepared"
    assert (ledger_dir / RESERVE_FILE).exists()


@pytest.mark.parametrize("layout", [{"ledger_max_bytes": 2 * MIB}], indirect=True)
def test_the_ledger_stops_admission_at_its_own_bound(daemon: Daemon) -> None:
    """No full disk: the ledger reaches `ledger_max_bytes` (less an eighth) by itself."""
    admitted = daemon.plan()
    rows(daemon.prepare([admitted]))
    daemon.wait_state(admitted, lambda r: r.ready or r.state != "prepared", "ready")
    recorded, size = 0, 64
    for _ in range(200):
        reply = daemon.reject_absent([daemon.plan() for _ in range(size)])
        if error_code(reply) is None:
            recorded += size
            continue
        assert error_code(reply) == "ledger_full", reply
        message = reply.error.message  # type: ignore[union-attr]
        assert message.startswith("admission refused: the ledger holds"), message
        if size == 1:
            break
        size = 1  # full batches no longer fit: go on one plan at a time
    else:
        raise AssertionError("admission was never refused")
    assert recorded > 0
    assert error_code(daemon.prepare([daemon.plan()])) == "ledger_full"
    # the attempt admitted before goes on to its release
    assert attempt(daemon.renew(admitted, 2, now_ms() + 600_000)).lease_sequence == 2
    attempt(daemon.stop_attempt(admitted))
    assert settled(daemon, admitted, "cancelled").state == "cancelled"
    assert attempt(daemon.release(admitted)).state == "released"


def check_config(daemon: Daemon, *options: str) -> subprocess.CompletedProcess[str]:
    """`check-config` as the shipped unit runs it before `serve` (the timeout is a hang
    guard, not an assertion)."""
    command = [sys.executable, "-m", "ficc.execution", "check-config", *options]
    command += ["--config", str(daemon.layout.config_path)]
    command += ["--provider-path", str(daemon.provider.site)]
    return subprocess.run(command, capture_output=True, text=True, check=False, timeout=120)


def refusals(process: DaemonProcess) -> list[tuple[str, str]]:
    """The (code, message) of each `refused` event `serve` logged."""
    return [(e["code"], e["message"]) for e in process.events() if e.get("event") == "refused"]


def stopped_cleanly(daemon: Daemon) -> Path:
    """Stop the daemon (exit 0); its state_dir, which SQLite left without its
    write-ahead log and shared-memory index, so opening the ledger must make them."""
    ledger_dir = state_dir(daemon)
    assert daemon.stop() == 0
    assert not (ledger_dir / f"{LEDGER_FILE}-wal").exists()
    assert not (ledger_dir / f"{LEDGER_FILE}-shm").exists()
    return ledger_dir


def test_a_restart_on_a_state_dir_filled_while_stopped_spends_the_reserve(daemon: Daemon) -> None:
    admitted = daemon.plan()
    rows(daemon.prepare([admitted]))
    daemon.wait_state(admitted, lambda r: r.ready or r.state != "prepared", "ready")
    ledger_dir = stopped_cleanly(daemon)
    fill(ledger_dir / "filler")

    # the unit's check before serve: no refusal, and the reserve is left for serve
    checked = check_config(daemon, "--json")
    assert checked.returncode == 0, checked.stderr
    document = json.loads(checked.stdout)
    assert document["result"] == "ok", document
    assert document["ledger"].startswith("not checked: "), document
    assert (ledger_dir / RESERVE_FILE).exists()

    daemon.process = DaemonProcess.of(daemon.layout, daemon.provider)
    daemon.start()
    assert not (ledger_dir / RESERVE_FILE).exists()  # spent to open the ledger
    assert (ledger_dir / f"{LEDGER_FILE}-wal").exists()
    assert {a.attempt_id for a in daemon.snapshot().attempts} == {admitted.attempt_id}
    refused = daemon.plan()
    reply = daemon.prepare([refused])
    assert error_code(reply) == "ledger_full", reply
    assert RESERVE_FILE in reply.error.message  # type: ignore[union-attr]
    assert row_code(daemon.observe(refused)) == "unknown_attempt"
    assert attempt(daemon.renew(admitted, 2, now_ms() + 600_000)).lease_sequence == 2

    # space freed: admission reopens and the reserve is made again
    (ledger_dir / "filler").unlink()
    (row,) = rows(daemon.prepare([refused]))
    assert attempt(row).state == "prepared"
    assert (ledger_dir / RESERVE_FILE).exists()


def test_a_full_state_dir_without_a_reserve_refuses_to_start(daemon: Daemon) -> None:
    ledger_dir = stopped_cleanly(daemon)
    (ledger_dir / RESERVE_FILE).unlink()
    fill(ledger_dir / "filler")

    checked = check_config(daemon)
    assert checked.returncode == 1, checked
    assert checked.stderr.startswith("ledger_full: "), checked.stderr
    assert "Traceback" not in checked.stderr
    assert f"mounted at {ledger_dir}" in checked.stderr
    document = json.loads(check_config(daemon, "--json").stdout)
    assert (document["result"], document["error"]["code"]) == ("refused", "ledger_full")

    daemon.process = DaemonProcess.of(daemon.layout, daemon.provider)
    with pytest.raises(DaemonFailed):
        daemon.start()
    ((code, message),) = refusals(daemon.process)
    assert code == "ledger_full"
    assert "free space on that filesystem" in message

    (ledger_dir / "filler").unlink()
    daemon.process = DaemonProcess.of(daemon.layout, daemon.provider)
    daemon.start()
    (row,) = rows(daemon.prepare([daemon.plan()]))
    assert attempt(row).state == "prepared"


def test_a_first_start_on_a_full_state_dir_leaves_no_ledger(
    layout: Layout, provider: InstalledProvider, accounts: Accounts
) -> None:
    ledger_dir = Path(layout.document["state_dir"])
    before = sorted(p.name for p in ledger_dir.iterdir())
    fill(ledger_dir / "filler")
    daemon = Daemon(layout, provider, accounts)
    try:
        with pytest.raises(DaemonFailed):
            daemon.start()
        ((code, message),) = refusals(daemon.process)
        assert code == "ledger_full", message
        assert "cannot be created" in message
        assert sorted(p.name for p in ledger_dir.iterdir()) == sorted([*before, "filler"])

        # space freed: the next start creates the ledger as on any first start
        (ledger_dir / "filler").unlink()
        daemon.process = DaemonProcess.of(layout, provider)
        daemon.start()
        (row,) = rows(daemon.prepare([daemon.plan()]))
        assert attempt(row).state == "prepared"
        assert (ledger_dir / RESERVE_FILE).exists()
    finally:
        status = daemon.stop()
    assert status == 0, daemon.process.log()
