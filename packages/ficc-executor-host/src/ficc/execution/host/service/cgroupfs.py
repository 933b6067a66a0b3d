"""The `cgroupfs` system service: the daemon manages the attempt's cgroups itself.

For hosts without systemd as PID 1. Each attempt gets a node
`<base>/<name>` in every hierarchy of the layout (`cgroups.discover`): on a v1 host
in every v1 hierarchy plus the unified tree (for `cgroup.kill`); on a v2 host in the
unified tree. Limits and the closed device policy are written on the node, read
back, and the node gets two children: `supervisor`, where the provider's argv runs,
and `payload`, which the provider's runtime creates under it (`supervisor_cgroup`).
A child is needed because cgroup v2 forbids processes in a node whose controllers
are delegated to children; v1 uses the same shape so both versions behave alike.

Starting the program inside the tree, as the slot account, before it runs any of its
own code, uses a start gate rather than `preexec_fn` (unsafe in a threaded daemon):

1. `subprocess.Popen` (fork+exec in C: no Python runs in the child) starts a tiny
   shim interpreter (shim.py) as the slot account, with an empty environment, no
   supplementary groups, a new session, the output files as stdout/stderr and two
   pipes.
2. While the interpreter comes up, the host writes its PID into every
   `supervisor/cgroup.procs` and checks /proc/PID/cgroup. The shim sets RLIMIT_CORE
   to 0/0 and RLIMIT_NOFILE to N/N itself (root here lacks CAP_SYS_RESOURCE, so
   prlimit(2) on another user's process is not an option), reports "ready" and
   blocks reading the gate pipe.
3. The host checks the shim's credentials and rlimits in /proc, and only then sends
   the argv and environment through the gate pipe (so neither appears in the shim's
   world-readable /proc cmdline or environ) and closes it.
4. The shim execs the argv; its ready pipe is close-on-exec, so the host reads EOF
   when the exec succeeded and an errno when it failed (then `create` refuses). If the
   host dies before step 3 completes, the shim reads an incomplete order and exits
   125 without running anything.

The account is the slot account; UID/GID 0 is refused unless the backend is built
with `root_supervisor=True`, for a rootful runtime (Podman with a UID map, as in the
design's recipe) whose payload the gate then checks for the slot account's IDs.

Stopping never signals a bare PID number: the unified node's `cgroup.kill` empties
the tree atomically where available, and otherwise the tree is frozen and each
member is killed through a pidfd after checking it is still in the tree, so a
recycled PID of another process is never hit.

On cgroup v2 the closed device policy is an eBPF program (`bpfdevices`), read back
from the kernel like every other control; if the kernel refuses it, `create`
refuses with `service_devices_unenforceable` rather than run with open devices.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import threading
import time
from typing import Literal

from ficc.execution.errors import ErrorCode
from ficc.execution.host.core.codes import HostCode
from ficc.execution.host.core.errors import HostError
from ficc.execution.host.linux import fsutil, procfs
from ficc.execution.host.service import accounting, bpfdevices, cgroups, payload, shim
from ficc.execution.host.service.account_processes import has_live_tasks, kill_account
from ficc.execution.host.service.cgroups import UNIFIED, Layout
from ficc.execution.host.service.interface import (
    CgroupUsage,
    Controls,
    DeviceAccess,
    ServiceHandle,
    ServiceSpec,
    check_account,
    check_name,
)
from ficc.execution.host.service.launch import (
    DEFAULT_INTERPRETER,
    check_credentials,
    open_output,
    trusted_interpreter,
    wait_until,
)

SUPERVISOR = "supervisor"
PAYLOAD = "payload"
REAPER_CGROUP = "lease-reaper"
"""The lease reaper's own cgroup under the base (not a service name: those are
`ficc-work-...`)."""


class CgroupfsService:
    """`SystemService` on raw cgroup files; see the module docstring for the design."""

    backend = "cgroupfs"

    def __init__(
        self,
        base: str = "ficc",
        *,
        layout: Layout | None = None,
        interpreter: str | None = None,
        start_timeout: float = 10.0,
        stop_timeout: float = 10.0,
        root_supervisor: bool = False,
    ) -> None:
        self._base = check_name(base)
        self._root_supervisor = root_supervisor
        self._layout = layout if layout is not None else cgroups.discover()
        self._interpreter = trusted_interpreter(interpreter or DEFAULT_INTERPRETER)
        self._start_timeout = start_timeout
        self._stop_timeout = stop_timeout
        self._started: dict[str, subprocess.Popen[bytes]] = {}
        self._lock = threading.Lock()

    @property
    def layout(self) -> Layout:
        return self._layout

    # --- create ----------------------------------------------------------------------

    def create(self, spec: ServiceSpec) -> ServiceHandle:
        check_account(spec, root_supervisor=self._root_supervisor)
        for device in spec.devices:
            cgroups.check_device_node(device)
        outputs = [open_output(spec.stdout)]
        created: dict[str, str] = {}
        process: subprocess.Popen[bytes] | None = None
        try:
            outputs.append(open_output(spec.stderr))
            nodes = self._make_nodes(spec.name, created)
            swap = self._swap_accounting(nodes)
            self._enforce(spec, nodes, swap)
            handle = ServiceHandle(spec.name, self.backend, self._version, nodes, None, None)
            _verify(spec, self.controls(handle), swap)
            self._check_hierarchical(nodes)
            for key, node in nodes.items():
                leaf = os.path.join(node, SUPERVISOR)
                cgroups.make_dir(leaf, exclusive=True)
                self._inherit_cpuset(key, leaf)
            process = self._spawn(spec, nodes, outputs[0], outputs[1])
        except BaseException as error:
            try:
                self._abandon(spec.name, created, process)
            except HostError as cleanup:
                error.add_note(f"cleanup after the refusal also failed: {cleanup}")
            if isinstance(error, OSError):
                raise HostError(
                    HostCode.SERVICE_CREATE,
                    f"creating service {spec.name} failed: {error}; check the cgroup "
                    "mounts, the working directory and the output paths",
                ) from error
            raise
        finally:
            for fd in outputs:
                os.close(fd)
        with self._lock:
            self._started[spec.name] = process
        return ServiceHandle(
            spec.name,
            self.backend,
            self._version,
            nodes,
            process.pid,
            procfs.start_ticks(process.pid),
        )

    @property
    def _version(self) -> Literal[1, 2]:
        return self._layout.version

    def _swap_accounting(self, nodes: dict[str, str]) -> bool:
        """Whether the kernel can bound swap; without it, refuse if swap is active."""
        name = "memory.swap.max" if self._version == 2 else "memory.memsw.limit_in_bytes"
        if os.path.exists(os.path.join(self._node(nodes, "memory"), name)):
            return True
        if cgroups.host_has_swap():
            raise HostError(
                HostCode.SERVICE_SWAP_UNENFORCEABLE,
                "the kernel has no swap accounting but swap is active, so the swap limit "
                "cannot be enforced; boot with swapaccount=1 or disable swap",
            )
        return False

    def _make_nodes(self, name: str, created: dict[str, str]) -> dict[str, str]:
        """`<base>/<name>` in every hierarchy; refuses if any already exists."""
        nodes = {}
        for hierarchy in self._layout.hierarchies:
            base = os.path.join(hierarchy.mount, self._base)
            cgroups.make_dir(base, exclusive=False)
            # Always (it only fills an empty cpuset): a parallel create may have made the
            # base and not yet given it CPUs, and a child of an empty cpuset cannot run.
            self._inherit_cpuset(hierarchy.key, base)
            node = os.path.join(base, name)
            try:
                cgroups.make_dir(node, exclusive=True)
            except FileExistsError as error:
                raise HostError(
                    HostCode.SERVICE_EXISTS,
                    f"cgroup {node} already exists; stop and remove the old service "
                    "(adopt it by name) before creating it again",
                ) from error
            created[hierarchy.key] = node
            self._inherit_cpuset(hierarchy.key, node)
            nodes[hierarchy.key] = node
            if self._version == 2:
                for parent in (hierarchy.mount, base, node):
                    _delegate_controllers(parent, cgroups.V2_REQUIRED)
        return nodes

    def _inherit_cpuset(self, key: str, path: str) -> None:
        """A new v1 cpuset cgroup has no CPUs or memory nodes until given its parent's."""
        if "cpuset" not in key.split(","):
            return
        parent = os.path.dirname(path)
        for name in ("cpuset.cpus", "cpuset.mems"):
            if not cgroups.read_text(os.path.join(path, name)).strip():
                value = cgroups.read_text(os.path.join(parent, name)).strip()
                cgroups.write_text(os.path.join(path, name), value)

    def _enforce(self, spec: ServiceSpec, nodes: dict[str, str], swap: bool) -> None:
        """Write the limits and the closed device policy on the attempt's node."""
        if self._version == 2:
            node = nodes[UNIFIED]
            writes = [
                (node, file, value)
                for file, value in cgroups.v2_writes(spec.limits)
                if swap or file != "memory.swap.max"
            ]
        else:
            writes = [
                (self._node(nodes, controller), file, value)
                for controller, file, value in cgroups.v1_writes(spec.limits, swap)
            ]
            devices = self._node(nodes, "devices")
            writes += [(devices, f, v) for f, v in cgroups.v1_device_writes(spec.devices)]
        for node, file, value in writes:
            path = os.path.join(node, file)
            try:
                cgroups.write_text(path, value)
            except OSError as error:
                raise HostError(
                    HostCode.SERVICE_LIMITS, f"the kernel refused {value!r} for {path}: {error}"
                ) from error
        if self._version == 2:
            bpfdevices.attach(nodes[UNIFIED], spec.devices)

    def _check_hierarchical(self, nodes: dict[str, str]) -> None:
        """Old v1 kernels may leave memory.use_hierarchy at 0, and then the runtime's
        child cgroups would escape the attempt's memory limit."""
        if self._version == 2:
            return
        memory = self._node(nodes, "memory")
        flag = os.path.join(memory, "memory.use_hierarchy")
        if os.path.exists(flag) and cgroups.read_text(flag).strip() != "1":
            raise HostError(
                HostCode.SERVICE_LIMITS,
                f"{memory} has memory.use_hierarchy 0, so child cgroups would escape "
                "the memory limit; set it to 1 on the base cgroup before any child exists",
            )

    def _node(self, nodes: dict[str, str], controller: str) -> str:
        return nodes[self._layout.by_controller(controller).key]

    # --- the start gate --------------------------------------------------------------

    def _spawn(
        self, spec: ServiceSpec, nodes: dict[str, str], stdout: int, stderr: int
    ) -> subprocess.Popen[bytes]:
        order = shim.encode_order(spec.argv, spec.environment)
        gate_read, gate_write = os.pipe()
        ready_read, ready_write = os.pipe()
        try:
            process = subprocess.Popen(
                [
                    self._interpreter,
                    *("-I", "-S", "-c", shim.PIPE_SOURCE),
                    *(str(gate_read), str(ready_write), str(spec.limits.nofile)),
                ],
                stdin=subprocess.DEVNULL,
                stdout=stdout,
                stderr=stderr,
                pass_fds=(gate_read, ready_write),
                cwd=spec.cwd,
                env={},
                user=spec.uid,
                group=spec.gid,
                extra_groups=[],
                umask=spec.umask,
                start_new_session=True,
            )
        except BaseException:
            os.close(gate_write)
            os.close(ready_read)
            raise
        finally:
            os.close(gate_read)
            os.close(ready_write)
        try:
            # Joining first overlaps the kernel's cgroup moves with the interpreter's
            # start-up; the shim runs nothing of the attempt before the order anyway.
            self._join(process.pid, spec.name, nodes)
            self._await_ready(process, ready_read)
            check_credentials(process.pid, spec, groups=frozenset())
            fsutil.write_all(gate_write, order)
            os.close(gate_write)
            gate_write = -1
            self._await_exec(process, ready_read, spec.argv[0])
        except BaseException as error:
            process.kill()
            process.wait()
            if isinstance(error, OSError):
                raise HostError(
                    HostCode.SERVICE_START,
                    f"the start shim of {spec.name} could not be confined and released: {error}",
                ) from error
            raise
        finally:
            os.close(ready_read)
            if gate_write >= 0:
                os.close(gate_write)
        return process

    def _await_ready(self, process: subprocess.Popen[bytes], ready: int) -> None:
        if not _readable(ready, self._start_timeout) or os.read(ready, 1) != b"R":
            process.kill()
            status = process.wait()
            raise HostError(
                HostCode.SERVICE_START,
                f"the start shim did not become ready (exit status {status}); check that "
                f"{self._interpreter} is executable by the slot account and that the "
                "nofile limit does not exceed the daemon's own hard limit",
            )

    def _await_exec(self, process: subprocess.Popen[bytes], ready: int, program: str) -> None:
        """EOF on the close-on-exec ready pipe is the kernel's word that exec worked."""
        if not _readable(ready, self._start_timeout):
            raise HostError(HostCode.SERVICE_START, f"{program} was not executed in time; retry")
        report = os.read(ready, 64)
        if report:
            number = int(report[1:]) if report[1:].isdigit() else 0
            process.wait()
            raise HostError(
                HostCode.SERVICE_START,
                f"cannot execute {program}: {os.strerror(number)}; check the provider's argv",
            )

    def _join(self, pid: int, name: str, nodes: dict[str, str]) -> None:
        """Move the gated shim into every `supervisor` leaf and check the kernel agrees."""
        for node in nodes.values():
            cgroups.write_text(os.path.join(node, SUPERVISOR, "cgroup.procs"), str(pid))
        expected = f"/{self._base}/{name}/{SUPERVISOR}"
        memberships = cgroups.parse_proc_cgroup(cgroups.read_text(f"/proc/{pid}/cgroup"))
        wrong = cgroups.hierarchies_not_at(self._layout, memberships, expected)
        if wrong:
            raise HostError(
                HostCode.SERVICE_START,
                f"process {pid} is not in {expected} of the {', '.join(wrong)} hierarchies "
                "after joining them; refusing to release it",
            )

    # --- observe ---------------------------------------------------------------------

    def controls(self, handle: ServiceHandle) -> Controls:
        self._nodes_of(handle)
        if handle.cgroup_version == 2:
            node = handle.cgroups[UNIFIED]
            quota, period = _read(node, "cpu.max").split()
            return Controls(
                backend=self.backend,
                cgroup_version=2,
                memory_bytes=cgroups.parse_limit(_read(node, "memory.max")),
                swap_bytes=_optional_limit(node, "memory.swap.max"),
                processes=cgroups.parse_limit(_read(node, "pids.max")),
                cpu_millis=cgroups.parse_cpu(quota, period),
                devices=_single_filter(node),
                cgroups=dict(handle.cgroups),
            )
        memory = self._node(handle.cgroups, "memory")
        cpu = self._node(handle.cgroups, "cpu")
        memory_bytes = cgroups.parse_limit(_read(memory, "memory.limit_in_bytes"))
        swap_bytes = None
        if os.path.exists(os.path.join(memory, "memory.memsw.limit_in_bytes")):
            total = cgroups.parse_limit(_read(memory, "memory.memsw.limit_in_bytes"))
            if total is not None and memory_bytes is not None:
                swap_bytes = total - memory_bytes
        return Controls(
            backend=self.backend,
            cgroup_version=1,
            memory_bytes=memory_bytes,
            swap_bytes=swap_bytes,
            processes=cgroups.parse_limit(_read(self._node(handle.cgroups, "pids"), "pids.max")),
            cpu_millis=cgroups.parse_cpu(
                _read(cpu, "cpu.cfs_quota_us"), _read(cpu, "cpu.cfs_period_us")
            ),
            devices=cgroups.parse_devices(
                _read(self._node(handle.cgroups, "devices"), "devices.list")
            ),
            cgroups=dict(handle.cgroups),
        )

    def members(self, handle: ServiceHandle) -> set[int]:
        pids: set[int] = set()
        for node in self._nodes_of(handle).values():
            pids |= cgroups.tree_pids(node)
        return pids

    def occupied(self, handle: ServiceHandle) -> bool:
        unified = self._nodes_of(handle).get(cgroups.UNIFIED)
        if unified is not None and cgroups.populated(unified):
            return True
        return bool(self.members(handle))

    def usage(self, handle: ServiceHandle) -> CgroupUsage:
        return accounting.read_usage(self._layout, self._nodes_of(handle))

    def place_payload(self, handle: ServiceHandle, pid: int) -> None:
        payload.enter(self._layout, self._nodes_of(handle), pid)

    def _nodes_of(self, handle: ServiceHandle) -> dict[str, str]:
        """The handle's nodes, refused unless each is exactly where this backend puts
        it: a corrupted or foreign handle must never make us kill or rmdir elsewhere."""
        check_name(handle.name)
        mounts = {h.key: h.mount for h in self._layout.hierarchies}
        for key, path in handle.cgroups.items():
            if key not in mounts or path != os.path.join(mounts[key], self._base, handle.name):
                raise HostError(
                    HostCode.SERVICE_HANDLE,
                    f"handle of {handle.name} names cgroup {path!r}, which is not this "
                    f"backend's node for {key!r}; adopt the service by name instead",
                )
        if handle.backend != self.backend or handle.cgroup_version != self._layout.version:
            raise HostError(
                HostCode.SERVICE_HANDLE, f"handle of {handle.name} is not a cgroupfs one"
            )
        return dict(handle.cgroups)

    def exit_status(self, handle: ServiceHandle) -> int | None:
        with self._lock:
            process = self._started.get(handle.name)
        if process is None or process.pid != handle.main_pid:
            return None
        return process.poll()

    def is_idle(self, handle: ServiceHandle, uid: int) -> bool:
        """Zombies are not counted: they hold no resources and cannot run code."""
        return not self.occupied(handle) and not has_live_tasks(uid)

    def supervisor_cgroup(self, handle: ServiceHandle) -> str:
        return self.planned_supervisor_cgroup(handle.name)

    def planned_supervisor_cgroup(self, name: str) -> str:
        return f"/{self._base}/{check_name(name)}/{PAYLOAD}"

    def account_idle(self, uid: int) -> bool:
        return not has_live_tasks(uid)

    def kill_account(self, uid: int, timeout: float | None = None) -> bool:
        return kill_account(uid, self._stop_timeout if timeout is None else timeout)

    def planned_cgroups(self, name: str) -> list[str]:
        check_name(name)
        return [os.path.join(h.mount, self._base, name) for h in self._layout.hierarchies]

    def place_reaper(self, pid: int) -> list[str]:
        """`<base>/lease-reaper` in every hierarchy: outside the daemon's cgroup (a
        freeze or a kill of that cgroup leaves the reaper running) and outside every
        attempt's (stopping an attempt never stops it)."""
        placed = []
        for hierarchy in self._layout.hierarchies:
            base = os.path.join(hierarchy.mount, self._base)
            cgroups.make_dir(base, exclusive=False)
            self._inherit_cpuset(hierarchy.key, base)
            node = os.path.join(base, REAPER_CGROUP)
            cgroups.make_dir(node, exclusive=False)
            self._inherit_cpuset(hierarchy.key, node)
            with open(os.path.join(node, "cgroup.procs"), "w", encoding="ascii") as procs:
                procs.write(str(pid))
            placed.append(node)
        return placed

    def reaper_unit(self, installation_id: str) -> str | None:
        """None: the daemon spawns the reaper and moves it (`place_reaper`)."""
        return None

    def start_reaper(self, unit: str, command: list[str], directory: str) -> bool:
        raise HostError(
            HostCode.SERVICE_UNSUPPORTED, "the cgroupfs backend runs no units; use place_reaper"
        )

    def adopt(self, name: str) -> ServiceHandle | None:
        check_name(name)
        nodes = {
            h.key: os.path.join(h.mount, self._base, name)
            for h in self._layout.hierarchies
            if cgroups.is_real_dir(os.path.join(h.mount, self._base, name))
        }
        if not nodes:
            return None
        return ServiceHandle(name, self.backend, self._layout.version, nodes, None, None)

    # --- stop and remove -------------------------------------------------------------

    def stop(self, handle: ServiceHandle) -> None:
        self._nodes_of(handle)
        deadline = time.monotonic() + self._stop_timeout
        if self._cgroup_kill(handle):
            wait_until(lambda: not self.occupied(handle), min(deadline, time.monotonic() + 1.0))
        while pids := self.members(handle):
            if time.monotonic() >= deadline:
                raise HostError(
                    HostCode.SERVICE_STOP_UNCONFIRMED,
                    f"service {handle.name} still has processes {sorted(pids)[:16]} after "
                    f"{self._stop_timeout}s; keep the attempt quarantined and retry stop",
                )
            self._freeze_and_kill(handle, deadline)
            wait_until(lambda: not self.occupied(handle), min(deadline, time.monotonic() + 0.2))
        with self._lock:
            process = self._started.get(handle.name)
        if process is not None and process.pid == handle.main_pid:
            try:
                process.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired as error:
                raise HostError(
                    HostCode.SERVICE_STOP_UNCONFIRMED,
                    f"the main process of {handle.name} left the tree but has not exited; "
                    "retry stop",
                ) from error

    def _cgroup_kill(self, handle: ServiceHandle) -> bool:
        """SIGKILL the unified subtree atomically (kernel >= 5.14); False if unavailable."""
        node = handle.cgroups.get(UNIFIED)
        if node is None or not os.path.exists(os.path.join(node, "cgroup.kill")):
            return False
        cgroups.write_text(os.path.join(node, "cgroup.kill"), "1")
        return True

    def _freeze_and_kill(self, handle: ServiceHandle, deadline: float) -> None:
        """Freeze (so nothing forks or exits meanwhile), SIGKILL every member, thaw.

        Thawing covers every node of the subtree: a runtime may have frozen its own
        child cgroup (a paused container), and a killed task that stays frozen never
        dies.
        """
        freezer = self._freezer(handle)
        if freezer is not None:
            top, state, frozen, _ = freezer
            path = os.path.join(top, state)
            cgroups.write_text(path, frozen)
            wait_until(
                lambda: cgroups.read_text(path).strip() in {"FROZEN", "1"},
                min(deadline, time.monotonic() + 1.0),
            )
        try:
            for pid in self.members(handle):
                self._kill_member(pid, handle.name)
        finally:
            if freezer is not None:
                top, state, _, thawed = freezer
                for node in cgroups.walk_nodes(top):
                    cgroups.write_text(os.path.join(node, state), thawed)

    def _freezer(self, handle: ServiceHandle) -> tuple[str, str, str, str] | None:
        """(node, state file, frozen value, thawed value) of the tree's freezer."""
        if handle.cgroup_version == 2:
            return handle.cgroups[UNIFIED], "cgroup.freeze", "1", "0"
        key = self._layout.by_controller("freezer").key
        if key not in handle.cgroups:
            return None
        return handle.cgroups[key], "freezer.state", "FROZEN", "THAWED"

    def _kill_member(self, pid: int, name: str) -> None:
        try:
            pidfd = os.pidfd_open(pid)
        except ProcessLookupError:
            return
        try:
            prefix = f"/{self._base}/{name}"
            paths = cgroups.parse_proc_cgroup(cgroups.read_text(f"/proc/{pid}/cgroup")).values()
            if any(p == prefix or p.startswith(prefix + "/") for p in paths):
                signal.pidfd_send_signal(pidfd, signal.SIGKILL)
        except (ProcessLookupError, FileNotFoundError):
            pass
        finally:
            os.close(pidfd)

    def remove(self, handle: ServiceHandle) -> None:
        pids = self.members(handle)
        if pids:
            raise HostError(
                ErrorCode.SERVICE_NOT_EMPTY,
                f"service {handle.name} still has processes {sorted(pids)[:16]}; stop it "
                "and confirm it is empty before removing it",
            )
        for node in self._nodes_of(handle).values():
            try:
                cgroups.remove_tree(node)
            except OSError as error:
                raise HostError(
                    ErrorCode.SERVICE_NOT_EMPTY,
                    f"cgroup {node} could not be removed ({error}); stop the service and retry",
                ) from error
        with self._lock:
            process = self._started.get(handle.name)
            if process is not None and process.pid == handle.main_pid:
                del self._started[handle.name]

    def _abandon(
        self, name: str, created: dict[str, str], process: subprocess.Popen[bytes] | None
    ) -> None:
        """Undo a refused create: kill what started, remove only the nodes made here."""
        if process is not None and process.poll() is None:
            process.kill()
            process.wait()
        if created:
            handle = ServiceHandle(name, self.backend, self._version, created, None, None)
            self.stop(handle)
            self.remove(handle)


# --- helpers -----------------------------------------------------------------------


def _verify(spec: ServiceSpec, controls: Controls, swap: bool) -> None:
    """Refuse unless every control the kernel reports is exactly what was planned."""
    planned = cgroups.planned_controls(spec, swap)
    wrong = cgroups.mismatches(planned, cgroups.kernel_controls(controls))
    if wrong:
        raise HostError(
            HostCode.SERVICE_LIMITS,
            f"the kernel does not enforce the planned controls for {spec.name}: "
            + "; ".join(wrong),
        )


def _delegate_controllers(parent: str, controllers: frozenset[str]) -> None:
    """Enable v2 controllers for the children of `parent` (those not enabled yet)."""
    path = os.path.join(parent, "cgroup.subtree_control")
    missing = controllers - set(cgroups.read_text(path).split())
    if missing:
        cgroups.write_text(path, " ".join(f"+{name}" for name in sorted(missing)))


def _single_filter(node: str) -> list[DeviceAccess] | None:
    """The device rules if exactly one filter of our shape is attached, else None."""
    try:
        filters = bpfdevices.attached(node)
    except OSError as error:  # bpf() refused (no CAP_BPF?) or the cgroup went away
        raise HostError(
            HostCode.SERVICE_DEVICES,
            f"the device filter of {node} cannot be read back ({error}); the payload is not "
            "released: give the daemon CAP_BPF and CAP_SYS_ADMIN",
        ) from error
    return filters[0] if len(filters) == 1 else None


def _optional_limit(node: str, name: str) -> int | None:
    path = os.path.join(node, name)
    return cgroups.parse_limit(cgroups.read_text(path)) if os.path.exists(path) else None


def _read(node: str, name: str) -> str:
    return cgroups.read_text(os.path.join(node, name))


def _readable(fd: int, timeout: float) -> bool:
    """poll(2), not select(2): a busy daemon's descriptors may exceed FD_SETSIZE."""
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    return bool(poller.poll(timeout * 1000))


"""Between looks for what a SIGKILL of a slot account's processes left alive."""
