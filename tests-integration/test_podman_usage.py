"""What a job cost, through the real daemon and real rootless Podman.

Each test runs a payload whose use is known (a CPU spinner, a memory hog, a memory bomb,
a writer, a forking shell), asks `observe` with `usage: true`, and compares what the
host read from the kernel's counters of the attempt's service with what the payload
did. The service holds Podman and conmon too, so CPU time, memory and processes are at
least the payload's own and more by Podman's share: the bounds below say by how much.
The figures are recorded when the attempt ends and survive a daemon restart and a
release unchanged.

Each test prints its figures as `usage-table|figure|payload|read|expected|backend`
lines (run with `-s` to see them). Like the end-to-end suite it runs with `cgroupfs`
here and with `systemd` inside the systemd container (tools/systemd/run.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest
from prometheus_client.parser import text_string_to_metric_families

from ficc.execution.plan import Plan
from ficc.execution.protocol import MetricsRequest
from ficc.execution.wire import AttemptRow, MetricsReply, PayloadUsage, Usage
from ficc_testkit.plans import new_id
from ficc_testkit.podman import SLOT_CLASS, PodmanWorld
from ficc_testkit.units import MIB
from podman_support import NEEDS_PODMAN, children_cpu_us

pytestmark = NEEDS_PODMAN

COMMAND = Path(sys.executable).parent / "ficc-executor"
SPIN_SECONDS = 1
HOG_BYTES = 64 * MIB
BOMB_LIMIT = 160 * MIB
OVERSHOOT = 1 * MIB
"""How far a v2 `memory.peak` may pass `memory.max`: the kernel charges a few pages
beyond the limit for allocations that must not fail (measured: one page, on Debian 12's
6.1 kernel under systemd)."""
WRITTEN_FILES = 8
WRITTEN_BYTES = WRITTEN_FILES * MIB
FORKS = 20
PODMAN_CPU_US = int(os.environ.get("FICC_TEST_PODMAN_CPU_US", "1000000"))
"""What Podman, conmon and the runtime may add to a payload's CPU time in its service
(measured on this 2-core host at about a quarter of a second; under the VM lane's
software emulation, where Podman itself runs about 20x slower, at 5 to 7 s, so the
lane sets this higher)."""
PAYLOAD_SLACK_US = int(os.environ.get("FICC_TEST_PAYLOAD_SLACK_US", "100000"))
"""What the payload's own node may count beyond its processes' `times`: the barrier's
last polls after it was moved there and the shell itself (measured here at about
0.04 s; the VM lane's software emulation sets this higher)."""
SLOT_SLACK_BYTES = 2 * MIB
"""What a run adds to its slot beyond its payload's files (logs, the provider's files)."""
SLOT_SLACK_INODES = 64


@pytest.fixture
def usage(e2e: PodmanWorld) -> PodmanWorld:
    """The shared world, cleaned after each test (conftest's `e2e`)."""
    return e2e


def _table(world: PodmanWorld, figure: str, payload: str, read: object, expected: str) -> None:
    print(f"\nusage-table|{figure}|{payload}|{read}|{expected}|{world.backend}")


def _finished(world: PodmanWorld, plan: Plan) -> tuple[AttemptRow, Usage]:
    """Run `plan` to its end; the settled row with its (final) usage."""
    world.prepare(plan)
    world.wait_ready(plan)
    world.start(plan)
    world.wait_settled(plan)
    row = world.usage(plan)
    assert isinstance(row.usage, Usage), row
    assert row.usage.final, row
    return row, row.usage


def _shown_bytes(n: int) -> list[str]:
    """How `ficc-executor status` shows a byte count (`12.3 MiB`), as words."""
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return [f"{n / size:.1f}", unit]
    return [str(n), "B"]


def _cpu_us(used: Usage) -> int:
    assert isinstance(used.cpu_user_us, int), used
    assert isinstance(used.cpu_system_us, int), used
    return used.cpu_user_us + used.cpu_system_us


def test_a_cpu_spinner_costs_its_cpu_second_and_is_read_live(usage: PodmanWorld) -> None:
    """The spinner busy-loops for one second of wall time, then the shell prints the CPU
    time its children used (`times`). The service's CPU time is at least that and at
    most Podman's share more; the wall time is at least the second."""
    script = f"timeout {SPIN_SECONDS} sh -c 'while :; do :; done'; times"
    plan = usage.plan(script)
    usage.run_to_running(plan)
    live = usage.usage(plan).usage
    assert isinstance(live, Usage), live
    if not live.final:  # still running: a live reading, not the record
        assert isinstance(live.cpu_user_us, int), live
    usage.wait_settled(plan)
    row = usage.usage(plan)
    used = row.usage
    assert isinstance(used, Usage)
    assert used.final
    assert (row.state, row.exit_code) == ("succeeded", 0), row
    spun_us = children_cpu_us(usage.collect(plan, "stdout").data)
    cpu = _cpu_us(used)
    _table(usage, "cpu_user_us+cpu_system_us", "spinner, 1 s wall", cpu,
           f"{spun_us} (the spinner's own, by `times`) .. +{PODMAN_CPU_US}")  # fmt: skip
    assert spun_us >= 500_000, f"the spinner got only {spun_us} us of CPU in a second"
    assert spun_us <= cpu <= spun_us + PODMAN_CPU_US, (spun_us, used)
    assert used.wall_ms is not None
    assert used.wall_ms >= SPIN_SECONDS * 1000, used
    _table(usage, "wall_ms", "spinner, 1 s wall", used.wall_ms, ">= 1000")
    assert used.oom_kills == 0


def test_the_payloads_own_share_is_told_apart_from_its_runtimes(usage: PodmanWorld) -> None:
    """`payload_usage: true`: the spinner's own CPU (its container's cgroup, which the
    host made below the service) is close to what it spun by `times`, and below the
    service's total, which counts Podman's start and teardown too; its peak memory is
    below the service's. Live while it runs and recorded at the end, as `usage` is; a
    request that asks only for `usage` never sees the payload's part."""
    script = f"timeout {SPIN_SECONDS} sh -c 'while :; do :; done'; times"
    plan = usage.plan(script)
    usage.run_to_running(plan)
    live = usage.usage(plan, payload=True).usage
    assert isinstance(live, Usage), live
    assert isinstance(live.payload, PayloadUsage), live
    if not live.final:  # still running: read live from the payload's own cgroup
        assert isinstance(live.payload.cpu_user_us, int), live
    usage.wait_settled(plan)
    used = usage.usage(plan, payload=True).usage
    assert isinstance(used, Usage), used
    assert used.final
    own = used.payload
    assert isinstance(own, PayloadUsage), used
    spun_us = children_cpu_us(usage.collect(plan, "stdout").data)
    assert isinstance(own.cpu_user_us, int), own
    assert isinstance(own.cpu_system_us, int), own
    own_us = own.cpu_user_us + own.cpu_system_us
    total_us = _cpu_us(used)
    _table(usage, "payload cpu_user_us+cpu_system_us", "spinner, 1 s wall", own_us,
           f"{spun_us} (the spinner's own, by `times`) .. +{PAYLOAD_SLACK_US}")  # fmt: skip
    _table(usage, "service minus payload cpu", "spinner, 1 s wall", total_us - own_us,
           "> 0 (Podman, conmon, runc)")  # fmt: skip
    assert spun_us <= own_us <= spun_us + PAYLOAD_SLACK_US, (spun_us, used)
    assert own_us < total_us, used
    assert isinstance(own.memory_peak_bytes, int), own
    assert isinstance(used.memory_peak_bytes, int), used
    _table(usage, "payload memory_peak_bytes", "spinner, 1 s wall", own.memory_peak_bytes,
           f"< the service's {used.memory_peak_bytes}")  # fmt: skip
    assert 0 < own.memory_peak_bytes < used.memory_peak_bytes, used
    assert usage.usage(plan).usage == msgspec.structs.replace(used, payload=msgspec.UNSET)


def test_a_memory_hog_peaks_at_least_at_what_it_holds(usage: PodmanWorld) -> None:
    script = f'awk \'BEGIN {{ s = sprintf("%{HOG_BYTES}s", ""); print length(s) }}\''
    row, used = _finished(usage, usage.plan(script))
    assert (row.state, row.exit_code) == ("succeeded", 0), row
    assert usage.collect(usage.plans[-1], "stdout").data == f"{HOG_BYTES}\n".encode()
    _table(usage, "memory_peak_bytes", "awk holding a 64 MiB string", used.memory_peak_bytes,
           f">= {HOG_BYTES}, <= the plan's 256 MiB")  # fmt: skip
    assert used.memory_peak_bytes is not None
    assert HOG_BYTES <= used.memory_peak_bytes <= 256 * MIB, used
    assert used.oom_kills == 0


def test_a_memory_bomb_is_oom_killed_and_says_so(usage: PodmanWorld) -> None:
    plan = usage.plan("exec awk 'BEGIN { s = \"x\"; while (1) s = s s }'", memory_bytes=BOMB_LIMIT)
    row, used = _finished(usage, plan)
    _table(usage, "reason, exit_code", "awk doubling a string under 160 MiB",
           f"{row.reason}, {row.exit_code}", "memory_exhausted, 137")  # fmt: skip
    _table(usage, "oom_kills", "awk doubling a string under 160 MiB", used.oom_kills, ">= 1")
    _table(usage, "memory_peak_bytes", "awk doubling a string under 160 MiB",
           used.memory_peak_bytes, f"<= {BOMB_LIMIT} (the limit) + {OVERSHOOT}")  # fmt: skip
    assert (row.state, row.outcome, row.reason) == ("failed", "failed", "memory_exhausted"), row
    assert row.exit_code == 137, row
    assert used.oom_kills is not None
    assert used.oom_kills >= 1, used
    assert used.memory_peak_bytes is not None
    assert used.memory_peak_bytes <= BOMB_LIMIT + OVERSHOOT, used
    found = _metrics(usage)
    kills = found[("ficc_slot_class_oom_kills_total", (("class", SLOT_CLASS),))]
    failed = found[
        ("ficc_slot_class_attempts_total", (("class", SLOT_CLASS), ("outcome", "failed")))
    ]
    _table(usage, "ficc_slot_class_oom_kills_total", "after the bomb", kills, ">= 1")
    assert kills >= used.oom_kills
    assert failed >= 1
    assert found[("ficc_slot_class_cpu_seconds_total", (("class", SLOT_CLASS),))] > 0


def _metrics(world: PodmanWorld) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """The daemon's metrics as Prometheus parses them (administrator's request)."""
    reply = world.driver.as_admin(MetricsRequest(version=1, id=new_id()))
    assert isinstance(reply, MetricsReply), reply
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(reply.text)
        for sample in family.samples
    }


def test_a_writer_leaves_its_bytes_and_files_in_the_slot(usage: PodmanWorld) -> None:
    """What the slot holds when the payload finished, against a payload that writes
    nothing in the same slot just before."""
    _, empty = _finished(usage, usage.plan("true"))
    first = usage.plans[-1]
    slot = usage.observe(first).slot
    assert usage.release(first).state == "released"
    write = (
        f"mkdir /work/out && for i in $(seq {WRITTEN_FILES}); do"
        f' awk \'BEGIN {{ printf "%s", sprintf("%{MIB}s", "") }}\' > /work/out/f$i; done'
    )
    plan = usage.plan(write)
    row, used = _finished(usage, plan)
    assert row.slot == slot, "the writer went to another slot than the empty run"
    assert (row.state, row.exit_code) == ("succeeded", 0), row
    assert isinstance(empty.storage_bytes, int)
    assert isinstance(used.storage_bytes, int)
    assert isinstance(empty.storage_inodes, int)
    assert isinstance(used.storage_inodes, int)
    grew, files = (
        used.storage_bytes - empty.storage_bytes,
        used.storage_inodes - empty.storage_inodes,
    )
    _table(usage, "storage_bytes (minus an empty run's)", "8 files of 1 MiB", grew,
           f"{WRITTEN_BYTES} .. +{SLOT_SLACK_BYTES}")  # fmt: skip
    _table(usage, "storage_inodes (minus an empty run's)", "8 files of 1 MiB and their directory",
           files, f"{WRITTEN_FILES + 1} .. +{SLOT_SLACK_INODES}")  # fmt: skip
    assert WRITTEN_BYTES <= grew <= WRITTEN_BYTES + SLOT_SLACK_BYTES, (empty, used)
    assert WRITTEN_FILES + 1 <= files <= WRITTEN_FILES + 1 + SLOT_SLACK_INODES, (empty, used)


def test_a_forking_payload_peaks_at_its_processes(usage: PodmanWorld) -> None:
    row, used = _finished(usage, usage.plan(f"for i in $(seq {FORKS}); do sleep 2 & done; wait"))
    assert (row.state, row.exit_code) == ("succeeded", 0), row
    # the kernel keeps pids.peak in every non-root cgroup from 6.1 on: look at the
    # attempts' base cgroup (`ficc` of cgroupfs, `ficc.slice` of systemd)
    has_peak = any(Path("/sys/fs/cgroup").glob("*/ficc*/pids.peak")) or any(
        Path("/sys/fs/cgroup").glob("ficc*/pids.peak")
    )
    _table(usage, "processes_peak", f"a shell and {FORKS} sleeps", used.processes_peak,
           f">= {FORKS + 1}, <= 128 (the plan's limit)" if has_peak else "absent")  # fmt: skip
    if has_peak:
        assert used.processes_peak is not None
        assert FORKS + 1 <= used.processes_peak <= 128, used
    else:
        assert used.processes_peak is None, used


def test_the_figures_survive_a_daemon_restart_and_the_release(usage: PodmanWorld) -> None:
    plan = usage.plan('awk \'BEGIN { s = sprintf("%8000000s", "") }\'; echo done')
    _, recorded = _finished(usage, plan)
    assert _cpu_us(recorded) > 0
    assert recorded.memory_peak_bytes
    usage.restart_cleanly()
    assert usage.usage(plan).usage == recorded
    assert usage.release(plan).state == "released"
    after = usage.usage(plan)
    assert after.state == "released"
    assert after.usage == recorded
    assert usage.observe(plan).usage is msgspec.UNSET  # not asked: no usage
    config = str(usage.layout.config_path)
    status = subprocess.run([str(COMMAND), "status", "--config", config, "--json", "--all"],
                            capture_output=True, text=True, check=True, timeout=120)  # fmt: skip
    listed = {
        a["attempt_id"]: a for page in json.loads(status.stdout)["pages"] for a in page["attempts"]
    }
    assert listed[plan.attempt_id]["usage"] == msgspec.to_builtins(recorded)
    table = subprocess.run([str(COMMAND), "status", "--config", config, "--all"],
                           capture_output=True, text=True, check=True, timeout=120)  # fmt: skip
    (line,) = [x for x in table.stdout.splitlines() if x.startswith(plan.attempt_id)]
    cpu = f"{_cpu_us(recorded) / 1_000_000:.2f}"
    assert line.split()[-5:] == [cpu, "s", *_shown_bytes(recorded.memory_peak_bytes), "0"], line
    _table(usage, "every figure", "after a restart and the release", "unchanged", "unchanged")
