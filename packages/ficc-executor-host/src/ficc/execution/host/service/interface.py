"""The system service that encloses one attempt, independent of backend.

The host, never the provider, creates this service: the provider only supplies the
argv (its supervisor, e.g. Podman), and the host wraps it in a cgroup tree with the
plan's limits, a closed device policy and kill-the-whole-tree on stop. Two backends
implement `SystemService`: `cgroupfs` (this package, for hosts without systemd as
PID 1) and `systemd`. The daemon only talks to this interface, so
both must pass the same behaviour tests.

Every method is synchronous and may block briefly (cgroup file I/O, polling with a
deadline); the daemon calls them from worker threads, never on the event loop.

Refusal codes (HostError.code), stable across backends:
  service_spec                   the spec itself is unusable (name, argv, root account)
  service_unsupported            the host lacks the cgroup hierarchies or the shim interpreter
  service_devices                a device rule does not match the node at its path
  service_devices_unenforceable  the backend cannot enforce a closed device policy here
  service_swap_unenforceable     swap is active but the kernel cannot account it
  service_output                 an output path is a link, FIFO, shared or foreign file
  service_payload                the payload could not be moved into its own cgroup
  service_exists                 a service of that name already exists (adopt it)
  service_limits                 the kernel refused a limit or reports another value
  service_create                 creating the cgroups or entering the cwd failed
  service_start                  the program could not be confined, released or executed
  service_handle                 a handle names cgroups this backend does not own
  service_stop_unconfirmed       the tree was not empty by the deadline (quarantine, retry)
  service_not_empty              remove was asked while processes remain
"""

from __future__ import annotations

import re
from typing import Annotated, Literal, Protocol

import msgspec

from ficc.execution.host.core.codes import HostCode
from ficc.execution.host.core.errors import HostError

#: Service names become cgroup directory names (and systemd unit names), so they are
#: restricted to a portable, path-free alphabet.
NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,199}$"
_NAME = re.compile(NAME_PATTERN)

ServiceName = Annotated[str, msgspec.Meta(pattern=NAME_PATTERN)]
AbsolutePath = Annotated[str, msgspec.Meta(pattern=r"^/[^\x00]*$", max_length=4096)]
HostId = Annotated[int, msgspec.Meta(ge=0, le=2**32 - 2)]
DeviceNumber = Annotated[int, msgspec.Meta(ge=0, le=2**20 - 1)]
EnvName = Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z_][A-Za-z0-9_]{0,255}$")]
EnvValue = Annotated[str, msgspec.Meta(pattern=r"^[^\x00]*$", max_length=65536)]
Argument = Annotated[str, msgspec.Meta(pattern=r"^[^\x00]*$", max_length=65536)]


def check_name(name: str) -> str:
    """Refuse a service name that could not be a single cgroup directory name."""
    if not _NAME.fullmatch(name):
        raise HostError(
            HostCode.SERVICE_SPEC,
            f"service name {name!r} is not allowed; use letters, digits, '.', '_' and '-' "
            "(at most 200 characters, not starting with a punctuation mark)",
        )
    return name


def check_account(spec: ServiceSpec, *, root_supervisor: bool) -> None:
    """Refuse a service that would run as root, unless a root supervisor is configured:
    the provider's argv runs as the slot account, never with the daemon's authority."""
    if 0 in (spec.uid, spec.gid) and not root_supervisor:
        raise HostError(
            HostCode.SERVICE_SPEC,
            f"service {spec.name} would run as UID/GID 0; run it as the slot account, "
            "or configure a root supervisor explicitly",
        )


class ServiceLimits(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The plan's resource limits as the service enforces them.

    The core-dump limit is not a field: it is always 0 (`LimitCORE=0`), so no field can
    accidentally enable dumps of someone else's memory.
    """

    cpu_millis: Annotated[int, msgspec.Meta(ge=10, le=2**31)]
    memory_bytes: Annotated[int, msgspec.Meta(ge=1 << 20, le=2**62)]
    swap_bytes: Annotated[int, msgspec.Meta(ge=0, le=2**62)]
    processes: Annotated[int, msgspec.Meta(ge=1, le=4_194_304)]
    nofile: Annotated[int, msgspec.Meta(ge=16, le=1 << 20)]


class DeviceRule(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One character device the service may open (read, write, mknod).

    The path is checked against the numbers when the service is created, so a rule
    never allows a different device than the one the provider prepared. `minor` None
    allows every minor of `major` and then `path` must be the directory holding that
    class (e.g. `/dev/pts` for 136): runc writes `c 136:* rwm` for every container,
    and a v1 device cgroup can never allow more than its parent.

    Everything not listed is denied for reading and writing. Creating nodes (`m`) is
    allowed for every device, because it grants no access (open is checked against
    `r`/`w`) and needs CAP_MKNOD anyway, while container runtimes write `c *:* m`.
    """

    path: AbsolutePath
    major: DeviceNumber
    minor: DeviceNumber | None


class ServiceSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Everything the host decides about one attempt's enclosing service.

    `uid`/`gid` are normally the slot account. A backend refuses 0 unless it was
    built to allow a root supervisor (a rootful runtime such as Podman with a UID
    map, whose payload the gate then checks for the slot account's IDs).

    `environment` is the complete environment of the started program: nothing is
    inherited from the daemon. `stdout` and `stderr` are files the host opens itself
    (created root-owned 0600, never through a symlink) and hands over as descriptors.
    """

    name: ServiceName
    argv: Annotated[list[Argument], msgspec.Meta(min_length=1, max_length=4096)]
    uid: HostId
    gid: HostId
    cwd: AbsolutePath
    environment: dict[EnvName, EnvValue]
    limits: ServiceLimits
    devices: Annotated[list[DeviceRule], msgspec.Meta(max_length=64)]
    stdout: AbsolutePath
    stderr: AbsolutePath
    umask: Annotated[int, msgspec.Meta(ge=0, le=0o777)] = 0o077

    def __post_init__(self) -> None:
        if not self.argv[0].startswith("/"):
            raise HostError(
                HostCode.SERVICE_SPEC,
                f"argv[0] {self.argv[0]!r} must be an absolute program path; the service "
                "never searches PATH",
            )
        if len({(d.major, d.minor) for d in self.devices}) != len(self.devices):
            raise HostError(HostCode.SERVICE_SPEC, "a device is listed twice; list each node once")


class DeviceAccess(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One line of an allow list as the kernel reports it (`c 1:3 rwm`).

    `major`/`minor` are None for a wildcard (`*`); `kind` `a` means all devices.
    """

    kind: Literal["a", "b", "c"]
    major: int | None
    minor: int | None
    access: str


class Controls(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Controls read back from the kernel, never from what the host meant to write.

    A None limit means "unlimited". `devices` is None when the backend cannot read a
    device policy at all (then the gate must refuse). `swap_bytes` is None when the
    kernel has no swap accounting and the host has no active swap (so no swap can be
    used at all).
    """

    backend: str
    cgroup_version: Literal[1, 2]
    memory_bytes: int | None
    swap_bytes: int | None
    processes: int | None
    cpu_millis: int | None
    devices: list[DeviceAccess] | None
    cgroups: dict[str, str]


class CgroupUsage(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """What a service used so far, from its cgroups' counters (`accounting`); None:
    this host could not read it. The `payload_` figures are its payload's own node's
    (`place_payload`), the others the whole service's, the payload's included."""

    cpu_user_us: int | None = None
    cpu_system_us: int | None = None
    memory_peak_bytes: int | None = None
    oom_kills: int | None = None
    processes_peak: int | None = None
    payload_cpu_user_us: int | None = None
    payload_cpu_system_us: int | None = None
    payload_memory_peak_bytes: int | None = None


class ServiceHandle(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What the daemon keeps about a running service (it may also persist it).

    `cgroups` maps each hierarchy (`memory`, `pids`, ..., `unified`) to the absolute
    directory of the attempt's node. `main_pid` and `main_start_ticks` (field 22 of
    /proc/PID/stat, to detect PID reuse) are None for an adopted service whose main
    process is unknown after a daemon restart.
    """

    name: ServiceName
    backend: str
    cgroup_version: Literal[1, 2]
    cgroups: dict[str, str]
    main_pid: int | None
    main_start_ticks: int | None


class SystemService(Protocol):
    """The enclosing service of attempts; implemented by `cgroupfs` and `systemd`."""

    backend: str
    """The backend's name (`cgroupfs`, `systemd`), told to providers in their context."""

    def create(self, spec: ServiceSpec) -> ServiceHandle:
        """Create the service, enforce and verify its controls, start argv inside it.

        Raises HostError (`service_limits`, `service_devices`, `service_exists`,
        `service_start`, ...) and leaves nothing behind when it refuses.
        """
        ...

    def controls(self, handle: ServiceHandle) -> Controls:
        """Read the enforced limits and device policy back from the kernel."""
        ...

    def members(self, handle: ServiceHandle) -> set[int]:
        """Every PID in the attempt's cgroup tree, in every hierarchy used."""
        ...

    def occupied(self, handle: ServiceHandle) -> bool:
        """Whether `members` would name any PID. One read of the unified node's
        `populated` when that says yes; `members` itself otherwise, so an answer of
        "empty" is always the full walk's."""
        ...

    def usage(self, handle: ServiceHandle) -> CgroupUsage:
        """What the tree used so far, from the kernel's counters of its cgroups
        (`accounting`); a figure this host cannot read is None. Readable while the
        service runs and after it stopped, until `remove`."""
        ...

    def place_payload(self, handle: ServiceHandle, pid: int) -> None:
        """Move the service's process `pid` (the gated barrier, before its release) into
        the service's own payload node in every hierarchy (`service/payload.py`), so
        `usage` can tell its figures from its runtime's. Raises HostError
        (`service_payload`) when it cannot; the payload's figures are then absent."""
        ...

    def exit_status(self, handle: ServiceHandle) -> int | None:
        """The main process's exit status (negative: killed by that signal), or None
        while it runs or when it is unknown (adopted after a restart)."""
        ...

    def stop(self, handle: ServiceHandle) -> None:
        """Kill the whole tree and return only once it is confirmed empty.

        Raises HostError(`service_stop_unconfirmed`) when the tree is not empty by the
        deadline; the caller keeps the attempt in quarantine and retries later.
        """
        ...

    def is_idle(self, handle: ServiceHandle, uid: int) -> bool:
        """True only if the tree is empty and no process on the host runs as `uid`."""
        ...

    def remove(self, handle: ServiceHandle) -> None:
        """Delete the service's cgroups; refuses (`service_not_empty`) while occupied."""
        ...

    def adopt(self, name: str) -> ServiceHandle | None:
        """Find an existing service by name (after a daemon restart), or None."""
        ...

    def supervisor_cgroup(self, handle: ServiceHandle) -> str:
        """The cgroup path (from each hierarchy's root) a provider passes to its
        runtime, e.g. Podman's `--cgroup-parent`, so the payload stays in the tree."""
        ...

    # Added for the runner (runner/pipeline.py): the provider's prepare context carries the
    # cgroup before the service exists, and cleanup of an attempt that never had a
    # service still has to confirm that the slot account runs nothing.

    def planned_supervisor_cgroup(self, name: str) -> str:
        """What `supervisor_cgroup` will return for service `name`, before it exists."""
        ...

    def account_idle(self, uid: int) -> bool:
        """True only if no live process on the host runs as `uid` (any of its UIDs)."""
        ...

    def kill_account(self, uid: int, timeout: float | None = None) -> bool:
        """SIGKILL every live process that runs as `uid`, outside any service too, and
        return once none is left (`service_stop_unconfirmed` after `timeout`, by
        default the backend's stop timeout), with what `account_idle` would then say.
        For a slot account whose attempt has settled: what a provider command left
        running (a rootless Podman pause process, a command orphaned when the daemon
        died)."""
        ...

    def planned_cgroups(self, name: str) -> list[str]:
        """Every cgroup directory service `name` has or will have (existing or not):
        what the lease reaper kills at the deadline, known before the service exists."""
        ...

    def place_reaper(self, pid: int) -> list[str]:
        """Move the lease reaper (`pid`, just started by the daemon as its child) out of
        the daemon's cgroup, so freezing or stopping the daemon's cgroup leaves it
        enforcing; returns the cgroups it now runs in (empty: it stays where it
        started). cgroupfs: its own cgroup beside the attempts'; systemd: not used
        (the reaper is a unit of its own, `reaper_unit`)."""
        ...

    def reaper_unit(self, installation_id: str) -> str | None:
        """The unit the lease reaper of installation `installation_id` runs as, or
        None when the daemon starts it as its child and moves it (`place_reaper`).
        systemd: `ficc-lease-reaper-<installation>.service`; cgroupfs: None."""
        ...

    def start_reaper(self, unit: str, command: list[str], directory: str) -> bool:
        """Start `command` (the reaper of `directory`) as `unit`, outside the daemon's
        unit and not bound to it, restarted by the service manager if it fails: True
        once the reaper has been executed, False while a unit of that name is still
        there. Only for a backend whose `reaper_unit` is not None."""
        ...


def device_key(device: DeviceAccess) -> tuple[str, int, int, str]:
    """A device rule as a sortable key (a wildcard number as -1)."""
    return (
        device.kind,
        -1 if device.major is None else device.major,
        -1 if device.minor is None else device.minor,
        device.access,
    )
