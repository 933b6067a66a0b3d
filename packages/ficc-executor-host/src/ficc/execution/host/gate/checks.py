"""The payload gate: judge the live barrier process before its payload is released.

A provider's description of its sandbox ("no capabilities, private namespaces, ...")
is a claim, not evidence. While the payload is still the trusted barrier (waiting for
the host's release marker), the daemon reads the live process (procfs.py) and checks
it here against an `Expectation` the daemon builds from its configuration, the
persisted prepare result and the service handle. Nothing from the provider's replies
is evidence; only /proc of the live process is.

`check` is pure: Evidence + Expectation -> Verdict, every failure with a stable code.
`inspect_and_check` is the I/O shell: read evidence, WRITE it to the attempt directory
(before any assertion, so a refusal can always be audited), check, then confirm the
process is still the one that was read.

Contract for the daemon: on a failed verdict it must stop the attempt's service (kill
the whole tree), record the failure codes, and never call `write_release_marker`.
Only a passing verdict from `inspect_and_check` for the PID reported by `observe`
permits `write_release_marker`. The rules each check applies are listed in
docs/security.md ("Payload gate rules").
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Annotated

import msgspec

from ficc.execution.host.core.codes import HostCode
from ficc.execution.host.core.errors import HostError
from ficc.execution.host.gate import reader as gate_reader
from ficc.execution.host.linux import evidence as evidencelib
from ficc.execution.host.linux import fsutil, procfs, seccomp
from ficc.execution.host.linux.evidence import DeviceAccess, Evidence, FileIdentity, Mount

SlotId = Annotated[int, msgspec.Meta(gt=0, le=0xFFFF_FFFE)]
"""A slot account's host UID or GID: never root, never the invalid id."""

BASE_NAMESPACES = ("mnt", "pid", "net", "ipc", "uts")
DEV_NULL = os.makedev(1, 3)
MOUNT_FLAGS = frozenset({"ro", "nosuid", "nodev", "noexec"})


def _components(path: str) -> tuple[str, ...] | None:
    """Components of a normalized absolute path, or None if it is not one."""
    if not path.startswith("/") or "\0" in path:
        return None
    parts = tuple(part for part in path.split("/") if part)
    if any(part in (".", "..") for part in parts) or "//" in path:
        return None
    if path != "/" and path.endswith("/"):
        return None
    return parts


def _within(path: str, prefix: str) -> bool:
    """True when `path` is `prefix` or below it, compared by whole components."""
    inner, outer = _components(path), _components(prefix)
    return inner is not None and outer is not None and inner[: len(outer)] == outer


def _require_path(path: str, what: str) -> None:
    if _components(path) is None:
        raise ValueError(f"{what} {path!r} is not a normalized absolute path")


class CgroupRequirement(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The payload's cgroup in one hierarchy must be `path` or below it.

    `controller` names the hierarchy: "" for the cgroup v2 line (hierarchy 0), or a
    v1 controller ("memory", "pids", "name=systemd") that must appear on the line.
    """

    controller: str
    path: str

    def __post_init__(self) -> None:
        _require_path(self.path, "cgroup path")


class RlimitCeiling(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Both soft and hard limit must be finite and at most `maximum`.

    Only the hard limit bounds the payload (it may raise soft up to hard), so a
    lower limit than planned is acceptable; unlimited never is.
    """

    name: str
    maximum: Annotated[int, msgspec.Meta(ge=0)]

    def __post_init__(self) -> None:
        if self.name not in evidencelib.RLIMIT_LABELS.values():
            raise ValueError(f"unknown rlimit {self.name!r}")


class FdAllowance(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Descriptor `fd` may be open, pointing at one of the allowed kinds of target."""

    fd: Annotated[int, msgspec.Meta(ge=0, le=1023)]
    dev_null: bool = True
    """The character device 1:3."""
    pipe: bool = True
    """An anonymous pipe (pipefs); a named FIFO on disk is never allowed."""
    files: tuple[FileIdentity, ...] = ()
    """Regular files by (device, inode): the attempt's log files the host created."""


class PreparedMount(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A mount from the persisted prepare result, as it must appear to the payload."""

    target: str
    major: Annotated[int, msgspec.Meta(ge=0)]
    minor: Annotated[int, msgspec.Meta(ge=0)]
    read_only: bool
    identity: FileIdentity | None = None
    """(st_dev, st_ino) of the source recorded at prepare: the mount point must match."""
    root: str | None = None
    """The mountinfo root field (path inside the source filesystem), when recorded."""
    required_options: tuple[str, ...] = ("nosuid", "nodev")

    def __post_init__(self) -> None:
        _require_path(self.target, "mount target")
        if not set(self.required_options) <= MOUNT_FLAGS:
            raise ValueError(f"required_options must be within {sorted(MOUNT_FLAGS)}")


class GeneratedMount(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A mount the runtime creates itself (/proc, /dev, /sys, /etc/hosts, the root).

    Its identity cannot be known at prepare time, so it is constrained by target,
    filesystem type and flags instead. `subtree` also admits mounts below `target`
    (masked /proc entries, /dev/pts); it is invalid for "/".
    """

    target: str
    fs_types: tuple[str, ...]
    subtree: bool = False
    read_only: bool | None = None
    required_options: tuple[str, ...] = ("nosuid", "nodev")

    def __post_init__(self) -> None:
        _require_path(self.target, "generated target")
        if self.subtree and self.target == "/":
            raise ValueError("a generated subtree of / would admit every mount")
        if not self.fs_types:
            raise ValueError("a generated target needs at least one filesystem type")
        if not set(self.required_options) <= MOUNT_FLAGS:
            raise ValueError(f"required_options must be within {sorted(MOUNT_FLAGS)}")


class Expectation(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What the live barrier process must look like; built by the daemon."""

    uid: SlotId
    gid: SlotId
    barrier: FileIdentity
    """Device and inode of the barrier executable recorded at prepare."""
    cgroups: Annotated[tuple[CgroupRequirement, ...], msgspec.Meta(min_length=1)]
    rlimits: tuple[RlimitCeiling, ...]
    fds: tuple[FdAllowance, ...]
    mounts: tuple[PreparedMount, ...]
    generated: tuple[GeneratedMount, ...]
    groups: tuple[SlotId, ...] = ()
    """Supplementary groups allowed besides `gid` (usually none)."""
    user_namespace: bool = False
    """The runtime maps users: the user namespace must differ from the daemon's too."""
    cgroup_namespace: bool = False
    devices: tuple[DeviceAccess, ...] | None = None
    """The closed device policy may grant only these: the v1 devices.list of the
    process, or on cgroup v2 its effective device programs. None skips the check."""

    def __post_init__(self) -> None:
        if any(rule.type == "a" for rule in self.devices or ()):
            raise ValueError("a device rule of type 'a' would allow every device")
        fds = [allowance.fd for allowance in self.fds]
        if len(fds) != len(set(fds)):
            raise ValueError("an fd appears twice in fds")


class Failure(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    code: str
    message: str


class Verdict(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    ok: bool
    failures: tuple[Failure, ...]
    evidence_file: str | None = None
    """Name of the evidence JSON in the attempt directory, once written."""


# ---------------------------------------------------------------- the checks

Check = Callable[[Evidence, Expectation], list[Failure]]
ADVICE = "the payload is not released; the daemon stops the attempt's service"


def _fail(code: str, message: str) -> Failure:
    return Failure(code, f"{message}; {ADVICE}")


def check_ids(evidence: Evidence, expectation: Expectation) -> list[Failure]:
    status = evidence.status
    failures = []
    uids = msgspec.structs.astuple(status.uid)
    gids = msgspec.structs.astuple(status.gid)
    if any(uid != expectation.uid for uid in uids):
        failures.append(
            _fail(
                HostCode.GATE_UID,
                f"UIDs (real, effective, saved, fs) are {uids}, expected all {expectation.uid}",
            )
        )
    extra_groups = set(status.groups) - {expectation.gid, *expectation.groups}
    if any(gid != expectation.gid for gid in gids) or extra_groups:
        failures.append(
            _fail(
                HostCode.GATE_GID,
                f"GIDs are {gids} with groups {list(status.groups)}, "
                f"expected all {expectation.gid} and no other group",
            )
        )
    return failures


def check_privileges(evidence: Evidence, expectation: Expectation) -> list[Failure]:
    status = evidence.status
    failures = []
    sets = msgspec.structs.asdict(status.capabilities)
    held = {name: f"{mask:#x}" for name, mask in sets.items() if mask}
    if held:
        failures.append(_fail(HostCode.GATE_CAPABILITIES, f"capability sets are not empty: {held}"))
    if status.no_new_privs != 1:
        failures.append(_fail(HostCode.GATE_NO_NEW_PRIVS, f"NoNewPrivs is {status.no_new_privs}"))
    if status.seccomp != 2 or status.seccomp_filters == 0:
        failures.append(
            _fail(
                HostCode.GATE_SECCOMP,
                f"seccomp mode is {status.seccomp} with "
                f"{status.seccomp_filters} filters, expected mode 2 (filter)",
            )
        )
    return failures


def check_syscall_filter(evidence: Evidence, expectation: Expectation) -> list[Failure]:
    """The filter is judged by its content: it must deny every call of
    `seccomp.MUST_DENY` (an allow-all filter satisfies `Seccomp: 2` alone)."""
    if evidence.status.seccomp != 2:
        return []  # check_privileges reports the mode
    filters = evidence.syscall_filters
    if filters is None:
        detail = evidence.syscall_filters_error or "no filter was read"
        return [_fail(HostCode.GATE_SECCOMP, f"the system-call filter cannot be judged: {detail}")]
    try:
        allowed = seccomp.allowed_calls(filters)
    except seccomp.BadProgram as error:
        return [_fail(HostCode.GATE_SECCOMP, f"the system-call filter cannot be judged: {error}")]
    if not allowed:
        return []
    shown = ", ".join(allowed[:8]) + (f" and {len(allowed) - 8} more" if len(allowed) > 8 else "")
    return [
        _fail(
            HostCode.GATE_SECCOMP,
            f"the system-call filter allows {shown}, which every payload filter must deny",
        )
    ]


def _hierarchy(controller: str, entry: evidencelib.CgroupEntry) -> bool:
    if controller == "":
        return entry.hierarchy_id == 0 and entry.controllers == ()
    return entry.hierarchy_id != 0 and controller in entry.controllers


def check_cgroups(evidence: Evidence, expectation: Expectation) -> list[Failure]:
    failures = []
    for requirement in expectation.cgroups:
        entries = [e for e in evidence.cgroups if _hierarchy(requirement.controller, e)]
        name = requirement.controller or "v2"
        if not entries:
            failures.append(_fail(HostCode.GATE_CGROUP, f"the process has no {name} cgroup"))
        failures.extend(
            _fail(
                HostCode.GATE_CGROUP,
                f"{name} cgroup is {entry.path}, not inside "
                f"the attempt's service {requirement.path}",
            )
            for entry in entries
            if not _within(entry.path, requirement.path)
        )
    return failures


def check_namespaces(evidence: Evidence, expectation: Expectation) -> list[Failure]:
    kinds = list(BASE_NAMESPACES)
    if expectation.user_namespace:
        kinds.append("user")
    if expectation.cgroup_namespace:
        kinds.append("cgroup")
    failures = []
    for kind in kinds:
        own = evidence.namespaces.get(kind)
        reference = evidence.reference_namespaces.get(kind, ())
        if own is None or not reference:
            failures.append(_fail(HostCode.GATE_NAMESPACE, f"no {kind} namespace to compare"))
        elif own in reference:
            failures.append(
                _fail(HostCode.GATE_NAMESPACE, f"{kind} namespace {own} is the daemon's own")
            )
    return failures


def check_rlimits(evidence: Evidence, expectation: Expectation) -> list[Failure]:
    limits = {limit.name: limit for limit in evidence.limits}
    # Core dumps are refused on every host, whatever the expectation lists.
    ceilings = [RlimitCeiling("core", 0), *expectation.rlimits]
    failures = []
    for ceiling in ceilings:
        limit = limits.get(ceiling.name)
        if limit is None:
            failures.append(_fail(HostCode.GATE_RLIMIT, f"limit {ceiling.name} is not reported"))
            continue
        values = (limit.soft, limit.hard)
        if any(value is None or value > ceiling.maximum for value in values):
            failures.append(
                _fail(
                    HostCode.GATE_RLIMIT,
                    f"limit {ceiling.name} is soft {limit.soft} hard "
                    f"{limit.hard} (None = unlimited), expected at most {ceiling.maximum}",
                )
            )
    return failures


def _fd_allowed(entry: evidencelib.FdEntry, allowance: FdAllowance) -> bool:
    if entry.kind == "chr":
        return allowance.dev_null and entry.rdev == DEV_NULL
    if entry.kind == "fifo":
        return allowance.pipe and entry.target.startswith("pipe:[")
    if entry.kind == "file" and entry.dev is not None and entry.ino is not None:
        return FileIdentity(entry.dev, entry.ino) in allowance.files
    return False


def check_fds(evidence: Evidence, expectation: Expectation) -> list[Failure]:
    allowances = {allowance.fd: allowance for allowance in expectation.fds}
    failures = []
    for entry in evidence.fds:
        allowance = allowances.get(entry.fd)
        if allowance is None or not _fd_allowed(entry, allowance):
            failures.append(
                _fail(
                    HostCode.GATE_FD,
                    f"descriptor {entry.fd} ({entry.kind} {entry.target!r}) "
                    "is not an allowed descriptor",
                )
            )
    return failures


def _read_only(mount: Mount) -> bool:
    return "ro" in mount.mount_options or "ro" in mount.super_options


def _missing_options(mount: Mount, required: tuple[str, ...]) -> list[str]:
    return [
        option
        for option in required
        if not (option == "ro" and _read_only(mount)) and option not in mount.mount_options
    ]


def _prepared_mismatch(mount: Mount, prepared: PreparedMount) -> str | None:
    if (mount.major, mount.minor) != (prepared.major, prepared.minor):
        return f"device {mount.major}:{mount.minor}, prepared {prepared.major}:{prepared.minor}"
    if prepared.identity is not None and mount.identity != prepared.identity:
        return f"identity {mount.identity}, prepared {prepared.identity}"
    if prepared.root is not None and mount.root != prepared.root:
        return f"root {mount.root!r}, prepared {prepared.root!r}"
    if _read_only(mount) != prepared.read_only:
        return f"read-only {_read_only(mount)}, prepared {prepared.read_only}"
    missing = _missing_options(mount, prepared.required_options)
    return f"missing options {missing}" if missing else None


def _generated_match(mount: Mount, generated: GeneratedMount) -> bool:
    at_target = mount.mount_point == generated.target or (
        generated.subtree and _within(mount.mount_point, generated.target)
    )
    return (
        at_target
        and mount.fs_type in generated.fs_types
        and not _missing_options(mount, generated.required_options)
        and (generated.read_only is None or _read_only(mount) == generated.read_only)
    )


def check_mounts(evidence: Evidence, expectation: Expectation) -> list[Failure]:
    prepared = {mount.target: mount for mount in expectation.mounts}
    failures = []
    for mount in evidence.mounts:
        where = f"mount {mount.mount_point!r} ({mount.fs_type} {mount.source!r})"
        expected = prepared.get(mount.mount_point)
        if expected is not None:
            # A prepared target can only be satisfied by the prepared mount itself,
            # never by a generated rule that happens to cover the same path.
            mismatch = _prepared_mismatch(mount, expected)
            if mismatch is not None:
                failures.append(_fail(HostCode.GATE_MOUNT, f"{where} does not match: {mismatch}"))
        elif not any(_generated_match(mount, rule) for rule in expectation.generated):
            failures.append(
                _fail(
                    HostCode.GATE_MOUNT,
                    f"{where} with options {list(mount.mount_options)} "
                    "is neither a prepared mount nor an allowed generated target",
                )
            )
    present = {mount.mount_point for mount in evidence.mounts}
    failures.extend(
        _fail(HostCode.GATE_MOUNT, f"prepared mount {target!r} is missing")
        for target in prepared
        if target not in present
    )
    return failures


def check_exe(evidence: Evidence, expectation: Expectation) -> list[Failure]:
    if evidence.exe.identity == expectation.barrier:
        return []
    return [
        _fail(
            HostCode.GATE_EXE,
            f"the executable {evidence.exe.target!r} is "
            f"{evidence.exe.identity}, not the barrier {expectation.barrier}",
        )
    ]


def _covers(rule: DeviceAccess, granted: DeviceAccess) -> bool:
    return (
        rule.type == granted.type
        and (rule.major is None or rule.major == granted.major)
        and (rule.minor is None or rule.minor == granted.minor)
        and set(granted.access) <= set(rule.access)
    )


def _beyond(granted: tuple[DeviceAccess, ...], allowed: tuple[DeviceAccess, ...]) -> list[str]:
    """Each grant no rule of `allowed` covers, as text."""
    return [
        f"{g.type} {'*' if g.major is None else g.major}:"
        f"{'*' if g.minor is None else g.minor} {g.access}"
        for g in granted
        if not any(_covers(rule, g) for rule in allowed)
    ]


def check_devices(evidence: Evidence, expectation: Expectation) -> list[Failure]:
    """The live payload's device policy must stay within the prepared devices.

    cgroup v1: the process's devices.list. cgroup v2 (no v1 devices cgroup): the
    kernel allows an access only if every effective program allows it, so one
    program the host can read whose rules are within the plan bounds the policy;
    none (no program, only foreign ones, or one that grants more) is a refusal.
    """
    if expectation.devices is None:
        return []
    allowed = expectation.devices
    if evidence.devices is not None:
        return [
            _fail(
                HostCode.GATE_DEVICE,
                f"the device policy grants {grant}, which the prepared devices do not include",
            )
            for grant in _beyond(evidence.devices, allowed)
        ]
    programs = evidence.device_programs
    if not programs:
        detail = evidence.device_programs_error or "and no cgroup v2 device program runs for it"
        return [_fail(HostCode.GATE_DEVICE, f"the process has no v1 devices cgroup {detail}")]
    readable = [p for p in programs if p.rules is not None]
    if any(not _beyond(p.rules, allowed) for p in readable if p.rules is not None):
        return []
    if not readable:
        return [
            _fail(
                HostCode.GATE_DEVICE,
                f"none of the {len(programs)} cgroup v2 device programs of the process is "
                "one the host can read, so its device policy is unknown",
            )
        ]
    wider = sorted(
        {grant for p in readable if p.rules is not None for grant in _beyond(p.rules, allowed)}
    )
    return [
        _fail(
            HostCode.GATE_DEVICE,
            f"the cgroup v2 device policy grants {', '.join(wider[:8])}, which the prepared "
            "devices do not include",
        )
    ]


CHECKS: tuple[Check, ...] = (
    check_ids,
    check_privileges,
    check_syscall_filter,
    check_cgroups,
    check_namespaces,
    check_rlimits,
    check_fds,
    check_mounts,
    check_exe,
    check_devices,
)


def check(evidence: Evidence, expectation: Expectation) -> Verdict:
    """Pure: every check runs, so one refusal reports every problem at once."""
    failures = tuple(failure for one in CHECKS for failure in one(evidence, expectation))
    return Verdict(ok=not failures, failures=failures)


# ---------------------------------------------------------------- the I/O shell

EVIDENCE_FILE = "gate-evidence.json"
RELEASE_CONTENT = b"ficc-release-v1\n"


def _single_name(name: str) -> None:
    if not name or name in (".", "..") or "/" in name or "\0" in name:
        raise HostError(HostCode.GATE_EVIDENCE, f"{name!r} is not a plain file name")


def publish_file(
    dir_fd: int, name: str, data: bytes, *, mode: int, gid: int, durable: bool = True
) -> None:
    """Create `name` in `dir_fd` complete, never replacing or following anything;
    `durable`: also synced (the file, then the directory) before returning.

    The file is written as an unnamed O_TMPFILE (owner, mode and bytes final) and only
    then linked under `name`. A reader polling for it (the barrier waiting for its
    release marker) therefore never sees a half-written file or a transient owner or
    mode, and never a link count above one. linkat(2) refuses an existing name, a
    planted symlink included, and never follows it: the same guarantee as
    O_CREAT|O_EXCL|O_NOFOLLOW.
    """
    _single_name(name)
    fd = os.open(".", os.O_TMPFILE | os.O_WRONLY | os.O_CLOEXEC, 0o600, dir_fd=dir_fd)
    try:
        os.fchown(fd, 0, gid)
        os.fchmod(fd, mode)
        fsutil.write_all(fd, data)
        if durable:
            os.fsync(fd)
        # /proc/self/fd/N is the kernel's documented way to name an O_TMPFILE file.
        os.link(f"/proc/self/fd/{fd}", name, dst_dir_fd=dir_fd, follow_symlinks=True)
    finally:
        os.close(fd)
    if durable:
        os.fsync(dir_fd)


def write_evidence(dir_fd: int, name: str, evidence: Evidence) -> None:
    """Root-only evidence file: it holds host paths the slot has no need to see."""
    publish_file(dir_fd, name, msgspec.json.encode(evidence) + b"\n", mode=0o600, gid=0)


def write_release_marker(dir_fd: int, name: str, *, group: int) -> None:
    """The host's release marker: root-owned, readable by the slot group (0640).

    Call only after a passing verdict. The barrier waits for this file and then
    executes the payload; it must never be writable by the slot account. Not synced:
    the barrier sees the file once it is linked, and it has nothing to say after a
    crash of the machine (the container is gone; the attempt is never started again).
    Two syncs of the slot filesystem would only delay the payload.
    """
    try:
        publish_file(dir_fd, name, RELEASE_CONTENT, mode=0o640, gid=group, durable=False)
    except OSError as exc:
        raise HostError(
            HostCode.RELEASE_MARKER_FAILED,
            f"cannot create the release marker {name!r} ({exc.strerror}); the payload "
            "stays blocked: stop the attempt and check the attempt directory",
        ) from exc


def inspect_and_check(
    pid: int,
    expectation: Expectation,
    evidence_dir: int,
    *,
    evidence_name: str = EVIDENCE_FILE,
    after_first_read: Callable[[], None] | None = None,
    after_check: Callable[[], None] | None = None,
) -> Verdict:
    """Inspect the live process `pid` (from observe) and judge it; never raises.

    `evidence_dir` is the attempt directory as a directory fd. The hooks exist so
    tests can kill the process at exact points, without sleeping.
    """
    try:
        evidence = gate_reader.read_evidence(pid, after_first_read=after_first_read)
    except HostError as exc:
        return Verdict(ok=False, failures=(Failure(exc.code, exc.message),))
    try:
        write_evidence(evidence_dir, evidence_name, evidence)
    except (OSError, HostError) as exc:
        reason = exc.message if isinstance(exc, HostError) else exc.strerror
        return Verdict(
            ok=False,
            failures=(
                _fail(HostCode.GATE_EVIDENCE, f"cannot write evidence {evidence_name!r}: {reason}"),
            ),
        )
    verdict = check(evidence, expectation)
    if after_check is not None:
        after_check()
    try:
        procfs.confirm_unchanged(pid, evidence.start_time)
    except HostError as exc:
        verdict = Verdict(ok=False, failures=(*verdict.failures, Failure(exc.code, exc.message)))
    return msgspec.structs.replace(verdict, evidence_file=evidence_name)
