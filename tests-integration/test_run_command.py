"""`ficc-executor run` against the real daemon and real rootless Podman, run as the
real transport account (a forked process with its UID and GID, no groups), with the
arguments an integrator types: one command per job.

Each test reads the evidence from the real system: the command's exit status and
what it printed, the files it collected into its output directory, and the daemon's
own record of the attempt (its snapshot, which `status` prints).
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import sys
import traceback
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from ficc.execution.host import commands
from ficc.execution.plan import Plan, decode_plan
from ficc.execution.wire import AttemptStatus
from ficc_testkit.accounts import Account
from ficc_testkit.podman import SLOT_CLASS, WAIT_TIMEOUT, PodmanWorld
from ficc_testkit.waits import wait_for
from podman_support import NEEDS_PODMAN

pytestmark = NEEDS_PODMAN
REPOSITORY = Path(__file__).resolve().parent.parent
EXAMPLE = REPOSITORY / "docs" / "examples" / "podman-first-job.json"
GREETING = b"greetings from the input file\n"


@pytest.fixture
def work(e2e: PodmanWorld) -> Iterator[Path]:
    """A working directory of the transport account's own, with the example plan and
    an input file in it."""
    path = e2e.base / f"work-{secrets.token_hex(4)}"
    path.mkdir(mode=0o700)
    shutil.copy(EXAMPLE, path / "plan.json")
    (path / "greeting.txt").write_bytes(GREETING)
    for item in [path, *path.iterdir()]:
        os.chown(item, e2e.transport.uid, e2e.transport.gid)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@dataclass
class Ran:
    """What a finished command left: its exit status and everything it printed."""

    returncode: int
    stdout: str
    stderr: str


class Command:
    """`ficc-executor run` (the console command's own `main`) in a forked child that
    drops to the transport account's UID and GID with no groups, its stdout and stderr
    in files: the account needs no access to the interpreter or the source tree (the
    test kit's `run_as` does the same)."""

    def __init__(self, world: PodmanWorld, work: Path, argv: list[str], logs: Path) -> None:
        self.logs = logs
        sys.stdout.flush()
        sys.stderr.flush()
        with open(logs / "stdout", "wb") as out, open(logs / "stderr", "wb") as err:
            self.pid = os.fork()
            if self.pid == 0:  # pragma: no cover - the child
                self._child(world.transport, work, argv, out.fileno(), err.fileno())

    @staticmethod
    def _child(account: Account, work: Path, argv: list[str], out: int, err: int) -> None:
        status = 70
        try:
            os.dup2(out, 1)
            os.dup2(err, 2)
            sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115
            sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
            os.setgroups([])
            os.setresgid(account.gid, account.gid, account.gid)
            os.setresuid(account.uid, account.uid, account.uid)
            os.chdir(work)
            signal.signal(signal.SIGINT, signal.default_int_handler)
            status = commands.main(["run", *argv])
        except BaseException:
            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(status)

    def send_signal(self, number: int) -> None:
        os.kill(self.pid, number)

    def wait(self, timeout: float = 600) -> Ran:
        """Until the command exits; what it left."""
        (status,) = wait_for(self._exited, "the command's exit", timeout)
        out, err = (self.logs.joinpath(name).read_text() for name in ("stdout", "stderr"))
        return Ran(status, out, err)

    def _exited(self) -> tuple[int] | None:
        pid, status = os.waitpid(self.pid, os.WNOHANG)
        return (os.waitstatus_to_exitcode(status),) if pid else None


def _base(world: PodmanWorld, *argv: str) -> list[str]:
    """The flags the transport account gives: the transport socket, and the two IDs
    only the host's configuration holds."""
    config = world.layout.config
    return [
        "--socket", world.socket, "--deployment", config.deployment_id,
        "--node", config.node_id, *argv,
    ]  # fmt: skip


def start_command(world: PodmanWorld, work: Path, *argv: str, base: bool = True) -> Command:
    """Start `ficc-executor run ARGV` as the transport account."""
    logs = work.parent / f"{work.name}-logs-{secrets.token_hex(2)}"
    logs.mkdir()
    return Command(world, work, _base(world, *argv) if base else list(argv), logs)


def run_command(world: PodmanWorld, work: Path, *argv: str, base: bool = True) -> Ran:
    """Run `ficc-executor run ARGV` to its end as the transport account."""
    return start_command(world, work, *argv, base=base).wait()


def attempts(world: PodmanWorld) -> dict[str, AttemptStatus]:
    """Every attempt the daemon records (what `status` shows), by ID."""
    return {a.attempt_id: a for a in world.driver.snapshot().attempts}


def planned(world: PodmanWorld, directory: Path) -> Plan:
    """The plan a running command wrote down before it sent anything (tracked, so the
    world's cleanup releases it should the test fail)."""
    plan = decode_plan(wait_for(lambda: _read(directory / "plan.json"), "the plan written"))
    world.plans.append(plan)
    return plan


def _read(path: Path) -> bytes | None:
    return path.read_bytes() if path.exists() and path.stat().st_size else None


def test_the_example_plan_with_an_input_runs_and_lands_in_its_directory(
    e2e: PodmanWorld, work: Path
) -> None:
    """docs/examples/podman-first-job.json, placeholders and all, with its input file:
    filled from the host, streamed, run, collected and released by one command."""
    before = set(attempts(e2e))
    shown = run_command(
        e2e, work, "--plan", "plan.json", "--input", "greeting.txt=greeting.txt",
        "--image", e2e.image["image_id"], "--output-dir", "out",
    )  # fmt: skip
    assert shown.returncode == 0, shown.stdout + shown.stderr
    out = work / "out"
    assert shown.stdout.strip() == str(out)
    assert (out / "stdout").read_bytes().startswith(b"hello from the first job\nuid=")
    assert (out / "stderr").read_bytes() == b""
    assert (out / "outputs" / "greeting").read_bytes() == GREETING.upper()
    plan = decode_plan((out / "plan.json").read_bytes())
    assert plan.job.inputs[0].bytes == len(GREETING)
    assert plan.job.runtime.package_digest == e2e.provider.digest
    for step in ("prepare: admitted", "upload: greeting.txt complete", "start: accepted",
                 "run: the payload exited 0", "collect: output:greeting, 30 bytes",
                 "release: released (outcome succeeded)"):  # fmt: skip
        assert step in shown.stderr, (step, shown.stderr)
    (new,) = set(attempts(e2e)) - before
    assert new == plan.attempt_id
    record = attempts(e2e)[new]
    assert (record.state, record.outcome, record.exit_code) == ("released", "succeeded", 0)
    result = json.loads((out / "result.json").read_text())
    assert (result["state"], result["exit_code"]) == ("released", 0)


def test_a_job_that_exits_non_zero_returns_its_exit_code(e2e: PodmanWorld, work: Path) -> None:
    """The job's own exit status is the command's; its logs are collected all the same."""
    shown = run_command(
        e2e, work, "--image", e2e.image["image_id"], "--output-dir", "out",
        "--", "/bin/sh", "-c", "echo to stdout; echo to stderr >&2; exit 7",
    )  # fmt: skip
    assert shown.returncode == 7, shown.stdout + shown.stderr
    assert (work / "out" / "stdout").read_bytes() == b"to stdout\n"
    assert (work / "out" / "stderr").read_bytes() == b"to stderr\n"
    assert "outcome failed (reason exited, exit code 7)" in shown.stderr


def test_an_image_and_a_command_line_are_one_job(e2e: PodmanWorld, work: Path) -> None:
    """`run --image DIGEST --class CLASS -- /bin/echo hi`: the plan is built from the
    snapshot, the output directory is named after the attempt."""
    shown = run_command(
        e2e, work, "--image", e2e.image["image_id"], "--class", SLOT_CLASS, "--memory", "64M",
        "--input", "words=greeting.txt", "--output", "count=count.txt",
        "--", "/bin/sh", "-c", "wc -c < /inputs/words > /work/count.txt; echo hi",
    )  # fmt: skip
    assert shown.returncode == 0, shown.stdout + shown.stderr
    out = Path(shown.stdout.strip())
    plan = decode_plan((out / "plan.json").read_bytes())
    assert out == work / f"ficc-run-{plan.attempt_id}"
    assert (plan.generation, plan.job.slot_class, plan.job.limits.memory_bytes) == (
        1, SLOT_CLASS, 64 << 20,
    )  # fmt: skip
    assert (out / "stdout").read_bytes() == b"hi\n"
    assert (out / "outputs" / "count").read_text().strip() == str(len(GREETING))
    assert attempts(e2e)[plan.attempt_id].state == "released"


def test_the_lease_is_renewed_while_the_job_runs_past_it(e2e: PodmanWorld, work: Path) -> None:
    """A 6 s lease and a job of 15 s: the command renews it while it waits, so the
    host never expires the job, and the job's own exit status comes back."""
    shown = run_command(
        e2e, work, "--image", e2e.image["image_id"], "--lease", "6", "--output-dir", "out",
        "--", "/bin/sh", "-c", "sleep 15; exit 3",
    )  # fmt: skip
    assert shown.returncode == 3, shown.stdout + shown.stderr
    plan = decode_plan((work / "out" / "plan.json").read_bytes())
    record = attempts(e2e)[plan.attempt_id]
    assert (record.outcome, record.exit_code) == ("failed", 3)
    assert record.lease_sequence >= 4, record  # renewed every 2 s for 15 s


def test_an_interrupted_run_stops_the_job_and_releases_it(e2e: PodmanWorld, work: Path) -> None:
    """SIGINT while the job runs: the command stops it, collects what it wrote,
    releases it and exits 130; the daemon shows it released."""
    process = start_command(
        e2e, work, "--image", e2e.image["image_id"], "--output-dir", "out",
        "--", "/bin/sh", "-c", "echo started; while :; do sleep 1; done",
    )  # fmt: skip
    plan = planned(e2e, work / "out")
    e2e.wait(plan, lambda r: r.state == "running", "running")
    process.send_signal(signal.SIGINT)
    shown = process.wait(WAIT_TIMEOUT)
    assert shown.returncode == 130, shown.stdout + shown.stderr
    assert "interrupted: stopping the job, then releasing it" in shown.stderr
    record = attempts(e2e)[plan.attempt_id]
    assert (record.state, record.outcome, record.cleanup_confirmed) == (
        "released", "cancelled", True,
    )  # fmt: skip
    assert (work / "out" / "stdout").read_bytes() == b"started\n"


def test_detach_leaves_the_job_running_and_resume_finishes_it(e2e: PodmanWorld, work: Path) -> None:
    """`--detach` and SIGTERM: the job keeps running, the command prints how to resume
    and exits 130; `run --resume DIR` follows it to its end and releases it."""
    process = start_command(
        e2e, work, "--image", e2e.image["image_id"], "--detach", "--output-dir", "out",
        "--", "/bin/sh", "-c", "while [ ! -e /work/go ]; do sleep 0.1; done; echo went",
    )  # fmt: skip
    plan = planned(e2e, work / "out")
    running = e2e.wait(plan, lambda r: r.state == "running", "running")
    process.send_signal(signal.SIGTERM)
    detached = process.wait(WAIT_TIMEOUT)
    assert detached.returncode == 130, detached.stdout + detached.stderr
    resume = f"ficc-executor run --resume {work / 'out'}"
    assert f"to finish it: {resume}" in detached.stderr
    assert attempts(e2e)[plan.attempt_id].state == "running"
    (e2e.attempt_dir(running) / "storage" / "go").touch()
    shown = run_command(e2e, work, "--resume", str(work / "out"), base=False)
    assert shown.returncode == 0, shown.stdout + shown.stderr
    assert (work / "out" / "stdout").read_bytes() == b"went\n"
    assert attempts(e2e)[plan.attempt_id].state == "released"


@pytest.mark.parametrize(
    ("argv", "code", "says"),
    [
        (["--input", "greeting.txt=missing.txt"], "run_input_unreadable", "cannot read the file"),
        (["--input", "greeting.txt=greeting.txt", "--input", "other.txt=greeting.txt"],
         "run_input_undeclared", "the plan declares no input 'other.txt'"),
        ([], "run_input_not_given", "add --input greeting.txt=FILE"),
        (["--input", "greeting.txt=greeting.txt", "--plan", "broken.json"],
         "run_plan_invalid", "broken.json is not a JSON plan"),
    ],
)  # fmt: skip
def test_bad_input_is_refused_before_anything_is_reserved(
    e2e: PodmanWorld, work: Path, argv: list[str], code: str, says: str
) -> None:
    (work / "broken.json").write_text('{"version": 1, "job": {')
    before = attempts(e2e)
    plan = [] if "--plan" in argv else ["--plan", "plan.json"]
    shown = run_command(e2e, work, *plan, *argv, "--image", e2e.image["image_id"])
    assert shown.returncode == 125, shown.stdout + shown.stderr
    assert shown.stderr.startswith(f"{code}: "), shown.stderr
    assert says in shown.stderr
    assert attempts(e2e) == before  # nothing admitted, nothing reserved
    assert not list(work.glob("ficc-run-*")), "an output directory was left"
