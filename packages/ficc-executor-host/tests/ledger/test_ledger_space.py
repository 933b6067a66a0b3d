"""The ledger cannot fill the host: the bound arithmetic, the ledger's own bound, SQLite's
hard limit, and the reserve that keeps writes going on a filesystem filled from outside.

Real SQLite in a real state directory; the full-disk test mounts a real small tmpfs
(root only) and fills it with a file until the kernel says ENOSPC.
"""

from __future__ import annotations

import contextlib
import errno
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ficc.execution import plan as planlib
from ficc.execution.host.core import lifecycle as lc
from ficc.execution.host.core.errors import HostError
from ficc.execution.host.ledger import space
from ficc.execution.host.ledger.space import Space, SpaceBounds
from ficc.execution.host.ledger.store import Admitted, Applied, Ledger, PrepareRow
from ledger_support import (
    CEILING,
    INSTALLATION,
    NOW,
    Renew,
    admitted,
    create_ledger,
    facts,
    fence,
    lease,
    limits,
    make_plan,
    open_ledger,
    raw,
    to_ready,
)

MIB = space.MIB

FULL_DISK = pytest.mark.root("a full disk is a small tmpfs, and only root mounts one")


# --- the arithmetic (pure) ------------------------------------------------------------


def test_admission_stops_an_eighth_below_the_ledger_bound() -> None:
    bounds = SpaceBounds(ledger_max_bytes=8 * MIB, min_free_bytes=0)
    assert bounds.headroom == MIB
    assert bounds.admission_bytes == 7 * MIB
    assert space.admission_refusal(Space(7 * MIB - 100, 10**12), 100, bounds) is None
    why = space.admission_refusal(Space(7 * MIB - 100, 10**12), 101, bounds)
    assert why is not None
    assert "ledger_max_bytes" in why


def test_admission_keeps_the_free_space_floor() -> None:
    bounds = SpaceBounds(ledger_max_bytes=1 << 30, min_free_bytes=64 * MIB)
    assert space.admission_refusal(Space(0, 64 * MIB + 10), 10, bounds) is None
    why = space.admission_refusal(Space(0, 64 * MIB + 10), 11, bounds)
    assert why is not None
    assert "state_dir_min_free_bytes" in why
    assert space.admission_refusal(Space(0, 0), 0, bounds) is not None


@given(
    used=st.integers(0, 1 << 32),
    free=st.integers(0, 1 << 32),
    wanted=st.integers(0, 1 << 24),
    maximum=st.integers(space.MIN_LEDGER_MAX_BYTES, 1 << 32),
    floor=st.integers(0, 1 << 32),
)
def test_refusal_is_exactly_the_two_bounds(
    used: int, free: int, wanted: int, maximum: int, floor: int
) -> None:
    bounds = SpaceBounds(maximum, floor)
    refused = space.admission_refusal(Space(used, free), wanted, bounds) is not None
    assert refused == (used + wanted > maximum - maximum // 8 or free - wanted < floor)


def test_a_short_reserve_left_by_a_crash_is_made_again(state_dir: Path) -> None:
    (state_dir / space.RESERVE_FILE).write_bytes(b"")
    fd = os.open(state_dir, os.O_RDONLY | os.O_DIRECTORY)
    try:
        assert not space.has_reserve(fd)
        assert space.make_reserve(fd, SpaceBounds(MIB, 0))
        assert space.has_reserve(fd)
    finally:
        os.close(fd)
    assert (state_dir / space.RESERVE_FILE).stat().st_blocks * 512 >= space.RESERVE_BYTES


def test_the_hard_limit_in_pages() -> None:
    assert SpaceBounds(MIB, 0).max_page_count(4096) == 256
    assert SpaceBounds(MIB + 4095, 0).max_page_count(4096) == 256


def test_request_bytes_errs_high(tmp_path: Path) -> None:
    """The estimate is at least what recording a full batch really adds to the database."""
    state_dir = tmp_path / "state"
    state_dir.mkdir(mode=0o700)
    led = create_ledger(str(state_dir), INSTALLATION, limits(), CEILING)
    try:
        plans = [make_plan(name="j" * 80) for _ in range(planlib.MAX_ROWS)]
        before = _ledger_bytes(led)
        led.reject_absent(led.bindings(), plans)
        grown = _ledger_bytes(led) - before
        estimate = space.request_bytes(len(planlib.encode_plan(p)) for p in plans)
        assert 0 < grown <= estimate // 2, (grown, estimate)
    finally:
        led.close()


def _ledger_bytes(led: Ledger) -> int:
    db = raw(led)
    try:
        return int(db.execute("PRAGMA page_count").fetchone()[0]) * 4096
    finally:
        db.close()


# --- the ledger's own bound -----------------------------------------------------------


@pytest.fixture
def state_dir(tmp_path: Path) -> Path:
    path = tmp_path / "state"
    path.mkdir(mode=0o700)
    return path


def _fill_to_refusal(led: Ledger) -> int:
    """reject_absent until not even one plan is admitted (full batches first, then one
    plan at a time); how many records went in."""
    recorded, size = 0, planlib.MAX_ROWS
    for _ in range(1000):
        plans = [make_plan() for _ in range(size)]
        try:
            led.reject_absent(led.bindings(), plans)
        except HostError as error:
            refusal = error
        else:
            recorded += size
            continue
        assert refusal.code == "ledger_full"
        assert refusal.message.startswith("admission refused: the ledger holds"), refusal
        if size == 1:
            return recorded
        size = 1
    raise AssertionError("admission was never refused")


def test_the_ledger_bound_refuses_admission_and_keeps_everything_else(state_dir: Path) -> None:
    led = create_ledger(str(state_dir), INSTALLATION, limits(), CEILING)
    try:
        led.bound_space(SpaceBounds(ledger_max_bytes=2 * MIB, min_free_bytes=0))
        running, stopped, repeated = make_plan(), make_plan(), make_plan()
        for plan in (running, stopped, repeated):
            admitted(led, plan)
            to_ready(led, plan)
        assert _fill_to_refusal(led) > 0
        records = _count(led)
        with pytest.raises(HostError) as refused:
            led.admit_batch(led.bindings(), [_row(make_plan())], facts())
        assert refused.value.code == "ledger_full"
        assert _count(led) == records  # nothing written, not even a rejection record
        # a repeated prepare still answers with the existing record
        (again,) = led.admit_batch(led.bindings(), [_row(repeated)], facts())
        assert isinstance(again, Admitted)
        assert not again.new
        # start, renew, stop, finish, clean up and release of admitted attempts go on
        for plan in (running, stopped):
            (start,) = led.start_batch([fence(plan)], NOW)
            assert isinstance(start, Applied)
            assert start.changed
            led.apply(fence(plan), lc.Started())
        (renewed,) = led.renew_batch([(fence(running), Renew(2, 6000))], NOW, 10**6)
        assert isinstance(renewed, Applied)
        assert renewed.changed
        led.apply(fence(stopped), lc.StopRequested())
        for event in (lc.Finished(exit_code=0), lc.CleanupConfirmed(), lc.Release()):
            led.apply(fence(stopped), event)
        record = led.get(stopped.attempt_id)
        assert record is not None
        assert record.status.state == "released"
        assert _count(led) == records
    finally:
        led.close()
    reopened = open_ledger(str(state_dir), INSTALLATION)
    try:
        assert _quick_check(reopened) == "ok"
        assert _count(reopened) == records
    finally:
        reopened.close()


def test_the_hard_limit_fails_a_write_whole_and_the_ledger_goes_on(
    state_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A write past max_page_count is rolled back (SQLITE_FULL), answered `ledger_full`,
    and leaves no transaction open: the next write goes through."""
    led = create_ledger(str(state_dir), INSTALLATION, limits(), CEILING)
    try:
        led.bound_space(SpaceBounds(ledger_max_bytes=MIB, min_free_bytes=0))
        plan = make_plan()
        admitted(led, plan)
        led.apply(fence(plan), lc.PrepareBegun())
        before = led.get(plan.attempt_id)
        with pytest.raises(HostError) as full:
            led.apply(fence(plan), lc.PrepareOk(result=b"x" * (2 * MIB)))
        assert full.value.code == "ledger_full"
        assert led.get(plan.attempt_id) == before
        assert led.prepare_result(plan.attempt_id) is None
        led.apply(fence(plan), lc.PrepareOk(result=b'{"argv":["/bin/true"]}'))
        record = led.get(plan.attempt_id)
        assert record is not None
        assert record.status.ready
        # the disk has room: the reserve was not spent on a write the cap refused
        assert (state_dir / space.RESERVE_FILE).exists()
        assert "deleted" not in caplog.text
    finally:
        led.close()


# --- a filesystem filled from outside -------------------------------------------------


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    """A 24 MiB tmpfs, private to root, unmounted however the test ends."""
    path = tmp_path / "small"
    path.mkdir()
    subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=24m,mode=0700,nodev,nosuid", "tmpfs", str(path)],
        check=True,
    )
    try:
        yield path
    finally:
        subprocess.run(["umount", str(path)], check=True)


def _fill(path: Path) -> None:
    """Write a file until the filesystem refuses (ENOSPC): full to the last block."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        block = b"\0" * 65536
        with contextlib.suppress(OSError):
            while True:
                os.write(fd, block)
        for size in (4096, 1):  # the last partial blocks
            with pytest.raises(OSError) as full:  # noqa: PT012 - until the disk is full
                while True:
                    os.write(fd, block[:size])
            assert full.value.errno == errno.ENOSPC
    finally:
        os.close(fd)


@FULL_DISK
def test_a_disk_filled_from_outside_spends_the_reserve(small_fs: Path) -> None:
    led = create_ledger(str(small_fs), INSTALLATION, limits(), CEILING)
    try:
        bounds = SpaceBounds(ledger_max_bytes=64 * MIB, min_free_bytes=2 * MIB,
                             reserve_bytes=4 * MIB)  # fmt: skip
        led.bound_space(bounds)
        reserve = small_fs / space.RESERVE_FILE
        assert reserve.stat().st_blocks * 512 >= 4 * MIB  # allocated, not sparse
        plans = [make_plan() for _ in range(3)]
        for plan in plans:
            admitted(led, plan)
        led.apply(fence(plans[1]), lc.PrepareBegun())
        _fill(small_fs / "filler")
        # admission is refused, by the floor, and writes nothing
        with pytest.raises(HostError) as refused:
            led.admit_batch(led.bindings(), [_row(make_plan())], facts())
        assert refused.value.code == "ledger_full"
        assert "state_dir_min_free_bytes" in refused.value.message
        # a change of an admitted attempt goes through by spending the reserve (a
        # large result, so the write-ahead log must grow into new blocks)
        led.apply(fence(plans[0]), lc.PrepareBegun())
        led.apply(fence(plans[0]), lc.PrepareOk(result=b"r" * (512 * 1024)))
        assert not reserve.exists()
        # what the reserve freed is not for admission
        free = os.statvfs(small_fs)
        assert free.f_bavail * free.f_frsize > bounds.min_free_bytes
        with pytest.raises(HostError) as refused:
            led.admit_batch(led.bindings(), [_row(make_plan())], facts())
        assert refused.value.code == "ledger_full"
        assert space.RESERVE_FILE in refused.value.message
        # with no reserve left, a write that cannot fit fails whole and changes nothing
        _fill(small_fs / "filler2")
        before = led.get(plans[1].attempt_id)
        with pytest.raises(HostError) as full:
            led.apply(fence(plans[1]), lc.PrepareOk(result=b"r" * MIB))
        assert full.value.code == "ledger_full"
        assert led.get(plans[1].attempt_id) == before
        assert led.prepare_result(plans[1].attempt_id) is None
        # space comes back: writes go on, the reserve is made again, admission reopens
        (small_fs / "filler").unlink()
        (small_fs / "filler2").unlink()
        led.apply(fence(plans[1]), lc.PrepareOk(result=b'{"argv":["/bin/true"]}'))
        assert reserve.exists()
        admitted(led, make_plan())
    finally:
        led.close()
    reopened = open_ledger(str(small_fs), INSTALLATION)
    try:
        assert _quick_check(reopened) == "ok"
        record = reopened.get(plans[1].attempt_id)
        assert record is not None
        assert record.status.ready
    finally:
        reopened.close()


@FULL_DISK
def test_opening_on_a_full_disk_spends_the_reserve_and_keeps_admission_closed(
    small_fs: Path,
) -> None:
    """A clean close deletes the write-ahead log and shared-memory index; opening makes
    them again, which on a full disk needs the reserve's space."""
    bounds = SpaceBounds(ledger_max_bytes=64 * MIB, min_free_bytes=2 * MIB,
                         reserve_bytes=4 * MIB)  # fmt: skip
    reserve = small_fs / space.RESERVE_FILE
    led = create_ledger(str(small_fs), INSTALLATION, limits(), CEILING)
    try:
        led.bound_space(bounds)
        plan = make_plan()
        admitted(led, plan)
    finally:
        led.close()
    assert sorted(p.name for p in small_fs.iterdir()) == [space.RESERVE_FILE, "ledger.sqlite3"]
    _fill(small_fs / "filler")
    # a check that must change nothing refuses, and leaves the reserve alone
    with pytest.raises(HostError) as refused:
        open_ledger(str(small_fs), INSTALLATION, spend_reserve=False)
    assert refused.value.code == "ledger_full"
    assert f"mounted at {small_fs}" in refused.value.message
    assert reserve.exists()
    led = open_ledger(str(small_fs), INSTALLATION)
    try:
        assert not reserve.exists()
        led.bound_space(bounds)
        with pytest.raises(HostError) as refused:
            led.admit_batch(led.bindings(), [_row(make_plan())], facts())
        assert refused.value.code == "ledger_full"
        assert space.RESERVE_FILE in refused.value.message
        led.apply(fence(plan), lc.PrepareBegun())  # admitted work goes on
        (small_fs / "filler").unlink()
        admitted(led, make_plan())
        assert reserve.exists()
    finally:
        led.close()


@FULL_DISK
def test_a_reserve_too_small_to_open_the_ledger_is_ledger_full(small_fs: Path) -> None:
    create_ledger(str(small_fs), INSTALLATION, limits(), CEILING).close()
    _fill(small_fs / "filler")
    (small_fs / space.RESERVE_FILE).touch()  # frees nothing when deleted
    with pytest.raises(HostError) as refused:
        open_ledger(str(small_fs), INSTALLATION)
    assert refused.value.code == "ledger_full"
    assert f"even after deleting {space.RESERVE_FILE}" in refused.value.message
    (small_fs / "filler").unlink()
    open_ledger(str(small_fs), INSTALLATION).close()


@FULL_DISK
def test_creating_on_a_full_disk_leaves_no_ledger(small_fs: Path) -> None:
    _fill(small_fs / "filler")
    with pytest.raises(HostError) as refused:
        create_ledger(str(small_fs), INSTALLATION, limits(), CEILING)
    assert refused.value.code == "ledger_full"
    assert "cannot be created" in refused.value.message
    assert [p.name for p in small_fs.iterdir()] == ["filler"]
    (small_fs / "filler").unlink()
    led = create_ledger(str(small_fs), INSTALLATION, limits(), CEILING)
    led.close()


@FULL_DISK
def test_creating_with_no_inode_left_is_ledger_full(tmp_path: Path) -> None:
    """Out of inodes, not bytes: the ledger file itself cannot be made."""
    path = tmp_path / "few-inodes"
    path.mkdir()
    subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=4m,nr_inodes=8,mode=0700,nodev,nosuid",
         "tmpfs", str(path)],
        check=True,
    )  # fmt: skip
    try:
        with pytest.raises(OSError) as full:  # noqa: PT012 - until no inode is left
            for n in range(64):
                (path / f"f{n}").touch()
        assert full.value.errno == errno.ENOSPC
        with pytest.raises(HostError) as refused:
            create_ledger(str(path), INSTALLATION, limits(), CEILING)
        assert refused.value.code == "ledger_full"
        (path / "f0").unlink()
        (path / "f1").unlink()
        (path / "f2").unlink()
        create_ledger(str(path), INSTALLATION, limits(), CEILING).close()
    finally:
        subprocess.run(["umount", str(path)], check=True)


# --- helpers ----------------------------------------------------------------------------


def _quick_check(led: Ledger) -> str:
    db = raw(led)
    try:
        return str(db.execute("PRAGMA quick_check").fetchone()[0])
    finally:
        db.close()


def _count(led: Ledger) -> int:
    db = raw(led)
    try:
        return int(db.execute("SELECT count(*) FROM attempts").fetchone()[0])
    finally:
        db.close()


def _row(plan: planlib.Plan) -> PrepareRow:
    return PrepareRow(plan, lease())
