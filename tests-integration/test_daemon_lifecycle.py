"""One attempt through the real daemon and the test provider, up to the gate's refusal;
stop; reject_absent and reconcile_absent exactly as docs/protocol.md says.

The test provider's runtime is a plain process (no namespaces, no seccomp, the wrong
account), so the payload gate must refuse it: the attempt fails with a `gate_*` reason,
the release marker is never written, and cleanup is confirmed before release.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import psutil

from ficc.execution.protocol import encode_request
from ficc.execution.wire import TERMINAL
from ficc_testkit import tamper
from ficc_testkit.driver import attempt, error_code, row_code, rows
from ficc_testkit.host import Daemon


def slot_uid(daemon: Daemon, slot: str) -> int:
    return int(daemon.accounts[f"slot{slot[-1]}"].uid)


def processes_of(uid: int) -> list[str]:
    """`pid cmdline` of every live (not zombie) process of the account."""
    found = []
    for process in psutil.process_iter(["uids", "cmdline", "status"]):
        if process.info["uids"].real == uid and process.info["status"] != psutil.STATUS_ZOMBIE:
            found.append(f"{process.pid} {process.info['cmdline']}")
    return found


def test_the_gate_refuses_the_unconfined_test_runtime(daemon: Daemon) -> None:
    plan = daemon.plan()
    (row,) = rows(daemon.prepare([plan]))
    slot = attempt(row).slot
    assert slot is not None
    ready = daemon.wait_state(plan, lambda r: r.ready or r.state != "prepared", "readiness")
    assert (ready.state, ready.ready) == ("prepared", True), ready

    started = attempt(daemon.start_attempt(plan))
    assert started.state in {"starting", "running", "failed"}
    ended = daemon.wait_state(plan, lambda r: r.state in TERMINAL, "a terminal state")
    assert ended.state == "failed", ended
    assert ended.outcome == "failed"
    assert ended.reason is not None
    assert ended.reason.startswith("gate_"), ended.reason
    # evidence was written before the gate decided
    slot_path = Path(daemon.layout.document["slots"][int(slot[-1])]["path"])
    assert list(slot_path.rglob("gate-evidence.json")), "no gate evidence in the attempt layout"
    # and the release marker was never written: the payload was never let go
    control = slot_path / "ficc" / plan.attempt_id / "control"
    assert control.is_dir()
    assert list(control.iterdir()) == []

    # a second start never starts twice
    again = daemon.start_attempt(plan)
    assert row_code(again) is not None or attempt(again).state == "failed"
    assert daemon.layout.provider_calls("start", plan.attempt_id) <= 1

    cleaned = daemon.wait_state(plan, lambda r: r.cleanup_confirmed, "confirmed cleanup")
    assert cleaned.state == "failed"
    assert processes_of(slot_uid(daemon, slot)) == []
    released = attempt(daemon.release(plan))
    assert (released.state, released.outcome, released.slot) == ("released", "failed", None)
    assert released.reason == ended.reason
    free = {c.class_: c.free for c in daemon.snapshot().capacity.slot_classes}
    assert free == {"small": 2}


def test_a_limit_raised_after_the_service_was_made_is_refused_by_the_gate(
    daemon: Daemon,
) -> None:
    """The host reads the service's limits back when it makes the service, and the gate
    reads them again before the payload is let go. While the provider's start is held,
    root raises the service's pids.max behind the host's back: the attempt fails
    `gate_limits` (named first, whatever else the gate refuses), the release marker is
    never written, and cleanup is confirmed."""
    raised = tamper.raise_a_limit_while_start_is_held(daemon)
    assert (raised.ended.state, raised.ended.reason) == ("failed", "gate_limits"), raised.ended
    assert list((raised.attempt_dir / "control").iterdir()) == []
    cleaned = daemon.wait_state(raised.plan, lambda r: r.cleanup_confirmed, "confirmed cleanup")
    assert (cleaned.state, cleaned.slot is not None) == ("failed", True), cleaned
    assert processes_of(slot_uid(daemon, str(cleaned.slot))) == []


def test_release_before_the_end_is_refused(daemon: Daemon) -> None:
    plan = daemon.plan()
    rows(daemon.prepare([plan]))
    assert row_code(daemon.release(plan)) in {"not_terminal", "cleanup_unconfirmed"}
    assert attempt(daemon.observe(plan)).state == "prepared"


def test_a_stopped_prepared_attempt_is_cancelled_and_releasable(daemon: Daemon) -> None:
    plan = daemon.plan()
    rows(daemon.prepare([plan]))
    daemon.wait_state(plan, lambda r: r.ready or r.state != "prepared", "readiness")
    daemon.stop_attempt(plan)
    done = daemon.wait_state(plan, lambda r: r.state in TERMINAL and r.cleanup_confirmed, "stop")
    assert (done.state, done.outcome) == ("cancelled", "cancelled")
    released = attempt(daemon.release(plan))
    assert (released.state, released.outcome) == ("released", "cancelled")


# --- reject_absent ----------------------------------------------------------------------------


def test_reject_absent_records_a_rejection_that_can_never_run(daemon: Daemon) -> None:
    plan = daemon.plan()
    (row,) = rows(daemon.reject_absent([plan]))
    record = attempt(row)
    assert (record.state, record.outcome, record.reason) == (
        "failed",
        "failed",
        "admission_rejected",
    )
    assert (record.slot, record.cleanup_confirmed, record.lease_sequence) == (None, True, 0)
    (again,) = rows(daemon.prepare([plan]))  # a later prepare gets the rejection back
    assert attempt(again).state == "failed"
    assert row_code(daemon.start_attempt(plan)) == "admission_rejected"  # never runnable
    assert daemon.layout.provider_calls("start", plan.attempt_id) == 0
    assert daemon.layout.provider_calls("probe", plan.attempt_id) == 0
    released = attempt(daemon.release(plan))
    assert (released.state, released.outcome) == ("released", "failed")


def test_reject_absent_returns_an_existing_attempt_as_it_is(daemon: Daemon) -> None:
    plan = daemon.plan()
    rows(daemon.prepare([plan]))
    (row,) = rows(daemon.reject_absent([plan]))
    assert attempt(row).state == "prepared"
    assert attempt(daemon.observe(plan)).state == "prepared"


def test_reject_absent_refuses_another_fence_and_a_conflicting_generation(
    daemon: Daemon,
) -> None:
    job = "7" * 32
    admitted = daemon.plan(job_id=job, generation=2)
    rows(daemon.prepare([admitted]))
    other_fence = daemon.plan(attempt_id=admitted.attempt_id, job_id=job, generation=2,
                              memory_bytes=32 * 1024 * 1024)  # fmt: skip
    lower = daemon.plan(job_id=job, generation=1)
    first, second = rows(daemon.reject_absent([other_fence, lower]))
    assert row_code(first) == "fence_mismatch"
    assert row_code(second) == "generation_conflict"
    assert [a.attempt_id for a in daemon.snapshot().attempts] == [admitted.attempt_id]


# --- reconcile_absent ---------------------------------------------------------------------------


def request_command(daemon: Daemon, payload: bytes) -> subprocess.CompletedProcess[bytes]:
    """`python -m ficc.execution request --socket admin.sock`, as the administrator would."""
    return subprocess.run(
        [sys.executable, "-m", "ficc.execution", "request", "--socket", daemon.admin],
        input=payload,
        capture_output=True,
        check=False,
        timeout=120,
    )


def test_reconcile_absent_acknowledges_a_missing_attempt_as_unknown(daemon: Daemon) -> None:
    rejected = daemon.plan()
    rows(daemon.reject_absent([rejected]))
    missing = daemon.plan()
    request = daemon.reconcile_request([missing, rejected])
    result = request_command(daemon, encode_request(request))
    assert result.returncode == 0, result.stderr.decode()
    reply = json.loads(result.stdout)
    first, second = reply["results"]
    assert (first["state"], first["outcome"], first["reason"]) == (
        "unknown",
        "unknown",
        "legacy_absence_acknowledged",
    )
    assert (first["slot"], first["cleanup_confirmed"]) == (None, True)
    assert (second["state"], second["reason"]) == ("failed", "admission_rejected")  # unchanged
    released = attempt(daemon.release(missing))
    assert (released.state, released.outcome) == ("released", "unknown")


def test_reconcile_absent_is_refused_while_a_reservation_is_held(daemon: Daemon) -> None:
    rows(daemon.prepare([daemon.plan()]))
    missing = daemon.plan()
    result = request_command(daemon, encode_request(daemon.reconcile_request([missing])))
    assert result.returncode == 1
    assert b"reconcile_refused" in result.stderr
    assert row_code(daemon.observe(missing)) == "unknown_attempt"


def test_reconcile_absent_is_for_the_administrator_only(daemon: Daemon) -> None:
    request = daemon.reconcile_request([daemon.plan()])
    assert error_code(daemon.as_transport(request)) == "not_authorized"
    assert error_code(daemon.as_owner(request)) == "not_authorized"
    assert daemon.snapshot().attempts == []


def test_reconcile_absent_needs_the_current_bindings(daemon: Daemon) -> None:
    wrong = dict(daemon.bindings(), ledger_id="e" * 32)
    request = daemon.reconcile_request([daemon.plan()], bindings=wrong)
    assert error_code(daemon.as_admin(request)) == "bindings_changed"
    assert daemon.snapshot().attempts == []
