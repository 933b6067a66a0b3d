"""The runner's own decisions, without root: a real `Runner` on the host of fakes.

Requests go through the real handlers, and the runner does its work on the real
ledger (owned by this process), with a system service kept in memory, the slot's
attempt files on plain directories and a provider driver that answers as each test
scripts it (fake_host.py). A released payload is a real process of this test's; the
two steps of its start that need root (the gate's look at the live barrier, the
root-owned release marker) are replaced by the `payload` fixture. What this cannot
show (a real layout owned by the slot account, real cgroups, the gate on a real
barrier) is test_pipeline.py's and test_gate.py's, with root.

Waiting is on a real condition with a deadline (`until`), never a sleep.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from fake_host import Host, plan
from ficc.execution import protocol, wire
from ficc.execution import provider as sdk
from ficc.execution.host.core import lifecycle
from ficc.execution.host.core.errors import HostError
from ficc.execution.host.gate import checks as gate
from ficc.execution.host.ledger.store import AttemptRecord
from ficc.execution.host.runner import starting
from ficc.execution.host.runner.pipeline import Runner, Settings
from ficc.execution.host.service.interface import CgroupUsage
from ficc.execution.host.storage.layout import service_name
from ficc.execution.plan import Plan
from ficc_testkit.driver import fence
from ficc_testkit.fakes import FakeUnit
from ficc_testkit.plans import new_id
from runner_support import running, until

FAST = Settings(tick=0.02, provider_timeout=30.0, start_timeout=30.0, observe_interval=0.01)
QUICK = Settings(tick=0.02, provider_timeout=1.0, start_timeout=30.0, observe_interval=0.01)
"""A provider call times out after 1 s (its thread runs on until `held` lets it go);
the scripted provider's other calls return at once."""


@pytest.fixture
def host(tmp_path: Path) -> Iterator[Host]:
    with Host(tmp_path) as made:
        yield made


def record(host: Host, attempt_id: str) -> AttemptRecord:
    found = host.ctx.ledger.get(attempt_id)
    assert found is not None
    return found


def settled_and_clean(host: Host, attempt_id: str) -> Callable[[], bool]:
    def check() -> bool:
        status = record(host, attempt_id).status
        return status.state in lifecycle.SETTLED and status.cleanup_confirmed

    return check


def ready(host: Host, attempt_id: str) -> Callable[[], bool]:
    return lambda: record(host, attempt_id).status.ready


async def admitted(host: Host, runner: Runner, job: Plan, *, lease_ms: int = 300_000) -> None:
    """`job` admitted through the handlers, which hand it to `runner`."""
    host.runner = runner
    (row,) = (await host.ask(host.prepare_request(job, lease_ms=lease_ms))).results
    assert isinstance(row, wire.AttemptRow), row


async def started(host: Host, runner: Runner, job: Plan) -> None:
    """`job` admitted, prepared until ready, and its start accepted by the handlers."""
    await admitted(host, runner, job)
    await until(ready(host, job.attempt_id), "ready")
    (row,) = await ask_rows(host, protocol.StartRequest, job)
    assert isinstance(row, wire.AttemptRow), row


async def ask_rows(host: Host, kind: type[Any], *jobs: Plan) -> list[Any]:
    """The rows of a stop or release of `jobs`' attempts."""
    request = kind(version=1, id=new_id(), attempts=[fence(j) for j in jobs])
    return list((await host.ask(request)).results)


def failed_with(host: Host, job: Plan, reason: str) -> None:
    status = record(host, job.attempt_id).status
    assert (status.state, status.reason) == ("failed", reason)


def script(host: Host, method: str, job: Plan, answer: Callable[[Any], dict[str, Any]]) -> None:
    host.driver.script[(method, job.attempt_id)] = answer


def refuse(code: str) -> Callable[[Any], dict[str, Any]]:
    def row(_: Any) -> dict[str, Any]:
        raise sdk.Refused(code, f"scripted {code}")

    return row


def admitted_until(host: Host, job: Plan, condition: Callable[[], bool], what: str) -> None:
    """Admit `job` to a running runner and wait until `condition`."""

    async def scenario() -> None:
        async with running(Runner(host.ctx, settings=FAST)) as runner:
            await admitted(host, runner, job)
            await until(condition, what)

    asyncio.run(scenario())


@pytest.fixture
def returned(host: Host) -> Iterator[threading.Event]:
    """What lets a `held` call return; set at the latest before the host closes (it
    depends on `host`), so no provider thread outlives a failed test."""
    event = threading.Event()
    try:
        yield event
    finally:
        event.set()


def held(returned: threading.Event, reply: Any) -> Callable[[Any], dict[str, Any]]:
    """A row that answers `reply` only once `returned` is set: a call past its timeout."""

    def row(_: Any) -> dict[str, Any]:
        returned.wait(60)
        return sdk.reply(reply)

    return row


def prepared_until_settled(host: Host, job: Plan) -> None:
    """Admit `job`, let the runner prepare it, and wait until it settled and was cleaned."""
    admitted_until(host, job, settled_and_clean(host, job.attempt_id), "settled and cleaned")


def restarted_until(host: Host, condition: Callable[[], bool], what: str) -> None:
    """A new runner recovers from the ledger, as at the daemon's start; then wait."""

    async def restart() -> None:
        runner = Runner(host.ctx, settings=FAST)
        await runner.recover()
        async with running(runner):
            await until(condition, what)

    asyncio.run(restart())


# --- prepare -------------------------------------------------------------------------


def test_an_admitted_attempt_is_probed_prepared_and_ready_with_its_result_persisted(
    host: Host,
) -> None:
    job = plan()
    admitted_until(host, job, ready(host, job.attempt_id), "ready")
    status = record(host, job.attempt_id).status
    assert (status.state, status.ready, status.preparing) == ("prepared", True, False)
    assert [m for m, a in host.driver.calls if a == job.attempt_id] == ["probe", "prepare"]
    files = host.files[record(host, job.attempt_id).slot_id or ""]
    assert [m for m, _ in files.calls[:2]] == ["verify", "create"]
    assert files.exists(job.attempt_id)
    assert host.ctx.ledger.prepare_result(job.attempt_id) is not None


def test_a_probe_that_says_no_fails_the_attempt_without_a_prepare(host: Host) -> None:
    job = plan()
    script(host, "probe", job, lambda _: sdk.reply(sdk.ProbeReply(ok=False)))
    prepared_until_settled(host, job)
    failed_with(host, job, "probe_failed")
    assert host.driver.count("prepare", job.attempt_id) == 0


@pytest.mark.parametrize(
    ("code", "reason"),
    [
        ("input_changed", "input_changed"),
        ("provider_unavailable", "provider_unavailable"),
        ("image_unknown", "provider_failed"),
    ],
)
def test_a_prepare_refusal_keeps_only_the_codes_a_controller_reads_as_the_hosts(
    host: Host, code: str, reason: str
) -> None:
    job = plan()
    script(host, "prepare", job, refuse(code))
    prepared_until_settled(host, job)
    failed_with(host, job, reason)


def test_a_driver_method_that_raises_fails_its_rows_as_provider_failed(host: Host) -> None:
    job = plan()

    def broken(_: Any) -> dict[str, Any]:
        raise RuntimeError("the provider's own bug")

    script(host, "prepare", job, broken)
    prepared_until_settled(host, job)
    failed_with(host, job, "provider_failed")


def test_a_prepare_result_the_files_contradict_is_provider_malformed(host: Host) -> None:
    job = plan()
    shell = sdk.BarrierSpec(path="/bin/sh", identity=sdk.Identity(device=1, inode=1))
    result = sdk.PrepareResult(
        argv=["relative/program"], barrier=shell, devices=[], mounts=[],
        generated_targets=[], positive_devices=[], negative_devices=[],
    )  # fmt: skip
    script(host, "prepare", job, lambda _: sdk.reply(result))
    prepared_until_settled(host, job)
    failed_with(host, job, "provider_malformed")
    assert host.ctx.ledger.prepare_result(job.attempt_id) is None


@pytest.mark.parametrize(
    ("method", "code"),
    [("verify", "slot_filesystem"), ("create", "slot_full"), ("storage_binding", "layout_unsafe")],
)
def test_a_slot_that_refuses_its_files_fails_the_attempt_before_any_provider_call(
    host: Host, method: str, code: str
) -> None:
    job = plan()
    for files in host.files.values():
        files.refusals[method] = HostError(code, f"scripted {code}")
    prepared_until_settled(host, job)
    failed_with(host, job, code)
    assert host.driver.count("probe", job.attempt_id) == 0


def test_a_prepare_past_its_timeout_fails_and_cleanup_waits_until_the_call_returns(
    host: Host, returned: threading.Event
) -> None:
    """A timed-out call's thread runs on: the attempt fails `provider_timeout` at once,
    but its cleanup is confirmed only once the call has returned, never while the
    provider may still act on the attempt."""
    job = plan()
    script(host, "probe", job, held(returned, sdk.ProbeReply(ok=True)))
    ticks = 0

    def tick() -> None:
        nonlocal ticks
        ticks += 1

    async def scenario() -> None:
        async with running(Runner(host.ctx, settings=QUICK, on_tick=tick)) as runner:
            await admitted(host, runner, job)
            await until(lambda: record(host, job.attempt_id).status.reason is not None, "failed")
            seen = ticks
            await until(lambda: ticks >= seen + 10, "ten more monitor ticks")
            assert not record(host, job.attempt_id).status.cleanup_confirmed
            returned.set()
            await until(settled_and_clean(host, job.attempt_id), "cleaned after the return")

    asyncio.run(scenario())
    failed_with(host, job, "provider_timeout")
    assert host.driver.count("prepare", job.attempt_id) == 0


# --- start, up to the payload's PID ---------------------------------------------------


def started_until_settled(host: Host, job: Plan, settings: Settings = FAST) -> Runner:
    """Admit, prepare and start `job` through the handlers; wait until it settled and
    was cleaned. The runner, for what it keeps (the rows' details)."""
    runner = Runner(host.ctx, settings=settings)

    async def scenario() -> None:
        async with running(runner):
            await started(host, runner, job)
            await until(settled_and_clean(host, job.attempt_id), "settled and cleaned")

    asyncio.run(scenario())
    return runner


def the_service(host: Host, job: Plan) -> FakeUnit | None:
    return host.service.units.get(service_name(host.config.installation_id, job.attempt_id))


def service_stopped(host: Host, job: Plan) -> bool:
    """Whether the attempt's service was made and then stopped."""
    name = service_name(host.config.installation_id, job.attempt_id)
    calls = host.service.calls
    return ("create", name) in calls and ("stop", name) in calls


def test_a_refused_start_stops_its_service_before_it_records_the_failure(host: Host) -> None:
    job = plan()
    script(host, "start", job, refuse("runtime_failed"))
    states_at_stop: list[str] = []

    def stop(_: Any) -> dict[str, Any]:
        states_at_stop.append(record(host, job.attempt_id).status.state)
        return sdk.reply(sdk.StopReply(stopped=True))

    script(host, "stop", job, stop)
    started_until_settled(host, job)
    failed_with(host, job, "provider_failed")
    assert states_at_stop == ["starting"]  # stopped while the record still said starting
    assert service_stopped(host, job)


def test_a_payload_pid_that_never_comes_fails_the_start_at_its_timeout(host: Host) -> None:
    job = plan(argv=("/bin/true",))
    waiting = sdk.Observation(phase="waiting")
    script(host, "observe", job, lambda _: sdk.reply(waiting))
    impatient = Settings(tick=0.02, provider_timeout=30.0, start_timeout=0.3)
    started_until_settled(host, job, impatient)
    failed_with(host, job, "start_timeout")
    assert host.driver.count("stop", job.attempt_id) == 1
    assert service_stopped(host, job)


def test_a_barrier_that_finished_before_its_pid_never_ran_the_payload(host: Host) -> None:
    job = plan()
    finished = sdk.Observation(phase="finished", exit_code=1)
    script(host, "observe", job, lambda _: sdk.reply(finished))
    started_until_settled(host, job)
    failed_with(host, job, "barrier_exited")


def test_a_barrier_killed_for_memory_before_its_release_is_memory_exhausted(host: Host) -> None:
    """An OOM kill in the service before the release: the runtime (here the barrier)
    was killed for memory, so the outcome says so, not `barrier_exited`, and the detail
    explains it with the runtime's own failure."""
    job = plan()

    def start(_: Any) -> dict[str, Any]:
        unit = the_service(host, job)
        assert unit is not None
        unit.usage = CgroupUsage(oom_kills=2)
        return sdk.reply(sdk.StartReply(started=True))

    script(host, "start", job, start)
    finished = sdk.Observation(phase="finished", exit_code=137)
    script(host, "observe", job, lambda _: sdk.reply(finished))
    runner = started_until_settled(host, job)
    failed_with(host, job, "memory_exhausted")
    (detail,) = runner.details([job.attempt_id]).values()
    assert detail.startswith(
        "the kernel's out-of-memory killer killed 2 process(es) of the attempt's service"
        " before the payload was released (barrier_exited: "
    ), detail
    assert f"memory_bytes {job.job.limits.memory_bytes} is too small" in detail
    assert host.ctx.ledger.usage_of([job.attempt_id])[job.attempt_id].usage.oom_kills == 2


def test_a_provider_start_past_its_timeout_leaves_the_outcome_unknown_never_replayed(
    host: Host, returned: threading.Event
) -> None:
    """The payload may run: the outcome is lost (`provider_timeout`), the service is
    stopped, and start is never called again."""
    job = plan()
    script(host, "start", job, held(returned, sdk.StartReply(started=True)))

    async def scenario() -> None:
        async with running(Runner(host.ctx, settings=QUICK)) as runner:
            await started(host, runner, job)
            await until(lambda: record(host, job.attempt_id).status.state == "unknown", "lost")
            returned.set()
            await until(settled_and_clean(host, job.attempt_id), "cleaned after the return")

    asyncio.run(scenario())
    status = record(host, job.attempt_id).status
    assert (status.state, status.reason) == ("unknown", "provider_timeout")
    assert host.driver.count("start", job.attempt_id) == 1
    assert service_stopped(host, job)


# --- a released payload: what the runner makes of what it observes -------------------


class Payload:
    """A real process standing in for the gated barrier, and what the scripted provider
    reports of it: the payload running with its PID until `exit_code` is set, then
    finished with that code. The process lives until `end` (its stdin closes)."""

    def __init__(self) -> None:
        self.process = subprocess.Popen(["cat"], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL)
        self.exit_code: int | None = None

    def observation(self, _: Any) -> dict[str, Any]:
        if self.exit_code is None:
            return sdk.reply(sdk.Observation(phase="payload", pid=self.process.pid))
        return sdk.reply(sdk.Observation(phase="finished", exit_code=self.exit_code))

    def end(self) -> None:
        if self.process.stdin is not None:
            self.process.stdin.close()
        self.process.wait(timeout=60)


@pytest.fixture
def payload(host: Host, monkeypatch: pytest.MonkeyPatch) -> Iterator[Payload]:
    """A payload the runner releases without root. The two steps of a start that need
    it are replaced: the gate's look at the live barrier (its account, cgroup,
    namespaces and confinement, which test_gate.py proves) passes, and the release
    marker is a plain file (root-owned in the daemon, as test_pipeline.py proves).
    Everything else (the provider's start, the wait for the PID, the release in one
    ledger transaction, `Started`, observation) is the runner's own code."""

    def passes(self: Any, *_: Any) -> gate.Verdict:
        return gate.Verdict(ok=True, failures=())

    def plain_marker(dir_fd: int, name: str, *, group: int) -> None:
        fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o640, dir_fd=dir_fd)
        os.close(fd)

    monkeypatch.setattr(starting.Starter, "_run_gate", passes)
    monkeypatch.setattr(gate, "write_release_marker", plain_marker)
    made = Payload()
    try:
        yield made
    finally:
        made.end()


def the_service_runs(host: Host, job: Plan, payload: Payload) -> Callable[[Any], dict[str, Any]]:
    """The provider's start: the payload is in the attempt's service from now on."""

    def row(_: Any) -> dict[str, Any]:
        unit = the_service(host, job)
        assert unit is not None, "start before the service was made"
        unit.members.add(payload.process.pid)
        return sdk.reply(sdk.StartReply(started=True))

    return row


def running_until_settled(
    host: Host,
    job: Plan,
    payload: Payload,
    then: Callable[[FakeUnit], Any],
    settings: Settings = FAST,
) -> None:
    """Admit, prepare, start and release `job`; once it runs, `then(its service)`
    (which may be a coroutine function); wait until the attempt settled and was
    cleaned."""
    script(host, "start", job, the_service_runs(host, job, payload))
    script(host, "observe", job, payload.observation)

    async def scenario() -> None:
        async with running(Runner(host.ctx, settings=settings)) as runner:
            await started(host, runner, job)
            await until(lambda: record(host, job.attempt_id).status.state == "running", "running")
            unit = the_service(host, job)
            assert unit is not None
            done = then(unit)
            if asyncio.iscoroutine(done):
                await done
            await until(settled_and_clean(host, job.attempt_id), "settled and cleaned")

    asyncio.run(scenario())


def test_a_payload_that_exits_is_recorded_with_its_exit_code_and_what_it_used(
    host: Host, payload: Payload
) -> None:
    job = plan()

    def exits(unit: FakeUnit) -> None:
        unit.usage = CgroupUsage(cpu_user_us=7, memory_peak_bytes=4096, oom_kills=0)
        for files in host.files.values():
            files.used = (1 << 20, 12)
        payload.exit_code = 3

    running_until_settled(host, job, payload, exits)
    status = record(host, job.attempt_id).status
    assert (status.state, status.exit_code) == ("failed", 3)
    used = host.ctx.ledger.usage_of([job.attempt_id])[job.attempt_id].usage
    assert (used.cpu_user_us, used.memory_peak_bytes, used.oom_kills) == (7, 4096, 0)
    assert (used.storage_bytes, used.storage_inodes) == (1 << 20, 12)
    assert host.driver.count("start", job.attempt_id) == 1


def test_the_payload_is_in_its_own_node_before_the_gate_and_its_share_is_recorded(
    host: Host, payload: Payload, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The barrier is moved into the service's payload node before the gate judges it
    (the gate then vouches for where it is), and what that node used is recorded
    beside the whole service's figures."""
    job = plan()
    judged: list[int | None] = []

    def gate_sees(self: Any, attempt: Any, result: Any, handle: Any, pid: int) -> gate.Verdict:
        unit = the_service(host, job)
        judged.append(None if unit is None else unit.payload)
        return gate.Verdict(ok=True, failures=())

    monkeypatch.setattr(starting.Starter, "_run_gate", gate_sees)

    def exits(unit: FakeUnit) -> None:
        unit.usage = CgroupUsage(cpu_user_us=9, payload_cpu_user_us=4, payload_memory_peak_bytes=3)
        payload.exit_code = 0

    running_until_settled(host, job, payload, exits)
    assert judged == [payload.process.pid]
    used = host.ctx.ledger.usage_of([job.attempt_id])[job.attempt_id].usage
    assert (used.cpu_user_us, used.payload_cpu_user_us, used.payload_memory_peak_bytes) == (9, 4, 3)


def test_an_exit_the_services_main_process_contradicts_is_an_unknown_outcome(
    host: Host, payload: Payload
) -> None:
    job = plan()

    def contradicted(unit: FakeUnit) -> None:
        unit.exit_status = 1
        payload.exit_code = 0

    running_until_settled(host, job, payload, contradicted)
    status = record(host, job.attempt_id).status
    assert (status.state, status.reason) == ("unknown", "outcome_conflict")


def test_a_service_that_emptied_with_no_exit_reported_is_an_unreadable_outcome(
    host: Host, payload: Payload
) -> None:
    job = plan()

    def emptied(unit: FakeUnit) -> None:
        unit.members.clear()

    running_until_settled(host, job, payload, emptied)
    status = record(host, job.attempt_id).status
    assert (status.state, status.reason) == ("unknown", "outcome_unreadable")


def test_a_nonzero_exit_after_an_oom_kill_is_memory_exhausted(host: Host, payload: Payload) -> None:
    job = plan()

    def killed(unit: FakeUnit) -> None:
        unit.usage = CgroupUsage(oom_kills=1)
        payload.exit_code = 137

    running_until_settled(host, job, payload, killed)
    status = record(host, job.attempt_id).status
    assert (status.state, status.reason, status.exit_code) == ("failed", "memory_exhausted", 137)


def test_an_observe_past_its_timeout_while_the_payload_runs_is_an_unknown_outcome(
    host: Host, payload: Payload, returned: threading.Event
) -> None:
    job = plan()

    async def hangs(_: FakeUnit) -> None:
        script(host, "observe", job, held(returned, sdk.Observation(phase="waiting")))
        await until(lambda: record(host, job.attempt_id).status.state == "unknown", "lost")
        returned.set()  # cleanup waits for the call's return

    running_until_settled(host, job, payload, hangs, QUICK)
    status = record(host, job.attempt_id).status
    assert (status.state, status.reason) == ("unknown", "provider_timeout")


def test_a_full_slot_fails_a_payload_that_then_exits_zero(host: Host, payload: Payload) -> None:
    job = plan()

    def fills(_: FakeUnit) -> None:
        for files in host.files.values():
            files.full = True

    def exits_once_noted(_: FakeUnit) -> Any:
        async def later() -> None:
            fills(_)
            await until(lambda: record(host, job.attempt_id).status.storage_exhausted, "noted")
            payload.exit_code = 0

        return later()

    running_until_settled(host, job, payload, exits_once_noted)
    status = record(host, job.attempt_id).status
    assert (status.state, status.exit_code) == ("failed", 0)
    assert status.reason == "storage_exhausted"


def test_a_stopped_payload_is_cancelled_through_the_provider_and_its_service(
    host: Host, payload: Payload
) -> None:
    job = plan()

    async def stop(_: FakeUnit) -> None:
        (row,) = await ask_rows(host, protocol.StopRequest, job)
        assert isinstance(row, wire.AttemptRow), row

    running_until_settled(host, job, payload, stop)
    status = record(host, job.attempt_id).status
    assert (status.state, status.reason) == ("cancelled", "stopped")
    assert host.driver.count("stop", job.attempt_id) >= 1
    assert service_stopped(host, job)


# --- stop, expiry, cleanup -------------------------------------------------------------


def test_a_stopped_ready_attempt_is_cancelled_and_cleaned_without_a_start(host: Host) -> None:
    job = plan()

    async def scenario() -> list[Any]:
        async with running(Runner(host.ctx, settings=FAST)) as runner:
            await admitted(host, runner, job)
            await until(ready(host, job.attempt_id), "ready")
            rows = await ask_rows(host, protocol.StopRequest, job)
            await until(settled_and_clean(host, job.attempt_id), "cancelled and cleaned")
            return rows

    (row,) = asyncio.run(scenario())
    assert isinstance(row, wire.AttemptRow), row
    status = record(host, job.attempt_id).status
    assert (status.state, status.reason) == ("cancelled", "stopped")
    assert host.driver.count("start", job.attempt_id) == 0


def test_a_lease_that_runs_out_before_the_start_ends_the_attempt_expired(host: Host) -> None:
    job = plan()

    async def scenario() -> None:
        async with running(Runner(host.ctx, settings=FAST)) as runner:
            await admitted(host, runner, job, lease_ms=1_000)
            await until(settled_and_clean(host, job.attempt_id), "expired and cleaned")

    asyncio.run(scenario())
    status = record(host, job.attempt_id).status
    assert (status.state, status.reason) == ("expired", "lease_expired")
    assert host.driver.count("start", job.attempt_id) == 0


def test_cleanup_is_not_confirmed_while_the_slot_account_survives_its_kill(host: Host) -> None:
    job = plan()
    script(host, "probe", job, lambda _: sdk.reply(sdk.ProbeReply(ok=False)))
    host.service.unkillable.update(s.uid for s in host.config.slots)

    async def scenario() -> None:
        async with running(Runner(host.ctx, settings=FAST)) as runner:
            await admitted(host, runner, job)
            await until(lambda: record(host, job.attempt_id).status.quarantined, "quarantined")
            assert not record(host, job.attempt_id).status.cleanup_confirmed
            host.service.unkillable.clear()
            await until(settled_and_clean(host, job.attempt_id), "cleaned once it is idle")

    asyncio.run(scenario())
    failed_with(host, job, "probe_failed")


# --- release ---------------------------------------------------------------------------


def test_release_frees_the_payloads_data_asks_the_provider_and_removes_the_layout(
    host: Host,
) -> None:
    job = plan()
    script(host, "probe", job, lambda _: sdk.reply(sdk.ProbeReply(ok=False)))

    async def scenario() -> list[Any]:
        async with running(Runner(host.ctx, settings=FAST)) as runner:
            await admitted(host, runner, job)
            await until(settled_and_clean(host, job.attempt_id), "settled and cleaned")
            return await ask_rows(host, protocol.ReleaseRequest, job)

    (row,) = asyncio.run(scenario())
    assert isinstance(row, wire.AttemptRow), row
    assert record(host, job.attempt_id).status.state == "released"
    files = host.files[record(host, job.attempt_id).slot_id or ""]
    released = [m for m, a in files.calls if a == job.attempt_id][-2:]
    assert released == ["free_payload_data", "remove"]
    assert host.driver.count("release", job.attempt_id) == 1
    assert not files.exists(job.attempt_id)


def test_a_layout_that_cannot_be_removed_keeps_the_reservation_until_a_release_succeeds(
    host: Host,
) -> None:
    """The second release finds the payload's storage already freed by the first: the
    provider is asked again with the path alone, and the layout is removed."""
    job = plan()
    script(host, "probe", job, lambda _: sdk.reply(sdk.ProbeReply(ok=False)))
    stuck = HostError("layout_cleanup_failed", "scripted: the slot's disk fails")
    for files in host.files.values():
        files.refusals["remove"] = stuck
    bindings: list[sdk.StorageBinding] = []

    def release(context: Any) -> dict[str, Any]:
        bindings.append(context.storage)
        return sdk.reply(sdk.ReleaseReply(released=True))

    script(host, "release", job, release)

    async def scenario() -> tuple[Any, Any]:
        async with running(Runner(host.ctx, settings=FAST)) as runner:
            await admitted(host, runner, job)
            await until(settled_and_clean(host, job.attempt_id), "settled and cleaned")
            (refused,) = await ask_rows(host, protocol.ReleaseRequest, job)
            assert record(host, job.attempt_id).status.state == "failed"
            for files in host.files.values():
                files.refusals.clear()
            (released,) = await ask_rows(host, protocol.ReleaseRequest, job)
            return refused, released

    refused, released = asyncio.run(scenario())
    assert isinstance(refused, wire.ErrorRow), refused
    assert refused.error.code == "layout_cleanup_failed"
    assert isinstance(released, wire.AttemptRow), released
    assert record(host, job.attempt_id).status.state == "released"
    first, second = bindings
    assert first.device is not None  # verified on the slot's filesystem
    assert (second.path, second.device, second.inode) == (first.path, None, None)
    assert not host.files[record(host, job.attempt_id).slot_id or ""].exists(job.attempt_id)


# --- restart ---------------------------------------------------------------------------


def test_a_restart_never_replays_a_running_attempt_it_stops_and_cleans_it_as_unknown(
    host: Host,
) -> None:
    """The ledger says `running` and the service is still there: the new runner adopts
    it by name, stops it, and records the outcome as unknown. No provider call starts
    anything again."""
    job = plan()

    admitted_until(host, job, ready(host, job.attempt_id), "ready")
    host.ctx.ledger.start_batch([record(host, job.attempt_id).fence], host.ctx.clock.now())
    host.ctx.ledger.apply(record(host, job.attempt_id).fence, lifecycle.Started())
    name = service_name(host.config.installation_id, job.attempt_id)
    unit = FakeUnit(spec=None, members={4242})  # type: ignore[arg-type]
    host.service.units[name] = unit
    calls_before = list(host.driver.calls)

    restarted_until(host, settled_and_clean(host, job.attempt_id), "unknown and cleaned")
    status = record(host, job.attempt_id).status
    assert (status.state, status.reason) == ("unknown", "executor_restarted")
    assert unit.stopped
    new_calls = host.driver.calls[len(calls_before) :]
    assert not [m for m, _ in new_calls if m in ("probe", "prepare", "start")], new_calls


def test_a_restart_prepares_an_admitted_attempt_whose_preparation_never_began(
    host: Host,
) -> None:
    job = plan()
    (row,) = host.prepare(job)  # the recording runner: nothing is prepared
    assert isinstance(row, wire.AttemptRow), row

    restarted_until(host, ready(host, job.attempt_id), "ready")
    assert [m for m, _ in host.driver.calls] == ["probe", "prepare"]


def test_a_restart_fails_a_preparation_that_was_in_flight_without_calling_again(
    host: Host,
) -> None:
    job = plan()
    host.prepare(job)
    host.ctx.ledger.apply(record(host, job.attempt_id).fence, lifecycle.PrepareBegun())

    restarted_until(host, settled_and_clean(host, job.attempt_id), "failed and cleaned")
    assert record(host, job.attempt_id).status.state == "failed"
    assert host.driver.calls == []
