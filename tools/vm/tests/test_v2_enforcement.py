"""What the kernel enforces on a production host: one unified cgroup v2 tree with
every controller, and systemd as PID 1 (run only inside the VM lane's guest).

The Podman end-to-end and usage suites run there too (memory and process limits,
stop, leases, the OOM outcome); this file adds what only such a host can show: the
tree itself, and a CPU spinner held to its plan's `cpu.max` share, measured by the
attempt's own usage figures and printed as the lane's figure. Both backends.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tests-integration"))
from ficc_testkit.podman import PodmanWorld
from ficc_testkit.waits import wait_for
from podman_support import BACKENDS, NEEDS_PODMAN, children_cpu_us, each_test, podman_world

pytestmark = [
    NEEDS_PODMAN,
    pytest.mark.skipif(
        os.environ.get("FICC_VM_LANE") != "1",
        reason="runs only in the VM lane's guest (tools/vm/run.py, `nox -s vm`)",
    ),
]

EVERY_CONTROLLER = {"cpuset", "cpu", "io", "memory", "pids"}
SPIN_MILLIS = 250
"""A quarter of one CPU: `cpu.max` 25000 100000."""
SPIN_SECONDS = 8
PROCESSES = 64
"""The fork bomb's plan: Podman and conmon hold about 30 of them here (Go threads count
as tasks; a 32-task plan left Podman none to start with), as the end-to-end suite's
process test allows for too."""
GO = "while [ ! -e /work/go ]; do sleep 0.1; done"
"""The payload waits until the test has read its live cgroup (the test writes `go`)."""


@pytest.fixture(scope="module", params=BACKENDS)
def world(request: pytest.FixtureRequest) -> Iterator[PodmanWorld]:
    with podman_world(request.param) as built:
        yield built


@pytest.fixture
def v2(request: pytest.FixtureRequest, world: PodmanWorld) -> Iterator[PodmanWorld]:
    yield from each_test(request, world)


def figure(**fields: object) -> None:
    """One measured figure on the guest's console, collected by the lane."""
    print("\nFICC-FIGURE " + json.dumps(fields, sort_keys=True), flush=True)


def test_the_tree_is_one_unified_v2_tree_with_every_controller() -> None:
    assert Path("/sys/fs/cgroup/cgroup.controllers").exists(), "not a pure cgroup v2 host"
    controllers = set(Path("/sys/fs/cgroup/cgroup.controllers").read_text().split())
    assert controllers >= EVERY_CONTROLLER, controllers
    assert Path("/proc/1/comm").read_text().strip() == "systemd"


def test_a_cpu_spinner_is_held_to_its_cpu_max_share(v2: PodmanWorld) -> None:
    """A busy loop for SPIN_SECONDS under a quarter-CPU plan: the live cgroup's
    `cpu.max` is the plan's, and the CPU time the spinner itself used (the shell's
    `times`, inside the container) over its wall time is about a quarter: the kernel's
    bandwidth controller throttles it every 100 ms. The service's whole CPU time (the
    usage figures, Podman's share included) is printed beside it."""
    spin = f"timeout {SPIN_SECONDS} sh -c 'while :; do :; done'; times"
    plan = v2.plan(spin, cpu_millis=SPIN_MILLIS)
    v2.run_to_running(plan)
    cpu_max = (v2.service_cgroup(plan, "cpu") / "cpu.max").read_text().split()
    assert cpu_max == [str(SPIN_MILLIS * 100), "100000"], cpu_max
    done = v2.wait_settled(plan)
    assert (done.state, done.exit_code) == ("succeeded", 0), done
    spun_s = children_cpu_us(v2.collect(plan, "stdout").data) / 1e6
    wait_for(lambda: v2.usage(plan).usage.final, "the final usage figures")  # type: ignore[union-attr]
    used = v2.usage(plan).usage
    assert used is not None
    assert used.cpu_user_us is not None
    assert used.cpu_system_us is not None
    share = spun_s / SPIN_SECONDS / (SPIN_MILLIS / 1000)
    figure(test="cpu.max", backend=v2.backend, spinner_cpu_seconds=round(spun_s, 3),
           service_cpu_seconds=round((used.cpu_user_us + used.cpu_system_us) / 1e6, 3),
           spin_seconds=SPIN_SECONDS, limit_cpus=SPIN_MILLIS / 1000,
           ratio_to_limit=round(share, 3))  # fmt: skip
    assert share <= 1.1, f"the spinner used {share:.2f}x its cpu.max share"
    assert share >= 0.5, f"the spinner got only {share:.2f}x its share (starved?)"


def test_a_memory_bomb_is_killed_at_memory_max_and_the_outcome_says_so(v2: PodmanWorld) -> None:
    limit = 96 << 20
    bomb = "exec awk 'BEGIN { s = \"x\"; while (1) s = s s }'"
    plan = v2.plan(f"{GO}; {bomb}", memory_bytes=limit)
    running = v2.run_to_running(plan)
    memory_max = (v2.service_cgroup(plan, "memory") / "memory.max").read_text().strip()
    (v2.attempt_dir(running) / "storage" / "go").touch()
    done = v2.wait_settled(plan)
    used = v2.usage(plan).usage
    assert used is not None
    figure(test="memory.max", backend=v2.backend, memory_max=memory_max, reason=done.reason,
           exit_code=done.exit_code, oom_kills=used.oom_kills,
           memory_peak_bytes=used.memory_peak_bytes)  # fmt: skip
    assert memory_max == str(limit)
    assert (done.state, done.reason, done.exit_code) == ("failed", "memory_exhausted", 137), done
    assert used.oom_kills is not None, used
    assert used.oom_kills >= 1, used


def test_a_fork_bomb_stops_at_pids_max(v2: PodmanWorld) -> None:
    fork_loop = (
        'last=; n=0; for i in $(seq 200); do sleep 60 & if [ "$!" != "$last" ]; then '
        "n=$((n+1)); last=$!; fi; echo $n > /work/forks.txt; done; echo all-forked"
    )
    storm = f"{GO}; {fork_loop}"
    plan = v2.plan(storm, outputs=[("forks", "forks.txt")], processes=PROCESSES)
    running = v2.run_to_running(plan)
    pids_max = (v2.service_cgroup(plan, "pids") / "pids.max").read_text().strip()
    (v2.attempt_dir(running) / "storage" / "go").touch()
    done = v2.wait_settled(plan)
    forks = int(v2.collect(plan, "output:forks").data)
    figure(test="pids.max", backend=v2.backend, pids_max=pids_max, forks=forks,
           state=done.state)  # fmt: skip
    assert pids_max == str(PROCESSES)
    assert 1 <= forks < PROCESSES, forks
    assert b"all-forked" not in v2.collect(plan, "stdout").data
