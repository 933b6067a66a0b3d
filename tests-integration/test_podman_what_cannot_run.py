"""What cannot run, said plainly, through the real daemon and real rootless Podman.

A plan below what the Podman provider states its runtime needs (`minimum_limits()`,
read when the provider was configured) is refused at admission, with the figure to ask
for and nothing reserved; a plan at exactly that minimum runs. A payload whose program
does not exist, or cannot be executed, ends with the shell's status (127, 126), and the
barrier's report (the path and the C library's reason) is the row's `detail` and a
`runtime_error` event in the daemon's log, where before there was only a status.
"""

from __future__ import annotations

import msgspec
import pytest

from ficc.execution.plan import Plan
from ficc.execution.wire import AttemptRow, ErrorRow
from ficc_provider_podman.driver import MINIMUM_LIMITS
from ficc_testkit.daemons import DaemonProcess
from ficc_testkit.driver import rows
from ficc_testkit.podman import PodmanWorld
from ficc_testkit.units import MIB
from podman_support import NEEDS_PODMAN

pytestmark = NEEDS_PODMAN

MINIMUM_MEMORY = MINIMUM_LIMITS.memory_bytes or 0
MINIMUM_PROCESSES = MINIMUM_LIMITS.processes or 0


@pytest.fixture
def podman(e2e: PodmanWorld) -> PodmanWorld:
    """The shared world, cleaned after each test (conftest's `e2e`)."""
    return e2e


def _with_argv(world: PodmanWorld, plan: Plan, argv: list[str]) -> Plan:
    """`plan` (the world's last) running `argv` instead; the world tracks the new one."""
    payload = msgspec.structs.replace(plan.job.payload, argv=argv)
    changed = msgspec.structs.replace(plan, job=msgspec.structs.replace(plan.job, payload=payload))
    world.plans[world.plans.index(plan)] = changed
    return changed


def _ran(world: PodmanWorld, plan: Plan) -> AttemptRow:
    world.prepare(plan)
    world.wait_ready(plan)
    world.start(plan)
    return world.wait_settled(plan)


def _runtime_errors(world: PodmanWorld, plan: Plan) -> list[dict[str, object]]:
    """The daemon's `runtime_error` events of `plan` (a daemon that is a child of the
    test; a unit's journal is read by the systemd lane)."""
    if not isinstance(world.process, DaemonProcess):
        pytest.skip("the structured log is read from a daemon the test started")
    wanted = {"event": "runtime_error", "attempt_id": plan.attempt_id}
    return [e for e in world.process.events() if wanted.items() <= e.items()]


def test_a_plan_below_the_runtimes_memory_is_refused_with_the_figure_and_holds_nothing(
    podman: PodmanWorld,
) -> None:
    """8 MiB: before, admitted and then `barrier_exited` with `Killed`. Now refused at
    prepare, before anything is reserved and before any provider method runs: the
    snapshot's capacity is as it was, and the refusal is a durable failed record."""
    before = podman.driver.snapshot().capacity
    plan = podman.plan("true", memory_bytes=8 * MIB)
    (row,) = rows(podman.driver.prepare([plan]))
    assert isinstance(row, ErrorRow), row
    assert row.error.code == "admission_rejected"
    assert row.error.message.startswith(
        f"limits_below_minimum: memory_bytes {8 * MIB} is below the {MINIMUM_MEMORY} the"
        f" podman runtime needs; ask for at least {MINIMUM_MEMORY}"
    ), row.error.message
    assert podman.driver.snapshot().capacity == before
    kept = podman.observe(plan)
    assert (kept.state, kept.reason, kept.slot) == ("failed", "admission_rejected", None)
    assert kept.cleanup_confirmed
    too_few = podman.plan("true", processes=MINIMUM_PROCESSES - 1)
    (row,) = rows(podman.driver.prepare([too_few]))
    assert isinstance(row, ErrorRow), row
    assert f"processes {MINIMUM_PROCESSES - 1} is below the {MINIMUM_PROCESSES}" in (
        row.error.message
    )
    assert podman.driver.snapshot().capacity == before


def test_a_plan_at_exactly_the_runtimes_minimum_runs(podman: PodmanWorld) -> None:
    plan = podman.plan("echo ran", memory_bytes=MINIMUM_MEMORY, processes=MINIMUM_PROCESSES)
    done = _ran(podman, plan)
    assert (done.state, done.reason, done.exit_code) == ("succeeded", "exited", 0), done
    assert podman.collect(plan, "stdout").data == b"ran\n"


def test_a_missing_program_ends_127_and_says_which_and_why(podman: PodmanWorld) -> None:
    """Before: exit 124 and `execve of the payload failed`, neither the path nor why."""
    program = "/no/such/program"
    plan = _with_argv(podman, podman.plan("true"), [program, "--flag"])
    done = _ran(podman, plan)
    assert (done.state, done.reason, done.exit_code) == ("failed", "exited", 127), done
    said = f"ficc-barrier: cannot execute {program}: No such file or directory (errno 2)"
    assert podman.driver.observe(plan, detail=True).detail == said
    assert podman.collect(plan, "stderr").data.decode().endswith(said + "\n")
    (event,) = _runtime_errors(podman, plan)
    assert (event["code"], event["exit_code"], event["runtime_stderr"]) == (
        "exec_failed", 127, said,
    )  # fmt: skip


def test_a_program_that_cannot_be_executed_ends_126_and_says_why(podman: PodmanWorld) -> None:
    """/etc/passwd is in the image, not executable: `Permission denied`, status 126."""
    plan = _with_argv(podman, podman.plan("true"), ["/etc/passwd"])
    done = _ran(podman, plan)
    assert (done.state, done.reason, done.exit_code) == ("failed", "exited", 126), done
    detail = podman.driver.observe(plan, detail=True).detail
    assert detail == "ficc-barrier: cannot execute /etc/passwd: Permission denied (errno 13)"


def test_a_payload_that_exits_127_by_itself_gets_no_detail(podman: PodmanWorld) -> None:
    """The payload ran (its shell found no `nope`): its own output never becomes a
    detail, only the barrier's report does."""
    plan = podman.plan("nope")
    done = _ran(podman, plan)
    assert (done.state, done.exit_code) == ("failed", 127), done
    assert b"nope" in podman.collect(plan, "stderr").data
    assert podman.driver.observe(plan, detail=True).detail is msgspec.UNSET
