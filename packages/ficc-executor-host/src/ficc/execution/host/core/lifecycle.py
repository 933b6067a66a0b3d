"""The attempt lifecycle: a pure state machine over one attempt's status.

No I/O here. The ledger reads a record, calls `apply(status, event)` and writes the
returned status in the same transaction, so every rule about which state may follow
which lives in this one module and is tested without a database.

The graph is the table `TRANSITIONS` below: for each event, the states it may be
applied in and what follows. A few rules need more than the state (is the attempt
ready? was a start ever requested? is the lease current?); those are the guards in
`_refusal`. Anything not in the table is refused with `invalid_state`.

Decisions the protocol leaves to the host, made here:

- `outcome` is set whenever the attempt settles (reaches a terminal state or
  `unknown`) and never changes afterwards, so `release` keeps it, as the protocol requires.
- A daemon restart (`DaemonRestarted`) turns `starting` and `running` into `unknown`:
  the payload may have been released and its outcome cannot be confirmed, so it is
  never resumed or replayed. A `prepared` attempt never ran its payload, so nothing
  about its execution is uncertain, but provider code may have been interrupted:
  - provider preparation in flight (`preparing`) -> `failed`, reason
    `executor_restarted`: replaying provider preparation is exactly the replay the
    protocol forbids, and "did not run" is certain, so it is a failure, not `unknown`.
    Cleanup is unconfirmed: the normal cleanup and release path follows.
  - staging inputs, or prepared and `ready` -> unchanged. Staged bytes are durable up
    to their committed offsets, a ready attempt's prepared result is persisted, and
    the payload gate re-checks everything before any start. This is what lets a
    controller resume a transfer or start after the daemon restarted.
- A stop or lease expiry of a `starting`/`running` attempt is recorded as
  `stop_pending`; the state changes only when the monitor confirms the stop
  (`Stopped`), or the payload's own exit is observed first (`Finished`, which wins).
- An observed exit ends `failed` with reason `storage_exhausted` when the payload ran
  its slot full, else `memory_exhausted` when it exited nonzero after the kernel's
  out-of-memory killer killed a process of its service (`Finished.oom_killed`, from
  the service's own counters), else `exited` (failed unless the exit code is 0). A
  payload that exited 0 although one of its processes was OOM-killed succeeded: its
  usage still counts the kill.
- Start authority is checked twice: when the start is requested, and again just
  before the release marker is written (`StartCancelled`: `starting` -> `cancelled`
  with the reason, the payload never released).
- A start of an attempt that already had a start requested is an idempotent reply
  (no change, `changed` false), whatever happened since: a lost start reply must
  never start twice.
- A start the host refuses before accepting it, because a staged input is no longer
  the file recorded when it completed (`StartRefused`, reason `input_changed`), fails
  the ready attempt at once: its payload never runs, no start is on record, and its
  cleanup and release follow as for any failed attempt. A later start of it is
  refused with that same code (`NEVER_STARTED`), as a start of an attempt rejected
  at admission is, so a controller that retries a lost reply hears the same answer.
"""

from __future__ import annotations

from typing import Annotated, Final, Literal, NamedTuple, get_args

import msgspec

from ficc.execution.errors import ErrorCode
from ficc.execution.host.core.errors import HostError
from ficc.execution.wire import State

STATES: Final[tuple[State, ...]] = get_args(State)
TERMINAL: Final = frozenset({"succeeded", "failed", "cancelled", "expired"})
SETTLED: Final = TERMINAL | {"unknown"}
"""States a release may follow (after confirmed cleanup)."""
ACTIVE: Final = frozenset({"prepared", "starting", "running"})
"""States that hold a live lease; renewals are accepted only here."""

STOP_REASONS: Final = {"cancelled": "stopped", "expired": "lease_expired"}
"""The documented reason (ficc.execution.wire.REASONS) of each way a stop ends work."""
ADMISSION_REJECTED: Final = "admission_rejected"
LEGACY_ABSENCE_ACKNOWLEDGED: Final = "legacy_absence_acknowledged"
EXECUTOR_RESTARTED: Final = "executor_restarted"
STORAGE_EXHAUSTED: Final = "storage_exhausted"
MEMORY_EXHAUSTED: Final = "memory_exhausted"
INPUT_CHANGED: Final = "input_changed"
NEVER_STARTED: Final = {
    ADMISSION_REJECTED: ErrorCode.ADMISSION_REJECTED,
    INPUT_CHANGED: ErrorCode.INPUT_CHANGED,
}
"""Reasons of attempts that settled without a start ever accepted, and the code a
start of such an attempt is refused with (any other settled one: `invalid_state`)."""

_Reason = Annotated[str, msgspec.Meta(pattern=r"\A[a-z][a-z0-9_.-]{0,79}\Z")]
_ExitCode = Annotated[int, msgspec.Meta(ge=0, le=255)]


class Status(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Everything the lifecycle decides about one attempt (a slice of its record)."""

    state: State
    ready: bool = False
    preparing: bool = False
    """Provider preparation has been called and has not reported back."""
    start_requested: bool = False
    stop_pending: Literal["cancelled", "expired"] | None = None
    outcome: State | None = None
    reason: _Reason | None = None
    exit_code: _ExitCode | None = None
    cleanup_confirmed: bool = False
    quarantined: bool = False
    """Cleanup was tried and failed: the reservation stays until it succeeds."""
    storage_exhausted: bool = False
    """The slot's filesystem ran out of bytes or inodes while the payload ran."""
    log_cut_short: bool = False
    """The slot ran out of bytes while the logs were open: a log may end early."""


# --- events -------------------------------------------------------------------------


class Event(msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag=True):
    """Something that happened to an attempt. The tag is the table's row name."""

    @property
    def name(self) -> str:
        return str(type(self).__struct_config__.tag)


class PrepareBegun(Event, frozen=True, tag="prepare_begun"):
    """Every input is complete and provider preparation has been called."""


class PrepareOk(Event, frozen=True, tag="prepare_ok"):
    """Provider preparation succeeded; the ledger persists its result beside the status."""

    result: bytes


class PrepareFailed(Event, frozen=True, tag="prepare_failed"):
    """Preparation or staging failed (provider error, disk, digest): never startable."""

    reason: _Reason


class StartRequested(Event, frozen=True, tag="start"):
    """A `start` row. The facts are computed by the caller at the moment of the request."""

    lease_current: bool
    offer_open: bool
    """The offer's control still allows starts (active or draining)."""
    offer_fits: bool
    """The current offer still covers the attempt: project and runtime allowed, its
    limits within what the offer leaves after started attempts (the ledger decides)."""


class Started(Event, frozen=True, tag="started"):
    """The payload gate released the payload."""


class StartFailed(Event, frozen=True, tag="start_failed"):
    """Start failed before the payload was released (for example the gate refused)."""

    reason: _Reason


class StartRefused(Event, frozen=True, tag="start_refused"):
    """A start row refused before it was accepted: something the start depends on no
    longer holds (a staged input changed after it completed). The ready attempt fails
    with the reason; its payload never runs, and no start is on record."""

    reason: _Reason


class StartCancelled(Event, frozen=True, tag="start_cancelled"):
    """Start authority was lost between the start request and the release marker (the
    offer was paused, stopped or drained, or no longer covers the attempt): the payload
    was never released."""

    reason: _Reason


class Finished(Event, frozen=True, tag="finished"):
    """The payload's exit was observed. `oom_killed`: the kernel's out-of-memory killer
    killed a process of the attempt's service (its counters say so)."""

    exit_code: _ExitCode
    oom_killed: bool = False


class StorageExhausted(Event, frozen=True, tag="storage_exhausted"):
    """The slot's filesystem was found full while the payload ran (bytes or inodes)."""

    log_cut_short: bool


class StopRequested(Event, frozen=True, tag="stop"):
    """A `stop` row."""


class LeaseExpired(Event, frozen=True, tag="lease_expired"):
    """The monitor (or an operation) found the lease past its deadline."""


class Stopped(Event, frozen=True, tag="stopped"):
    """The monitor confirmed that a pending stop killed the workload."""


class OutcomeLost(Event, frozen=True, tag="outcome_lost"):
    """The outcome of a possibly released payload cannot be read."""

    reason: _Reason


class CleanupConfirmed(Event, frozen=True, tag="cleanup_confirmed"):
    """Service, workload tree and attempt storage are confirmed gone."""


class CleanupFailed(Event, frozen=True, tag="cleanup_failed"):
    """Cleanup could not be confirmed: quarantine, keep the reservation, retry later."""


class DaemonRestarted(Event, frozen=True, tag="daemon_restarted"):
    """Applied to every record when the daemon starts (see the module docstring)."""


class Release(Event, frozen=True, tag="release"):
    """A `release` row."""


AnyEvent = (
    PrepareBegun
    | PrepareOk
    | PrepareFailed
    | StartRequested
    | Started
    | StartFailed
    | StartRefused
    | StartCancelled
    | Finished
    | StorageExhausted
    | StopRequested
    | LeaseExpired
    | Stopped
    | OutcomeLost
    | CleanupConfirmed
    | CleanupFailed
    | DaemonRestarted
    | Release
)


# --- the table ----------------------------------------------------------------------


class Refuse(NamedTuple):
    code: str


SAME: Final = "="
"""The state stays. Flags may still change (stop_pending, cleanup_confirmed, ...); when
nothing changes at all the reply is idempotent (`Step.changed` is false)."""

_P, _S, _R, _U, _X = "prepared", "starting", "running", "unknown", "released"
_SETTLED_SAME = dict.fromkeys(sorted(SETTLED), SAME)
_NOT_TERMINAL = Refuse(ErrorCode.NOT_TERMINAL)

TRANSITIONS: Final[dict[str, dict[str, str | Refuse]]] = {
    # event   {from state: next state}; SAME: state stays; a state not listed: invalid_state
    # _P prepared, _S starting, _R running, _U unknown, _X released
    "prepare_begun":     {_P: SAME},                       # preparing true
    "prepare_ok":        {_P: SAME},                       # ready true
    "prepare_failed":    {_P: "failed"},
    "start":             {_P: _S, _S: SAME, _R: SAME, **_SETTLED_SAME, _X: SAME},
    "started":           {_S: _R},
    "start_failed":      {_S: "failed"},
    "start_refused":     {_P: "failed"},                   # ready only
    "start_cancelled":   {_S: "cancelled"},
    "finished":          {_R: "succeeded"},   # failed: exit_code != 0, full slot, OOM kill
    "storage_exhausted": {_S: SAME, _R: SAME},              # flags only
    "stop":              {_P: "cancelled", _S: SAME, _R: SAME,  # _S, _R: stop_pending
                          **_SETTLED_SAME, _X: SAME},
    "lease_expired":     {_P: "expired", _S: SAME, _R: SAME,    # _S, _R: stop_pending
                          **_SETTLED_SAME, _X: SAME},
    "stopped":           {_S: "cancelled", _R: "cancelled"},  # or expired: stop_pending
    "outcome_lost":      {_S: _U, _R: _U},
    "cleanup_confirmed": dict.fromkeys(sorted(SETTLED), SAME),
    "cleanup_failed":    dict.fromkeys(sorted(SETTLED), SAME),
    "daemon_restarted":  {_P: SAME, _S: _U, _R: _U,              # _P preparing: failed
                          **_SETTLED_SAME, _X: SAME},
    "release":           {_P: _NOT_TERMINAL, _S: _NOT_TERMINAL, _R: _NOT_TERMINAL,
                          **dict.fromkeys(sorted(SETTLED), _X), _X: SAME},
}  # fmt: skip


# --- initial statuses ---------------------------------------------------------------


def admitted() -> Status:
    """A freshly admitted attempt: slot and first lease reserved, nothing prepared."""
    return Status(state="prepared")


def admission_rejected() -> Status:
    """A refusal before any provider call: failed, no resources, nothing to clean."""
    return Status(
        state="failed", outcome="failed", reason=ADMISSION_REJECTED, cleanup_confirmed=True
    )


def absence_acknowledged() -> Status:
    """`reconcile_absent` for a missing record: unknown, with confirmed cleanup."""
    return Status(
        state="unknown",
        outcome="unknown",
        reason=LEGACY_ABSENCE_ACKNOWLEDGED,
        cleanup_confirmed=True,
    )


# --- applying an event --------------------------------------------------------------


class Step(NamedTuple):
    status: Status
    changed: bool
    """False for an idempotent reply: the caller must not act (for example, not start)."""


def apply(status: Status, event: AnyEvent) -> Step:
    """The status after `event`, or HostError with a stable code if it is refused."""
    row = TRANSITIONS[event.name]
    target = row.get(status.state, Refuse(ErrorCode.INVALID_STATE))
    refusal = target if isinstance(target, Refuse) else _refusal(status, event)
    if refusal is not None:
        raise HostError(refusal.code, _explain(refusal.code, status, event))
    assert not isinstance(target, Refuse)
    after = _effect(status, event, status.state if target == SAME else target)
    return Step(after, after != status)


def _refusal(status: Status, event: AnyEvent) -> Refuse | None:
    """The guards: rules that need more than the current state."""
    match event:
        case PrepareBegun() if status.ready or status.preparing:
            return Refuse(ErrorCode.INVALID_STATE)
        case PrepareOk() if status.ready or not status.preparing:
            return Refuse(ErrorCode.INVALID_STATE)
        case StartRequested() if status.state == "prepared":
            if status.preparing:
                return Refuse(ErrorCode.RUNTIME_PREPARING)
            if not status.ready:
                return Refuse(ErrorCode.NOT_READY)
            if not event.lease_current:
                return Refuse(ErrorCode.LEASE_EXPIRED)
            if not event.offer_open:
                return Refuse(ErrorCode.OFFER_CLOSED)
            if not event.offer_fits:
                return Refuse(ErrorCode.OFFER_CHANGED)
        case StartRequested() if not status.start_requested:
            return Refuse(NEVER_STARTED.get(status.reason or "", ErrorCode.INVALID_STATE))
        case StartRefused() if not status.ready:
            return Refuse(ErrorCode.NOT_READY)
        case Stopped() if status.stop_pending is None:
            return Refuse(ErrorCode.INVALID_STATE)
        case CleanupFailed() if status.cleanup_confirmed:
            return Refuse(ErrorCode.INVALID_STATE)
        case Release() if status.state != "released" and not status.cleanup_confirmed:
            return Refuse(ErrorCode.CLEANUP_UNCONFIRMED)
    return None


def _effect(status: Status, event: AnyEvent, target: str) -> Status:
    """The new status once the event is allowed; `target` is the table's next state."""
    s = status
    match event:
        case PrepareBegun():
            return _with(s, preparing=True)
        case PrepareOk():
            return _with(s, preparing=False, ready=True)
        case PrepareFailed(reason=reason):
            return _settle(_with(s, preparing=False), "failed", reason)
        case StartRequested() if target == "starting":
            return _with(s, state="starting", start_requested=True)
        case Started():
            return _with(s, state="running")
        case StartFailed(reason=reason) | StartRefused(reason=reason):
            return _settle(s, "failed", reason)
        case StartCancelled(reason=reason):
            return _with(_settle(s, "cancelled", reason), stop_pending=None)
        case Finished(exit_code=code) if s.storage_exhausted:
            done = _settle(s, "failed", STORAGE_EXHAUSTED)
            return _with(done, exit_code=code, stop_pending=None)
        case Finished(exit_code=code, oom_killed=True) if code != 0:
            done = _settle(s, "failed", MEMORY_EXHAUSTED)
            return _with(done, exit_code=code, stop_pending=None)
        case Finished(exit_code=code):
            done = _settle(s, "succeeded" if code == 0 else "failed", "exited")
            return _with(done, exit_code=code, stop_pending=None)
        case StorageExhausted(log_cut_short=cut):
            return _with(s, storage_exhausted=True, log_cut_short=s.log_cut_short or cut)
        case StopRequested() | LeaseExpired() if s.state in ACTIVE:
            cause = "cancelled" if isinstance(event, StopRequested) else "expired"
            if s.state == "prepared":
                return _settle(_with(s, preparing=False), cause, STOP_REASONS[cause])
            return _with(s, stop_pending=s.stop_pending or cause)
        case Stopped():
            cause = s.stop_pending or "cancelled"
            return _with(_settle(s, cause, STOP_REASONS[cause]), stop_pending=None)
        case OutcomeLost(reason=reason):
            return _settle(s, "unknown", reason)
        case CleanupConfirmed():
            return _with(s, cleanup_confirmed=True, quarantined=False)
        case CleanupFailed():
            return _with(s, quarantined=True)
        case DaemonRestarted() if s.state == "prepared" and s.preparing:
            return _settle(_with(s, preparing=False), "failed", EXECUTOR_RESTARTED)
        case DaemonRestarted() if s.state in ("starting", "running"):
            return _settle(s, "unknown", EXECUTOR_RESTARTED)
        case Release() if s.state != "released":
            return _with(s, state="released")
    return s


def _settle(status: Status, state: str, reason: str) -> Status:
    """Reach a terminal state or unknown: the outcome is fixed, cleanup still to do."""
    return _with(status, state=state, outcome=state, reason=reason, cleanup_confirmed=False)


def _with(status: Status, **changes: object) -> Status:
    return msgspec.structs.replace(status, **changes)


_HINTS: Final[dict[str, str]] = {
    ErrorCode.NOT_READY: "inputs or preparation are incomplete; poll readiness, then start",
    ErrorCode.RUNTIME_PREPARING: "provider preparation is running; poll readiness, then start",
    ErrorCode.LEASE_EXPIRED: "the lease is not current; a new attempt is needed",
    ErrorCode.OFFER_CLOSED: "the local owner's offer does not allow this now",
    ErrorCode.OFFER_CHANGED: "the current offer no longer covers this attempt; release it",
    ErrorCode.ADMISSION_REJECTED: "this attempt was rejected at admission and can never run",
    ErrorCode.INPUT_CHANGED: (
        "a staged input changed after it was staged, so the attempt failed and its payload"
        " never ran: release the attempt and retry the job as a new attempt"
    ),
    ErrorCode.NOT_TERMINAL: "stop the attempt and wait for a terminal state first",
    ErrorCode.CLEANUP_UNCONFIRMED: "cleanup is not confirmed yet; retry release later",
    ErrorCode.INVALID_STATE: "observe the attempt and act on its current state",
}


def _explain(code: str, status: Status, event: AnyEvent) -> str:
    hint = _HINTS.get(code, "observe the attempt and act on its current state")
    return f"{event.name} refused in state {status.state}: {hint}"


__all__ = [
    "ACTIVE",
    "ADMISSION_REJECTED",
    "EXECUTOR_RESTARTED",
    "INPUT_CHANGED",
    "LEGACY_ABSENCE_ACKNOWLEDGED",
    "MEMORY_EXHAUSTED",
    "NEVER_STARTED",
    "SAME",
    "SETTLED",
    "STATES",
    "STOP_REASONS",
    "TERMINAL",
    "TRANSITIONS",
    "AnyEvent",
    "CleanupConfirmed",
    "CleanupFailed",
    "DaemonRestarted",
    "Event",
    "Finished",
    "LeaseExpired",
    "OutcomeLost",
    "PrepareBegun",
    "PrepareFailed",
    "PrepareOk",
    "Refuse",
    "Release",
    "StartCancelled",
    "StartFailed",
    "StartRefused",
    "StartRequested",
    "Started",
    "State",
    "Status",
    "Step",
    "StopRequested",
    "Stopped",
    "StorageExhausted",
    "absence_acknowledged",
    "admission_rejected",
    "admitted",
]
