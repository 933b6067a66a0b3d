"""A daemon restart keeps every record and the ledger identity, and replays nothing."""

from __future__ import annotations

import pytest

from ficc.execution.protocol import SnapshotRequest
from ficc_testkit.daemons import DaemonFailed, DaemonProcess
from ficc_testkit.driver import attempt, error_code, rows
from ficc_testkit.host import Daemon


def test_sigterm_then_start_keeps_the_ledger_and_its_attempts(daemon: Daemon) -> None:
    prepared = daemon.plan()
    rows(daemon.prepare([prepared]))
    ready = daemon.wait_state(prepared, lambda r: r.ready or r.state != "prepared", "readiness")
    assert (ready.state, ready.ready) == ("prepared", True), ready
    rejected = [daemon.plan() for _ in range(3)]
    rows(daemon.reject_absent(rejected))
    before = daemon.snapshot()

    daemon.restart()

    after = daemon.snapshot()
    assert after.bindings() == before.bindings()
    assert [a.attempt_id for a in after.attempts] == [a.attempt_id for a in before.attempts]
    by_id = {a.attempt_id: a for a in after.attempts}
    for plan in rejected:
        record = by_id[plan.attempt_id]
        assert (record.state, record.reason, record.slot) == ("failed", "admission_rejected", None)
    kept = by_id[prepared.attempt_id]
    # a prepared attempt stays prepared (or became unknown); it never ran
    assert kept.state in {"prepared", "unknown"}, kept
    assert kept.exit_code is None
    assert daemon.layout.provider_calls("start", prepared.attempt_id) == 0
    # the same transport can go on with the same bindings
    (row,) = rows(daemon.prepare([prepared], bindings=before.bindings()))
    assert attempt(row).attempt_id == prepared.attempt_id
    assert error_code(daemon.as_owner(SnapshotRequest(version=1, id="d" * 32))) is None


def test_a_second_daemon_on_the_same_sockets_is_refused(daemon: Daemon) -> None:
    """Two daemons must never share a ledger or a socket: the second refuses to start."""
    second = DaemonProcess.of(daemon.layout, daemon.provider)
    second.notify_path = daemon.layout.base / "notify-second.sock"
    with pytest.raises(DaemonFailed) as failed:
        second.start()
    second.stop()  # only if it did start, so the assertion below names the problem
    message = str(failed.value)
    assert "socket_in_use" in message or "ledger" in message, message
    assert second.process is not None
    assert second.process.returncode == 1
    assert daemon.process.alive
    daemon.snapshot()


def test_the_initial_offer_counts_only_when_the_ledger_is_created(daemon: Daemon) -> None:
    """docs/configuration.md, "When `initial_offer` counts": the first start writes the
    offer into the ledger; a changed `initial_offer` and a restart change nothing (only
    `set_offer` does), so a `paused` example stays as the ledger has it."""
    before = daemon.snapshot().offer
    assert before.control == "active"
    document = daemon.layout.document
    document["initial_offer"] = {**document["initial_offer"], "control": "paused",
                                 "cpu_millis": 1000}  # fmt: skip
    daemon.layout.rewrite(document)
    daemon.restart()
    assert daemon.snapshot().offer == before  # the same control, limits and revision
