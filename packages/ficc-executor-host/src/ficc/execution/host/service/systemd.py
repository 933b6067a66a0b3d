"""The `systemd` system service: each attempt is a transient unit of systemd (PID 1).

For hosts where systemd is PID 1. The attempt's service is the unit
`<name>.service` (the daemon names it `ficc-work-<installation>-<attempt>`) in
`ficc.slice`, created with `systemd-run`. Why `systemd-run` rather than D-Bus
`StartTransientUnit`: the daemon depends only on msgspec, uvloop and pybase64, and
no D-Bus client is among them; `systemd-run` is systemd's own client for exactly
this call (it sends StartTransientUnit and waits for the start job), it is present
wherever systemd is, and creating a unit is rare (once per attempt), so a process
spawn costs nothing that matters. Everything systemd reports is read back with
`systemctl show`, and every limit is also read from the cgroup files themselves.

The unit's properties and the lease reaper's unit are in `units`; the start gate's
socket is in `gate_socket`.

Stop: `systemctl kill --signal=SIGKILL`, then the tree is confirmed empty from the
cgroup files (falling back to the cgroupfs backend's cgroup.kill and freezer path),
then `systemctl stop`. Remove: `systemctl reset-failed`, and the unit must be gone.

The cgroup file reading and killing are shared with the cgroupfs backend: a private
`CgroupfsService` whose base is the slice reads the unit's nodes, so both backends
report controls and members in exactly the same way. systemd's own controller-less
`name=systemd` v1 tree is left to systemd.

Differences from the cgroupfs backend (the shared behaviour tests pin them down):
`User=` gives the slot account its own primary GID as the one supplementary group;
systemd removes a unit's cgroups as soon as they are empty, and stops the whole
tree when the main process fails (its exit status stays readable until `remove`,
also after a daemon restart). What a unit used (`usage`) is read from the same
cgroup files as in the cgroupfs backend, so once systemd removed them (a failed main
process) the figures are unknown, never guessed. On cgroup v2 the device policy is systemd's own BPF
program on the unit's cgroup, read back and decoded by `systemd_devices` (exactly the
shapes systemd 252 emits); any other program, a second one, or other flags make
`create` refuse (`service_devices_unenforceable`) rather than run without a verified
device policy. The v2 device read-back is tested under systemd booted in unified mode
(tools/systemd/unified.py); the whole backend is tested on cgroup v1 (hybrid) only.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import socket
import subprocess
import time

import msgspec

from ficc.execution.errors import ErrorCode
from ficc.execution.host.core.codes import HostCode
from ficc.execution.host.core.errors import HostError
from ficc.execution.host.linux import procfs
from ficc.execution.host.service import (
    accounting,
    cgroups,
    gate_socket,
    payload,
    shim,
    systemd_devices,
)
from ficc.execution.host.service.cgroupfs import CgroupfsService
from ficc.execution.host.service.cgroups import Layout
from ficc.execution.host.service.interface import (
    CgroupUsage,
    Controls,
    DeviceAccess,
    ServiceHandle,
    ServiceSpec,
    check_account,
)
from ficc.execution.host.service.launch import (
    DEFAULT_INTERPRETER,
    check_credentials,
    open_output,
    trusted_interpreter,
    wait_until,
)
from ficc.execution.host.service.units import (
    PAYLOAD,
    SLICE,
    SUPERVISOR,
    SYSTEMD_RUN,
    UNIT_SUFFIX,
    check_unit,
    exit_status_of,
    own_unit,
    parse_proc_devices,
    parse_show,
    parse_usec,
    reaper_run_argv,
    reaper_unit,
    run_properties,
    unit_cgroup,
    unit_name,
)

#: Under the daemon's RuntimeDirectory (the unit's ProtectSystem=strict leaves the rest
#: of /run read-only); the gate sockets live in random subdirectories of it.
RUNTIME_DIR = "/run/ficc-executor/service-gates"
SYSTEMCTL = "/usr/bin/systemctl"
_OUTPUT_LIMIT = 1 << 20

_SHIM = shim.SOCKET_SOURCE
"""The gate program the unit runs (shim.py)."""


# --- pure helpers ------------------------------------------------------------------


# --- the backend ---------------------------------------------------------------------


class SystemdService:
    """`SystemService` on transient systemd units; see the module docstring."""

    backend = "systemd"

    def __init__(
        self,
        *,
        bind_to: str | None = None,
        bind_to_own_unit: bool = True,
        slice_name: str = SLICE,
        layout: Layout | None = None,
        interpreter: str | None = None,
        runtime_dir: str = RUNTIME_DIR,
        start_timeout: float = 10.0,
        stop_timeout: float = 10.0,
        root_supervisor: bool = False,
    ) -> None:
        if not slice_name.endswith(".slice") or "-" in slice_name or "/" in slice_name:
            raise HostError(HostCode.SERVICE_SPEC, f"{slice_name!r} must be a top-level .slice")
        self._slice = slice_name
        if bind_to is None and bind_to_own_unit:
            with open("/proc/self/cgroup", encoding="ascii") as listing:
                bind_to = own_unit(listing.read(1 << 20))
            if bind_to is None:
                raise HostError(
                    HostCode.SERVICE_UNSUPPORTED,
                    "this process does not run in a systemd service unit, so attempts "
                    "cannot be bound to it (a daemon stop would leave them running); run "
                    "the daemon as its systemd service or use the cgroupfs supervisor",
                )
        self._bind_to = None if bind_to is None else check_unit(bind_to)
        self._layout = layout if layout is not None else cgroups.discover()
        self._files = CgroupfsService(
            slice_name, layout=self._layout, interpreter=interpreter, stop_timeout=stop_timeout
        )
        self._interpreter = trusted_interpreter(interpreter or DEFAULT_INTERPRETER)
        self._runtime_dir = runtime_dir
        self._start_timeout = start_timeout
        self._stop_timeout = stop_timeout
        self._root_supervisor = root_supervisor

    @property
    def layout(self) -> Layout:
        return self._layout

    @property
    def bind_to(self) -> str | None:
        return self._bind_to

    # --- create ----------------------------------------------------------------------

    def create(self, spec: ServiceSpec) -> ServiceHandle:
        check_account(spec, root_supervisor=self._root_supervisor)
        unit = unit_name(spec.name)
        for device in spec.devices:
            cgroups.check_device_node(device)
        if not os.path.isdir(spec.cwd):
            raise HostError(
                HostCode.SERVICE_CREATE,
                f"working directory {spec.cwd} of {spec.name} does not exist",
            )
        with open("/proc/devices", encoding="ascii") as listing:
            classes = parse_proc_devices(listing.read(1 << 20))
        # A short random name: a socket path must fit in 108 bytes, a unit name may not.
        gate_dir = os.path.join(self._runtime_dir, secrets.token_hex(8))
        properties = run_properties(
            spec,
            slice_name=self._slice,
            bind_to=self._bind_to,
            cgroup_version=self._layout.version,
            classes=classes,
            stdin_file=os.path.join(gate_dir, "empty"),
        )
        if self._show(unit, "LoadState").get("LoadState") not in {"not-found", None}:
            raise HostError(
                HostCode.SERVICE_EXISTS,
                f"unit {unit} already exists; stop and remove the old service (adopt it by "
                "name) before creating it again",
            )
        # The program's stdin is the host's /dev/null, opened here, outside the unit's
        # device policy (as the cgroupfs backend does).
        outputs = [os.open(os.devnull, os.O_RDWR | os.O_CLOEXEC)]
        listener: socket.socket | None = None
        started = False
        try:
            outputs.append(open_output(spec.stdout))
            outputs.append(open_output(spec.stderr))
            listener = gate_socket.listen(self._runtime_dir, gate_dir, spec, self._start_timeout)
            started = self._run(unit, properties, os.path.join(gate_dir, "gate"))
            handle = self._gate(spec, unit, listener, outputs)
        except BaseException as error:
            if started:
                try:
                    self._abandon(spec.name)
                except HostError as cleanup:
                    error.add_note(f"cleanup after the refusal also failed: {cleanup}")
            if isinstance(error, OSError):
                raise HostError(
                    HostCode.SERVICE_CREATE,
                    f"creating unit {unit} failed: {error}; check systemd, the working "
                    "directory and the output paths",
                ) from error
            raise
        finally:
            for fd in outputs:
                os.close(fd)
            if listener is not None:
                listener.close()
            shutil.rmtree(gate_dir, ignore_errors=True)
        return handle

    def _run(self, unit: str, properties: list[str], gate: str) -> bool:
        """Create and start the unit; True once it is ours (even if its start failed,
        so the caller cleans it up), an exception naming the cause otherwise.

        A unit of that name created meanwhile by someone else is `service_exists` and
        is never cleaned up here: it is not ours.
        """
        argv = [SYSTEMD_RUN, "--quiet", f"--unit={unit}"]
        argv += [f"--property={p}" for p in properties]
        argv += ["--", self._interpreter, "-I", "-S", "-c", _SHIM, gate]
        result = _command(argv, self._start_timeout)
        if result.returncode == 0:
            return True
        reason = result.stderr.strip()[:2000]
        if "already" in reason:
            raise HostError(HostCode.SERVICE_EXISTS, f"unit {unit} already exists: {reason}")
        self._abandon(unit.removesuffix(UNIT_SUFFIX))
        raise HostError(HostCode.SERVICE_START, f"systemd could not start unit {unit}: {reason}")

    def _gate(
        self, spec: ServiceSpec, unit: str, listener: socket.socket, outputs: list[int]
    ) -> ServiceHandle:
        try:
            link, _ = listener.accept()
        except TimeoutError as error:
            raise HostError(
                HostCode.SERVICE_START,
                f"the start shim of {unit} did not connect within {self._start_timeout}s; "
                f"check `journalctl -u {unit}` and that {self._interpreter} runs as the slot "
                "account",
            ) from error
        with link:
            link.settimeout(self._start_timeout)
            pid, uid, gid = gate_socket.peer(link)
            if link.recv(1) != b"R":
                raise HostError(HostCode.SERVICE_START, f"the start shim of {unit} did not report")
            show = self._show(unit, "MainPID", "ControlGroup")
            if show.get("MainPID") != str(pid) or (uid, gid) != (spec.uid, spec.gid):
                raise HostError(
                    HostCode.SERVICE_START,
                    f"the gate peer (pid {pid}, uid {uid}) is not the main process "
                    f"{show.get('MainPID')} of {unit} as the slot account; refusing to release",
                )
            check_credentials(pid, spec, groups=frozenset({str(spec.gid)}))
            nodes = self._nodes(spec.name, show.get("ControlGroup", ""))
            handle = ServiceHandle(
                spec.name, self.backend, self._layout.version, nodes, pid, procfs.start_ticks(pid)
            )
            self._check_member(pid, unit_cgroup(self._slice, spec.name), nodes)
            swap = self._enforce_swap(spec, nodes)
            self._verify(spec, handle, swap)
            self._enter_supervisor(pid, spec.name, nodes)
            gate_socket.send_order(link, shim.encode_order(spec.argv, spec.environment), outputs)
            link.shutdown(socket.SHUT_WR)
            report = gate_socket.recv_report(link)
            if report:
                number = int(report[1:]) if report[1:].isdigit() else 0
                raise HostError(
                    HostCode.SERVICE_START,
                    f"cannot execute {spec.argv[0]}: {os.strerror(number)}; check the "
                    "provider's argv",
                )
        return handle

    def _nodes(self, name: str, control_group: str) -> dict[str, str]:
        """The unit's node in every hierarchy where systemd made one."""
        expected = unit_cgroup(self._slice, name)
        if control_group != expected:
            raise HostError(
                HostCode.SERVICE_START,
                f"systemd put the unit in cgroup {control_group!r}, not {expected!r}",
            )
        nodes = self._existing_nodes(expected)
        required = ["memory", "pids", "cpu"] + (["devices"] if self._layout.version == 1 else [])
        missing = [c for c in required if self._key(c) not in nodes]
        if missing:
            raise HostError(
                HostCode.SERVICE_LIMITS,
                f"systemd did not create the unit's cgroup for {missing}; limits there "
                "cannot be enforced",
            )
        return nodes

    def _existing_nodes(self, path: str) -> dict[str, str]:
        """The unit's node in every hierarchy where it exists, except systemd's own
        controller-less `name=systemd` tree: systemd alone manages it (and inside a
        container its paths are relative to another root), it limits nothing, and the
        unified tree already tracks the same membership."""
        return {
            h.key: h.mount + path
            for h in self._layout.hierarchies
            if not h.key.startswith("name=") and cgroups.is_real_dir(h.mount + path)
        }

    def _key(self, controller: str) -> str:
        return self._layout.by_controller(controller).key

    def _check_member(self, pid: int, path: str, nodes: dict[str, str]) -> None:
        memberships = cgroups.parse_proc_cgroup(cgroups.read_text(f"/proc/{pid}/cgroup"))
        wrong = [
            key
            for key in cgroups.hierarchies_not_at(self._layout, memberships, path)
            if key in nodes
        ]
        if wrong:
            raise HostError(
                HostCode.SERVICE_START,
                f"process {pid} is not in {path} of the {', '.join(wrong)} hierarchies; "
                "refusing to release it",
            )

    def _enforce_swap(self, spec: ServiceSpec, nodes: dict[str, str]) -> bool:
        """v1: systemd leaves memsw alone, so the host writes it (before release)."""
        memory = nodes[self._key("memory")]
        if self._layout.version == 2:
            return os.path.exists(os.path.join(memory, "memory.swap.max"))
        path = os.path.join(memory, "memory.memsw.limit_in_bytes")
        if not os.path.exists(path):
            if cgroups.host_has_swap():
                raise HostError(
                    HostCode.SERVICE_SWAP_UNENFORCEABLE,
                    "the kernel has no swap accounting but swap is active, so the swap "
                    "limit cannot be enforced; boot with swapaccount=1 or disable swap",
                )
            return False
        total = cgroups.page_floor(spec.limits.memory_bytes) + cgroups.page_floor(
            spec.limits.swap_bytes
        )
        try:
            cgroups.write_text(path, str(total))
        except OSError as error:
            raise HostError(
                HostCode.SERVICE_LIMITS, f"the kernel refused {total} for {path}"
            ) from error
        return True

    def _enter_supervisor(self, pid: int, name: str, nodes: dict[str, str]) -> None:
        """Move the gated shim into `supervisor` in every hierarchy (Delegate=yes makes
        the unit's subtree ours), so `payload` can be a sibling, as in cgroupfs."""
        for key, node in nodes.items():
            leaf = os.path.join(node, SUPERVISOR)
            cgroups.make_dir(leaf, exclusive=True)
            if "cpuset" in key.split(","):
                for file in ("cpuset.cpus", "cpuset.mems"):
                    value = cgroups.read_text(os.path.join(node, file)).strip()
                    cgroups.write_text(os.path.join(leaf, file), value)
            cgroups.write_text(os.path.join(leaf, "cgroup.procs"), str(pid))
        self._check_member(pid, f"{unit_cgroup(self._slice, name)}/{SUPERVISOR}", nodes)

    def _verify(self, spec: ServiceSpec, handle: ServiceHandle, swap: bool) -> None:
        """Refuse unless systemd's view and the kernel's both match the plan."""
        wrong = cgroups.mismatches(self._planned_systemd(spec), self._systemd_view(handle.name))
        controls = self._controls(handle, strict=True)
        wrong += cgroups.mismatches(
            cgroups.planned_controls(spec, swap), cgroups.kernel_controls(controls)
        )
        if wrong:
            raise HostError(
                HostCode.SERVICE_LIMITS,
                f"the planned controls of {spec.name} are not in force: " + "; ".join(wrong),
            )

    def _planned_systemd(self, spec: ServiceSpec) -> dict[str, str]:
        limits = spec.limits
        planned = {
            "CPUQuotaPerSecUSec": str(limits.cpu_millis * 1000),
            "MemoryMax": str(cgroups.page_floor(limits.memory_bytes)),
            "TasksMax": str(limits.processes),
            "LimitCORE": "0",
            "LimitNOFILE": str(limits.nofile),
            "LimitNOFILESoft": str(limits.nofile),
            "KillMode": "control-group",
            "KillSignal": "9",
            "DevicePolicy": "strict",
            "Delegate": "yes",
            "User": str(spec.uid),
            "Group": str(spec.gid),
        }
        if self._bind_to is not None:
            planned["BindsTo"] = self._bind_to
        return planned

    def _systemd_view(self, name: str) -> dict[str, str]:
        keys = [
            "CPUQuotaPerSecUSec",
            "MemoryMax",
            "TasksMax",
            "LimitCORE",
            "LimitNOFILE",
            "LimitNOFILESoft",
            "KillMode",
            "KillSignal",
            "DevicePolicy",
            "Delegate",
            "User",
            "Group",
        ] + (["BindsTo"] if self._bind_to is not None else [])
        view = self._show(unit_name(name), *keys)
        view["CPUQuotaPerSecUSec"] = str(parse_usec(view.get("CPUQuotaPerSecUSec", "")))
        return view

    # --- observe ---------------------------------------------------------------------

    def controls(self, handle: ServiceHandle) -> Controls:
        return self._controls(handle, strict=False)

    def _controls(self, handle: ServiceHandle, *, strict: bool) -> Controls:
        """The cgroup files' controls; on v2 the devices are decoded from systemd's own
        program (`systemd_devices`). `strict` raises the reason it cannot be (for the
        start gate) instead of reporting None (for observers)."""
        files = self._as_files(handle)
        read = self._files.controls(files)
        if handle.cgroup_version == 2:
            read = msgspec.structs.replace(
                read, devices=_unit_devices(files.cgroups[cgroups.UNIFIED], strict=strict)
            )
        return msgspec.structs.replace(read, backend=self.backend)

    def members(self, handle: ServiceHandle) -> set[int]:
        return self._files.members(self._as_files(handle))

    def occupied(self, handle: ServiceHandle) -> bool:
        return self._files.occupied(self._as_files(handle))

    def usage(self, handle: ServiceHandle) -> CgroupUsage:
        """Read from the unit's nodes that exist now (systemd may have created more
        than the handle names, or already removed some: see the module docstring)."""
        self._as_files(handle)
        nodes = {**handle.cgroups, **self._existing_nodes(unit_cgroup(self._slice, handle.name))}
        return accounting.read_usage(self._layout, nodes)

    def place_payload(self, handle: ServiceHandle, pid: int) -> None:
        """In the unit's nodes that exist now, as `usage` reads them (Delegate=yes makes
        the unit's subtree ours, as for `supervisor`)."""
        self._as_files(handle)
        nodes = {**handle.cgroups, **self._existing_nodes(unit_cgroup(self._slice, handle.name))}
        payload.enter(self._layout, nodes, pid)

    def exit_status(self, handle: ServiceHandle) -> int | None:
        self._as_files(handle)
        show = self._show(
            unit_name(handle.name), "LoadState", "ExecMainCode", "ExecMainStatus", "MainPID"
        )
        return exit_status_of(show)

    def is_idle(self, handle: ServiceHandle, uid: int) -> bool:
        return not self.occupied(handle) and self._files.account_idle(uid)

    def account_idle(self, uid: int) -> bool:
        return self._files.account_idle(uid)

    def kill_account(self, uid: int, timeout: float | None = None) -> bool:
        return self._files.kill_account(uid, timeout)

    def supervisor_cgroup(self, handle: ServiceHandle) -> str:
        return self.planned_supervisor_cgroup(handle.name)

    def planned_supervisor_cgroup(self, name: str) -> str:
        return f"{unit_cgroup(self._slice, name)}/{PAYLOAD}"

    def place_reaper(self, pid: int) -> list[str]:
        """Not used: the reaper runs as a unit of its own (`start_reaper`)."""
        return []

    def reaper_unit(self, installation_id: str) -> str | None:
        return reaper_unit(installation_id)

    def start_reaper(self, unit: str, command: list[str], directory: str) -> bool:
        """Create and start the reaper's unit; True once its reaper has been executed,
        False when systemd refuses because a unit of that name is still there (its
        reaper coming up, waiting to be restarted or exiting). `service_start` when
        systemd could not start it for any other reason."""
        argv = reaper_run_argv(unit, command, directory=directory, slice_name=self._slice)
        result = _command(argv, self._start_timeout)
        if result.returncode == 0:
            return True
        reason = result.stderr.strip()[:2000]
        if "already" in reason:
            return False
        raise HostError(
            HostCode.SERVICE_START,
            f"systemd could not start the lease reaper's unit {unit}: {reason}; see "
            f"`journalctl -u {unit}`",
        )

    def planned_cgroups(self, name: str) -> list[str]:
        path = unit_cgroup(self._slice, name)
        return [h.mount + path for h in self._layout.hierarchies if not h.key.startswith("name=")]

    def adopt(self, name: str) -> ServiceHandle | None:
        """The unit if systemd knows it, or its cgroups if any are left behind."""
        nodes = self._existing_nodes(unit_cgroup(self._slice, name))
        show = self._show(unit_name(name), "LoadState", "Slice")
        loaded = show.get("LoadState") == "loaded"
        if loaded and show.get("Slice") != self._slice:
            raise HostError(
                HostCode.SERVICE_HANDLE,
                f"unit {unit_name(name)} exists in {show.get('Slice')!r}, not in "
                f"{self._slice}: it is not an attempt's service; leave it alone",
            )
        if not nodes and not loaded:
            return None
        return ServiceHandle(name, self.backend, self._layout.version, nodes, None, None)

    def _as_files(self, handle: ServiceHandle) -> ServiceHandle:
        """The same nodes as a handle of the private cgroupfs reader (base = slice),
        refused unless each node is exactly this unit's cgroup (`service_handle`)."""
        if handle.backend != self.backend or handle.cgroup_version != self._layout.version:
            raise HostError(
                HostCode.SERVICE_HANDLE, f"handle of {handle.name} is not a systemd one"
            )
        path = unit_cgroup(self._slice, handle.name)
        mounts = {h.key: h.mount for h in self._layout.hierarchies}
        for key, node in handle.cgroups.items():
            if key not in mounts or key.startswith("name=") or node != mounts[key] + path:
                raise HostError(
                    HostCode.SERVICE_HANDLE,
                    f"handle of {handle.name} names cgroup {node!r}, which is not its unit's "
                    f"node for {key!r}; adopt the service by name instead",
                )
        unit = unit_name(handle.name)
        return msgspec.structs.replace(handle, name=unit, backend=self._files.backend)

    def _show(self, unit: str, *keys: str) -> dict[str, str]:
        argv = [SYSTEMCTL, "show", unit, *(f"--property={k}" for k in keys)]
        result = _command(argv, self._stop_timeout)
        if result.returncode != 0:
            raise HostError(
                HostCode.SERVICE_UNSUPPORTED,
                f"systemctl show {unit} failed: {result.stderr.strip()[:2000]}; is systemd "
                "PID 1 and D-Bus running?",
            )
        return parse_show(result.stdout)

    # --- stop and remove -------------------------------------------------------------

    def stop(self, handle: ServiceHandle) -> None:
        self._as_files(handle)
        # Look again: a runtime may have made nodes below the unit in hierarchies that
        # systemd does not manage for it (runc's v1 freezer cgroup of a paused container,
        # whose tasks SIGKILL cannot reach until they are thawed).
        current = self._existing_nodes(unit_cgroup(self._slice, handle.name))
        files = self._as_files(
            msgspec.structs.replace(handle, cgroups={**handle.cgroups, **current})
        )
        unit = unit_name(handle.name)
        deadline = time.monotonic() + self._stop_timeout
        # Fails harmlessly when the unit is already gone; the cgroup files decide.
        _command([SYSTEMCTL, "kill", "--signal=SIGKILL", unit], self._stop_timeout)
        if not wait_until(
            lambda: not self._files.members(files), min(deadline, time.monotonic() + 1.0)
        ):
            # systemd removes a unit's cgroups once they are empty, possibly while the
            # cgroupfs path (cgroup.kill, then freeze and kill) is working on them.
            with contextlib.suppress(FileNotFoundError):
                self._files.stop(files)
        pids = self._files.members(files)
        if pids:
            raise HostError(
                HostCode.SERVICE_STOP_UNCONFIRMED,
                f"unit {unit} still has processes {sorted(pids)[:16]}; keep the attempt "
                "quarantined and retry stop",
            )
        result = _command([SYSTEMCTL, "stop", unit], self._stop_timeout)
        if not wait_until(lambda: self._settled(unit), deadline):
            raise HostError(
                HostCode.SERVICE_STOP_UNCONFIRMED,
                f"unit {unit} is empty but systemd did not confirm the stop "
                f"({result.stderr.strip()[:500]}); retry stop",
            )

    def _settled(self, unit: str) -> bool:
        show = self._show(unit, "LoadState", "ActiveState")
        return show.get("LoadState") != "loaded" or show.get("ActiveState") in {
            "inactive",
            "failed",
        }

    def remove(self, handle: ServiceHandle) -> None:
        files = self._as_files(handle)
        pids = self._files.members(files)
        if pids:
            raise HostError(
                ErrorCode.SERVICE_NOT_EMPTY,
                f"service {handle.name} still has processes {sorted(pids)[:16]}; stop it "
                "and confirm it is empty before removing it",
            )
        unit = unit_name(handle.name)
        if not self._settled(unit):
            raise HostError(
                ErrorCode.SERVICE_NOT_EMPTY, f"unit {unit} is still active; stop it before removing"
            )
        _command([SYSTEMCTL, "reset-failed", unit], self._stop_timeout)
        self._files.remove(files)
        self._trim(handle.name)
        deadline = time.monotonic() + self._stop_timeout
        if not wait_until(
            lambda: self._show(unit, "LoadState").get("LoadState") != "loaded", deadline
        ):
            raise HostError(
                ErrorCode.SERVICE_NOT_EMPTY, f"systemd still has unit {unit} loaded; retry remove"
            )

    def _trim(self, name: str) -> None:
        """Remove what a runtime left below the unit in hierarchies systemd does not
        manage for it (runc with the cgroupfs driver creates its `payload/libpod-*`
        path in every hierarchy, e.g. cpuset and freezer; systemd trims only its own)."""
        path = unit_cgroup(self._slice, name)
        for hierarchy in self._layout.hierarchies:
            if hierarchy.key.startswith("name="):
                continue
            top = hierarchy.mount + path
            try:
                cgroups.remove_tree(top)
            except OSError as error:
                raise HostError(
                    ErrorCode.SERVICE_NOT_EMPTY,
                    f"cgroup {top} could not be removed ({error}); stop the service and retry",
                ) from error

    def _abandon(self, name: str) -> None:
        handle = self.adopt(name)
        if handle is not None:
            self.stop(handle)
            self.remove(handle)


# --- helpers -----------------------------------------------------------------------


def _command(argv: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
    """systemctl/systemd-run with a fixed environment, a deadline and bounded output."""
    try:
        result = subprocess.run(
            argv,
            capture_output=True,
            text=True,
            env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C", "SYSTEMD_PAGER": ""},
            timeout=timeout,
            check=False,
            stdin=subprocess.DEVNULL,
        )
    except subprocess.TimeoutExpired as error:
        raise HostError(
            HostCode.SERVICE_UNSUPPORTED, f"{argv[0]} did not answer within {timeout}s"
        ) from error
    except FileNotFoundError as error:
        raise HostError(HostCode.SERVICE_UNSUPPORTED, f"{argv[0]} is missing: {error}") from error
    result.stdout = result.stdout[:_OUTPUT_LIMIT]
    return result


def _unit_devices(node: str, *, strict: bool) -> list[DeviceAccess] | None:
    try:
        return systemd_devices.read_back(node)
    except HostError:
        if strict:
            raise
        return None
