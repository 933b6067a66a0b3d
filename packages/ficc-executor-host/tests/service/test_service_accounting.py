"""What a service used, read from its cgroups' counters (service/accounting.py).

The parsers are checked on the kernel's own text (as Linux 6.x prints these files, on
cgroup v1 and v2), and `read_usage` on trees of such files shaped as each backend
makes them: which file each figure comes from, the v1 OOM kills summed over the
subtree (the kernel counts a kill only where the victim was), and a file the host
cannot read leaving its figure unknown, never zero. The live kernel's counters are
read through the real daemon and Podman in tests-integration/test_podman_usage.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from ficc.execution.host.service import accounting
from ficc.execution.host.service.cgroups import Hierarchy, Layout
from ficc.execution.host.service.interface import CgroupUsage

V2_CPU_STAT = """usage_usec 1290523
user_usec 1250011
system_usec 40512
core_sched.force_idle_usec 0
nr_periods 14
nr_throttled 3
throttled_usec 212007
nr_bursts 0
burst_usec 0
"""
V2_MEMORY_EVENTS = "low 0\nhigh 0\nmax 1844\noom 2\noom_kill 2\noom_group_kill 0\n"
V1_OOM_CONTROL = "oom_kill_disable 0\nunder_oom 0\noom_kill 1\n"
V1_OOM_CONTROL_OLD_KERNEL = "oom_kill_disable 0\nunder_oom 0\n"


def test_parsers_read_the_kernels_text() -> None:
    assert accounting.v2_cpu(V2_CPU_STAT) == (1_250_011, 40_512)
    assert accounting.parse_keyed(V2_MEMORY_EVENTS)["oom_kill"] == 2
    assert accounting.parse_keyed(V1_OOM_CONTROL)["oom_kill"] == 1
    assert "oom_kill" not in accounting.parse_keyed(V1_OOM_CONTROL_OLD_KERNEL)
    assert accounting.parse_count("67108864\n") == 67_108_864
    assert accounting.parse_count("max\n") is None
    assert accounting.parse_count("") is None
    assert accounting.ns_to_us(1_250_011_999) == 1_250_011
    assert accounting.v2_cpu("") == (None, None)


def _files(node: Path, files: dict[str, str]) -> None:
    node.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (node / name).write_text(text)


def test_v2_reads_the_unified_node(tmp_path: Path) -> None:
    node = tmp_path / "unified" / "ficc" / "work"
    _files(node, {"cpu.stat": V2_CPU_STAT, "memory.peak": "75497472\n",
                  "memory.events": V2_MEMORY_EVENTS, "pids.peak": "23\n"})  # fmt: skip
    _files(node / "supervisor", {"memory.events": V2_MEMORY_EVENTS})  # hierarchical: not summed
    layout = Layout(2, (Hierarchy("unified", str(tmp_path / "unified"), 2, frozenset({"cpu"})),))
    assert accounting.read_usage(layout, {"unified": str(node)}) == CgroupUsage(
        cpu_user_us=1_250_011,
        cpu_system_us=40_512,
        memory_peak_bytes=75_497_472,
        oom_kills=2,
        processes_peak=23,
    )


def test_v2_without_memory_peak_or_pids_peak_leaves_them_unknown(tmp_path: Path) -> None:
    """Kernels before 5.19 have no memory.peak, before 6.1 no pids.peak."""
    node = tmp_path / "work"
    _files(node, {"cpu.stat": V2_CPU_STAT, "memory.events": V2_MEMORY_EVENTS})
    layout = Layout(2, (Hierarchy("unified", str(tmp_path), 2, frozenset({"cpu"})),))
    used = accounting.read_usage(layout, {"unified": str(node)})
    assert (used.memory_peak_bytes, used.processes_peak) == (None, None)
    assert used.oom_kills == 2


def _v1_layout(tmp_path: Path, *keys: str) -> Layout:
    hierarchies = [Hierarchy(k, str(tmp_path / k), 1, frozenset(k.split(","))) for k in keys]
    hierarchies.append(Hierarchy("unified", str(tmp_path / "unified"), 2, frozenset()))
    return Layout(1, tuple(hierarchies))


def test_v1_reads_each_hierarchy_and_sums_oom_kills_over_the_subtree(tmp_path: Path) -> None:
    layout = _v1_layout(tmp_path, "cpuacct", "memory", "pids")
    nodes = {key: str(tmp_path / key / "ficc" / "work") for key in ("cpuacct", "memory", "pids")}
    _files(Path(nodes["cpuacct"]), {"cpuacct.usage_user": "1250011999\n",
                                    "cpuacct.usage_sys": "40512000\n"})  # fmt: skip
    memory = Path(nodes["memory"])
    _files(
        memory, {"memory.max_usage_in_bytes": "67379200\n", "memory.oom_control": V1_OOM_CONTROL}
    )
    _files(memory / "supervisor", {"memory.oom_control": V1_OOM_CONTROL.replace("1", "2")})
    _files(memory / "payload", {"memory.oom_control": V1_OOM_CONTROL})
    _files(Path(nodes["pids"]), {"pids.peak": "17\n"})
    assert accounting.read_usage(layout, nodes) == CgroupUsage(
        cpu_user_us=1_250_011,
        cpu_system_us=40_512,
        memory_peak_bytes=67_379_200,
        oom_kills=4,
        processes_peak=17,
    )


def test_v1_without_cpuacct_takes_the_unified_trees_cpu_and_omits_the_rest(
    tmp_path: Path,
) -> None:
    """No cpuacct hierarchy: the unified node's cpu.stat (kept in every v2 cgroup);
    an old kernel's oom_control without oom_kill and no pids.peak: unknown."""
    layout = _v1_layout(tmp_path, "memory", "pids")
    unified = tmp_path / "unified" / "ficc" / "work"
    _files(unified, {"cpu.stat": V2_CPU_STAT})
    memory = tmp_path / "memory" / "ficc" / "work"
    _files(memory, {"memory.oom_control": V1_OOM_CONTROL_OLD_KERNEL})
    nodes = {"memory": str(memory), "pids": str(tmp_path / "pids"), "unified": str(unified)}
    used = accounting.read_usage(layout, nodes)
    assert used == CgroupUsage(cpu_user_us=1_250_011, cpu_system_us=40_512)


def test_a_service_whose_cgroups_are_gone_has_no_figures(tmp_path: Path) -> None:
    layout = _v1_layout(tmp_path, "cpuacct", "memory", "pids")
    nodes = {key: str(tmp_path / key / "gone") for key in ("cpuacct", "memory", "pids")}
    assert accounting.read_usage(layout, nodes) == CgroupUsage()


@pytest.mark.parametrize("broken", ["12x\n", "-1\n"])
def test_a_figure_that_is_not_a_count_is_unknown(tmp_path: Path, broken: str) -> None:
    node = tmp_path / "work"
    _files(node, {"cpu.stat": V2_CPU_STAT, "memory.peak": broken, "pids.peak": broken})
    layout = Layout(2, (Hierarchy("unified", str(tmp_path), 2, frozenset({"cpu"})),))
    used = accounting.read_usage(layout, {"unified": str(node)})
    assert (used.memory_peak_bytes, used.processes_peak) == (None, None)


# --- the payload's own node ------------------------------------------------------------


def test_v2_reads_the_payloads_own_node_beside_the_service(tmp_path: Path) -> None:
    node = tmp_path / "unified" / "ficc" / "work"
    _files(node, {"cpu.stat": V2_CPU_STAT, "memory.peak": "75497472\n"})
    own = V2_CPU_STAT.replace("1250011", "900000").replace("40512", "1000")
    _files(node / "payload", {"cpu.stat": own, "memory.peak": "50331648\n"})
    layout = Layout(2, (Hierarchy("unified", str(tmp_path / "unified"), 2, frozenset({"cpu"})),))
    used = accounting.read_usage(layout, {"unified": str(node)})
    assert (used.cpu_user_us, used.memory_peak_bytes) == (1_250_011, 75_497_472)
    assert (used.payload_cpu_user_us, used.payload_cpu_system_us) == (900_000, 1_000)
    assert used.payload_memory_peak_bytes == 50_331_648


def test_v1_reads_the_payloads_own_node_in_each_hierarchy(tmp_path: Path) -> None:
    layout = _v1_layout(tmp_path, "cpuacct", "memory")
    nodes = {key: str(tmp_path / key / "ficc" / "work") for key in ("cpuacct", "memory")}
    _files(Path(nodes["cpuacct"]), {"cpuacct.usage_user": "9000000000\n",
                                    "cpuacct.usage_sys": "1000000000\n"})  # fmt: skip
    _files(Path(nodes["cpuacct"]) / "payload", {"cpuacct.usage_user": "1000000000\n",
                                                "cpuacct.usage_sys": "2000000\n"})  # fmt: skip
    _files(Path(nodes["memory"]), {"memory.max_usage_in_bytes": "67379200\n"})
    _files(Path(nodes["memory"]) / "payload", {"memory.max_usage_in_bytes": "4194304\n"})
    used = accounting.read_usage(layout, nodes)
    assert (used.cpu_user_us, used.cpu_system_us) == (9_000_000, 1_000_000)
    assert (used.payload_cpu_user_us, used.payload_cpu_system_us) == (1_000_000, 2_000)
    assert (used.memory_peak_bytes, used.payload_memory_peak_bytes) == (67_379_200, 4_194_304)


def test_no_payload_node_leaves_the_payloads_figures_unknown(tmp_path: Path) -> None:
    """A payload the host could not move, or an attempt that never ran: absent, never
    zero (the service's own figures are read as before)."""
    node = tmp_path / "work"
    _files(node, {"cpu.stat": V2_CPU_STAT, "memory.peak": "75497472\n"})
    layout = Layout(2, (Hierarchy("unified", str(tmp_path), 2, frozenset({"cpu"})),))
    used = accounting.read_usage(layout, {"unified": str(node)})
    assert used.cpu_user_us == 1_250_011
    assert (used.payload_cpu_user_us, used.payload_memory_peak_bytes) == (None, None)
