"""The prepare result a provider returns, and the gate Expectation the host builds from it.

A provider's prepare result (argv, barrier, devices, mounts, generated_targets,
positive_devices, negative_devices) is validated ONCE, strictly, into the provider
SDK's `PrepareResult` (sdk.py, the one definition both sides use)
and persisted before anything uses it (`check_prepare_result` compares it with the
plan and with the real filesystem). From then on the host never trusts the provider
again: the payload gate judges the live process against an `Expectation` built here
from three things the host controls -- the slot account, the persisted prepare result
(identities recorded at prepare) and the service handle (cgroup paths from the
backend) -- never from a later provider reply.

Decisions made here:
- Each prepared device names the plan device (`limits.devices`) it serves, so a
  provider can never add a device the plan did not ask for. The one exception is the
  name `runtime`, for the shared pseudo-devices every container runtime needs
  (`RUNTIME_NODES`: null, zero, full, random, urandom, tty), and only those; a
  provider cannot pass anything else off as `runtime`. Positive devices must be
  prepared devices (the payload must be able to open them); negative devices must not
  be (the closed device policy must refuse them).
- The barrier's identity (device, inode) and each mount source's identity are
  recorded by the provider at prepare and re-checked by the host against the real
  files before they are persisted; the gate then compares `/proc/PID/exe` and each
  mount with these recorded identities.
- The expected device policy is the backend's closed policy for exactly the prepared
  devices (plus its mknod-only baseline), on cgroup v1 and v2 alike: the gate reads
  the live payload's v1 devices.list, or on v2 the effective device programs of its
  cgroup (the service backend also reads its own program back at create).
- Namespaces: mnt, pid, net, ipc, uts always differ from the daemon's; user and cgroup
  namespaces are required by default (rootless runtimes use both) and can be relaxed
  only by the caller, i.e. by host configuration, never by the provider.

Pure functions except `check_prepare_result`, which stats the named files.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Mapping, Sequence
from typing import Final

import msgspec

from ficc.execution import plan as planlib
from ficc.execution.host.core.codes import HostCode
from ficc.execution.host.core.errors import HostError
from ficc.execution.host.gate import checks as gate
from ficc.execution.host.linux import evidence as evidencelib
from ficc.execution.host.service import cgroups
from ficc.execution.host.service.interface import DeviceRule, ServiceHandle, ServiceSpec
from ficc.execution.host.storage.layout import AttemptPaths
from ficc.execution.provider import (
    BarrierSpec,
    GeneratedTarget,
    MountSpec,
    PreparedDevice,
    PrepareResult,
    decode_reply,
)

__all__ = [
    "DEFAULT_NOFILE",
    "RUNTIME_DEVICE",
    "RUNTIME_NODES",
    "SERVICE_ENVIRONMENT",
    "BarrierSpec",
    "GeneratedTarget",
    "MountSpec",
    "PrepareResult",
    "PreparedDevice",
    "build_expectation",
    "check_device_opens",
    "check_prepare_result",
    "decode_prepare_result",
    "device_rules",
    "service_spec",
]

RUNTIME_DEVICE = "runtime"
"""The device name for nodes the runtime itself needs, serving no plan device."""
RUNTIME_NODES = frozenset({(1, 3), (1, 5), (1, 7), (1, 8), (1, 9), (5, 0)})
"""(major, minor) of /dev/null, zero, full, random, urandom and tty: shared, harmless."""

DEFAULT_NOFILE = 1024
"""RLIMIT_NOFILE of every attempt's service (the plan has no field for it)."""

SERVICE_ENVIRONMENT: Final = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8"}
"""The complete environment of the provider argv: nothing is inherited."""


def _invalid(message: str) -> HostError:
    return HostError(
        HostCode.PROVIDER_MALFORMED,
        f"the provider's prepare result is not acceptable: {message}; the attempt cannot"
        " start: fix the provider or its configuration, then admit a new attempt",
    )


def decode_prepare_result(reply: object) -> PrepareResult:
    """The provider's reply as a `PrepareResult`, or `provider_malformed`."""
    try:
        return decode_reply("prepare", reply, PrepareResult)
    except msgspec.ValidationError as error:
        raise _invalid(str(error)) from error


def _normalized(path: str) -> bool:
    return os.path.normpath(path) == path and "//" not in path


def check_prepare_result(result: PrepareResult, plan: planlib.Plan) -> None:
    """Refuse (`provider_malformed`) a result the plan or the real files contradict."""
    if not result.argv[0].startswith("/"):
        raise _invalid(f"argv[0] {result.argv[0]!r} is not an absolute program path")
    _check_barrier(result.barrier)
    paths = _check_devices(result.devices, set(plan.job.limits.devices))
    for path in result.positive_devices:
        if path not in paths:
            raise _invalid(f"positive device {path} is not a prepared device")
    for path in result.negative_devices:
        if path in paths:
            raise _invalid(f"negative device {path} is also a prepared device")
    _check_mounts(result.mounts, result.generated_targets)


def _check_barrier(barrier: BarrierSpec) -> None:
    if not _normalized(barrier.path):
        raise _invalid(f"barrier path {barrier.path!r} is not normalized")
    try:
        st = os.stat(barrier.path, follow_symlinks=False)
    except OSError as error:
        raise _invalid(f"barrier {barrier.path}: {error.strerror}") from error
    if not stat.S_ISREG(st.st_mode) or st.st_uid != 0 or st.st_mode & 0o022:
        raise _invalid(
            f"barrier {barrier.path} must be a regular root-owned file writable only by root"
        )
    if (st.st_dev, st.st_ino) != (barrier.identity.device, barrier.identity.inode):
        raise _invalid(f"barrier {barrier.path} is not the file recorded at prepare")


def _check_devices(devices: list[PreparedDevice], planned: set[str]) -> set[str]:
    seen: set[tuple[int, int]] = set()
    paths: set[str] = set()
    for device in devices:
        if device.name == RUNTIME_DEVICE:
            if (device.major, device.minor) not in RUNTIME_NODES:
                raise _invalid(f"device {device.path} is not a shared pseudo-device")
        elif device.name not in planned:
            raise _invalid(f"device {device.path} serves {device.name!r}, not a plan device")
        try:
            st = os.stat(device.path, follow_symlinks=False)
        except OSError as error:
            raise _invalid(f"device {device.path}: {error.strerror}") from error
        actual = (os.major(st.st_rdev), os.minor(st.st_rdev))
        if not stat.S_ISCHR(st.st_mode) or actual != (device.major, device.minor):
            raise _invalid(
                f"{device.path} is not the character device {device.major}:{device.minor}"
            )
        if actual in seen or device.path in paths:
            raise _invalid(f"device {device.path} is listed twice")
        seen.add(actual)
        paths.add(device.path)
    return paths


def _check_mounts(mounts: list[MountSpec], generated: list[GeneratedTarget]) -> None:
    targets: set[str] = set()
    for mount in mounts:
        if not (_normalized(mount.target) and _normalized(mount.source)):
            raise _invalid(f"mount {mount.source} -> {mount.target} is not normalized")
        if mount.target in targets:
            raise _invalid(f"mount target {mount.target} is listed twice")
        targets.add(mount.target)
        try:
            st = os.stat(mount.source, follow_symlinks=False)
        except OSError as error:
            raise _invalid(f"mount source {mount.source}: {error.strerror}") from error
        if (st.st_dev, st.st_ino) != (mount.identity.device, mount.identity.inode):
            raise _invalid(f"mount source {mount.source} is not the file recorded at prepare")
    for target in generated:
        if not _normalized(target.target) or (target.subtree and target.target == "/"):
            raise _invalid(f"generated target {target.target!r} is not acceptable")


def check_device_opens(result: PrepareResult, opened: Mapping[str, bool] | None) -> None:
    """The runner's device-open results (observe, phase `ready`) must agree with the
    prepared policy: every positive device opened, every negative one refused."""
    if not result.positive_devices and not result.negative_devices:
        return
    seen = opened or {}
    wrong = [p for p in result.positive_devices if seen.get(p) is not True]
    wrong += [p for p in result.negative_devices if seen.get(p) is not False]
    if wrong:
        raise HostError(
            HostCode.GATE_DEVICE,
            f"device-open results contradict the prepared policy for {wrong}; the payload"
            " is not released: check the provider's device configuration",
        )


def device_rules(result: PrepareResult) -> list[DeviceRule]:
    """The service's closed device policy: exactly the prepared nodes."""
    return [DeviceRule(path=d.path, major=d.major, minor=d.minor) for d in result.devices]


def service_spec(
    name: str,
    result: PrepareResult,
    *,
    uid: int,
    gid: int,
    paths: AttemptPaths,
    limits: planlib.Limits,
    nofile: int,
    argv: Sequence[str] | None = None,
) -> ServiceSpec:
    """The attempt's service: the prepared argv (or `argv`) as the slot account in the
    attempt's storage, with the plan's limits, exactly the prepared devices and the
    attempt's log files; `service_spec` when it cannot be built."""
    try:
        return msgspec.convert(
            {
                "name": name,
                "argv": list(result.argv if argv is None else argv),
                "uid": uid,
                "gid": gid,
                "cwd": paths.storage,
                "environment": SERVICE_ENVIRONMENT,
                "limits": {
                    "cpu_millis": limits.cpu_millis,
                    "memory_bytes": limits.memory_bytes,
                    "swap_bytes": limits.swap_bytes,
                    "processes": limits.processes,
                    "nofile": nofile,
                },
                "devices": msgspec.to_builtins(device_rules(result)),
                "stdout": paths.stdout,
                "stderr": paths.stderr,
            },
            ServiceSpec,
        )
    except msgspec.ValidationError as error:
        raise HostError(HostCode.SERVICE_SPEC, f"the service cannot be built: {error}") from error


def _cgroup_requirements(
    handle: ServiceHandle, service_cgroup: str
) -> tuple[gate.CgroupRequirement, ...]:
    """Every hierarchy the backend put the service in: the payload must stay inside."""
    requirements = []
    for key in sorted(handle.cgroups):
        controller = "" if key == cgroups.UNIFIED else key.split(",")[0]
        requirements.append(gate.CgroupRequirement(controller, service_cgroup))
    return tuple(requirements)


def build_expectation(
    *,
    uid: int,
    gid: int,
    result: PrepareResult,
    handle: ServiceHandle,
    service_cgroup: str,
    processes: int,
    log_files: tuple[evidencelib.FileIdentity, ...],
    nofile: int = DEFAULT_NOFILE,
    user_namespace: bool = True,
    cgroup_namespace: bool = True,
) -> gate.Expectation:
    """The gate's Expectation for one attempt's barrier process.

    `service_cgroup` is the service's node path from each hierarchy's root (the parent
    of the backend's supervisor cgroup); `log_files` are the identities of the
    stdout/stderr files the host opened for the service.
    """
    barrier = evidencelib.FileIdentity(
        result.barrier.identity.device, result.barrier.identity.inode
    )
    devices = tuple(
        evidencelib.DeviceAccess(rule.kind, rule.major, rule.minor, rule.access)
        for rule in cgroups.expected_devices(device_rules(result))
    )
    return gate.Expectation(
        uid=uid,
        gid=gid,
        barrier=barrier,
        cgroups=_cgroup_requirements(handle, service_cgroup),
        rlimits=(gate.RlimitCeiling("nofile", nofile), gate.RlimitCeiling("nproc", processes)),
        fds=(
            gate.FdAllowance(0, pipe=False),
            gate.FdAllowance(1, files=log_files),
            gate.FdAllowance(2, files=log_files),
        ),
        mounts=tuple(
            gate.PreparedMount(
                mount.target,
                os.major(mount.identity.device),
                os.minor(mount.identity.device),
                mount.read_only,
                evidencelib.FileIdentity(mount.identity.device, mount.identity.inode),
            )
            for mount in result.mounts
        ),
        generated=tuple(
            gate.GeneratedMount(
                target.target,
                tuple(target.fs_types),
                subtree=target.subtree,
                read_only=target.read_only,
                required_options=tuple(target.required_options),
            )
            for target in result.generated_targets
        ),
        user_namespace=user_namespace,
        cgroup_namespace=cgroup_namespace,
        devices=devices,
    )
