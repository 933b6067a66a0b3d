"""The provider SDK: the typed contract between the host and an executor provider.

The host (ficc-executor-host) and every provider import this module, so a change to
the contract is a type error on both sides (mypy --strict), not a key that silently
goes missing at run time.

The host builds one `Context` per row (a `PrepareContext`, which adds `check`, for
`prepare`) and calls a driver method with an ordered list of 1..`MAX_BATCH` of them.
Contexts are frozen: a provider reads them and never edits the host's copy. Each
method returns one plain dict per context, in the same order. A provider builds that
dict from the reply Structs below (`reply(PrepareResult(...))`) or refuses the row
with `refusal(code, message)`; the host decodes every reply with the same Structs
(`decode_reply`), so a reply the SDK would not build is `provider_malformed`.

What a provider may rely on in a context:
- `plan` is the validated immutable plan, `plan_digest` its digest;
- `slot` is the reserved slot (its account and its reserved filesystem);
- `storage` is the storage binding, verified (device, inode, limits set) in the
  contexts of every method: the host never hands a provider a binding it cannot
  verify (it refuses the start or the release, records an observe's outcome as lost,
  and stops the service without the provider's `stop`). Only a release repeated after
  an earlier one freed the storage directory carries its path alone (`verified`
  false): nothing is left there;
- `inputs` are the host-created capabilities of the plan's streamed inputs (prepare
  and start);
- `prepared` is the persisted prepare result (start and every later method).

A driver may also state, once, the smallest limits its own runtime needs
(`minimum_limits()`, returning `reply(MinimumLimits(...))`): the host reads it when the
provider is configured and refuses a plan below it at admission, before anything is
reserved and before any driver method runs for it. A driver without the method states
nothing, and every plan is admitted as before.

This distribution (ficc-provider-sdk) depends on msgspec and ficc-protocol's plan
types only, so a provider installs and imports the contract without the daemon.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any, Final, Literal, TypeVar

import msgspec

from ficc.execution import plan as planlib

__all__ = [
    "API_VERSION",
    "MAX_BATCH",
    "METHODS",
    "SLOT_FILES_STUCK",
    "BarrierSpec",
    "CollectReply",
    "Context",
    "DeviceOpen",
    "FileIdentity",
    "GeneratedTarget",
    "Identity",
    "InputCapability",
    "Logs",
    "MinimumLimits",
    "MountSpec",
    "Observation",
    "PrepareContext",
    "PrepareResult",
    "PreparedDevice",
    "ProbeReply",
    "Refusal",
    "Refused",
    "ReleaseReply",
    "Reply",
    "Slot",
    "StartReply",
    "StopReply",
    "StorageBinding",
    "Supervisor",
    "decode_minimum_limits",
    "decode_reply",
    "refusal",
    "reply",
]

API_VERSION: Final = 1
"""The value a provider module exports as `API_VERSION`."""
MAX_BATCH: Final = 64
"""The most contexts in one driver call."""
METHODS: Final = ("probe", "prepare", "start", "observe", "stop", "collect", "release")
"""The driver methods, in the order an attempt meets them."""
SLOT_FILES_STUCK: Final = "slot_files_stuck"
"""The refusal of a provider that cannot reset its part of a slot's files (what it
could not remove, named in the message). The host then takes the slot out of the
offer until the administrator, having removed them, asks for a check of the slots
(`ficc-executor check-slots`): every job placed there would fail the same way."""

Reply = dict[str, Any]
"""What a driver method returns per row: plain data, never a Struct."""

_Path = Annotated[str, msgspec.Meta(pattern=r"\A/[^\x00]*\Z", max_length=4096)]
_Arg = Annotated[str, msgspec.Meta(pattern=r"\A[^\x00]*\Z", max_length=65536)]
_Number = planlib.Count
_Id = Annotated[int, msgspec.Meta(ge=0, le=2**32 - 2)]
_DeviceNumber = Annotated[int, msgspec.Meta(ge=0, le=2**20 - 1)]
_Pid = Annotated[int, msgspec.Meta(gt=0, le=2**22)]
_Option = Annotated[str, msgspec.Meta(pattern=r"\A(ro|nosuid|nodev|noexec)\Z")]
_FsType = Annotated[str, msgspec.Meta(pattern=r"\A[a-z0-9_.]{1,32}\Z")]
_Code = Annotated[str, msgspec.Meta(pattern=r"\A[a-z][a-z0-9_.-]{0,79}\Z")]
_Text = Annotated[str, msgspec.Meta(max_length=4096)]


class _Strict(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    pass


# --- the context ---------------------------------------------------------------------


class FileIdentity(_Strict, frozen=True):
    """What must stay equal for a file to be the one recorded: ctime is left out,
    because hard-linking a staged input into a runtime layout changes it."""

    device: _Number
    inode: _Number
    mode: _Number
    bytes: _Number
    mtime_ns: _Number


class Slot(_Strict, frozen=True):
    """The reserved slot of the attempt: its account and its reserved filesystem."""

    id: planlib.Name
    slot_class: planlib.Name
    path: _Path
    uid: _Id
    gid: _Id
    storage_bytes: _Number
    storage_inodes: _Number


class StorageBinding(_Strict, frozen=True):
    """The slot-owned `storage/` directory of the attempt, and the plan's limits on it.

    `device` and `inode` identify the directory as verified on the slot's filesystem.
    All four are None only in a release repeated after an earlier release freed the
    directory: nothing is left there to verify. A binding the host cannot verify is
    never handed to a provider in any call."""

    path: _Path
    device: _Number | None = None
    inode: _Number | None = None
    bytes: _Number | None = None
    inodes: _Number | None = None

    @property
    def verified(self) -> bool:
        """Whether the host checked the binding (device and inode) for this call."""
        return self.device is not None and self.inode is not None


class InputCapability(_Strict, frozen=True):
    """A completed streamed input: a root-owned, read-only file in the host's private
    staging directory on the slot's filesystem, and the identity it had when it
    completed. A provider may hard-link it after checking that identity."""

    id: planlib.Identity
    name: Annotated[str, msgspec.Meta(min_length=1, max_length=128)]
    bytes: _Number
    digest: planlib.Digest
    delivery: Literal["stream"]
    path: _Path
    identity: FileIdentity


class Logs(_Strict, frozen=True):
    """The attempt's log files: the payload's stdout and stderr."""

    stdout: _Path
    stderr: _Path


class Supervisor(_Strict, frozen=True):
    """The host's service backend and the exact service enclosing the attempt."""

    backend: planlib.Name
    """`systemd` or `cgroupfs`."""
    service: Annotated[str, msgspec.Meta(min_length=1, max_length=255)]


class Context(_Strict, frozen=True):
    """One row of a driver call (see the module docstring for what each part means)."""

    attempt_id: planlib.Identity
    plan: planlib.Plan
    plan_digest: planlib.Digest
    slot: Slot
    storage: StorageBinding
    attempt_directory: _Path
    """`S/ficc/<attempt>`: `provider/`, `storage/`, `control/`, `logs/`, `evidence/`."""
    provider_directory: _Path
    """`provider/` (root 0711): the provider's own files; empty again after release."""
    control_directory: _Path
    """`control/` (root 0755): where the host writes the release marker."""
    release_marker: _Path
    """The marker the barrier waits for before it executes the payload."""
    logs: Logs
    service: Annotated[str, msgspec.Meta(min_length=1, max_length=255)]
    """The exact name of the system service the host runs the prepare argv in."""
    cgroup: _Path
    """The service's planned supervisor cgroup (known before the service exists)."""
    supervisor: Supervisor
    inputs: tuple[InputCapability, ...] = ()
    prepared: PrepareResult | None = None


class PrepareContext(Context, frozen=True, kw_only=True):
    """The context of `prepare`: `check` raises `Refused` once the lease or the local
    authority is gone. Call it before preparing and between bounded operations (each
    input, each copy chunk); on a refusal stop, undo what this call made, and refuse
    the row with the exception's code. Never store or serialize it."""

    check: Callable[[], None]


class Refused(Exception):
    """A refusal with a stable code (a lowercase Name) and an operator message: what
    `check()` raises. A provider catches it and refuses the row with
    `refusal(code, message)`; it must not raise it (or anything) to refuse one row,
    because a driver method that raises fails every row of its call."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


# --- replies -------------------------------------------------------------------------


class Refusal(_Strict, frozen=True):
    """A row the provider refuses; the other rows of the call go on."""

    error: _Code
    message: _Text = ""


class ProbeReply(msgspec.Struct, frozen=True):
    """`ok` true: the provider can run this plan. Other fields are the provider's."""

    ok: bool


class Identity(_Strict, frozen=True):
    """(st_dev, st_ino) of a file recorded at prepare."""

    device: _Number
    inode: _Number


class BarrierSpec(_Strict, frozen=True):
    """The trusted barrier executable: its path and the identity recorded at prepare."""

    path: _Path
    identity: Identity


class PreparedDevice(_Strict, frozen=True):
    """An exact character node the payload may open, serving plan device `name`
    (or `runtime`, for the shared pseudo-devices a runtime needs)."""

    name: planlib.Name
    path: _Path
    major: _DeviceNumber
    minor: _DeviceNumber


class MountSpec(_Strict, frozen=True):
    """A bind mount of `source` at `target` with the source's recorded identity."""

    source: _Path
    target: _Path
    read_only: bool
    identity: Identity


class GeneratedTarget(_Strict, frozen=True):
    """A mount the runtime makes itself (/proc, /dev, the root): constrained by type."""

    target: _Path
    fs_types: Annotated[list[_FsType], msgspec.Meta(min_length=1, max_length=16)]
    subtree: bool = False
    read_only: bool | None = None
    required_options: Annotated[list[_Option], msgspec.Meta(max_length=4)] = msgspec.field(
        default_factory=lambda: ["nosuid", "nodev"]
    )


class PrepareResult(_Strict, frozen=True):
    """The reply of `prepare`; the host validates it, checks it against the plan and
    the real files, and persists it before anything uses it."""

    argv: Annotated[list[_Arg], msgspec.Meta(min_length=1, max_length=4096)]
    barrier: BarrierSpec
    devices: Annotated[list[PreparedDevice], msgspec.Meta(max_length=64)]
    mounts: Annotated[list[MountSpec], msgspec.Meta(max_length=256)]
    generated_targets: Annotated[list[GeneratedTarget], msgspec.Meta(max_length=256)]
    positive_devices: Annotated[list[_Path], msgspec.Meta(max_length=64)]
    negative_devices: Annotated[list[_Path], msgspec.Meta(max_length=64)]


class StartReply(msgspec.Struct, frozen=True):
    """The provider's part of start is done (the host itself runs the argv)."""

    started: Literal[True]


class DeviceOpen(_Strict, frozen=True):
    """One device-open result of the runner, produced inside the workload's sandbox."""

    path: _Path
    opened: bool


class Observation(_Strict, frozen=True, omit_defaults=True):
    """The reply of `observe`: `waiting`; `ready` with the runner's device-open
    results; `payload` with the barrier's host PID; `finished` with the exit code."""

    phase: Literal["waiting", "ready", "payload", "finished"]
    pid: _Pid | None = None
    exit_code: Annotated[int, msgspec.Meta(ge=0, le=255)] | None = None
    devices: Annotated[list[DeviceOpen], msgspec.Meta(max_length=128)] | None = None

    def __post_init__(self) -> None:
        if self.phase == "payload" and self.pid is None:
            raise ValueError("phase payload needs the host pid")
        if self.phase == "finished" and self.exit_code is None:
            raise ValueError("phase finished needs the exit code")


class StopReply(msgspec.Struct, frozen=True):
    """The provider stopped what it runs for the attempt (the host's service stop is
    the guarantee); repeated stops are fine."""

    stopped: Literal[True]


class CollectReply(msgspec.Struct, frozen=True):
    """An acknowledgement: the host collects logs and outputs itself."""

    ok: Literal[True]


class ReleaseReply(msgspec.Struct, frozen=True):
    """Nothing of the attempt is left in the provider's care; repeated releases are fine."""

    released: Literal[True]


# --- what the driver states once ------------------------------------------------------


class MinimumLimits(_Strict, frozen=True, kw_only=True, omit_defaults=True):
    """The smallest plan limits with which the provider's own runtime can start a
    payload at all, as the driver's optional `minimum_limits()` states them.

    A provider's supervisor runs inside the attempt's service, under the plan's limits
    (for Podman: Podman, conmon and runc share the plan's memory and processes), so a
    plan below these cannot run even a payload that needs nothing. The host calls
    `minimum_limits()` once, right after `configure()` (never per attempt, so no
    provider code runs before an admission is committed), and refuses a plan below a
    figure at admission: a durable `admission_rejected` record whose cause is
    `limits_below_minimum`, with nothing reserved. A figure left out states nothing.
    State what the runtime was measured to need, with a margin: a plan at exactly
    these figures must run (the conformance kit's `limits.minimum_runs`).
    """

    memory_bytes: planlib.Positive | None = None
    """The plan's `memory_bytes` must be at least this."""
    processes: planlib.Positive | None = None
    """The plan's `processes` must be at least this."""


def decode_minimum_limits(data: object) -> MinimumLimits:
    """A driver's `minimum_limits()` as the host reads it: strict, no coercion; raises
    `msgspec.ValidationError`."""
    return msgspec.convert(data, MinimumLimits, strict=True)


_REPLIES: Final[dict[str, type[msgspec.Struct]]] = {
    "probe": ProbeReply,
    "prepare": PrepareResult,
    "start": StartReply,
    "observe": Observation,
    "stop": StopReply,
    "collect": CollectReply,
    "release": ReleaseReply,
}

_S = TypeVar("_S", bound=msgspec.Struct)


def reply(value: msgspec.Struct) -> Reply:
    """A reply Struct as the plain dict a driver method returns."""
    data = msgspec.to_builtins(value)
    assert isinstance(data, dict)
    return data


def refusal(code: str, message: str) -> Reply:
    """The row `{"error": code, "message": message}` (the code must be a Name)."""
    return reply(msgspec.convert({"error": code, "message": message}, Refusal))


def decode_reply(method: str, data: object, kind: type[_S]) -> _S:
    """One row's reply as `kind`; raises `msgspec.ValidationError` or ValueError.

    `kind` must be the Struct of `method` (`PrepareResult` for prepare, ...), which
    keeps the caller's type and this table in step.
    """
    if _REPLIES.get(method) is not kind:
        raise ValueError(f"{kind.__name__} is not the reply of {method!r}")
    return msgspec.convert(data, kind, strict=True)
