"""Provider failures through the real daemon: a failed probe, a hung start or observe.

The test provider fails or hangs when the plan's payload environment asks it to
(`FICC_TEST_PROVIDER_PROBE=fail`, `FICC_TEST_PROVIDER_HANG=<method>:<seconds>`). A
hang is bounded (the provider's thread must end for the daemon to exit), and the
daemon's `provider_timeout_seconds` is set far below it, so the host gives up on the
call while the provider is still in it: exactly the uncertainty of a hung provider.
"""

from __future__ import annotations

import signal
import subprocess
from typing import Any

import msgspec
import psutil
import pytest

from ficc.execution.plan import Plan
from ficc.execution.wire import Usage
from ficc_testkit.daemons import DaemonProcess
from ficc_testkit.driver import attempt, rows
from ficc_testkit.host import Daemon
from ficc_testkit.plans import with_environment
from ficc_testkit.waits import wait_for

TIMEOUT_S = 2
HANG_S = 3 * TIMEOUT_S
SETTLED = {"succeeded", "failed", "cancelled", "expired", "unknown"}
FAST_PROVIDER_TIMEOUT = pytest.mark.parametrize(
    "layout", [{"provider_timeout_seconds": TIMEOUT_S}], indirect=True
)


def free_slots(daemon: Daemon) -> int:
    (small,) = [c for c in daemon.snapshot().capacity.slot_classes if c.class_ == "small"]
    return int(small.free)


def slot_processes(daemon: Daemon, slot: str) -> list[str]:
    uid = int(daemon.accounts[f"slot{slot[-1]}"].uid)
    return [
        f"{p.pid} {p.info['cmdline']}"
        for p in psutil.process_iter(["uids", "cmdline", "status"])
        if p.info["uids"].real == uid and p.info["status"] != psutil.STATUS_ZOMBIE
    ]


def settled_clean(daemon: Daemon, plan: Plan) -> Any:
    return daemon.wait_state(
        plan, lambda r: r.state in SETTLED and r.cleanup_confirmed, "settled, confirmed clean"
    )


def test_a_failed_probe_keeps_its_record_and_reservation_until_release(daemon: Daemon) -> None:
    plan = with_environment(daemon.plan(), FICC_TEST_PROVIDER_PROBE="fail")
    (row,) = rows(daemon.prepare([plan]))
    slot = attempt(row).slot
    assert slot is not None
    failed = settled_clean(daemon, plan)
    assert (failed.state, failed.outcome, failed.reason) == ("failed", "failed", "probe_failed")
    assert daemon.layout.provider_calls("prepare", plan.attempt_id) == 0
    # the failed attempt still holds its reservation: one of the two slots is free, and
    # of a second and a third plan only one is admitted
    assert failed.slot == slot
    assert free_slots(daemon) == 1
    second, third = daemon.plan(), daemon.plan()
    admitted, refused = rows(daemon.prepare([second, third]))
    assert attempt(admitted).state == "prepared"
    assert refused.error.code == "admission_rejected"
    assert "attempts: 2 reserved + 1 asked > 2 offered" in refused.error.message
    # explicit release frees it and keeps the failed outcome and its reason
    released = attempt(daemon.release(plan))
    assert (released.state, released.outcome, released.reason, released.slot) == (
        "released",
        "failed",
        "probe_failed",
        None,
    )
    assert attempt(daemon.observe(plan)).state == "released"  # the record stays
    assert daemon.layout.provider_calls("release", plan.attempt_id) == 1


def hung(daemon: Daemon, method: str) -> Plan:
    """A ready attempt whose provider hangs in `method`, then a start of it."""
    plan = with_environment(daemon.plan(), FICC_TEST_PROVIDER_HANG=f"{method}:{HANG_S}")
    rows(daemon.prepare([plan]))
    ready = daemon.wait_state(plan, lambda r: r.ready or r.state != "prepared", "readiness")
    assert (ready.state, ready.ready) == ("prepared", True), ready
    assert attempt(daemon.start_attempt(plan)).state == "starting"
    return plan


@FAST_PROVIDER_TIMEOUT
@pytest.mark.parametrize("method", ["start", "observe"])
def test_a_provider_hung_in_start_or_observe_ends_stopped_and_unknown(
    daemon: Daemon, method: str
) -> None:
    plan = hung(daemon, method)
    ended = settled_clean(daemon, plan)
    assert (ended.state, ended.outcome, ended.reason) == ("unknown", "unknown", "provider_timeout")
    calls = daemon.layout.provider_calls
    wait_for(lambda: calls("stop", plan.attempt_id) >= 1, "the provider's stop call")
    assert ended.slot is not None
    assert slot_processes(daemon, ended.slot) == []  # the service was stopped
    # a repeated start is an idempotent reply: the provider never starts it again
    again = attempt(daemon.start_attempt(plan))
    assert (again.state, again.outcome) == ("unknown", "unknown")
    released = attempt(daemon.release(plan))
    assert (released.state, released.outcome) == ("released", "unknown")
    assert calls("start", plan.attempt_id) == 1


def _orphan_of(daemon: Daemon, plan: Plan) -> int:
    """The PID of the process the test provider left behind (FICC_TEST_PROVIDER_ORPHAN)."""
    slot = attempt(daemon.observe(plan)).slot
    assert slot is not None
    storage = daemon.layout.slot_paths[int(slot[-1])] / "ficc" / plan.attempt_id / "storage"
    return int((storage / "orphan.pid").read_text())


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_cleanup_kills_what_a_provider_left_of_the_slot_account(daemon: Daemon) -> None:
    """A process of the slot account outside any service (a rootless Podman pause
    process, a provider command orphaned by a daemon that died) would keep the slot
    from ever being confirmed clean: cleanup kills it, then confirms."""
    plan = with_environment(daemon.plan(), FICC_TEST_PROVIDER_ORPHAN="1")
    rows(daemon.prepare([plan]))
    daemon.wait_state(plan, lambda r: r.ready, "readiness")
    orphan = _orphan_of(daemon, plan)
    assert not _gone(orphan)
    assert attempt(daemon.stop_attempt(plan)).state == "cancelled"
    clean = settled_clean(daemon, plan)
    assert clean.reason == "stopped"
    assert _gone(orphan)
    assert attempt(daemon.release(plan)).state == "released"


@pytest.mark.parametrize("restarted", [True, False], ids=["next-daemon", "same-daemon"])
def test_release_kills_what_appeared_of_the_slot_account_after_cleanup(
    daemon: Daemon, restarted: bool
) -> None:
    """Cleanup confirmed, then a process of the slot account appears before release
    (what a provider command of a daemon killed in the middle of a release leaves, or
    anything else run as that account): release kills it before it calls the
    provider, and frees the slot, whether the daemon was restarted in between or not."""
    plan = daemon.plan()
    rows(daemon.prepare([plan]))
    daemon.wait_state(plan, lambda r: r.ready, "readiness")
    daemon.stop_attempt(plan)
    slot = settled_clean(daemon, plan).slot
    assert slot is not None
    if restarted:
        daemon.process.kill()
        daemon.process = DaemonProcess.of(daemon.layout, daemon.provider)
        daemon.start()
    account = daemon.accounts[f"slot{slot[-1]}"]
    stray = subprocess.Popen(
        ["/bin/sleep", "3600"], user=int(account.uid), group=int(account.gid),
        extra_groups=[], start_new_session=True, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        assert attempt(daemon.release(plan)).state == "released"
        assert stray.wait(timeout=10) == -signal.SIGKILL
    finally:
        if stray.poll() is None:
            stray.kill()
            stray.wait()


def test_a_runtime_that_fails_before_the_release_is_heard_in_the_daemons_log(
    daemon: Daemon,
) -> None:
    """A start that fails before the payload runs logs what the runtime printed, at
    error priority with the attempt's ID: release deletes the attempt's stderr, and
    `barrier_exited` alone does not say why."""
    plan = with_environment(daemon.plan(), FICC_TEST_PROVIDER_HOLD="fail")
    rows(daemon.prepare([plan]))
    ready = daemon.wait_state(plan, lambda r: r.ready or r.state != "prepared", "readiness")
    assert (ready.state, ready.ready) == ("prepared", True), ready
    attempt(daemon.start_attempt(plan))
    done = settled_clean(daemon, plan)
    assert (done.state, done.reason) == ("failed", "barrier_exited"), done
    runtime_said = (
        "ficc-test-barrier: preparing the runtime\n"
        "ficc-test-barrier: OCI runtime error: the runtime refused to create the container"
    )
    # the controller can show it too: on the row, when it asks for the detail
    assert attempt(daemon.observe(plan, detail=True)).detail == runtime_said
    assert attempt(daemon.observe(plan)).detail is msgspec.UNSET
    daemon.release(plan)

    said = [line for line in daemon.process.events() if line.get("event") == "runtime_error"]
    assert len(said) == 1, said
    (line,) = said
    assert (line["level"], line["attempt_id"], line["code"]) == (
        "error", plan.attempt_id, "barrier_exited",
    )  # fmt: skip
    assert line["runtime_stderr"] == runtime_said
    assert "OCI runtime error" in line["message"]


def test_a_runtime_killed_for_memory_before_the_release_is_memory_exhausted(
    daemon: Daemon,
) -> None:
    """The barrier (standing in for a runtime given too little memory for itself) grows
    until the kernel's out-of-memory killer kills it, before the release: the attempt
    ends `memory_exhausted`, not `barrier_exited`, and its detail, its log event and its
    usage say why, so nobody has to connect a bare `Killed` with an OOM count."""
    plan = with_environment(daemon.plan(memory_bytes=64 << 20), FICC_TEST_PROVIDER_HOLD="oom")
    rows(daemon.prepare([plan]))
    ready = daemon.wait_state(plan, lambda r: r.ready or r.state != "prepared", "readiness")
    assert (ready.state, ready.ready) == ("prepared", True), ready
    attempt(daemon.start_attempt(plan))
    done = settled_clean(daemon, plan)
    assert (done.state, done.reason, done.exit_code) == ("failed", "memory_exhausted", None), done
    detail = attempt(daemon.observe(plan, detail=True)).detail
    assert isinstance(detail, str), detail
    assert detail.startswith("the kernel's out-of-memory killer killed 1 process(es)"), detail
    assert "(barrier_exited: the barrier exited before release" in detail, detail
    assert f"memory_bytes {64 << 20} is too small for the provider's runtime itself" in detail
    assert "the runtime printed: ficc-test-barrier: starting the runtime" in detail, detail
    used = attempt(daemon.observe(plan, usage=True)).usage
    assert isinstance(used, Usage), used
    assert (used.final, used.oom_kills) == (True, 1), used
    daemon.release(plan)
    said = [line for line in daemon.process.events() if line.get("event") == "runtime_error"]
    assert [(line["attempt_id"], line["code"]) for line in said] == [
        (plan.attempt_id, "memory_exhausted")
    ], said
