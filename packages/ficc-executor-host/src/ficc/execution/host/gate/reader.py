"""The payload gate's reader: all the evidence about one live process, in one `Evidence`.

procfs parses each /proc file and reads it safely (relative to one /proc/PID directory
fd, bounded, without following links); this module reads them all, with the process's
seccomp filters (seccomp) and the device programs of its cgroup v2 (decoded by the
service backends' BPF readers), and refuses a process whose start time changed while
it was read (`gate_process_changed`). Nothing it returns is trusted: only the gate
judges the evidence.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable

from ficc.execution.host.core.errors import HostError
from ficc.execution.host.linux import seccomp
from ficc.execution.host.linux.evidence import (
    CgroupEntry,
    DeviceAccess,
    DeviceProgram,
    Evidence,
    Status,
    malformed,
    process_changed,
)
from ficc.execution.host.linux.procfs import (
    open_process_dir,
    own_mounts,
    read_bounded,
    read_devices,
    read_exe,
    read_fds,
    read_mounts,
    read_namespaces,
    read_stat,
    reference_namespaces,
)
from ficc.execution.host.linux.procparse import parse_cgroup, parse_limits, parse_status
from ficc.execution.host.service import bpfdevices, systemd_devices


def _cgroup2_mount(pid: int) -> str | None:
    """Where the daemon sees the cgroup v2 hierarchy (its own mountinfo), if anywhere."""
    for mount in own_mounts(pid):
        if mount.fs_type == "cgroup2" and mount.root == "/":
            return mount.mount_point
    return None


def read_device_programs(
    cgroups: tuple[CgroupEntry, ...], pid: int
) -> tuple[tuple[DeviceProgram, ...] | None, str | None]:
    """The effective v2 device programs of the process's unified cgroup, decoded, or
    why they could not be read. Nothing here is trusted: only the gate judges."""
    entry = next((e for e in cgroups if e.hierarchy_id == 0 and not e.controllers), None)
    mount = _cgroup2_mount(pid) if entry is not None else None
    if entry is None or mount is None:
        return None, None
    parts = [part for part in entry.path.split("/") if part]
    if any(part in (".", "..") for part in parts):
        raise malformed("cgroup", f"v2 path {entry.path!r}")
    directory = os.path.join(mount, *parts)
    try:
        _flags, ids = bpfdevices.query(directory, effective=True)
        programs = []
        for prog_id in ids:
            prog_type, raw = bpfdevices.xlated(prog_id)
            decoded = bpfdevices.decode(raw) if prog_type == bpfdevices.PROG_TYPE else None
            if decoded is None and prog_type == bpfdevices.PROG_TYPE:
                with contextlib.suppress(systemd_devices.NotSystemdShape):
                    decoded = systemd_devices.decode(raw)
            rules = None
            if decoded is not None:
                rules = tuple(DeviceAccess(d.kind, d.major, d.minor, d.access) for d in decoded)
            programs.append(DeviceProgram(id=prog_id, rules=rules))
    except (OSError, HostError) as error:
        return None, f"the device programs of {directory} cannot be read ({error})"
    return tuple(programs), None


def read_syscall_filters(
    pid: int, status: Status
) -> tuple[seccomp.SeccompFilters | None, str | None]:
    """The process's seccomp filters (mode 2 only), or why they could not be read: a
    refusal to read is evidence too, and the gate judges it."""
    if status.seccomp != 2:
        return None, None
    try:
        return seccomp.read_filters(pid), None
    except seccomp.FiltersUnreadable as error:
        return None, str(error)


def read_evidence(pid: int, *, after_first_read: Callable[[], None] | None = None) -> Evidence:
    """Read all evidence about `pid`, refusing if it changed while we read.

    `after_first_read` runs right after the first start-time read; tests use it to
    kill the process at exactly that point.
    """
    pid_fd = open_process_dir(pid)
    try:
        first = read_stat(pid_fd, pid)
        if after_first_read is not None:
            after_first_read()
        cgroups = parse_cgroup(read_bounded(pid_fd, "cgroup", pid))
        status = parse_status(read_bounded(pid_fd, "status", pid))
        filters, filters_error = read_syscall_filters(pid, status)
        programs, programs_error = read_device_programs(cgroups, pid)
        evidence = Evidence(
            pid=pid,
            start_time=first.start_time,
            status=status,
            cgroups=cgroups,
            namespaces=read_namespaces(pid_fd, pid),
            reference_namespaces=reference_namespaces(),
            limits=parse_limits(read_bounded(pid_fd, "limits", pid)),
            fds=read_fds(pid_fd, pid),
            mounts=read_mounts(pid_fd, pid),
            exe=read_exe(pid_fd, pid),
            devices=read_devices(cgroups, pid),
            syscall_filters=filters,
            syscall_filters_error=filters_error,
            device_programs=programs,
            device_programs_error=programs_error,
        )
        last = read_stat(pid_fd, pid)
    finally:
        os.close(pid_fd)
    if last.start_time != first.start_time:
        raise process_changed(pid, "was replaced by another process")
    return evidence
