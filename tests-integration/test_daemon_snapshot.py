"""Snapshots: bindings, bounds, capacity, paging over 200 attempts, and `status`."""

from __future__ import annotations

import re
import subprocess
import sys
from importlib import metadata

from ficc.execution.protocol import SnapshotRequest
from ficc.execution.wire import AttemptStatus, SnapshotReply
from ficc_testkit.driver import attempt, rows
from ficc_testkit.host import Daemon
from ficc_testkit.units import MIB


def test_a_new_ledger_reports_its_bindings_and_bounds(daemon: Daemon) -> None:
    snap = daemon.snapshot()
    assert snap.installation_id == daemon.layout.installation_id
    assert snap.ledger_id is not None
    assert re.fullmatch(r"[0-9a-f]{32}", snap.ledger_id)
    assert snap.admission_version == 1
    assert snap.maximum_lease_seconds == 600
    assert snap.input_chunk_bytes == 8 * MIB
    assert snap.bindings() == {
        "installation_id": daemon.layout.installation_id,
        "ledger_id": snap.ledger_id,
        "admission_version": 1,
    }
    assert snap.offer.revision == 1
    assert snap.offer.control == "active"
    assert [(c.class_, c.total, c.free) for c in snap.capacity.slot_classes] == [("small", 2, 2)]
    (provider,) = snap.capacity.providers
    assert (provider.id, provider.package_digest, provider.available) == (
        "test",
        daemon.provider.digest,
        True,
    )
    assert snap.attempts == []
    assert snap.next is None


def test_every_socket_may_read_the_same_snapshot(daemon: Daemon) -> None:
    admin = daemon.snapshot()
    for reply in (
        daemon.as_transport(SnapshotRequest(version=1, id="a" * 32)),
        daemon.as_owner(SnapshotRequest(version=1, id="b" * 32)),
    ):
        assert isinstance(reply, SnapshotReply)
        assert reply.bindings() == admin.bindings()


def test_paging_over_200_attempts_visits_each_once_in_id_order(daemon: Daemon) -> None:
    plans = [daemon.plan() for _ in range(200)]
    for start in range(0, 200, 64):
        batch = plans[start : start + 64]
        results = rows(daemon.reject_absent(batch))
        assert [attempt(r).attempt_id for r in results] == [p.attempt_id for p in batch]
    seen: list[AttemptStatus] = []
    pages = 0
    after = None
    while True:
        page = daemon.snapshot(after)
        pages += 1
        assert len(page.attempts) <= 64
        seen += page.attempts
        if page.next is None:
            break
        assert page.next == page.attempts[-1].attempt_id
        after = page.next
    assert [a.attempt_id for a in seen] == sorted(p.attempt_id for p in plans)
    assert pages == 4  # 64 + 64 + 64 + 8
    for record in seen:
        assert (record.state, record.outcome, record.reason) == (
            "failed",
            "failed",
            "admission_rejected",
        )
        assert (record.slot, record.cleanup_confirmed) == (None, True)


def test_status_prints_the_table_through_the_admin_socket(daemon: Daemon) -> None:
    plans = [daemon.plan() for _ in range(3)]
    rows(daemon.reject_absent(plans))
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "ficc.execution",
            "status",
            "--config",
            str(daemon.layout.config_path),
        ],
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    running = metadata.version("ficc-executor-host")
    assert lines[0].startswith(f"daemon         {running}   started ")
    assert lines[1].startswith("  tasks        ")  # process events, or why it walks
    assert f"installation   {daemon.layout.installation_id}" in lines
    assert "offer          revision 1   control active" in lines
    assert "attempts       3   live (not released)" in lines
    for plan in plans:
        (line,) = [line for line in lines if line.startswith(plan.attempt_id)]
        assert line.split()[2:7] == ["1", "failed", "-", "failed", "admission_rejected"]
