"""The SQLite ledger: file safety, identity, admission, lifecycle, leases, inputs, offer.

Real files in a real root-owned state directory; real SQLite; a real SIGKILL loop for
crash safety (size from FICC_SOAK).
"""

from __future__ import annotations

import contextlib
import os
import random
import select
import shutil
import signal
import sqlite3
import stat
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ficc.execution import plan as planlib
from ficc.execution.host.core import lifecycle as lc
from ficc.execution.host.core.errors import HostError
from ficc.execution.host.ledger import schema as ledger_schema
from ficc.execution.host.ledger.store import (
    LEDGER_FILE,
    Admitted,
    Applied,
    HostFacts,
    Lease,
    Ledger,
    Now,
    PrepareRow,
    RecordedUsage,
    ResourceUsage,
    SlotSpec,
)
from ficc.execution.host.linux import filesystems
from ficc.execution.protocol import Fence, OfferLimits
from ficc_testkit.plans import new_id
from ledger_support import (
    BIG,
    BOOT,
    CEILING,
    DEADLINE,
    INSTALLATION,
    MAX_LEASE,
    NOW,
    OTHER_BOOT,
    OWNER,
    SHA,
    WALL,
    Renew,
    admit,
    admitted,
    count,
    create_ledger,
    facts,
    fence,
    lease,
    limits,
    make_plan,
    open_ledger,
    raw,
    raw_path,
    refused,
    stream,
    to_ready,
    to_released,
)


@pytest.fixture
def state_dir(tmp_path: Path) -> Path:
    path = tmp_path / "state"
    path.mkdir(mode=0o700)
    os.chmod(path, 0o700)
    return path


@pytest.fixture
def ledger(state_dir: Path) -> Iterator[Ledger]:
    led = create_ledger(str(state_dir), INSTALLATION, limits(), CEILING)
    yield led
    led.close()


# --- the file -----------------------------------------------------------------------


def test_created_file_is_private_wal_and_full_sync(ledger: Ledger, state_dir: Path) -> None:
    st = os.lstat(state_dir / LEDGER_FILE)
    assert stat.S_ISREG(st.st_mode)
    assert stat.S_IMODE(st.st_mode) == 0o600
    assert (st.st_uid, st.st_nlink) == (OWNER, 1)
    assert raw(ledger).execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert ledger._db.execute("PRAGMA synchronous").fetchone()[0] == 2  # FULL
    assert ledger._db.execute("PRAGMA foreign_keys").fetchone()[0] == 1
    admitted(ledger, make_plan())
    for suffix in ("-wal", "-shm"):
        st = os.lstat(state_dir / (LEDGER_FILE + suffix))
        assert (stat.S_IMODE(st.st_mode), st.st_uid) == (0o600, OWNER)


def test_identity_is_durable_and_new_per_database(ledger: Ledger, tmp_path: Path) -> None:
    bindings = ledger.bindings()
    assert bindings.installation_id == INSTALLATION
    assert bindings.admission_version == 1
    msgspec.convert(bindings.ledger_id, planlib.Identity)
    ledger.close()
    reopened = open_ledger(str(ledger.path.rsplit("/", 1)[0]), INSTALLATION)
    assert reopened.bindings() == bindings
    other_dir = tmp_path / "other"
    other_dir.mkdir(mode=0o700)
    other = create_ledger(str(other_dir), INSTALLATION, limits(), CEILING)
    assert other.bindings().ledger_id != bindings.ledger_id
    assert other.bindings().installation_id == INSTALLATION


def test_other_installation_is_refused(ledger: Ledger, state_dir: Path) -> None:
    ledger.close()
    with pytest.raises(HostError) as error:
        open_ledger(str(state_dir), "9" * 32)
    assert error.value.code == "ledger_installation_mismatch"


def test_create_refuses_an_existing_file(ledger: Ledger, state_dir: Path) -> None:
    ledger.close()
    before = (state_dir / LEDGER_FILE).read_bytes()
    with pytest.raises(HostError) as error:
        create_ledger(str(state_dir), INSTALLATION, limits(), CEILING)
    assert error.value.code == "ledger_exists"
    assert (state_dir / LEDGER_FILE).read_bytes() == before


def test_one_process_at_a_time(ledger: Ledger, state_dir: Path) -> None:
    for call in (
        lambda: open_ledger(str(state_dir), INSTALLATION),
        lambda: create_ledger(str(state_dir), INSTALLATION, limits(), CEILING),
    ):
        with pytest.raises(HostError) as error:
            call()
        assert error.value.code == "ledger_busy"
    ledger.close()
    open_ledger(str(state_dir), INSTALLATION).close()


def test_another_process_closing_the_file_keeps_our_wal(ledger: Ledger, state_dir: Path) -> None:
    """Regression: our own fd of the file must not drop SQLite's locks, or the last other
    connection to close checkpoints and deletes the WAL we are still writing."""
    ledger.close()
    led = open_ledger(str(state_dir), INSTALLATION)
    admitted(led, make_plan())
    reader = "import sqlite3, sys; print(sqlite3.connect(sys.argv[1]).execute(sys.argv[2])"
    reader += ".fetchone()[0])"
    query = "SELECT count(*) FROM attempts"
    run = [sys.executable, "-c", reader, led.path, query]
    assert subprocess.run(run, check=True, capture_output=True).stdout == b"1\n"
    assert (state_dir / (LEDGER_FILE + "-wal")).exists()
    admitted(led, make_plan())
    assert subprocess.run(run, check=True, capture_output=True).stdout == b"2\n"
    led.close()


def test_create_and_open_refuse_a_symlink(state_dir: Path, tmp_path: Path) -> None:
    target = tmp_path / "elsewhere.db"
    (state_dir / LEDGER_FILE).symlink_to(target)
    with pytest.raises(HostError) as error:
        create_ledger(str(state_dir), INSTALLATION, limits(), CEILING)
    assert error.value.code == "ledger_exists"
    assert not target.exists()
    target.write_bytes(b"")
    with pytest.raises(HostError) as error:
        open_ledger(str(state_dir), INSTALLATION)
    assert error.value.code == "ledger_unsafe"


def test_open_refuses_a_hard_link_or_loose_mode(ledger: Ledger, state_dir: Path) -> None:
    ledger.close()
    path = state_dir / LEDGER_FILE
    os.chmod(path, 0o644)
    with pytest.raises(HostError) as error:
        open_ledger(str(state_dir), INSTALLATION)
    assert error.value.code == "ledger_unsafe"
    os.chmod(path, 0o600)
    os.link(path, state_dir / "alias")
    with pytest.raises(HostError) as error:
        open_ledger(str(state_dir), INSTALLATION)
    assert error.value.code == "ledger_unsafe"
    assert error.value.message.endswith("remove the other links")  # one fix, the right one
    assert "create" not in error.value.message


def test_the_state_dir_magic_is_the_one_stat_reports(state_dir: Path) -> None:
    fd = os.open(state_dir, os.O_RDONLY | os.O_DIRECTORY)
    try:
        magic = filesystems.filesystem_magic(fd)
    finally:
        os.close(fd)
    reported = subprocess.run(
        ["stat", "-f", "-c", "%t", str(state_dir)], capture_output=True, text=True, check=True
    ).stdout.strip()
    assert magic == int(reported, 16)
    assert magic not in filesystems.NETWORK_FILESYSTEMS


@pytest.mark.parametrize(
    ("magic", "name"), [(0x6969, "NFS"), (0xFE534D42, "SMB2/SMB3"), (0x65735546, "FUSE")]
)
def test_a_state_dir_on_a_network_filesystem_is_refused(
    state_dir: Path, monkeypatch: pytest.MonkeyPatch, magic: int, name: str
) -> None:
    """No network filesystem can be mounted here: the magic the kernel would report
    for one stands in; the refusal path (create and open) is the real one."""
    create_ledger(str(state_dir), INSTALLATION, limits(), CEILING).close()
    monkeypatch.setattr(filesystems, "filesystem_magic", lambda fd: magic)
    for call in (
        lambda: open_ledger(str(state_dir), INSTALLATION),
        lambda: create_ledger(str(state_dir), INSTALLATION, limits(), CEILING),
    ):
        with pytest.raises(HostError) as refused:
            call()
        assert refused.value.code == "unsupported_filesystem"
        assert name in refused.value.message
    monkeypatch.undo()
    open_ledger(str(state_dir), INSTALLATION).close()  # the local directory still opens


SCHEMA_TWO_COLUMNS = (
    "storage_exhausted",
    "log_cut_short",
    "effective_expires_at_ms",
    "acknowledged_unknown",
    "start_offer_revision",
)


PAYLOAD_COLUMNS = ("payload_cpu_user_us", "payload_cpu_system_us", "payload_memory_peak_bytes")
"""What schema 6 added (the payload's own usage)."""
SCHEMA_THREE_COLUMNS = (
    "usage_recorded",
    *(c for c in ledger_schema.USAGE_COLUMNS if c not in PAYLOAD_COLUMNS),
)


def as_schema_five(state_dir: Path) -> None:
    """Turn a closed ledger into what a release before the payload's own usage wrote
    (schema 5)."""
    old = raw_path(state_dir)
    for column in PAYLOAD_COLUMNS:
        old.execute(f"ALTER TABLE attempts DROP COLUMN {column}")
    old.execute("UPDATE meta SET schema_version = 5")
    old.commit()
    old.close()


def as_schema_four(state_dir: Path) -> None:
    """Turn a closed ledger into what a release before `changed_ms` wrote (schema 4)."""
    as_schema_five(state_dir)
    old = raw_path(state_dir)
    old.execute("ALTER TABLE attempts DROP COLUMN changed_ms")
    old.execute("UPDATE meta SET schema_version = 4")
    old.commit()
    old.close()


def as_schema_three(state_dir: Path) -> None:
    """Turn a closed ledger into what a release before the renewals table wrote
    (schema version 3), its renewed leases back in the attempts' rows."""
    as_schema_four(state_dir)
    old = raw_path(state_dir)
    fields = ", ".join(ledger_schema.LEASE_FIELDS)
    for row in old.execute(f"SELECT {fields}, updated, attempt_id FROM renewals").fetchall():
        assignments = ", ".join(f"{n} = ?" for n in (*ledger_schema.LEASE_FIELDS, "updated"))
        old.execute(f"UPDATE attempts SET {assignments} WHERE attempt_id = ?", row)
    old.execute("DROP VIEW attempt_records")
    old.execute("DROP TABLE renewals")
    old.execute("UPDATE meta SET schema_version = 3")
    old.commit()
    old.close()


def as_schema_two(state_dir: Path) -> None:
    """Turn a closed ledger into what a release before usage wrote (schema version 2)."""
    as_schema_three(state_dir)
    old = raw_path(state_dir)
    for column in SCHEMA_THREE_COLUMNS:
        old.execute(f"ALTER TABLE attempts DROP COLUMN {column}")
    old.execute("UPDATE meta SET schema_version = 2")
    old.commit()
    old.close()


def migrated_from(led: Ledger, state_dir: Path, downgrade: Callable[[Path], None]) -> Ledger:
    """Close `led`, turn its file into an older schema with `downgrade`, and open it
    again (which migrates it): every record reads back as it was."""
    before = led.page(None)[0]
    led.close()
    downgrade(state_dir)
    migrated = open_ledger(str(state_dir), INSTALLATION)
    assert migrated.page(None)[0] == before
    return migrated


def as_schema_one(state_dir: Path) -> None:
    """Turn a closed ledger into what the first release wrote (schema version 1)."""
    as_schema_two(state_dir)
    old = raw_path(state_dir)
    for column in SCHEMA_TWO_COLUMNS:
        old.execute(f"ALTER TABLE attempts DROP COLUMN {column}")
    old.execute("UPDATE meta SET schema_version = 1")
    old.commit()
    old.close()


def test_a_ledger_made_before_the_added_columns_is_upgraded(state_dir: Path) -> None:
    led = create_ledger(str(state_dir), INSTALLATION, limits(), CEILING)
    job = new_id()
    first = make_plan(job_id=job)
    admitted(led, first)
    led.close()
    as_schema_one(state_dir)
    reopened = open_ledger(str(state_dir), INSTALLATION)
    record = reopened.get(first.attempt_id)
    assert record is not None
    assert record.lease is not None
    assert record.lease.effective_expires_at_ms == record.lease.expires_at_ms
    to_unknown_released(reopened, first)  # the new columns work on the old records
    retry = make_plan(job_id=job, generation=2)
    assert isinstance(admit_acknowledging(reopened, retry, first.attempt_id), Admitted)
    reopened.close()


USED = ResourceUsage(
    cpu_user_us=1_250_000,
    cpu_system_us=40_000,
    memory_peak_bytes=64 << 20,
    oom_kills=1,
    processes_peak=9,
    storage_bytes=3 << 20,
    storage_inodes=12,
    wall_ms=1_500,
)


def to_running(led: Ledger, plan: planlib.Plan) -> None:
    to_ready(led, plan)
    led.start_batch([fence(plan)], NOW)
    led.apply(fence(plan), lc.Started())


def test_a_batch_read_as_one_json_row_is_the_records_read_row_by_row(ledger: Ledger) -> None:
    """Batch reads come back from SQLite as one JSON row, decoded by msgspec: every
    state, flag and lease (or none) reads back exactly as the row-by-row path has it."""
    made = [make_plan() for _ in range(6)]
    for plan in made:
        admitted(ledger, plan, f=facts(slots=6))
    to_ready(ledger, made[1])
    to_running(ledger, made[2])
    ledger.apply(fence(made[2]), lc.StorageExhausted(log_cut_short=True), USED)
    to_running(ledger, made[3])
    ledger.apply(fence(made[3]), lc.Finished(exit_code=137, oom_killed=True), USED)
    ledger.apply(fence(made[3]), lc.CleanupConfirmed())
    to_released(ledger, made[4])
    to_running(ledger, made[5])
    ledger.apply(fence(made[5]), lc.StopRequested())
    fences = [fence(p) for p in made] + [Fence(new_id(), 1, SHA)]
    assert ledger._as_one  # this SQLite has its JSON functions
    ledger._cache = None  # both reads from the database
    as_one = ledger.fenced(fences)
    ledger._as_one = False
    row_by_row = ledger.fenced(fences)
    assert [repr(r) for r in as_one] == [repr(r) for r in row_by_row]
    states = [r.code if isinstance(r, HostError) else r.status.state for r in as_one]
    assert states == [
        "prepared",
        "prepared",
        "running",
        "failed",
        "released",
        "running",
        "unknown_attempt",
    ]
    running = [r for r in as_one if not isinstance(r, HostError) and r.status.state == "running"]
    assert [(r.status.storage_exhausted, r.status.stop_pending) for r in running] == [
        (True, None),
        (False, "cancelled"),
    ]


def test_usage_is_recorded_with_the_event_that_settles_and_only_once(ledger: Ledger) -> None:
    plan = make_plan()
    admitted(ledger, plan)
    assert ledger.usage_of([plan.attempt_id]) == {
        plan.attempt_id: RecordedUsage(False, ResourceUsage())
    }
    to_running(ledger, plan)
    ledger.apply(fence(plan), lc.StorageExhausted(log_cut_short=False), USED)  # not settled
    assert not ledger.usage_of([plan.attempt_id])[plan.attempt_id].recorded
    ledger.apply(fence(plan), lc.Finished(exit_code=137, oom_killed=True), USED)
    assert ledger.usage_of([plan.attempt_id, new_id()]) == {
        plan.attempt_id: RecordedUsage(True, USED)
    }
    assert not ledger.record_usage(fence(plan), ResourceUsage(oom_kills=7))  # never rewritten
    ledger.apply(fence(plan), lc.CleanupConfirmed())
    ledger.apply(fence(plan), lc.Release())
    assert ledger.usage_of([plan.attempt_id])[plan.attempt_id] == RecordedUsage(True, USED)


def test_usage_recorded_after_settling_needs_a_settled_attempt(ledger: Ledger) -> None:
    plan = make_plan()
    admitted(ledger, plan)
    to_running(ledger, plan)
    with pytest.raises(HostError) as refused:
        ledger.record_usage(fence(plan), USED)
    assert refused.value.code == "invalid_state"
    ledger.apply(fence(plan), lc.OutcomeLost(reason="provider_timeout"))
    partial = ResourceUsage(cpu_user_us=5, storage_bytes=4096)  # what could be read
    assert ledger.record_usage(fence(plan), partial)
    assert ledger.usage_of([plan.attempt_id])[plan.attempt_id] == RecordedUsage(True, partial)
    with pytest.raises(HostError) as mismatch:
        ledger.record_usage(Fence(plan.attempt_id, 2, fence(plan).plan_digest), USED)
    assert mismatch.value.code == "fence_mismatch"


def test_usage_is_tallied_per_slot_and_outcome(ledger: Ledger) -> None:
    done, lost = make_plan(), make_plan()
    for plan in (done, lost):
        admitted(ledger, plan)
        to_running(ledger, plan)
    ledger.apply(fence(done), lc.Finished(exit_code=0), USED)
    ledger.apply(fence(lost), lc.OutcomeLost(reason="provider_timeout"))
    tally = {(outcome, n, cpu, oom) for _, outcome, n, cpu, oom in ledger.usage_tally()}
    assert tally == {("succeeded", 1, 1_290_000, 1), ("unknown", 1, 0, 0)}


def test_a_ledger_of_schema_two_gains_usage_unrecorded_for_every_record(state_dir: Path) -> None:
    led = create_ledger(str(state_dir), INSTALLATION, limits(), CEILING)
    old, running = make_plan(), make_plan()
    admitted(led, old)
    to_unknown_released(led, old)
    admitted(led, running)
    to_running(led, running)
    reopened = migrated_from(led, state_dir, as_schema_two)
    try:
        found = reopened.usage_of([old.attempt_id, running.attempt_id])
        assert found == dict.fromkeys(
            [old.attempt_id, running.attempt_id], RecordedUsage(False, ResourceUsage())
        )
        reopened.apply(fence(running), lc.Finished(exit_code=0), USED)  # the new columns work
        assert reopened.usage_of([running.attempt_id])[running.attempt_id].recorded
    finally:
        reopened.close()


def test_by_default_the_state_dir_and_the_ledger_must_be_roots(state_dir: Path) -> None:
    """The daemon never names an owner: its ledger is root's. Other tests of the
    ledger's logic run as whoever runs them (`ledger_support`); this one holds the
    default, as root (the directory handed to someone else) or not."""
    if os.geteuid() == 0:
        os.chown(state_dir, 65534, 65534)
    with pytest.raises(HostError) as error:
        Ledger.create(str(state_dir), INSTALLATION, limits(), CEILING)
    assert error.value.code == "ledger_unsafe"
    assert "must be owned by root" in error.value.message
    assert "chown root" in error.value.message
    assert not (state_dir / LEDGER_FILE).exists()
    if OWNER != 0:  # without root: a ledger file that is not root's is refused as well
        create_ledger(str(state_dir), INSTALLATION, limits(), CEILING).close()
        with pytest.raises(HostError) as error:
            Ledger.open(str(state_dir), INSTALLATION)
        assert error.value.code == "ledger_unsafe"


def test_state_dir_must_be_private(state_dir: Path, tmp_path: Path) -> None:
    os.chmod(state_dir, 0o755)
    with pytest.raises(HostError) as error:
        create_ledger(str(state_dir), INSTALLATION, limits(), CEILING)
    assert error.value.code == "ledger_unsafe"
    assert not (state_dir / LEDGER_FILE).exists()
    os.chmod(state_dir, 0o700)
    link = tmp_path / "link"
    link.symlink_to(state_dir)
    with pytest.raises(HostError) as error:
        create_ledger(str(link), INSTALLATION, limits(), CEILING)
    assert error.value.code == "unsafe_path"


def test_open_missing_and_half_created(state_dir: Path) -> None:
    with pytest.raises(HostError) as error:
        open_ledger(str(state_dir), INSTALLATION)
    assert error.value.code == "ledger_missing"
    assert "restore it from backup" in error.value.message
    fd = os.open(state_dir / LEDGER_FILE, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    os.close(fd)  # a crash between creating the file and committing its schema
    with pytest.raises(HostError) as error:
        open_ledger(str(state_dir), INSTALLATION)
    assert error.value.code in {"ledger_corrupt", "ledger_schema"}


def test_a_database_without_the_ledger_tables_is_refused_as_no_ledger(state_dir: Path) -> None:
    """A real SQLite file with no tables (say, a crash during the first start) is
    refused with what to do, before anything is made on its connection."""
    path = state_dir / LEDGER_FILE
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    os.close(fd)
    db = sqlite3.connect(path)
    db.execute("PRAGMA journal_mode=WAL")
    db.execute("PRAGMA user_version = 1")  # a written header, still no table
    db.close()
    with pytest.raises(HostError) as error:
        open_ledger(str(state_dir), INSTALLATION)
    assert error.value.code == "ledger_schema"
    assert "no ledger identity" in error.value.message


def test_records_and_identity_cannot_be_deleted_or_rewritten(ledger: Ledger) -> None:
    plan = make_plan(inputs=(stream(),))  # row triggers need a row in every table
    admitted(ledger, plan)
    db = raw(ledger)
    for statement in (
        "DELETE FROM attempts",
        "DELETE FROM meta",
        "DELETE FROM input_objects",
        "UPDATE attempts SET plan_digest = 'x'",
        "UPDATE attempts SET generation = 7",
        "UPDATE meta SET ledger_id = '" + "0" * 32 + "'",
    ):
        with pytest.raises(sqlite3.DatabaseError, match="never"):
            db.execute(statement)
    assert count(ledger) == 1


# --- admission ----------------------------------------------------------------------


def test_admission_reserves_slot_lease_and_inputs(ledger: Ledger) -> None:
    obj = stream(10)
    plan = make_plan(inputs=(obj, planlib.InputObject(id=new_id(), name="local", bytes=0,
                                                      digest=planlib.EMPTY_DIGEST)))  # fmt: skip
    result = admitted(ledger, plan)
    record = result.record
    assert result.new
    assert record.status == lc.admitted()
    assert record.slot_id == "slot0"
    assert record.lease == lease()
    assert record.fence == fence(plan)
    assert ledger.get(plan.attempt_id) == record  # what was returned is what was written
    assert ledger.plan_bytes(plan.attempt_id) == planlib.encode_plan(plan)
    (only,) = ledger.inputs(plan.attempt_id)
    assert (only.object_id, only.offset, only.complete, only.bytes) == (obj.id, 0, False, 10)


def test_repeated_prepare_returns_the_same_record_deadline_and_partial(ledger: Ledger) -> None:
    obj = stream(10)
    plan = make_plan(inputs=(obj,))
    admitted(ledger, plan)
    ledger.commit_input_offset(fence(plan), obj.id, 0, 4)
    first = ledger.get(plan.attempt_id)
    rows = [PrepareRow(plan, lease(deadline_ns=DEADLINE * 2, expires_at_ms=9999))]
    (again,) = ledger.admit_batch(ledger.bindings(), rows, facts())
    assert isinstance(again, Admitted)
    assert not again.new
    assert again.record == first
    assert ledger.inputs(plan.attempt_id)[0].offset == 4


def test_a_plan_for_another_node_is_refused_before_anything_else(ledger: Ledger) -> None:
    """A plan addressed to another node (or deployment) is refused as such, also when
    another check (here the provider's, made before the transaction) would refuse it
    too: the operator is sent after the real cause. The plans of `make_plan` name
    deployment "3"*32 and node "4"*32."""
    here = msgspec.structs.replace(facts(), deployment_id="3" * 32, node_id="4" * 32)
    elsewhere = msgspec.structs.replace(here, node_id="5" * 32)
    unavailable = HostError("provider_unavailable", "the provider is not loaded")
    row = PrepareRow(make_plan(), lease(), refusal=unavailable)
    (result,) = ledger.admit_batch(ledger.bindings(), [row], elsewhere)
    refused(result, "node_mismatch")  # the handler sends it as admission_rejected's detail
    record = ledger.get(row.plan.attempt_id)
    assert record is not None
    assert record.detail == "node_mismatch"
    other_deployment = msgspec.structs.replace(here, deployment_id="6" * 32)
    (result,) = admit(ledger, make_plan(), f=other_deployment)
    refused(result, "node_mismatch")
    assert isinstance(admitted(ledger, make_plan(), f=here), Admitted)


def test_slot_exhaustion_commits_a_durable_rejection(ledger: Ledger, state_dir: Path) -> None:
    plans = [make_plan() for _ in range(3)]
    results = admit(ledger, *plans, f=facts(slots=2))
    assert [type(r) for r in results[:2]] == [Admitted, Admitted]
    refused(results[2], "slot_capacity")
    ledger.close()
    reopened = open_ledger(str(state_dir), INSTALLATION)
    record = reopened.get(plans[2].attempt_id)
    assert record is not None
    assert record.status == lc.admission_rejected()
    assert (record.slot_id, record.detail) == (None, "slot_capacity")
    assert reopened.inputs(plans[2].attempt_id) == []
    # the rejection is final: repeating the prepare returns it, starting it is refused
    (again,) = admit(reopened, plans[2], f=facts(slots=8))
    assert isinstance(again, Admitted)
    assert again.record == record
    (start,) = reopened.start_batch([fence(plans[2])], NOW)
    refused(start, "admission_rejected")
    released = reopened.apply(fence(plans[2]), lc.Release()).record.status
    assert (released.state, released.outcome, released.reason) == (
        "released",
        "failed",
        "admission_rejected",
    )
    reopened.close()


def test_slot_class_and_storage_must_fit(ledger: Ledger) -> None:
    refused(admit(ledger, make_plan(slot_class="gpu"))[0], "slot_capacity")
    too_big = make_plan(inputs=(stream(1 << 31),))
    refused(admit(ledger, too_big)[0], "slot_capacity")


@pytest.mark.parametrize("control", ["paused", "draining", "stopped"])
def test_a_new_ledger_has_the_configured_control_from_its_first_transaction(
    state_dir: Path, control: str
) -> None:
    """The configured control is part of the ledger's creation, not a second change that
    could fail (a full disk) and leave a new ledger with an offer more open than set."""
    led = create_ledger(str(state_dir), INSTALLATION, limits(), CEILING, control)  # type: ignore[arg-type]
    led.close()
    reopened = open_ledger(str(state_dir), INSTALLATION)
    try:
        offer = reopened.offer()
        assert (offer.revision, offer.control) == (1, control)
        refused(admit(reopened, make_plan(offer_revision=1))[0], "offer_closed")
    finally:
        reopened.close()


def test_resources_beyond_the_offer_are_rejected(state_dir: Path) -> None:
    led = create_ledger(str(state_dir), INSTALLATION, limits(cpu_millis=2500), CEILING)
    results = admit(led, make_plan(), make_plan(), make_plan())
    assert [type(r) for r in results[:2]] == [Admitted, Admitted]
    refused(results[2], "admission_rejected")
    assert "cpu_millis" in results[2].message  # type: ignore[union-attr]
    led.close()


def test_attempt_count_beyond_the_offer_is_rejected(state_dir: Path) -> None:
    led = create_ledger(str(state_dir), INSTALLATION, limits(attempts=1), CEILING)
    results = admit(led, make_plan(), make_plan())
    refused(results[1], "admission_rejected")
    led.close()


@pytest.mark.parametrize("control", ["paused", "draining", "stopped"])
def test_closed_offer_rejects_admission_durably(ledger: Ledger, control: str) -> None:
    offer = ledger.set_offer(1, control, None, CEILING)  # type: ignore[arg-type]
    plan = make_plan(offer_revision=offer.revision)
    refused(admit(ledger, plan)[0], "offer_closed")
    record = ledger.get(plan.attempt_id)
    assert record is not None
    assert record.status.reason == "admission_rejected"


def test_stale_offer_revision_and_expired_first_lease(ledger: Ledger) -> None:
    refused(admit(ledger, make_plan(offer_revision=2))[0], "offer_revision")
    plan = make_plan()
    rows = [PrepareRow(plan, lease(deadline_ns=NOW.boottime_ns))]
    refused(ledger.admit_batch(ledger.bindings(), rows, facts())[0], "lease_expired")
    other_boot = [PrepareRow(make_plan(), Lease(OTHER_BOOT, 1, 1, DEADLINE, 1))]
    refused(ledger.admit_batch(ledger.bindings(), other_boot, facts())[0], "lease_expired")
    assert count(ledger) == 3


def test_devices_projects_and_runtimes(state_dir: Path) -> None:
    offered = OfferLimits(limits().resources, projects=["2" * 32], runtimes=["podman"])
    led = create_ledger(str(state_dir), INSTALLATION, offered, CEILING)
    first, second, unknown = admit(
        led,
        make_plan(devices=("gpu0",)),
        make_plan(devices=("gpu0",)),
        make_plan(devices=("gpu9",)),
    )
    assert isinstance(first, Admitted)
    refused(second, "admission_rejected")
    refused(unknown, "admission_rejected")
    refused(admit(led, make_plan(project_id="5" * 32))[0], "admission_rejected")
    refused(admit(led, make_plan(provider="other"))[0], "admission_rejected")
    led.close()


def rejected_as(led: Ledger, plan: planlib.Plan, detail: str) -> None:
    """The plan's durable admission rejection: failed, no slot, cleanup confirmed."""
    record = led.get(plan.attempt_id)
    assert record is not None
    assert record.status == lc.admission_rejected()
    assert (record.slot_id, record.detail) == (None, detail)


def release_rejected(led: Ledger, *plans: planlib.Plan) -> None:
    for plan in plans:
        led.apply(fence(plan), lc.Release())


def test_generation_order(ledger: Ledger) -> None:
    job = new_id()
    first = make_plan(job_id=job, generation=1)
    admitted(ledger, first)
    newer, same = make_plan(job_id=job, generation=2), make_plan(job_id=job, generation=1)
    refused(admit(ledger, newer)[0], "generation_conflict")
    refused(admit(ledger, same)[0], "generation_conflict")
    # each refusal before a provider call leaves its durable rejection, this one too
    rejected_as(ledger, newer, "generation_conflict")
    rejected_as(ledger, same, "generation_conflict")
    (again,) = admit(ledger, newer)
    assert isinstance(again, Admitted)
    assert not again.new
    refused(ledger.start_batch([fence(newer)], NOW)[0], "admission_rejected")
    to_released(ledger, first)
    release_rejected(ledger, newer, same)
    second = make_plan(job_id=job, generation=3)
    admitted(ledger, second)
    older = make_plan(job_id=job, generation=2)
    refused(admit(ledger, older)[0], "generation_conflict")
    rejected_as(ledger, older, "generation_conflict")


def test_generation_conflict_of_reject_absent_writes_nothing(ledger: Ledger) -> None:
    job = new_id()
    admitted(ledger, make_plan(job_id=job, generation=1))
    before = count(ledger)
    (row,) = ledger.reject_absent(ledger.bindings(), [make_plan(job_id=job, generation=2)])
    refused(row, "generation_conflict")
    assert count(ledger) == before


# --- retry after an unknown outcome -------------------------------------------------


def to_unknown_released(led: Ledger, plan: planlib.Plan) -> None:
    to_ready(led, plan)
    led.start_batch([fence(plan)], NOW)
    for event in (lc.Started(), lc.OutcomeLost(reason="provider_timeout")):
        led.apply(fence(plan), event)
    for event in (lc.CleanupConfirmed(), lc.Release()):
        led.apply(fence(plan), event)


def admit_acknowledging(led: Ledger, plan: planlib.Plan, *acknowledged: str) -> object:
    row = PrepareRow(plan, lease(), acknowledged_unknown=acknowledged)
    (result,) = led.admit_batch(led.bindings(), [row], facts())
    return result


def test_a_retry_after_unknown_needs_its_acknowledgement(ledger: Ledger) -> None:
    job = new_id()
    first = make_plan(job_id=job, generation=1)
    admitted(ledger, first)
    to_unknown_released(ledger, first)
    silent = make_plan(job_id=job, generation=2)
    (refusal,) = admit(ledger, silent)
    refused(refusal, "unknown_not_acknowledged")
    assert first.attempt_id in str(refusal)  # the message names what to acknowledge
    rejected_as(ledger, silent, "unknown_not_acknowledged")
    release_rejected(ledger, silent)
    # a wrong list (an extra ID) is refused like a missing one
    wrong = make_plan(job_id=job, generation=3)
    refused(admit_acknowledging(ledger, wrong, first.attempt_id, silent.attempt_id),
            "unknown_not_acknowledged")  # fmt: skip
    release_rejected(ledger, wrong)
    retry = make_plan(job_id=job, generation=4)
    result = admit_acknowledging(ledger, retry, first.attempt_id)
    assert isinstance(result, Admitted)
    assert result.new


def test_each_unknown_is_acknowledged_once(ledger: Ledger, state_dir: Path) -> None:
    job = new_id()
    first = make_plan(job_id=job, generation=1)
    admitted(ledger, first)
    to_unknown_released(ledger, first)
    second = make_plan(job_id=job, generation=2)
    assert isinstance(admit_acknowledging(ledger, second, first.attempt_id), Admitted)
    to_released(ledger, second)
    ledger.close()
    reopened = open_ledger(str(state_dir), INSTALLATION)  # the acknowledgement is durable
    again = make_plan(job_id=job, generation=3)
    refused(admit_acknowledging(reopened, again, first.attempt_id), "unknown_not_acknowledged")
    release_rejected(reopened, again)
    assert isinstance(admitted(reopened, make_plan(job_id=job, generation=4)), Admitted)
    reopened.close()


def test_a_rejected_admission_does_not_use_up_the_acknowledgement(ledger: Ledger) -> None:
    job = new_id()
    first = make_plan(job_id=job, generation=1)
    admitted(ledger, first)
    to_unknown_released(ledger, first)
    wrong_class = make_plan(job_id=job, generation=2, slot_class="gpu")
    refused(admit_acknowledging(ledger, wrong_class, first.attempt_id), "slot_capacity")
    release_rejected(ledger, wrong_class)
    silent = make_plan(job_id=job, generation=3)
    refused(admit(ledger, silent)[0], "unknown_not_acknowledged")
    release_rejected(ledger, silent)
    retry = make_plan(job_id=job, generation=4)
    assert isinstance(admit_acknowledging(ledger, retry, first.attempt_id), Admitted)


def test_an_acknowledgement_without_unknowns_is_refused(ledger: Ledger) -> None:
    job = new_id()
    first = make_plan(job_id=job, generation=1)
    admitted(ledger, first)
    to_released(ledger, first)  # succeeded, not unknown
    retry = make_plan(job_id=job, generation=2)
    refused(admit_acknowledging(ledger, retry, first.attempt_id), "unknown_not_acknowledged")
    other_job = make_plan()
    refused(admit_acknowledging(ledger, other_job, first.attempt_id), "unknown_not_acknowledged")


def test_reused_attempt_id_with_another_plan_is_a_fence_mismatch(ledger: Ledger) -> None:
    plan = make_plan()
    admitted(ledger, plan)
    changed = msgspec.structs.replace(plan, job=msgspec.structs.replace(plan.job, name="other"))
    refused(admit(ledger, changed)[0], "fence_mismatch")


@pytest.mark.parametrize("field", ["installation_id", "ledger_id", "admission_version"])
def test_changed_bindings_write_nothing(ledger: Ledger, field: str) -> None:
    admitted(ledger, make_plan())
    before = raw(ledger).execute("SELECT count(*), (SELECT ordinal FROM meta) FROM attempts")
    snapshot = before.fetchone()
    wrong = {"installation_id": "7" * 32, "ledger_id": "7" * 32, "admission_version": 0}
    bindings = msgspec.structs.replace(ledger.bindings(), **{field: wrong[field]})
    plans = [make_plan(), make_plan(slot_class="none")]  # a good row and a rejected one
    for call in (
        lambda: ledger.admit_batch(bindings, [PrepareRow(p, lease()) for p in plans], facts()),
        lambda: ledger.reject_absent(bindings, plans),
        lambda: ledger.reconcile_absent(bindings, plans, evidence_ok=True),
    ):
        with pytest.raises(HostError) as error:
            call()
        assert error.value.code == "bindings_changed"
    after = raw(ledger).execute("SELECT count(*), (SELECT ordinal FROM meta) FROM attempts")
    assert after.fetchone() == snapshot


def test_a_batch_reserves_in_order_within_one_transaction(ledger: Ledger) -> None:
    plans = [make_plan() for _ in range(64)]
    results = admit(ledger, *plans, f=facts(slots=40))
    assert all(isinstance(r, Admitted) for r in results[:40])
    for r in results[40:]:
        refused(r, "slot_capacity")
    slots = {r.record.slot_id for r in results[:40] if isinstance(r, Admitted)}
    assert len(slots) == 40
    updated = {ledger.get(p.attempt_id).updated for p in plans}  # type: ignore[union-attr]
    assert len(updated) == 1  # one transaction


def test_a_mixed_batch_stores_each_record_as_returned_and_in_order(ledger: Ledger) -> None:
    """Admitted records are written by a statement with their status fixed as SQL
    literals, rejections by one binding every column: both must store exactly what
    binding the record's own values stores, and in the batch's order."""
    obj = stream(10)
    plans = [make_plan(inputs=(obj,)), make_plan(slot_class="gpu"), make_plan(), make_plan()]
    results = admit(ledger, *plans)
    refused(results[1], "slot_capacity")
    expected = {
        plans[1].attempt_id: (lc.admission_rejected(), "slot_capacity"),
        **{p.attempt_id: (lc.admitted(), None) for p in (plans[0], *plans[2:])},
    }
    columns = [*lc.Status.__struct_fields__, "detail"]
    stored_sql = ", ".join(f"{c}, typeof({c})" for c in columns)
    bound_sql = ", ".join("?, typeof(?)" for _ in columns)
    db = raw(ledger)
    for plan, result in zip(plans, results, strict=True):
        record = ledger.get(plan.attempt_id)
        assert record is not None
        if isinstance(result, Admitted):
            assert result.record == record
        status, detail = expected[plan.attempt_id]
        assert (record.status, record.detail) == (status, detail)
        stored = db.execute(
            f"SELECT {stored_sql} FROM attempts WHERE attempt_id = ?",
            (plan.attempt_id,),
        ).fetchone()
        values = [*msgspec.structs.astuple(status), detail]
        bound = db.execute(f"SELECT {bound_sql}", [v for v in values for _ in (0, 1)]).fetchone()
        assert stored == bound
    order = [r for (r,) in db.execute("SELECT attempt_id FROM attempts ORDER BY rowid")]
    assert order == [p.attempt_id for p in plans]
    assert [i.object_id for i in ledger.inputs(plans[0].attempt_id)] == [obj.id]
    db.close()


def test_batch_bounds(ledger: Ledger) -> None:
    with pytest.raises(HostError) as error:
        ledger.admit_batch(ledger.bindings(), [], facts())
    assert error.value.code == "invalid_request"
    rows = [PrepareRow(make_plan(), lease()) for _ in range(65)]
    with pytest.raises(HostError):
        ledger.admit_batch(ledger.bindings(), rows, facts())


# --- reject_absent and reconcile_absent ---------------------------------------------


def test_reject_absent(ledger: Ledger) -> None:
    live = make_plan()
    admitted(ledger, live)
    absent = make_plan()
    job = new_id()
    lower = make_plan(job_id=job, generation=2)
    admitted(ledger, lower)
    results = ledger.reject_absent(
        ledger.bindings(), [live, absent, make_plan(job_id=job, generation=1)]
    )
    existing, new, generation_row = results
    assert isinstance(existing, Admitted)
    assert not existing.new
    assert existing.record.status == lc.admitted()  # its actual state, unchanged
    assert isinstance(new, Admitted)
    assert new.new
    assert new.record.status == lc.admission_rejected()
    assert (new.record.slot_id, new.record.lease) == (None, None)
    refused(generation_row, "generation_conflict")
    mismatched = msgspec.structs.replace(live, generation=2)
    refused(ledger.reject_absent(ledger.bindings(), [mismatched])[0], "fence_mismatch")
    # a later prepare of the rejected plan cannot run it
    (again,) = admit(ledger, absent)
    assert isinstance(again, Admitted)
    assert again.record.status.state == "failed"
    with pytest.raises(HostError) as error:
        ledger.reject_absent(ledger.bindings(), [absent, absent])
    assert error.value.code == "invalid_request"


def test_reconcile_absent(ledger: Ledger) -> None:
    live = make_plan()
    admitted(ledger, live)
    absent = make_plan()
    before = count(ledger)
    with pytest.raises(HostError) as error:
        ledger.reconcile_absent(ledger.bindings(), [absent], evidence_ok=False)
    assert error.value.code == "reconcile_refused"
    with pytest.raises(HostError) as error:  # a reservation is still held
        ledger.reconcile_absent(ledger.bindings(), [absent], evidence_ok=True)
    assert error.value.code == "reconcile_refused"
    assert count(ledger) == before
    to_released(ledger, live)
    results = ledger.reconcile_absent(ledger.bindings(), [absent, live], evidence_ok=True)
    new, existing = results
    assert isinstance(new, Admitted)
    assert new.new
    assert new.record.status == lc.absence_acknowledged()
    assert new.record.slot_id is None
    assert isinstance(existing, Admitted)
    assert existing.record.status.state == "released"
    mismatched = msgspec.structs.replace(live, generation=5)
    (mismatch,) = ledger.reconcile_absent(ledger.bindings(), [mismatched], evidence_ok=True)
    refused(mismatch, "fence_mismatch")
    released = ledger.apply(fence(absent), lc.Release()).record.status
    assert (released.state, released.outcome) == ("released", "unknown")


# --- paging -------------------------------------------------------------------------


def test_page_over_200_attempts(ledger: Ledger) -> None:
    plans = [make_plan() for _ in range(200)]
    for i in range(0, 200, 64):
        ledger.reject_absent(ledger.bindings(), plans[i : i + 64])
    seen: list[str] = []
    cursor: str | None = None
    pages = 0
    while True:
        records, cursor = ledger.page(cursor)
        pages += 1
        assert len(records) <= 64
        seen.extend(r.attempt_id for r in records)
        if cursor is None:
            break
    assert pages == 4
    assert seen == sorted(p.attempt_id for p in plans)
    records, cursor = ledger.page(seen[-1])
    assert (records, cursor) == ([], None)


# --- lifecycle through the ledger ---------------------------------------------------


def test_start_happens_once_and_release_frees_the_slot(ledger: Ledger) -> None:
    plan, waiting = make_plan(), make_plan()
    admitted(ledger, plan, f=facts(slots=1))
    refused(admit(ledger, waiting, f=facts(slots=1))[0], "slot_capacity")
    (not_ready,) = ledger.start_batch([fence(plan)], NOW)
    refused(not_ready, "not_ready")
    to_ready(ledger, plan)
    assert ledger.prepare_result(plan.attempt_id) == b'{"argv":["/bin/true"]}'
    first, second = ledger.start_batch([fence(plan)], NOW), ledger.start_batch([fence(plan)], NOW)
    assert isinstance(first[0], Applied)
    assert first[0].changed
    assert isinstance(second[0], Applied)
    assert not second[0].changed
    ledger.apply(fence(plan), lc.Started())
    refused(ledger.apply_batch([(fence(plan), lc.Release())])[0], "not_terminal")
    ledger.apply(fence(plan), lc.Finished(exit_code=0))
    refused(ledger.apply_batch([(fence(plan), lc.Release())])[0], "cleanup_unconfirmed")
    ledger.apply(fence(plan), lc.CleanupFailed())
    refused(admit(ledger, make_plan(), f=facts(slots=1))[0], "slot_capacity")  # quarantine
    ledger.apply(fence(plan), lc.CleanupConfirmed())
    final = ledger.apply(fence(plan), lc.Release()).record
    assert (final.status.state, final.status.outcome, final.slot_id) == (
        "released",
        "succeeded",
        "slot0",
    )
    admitted(ledger, make_plan(), f=facts(slots=1))


def test_start_needs_a_current_lease_and_an_offer_that_still_covers_it(ledger: Ledger) -> None:
    plan = make_plan()
    admitted(ledger, plan)
    to_ready(ledger, plan)
    late = Now(BOOT, DEADLINE, WALL)
    refused(ledger.start_batch([fence(plan)], late)[0], "lease_expired")
    refused(ledger.start_batch([fence(plan)], Now(OTHER_BOOT, 1, WALL))[0], "lease_expired")
    other_project = OfferLimits(CEILING.resources, projects=["5" * 32], runtimes=None)
    ledger.set_offer(1, "active", other_project, CEILING)
    refused(ledger.start_batch([fence(plan)], NOW)[0], "offer_changed")
    ledger.set_offer(2, "paused", CEILING, CEILING)
    refused(ledger.start_batch([fence(plan)], NOW)[0], "offer_closed")
    assert ledger.get(plan.attempt_id).status.state == "prepared"  # type: ignore[union-attr]
    ledger.set_offer(3, "draining", CEILING, CEILING)  # a new revision that still covers it
    (started,) = ledger.start_batch([fence(plan)], NOW)
    assert isinstance(started, Applied)
    assert started.changed


def test_a_start_refusal_found_before_the_transaction_fails_only_a_start_it_would_accept(
    ledger: Ledger,
) -> None:
    """`refusals` (a staged input changed) replace an acceptance: the attempt fails
    `input_changed`, never started, and a later start answers the same code. A row the
    ledger refuses anyway (here its lease) keeps its own refusal and records nothing."""
    changed, late, intact = make_plan(), make_plan(), make_plan()
    for plan in (changed, late, intact):
        admitted(ledger, plan)
        to_ready(ledger, plan)
    refusal = HostError("input_changed", "the staged input 'data.bin' changed")
    refusals = {changed.attempt_id: refusal, late.attempt_id: refusal}
    (late_row,) = ledger.start_batch([fence(late)], Now(BOOT, DEADLINE, WALL), None, refusals)
    refused(late_row, "lease_expired")
    assert ledger.get(late.attempt_id).status.state == "prepared"  # type: ignore[union-attr]
    rows = ledger.start_batch([fence(changed), fence(intact)], NOW, None, refusals)
    assert rows[0] is refusal
    assert isinstance(rows[1], Applied)
    assert rows[1].changed
    status = ledger.get(changed.attempt_id).status  # type: ignore[union-attr]
    assert (status.state, status.outcome, status.reason) == ("failed", "failed", "input_changed")
    assert not status.start_requested
    assert not status.cleanup_confirmed
    refused(ledger.start_batch([fence(changed)], NOW)[0], "input_changed")
    refused(ledger.start_batch([fence(changed)], NOW, None, refusals)[0], "input_changed")


def test_start_checks_resources_left_by_started_attempts(ledger: Ledger) -> None:
    first, second, third = make_plan(), make_plan(), make_plan()
    for plan in (first, second, third):
        admitted(ledger, plan)
        to_ready(ledger, plan)
    ledger.set_offer(1, "active", limits(cpu_millis=2500), CEILING)
    ok, fits, over = ledger.start_batch([fence(first), fence(second), fence(third)], NOW)
    assert isinstance(ok, Applied)
    assert isinstance(fits, Applied)
    refused(over, "offer_changed")  # 3 x 1000 millis > 2500 offered


def starting(led: Ledger, plan: planlib.Plan) -> None:
    admitted(led, plan)
    to_ready(led, plan)
    (start,) = led.start_batch([fence(plan)], NOW)
    assert isinstance(start, Applied)
    assert start.changed


def test_release_is_authorized_while_the_offer_is_unchanged(ledger: Ledger) -> None:
    plan = make_plan()
    starting(ledger, plan)
    assert ledger.authorize_release(fence(plan), NOW, CEILING) is None
    assert ledger.get(plan.attempt_id).status.state == "starting"  # type: ignore[union-attr]


def test_a_stop_recorded_before_the_release_refuses_it_and_records_nothing(
    ledger: Ledger,
) -> None:
    plan = make_plan()
    starting(ledger, plan)
    ledger.apply(fence(plan), lc.StopRequested())
    assert ledger.authorize_release(fence(plan), NOW, CEILING) == "stop_pending"
    status = ledger.get(plan.attempt_id).status  # type: ignore[union-attr]
    assert (status.state, status.stop_pending) == ("starting", "cancelled")


def test_a_lease_run_out_before_the_release_refuses_it_and_records_nothing(
    ledger: Ledger,
) -> None:
    plan = make_plan()
    starting(ledger, plan)
    late = Now(BOOT, DEADLINE, WALL)
    assert ledger.authorize_release(fence(plan), late, CEILING) == "lease_expired"
    assert ledger.get(plan.attempt_id).status.state == "starting"  # type: ignore[union-attr]
    assert ledger.authorize_release(fence(plan), NOW, CEILING) is None


def test_a_start_accepted_while_draining_is_released_while_still_draining(
    ledger: Ledger,
) -> None:
    plan = make_plan()
    admitted(ledger, plan)
    to_ready(ledger, plan)
    ledger.set_offer(1, "draining", None, CEILING)
    ledger.start_batch([fence(plan)], NOW)
    assert ledger.authorize_release(fence(plan), NOW, CEILING) is None


@pytest.mark.parametrize("control", ["paused", "stopped", "draining"])
def test_an_offer_closed_after_the_start_cancels_before_release(
    ledger: Ledger, control: str
) -> None:
    plan = make_plan()
    starting(ledger, plan)
    ledger.set_offer(1, control, None, CEILING)  # type: ignore[arg-type]
    assert ledger.authorize_release(fence(plan), NOW, CEILING) == "offer_closed"
    status = ledger.get(plan.attempt_id).status  # type: ignore[union-attr]
    assert (status.state, status.outcome, status.reason) == (
        "cancelled",
        "cancelled",
        "offer_closed",
    )
    assert not status.cleanup_confirmed  # the service still has to be confirmed gone
    # the attempt is settled: a repeated start is an idempotent reply, never a start
    (again,) = ledger.start_batch([fence(plan)], NOW)
    assert isinstance(again, Applied)
    assert not again.changed


def test_a_new_revision_that_still_covers_the_attempt_keeps_authority(ledger: Ledger) -> None:
    plan = make_plan()
    starting(ledger, plan)
    ledger.set_offer(1, "paused", None, CEILING)
    ledger.set_offer(2, "active", limits(cpu_millis=1000), CEILING)  # exactly this attempt
    assert ledger.authorize_release(fence(plan), NOW, CEILING) is None
    assert ledger.get(plan.attempt_id).status.state == "starting"  # type: ignore[union-attr]


def test_an_offer_that_no_longer_covers_the_attempt_cancels_before_release(
    ledger: Ledger,
) -> None:
    plan = make_plan()
    starting(ledger, plan)
    ledger.set_offer(1, "active", limits(cpu_millis=999), CEILING)
    assert ledger.authorize_release(fence(plan), NOW, CEILING) == "offer_changed"
    status = ledger.get(plan.attempt_id).status  # type: ignore[union-attr]
    assert (status.state, status.reason) == ("cancelled", "offer_changed")


def test_fences_are_checked(ledger: Ledger) -> None:
    plan = make_plan()
    admitted(ledger, plan)
    wrong = Fence(plan.attempt_id, 2, fence(plan).plan_digest)
    refused(ledger.apply_batch([(wrong, lc.StopRequested())])[0], "fence_mismatch")
    missing = Fence(new_id(), 1, SHA)
    refused(ledger.start_batch([missing], NOW)[0], "unknown_attempt")


def test_mark_restarted(ledger: Ledger) -> None:
    staging, preparing, running = make_plan(), make_plan(), make_plan()
    admit(ledger, staging, preparing, running)
    ledger.apply(fence(preparing), lc.PrepareBegun())
    to_ready(ledger, running)
    ledger.start_batch([fence(running)], NOW)
    ledger.apply(fence(running), lc.Started())
    changed = {r.attempt_id: r.status for r in ledger.mark_restarted()}
    assert set(changed) == {preparing.attempt_id, running.attempt_id}
    assert (changed[running.attempt_id].state, changed[running.attempt_id].reason) == (
        "unknown",
        "executor_restarted",
    )
    assert changed[preparing.attempt_id].state == "failed"
    assert ledger.get(staging.attempt_id).status == lc.admitted()  # type: ignore[union-attr]


# --- leases -------------------------------------------------------------------------


def test_renewals(ledger: Ledger) -> None:
    plan = make_plan()
    admitted(ledger, plan)
    f = fence(plan)
    (renewed,) = ledger.renew_batch([(f, Renew(2, 6000))], NOW, MAX_LEASE)
    assert isinstance(renewed, Applied)
    expected = Lease(BOOT, 2, 6000, NOW.boottime_ns + 6000 * 10**6, 6000)  # leases.renew's rule
    assert renewed.record.lease == expected
    later = Now(BOOT, NOW.boottime_ns + 10**6, WALL + 10**6)
    (duplicate,) = ledger.renew_batch([(f, Renew(2, 6000))], later, MAX_LEASE)
    assert isinstance(duplicate, Applied)
    assert not duplicate.changed
    assert duplicate.record.lease == expected  # original deadline kept
    assert ledger.get(plan.attempt_id).lease == expected  # type: ignore[union-attr]
    refused(ledger.renew_batch([(f, Renew(2, 7000))], NOW, MAX_LEASE)[0], "lease_sequence")
    refused(ledger.renew_batch([(f, Renew(1, 1))], NOW, MAX_LEASE)[0], "lease_sequence")
    (capped,) = ledger.renew_batch([(f, Renew(3, 10**12))], NOW, 60)
    assert isinstance(capped, Applied)
    assert capped.record.lease is not None
    assert capped.record.lease.deadline_boottime_ns == NOW.boottime_ns + 60 * 10**9
    past = Now(BOOT, NOW.boottime_ns + 61 * 10**9, WALL)
    refused(ledger.renew_batch([(f, Renew(4, 10**12))], past, MAX_LEASE)[0], "lease_expired")
    ledger.set_offer(1, "stopped", None, CEILING)
    refused(ledger.renew_batch([(f, Renew(4, 9000))], NOW, MAX_LEASE)[0], "offer_closed")
    ledger.apply(f, lc.StopRequested())
    refused(ledger.renew_batch([(f, Renew(5, 9000))], NOW, MAX_LEASE)[0], "invalid_state")


# --- streamed inputs ----------------------------------------------------------------


def test_input_offsets_compare_and_set(ledger: Ledger) -> None:
    obj = stream(10)
    plan = make_plan(inputs=(obj,))
    admitted(ledger, plan)
    f = fence(plan)
    assert ledger.commit_input_offset(f, obj.id, 0, 6).offset == 6
    for args, code in (
        ((0, 8), "input_offset_changed"),
        ((6, 11), "input_size_mismatch"),
        ((6, 5), "input_size_mismatch"),
    ):
        with pytest.raises(HostError) as error:
            ledger.commit_input_offset(f, obj.id, *args)
        assert error.value.code == code
    with pytest.raises(HostError) as error:
        ledger.commit_input_offset(f, new_id(), 0, 1)
    assert error.value.code == "input_unknown"
    done = ledger.commit_input_offset(f, obj.id, 6, 10)
    assert done.complete
    assert done.offset == 10
    with pytest.raises(HostError) as error:
        ledger.commit_input_offset(f, obj.id, 10, 10)
    assert error.value.code == "input_complete"
    assert ledger.inputs(plan.attempt_id) == [done]


def test_inputs_are_frozen_once_preparation_begins(ledger: Ledger) -> None:
    obj = stream(4)
    plan = make_plan(inputs=(obj,))
    admitted(ledger, plan)
    ledger.apply(fence(plan), lc.PrepareBegun())
    with pytest.raises(HostError) as error:
        ledger.commit_input_offset(fence(plan), obj.id, 0, 1)
    assert error.value.code == "invalid_state"


# --- the offer ----------------------------------------------------------------------


def test_set_offer(ledger: Ledger) -> None:
    assert ledger.offer().revision == 1
    with pytest.raises(HostError) as error:
        ledger.set_offer(7, "paused", None, CEILING)
    assert error.value.code == "offer_revision"
    small = limits(cpu_millis=10)
    offer = ledger.set_offer(1, "draining", small, CEILING)
    assert (offer.revision, offer.control, offer.limits) == (2, "draining", small)
    assert ledger.offer() == offer
    with pytest.raises(HostError) as error:
        ledger.set_offer(2, "active", limits(cpu_millis=BIG + 1), CEILING)
    assert error.value.code == "offer_exceeds_ceiling"
    narrow = OfferLimits(CEILING.resources, projects=["2" * 32], runtimes=None)
    with pytest.raises(HostError) as error:
        ledger.set_offer(2, "active", limits(), narrow)  # projects: any > ceiling's list
    assert error.value.code == "offer_exceeds_ceiling"
    assert ledger.offer() == offer


# --- crash safety -------------------------------------------------------------------

_CHILD = textwrap.dedent(
    """
    import os, sys
    from ficc.execution.host.ledger.store import Ledger, PrepareRow
    sys.path.insert(0, os.environ["FICC_TEST_DIR"])
    from ledger_support import INSTALLATION, facts, lease, make_plan

    state_dir, round_no, ack = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    led = Ledger.open(state_dir, INSTALLATION, owner=os.geteuid())
    os.write(ack, b"open\\n")
    f = facts(slots=4096)
    for batch in range(10**6):
        rows = [
            PrepareRow(make_plan(attempt_id=f"{round_no:08x}{batch:08x}{i:08x}{0:08x}"), lease())
            for i in range(8)
        ]
        led.admit_batch(led.bindings(), rows, f)
        os.write(ack, f"{batch}\\n".encode())
    """
)


def _crash_rounds() -> int:
    return 500 if os.environ.get("FICC_SOAK") == "1" else 30


def _read_acks(fd: int, wanted: int) -> list[int]:
    """Read until the child has opened the ledger and acknowledged `wanted` batches (or
    until EOF: the child is dead)."""
    buffer, acks, opened = b"", [], False
    while not opened or len(acks) < wanted:
        ready, _, _ = select.select([fd], [], [], 60)
        assert ready, "the child made no progress for 60 s"
        chunk = os.read(fd, 4096)
        if not chunk:
            break
        buffer += chunk
        *lines, buffer = buffer.split(b"\n")
        opened = opened or b"open" in lines
        acks += [int(line) for line in lines if line != b"open"]
    return acks


@pytest.mark.soak
def test_sigkill_never_loses_an_acknowledged_batch_or_splits_one(ledger: Ledger) -> None:
    state_dir = ledger.path.rsplit("/", 1)[0]
    ledger_id = ledger.bindings().ledger_id
    ledger.close()
    env = os.environ | {"FICC_TEST_DIR": str(Path(__file__).parents[1])}
    rng = random.Random(os.environ.get("FICC_SEED", "ledger"))
    acknowledged: set[tuple[int, int]] = set()
    for round_no in range(_crash_rounds()):
        read_fd, write_fd = os.pipe()
        child = subprocess.Popen(
            [sys.executable, "-c", _CHILD, state_dir, str(round_no), str(write_fd)],
            pass_fds=(write_fd,),
            env=env,
        )
        os.close(write_fd)
        try:
            acks = _read_acks(read_fd, rng.randint(0, 3))
            child.send_signal(signal.SIGKILL)
            child.wait()
            acks += _read_acks(read_fd, 10**9)  # the rest, written before the kill
        finally:
            os.close(read_fd)
            if child.poll() is None:
                child.kill()
                child.wait()
        assert child.returncode == -signal.SIGKILL
        acknowledged |= {(round_no, b) for b in acks}
        reopened = open_ledger(state_dir, INSTALLATION)
        try:
            assert reopened.bindings().ledger_id == ledger_id
            batches: dict[tuple[int, int], int] = {}
            cursor: str | None = None
            while True:
                records, cursor = reopened.page(cursor)
                for r in records:
                    key = (int(r.attempt_id[:8], 16), int(r.attempt_id[8:16], 16))
                    batches[key] = batches.get(key, 0) + 1
                if cursor is None:
                    break
        finally:
            reopened.close()
        assert acknowledged <= set(batches), "an acknowledged batch is missing"
        assert set(batches.values()) <= {8}, "a batch was committed in part"


# --- admission invariants under random operations -----------------------------------

_SLOTS = [SlotSpec("c0", "cpu", 1 << 34, 10**6), SlotSpec("c1", "cpu", 1 << 34, 10**6),
          SlotSpec("g0", "gpu", 1 << 34, 10**6)]  # fmt: skip
_CPU_OFFER = 3000
_PLAN_SPECS = st.tuples(
    st.sampled_from(["cpu", "gpu"]),
    st.sampled_from([500, 1000, 2000]),
    st.sampled_from([(), ("gpu0",), ("gpu1",), ("gpu0", "gpu1")]),
)
_OPERATIONS = st.lists(
    st.one_of(
        st.tuples(st.just("admit"), st.lists(_PLAN_SPECS, min_size=1, max_size=4)),
        st.tuples(st.just("release"), st.integers(0, 7)),
        st.tuples(st.just("quarantine"), st.integers(0, 7)),
    ),
    max_size=12,
)


def _check_reservations(led: Ledger) -> None:
    records, _ = led.page(None)
    held = [r for r in records if r.slot_id is not None and r.status.state != "released"]
    classes = {s.id: s.slot_class for s in _SLOTS}
    assert len({r.slot_id for r in held}) == len(held), "a slot is reserved twice"
    devices: list[str] = []
    cpu = 0
    for r in held:
        plan = planlib.decode_plan(led.plan_bytes(r.attempt_id) or b"")
        assert classes[r.slot_id or ""] == plan.job.slot_class
        devices += plan.job.limits.devices
        cpu += plan.job.limits.cpu_millis
    assert len(set(devices)) == len(devices), "a device is reserved twice"
    assert cpu <= _CPU_OFFER
    for r in records:
        if r.status.reason == "admission_rejected":
            assert r.slot_id is None
            assert r.status.cleanup_confirmed


@pytest.mark.soak
@settings(
    max_examples=300 if os.environ.get("FICC_SOAK") == "1" else 25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(_OPERATIONS)
def test_reservations_never_overcommit(operations: list[tuple[str, object]]) -> None:
    work = tempfile.mkdtemp(prefix="ficc-ledger-")
    try:
        os.mkdir(f"{work}/state", 0o700)
        led = create_ledger(f"{work}/state", INSTALLATION, limits(cpu_millis=_CPU_OFFER), CEILING)
        f = HostFacts(slots=_SLOTS, devices=frozenset({"gpu0", "gpu1"}), ceiling=CEILING, now=NOW)
        live: list[planlib.Plan] = []
        for kind, arg in operations:
            if kind == "admit":
                plans = [
                    make_plan(slot_class=c, cpu_millis=m, devices=d)
                    for c, m, d in arg  # type: ignore[attr-defined]
                ]
                for plan, result in zip(plans, admit(led, *plans, f=f), strict=True):
                    if isinstance(result, Admitted) and result.record.slot_id is not None:
                        live.append(plan)
            elif live:
                plan = live[arg % len(live)]  # type: ignore[operator]
                led.apply_batch([(fence(plan), lc.StopRequested())])
                if kind == "release":
                    led.apply(fence(plan), lc.CleanupConfirmed())
                    led.apply(fence(plan), lc.Release())
                    live.remove(plan)
                else:
                    led.apply_batch([(fence(plan), lc.CleanupFailed())])
            _check_reservations(led)
        led.close()
    finally:
        shutil.rmtree(work)


# --- the record cache: always what the database holds ----------------------------


_EVENTS = [lc.PrepareBegun(), lc.PrepareOk(result=b'{"argv":["/bin/true"]}'), lc.Started(),
           lc.Finished(exit_code=0), lc.StopRequested(), lc.CleanupConfirmed(),
           lc.CleanupFailed(), lc.Release(), lc.LeaseExpired()]  # fmt: skip
_CACHE_OPERATIONS = st.lists(
    st.one_of(
        st.tuples(st.just("admit"), st.integers(1, 3)),
        st.tuples(st.just("stage"), st.integers(0, 7), st.integers(1, 10)),
        st.tuples(st.just("renew"), st.integers(0, 7), st.integers(-1, 2)),
        st.tuples(st.just("event"), st.integers(0, 7), st.integers(0, len(_EVENTS) - 1)),
        st.tuples(st.just("ready"), st.integers(0, 7)),
        st.tuples(st.just("start"), st.integers(0, 7)),
        st.tuples(st.just("finish_with_usage"), st.integers(0, 7)),
        st.tuples(st.just("expire"), st.integers(0, 7)),
        st.tuples(st.just("fail"), st.integers(0, 7), st.integers(0, len(_EVENTS) - 1)),
        st.tuples(st.just("restart")),
    ),
    min_size=1,
    max_size=16,
)


def _database_records(led: Ledger, ids: list[str]) -> dict[str, object]:
    """The records as a connection of its own reads them from the file."""
    db = sqlite3.connect(f"file:{led.path}?mode=ro", uri=True)
    try:
        marks = ", ".join("?" * len(ids))
        rows = db.execute(f"{ledger_schema.SELECT} WHERE attempt_id IN ({marks})", ids)
        return {r.attempt_id: r for r in map(ledger_schema.record, rows)}
    finally:
        db.close()


def _step(led: Ledger, plans: list[planlib.Plan], operation: tuple[object, ...]) -> None:
    """One operation of `test_the_record_cache_always_holds_what_the_database_holds`."""
    kind, *args = operation
    if kind == "admit":  # every other plan streams an input of 10 bytes
        made = [make_plan(inputs=(stream(),) * (i % 2)) for i in range(args[0])]  # type: ignore[call-overload]
        admit(led, *made, f=facts(slots=24))
        plans += made
        return
    if kind == "restart":
        led.mark_restarted()
        return
    if not plans:
        return
    plan = plans[args[0] % len(plans)]  # type: ignore[operator]
    if kind == "stage":
        with contextlib.suppress(HostError):  # not staging, or complete
            (obj,) = plan.job.inputs or (None,)
            if obj is not None:
                offset = sum(i.offset for i in led.inputs(plan.attempt_id))
                end = min(offset + args[1], obj.bytes)  # type: ignore[operator]
                led.commit_input_offset(fence(plan), obj.id, offset, end, when=NOW)
    elif kind == "renew":
        held = led.get(plan.attempt_id)
        sequence = (held.lease.sequence if held and held.lease else 1) + args[1]  # type: ignore[operator]
        led.renew_batch([(fence(plan), Renew(sequence, 6000 + sequence))], NOW, MAX_LEASE)
    elif kind == "event":
        led.apply_batch([(fence(plan), _EVENTS[args[1]])])  # type: ignore[index]
    elif kind == "ready":
        led.apply_batch([(fence(plan), lc.PrepareBegun())])
        led.apply_batch([(fence(plan), lc.PrepareOk(result=b"{}"))])
    elif kind == "start":  # also writes the offer revision it started under: two writes
        led.start_batch([fence(plan)], NOW)
    elif kind == "finish_with_usage":  # the usage is a second write of the row
        led.apply_batch([(fence(plan), lc.Started())])
        led.apply_batch([(fence(plan), lc.Finished(exit_code=3))], {plan.attempt_id: USED})
    elif kind == "expire":
        with contextlib.suppress(HostError):
            led.expire(fence(plan), Now(BOOT, DEADLINE + 1, WALL))
    else:  # a transaction that writes, then fails before its commit

        def fail(record: object) -> None:
            raise RuntimeError("injected fault after a write")

        led._wrote = fail  # type: ignore[method-assign]
        try:
            with contextlib.suppress(RuntimeError):
                led.apply_batch([(fence(plan), _EVENTS[args[1]])])  # type: ignore[index]
        finally:
            del led._wrote


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_CACHE_OPERATIONS)
def test_the_record_cache_always_holds_what_the_database_holds(
    operations: list[tuple[object, ...]],
) -> None:
    """After every kind of write (admission, staged chunks, renewals good and refused,
    lifecycle steps, starts, usage, expiry, the restart sweep, and a transaction that
    fails after its write), every cached record and staged amount, and every read,
    equal what the file holds."""
    work = tempfile.mkdtemp(prefix="ficc-ledger-")
    try:
        os.mkdir(f"{work}/state", 0o700)
        led = create_ledger(f"{work}/state", INSTALLATION, limits(), CEILING)
        plans: list[planlib.Plan] = []
        for operation in operations:
            _step(led, plans, operation)
            ids = [p.attempt_id for p in plans]
            if not ids:
                continue
            held = _database_records(led, ids)
            assert led._cache is not None
            assert led._cache.known(ids) == {i: held[i] for i in led._cache.known(ids)}
            staged = {i: sum(o.offset for o in led.inputs(i)) for i in ids}
            assert led._cache.known_staged(ids) == {
                i: staged[i] for i in led._cache.known_staged(ids)
            }
            reads = led.fenced([fence(p) for p in plans])
            assert reads == [held[i] for i in ids]
            assert led.staged_bytes(ids) == staged
            assert led.cached([fence(p) for p in plans]) == (reads, staged)  # filled by them
        led.close()
    finally:
        shutil.rmtree(work)


def test_a_renewal_and_the_reads_after_it_need_no_record_query(ledger: Ledger) -> None:
    """What makes polling cheap: once read, the records a client renews and observes
    come from the cache; the renewal's own write keeps it (no query of the records)."""
    plans = [make_plan() for _ in range(3)]
    admit(ledger, *plans)
    fences = [fence(p) for p in plans]
    ledger.fenced(fences)
    statements: list[str] = []
    ledger._db.set_trace_callback(statements.append)
    renewed = ledger.renew_batch([(f, Renew(2, 6000)) for f in fences], NOW, MAX_LEASE)
    after = ledger.fenced(fences)
    ledger._db.set_trace_callback(None)
    assert all(isinstance(r, Applied) and r.changed for r in renewed)
    assert after == [r.record for r in renewed]  # type: ignore[union-attr]
    held = _database_records(ledger, [f.attempt_id for f in fences])
    assert after == [held[f.attempt_id] for f in fences]
    assert [s for s in statements if "FROM attempt" in s] == []  # no record query
    assert sum(s.startswith("INSERT INTO renewals") for s in statements) >= 3  # traced


def test_a_refusal_inside_a_write_keeps_the_record_cache(ledger: Ledger) -> None:
    """A transaction refused before its commit is rolled back to what the cache holds:
    a client's stale chunk or unknown fence must not cost every other client's cache."""
    plans = [make_plan() for _ in range(3)]
    admit(ledger, *plans)
    ledger.fenced([fence(p) for p in plans])
    ledger.staged_bytes([p.attempt_id for p in plans])
    assert ledger._cache is not None
    assert len(ledger._cache) == 3
    with pytest.raises(HostError):
        ledger.expire(Fence(new_id(), 1, SHA), NOW)
    with pytest.raises(HostError):
        ledger.expire(Fence(plans[0].attempt_id, 2, SHA), NOW)
    assert len(ledger._cache) == 3
    held = _database_records(ledger, [p.attempt_id for p in plans])
    assert ledger.cached([fence(p) for p in plans]) == (
        [held[p.attempt_id] for p in plans],
        dict.fromkeys(held, 0),
    )


class _CommitFailsAfterWriting:
    """A connection whose COMMIT reports an error after the data is in (as an I/O
    error on the last sync can): the outcome, to the ledger, is unknown."""

    def __init__(self, db: sqlite3.Connection) -> None:
        self._db = db

    def execute(self, sql: str, *args: object) -> sqlite3.Cursor:
        cursor = self._db.execute(sql, *args)
        if sql == "COMMIT":
            error = sqlite3.OperationalError("disk I/O error")
            error.sqlite_errorcode = 10  # SQLITE_IOERR
            raise error
        return cursor

    def __getattr__(self, name: str) -> object:
        return getattr(self._db, name)


def test_a_commit_of_unknown_outcome_empties_the_record_cache(ledger: Ledger) -> None:
    plan = make_plan()
    admitted(ledger, plan)
    before = ledger.fenced([fence(plan)])
    real = ledger._db
    ledger._db = _CommitFailsAfterWriting(real)  # type: ignore[assignment]
    with pytest.raises(sqlite3.OperationalError):
        ledger.apply_batch([(fence(plan), lc.StopRequested())])
    ledger._db = real
    (after,) = ledger.fenced([fence(plan)])
    assert after != before[0]
    assert after == _database_records(ledger, [plan.attempt_id])[plan.attempt_id]
    assert after.status.state == "cancelled"  # type: ignore[union-attr]


# --- the log of committed changes -----------------------------------------------------------


def _state_lines(caplog: pytest.LogCaptureFixture) -> list[dict[str, object]]:
    return [
        r.fields  # type: ignore[attr-defined]
        for r in caplog.records
        if getattr(r, "fields", {}).get("event") == "attempt_state"
    ]


def test_every_committed_change_is_logged_once_with_its_cause(
    ledger: Ledger, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level("INFO", logger="ficc.execution.host.ledger")
    plan = make_plan()
    admitted(ledger, plan)
    ledger.apply(fence(plan), lc.StopRequested())
    lines = _state_lines(caplog)
    assert [(x["attempt_id"], x["cause"], x["state"]) for x in lines] == [
        (plan.attempt_id, "admitted", "prepared"),
        (plan.attempt_id, "stop", "cancelled"),
    ]
    assert lines[1]["outcome"] == "cancelled"
    ledger.apply(fence(plan), lc.StopRequested())  # no change: no line
    assert len(_state_lines(caplog)) == 2


def test_a_rolled_back_transaction_logs_nothing(
    ledger: Ledger, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A record written inside a transaction that then fails never reaches the log."""
    caplog.set_level("INFO", logger="ficc.execution.host.ledger")
    admit_new = Ledger._admit_new

    def write_then_fail(self: Ledger, *args: object, **kwargs: object) -> object:
        admit_new(self, *args, **kwargs)  # type: ignore[arg-type]
        raise RuntimeError("injected fault after the insert")

    monkeypatch.setattr(Ledger, "_admit_new", write_then_fail)
    plan = make_plan()
    with pytest.raises(RuntimeError):
        ledger.admit_batch(ledger.bindings(), [PrepareRow(plan, lease())], facts())
    monkeypatch.undo()
    assert ledger.get(plan.attempt_id) is None  # rolled back
    assert _state_lines(caplog) == []
    admitted(ledger, plan)  # and the next transaction logs only its own change
    assert [x["cause"] for x in _state_lines(caplog)] == ["admitted"]


# --- batched reads: one query per batch, the same per-row answers -------------------


def _outcome(result: object) -> object:
    """A row's answer without the transaction ordinals (which differ between twins)."""
    if isinstance(result, HostError):
        return result.code
    record = result.record if isinstance(result, Applied) else result
    assert not isinstance(record, Admitted)
    fields = msgspec.structs.asdict(record) | {"created": None, "updated": None}
    return (fields, getattr(result, "changed", None))


def _twins(tmp_path: Path, plans: list[planlib.Plan]) -> tuple[Ledger, Ledger]:
    """Two ledgers holding the same records: one for a batch, one for row-by-row calls."""
    twins = []
    for name in ("batch", "rows"):
        state = tmp_path / name
        state.mkdir(mode=0o700)
        led = create_ledger(str(state), INSTALLATION, limits(), CEILING)
        admit(led, *plans, f=facts(slots=len(plans)))
        twins.append(led)
    return twins[0], twins[1]


def _mixed_fences(plans: list[planlib.Plan]) -> list[Fence]:
    """Known, unknown, wrong generation, wrong digest, and a known one repeated."""
    known = fence(plans[0])
    return [
        known,
        Fence(new_id(), 1, SHA),
        Fence(plans[1].attempt_id, plans[1].generation + 1, fence(plans[1]).plan_digest),
        Fence(plans[2].attempt_id, plans[2].generation, SHA),
        fence(plans[3]),
        known,
    ]


def test_fenced_batch_answers_each_row_as_a_single_read(ledger: Ledger) -> None:
    plans = [make_plan() for _ in range(4)]
    admit(ledger, *plans)
    fences = _mixed_fences(plans)
    results = ledger.fenced(fences)
    assert [_outcome(r) for r in results] == [_outcome(ledger.fenced([f])[0]) for f in fences]
    codes = [r.code if isinstance(r, HostError) else r.attempt_id for r in results]
    assert codes == [
        plans[0].attempt_id,
        "unknown_attempt",
        "fence_mismatch",
        "fence_mismatch",
        plans[3].attempt_id,
        plans[0].attempt_id,
    ]
    for f, result in zip(fences, results, strict=True):
        if not isinstance(result, HostError):
            assert result == ledger.get(f.attempt_id)


def test_a_renew_batch_gives_the_answers_of_its_rows_one_by_one(tmp_path: Path) -> None:
    plans = [make_plan() for _ in range(5)]
    batch, rows = _twins(tmp_path, plans)
    try:
        for led in (batch, rows):
            to_released(led, plans[4])  # holds no lease any more
        known, unknown, generation, digest, later, _ = _mixed_fences(plans)
        renewals = [
            (known, Renew(2, 6000)),
            (unknown, Renew(2, 6000)),
            (generation, Renew(2, 6000)),
            (digest, Renew(2, 6000)),
            (later, Renew(2, 6000)),
            (known, Renew(2, 6000)),  # identical duplicate of the first row: no change
            (later, Renew(3, 7000)),  # sees the row before it in the same batch
            (later, Renew(3, 1)),  # same sequence, other expiry
            (fence(plans[4]), Renew(2, 6000)),
        ]
        together = batch.renew_batch(renewals, NOW, MAX_LEASE)
        alone = [rows.renew_batch([row], NOW, MAX_LEASE)[0] for row in renewals]
        assert [_outcome(r) for r in together] == [_outcome(r) for r in alone]
        codes = [r.code if isinstance(r, HostError) else r.changed for r in together]
        assert codes == [True, "unknown_attempt", "fence_mismatch", "fence_mismatch", True,
                         False, True, "lease_sequence", "invalid_state"]  # fmt: skip
        # What each row returned is what the ledger holds after that row.
        assert together[5] == Applied(together[0].record, changed=False)  # type: ignore[union-attr]
        assert together[6].record == batch.get(plans[3].attempt_id)  # type: ignore[union-attr]
        assert together[0].record == batch.get(plans[0].attempt_id)  # type: ignore[union-attr]
    finally:
        batch.close()
        rows.close()


def test_a_renewal_group_written_in_one_statement_holds_what_row_by_row_writes_hold(
    tmp_path: Path,
) -> None:
    """The renewals of a group are written as one JSON parameter in one statement where
    SQLite has its JSON functions: in order, so an attempt renewed twice in one group
    ends with its later lease, and the database then holds exactly what the cache
    kept and what one `executemany` writes."""
    plans = [make_plan() for _ in range(3)]
    one_statement, row_by_row = _twins(tmp_path, plans)
    try:
        assert one_statement._as_one  # this SQLite has its JSON functions
        row_by_row._as_one = False
        first, second, third = (fence(p) for p in plans)
        groups = [
            [(first, Renew(2, 6000)), (second, Renew(2, 6000))],
            [(first, Renew(3, 7000)), (third, Renew(2, 5000)), (second, Renew(2, 6000))],
        ]
        answers = [led.renew_batches(groups, NOW, MAX_LEASE) for led in (one_statement, row_by_row)]
        assert [[_outcome(r) for r in rows] for rows in answers[0]] == [
            [_outcome(r) for r in rows] for rows in answers[1]
        ]
        cached = [one_statement.get(p.attempt_id) for p in plans]
        for led in (one_statement, row_by_row):
            led._cache = None  # read the database itself
        held = [one_statement.get(p.attempt_id) for p in plans]
        assert held == cached == [row_by_row.get(p.attempt_id) for p in plans]
        leases = [(r.lease.sequence, r.lease.expires_at_ms) if r.lease else None for r in held]
        assert leases == [(3, 7000), (2, 6000), (2, 5000)]
    finally:
        one_statement.close()
        row_by_row.close()


def test_a_renew_batch_that_changes_nothing_commits_nothing(ledger: Ledger) -> None:
    plans = [make_plan() for _ in range(3)]
    admit(ledger, *plans)
    renewals = [(fence(p), Renew(2, 6000)) for p in plans]

    def ordinal() -> int:
        return int(raw(ledger).execute("SELECT ordinal FROM meta").fetchone()[0])

    first = ledger.renew_batch(renewals, NOW, MAX_LEASE)
    assert all(isinstance(r, Applied) and r.changed for r in first)
    committed = ordinal()
    later = Now(BOOT, NOW.boottime_ns + 10**9, WALL)
    again = ledger.renew_batch([*renewals, (Fence(new_id(), 1, SHA), Renew(2, 6000))], later,
                               MAX_LEASE)  # fmt: skip
    assert [r.record if isinstance(r, Applied) else r.code for r in again] == [
        *(r.record for r in first if isinstance(r, Applied)),
        "unknown_attempt",
    ]
    assert ordinal() == committed  # identical duplicates and refusals: no transaction
    assert [ledger.get(p.attempt_id) for p in plans] == [
        r.record for r in first if isinstance(r, Applied)
    ]
    ledger.renew_batch([(fence(plans[0]), Renew(3, 6000))], NOW, MAX_LEASE)
    assert ordinal() == committed + 1


def test_an_apply_batch_gives_the_answers_of_its_rows_one_by_one(tmp_path: Path) -> None:
    plans = [make_plan() for _ in range(4)]
    batch, rows = _twins(tmp_path, plans)
    try:
        known, unknown, generation, digest, other, _ = _mixed_fences(plans)
        events: list[tuple[Fence, lc.AnyEvent]] = [
            (known, lc.PrepareBegun()),
            (unknown, lc.PrepareBegun()),
            (generation, lc.StopRequested()),
            (digest, lc.StopRequested()),
            (known, lc.PrepareOk(result=b"{}")),  # sees the first row
            (known, lc.PrepareBegun()),  # refused: already ready
            (other, lc.StopRequested()),
            (other, lc.StopRequested()),  # no change
        ]
        together = batch.apply_batch(events)
        alone = [rows.apply_batch([row])[0] for row in events]
        assert [_outcome(r) for r in together] == [_outcome(r) for r in alone]
        assert together[4].record == batch.get(plans[0].attempt_id)  # type: ignore[union-attr]
        assert together[6].record == batch.get(plans[3].attempt_id)  # type: ignore[union-attr]
        assert batch.prepare_result(plans[0].attempt_id) == b"{}"
    finally:
        batch.close()
        rows.close()


def test_a_start_batch_gives_the_answers_of_its_rows_one_by_one(tmp_path: Path) -> None:
    plans = [make_plan() for _ in range(4)]
    batch, rows = _twins(tmp_path, plans)
    try:
        for led in (batch, rows):
            to_ready(led, plans[0])
            to_ready(led, plans[3])
        fences = _mixed_fences(plans)
        together = batch.start_batch(fences, NOW)
        alone = [rows.start_batch([f], NOW)[0] for f in fences]
        assert [_outcome(r) for r in together] == [_outcome(r) for r in alone]
        codes = [r.code if isinstance(r, HostError) else r.changed for r in together]
        assert codes == [True, "unknown_attempt", "fence_mismatch", "fence_mismatch", True, False]
        assert together[0].record == batch.get(plans[0].attempt_id)  # type: ignore[union-attr]
    finally:
        batch.close()
        rows.close()


def test_staged_bytes_of_a_batch(ledger: Ledger) -> None:
    small, large = stream(10), stream(20)
    two_streams, one_stream, none = (
        make_plan(inputs=(small, large)),
        make_plan(inputs=(stream(10),)),
        make_plan(),
    )
    admit(ledger, two_streams, one_stream, none)
    ledger.commit_input_offset(fence(two_streams), small.id, 0, 4)
    ledger.commit_input_offset(fence(two_streams), large.id, 0, 20)
    unknown = new_id()
    ids = [none.attempt_id, two_streams.attempt_id, unknown, one_stream.attempt_id]
    assert ledger.staged_bytes([*ids, two_streams.attempt_id]) == {
        none.attempt_id: 0,
        two_streams.attempt_id: 24,
        unknown: 0,
        one_stream.attempt_id: 0,
    }
    assert ledger.staged_bytes([]) == {}
    inputs = ledger.inputs_of(ids)
    assert list(inputs) == ids
    assert inputs == {attempt_id: ledger.inputs(attempt_id) for attempt_id in ids}
    assert [i.offset for i in inputs[two_streams.attempt_id]] == [
        {small.id: 4, large.id: 20}[i.object_id] for i in inputs[two_streams.attempt_id]
    ]
    assert inputs[unknown] == inputs[none.attempt_id] == []


@pytest.mark.parametrize("query", ["OCCUPANCY_SQL", "STARTED_SQL", "ACTIVE_SQL"])
def test_what_a_growing_ledger_looks_up_goes_through_an_index(ledger: Ledger, query: str) -> None:
    """Records are never deleted, so the reservations (every admission), the started
    usage (every start) and the active records (every restart) must be index lookups,
    not scans of every record ever made."""
    sql = getattr(ledger_schema, query)
    plan = [row[3] for row in ledger._db.execute(f"EXPLAIN QUERY PLAN {sql}")]
    assert any("USING INDEX attempts_" in step for step in plan), plan
    assert not any(step.startswith("SCAN attempts") for step in plan), plan


def test_a_ledger_of_the_previous_schema_is_migrated_with_its_records(
    ledger: Ledger, state_dir: Path
) -> None:
    """A ledger written before the storage flags existed (schema 1) opens, gains the
    columns with false for every record, and keeps every record as it was."""
    admitted(ledger, make_plan())
    migrated = migrated_from(ledger, state_dir, as_schema_one)
    try:
        assert not migrated.page(None)[0][0].status.storage_exhausted
    finally:
        migrated.close()
    db = sqlite3.connect(state_dir / LEDGER_FILE)
    try:
        (version,) = db.execute("SELECT schema_version FROM meta").fetchone()
        assert version == ledger_schema.SCHEMA_VERSION
    finally:
        db.close()


def test_a_ledger_of_schema_three_keeps_its_leases_and_renews_into_the_new_table(
    ledger: Ledger, state_dir: Path
) -> None:
    """Before schema 4 a renewal rewrote the lease in the attempt's row: those leases
    read back unchanged after the migration, and the next renewal goes on from them."""
    plans = [make_plan() for _ in range(2)]
    admit(ledger, *plans)
    ledger.renew_batch([(fence(plans[0]), Renew(2, 6000))], NOW, MAX_LEASE)
    migrated = migrated_from(ledger, state_dir, as_schema_three)
    try:
        assert migrated.get(plans[0].attempt_id).lease.sequence == 2  # type: ignore[union-attr]
        (stale,) = migrated.renew_batch([(fence(plans[0]), Renew(2, 7000))], NOW, MAX_LEASE)
        refused(stale, "lease_sequence")  # judged against the lease kept in the old row
        (renewed,) = migrated.renew_batch([(fence(plans[1]), Renew(2, 6000))], NOW, MAX_LEASE)
        assert isinstance(renewed, Applied)
    finally:
        migrated.close()
    reopened = open_ledger(str(state_dir), INSTALLATION)
    try:
        assert reopened.get(plans[1].attempt_id) == renewed.record
    finally:
        reopened.close()


def wall_ms() -> int:
    return time.time_ns() // 1_000_000


def test_each_status_change_records_when_it_happened(ledger: Ledger) -> None:
    """`changed_ms` is the wall clock of the transaction that last changed the status
    (what `status` sorts and shows); a renewal moves the lease, not the status."""
    plan = make_plan()
    before = wall_ms()
    admitted(ledger, plan)
    (at,) = ledger.changed_times([plan.attempt_id]).values()
    assert before <= at <= wall_ms()
    db = raw(ledger)
    db.execute("UPDATE attempts SET changed_ms = 1 WHERE attempt_id = ?", (plan.attempt_id,))
    db.commit()
    (renewed,) = ledger.renew_batch([(fence(plan), Renew(2, 6000))], NOW, MAX_LEASE)
    assert isinstance(renewed, Applied)
    assert renewed.changed
    assert ledger.changed_times([plan.attempt_id]) == {plan.attempt_id: 1}
    before = wall_ms()
    ledger.apply(fence(plan), lc.PrepareFailed(reason="provider_failed"))
    assert before <= ledger.changed_times([plan.attempt_id])[plan.attempt_id] <= wall_ms()
    assert ledger.changed_times([new_id()]) == {}


def test_a_ledger_of_schema_four_gains_changed_times_unknown_for_its_records(
    ledger: Ledger, state_dir: Path
) -> None:
    """Records made before the column have no time (shown as unknown); the next status
    change of one records its time."""
    plan = make_plan()
    admitted(ledger, plan)
    migrated = migrated_from(ledger, state_dir, as_schema_four)
    try:
        assert migrated.changed_times([plan.attempt_id]) == {}
        migrated.apply(fence(plan), lc.PrepareFailed(reason="provider_failed"))
        assert plan.attempt_id in migrated.changed_times([plan.attempt_id])
    finally:
        migrated.close()


def test_a_ledger_of_schema_five_keeps_its_usage_and_the_payloads_share_is_unknown(
    ledger: Ledger, state_dir: Path
) -> None:
    """Records made before the payload's own figures were kept have none (absent, never
    zero); what they used is kept, and a new record's payload figures are recorded."""
    old, new = make_plan(), make_plan()
    admit(ledger, old, new)
    for plan in (old, new):
        ledger.apply(fence(plan), lc.PrepareFailed(reason="provider_failed"))
    used = ResourceUsage(cpu_user_us=5, memory_peak_bytes=7)
    assert ledger.record_usage(fence(old), used)
    migrated = migrated_from(ledger, state_dir, as_schema_five)
    try:
        assert migrated.usage_of([old.attempt_id])[old.attempt_id].usage == used
        own = ResourceUsage(cpu_user_us=9, payload_cpu_user_us=4, payload_memory_peak_bytes=3)
        assert migrated.record_usage(fence(new), own)
        assert migrated.usage_of([new.attempt_id])[new.attempt_id].usage == own
    finally:
        migrated.close()


def test_another_installations_old_ledger_is_refused_before_it_is_migrated(
    ledger: Ledger, state_dir: Path
) -> None:
    ledger.close()
    as_schema_one(state_dir)
    with pytest.raises(HostError) as refused:
        open_ledger(str(state_dir), "f" * 32)
    assert refused.value.code == "ledger_installation_mismatch"
    db = sqlite3.connect(state_dir / LEDGER_FILE)
    try:
        assert db.execute("SELECT schema_version FROM meta").fetchone() == (1,)
    finally:
        db.close()


def test_a_ledger_written_by_a_newer_release_is_refused_as_such(
    ledger: Ledger, state_dir: Path
) -> None:
    ledger.close()
    db = raw_path(state_dir)
    db.execute("UPDATE meta SET schema_version = 99")
    db.commit()
    db.close()
    with pytest.raises(HostError) as refused:
        open_ledger(str(state_dir), INSTALLATION)
    assert refused.value.code == "ledger_schema"
    assert "newer release" in refused.value.message


def test_a_ledger_of_another_admission_version_is_refused_and_kept(
    ledger: Ledger, state_dir: Path
) -> None:
    ledger.close()
    db = raw_path(state_dir)
    db.execute("DROP TRIGGER identity_fixed")  # as a foreign release might have it
    db.execute("UPDATE meta SET admission_version = 99")
    db.commit()
    db.close()
    with pytest.raises(HostError) as refused:
        open_ledger(str(state_dir), INSTALLATION)
    assert refused.value.code == "ledger_schema"
    assert "admission version 99" in refused.value.message
    assert "Do not delete it" in refused.value.message
    assert (state_dir / LEDGER_FILE).exists()
