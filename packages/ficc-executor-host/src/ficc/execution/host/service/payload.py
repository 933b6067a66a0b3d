"""The payload's own cgroup: `payload` below the attempt's service node.

The service holds the provider's supervisor too (for Podman: Podman, conmon, runc, the
pause process), so its counters are the payload's and its runtime's together; on the
hosts this was measured on, a one-second CPU spinner's service used several seconds
more than the spinner. Rootless Podman makes no cgroup of its own (cgroup v1 cannot
delegate one to it, and with the cgroupfs manager it makes none on v2 either), so its
container stays in the service's `supervisor` leaf, beside Podman.

So the host puts the payload into a cgroup of its own, once the provider reported its
PID (the barrier, before the gate judges it and long before the release): `payload`
beside `supervisor`, in every hierarchy of the service. Everything the payload starts
is then born there, and the counters of that node are the payload's alone. It is below
the service's node, whose limits and device policy bound it as before (a v1 child
copies its parent's device list; a v2 device program of the parent applies to every
descendant); the gate checks the placement like any other (`gate_cgroup`). A runtime
that already made the payload's cgroup below `payload` (`supervisor_cgroup`, e.g.
Podman's `--cgroup-parent`) is left where it is: its node counts in `payload`'s.

The move is bookkeeping, never a condition of the release: a move the kernel refuses
is logged by the caller, the empty nodes are removed again, and the payload's figures
are then unknown (absent) rather than zero.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Mapping

from ficc.execution.host.core.codes import HostCode
from ficc.execution.host.core.errors import HostError
from ficc.execution.host.service import cgroups
from ficc.execution.host.service.cgroups import V2_REQUIRED, Hierarchy, Layout

PAYLOAD = "payload"
"""The payload's node below the service's (and the supervisor cgroup's last part)."""


def nodes_of(nodes: Mapping[str, str]) -> dict[str, str]:
    """The payload's node in each hierarchy of the service's `nodes`, where it exists."""
    found = {key: os.path.join(node, PAYLOAD) for key, node in nodes.items()}
    return {key: node for key, node in found.items() if cgroups.is_real_dir(node)}


def enter(layout: Layout, nodes: Mapping[str, str], pid: int) -> None:
    """Move process `pid` of the service with these `nodes` into `payload` in every
    hierarchy where it is not there (or below) yet. Raises HostError
    (`service_payload`) when the process is not in the service or the kernel refuses;
    the nodes made for it are then removed again (the caller decides what follows)."""
    memberships = cgroups.parse_proc_cgroup(cgroups.read_text(f"/proc/{pid}/cgroup"))
    made: list[str] = []
    try:
        for hierarchy in layout.hierarchies:
            node = nodes.get(hierarchy.key)
            if node is not None:
                _enter_one(hierarchy, node, memberships, pid, made)
    except (HostError, OSError) as error:
        for path in reversed(made):
            with contextlib.suppress(OSError):
                os.rmdir(path)
        if isinstance(error, HostError):
            raise
        raise HostError(
            HostCode.SERVICE_PAYLOAD,
            f"process {pid} could not be moved into its own payload cgroup ({error});"
            " its usage is counted with its runtime's only",
        ) from error


def _enter_one(
    hierarchy: Hierarchy,
    node: str,
    memberships: Mapping[frozenset[str], str],
    pid: int,
    made: list[str],
) -> None:
    """`enter` in one hierarchy; appends the node it made to `made`."""
    service = "/" + os.path.relpath(node, hierarchy.mount)
    target = f"{service}/{PAYLOAD}"
    key = frozenset() if hierarchy.version == 2 else hierarchy.controllers
    current = memberships.get(key, "")
    if current == target or current.startswith(target + "/"):
        return  # the runtime made the payload's cgroup below `payload` itself
    if current != service and not current.startswith(service + "/"):
        raise HostError(
            HostCode.SERVICE_PAYLOAD,
            f"process {pid} is in {current or 'no cgroup'} of the {hierarchy.key} hierarchy,"
            f" not in its service {service}; it was not moved",
        )
    path = os.path.join(node, PAYLOAD)
    if cgroups.make_dir(path, exclusive=False):
        made.append(path)
        _inherit(hierarchy, node, path)
    cgroups.write_text(os.path.join(path, "cgroup.procs"), str(pid))


def _inherit(hierarchy: Hierarchy, node: str, path: str) -> None:
    """What a new node needs of its parent before a process can join it: a v1 cpuset's
    CPUs and memory nodes; on v2, the parent's controllers enabled for its children
    (so the payload's node has `memory.peak` and the limits' counters too)."""
    if "cpuset" in hierarchy.controllers and hierarchy.version == 1:
        for name in ("cpuset.cpus", "cpuset.mems"):
            value = cgroups.read_text(os.path.join(node, name)).strip()
            cgroups.write_text(os.path.join(path, name), value)
    if hierarchy.version == 2:
        available = set(cgroups.read_text(os.path.join(node, "cgroup.controllers")).split())
        subtree = os.path.join(node, "cgroup.subtree_control")
        missing = (V2_REQUIRED & available) - set(cgroups.read_text(subtree).split())
        if missing:
            cgroups.write_text(subtree, " ".join(f"+{name}" for name in sorted(missing)))
