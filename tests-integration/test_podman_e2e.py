"""Real jobs end to end: the real daemon, its real sockets, real rootless Podman.

Each test talks to `python -m ficc.execution serve` (one
daemon per module and backend; the restart tests restart it) over its transport socket
with the real Client, as the real transport account, and the job runs in a real
rootless Podman container as a real slot account, inside the host's system service,
behind the provider's static barrier, released only after the host's payload gate
passed. The world (accounts, image, provider wheel and pin, configuration, daemon) is
built by podman_support.py. Tests run one after another and each releases its
attempt, so a slot is free for the next one.

The suite is parametrized by the daemon's system-service backend (`supervisor`):
`cgroupfs` here (the daemon a child process), and `systemd` inside the systemd
container of tools/systemd/run.py (`nox -s systemd`), where the daemon runs as the
shipped unit and each attempt's service is a transient unit bound to it
(podman_support.BACKENDS). The assertions are the same for both; where the backends
really differ (a SIGKILLed daemon's work outlives it under cgroupfs, and is stopped
by systemd with the daemon's unit), each test says so.

Evidence is always read from the real system: the attempt rows the daemon returns,
bytes collected through the protocol, the payload's own output files, the gate's
evidence file, the kernel's cgroup counters and /proc.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from ficc.execution.plan import InputObject, decode_plan
from ficc.execution.wire import ReadRow, Usage
from ficc_testkit import tamper
from ficc_testkit.accounts import processes_of
from ficc_testkit.digests import digest_of
from ficc_testkit.driver import row_code
from ficc_testkit.podman import DEVICE, WAIT_TIMEOUT, PodmanWorld, barrier_of
from ficc_testkit.units import MIB
from ficc_testkit.waits import now_ms, wait_for
from podman_support import NEEDS_PODMAN

pytestmark = NEEDS_PODMAN
REPOSITORY = Path(__file__).resolve().parent.parent
FICC_EXECUTOR = Path(sys.executable).parent / "ficc-executor"
"""The console command of the environment the tests run in."""


def _streamed(data: bytes, name: str) -> InputObject:
    return InputObject(
        id=os.urandom(16).hex(),
        name=name,
        bytes=len(data),
        digest=digest_of(data),
        delivery="stream",
    )


def test_a_streamed_job_runs_and_its_output_is_collected_in_1_mib_chunks(e2e: PodmanWorld) -> None:
    """prepare with one streamed 1.5 MiB input -> input_write in 1 MiB chunks at the
    returned offsets -> ready -> start -> succeeded with exit 0 -> the 3 MiB declared
    output, the 1.5 MiB stdout and stderr collected in 1 MiB chunks at the returned
    offsets -> release -> released, outcome succeeded, the attempt's files gone."""
    data = os.urandom(3 * MIB // 2)
    obj = _streamed(data, "input.bin")
    script = (
        "cat /inputs/input.bin /inputs/input.bin > /work/out.bin && "
        "cat /inputs/input.bin && sha256sum /inputs/input.bin >&2"
    )
    plan = e2e.plan(script, inputs=[obj], outputs=[("result", "out.bin")])

    admitted = e2e.prepare(plan)
    assert (admitted.state, admitted.ready) == ("prepared", False)
    written = e2e.stream(plan, obj, data)
    assert written.complete
    assert written.offset == len(data)
    e2e.wait_ready(plan)
    assert e2e.start(plan).state in ("starting", "running")
    done = e2e.wait_settled(plan)
    assert (done.state, done.outcome, done.exit_code) == ("succeeded", "succeeded", 0), done

    output = e2e.collect(plan, "output:result")
    assert output.data == data + data
    assert [len(r.data) for r in output.reads] == [MIB, MIB, MIB]
    assert output.reads[-1].eof
    assert output.reads[-1].complete
    assert len({r.identity for r in output.reads}) == 1
    stdout = e2e.collect(plan, "stdout")
    assert stdout.data == data
    assert [len(r.data) for r in stdout.reads] == [MIB, MIB // 2]
    stderr = e2e.collect(plan, "stderr").data
    assert stderr.decode() == f"{digest_of(data).removeprefix('sha256:')}  /inputs/input.bin\n"

    released = e2e.release(plan)
    assert (released.state, released.outcome) == ("released", "succeeded")
    assert not e2e.attempt_dir(done).exists()


def test_a_nonzero_exit_fails_the_attempt_with_that_code(e2e: PodmanWorld) -> None:
    """The payload's exit status 7 comes back as failed, exit_code 7, kept after release."""
    plan = e2e.plan("echo before-exit; exit 7")
    e2e.prepare(plan)
    e2e.wait_ready(plan)
    e2e.start(plan)
    done = e2e.wait_settled(plan)
    assert (done.state, done.exit_code) == ("failed", 7), (done, e2e.collect(plan, "stderr").data)
    assert e2e.collect(plan, "stdout").data == b"before-exit\n"
    released = e2e.release(plan)
    assert (released.state, released.outcome, released.exit_code) == ("released", "failed", 7)


def test_the_memory_limit_is_enforced(e2e: PodmanWorld) -> None:
    """A subshell of the payload grows a 512 MiB shell variable under a 128 MiB plan:
    the kernel OOM-kills it inside the attempt's service (the kill is counted in the
    service's memory cgroup tree, read while the service still runs), it never printed
    `survived`, and the payload, told to end with the subshell's status, fails with
    137 (SIGKILL)."""
    hog = (
        "echo hogging; (x=$(head -c 536870912 /dev/urandom | tr -d '\\000'); echo survived); "
        "status=$?; echo subshell $status; "
        "while [ ! -e /work/go ]; do sleep 0.1; done; exit $status"
    )
    plan = e2e.plan(hog, memory_bytes=128 * MIB)
    running = e2e.run_to_running(plan)
    wait_for(
        lambda: b"subshell" in e2e.collect(plan, "stdout").data, "the subshell's end", WAIT_TIMEOUT
    )
    assert e2e.collect(plan, "stdout").data == b"hogging\nsubshell 137\n"
    assert e2e.oom_kills(plan) >= 1
    (e2e.attempt_dir(running) / "storage" / "go").touch()
    done = e2e.wait_settled(plan)
    assert (done.state, done.exit_code) == ("failed", 137), (done.reason, done)


def test_the_process_limit_is_enforced(e2e: PodmanWorld) -> None:
    """A payload forking 200 background sleeps under a 64-process plan sees fork
    failures: it records each successful fork in its output, and the count stays
    below the limit (Podman itself holds some of the 64)."""
    storm = (
        'last=; n=0; for i in $(seq 200); do sleep 60 & if [ "$!" != "$last" ]; then '
        "n=$((n+1)); last=$!; fi; echo $n > /work/forks.txt; done; echo all-forked"
    )
    plan = e2e.plan(storm, outputs=[("forks", "forks.txt")], processes=64)
    e2e.prepare(plan)
    e2e.wait_ready(plan)
    e2e.start(plan)
    done = e2e.wait_settled(plan)
    forks = int(e2e.collect(plan, "output:forks").data)
    assert 1 <= forks < 64, forks
    assert b"all-forked" not in e2e.collect(plan, "stdout").data
    assert b"can't fork" in e2e.collect(plan, "stderr").data
    assert done.state == "failed", done
    assert done.exit_code not in (None, 0), done


def test_stop_kills_the_whole_running_tree(e2e: PodmanWorld) -> None:
    """Stop of a running job: cancelled, cleanup confirmed, and /proc shows no process
    of the slot account (payload, its children, Podman, conmon, the pause process)."""
    plan = e2e.plan("sleep 1000 & sleep 1000 & echo started; wait")
    running = e2e.run_to_running(plan)
    slot_uid = e2e.slot_account(running.slot).uid
    wait_for(
        lambda: e2e.collect(plan, "stdout").data == b"started\n",
        "the payload's output",
        WAIT_TIMEOUT,
    )
    assert len(processes_of(slot_uid)) >= 3  # the shell and its two sleeps, at least
    e2e.stop(plan)
    done = e2e.wait_settled(plan)
    assert (done.state, done.cleanup_confirmed) == ("cancelled", True), done
    assert processes_of(slot_uid) == []
    assert e2e.release(plan).outcome == "cancelled"


def test_lease_expiry_stops_a_running_job(e2e: PodmanWorld) -> None:
    """A running job whose lease is renewed to end 1.5 s from now, and never again, is
    stopped by the host itself: expired, cleanup confirmed, nothing left running."""
    plan = e2e.plan("sleep 1000")
    running = e2e.run_to_running(plan)
    slot_uid = e2e.slot_account(running.slot).uid
    renewed = e2e.renew(plan, 2, now_ms() + 1500)
    assert (renewed.state, renewed.lease_sequence) == ("running", 2), renewed
    done = e2e.wait_settled(plan)
    assert (done.state, done.cleanup_confirmed) == ("expired", True), done
    assert processes_of(slot_uid) == []
    assert e2e.release(plan).outcome == "expired"


def test_an_allowed_device_opens_and_an_unlisted_one_is_refused(e2e: PodmanWorld) -> None:
    """The plan asks for the configured device `full` (/dev/full): the payload opens it.
    /dev/zero is visible in the container but in no policy: opening it is refused by
    the service's closed device policy (EPERM), and the gate's evidence shows the
    policy the payload ran under allowed 1:7 and not 1:5."""
    script = (
        "for d in /dev/full /dev/zero; do if (exec 3<>$d) 2>/dev/null; then echo $d opened; "
        "else echo $d refused; fi; done > /work/devices.txt; "
        "head -c 1 /dev/zero > /dev/null 2>> /work/devices.txt; exit 0"
    )
    plan = e2e.plan(script, outputs=[("devices", "devices.txt")], devices=[DEVICE])
    e2e.prepare(plan)
    e2e.wait_ready(plan)
    e2e.start(plan)
    done = e2e.wait_settled(plan)
    assert (done.state, done.exit_code) == ("succeeded", 0), done
    lines = e2e.collect(plan, "output:devices").data.decode().splitlines()
    assert lines[:2] == ["/dev/full opened", "/dev/zero refused"], lines
    assert "Operation not permitted" in lines[2], lines
    evidence = json.loads((e2e.attempt_dir(done) / "evidence" / "gate-evidence.json").read_text())
    # The policies the kernel applied: the v1 devices.list, or on cgroup v2 every
    # effective device program (an access needs all of them to allow it).
    if evidence["devices"] is not None:
        policies = [evidence["devices"]]
    else:
        policies = [program["rules"] for program in evidence["device_programs"]]
    assert policies, evidence
    assert None not in policies, evidence["device_programs"]
    # Rules granting read or write (the closed policy also grants `c *:* m`, mknod only).
    opens = [
        {
            (d["major"], d["minor"])
            for d in rules
            if d["type"] in ("a", "c") and set(d["access"]) & {"r", "w"}
        }
        for rules in policies
    ]
    assert all((1, 7) in granted for granted in opens), policies
    assert any(not granted & {(1, 5), (1, None), (None, None)} for granted in opens), policies


@pytest.mark.parametrize(
    "change", [tamper.touch, tamper.replace_with_copy], ids=["touched", "replaced_input"]
)
def test_a_changed_staged_input_refuses_start(
    e2e: PodmanWorld, change: Callable[[Path], None]
) -> None:
    """A streamed input whose staged file changes identity after it was complete and the
    attempt ready (its mtime touched, or the file replaced by a copy with the same
    bytes): the start row itself is refused `input_changed`, naming the input; the
    attempt reads failed/input_changed with its cleanup confirmed, no service was made
    and the payload never ran (its marker output is absent); a repeated start answers
    the same; release works as for any failed attempt."""
    data = b"staged input bytes\n"
    obj = _streamed(data, "data.txt")
    plan = e2e.plan("echo ran > /work/ran.txt", inputs=[obj], outputs=[("ran", "ran.txt")])
    e2e.prepare(plan)
    e2e.stream(plan, obj, data)
    ready = e2e.wait_ready(plan)
    staged = e2e.slot_path(ready.slot) / "ficc-staging" / plan.attempt_id / obj.id
    assert staged.read_bytes() == data
    change(staged)

    refused = e2e.driver.start_attempt(plan)
    assert row_code(refused) == "input_changed", refused
    assert "'data.txt'" in refused.error.message, refused
    assert "retry the job as a new attempt" in refused.error.message, refused
    done = e2e.wait_settled(plan)
    assert (done.state, done.outcome, done.reason) == ("failed", "failed", "input_changed"), done
    assert done.cleanup_confirmed, done
    assert not (e2e.attempt_dir(done) / "storage" / "ran.txt").exists()
    assert not (e2e.attempt_dir(done) / "control" / "release").exists()
    assert not isinstance(e2e.read(plan, "output:ran", 0), ReadRow)
    # Never started: no service was made, so nothing was read of one (protocol: an
    # attempt that never started has `usage: {"final": true}`).
    assert e2e.usage(plan).usage == Usage(final=True)
    assert row_code(e2e.driver.start_attempt(plan)) == "input_changed"

    released = e2e.release(plan)
    assert (released.state, released.outcome, released.reason) == (
        "released",
        "failed",
        "input_changed",
    ), released
    assert not e2e.attempt_dir(done).exists()
    assert not staged.parent.exists()


class _ReplacedBarrier:
    """Swap the installed barrier for a byte-identical copy (another inode); put the
    original back afterwards (the daemon re-verifies the pinned files on restart)."""

    def __init__(self, world: PodmanWorld) -> None:
        self.path = barrier_of(world.provider)
        self.copy = world.base / "barrier-copy"
        self.original = world.base / "barrier-original"

    def __enter__(self) -> os.stat_result:
        shutil.copy2(self.path, self.copy)
        os.rename(self.path, self.original)
        os.rename(self.copy, self.path)
        return os.stat(self.path)

    def __exit__(self, *exc: object) -> None:
        os.rename(self.original, self.path)


def test_a_replaced_barrier_is_refused_before_the_payload_runs(e2e: PodmanWorld) -> None:
    """The installed barrier is replaced by a copy after prepare: the provider's own start
    check (barrier identity recorded at prepare) refuses at once, the attempt fails
    (provider_failed), the gate never runs, and the payload never ran."""
    plan = e2e.plan("echo ran > /work/ran.txt")
    e2e.prepare(plan)
    ready = e2e.wait_ready(plan)
    with _ReplacedBarrier(e2e):
        e2e.start(plan)
        # A refusal is immediate; under the bug the attempt would sit in `starting`.
        done = e2e.wait_settled(plan, timeout=45)
    assert (done.state, done.reason) == ("failed", "provider_failed"), done
    attempt = e2e.attempt_dir(ready)
    assert not (attempt / "storage" / "ran.txt").exists()
    assert not (attempt / "evidence" / "gate-evidence.json").exists()
    assert not (attempt / "control" / "release").exists()


def test_a_replaced_barrier_the_provider_misses_is_refused_by_the_gate(e2e: PodmanWorld) -> None:
    """The host never trusts the provider after prepare. The barrier is replaced by a
    copy AND the provider's private record is rewritten to the copy's identity, so the
    provider starts it and reports it as the barrier. The host's gate compares the live
    process with the identities persisted at prepare: refused (the first failing check is
    reported: gate_mount, the barrier's bind mount is not the prepared one; gate_exe
    fails too), the evidence shows the copy's inode as the executable, no release
    marker, and the payload never ran."""
    plan = e2e.plan("echo ran > /work/ran.txt")
    e2e.prepare(plan)
    ready = e2e.wait_ready(plan)
    attempt = e2e.attempt_dir(ready)
    state_file = attempt / "provider" / "state.json"
    state = json.loads(state_file.read_text())
    original = (state["barrier_device"], state["barrier_inode"])
    with _ReplacedBarrier(e2e) as copy:
        state["barrier_device"], state["barrier_inode"] = copy.st_dev, copy.st_ino
        state_file.write_text(json.dumps(state))
        e2e.start(plan)
        done = e2e.wait_settled(plan)
    assert done.state == "failed", done
    assert done.reason in ("gate_exe", "gate_mount"), done
    evidence = json.loads((attempt / "evidence" / "gate-evidence.json").read_text())
    exe = evidence["exe"]["identity"]
    assert (exe["dev"], exe["ino"]) == (copy.st_dev, copy.st_ino) != original
    assert not (attempt / "control" / "release").exists()
    assert not (attempt / "storage" / "ran.txt").exists()


@pytest.mark.parametrize("disruption", ["sigkill", "clean restart", "power cut"])
def test_a_daemon_crash_or_restart_during_a_job_gives_unknown_and_no_second_run(
    e2e: PodmanWorld, disruption: str
) -> None:
    """SIGKILL of the daemon while a payload runs (or a clean restart: SIGTERM, under
    systemd `systemctl restart`), then a new daemon on the same ledger: the attempt is
    unknown (its outcome cannot be confirmed, so it is neither guessed nor replayed)
    with cleanup confirmed, no process of the slot account is left, the payload ran
    exactly once (it appends a line per run), and release removes the container from
    the slot's Podman storage.

    After a SIGKILL the backends differ, and both are checked: under cgroupfs the job
    outlives the daemon until the new one's recovery stops it; under systemd the
    attempt's unit is bound to the daemon's (BindsTo=), so systemd stops the work with
    the daemon, and its Restart=on-failure brings the daemon back.

    A power cut is what a reboot leaves: every process gone and /run (a tmpfs) empty,
    so the slot account's runtime directory, which Podman needs even to remove the
    container, no longer exists; release must still work."""
    plan = e2e.plan("echo run >> /work/runs.txt; sleep 1000", outputs=[("runs", "runs.txt")])
    running = e2e.run_to_running(plan)
    slot_uid = e2e.slot_account(running.slot).uid
    runs = e2e.attempt_dir(running) / "storage" / "runs.txt"
    wait_for(
        lambda: runs.exists() and runs.read_bytes() == b"run\n",
        "the payload's first run",
        WAIT_TIMEOUT,
    )

    containers = e2e.slot_path(running.slot) / "ficc-podman/storage/overlay-containers"
    assert f"ficc-{plan.attempt_id}" in (containers / "containers.json").read_text()

    if disruption == "sigkill":
        e2e.process.kill()  # the daemon gets no chance to stop anything
        if e2e.backend == "cgroupfs":
            assert processes_of(slot_uid) != [], "the job should outlive the daemon"
        else:
            wait_for(
                lambda: processes_of(slot_uid) == [], "systemd to stop the bound work", WAIT_TIMEOUT
            )
        e2e.restart()
    elif disruption == "power cut":
        e2e.process.kill()
        for pid in processes_of(slot_uid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        wait_for(lambda: processes_of(slot_uid) == [], "the slot's processes to die", WAIT_TIMEOUT)
        shutil.rmtree(f"/run/user/{slot_uid}")
        e2e.restart()
    else:
        e2e.restart_cleanly()
    after = e2e.wait_settled(plan)
    assert (after.state, after.outcome, after.exit_code) == ("unknown", "unknown", None), after
    assert after.cleanup_confirmed, after
    # Why unknown. Usually the new daemon's recovery says so (`executor_restarted`). But
    # `systemctl restart` stops the attempt's unit (ordered After= the daemon's) BEFORE
    # it stops the daemon: the old daemon may still see its service die without an
    # exit it can trust, and records that itself (never as a failure of the job).
    reasons = {"executor_restarted"}
    if disruption == "clean restart" and e2e.backend == "systemd":
        reasons |= {"outcome_unreadable", "outcome_conflict"}
    assert after.reason in reasons, after
    assert processes_of(slot_uid) == []
    assert runs.read_bytes() == b"run\n"

    released = e2e.release(plan)
    assert (released.state, released.outcome) == ("released", "unknown")
    assert f"ficc-{plan.attempt_id}" not in (containers / "containers.json").read_text()


def test_the_smoke_test_command_runs_one_job_and_leaves_nothing_behind(e2e: PodmanWorld) -> None:
    """`ficc-executor smoke-test --config FILE`, an administrator's first job, runs a job
    through the running daemon as the transport account with the configured image, says
    each step and passes; its attempt is released (the slot is free again)."""
    before = {a.attempt_id for a in e2e.driver.snapshot().attempts}
    command = [str(FICC_EXECUTOR), "smoke-test"]
    shown = subprocess.run(
        [*command, "--config", str(e2e.layout.config_path), "--timeout", "120"],
        capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert shown.returncode == 0, shown.stdout + shown.stderr
    lines = shown.stdout.splitlines()
    for step in ("snapshot:", "prepare: admitted", "ready:", "start: accepted", "run: the payload"):
        assert any(step in line for line in lines), (step, shown.stdout)
    assert "payload said: ficc smoke test: the payload ran" in shown.stdout
    assert lines[-1] == "smoke test passed"
    (new,) = [a for a in e2e.driver.snapshot().attempts if a.attempt_id not in before]
    assert (new.state, new.outcome, new.cleanup_confirmed) == ("released", "succeeded", True)
    assert not list(e2e.base.glob(f"slots/*/ficc/{new.attempt_id}")), "the attempt's directory"


def test_the_smoke_test_reports_a_failed_job_and_still_releases_it(e2e: PodmanWorld) -> None:
    before = {a.attempt_id for a in e2e.driver.snapshot().attempts}
    command = [str(FICC_EXECUTOR), "smoke-test"]
    shown = subprocess.run(
        [*command, "--config", str(e2e.layout.config_path), "--", "/bin/sh", "-c", "exit 3"],
        capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert shown.returncode == 1, shown.stdout + shown.stderr
    (failed,) = [line for line in shown.stdout.splitlines() if "FAILED: run:" in line]
    assert "the attempt ended failed" in failed, shown.stdout
    assert "exit code 3" in failed, shown.stdout
    assert shown.stdout.splitlines()[-1] == "smoke test FAILED"
    (new,) = [a for a in e2e.driver.snapshot().attempts if a.attempt_id not in before]
    assert (new.state, new.outcome) == ("released", "failed")


def test_the_documented_first_job_plan_runs_with_the_podman_provider(e2e: PodmanWorld) -> None:
    """docs/examples/podman-first-job.json, with its `<...>` fields filled in from the
    host and its input file as the docs say, is a plan the reference provider runs, sent
    step by step as a controller would (`ficc-executor run` fills and sends it too:
    test_run_command.py)."""
    template = json.loads((REPOSITORY / "docs" / "examples" / "podman-first-job.json").read_text())
    greeting = b"greetings from the input\n"
    (item,) = template["job"]["inputs"]
    item.update(id=os.urandom(16).hex(), bytes=len(greeting), digest=digest_of(greeting))
    snapshot = e2e.driver.snapshot()
    config = e2e.layout.config
    template.update(
        deployment_id=config.deployment_id, node_id=config.node_id,
        project_id=(snapshot.offer.limits.projects or [os.urandom(16).hex()])[0],
        job_id=os.urandom(16).hex(), attempt_id=os.urandom(16).hex(),
        offer_revision=snapshot.offer.revision,
    )  # fmt: skip
    template["job"]["slot_class"] = config.slots[0].slot_class
    runtime = template["job"]["runtime"]
    runtime.update(package_digest=e2e.provider.digest, image_digest=e2e.image["image_id"])
    assert "<" not in json.dumps(template), "a field the docs mark to fill in was left"
    plan = decode_plan(json.dumps(template).encode())
    e2e.plans.append(plan)
    e2e.prepare(plan)
    e2e.stream(plan, plan.job.inputs[0], greeting)
    e2e.wait_ready(plan)
    e2e.start(plan)
    done = e2e.wait_settled(plan)
    assert (done.state, done.exit_code) == ("succeeded", 0), done
    assert e2e.collect(plan, "stdout").data.startswith(b"hello from the first job\n")
    assert e2e.collect(plan, "output:greeting").data == greeting.upper()
    assert e2e.release(plan).state == "released"


def test_a_replaced_input_link_in_the_runtime_layout_fails_start_with_input_changed(
    e2e: PodmanWorld,
) -> None:
    """The staged file is intact, but the provider's hard link of it in its runtime
    layout was replaced by another file: the provider's check at start refuses it, and
    the attempt fails `input_changed` (not a generic `provider_failed`); the payload
    never runs."""
    data = b"staged input bytes\n"
    obj = _streamed(data, "data.txt")
    plan = e2e.plan("echo ran > /work/ran.txt", inputs=[obj], outputs=[("ran", "ran.txt")])
    e2e.prepare(plan)
    e2e.stream(plan, obj, data)
    ready = e2e.wait_ready(plan)
    link = e2e.attempt_dir(ready) / "provider" / "inputs" / "data.txt"
    assert link.read_bytes() == data
    replacement = link.with_name("replacement")
    shutil.copy2(link, replacement)  # same bytes, mode and owner; another file
    os.replace(replacement, link)
    e2e.start(plan)
    done = e2e.wait_settled(plan)
    assert (done.state, done.reason) == ("failed", "input_changed"), done
    assert not (e2e.attempt_dir(done) / "storage" / "ran.txt").exists()
