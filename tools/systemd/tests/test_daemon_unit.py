"""The daemon as the systemd service it ships as, under a real systemd (PID 1).

Runs inside the container of `tools/systemd/run.py` (it skips elsewhere, saying why):
the shipped unit file (packages/ficc-executor-host/packaging) is installed as is, with
a drop-in that only points it at this test's configuration and provider and shortens
the watchdog and restart timings. The configuration, accounts and pinned test provider
come from the test kit (ficc_testkit.host, as the integration suite's), so the daemon is
the real one: `systemctl start` returns only after its READY=1, it pings the watchdog, a
hung daemon is killed by the watchdog and restarted, and `systemctl stop` stops it
cleanly.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

PROVIDER_WHEELS = Path(os.environ.get("FICC_WHEELS", "/opt/ficc/wheels"))
CRASH_TESTS = Path(
    os.environ.get("FICC_CRASH_TESTS", "/opt/ficc/tests-integration/test_crash_daemon.py")
)
"""The integration suite's crash loop (run.py copies it in), reused under systemd."""


def _pid1_is_systemd() -> bool:
    try:
        return Path("/proc/1/comm").read_text().strip() == "systemd"
    except OSError:
        return False


if not (os.geteuid() == 0 and _pid1_is_systemd() and PROVIDER_WHEELS.is_dir()):
    pytest.skip(
        "needs root, systemd as PID 1 and the test provider's wheel; run "
        "`python tools/systemd/run.py`, which runs this inside a systemd container",
        allow_module_level=True,
    )

import msgspec  # noqa: E402

from ficc.execution.host.core.errors import HostError  # noqa: E402
from ficc.execution.host.daemon import root as daemon  # noqa: E402
from ficc.execution.host.service import cgroups, reaper  # noqa: E402
from ficc.execution.host.service.interface import ServiceLimits, ServiceSpec  # noqa: E402
from ficc.execution.host.service.systemd import SystemdService  # noqa: E402
from ficc.execution.plan import Payload, Plan  # noqa: E402
from ficc_testkit import tamper  # noqa: E402
from ficc_testkit.accounts import Accounts  # noqa: E402
from ficc_testkit.daemons import SYSTEMCTL, UnitDaemon, show_unit  # noqa: E402
from ficc_testkit.driver import attempt, rows  # noqa: E402
from ficc_testkit.host import Daemon, Layout, ensure_accounts  # noqa: E402
from ficc_testkit.podman import WORLD_PARENT  # noqa: E402
from ficc_testkit.slots import private_directory  # noqa: E402
from ficc_testkit.unit import UNIT  # noqa: E402
from ficc_testkit.waits import now_ms, wait_for  # noqa: E402
from ficc_testkit.wheels import InstalledProvider, install_provider  # noqa: E402


def show(*keys: str) -> dict[str, str]:
    return show_unit(UNIT, *keys)


def journal() -> str:
    argv = ["journalctl", "-u", UNIT, "-u", "ficc-work-*", "-u", "ficc-lease-reaper-*"]
    argv += ["--no-pager", "-n", "80"]
    return subprocess.run(argv, capture_output=True, text=True, check=False).stdout


def reaper_unit(installation_id: str) -> str:
    """The lease reaper's unit of an installation (supervisor=systemd)."""
    return f"ficc-lease-reaper-{installation_id}.service"


@dataclass
class Installed:
    layout: Layout
    provider: InstalledProvider
    accounts: Accounts
    unit: UnitDaemon


def _systemd_backend_wired() -> bool:
    """Whether this daemon build can run with supervisor=systemd (daemon/root.py wiring)."""
    try:
        daemon.service_backend("systemd")
    except HostError as error:
        return error.code != "supervisor_unsupported"
    return True


@contextlib.contextmanager
def _install(supervisor: str, dropin: str) -> Iterator[Installed]:
    accounts = ensure_accounts()
    base = private_directory(WORLD_PARENT, "ficc-it-unit-")
    unit: UnitDaemon | None = None
    try:
        (wheel,) = PROVIDER_WHEELS.glob("ficc_test_provider-*.whl")
        provider = install_provider(wheel, base / "provider")
        layout = Layout.create(base, accounts, provider, supervisor=supervisor)
        unit = UnitDaemon(layout, provider, dropin=dropin)
        yield Installed(layout, provider, accounts, unit)
    finally:
        if unit is not None:
            unit.uninstall()
            # The lease reaper's unit outlives the daemon's by design (until its
            # deadlines are gone); this test's is stopped with the rest.
            lease_reaper = reaper_unit(unit.layout.installation_id)
            subprocess.run([SYSTEMCTL, "stop", lease_reaper], capture_output=True, check=False)
        shutil.rmtree(base, ignore_errors=True)
        accounts.remove()


@pytest.fixture(params=["cgroupfs", "systemd"])
def installed(request: pytest.FixtureRequest) -> Iterator[Installed]:
    """The shipped unit plus a drop-in for this test's configuration and provider
    (UnitDaemon), with each supervisor (the daemon's system-service backend)."""
    if request.param == "systemd" and not _systemd_backend_wired():
        pytest.skip("daemon.service_backend does not offer supervisor=systemd yet")
    with _install(request.param, "WatchdogSec=3s\nTimeoutStopSec=10s\n") as done:
        yield done


@pytest.fixture
def slow_watchdog() -> Iterator[Installed]:
    """supervisor=systemd with a watchdog far longer than a lease: a hung daemon is
    not restarted by systemd before the lease deadline, so only the lease reaper can
    stop its work in time. The crash loop restarts it far more often than the shipped
    start limit (5 in 10 minutes) allows, so the limit is off here."""
    dropin = "WatchdogSec=300s\nTimeoutStopSec=10s\n[Unit]\nStartLimitIntervalSec=0\n"
    with _install("systemd", dropin) as done:
        yield done


def test_start_returns_after_ready_and_the_watchdog_is_fed(installed: Installed) -> None:
    started = subprocess.run([SYSTEMCTL, "start", UNIT], capture_output=True, check=False)
    assert started.returncode == 0, journal()
    state = show("ActiveState", "SubState", "Type", "WatchdogUSec", "StatusText")
    assert (state["ActiveState"], state["SubState"], state["Type"]) == (
        "active",
        "running",
        "notify",
    )
    assert state["WatchdogUSec"] == "3s"
    assert state["StatusText"]
    assert Path(installed.layout.socket("admin")).exists()  # READY=1 came after the sockets
    # Each WATCHDOG=1 moves the timestamp; two moves prove periodic pings (every 1.5 s).
    first = show("WatchdogTimestampMonotonic")["WatchdogTimestampMonotonic"]
    second = wait_for(
        lambda: (
            (v := show("WatchdogTimestampMonotonic")["WatchdogTimestampMonotonic"]) != first and v
        )
    )
    wait_for(lambda: show("WatchdogTimestampMonotonic")["WatchdogTimestampMonotonic"] != second)
    assert show("ActiveState")["ActiveState"] == "active"
    subprocess.run([SYSTEMCTL, "stop", UNIT], check=True)
    assert show("ActiveState", "Result") == {"ActiveState": "inactive", "Result": "success"}


def test_a_hung_daemon_is_killed_by_the_watchdog_and_restarted(installed: Installed) -> None:
    subprocess.run([SYSTEMCTL, "start", UNIT], check=True)
    hung = int(show("MainPID")["MainPID"])
    os.kill(hung, signal.SIGSTOP)  # alive but silent: no more WATCHDOG=1
    wait_for(lambda: int(show("NRestarts")["NRestarts"]) >= 1)
    wait_for(
        lambda: show("ActiveState", "SubState") == {"ActiveState": "active", "SubState": "running"}
    )
    assert int(show("MainPID")["MainPID"]) not in {0, hung}
    assert not Path(f"/proc/{hung}").exists()
    subprocess.run([SYSTEMCTL, "stop", UNIT], check=True)


def test_an_attempt_runs_in_a_transient_unit_of_the_daemon(installed: Installed) -> None:
    """One attempt through the daemon under systemd, up to the payload gate's refusal
    of the unconfined test runtime (as in tests-integration/test_daemon_lifecycle.py):
    with supervisor=systemd the attempt's service is the unit
    ficc-work-<installation>-<attempt>.service, started and stopped by the daemon."""
    if installed.layout.document["supervisor"] != "systemd":
        pytest.skip("this test is about the systemd supervisor")
    subprocess.run([SYSTEMCTL, "start", UNIT], check=True)
    daemon = Daemon(installed.layout, installed.provider, installed.accounts)
    plan = daemon.plan()
    rows(daemon.prepare([plan]))
    ready = daemon.wait_state(plan, lambda r: r.ready or r.state != "prepared", "readiness")
    assert (ready.state, ready.ready) == ("prepared", True), ready
    daemon.start_attempt(plan)
    ended = daemon.wait_state(plan, lambda r: r.state in {"failed", "unknown"}, "the end")
    assert ended.state == "failed", ended
    assert ended.reason is not None
    if not ended.reason.startswith("gate_"):
        print(journal())  # shown by pytest with the failure
    assert ended.reason.startswith("gate_"), ended.reason
    work = f"ficc-work-{installed.layout.installation_id}-{plan.attempt_id}.service"
    log = subprocess.run(
        ["journalctl", "-u", work, "--no-pager", "-o", "cat"],
        capture_output=True,
        text=True,
        check=False,
    ).stdout
    assert "Started" in log, log
    daemon.wait_state(plan, lambda r: r.cleanup_confirmed, "confirmed cleanup")
    # Stopped and empty, kept (failed: it was killed) until release removes it.
    kept = show_unit(work, "BindsTo", "Slice", "ActiveState", "ControlGroup", "User")
    assert kept["BindsTo"] == UNIT
    assert kept["Slice"] == "ficc.slice"
    assert kept["ActiveState"] in {"failed", "inactive"}
    assert kept["User"] == str(installed.accounts["slot0"].uid) or kept["User"] == str(
        installed.accounts["slot1"].uid
    )
    released = attempt(daemon.release(plan))
    assert released.state == "released", released
    wait_for(lambda: show_unit(work, "LoadState")["LoadState"] == "not-found")
    subprocess.run([SYSTEMCTL, "stop", UNIT], check=True)


def test_a_daemon_restart_or_crash_stops_bound_work_and_never_restarts_it(
    installed: Installed, tmp_path: Path
) -> None:
    """BindsTo= the shipped unit: `systemctl restart` and a SIGKILL of the daemon (then
    Restart=on-failure) each stop the attempt's unit, and nothing starts it again."""
    if installed.layout.document["supervisor"] != "cgroupfs":
        pytest.skip("independent of the daemon's supervisor; runs once")
    subprocess.run([SYSTEMCTL, "start", UNIT], check=True)
    slot = installed.accounts["slot0"]
    backend = SystemdService(bind_to=UNIT)
    for index, disrupt in enumerate(
        ([SYSTEMCTL, "restart", UNIT], [SYSTEMCTL, "kill", "--signal=SIGKILL", UNIT])
    ):
        daemon_pid = show("MainPID")["MainPID"]
        name = f"ficc-work-t{os.getpid()}-bound-{index}"
        handle = backend.create(
            ServiceSpec(
                name=name,
                argv=["/bin/sleep", "1000"],
                uid=slot.uid,
                gid=slot.gid,
                cwd="/",
                environment={},
                limits=ServiceLimits(
                    cpu_millis=100, memory_bytes=32 << 20, swap_bytes=0, processes=8, nofile=64
                ),
                devices=[],
                stdout=str(tmp_path / f"{name}.out"),
                stderr=str(tmp_path / f"{name}.err"),
            )
        )
        assert backend.members(handle) == {handle.main_pid}
        subprocess.run(disrupt, check=True)
        wait_for(lambda handle=handle: backend.members(handle) == set())
        wait_for(
            lambda: (
                show("ActiveState", "SubState") == {"ActiveState": "active", "SubState": "running"}
            )
        )
        wait_for(lambda old=daemon_pid: show("MainPID")["MainPID"] not in {old, "0"})
        # stopped with the daemon, and not started again with the new one
        assert show_unit(f"{name}.service", "ActiveState")["ActiveState"] != "active"
        assert backend.members(handle) == set()
        backend.stop(handle)
        backend.remove(handle)
    assert int(show("NRestarts")["NRestarts"]) >= 1  # the SIGKILL was a crash: restarted
    subprocess.run([SYSTEMCTL, "stop", UNIT], check=True)


def test_a_limit_raised_behind_the_hosts_back_is_refused_by_the_gate(installed: Installed) -> None:
    """While the provider's start is held, root raises pids.max of the attempt's
    service (the unit's cgroup under supervisor=systemd, the host's own under cgroupfs;
    on a unified tree the v2 file): the gate reads the limits again from the service's
    cgroups and refuses `gate_limits`; the payload is never released."""
    if installed.layout.document["supervisor"] == "cgroupfs" and not _unified_tree():
        pytest.skip(
            "supervisor=cgroupfs under systemd on a hybrid tree cannot join systemd's own "
            "name=systemd hierarchy (service_start); the same check runs with cgroupfs "
            "without systemd in tests-integration, and on a unified tree in the VM lane"
        )
    subprocess.run([SYSTEMCTL, "start", UNIT], check=True)
    daemon = Daemon(installed.layout, installed.provider, installed.accounts)
    raised = tamper.raise_a_limit_while_start_is_held(daemon)
    assert (raised.ended.state, raised.ended.reason) == ("failed", "gate_limits"), raised.ended
    assert list((raised.attempt_dir / "control").iterdir()) == []
    plan = raised.plan
    daemon.wait_state(plan, lambda r: r.cleanup_confirmed, "confirmed cleanup")
    assert attempt(daemon.release(plan)).state == "released"
    assert not slot_processes(installed.accounts)
    subprocess.run([SYSTEMCTL, "stop", UNIT], check=True)


def _unified_tree() -> bool:
    """One cgroup v2 tree at /sys/fs/cgroup (no v1 hierarchy beside it)."""
    hierarchies = cgroups.parse_mountinfo(Path("/proc/self/mountinfo").read_text())
    return all(h.version == 2 for h in hierarchies)


def slot_processes(accounts: Accounts) -> list[str]:
    """Every live process of a slot account, as `pid uid name` (empty: none left)."""
    uids = {str(accounts["slot0"].uid), str(accounts["slot1"].uid)}
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            status = dict(
                line.split(":", 1) for line in (entry / "status").read_text().splitlines()
            )
        except (OSError, ValueError):
            continue  # exited meanwhile
        if status["Uid"].split()[0] in uids and status["State"].split()[0] != "Z":
            found.append(f"{entry.name} {status['Uid'].split()[0]} {status['Name'].strip()}")
    return found


def test_stopping_the_daemon_unit_stops_attempt_units_and_they_come_back_unknown(
    installed: Installed,
) -> None:
    """`systemctl stop` of the daemon's unit stops every attempt unit bound to it
    (BindsTo=; here one attempt in each of the two slots), and the next start reports
    each attempt `unknown` (executor_restarted) with its cleanup confirmed; the
    provider's `start` is never called again for either."""
    if installed.layout.document["supervisor"] != "systemd":
        pytest.skip("this test is about the systemd supervisor's attempt units")
    subprocess.run([SYSTEMCTL, "start", UNIT], check=True)
    daemon = Daemon(installed.layout, installed.provider, installed.accounts)
    held = Payload(argv=["/bin/true"], environment={"FICC_TEST_PROVIDER_HOLD": "1"})
    plans = [
        msgspec.structs.replace(plan, job=msgspec.structs.replace(plan.job, payload=held))
        for plan in (daemon.plan(), daemon.plan())
    ]
    rows(daemon.prepare(plans))
    works = []
    for plan in plans:
        ready = daemon.wait_state(plan, lambda r: r.ready or r.state != "prepared", "readiness")
        assert (ready.state, ready.ready) == ("prepared", True), ready
        attempt(daemon.start_attempt(plan))
        works.append(f"ficc-work-{installed.layout.installation_id}-{plan.attempt_id}.service")
    # Each barrier is held before it reports its PID: the attempts stay `starting` with
    # their units active and a process of each slot account alive inside them.
    for work in works:
        wait_for(lambda work=work: show_unit(work, "ActiveState")["ActiveState"] == "active")
        assert show_unit(work, "BindsTo")["BindsTo"] == UNIT
    # A unit (and its slot process) exists before the provider's start is called.
    for plan in plans:
        wait_for(lambda plan=plan: installed.layout.provider_calls("start", plan.attempt_id) == 1)
    wait_for(lambda: len({p.split()[1] for p in slot_processes(installed.accounts)}) == 2)
    assert [daemon.observe(plan).state for plan in plans] == ["starting"] * 2, journal()

    subprocess.run([SYSTEMCTL, "stop", UNIT], check=True)
    assert show("ActiveState")["ActiveState"] == "inactive"
    for work in works:
        wait_for(lambda work=work: show_unit(work, "ActiveState")["ActiveState"] != "active")
        assert show_unit(work, "ActiveState")["ActiveState"] in {"inactive", "failed"}
    wait_for(lambda: not slot_processes(installed.accounts))

    subprocess.run([SYSTEMCTL, "start", UNIT], check=True)
    for plan, work in zip(plans, works, strict=True):
        settled = daemon.wait_state(
            plan, lambda r: r.state not in {"starting", "running"}, "settled"
        )
        assert (settled.state, settled.reason) == ("unknown", "executor_restarted"), settled
        daemon.wait_state(plan, lambda r: r.cleanup_confirmed, "confirmed cleanup")
        assert show_unit(work, "ActiveState")["ActiveState"] != "active"
    assert not slot_processes(installed.accounts)
    for plan in plans:
        assert installed.layout.provider_calls("start", plan.attempt_id) == 1  # never replayed
        released = attempt(daemon.release(plan))
        assert released.state == "released", released
        assert installed.layout.provider_calls("start", plan.attempt_id) == 1
    subprocess.run([SYSTEMCTL, "stop", UNIT], check=True)


# --- the journal: priorities, and startup refusals from check-config ------------------------


def journal_records(since_us: int, *extra: str) -> list[dict[str, Any]]:
    """This unit's journal entries newer than `since_us` (`journalctl -o json`, after
    filters like `-p err`). Filtered by time here, not with `--after-cursor`: with a
    match such as `-p`, journalctl skips the first matching entry after the cursor."""
    argv = ["journalctl", "-u", UNIT, "--no-pager", "-o", "json", *extra]
    output = subprocess.run(argv, capture_output=True, text=True, check=True).stdout
    records = [json.loads(line) for line in output.splitlines() if line.strip()]
    return [r for r in records if int(r["__REALTIME_TIMESTAMP"]) > since_us]


def daemon_lines(since_us: int, *extra: str) -> list[tuple[int, dict[str, Any]]]:
    """(priority, parsed JSON line) of each JSON line the daemon wrote to the journal."""
    found = []
    for record in journal_records(since_us, *extra):
        message = record.get("MESSAGE")
        if isinstance(message, str) and message.startswith("{"):
            found.append((int(record["PRIORITY"]), json.loads(message)))
    return found


@pytest.fixture
def since_us() -> int:
    """The journal's newest entry time, so a test reads only the entries it caused."""
    records = subprocess.run(
        ["journalctl", "-n", "1", "-o", "json", "--no-pager"],
        capture_output=True, text=True, check=True,
    ).stdout.splitlines()  # fmt: skip
    return int(json.loads(records[-1])["__REALTIME_TIMESTAMP"]) if records else 0


def test_journal_priorities_follow_the_log_levels(installed: Installed, since_us: int) -> None:
    """`journalctl -p err` selects the daemon's error lines: each JSON line is written with
    its syslog priority prefix, which journald strips and records as PRIORITY."""
    if installed.layout.document["supervisor"] != "cgroupfs":
        pytest.skip("independent of the daemon's supervisor; runs once")
    document = dict(installed.layout.document)
    document["providers"] = [{**document["providers"][0], "configuration": {"argv": "x"}}]
    installed.layout.rewrite(document)
    subprocess.run([SYSTEMCTL, "start", UNIT], check=True)  # an unavailable provider: starts
    subprocess.run([SYSTEMCTL, "stop", UNIT], check=True)
    lines = daemon_lines(since_us)
    by_event = {line["event"]: (priority, line) for priority, line in lines}
    assert by_event["starting"][0] == 6
    assert by_event["ready"][0] == 6
    unavailable = [(p, line) for p, line in lines if "unavailable" in str(line.get("message"))]
    assert [p for p, _ in unavailable] == [3]
    assert all(p == {"error": 3, "warning": 4, "info": 6, "debug": 7}[line["level"]]
               for p, line in lines)  # fmt: skip
    errors = daemon_lines(since_us, "-p", "err")
    assert [line["message"] for _, line in errors] == [unavailable[0][1]["message"]]
    # check-config (ExecStartPre) reported the same provider as unavailable, as text
    texts = [str(r.get("MESSAGE")) for r in journal_records(since_us)]
    assert any("provider test: unavailable: provider_configure_failed" in t for t in texts)


def test_check_config_refuses_the_start_before_serve_runs(
    installed: Installed, since_us: int
) -> None:
    if installed.layout.document["supervisor"] != "cgroupfs":
        pytest.skip("independent of the daemon's supervisor; runs once")
    installed.layout.rewrite(installed.layout.document, mode=0o644)
    started = subprocess.run([SYSTEMCTL, "start", UNIT], capture_output=True, check=False)
    assert started.returncode != 0
    # Failed, waiting to try again (Restart=on-failure), or already trying again (on a
    # slow host RestartSec=5s can pass before this reads, which resets Result): in every
    # case no main process runs, and the journal shows serve never started.
    state = show("ActiveState", "ExecMainPID")
    assert state["ExecMainPID"] == "0", state
    assert state["ActiveState"] in {"failed", "activating"}, state
    texts = [str(r.get("MESSAGE")) for r in journal_records(since_us)]
    assert any(t.startswith("config_unsafe_file: ") and "chmod 0600" in t for t in texts), texts
    assert not [line for _, line in daemon_lines(since_us) if line["event"] == "starting"]
    subprocess.run([SYSTEMCTL, "stop", UNIT], check=False)


# --- leases without a live daemon (the lease reaper), under supervisor=systemd ---------

LEASE_MS = int(os.environ.get("FICC_TEST_LEASE_MS", "10000"))
"""The held attempt's lease: long enough for its start (the VM lane, where the daemon
runs about 20x slower under software emulation, sets a longer one)."""
GRACE_MS = 5_000


def start_held(installed: Installed, daemon: Daemon, lease_ms: int = LEASE_MS) -> tuple[Plan, int]:
    """A held attempt (a live process of the slot account in its unit) with a lease of
    `lease_ms`; returns it and the latest its deadline can be (wall-clock ms)."""
    plan = daemon.plan()
    held = Payload(argv=["/bin/true"], environment={"FICC_TEST_PROVIDER_HOLD": "1"})
    plan = msgspec.structs.replace(plan, job=msgspec.structs.replace(plan.job, payload=held))
    rows(daemon.prepare([plan], expires_in_ms=lease_ms))
    deadline = now_ms() + lease_ms
    ready = daemon.wait_state(plan, lambda r: r.ready or r.state != "prepared", "readiness")
    assert (ready.state, ready.ready) == ("prepared", True), ready
    attempt(daemon.start_attempt(plan))
    # The service (and its slot process) exists before the provider's start is called.
    wait_for(lambda: installed.layout.provider_calls("start", plan.attempt_id) == 1)
    wait_for(lambda: slot_processes(installed.accounts))
    assert daemon.observe(plan).state == "starting"
    return plan, deadline


def _sigkill_main() -> Callable[[], None]:
    """SIGKILL of the daemon's main process: systemd restarts it (Restart=on-failure)."""
    old = show("MainPID")["MainPID"]
    subprocess.run([SYSTEMCTL, "kill", "--kill-whom=main", "--signal=SIGKILL", UNIT], check=True)

    def restarted() -> None:
        wait_for(lambda: show("SubState", "MainPID")["MainPID"] not in {old, "0"})
        wait_for(lambda: show("SubState")["SubState"] == "running")

    return restarted


def _sigstop_main() -> Callable[[], None]:
    """SIGSTOP of the daemon's main process (hung: its monitor no longer runs)."""
    pid = int(show("MainPID")["MainPID"])
    os.kill(pid, signal.SIGSTOP)
    return lambda: os.kill(pid, signal.SIGCONT)


@pytest.mark.parametrize("disrupt", [_sigkill_main, _sigstop_main], ids=["sigkill", "sigstop"])
def test_a_dead_or_hung_daemon_still_stops_the_payload_at_its_deadline(
    slow_watchdog: Installed, disrupt: Callable[[], Callable[[], None]]
) -> None:
    """A held attempt (a live process of the slot account in its unit) with a 10 s
    lease; the daemon is SIGKILLed (its unit's BindsTo= stops the attempt unit at once)
    or SIGSTOPped (only the lease reaper is left to stop it): either way no process of
    the slot account is left 5 s after the deadline, the attempt ends `expired` or
    `unknown`, and the provider's `start` ran once."""
    installed = slow_watchdog
    subprocess.run([SYSTEMCTL, "start", UNIT], check=True)
    daemon = Daemon(installed.layout, installed.provider, installed.accounts)
    plan, deadline = start_held(installed, daemon)

    resume = disrupt()
    try:
        assert now_ms() < deadline - LEASE_MS // 2, "the start took too long"
        remaining = (deadline + GRACE_MS - now_ms()) / 1000
        wait_for(lambda: not slot_processes(installed.accounts), timeout=remaining)
    finally:
        resume()
    settled = daemon.wait_state(plan, lambda r: r.state in {"expired", "unknown"}, "settled")
    assert settled.state in {"expired", "unknown"}, settled
    daemon.wait_state(plan, lambda r: r.cleanup_confirmed, "confirmed cleanup")
    assert installed.layout.provider_calls("start", plan.attempt_id) == 1  # ran once
    assert attempt(daemon.release(plan)).state == "released"
    assert installed.layout.provider_calls("start", plan.attempt_id) == 1
    subprocess.run([SYSTEMCTL, "stop", UNIT], check=True)


# --- the lease reaper's own unit, under supervisor=systemd ---------------------------------


def deadline_ns(installed: Installed, plan: Plan) -> int:
    """The boot-clock deadline the reaper holds for the attempt's service."""
    name = f"ficc-work-{installed.layout.installation_id}-{plan.attempt_id}{reaper.SUFFIX}"
    document = json.loads((installed.layout.state_dir / "deadlines" / name).read_text())
    return int(document["deadline_boottime_ns"])


def boottime_ns() -> int:
    return time.clock_gettime_ns(time.CLOCK_BOOTTIME)


def _v2_node(unit: str) -> Path:
    """The unit's cgroup in the cgroup v2 hierarchy (on a hybrid host, the unified one
    systemd tracks its units in)."""
    mounts = cgroups.parse_mountinfo(Path("/proc/self/mountinfo").read_text())
    (unified,) = [h for h in mounts if h.version == 2]
    return Path(unified.mount + show_unit(unit, "ControlGroup")["ControlGroup"])


def freeze_unit(unit: str) -> tuple[str, Callable[[], None]]:
    """Freeze every process of `unit`; returns how, and what thaws it again.

    `systemctl freeze` where systemd offers it. systemd 252 freezes units only on a
    unified (v2-only) hierarchy and refuses on a hybrid one, such as this
    workplace's container; there the same kernel operation is made by hand: 1 in the
    unit's `cgroup.freeze` on the v2 hierarchy (where systemd tracks the unit's
    processes), confirmed by `frozen 1` in its `cgroup.events`, as systemd does.
    """
    argv = [SYSTEMCTL, "freeze", unit]
    frozen = subprocess.run(argv, capture_output=True, text=True, check=False)
    if frozen.returncode == 0:
        assert show_unit(unit, "FreezerState")["FreezerState"] == "frozen"
        return "systemctl freeze", lambda: subprocess.run([SYSTEMCTL, "thaw", unit], check=True)
    # Only a hybrid tree may refuse ("does not support freezing"); a unified one never.
    unified = Path("/sys/fs/cgroup/cgroup.controllers").exists()
    assert not unified, frozen.stderr
    assert "support" in frozen.stderr, frozen.stderr
    node = _v2_node(unit)

    def set_frozen(value: str) -> None:
        (node / "cgroup.freeze").write_text(value)
        wait_for(
            lambda: f"frozen {value}" in (node / "cgroup.events").read_text().splitlines(),
            f"{node} frozen {value}",
        )

    set_frozen("1")
    return f"{node}/cgroup.freeze (systemctl: {frozen.stderr.strip()})", lambda: set_frozen("0")


def test_a_frozen_daemon_unit_leaves_the_lease_reaper_enforcing(slow_watchdog: Installed) -> None:
    """Every process of the daemon's unit is frozen (`systemctl freeze`) before the
    deadline of a held attempt: the lease reaper, a unit of its own, still stops the
    payload, so no process of the slot account is left 5 s after the deadline. Once
    thawed the daemon finds the service emptied with the reaper's evidence: `expired`,
    and the provider's `start` ran once."""
    installed = slow_watchdog
    subprocess.run([SYSTEMCTL, "start", UNIT], check=True)
    daemon = Daemon(installed.layout, installed.provider, installed.accounts)
    plan, deadline = start_held(installed, daemon)
    exact = deadline_ns(installed, plan)
    how, thaw = freeze_unit(UNIT)
    try:
        assert now_ms() < deadline - LEASE_MS // 2, "the start took too long"
        assert slot_processes(installed.accounts), "the payload ended before its deadline"
        remaining = (deadline + GRACE_MS - now_ms()) / 1000
        wait_for(lambda: not slot_processes(installed.accounts), "the reaper's stop", remaining)
        late = (boottime_ns() - exact) / 1e9
    finally:
        thaw()
    print(f"daemon frozen by {how}; the payload was gone {late:.2f} s after its deadline")
    assert late < GRACE_MS / 1000
    settled = daemon.wait_state(plan, lambda r: r.state not in {"starting", "running"}, "end")
    assert (settled.state, settled.reason) == ("expired", "lease_expired"), settled
    daemon.wait_state(plan, lambda r: r.cleanup_confirmed, "confirmed cleanup")
    assert installed.layout.provider_calls("start", plan.attempt_id) == 1
    assert attempt(daemon.release(plan)).state == "released"
    subprocess.run([SYSTEMCTL, "stop", UNIT], check=True)


def _reaper_of(installed: Installed) -> str:
    """The lease reaper's unit of this installation, once it runs."""
    unit = reaper_unit(installed.layout.installation_id)
    wait_for(lambda: show_unit(unit, "ActiveState")["ActiveState"] == "active", unit)
    return unit


def test_the_lease_reaper_unit_is_restarted_by_systemd_and_keeps_enforcing(
    slow_watchdog: Installed,
) -> None:
    """The reaper's unit is in the attempts' slice, outside the daemon's cgroup, tied to
    the daemon's unit by nothing, with Restart=on-failure. With the daemon hung
    (SIGSTOP: it cannot start a reaper itself), the reaper's main process is
    SIGKILLed: systemd starts it again, and the new reaper stops the payload at its
    deadline (no process of the slot account 5 s after it); the attempt ends
    `expired`."""
    installed = slow_watchdog
    subprocess.run([SYSTEMCTL, "start", UNIT], check=True)
    daemon = Daemon(installed.layout, installed.provider, installed.accounts)
    plan, deadline = start_held(installed, daemon)
    exact = deadline_ns(installed, plan)
    unit = _reaper_of(installed)
    keys = ["Restart", "BindsTo", "PartOf", "After", "Slice", "ControlGroup", "MainPID"]
    state = show_unit(unit, *keys, "NRestarts")
    assert state["Restart"] == "on-failure"
    assert (state["BindsTo"], state["PartOf"]) == ("", ""), state
    assert UNIT not in state["After"].split(), state
    assert state["Slice"] == "ficc.slice"
    daemon_cgroup = show("ControlGroup")["ControlGroup"]
    assert not state["ControlGroup"].startswith(daemon_cgroup), (state, daemon_cgroup)
    first = state["MainPID"]
    assert "reaper.py" in Path(f"/proc/{first}/cmdline").read_text()

    hung = int(show("MainPID")["MainPID"])
    os.kill(hung, signal.SIGSTOP)
    try:
        subprocess.run(
            [SYSTEMCTL, "kill", "--kill-whom=main", "--signal=SIGKILL", unit], check=True
        )
        again = wait_for(
            lambda: (
                (now := show_unit(unit, "ActiveState", "MainPID", "NRestarts"))["ActiveState"]
                == "active"
                and now["MainPID"] not in {first, "0"}
                and int(now["NRestarts"]) >= 1
                and now
            ),
            "systemd to restart the reaper",
        )
        assert boottime_ns() < exact, "restarted only after the deadline"
        assert "reaper.py" in Path(f"/proc/{again['MainPID']}/cmdline").read_text()
        remaining = (deadline + GRACE_MS - now_ms()) / 1000
        wait_for(lambda: not slot_processes(installed.accounts), "the reaper's stop", remaining)
        late = (boottime_ns() - exact) / 1e9
    finally:
        os.kill(hung, signal.SIGCONT)
    print(f"reaper restarted ({again}); the payload was gone {late:.2f} s after its deadline")
    settled = daemon.wait_state(plan, lambda r: r.state not in {"starting", "running"}, "end")
    assert (settled.state, settled.reason) == ("expired", "lease_expired"), settled
    daemon.wait_state(plan, lambda r: r.cleanup_confirmed, "confirmed cleanup")
    assert attempt(daemon.release(plan)).state == "released"
    subprocess.run([SYSTEMCTL, "stop", UNIT], check=True)


def test_stopping_the_daemon_unit_leaves_the_lease_reaper_running(
    slow_watchdog: Installed,
) -> None:
    """`systemctl stop` of the daemon's unit stops the attempt's unit (BindsTo=) but
    not the reaper's, which goes on guarding the deadline file the daemon left. The
    next daemon settles the attempt and drops the file; the reaper then exits by
    itself (0, so systemd does not restart it) and systemd forgets its unit."""
    installed = slow_watchdog
    subprocess.run([SYSTEMCTL, "start", UNIT], check=True)
    daemon = Daemon(installed.layout, installed.provider, installed.accounts)
    plan, _deadline = start_held(installed, daemon, lease_ms=120_000)
    unit = _reaper_of(installed)
    before = show_unit(unit, "MainPID", "NRestarts")
    subprocess.run([SYSTEMCTL, "stop", UNIT], check=True)
    wait_for(lambda: not slot_processes(installed.accounts), "the attempt unit's stop")
    assert show_unit(unit, "ActiveState", "MainPID", "NRestarts") == {
        "ActiveState": "active",
        **before,
    }
    subprocess.run([SYSTEMCTL, "start", UNIT], check=True)
    settled = daemon.wait_state(plan, lambda r: r.state not in {"starting", "running"}, "end")
    assert (settled.state, settled.reason) == ("unknown", "executor_restarted"), settled
    daemon.wait_state(plan, lambda r: r.cleanup_confirmed, "confirmed cleanup")
    assert attempt(daemon.release(plan)).state == "released"
    wait_for(
        lambda: show_unit(unit, "LoadState")["LoadState"] == "not-found",
        "the reaper to exit and its unit to be forgotten",
        timeout=reaper.LINGER_SECONDS + 20,
    )
    subprocess.run([SYSTEMCTL, "stop", UNIT], check=True)


# --- the crash loop under supervisor=systemd, with the daemon as its unit ---------------


def test_sigkill_at_random_points_under_systemd_loses_nothing_and_replays_nothing(
    slow_watchdog: Installed,
) -> None:
    """The crash loop of tests-integration/test_crash_daemon.py (reliability target R2), with the
    daemon as its shipped unit and supervisor=systemd: each kill is a SIGKILL of the
    main process and the restart is systemd's (Restart=on-failure). FICC_CRASH_KILLS
    sets the count (CI: 50)."""
    spec = importlib.util.spec_from_file_location("test_crash_daemon", CRASH_TESTS)
    assert spec is not None
    assert spec.loader is not None
    test_crash_daemon = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = test_crash_daemon  # its dataclasses look their module up there
    spec.loader.exec_module(test_crash_daemon)

    installed = slow_watchdog
    unit = installed.unit

    class UnitCrasher(test_crash_daemon.Crasher):
        def kill(self) -> None:
            # The journal keeps every daemon's log: the last one's tail is enough here,
            # and internal_failures reads the whole journal at the end.
            unit.kill()
            self.logs.append(unit.log(tail=400))

        def restart(self) -> None:
            unit.wait_restarted()

    unit.start()
    daemon = Daemon(installed.layout, installed.provider, installed.accounts)
    daemon.process = unit  # type: ignore[assignment]  (the same interface)
    kills = int(os.environ.get("FICC_CRASH_KILLS", "50"))
    crasher = UnitCrasher(daemon, test_crash_daemon.random.Random(test_crash_daemon.SEED))
    for _ in range(kills):
        crasher.arm()
        try:
            while True:
                crasher.workload()
        except test_crash_daemon.Killed:
            pass
        crasher.restart()
        crasher.check_invariants()
        crasher.clean_host()
    assert sum(crasher.kills.values()) == kills
    print(f"kills by phase: {dict(crasher.kills)}; in flight: {crasher.in_flight_kills}")
    assert crasher.internal_failures() == []
    subprocess.run([SYSTEMCTL, "stop", UNIT], check=True)
