"""What systemd is told and what it answers, as pure text: unit names, the properties of a
job's transient unit and of the lease reaper's, and the parsers of `systemctl show`.

The unit's properties (see `run_properties`): the plan's `CPUQuota`, `MemoryMax`,
`MemorySwapMax` (cgroup v2; on v1 the host writes `memory.memsw.limit_in_bytes`
itself, which systemd does not manage), `TasksMax`, `LimitCORE=0`,
`LimitNOFILE=N:N`, `KillMode=control-group` with `KillSignal=SIGKILL`,
`DevicePolicy=strict` with
`DeviceAllow` for exactly the prepared devices (`closed` would also allow /dev/null,
/dev/zero, /dev/full, /dev/random and /dev/urandom, so it is not "exactly"), the
slot account as `User=`/`Group=`, `Delegate=yes` (the provider's runtime creates
the payload's cgroup below the unit, as with `--cgroup-parent`), `RemainAfterExit`
(the exit status stays readable and leftover processes stay in the tree until the
daemon stops the service, as in the cgroupfs backend) and `BindsTo=`+`After=` the
daemon's own unit: stopping or restarting the daemon stops every attempt, and
nothing restarts them (no `PartOf=`, which would replay the work on a restart).

The lease reaper (service/reaper.py) is a transient unit of its own,
`ficc-lease-reaper-<installation>.service` (`reaper_unit`), created the same way
(`start_reaper`) in the same slice, beside the attempts and outside the daemon's unit:
no `BindsTo=`, `PartOf=` or ordering ties it to the daemon's unit, so stopping,
killing or freezing the daemon leaves it enforcing, and a daemon stop never waits for
it. `Restart=on-failure` has systemd start it again if it dies; it exits 0 by itself
(not restarted) once nothing is left to guard, and `CollectMode=inactive-or-failed`
lets systemd forget the unit then, also after a failure, so the daemon can always
start it again by its name (see `reaper_properties`). The installation ID in its
name keeps two daemons of one host apart, as in the attempts' unit names.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping

from ficc.execution.host.core.codes import HostCode
from ficc.execution.host.core.errors import HostError
from ficc.execution.host.service import cgroups
from ficc.execution.host.service.interface import (
    DeviceRule,
    ServiceSpec,
    check_name,
)

SLICE = "ficc.slice"
SUPERVISOR = "supervisor"
PAYLOAD = "payload"
SYSTEMD_RUN = "/usr/bin/systemd-run"
UNIT_SUFFIX = ".service"
REAPER_PREFIX = "ficc-lease-reaper-"
REAPER_CAPABILITIES = "CAP_KILL CAP_DAC_OVERRIDE CAP_DAC_READ_SEARCH"
"""All the reaper needs: SIGKILL to the slot accounts' processes, and to read and
write cgroup files that a service's delegated subtree gives to its slot account."""


def unit_name(name: str) -> str:
    """The transient unit of service `name` (already `ficc-work-<inst>-<attempt>`)."""
    return check_name(name) + UNIT_SUFFIX


def unit_cgroup(slice_name: str, name: str) -> str:
    """The unit's cgroup path from each hierarchy's root (one level of slice)."""
    return f"/{slice_name}/{unit_name(name)}"


def cpu_quota(cpu_millis: int) -> str:
    """`CPUQuota=` in percent of one CPU, exact to a thousandth (systemd takes 2
    decimals); systemd turns it into the same CFS quota as the cgroupfs backend."""
    whole, tenth = divmod(cpu_millis, 10)
    return f"{whole}.{tenth}%" if tenth else f"{whole}%"


def parse_proc_devices(text: str) -> dict[int, list[str]]:
    """The character-device section of /proc/devices as {major: [driver names]}."""
    majors: dict[int, list[str]] = {}
    section = ""
    for line in text.splitlines():
        if line.endswith(":"):
            section = line[:-1].strip()
            continue
        fields = line.split()
        if section == "Character devices" and len(fields) == 2 and fields[0].isdigit():
            majors.setdefault(int(fields[0]), []).append(fields[1])
    return majors


def device_allow(devices: list[DeviceRule], classes: Mapping[int, list[str]]) -> list[str]:
    """`DeviceAllow=` values giving the same allow list as the cgroupfs backend.

    mknod for every device (`char-* m`, `block-* m`: see DeviceRule), then each node
    by path, and a whole major (minor None) by its driver class `char-<name>`, which
    systemd matches by name in /proc/devices: the name must belong to that one major
    alone, or the rule would allow more than the prepared class.
    """
    values = ["char-* m", "block-* m"]
    for device in devices:
        if device.minor is not None:
            values.append(f"{device.path} rwm")
            continue
        names = classes.get(device.major, [])
        if len(names) != 1 or any(
            names[0] in others for major, others in classes.items() if major != device.major
        ):
            raise HostError(
                HostCode.SERVICE_DEVICES,
                f"device class {device.major}:* has no unique driver name in /proc/devices "
                f"({names}); systemd can only allow a whole major by its name",
            )
        values.append(f"char-{names[0]} rwm")
    return values


def run_properties(
    spec: ServiceSpec,
    *,
    slice_name: str,
    bind_to: str | None,
    cgroup_version: int,
    classes: Mapping[int, list[str]],
    stdin_file: str,
) -> list[str]:
    """Every `-p NAME=VALUE` the unit is created with (see the module docstring).

    `stdin_file` is an empty regular file the shim starts with (see `_listen`)."""
    limits = spec.limits
    properties = [
        f"Description=ficc attempt service {spec.name}",
        "Type=exec",
        "RemainAfterExit=yes",
        f"Slice={slice_name}",
        "Delegate=yes",
        "KillMode=control-group",
        # Stopping an attempt is always a kill, as in the cgroupfs backend: also when
        # systemd stops the unit with the daemon's (BindsTo=), where SIGTERM would leave
        # a container's PID 1 (which ignores it) running for the 90 s stop timeout.
        "KillSignal=SIGKILL",
        "SendSIGHUP=no",
        f"User={spec.uid}",
        f"Group={spec.gid}",
        f"WorkingDirectory={spec.cwd}",
        f"UMask={spec.umask:04o}",
        # Not `null`: systemd would open /dev/null inside the unit, where the closed
        # device policy may forbid it. The shim gets the host's stdio fds instead.
        f"StandardInput=file:{stdin_file}",
        "StandardOutput=inherit",
        "StandardError=inherit",
        "CPUAccounting=yes",
        "MemoryAccounting=yes",
        "TasksAccounting=yes",
        f"CPUQuota={cpu_quota(limits.cpu_millis)}",
        f"MemoryMax={cgroups.page_floor(limits.memory_bytes)}",
        f"TasksMax={limits.processes}",
        "LimitCORE=0",
        f"LimitNOFILE={limits.nofile}:{limits.nofile}",
        "DevicePolicy=strict",
        *(f"DeviceAllow={value}" for value in device_allow(spec.devices, classes)),
    ]
    if cgroup_version == 2:
        properties.append(f"MemorySwapMax={cgroups.page_floor(limits.swap_bytes)}")
    if bind_to is not None:
        properties += [f"BindsTo={bind_to}", f"After={bind_to}"]
    return properties


def reaper_unit(installation_id: str) -> str:
    """The lease reaper's unit of installation `installation_id`: one per daemon
    (its deadline directory is in the installation's state_dir)."""
    return check_unit(unit_name(REAPER_PREFIX + installation_id))


def reaper_properties(directory: str, *, slice_name: str) -> list[str]:
    """Every `-p NAME=VALUE` of the lease reaper's unit (see the module docstring).

    Deliberately absent: `BindsTo=`, `PartOf=`, `Requisite=` and any ordering on
    the daemon's unit (the reaper must outlive a stopped daemon, and a daemon stop
    must not wait for it). The unit does not inherit the daemon's sandbox, so it gets
    one of its own: no new privileges, only the capabilities a kill needs, and the
    daemon's umask and OOM score adjustment (which the daemon's child had)."""
    return [
        f"Description=ficc lease reaper of {directory}",
        "Type=exec",
        f"Slice={slice_name}",
        "Restart=on-failure",
        "RestartSec=100ms",
        "CollectMode=inactive-or-failed",
        "KillMode=control-group",
        "StandardOutput=null",
        "StandardError=journal",
        "UMask=0077",
        "OOMScoreAdjust=-500",
        "NoNewPrivileges=yes",
        f"CapabilityBoundingSet={REAPER_CAPABILITIES}",
    ]


def reaper_run_argv(unit: str, command: list[str], *, directory: str, slice_name: str) -> list[str]:
    """The `systemd-run` call that creates and starts the reaper's unit running
    `command` (reaper.command: interpreter, flags, script, directory), whose paths
    must be absolute (systemd runs it from `/`) and free of `$` and `%`, which systemd
    may expand in a unit's command line (see the shim's)."""
    paths = [part for part in command if not part.startswith("-")]
    if not command or not all(os.path.isabs(path) for path in paths):
        raise HostError(
            HostCode.SERVICE_SPEC, f"the lease reaper's command {command!r} needs absolute paths"
        )
    if any("$" in part or "%" in part for part in command):
        raise HostError(
            HostCode.SERVICE_SPEC,
            f"the lease reaper's command {command!r} holds '$' or '%', which systemd would "
            "expand; give state_dir (and the daemon's Python) a path without them",
        )
    argv = [SYSTEMD_RUN, "--quiet", f"--unit={check_unit(unit)}"]
    argv += [f"--property={p}" for p in reaper_properties(directory, slice_name=slice_name)]
    return [*argv, "--", *command]


def parse_show(text: str) -> dict[str, str]:
    """`systemctl show -p A -p B` output as {A: value}; a repeated key keeps the last."""
    values = {}
    for line in text.splitlines():
        key, sep, value = line.partition("=")
        if sep:
            values[key] = value
    return values


_CLD_EXITED, _CLD_KILLED, _CLD_DUMPED = "1", "2", "3"


def exit_status_of(show: Mapping[str, str]) -> int | None:
    """The main process's status from `ExecMainCode`/`ExecMainStatus` (negative for
    a signal), or None while it runs or when systemd does not know the unit."""
    if show.get("LoadState") != "loaded":
        return None
    code, value = show.get("ExecMainCode", "0"), show.get("ExecMainStatus", "0")
    if code == _CLD_EXITED:
        return int(value)
    if code in {_CLD_KILLED, _CLD_DUMPED}:
        return -int(value)
    return None


def own_unit(proc_cgroup: str) -> str | None:
    """The service unit this process runs in, from /proc/self/cgroup text.

    The name=systemd line on a v1 host, the v2 line otherwise; None when the process
    is not in a `.service` (a test shell, a scope): then nothing can be bound.
    """
    paths = cgroups.parse_proc_cgroup(proc_cgroup)
    path = paths.get(frozenset({"name=systemd"}), paths.get(frozenset(), ""))
    for part in reversed(path.split("/")):
        if part.endswith(UNIT_SUFFIX):
            return part
    return None


_SPAN = re.compile(r"^(\d+)(?:\.(\d{1,6}))?(us|ms|s)$")
_SPAN_UNITS = {"us": 1, "ms": 1000, "s": 1_000_000}


def parse_usec(text: str) -> int | None:
    """A time span as `systemctl show` prints it (`255ms`, `1s`, `1.500000s`) in
    microseconds; None for `infinity` (no quota) or anything else."""
    match = _SPAN.fullmatch(text.strip())
    if match is None:
        return None
    whole, fraction, unit = match.groups()
    scale = _SPAN_UNITS[unit]
    digits = (fraction or "").ljust(6, "0")
    return int(whole) * scale + int(digits) * scale // 1_000_000


_UNIT = re.compile(r"^[A-Za-z0-9:_.\\@-]{1,250}\.service$")


def check_unit(unit: str) -> str:
    if not _UNIT.fullmatch(unit):
        raise HostError(HostCode.SERVICE_SPEC, f"{unit!r} is not a service unit name")
    return unit
