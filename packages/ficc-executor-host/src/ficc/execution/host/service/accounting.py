"""What an attempt's service used, read from the kernel's own counters of its cgroups.

Both backends read the same files, the same way (`read_usage`), from the nodes of the
attempt's service:

- CPU user/system: v1 `cpuacct.usage_user`, `cpuacct.usage_sys` (nanoseconds); v2
  `cpu.stat` `user_usec`, `system_usec`;
- peak memory: v1 `memory.max_usage_in_bytes`; v2 `memory.peak` (kernel 5.19 or newer);
- OOM kills: v1 `memory.oom_control` `oom_kill`, summed over the subtree; v2
  `memory.events` `oom_kill`;
- peak processes: `pids.peak` on both (kernel 6.1 or newer).

Every counter but one is hierarchical, so the service's own node counts its whole
tree (the provider's supervisor and the payload below it). The exception is v1's
`oom_kill`: the kernel counts a kill only in the victim's own memory cgroup, so it is
summed over every node of the subtree. On a v1 host without a cpuacct hierarchy the
unified tree's `cpu.stat` (which the kernel keeps in every v2 cgroup, with or without
controllers) gives the CPU time.

The payload's own figures (CPU and peak memory) are read the same way from the
service's `payload` node (payload.py), where the host moved the payload: none when
there is no such node.

A figure whose file is missing or unreadable is None: never guessed, never zero. The
parsers are pure, tested on the kernel's own text; only `read_usage` touches files.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Mapping

from ficc.execution.host.service import cgroups, payload
from ficc.execution.host.service.cgroups import UNIFIED, Layout
from ficc.execution.host.service.interface import CgroupUsage

# --- pure parsers ---------------------------------------------------------------------


def parse_keyed(text: str) -> dict[str, int]:
    """A flat keyed file (`cpu.stat`, `memory.events`, `memory.oom_control`):
    `key value` lines; lines that are not a key and an integer are skipped."""
    found: dict[str, int] = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[1].isdigit():
            found[parts[0]] = int(parts[1])
    return found


def parse_count(text: str) -> int | None:
    """A single nonnegative integer (`memory.peak`, `pids.peak`, `cpuacct.usage_user`);
    None for anything else (`max`, an empty file)."""
    value = text.strip()
    return int(value) if value.isdigit() else None


def v2_cpu(cpu_stat: str) -> tuple[int | None, int | None]:
    """(user, system) microseconds from v2 `cpu.stat`."""
    keyed = parse_keyed(cpu_stat)
    return keyed.get("user_usec"), keyed.get("system_usec")


def ns_to_us(value: int | None) -> int | None:
    """v1 cpuacct counts nanoseconds; the figure is microseconds (rounded down)."""
    return None if value is None else value // 1000


# --- reading a service's nodes ----------------------------------------------------------


def _read(node: str | None, name: str) -> str | None:
    """The text of a control file, or None when it is missing or unreadable (an older
    kernel, a cgroup removed meanwhile)."""
    if node is None:
        return None
    try:
        return cgroups.read_text(os.path.join(node, name))
    except FileNotFoundError:
        return None
    except OSError as error:
        if error.errno in (errno.ENODEV, errno.ENOENT, errno.EOPNOTSUPP, errno.EINVAL):
            return None
        raise


def _count(node: str | None, name: str) -> int | None:
    text = _read(node, name)
    return None if text is None else parse_count(text)


def _keyed(node: str | None, name: str, key: str) -> int | None:
    text = _read(node, name)
    return None if text is None else parse_keyed(text).get(key)


def _node_of(layout: Layout, nodes: Mapping[str, str], controller: str) -> str | None:
    """The service's node in the hierarchy of `controller`, if it has one."""
    for hierarchy in layout.hierarchies:
        if controller in hierarchy.controllers and hierarchy.key in nodes:
            return nodes[hierarchy.key]
    return None


def _subtree_oom_kills(node: str | None) -> int | None:
    """v1: the sum of `oom_kill` over every node of the subtree (None if the top has
    no such counter)."""
    top = _keyed(node, "memory.oom_control", "oom_kill")
    if node is None or top is None:
        return None
    total = 0
    for each in cgroups.walk_nodes(node):
        total += _keyed(each, "memory.oom_control", "oom_kill") or 0
    return total


def read_usage(layout: Layout, nodes: Mapping[str, str]) -> CgroupUsage:
    """What the service with these nodes (hierarchy key -> directory) used so far, and
    what its payload's own node used (`payload_` figures)."""
    own = payload.nodes_of(nodes)
    user, system = _cpu(layout, own)
    figures = {
        "payload_cpu_user_us": user,
        "payload_cpu_system_us": system,
        "payload_memory_peak_bytes": _memory_peak(layout, own),
    }
    user, system = _cpu(layout, nodes)
    if layout.version == 2:
        node = nodes.get(UNIFIED)
        return CgroupUsage(
            cpu_user_us=user,
            cpu_system_us=system,
            memory_peak_bytes=_memory_peak(layout, nodes),
            oom_kills=_keyed(node, "memory.events", "oom_kill"),
            processes_peak=_count(node, "pids.peak"),
            **figures,
        )
    return CgroupUsage(
        cpu_user_us=user,
        cpu_system_us=system,
        memory_peak_bytes=_memory_peak(layout, nodes),
        oom_kills=_subtree_oom_kills(_node_of(layout, nodes, "memory")),
        processes_peak=_count(_node_of(layout, nodes, "pids"), "pids.peak"),
        **figures,
    )


def _cpu(layout: Layout, nodes: Mapping[str, str]) -> tuple[int | None, int | None]:
    """(user, system) microseconds of the subtree of these nodes."""
    if layout.version == 2:
        return v2_cpu(_read(nodes.get(UNIFIED), "cpu.stat") or "")
    cpuacct = _node_of(layout, nodes, "cpuacct")
    user = ns_to_us(_count(cpuacct, "cpuacct.usage_user"))
    system = ns_to_us(_count(cpuacct, "cpuacct.usage_sys"))
    if user is None and system is None:  # no cpuacct: the unified tree's base counters
        return v2_cpu(_read(nodes.get(UNIFIED), "cpu.stat") or "")
    return user, system


def _memory_peak(layout: Layout, nodes: Mapping[str, str]) -> int | None:
    """The most memory the subtree of these nodes held at once."""
    if layout.version == 2:
        return _count(nodes.get(UNIFIED), "memory.peak")
    return _count(_node_of(layout, nodes, "memory"), "memory.max_usage_in_bytes")


__all__ = ["CgroupUsage", "ns_to_us", "parse_count", "parse_keyed", "read_usage", "v2_cpu"]
