"""The steps of one job through the daemon, as a pure state machine.

prepare (with the first lease) -> stream each input -> wait until ready -> start ->
wait for the end and confirmed cleanup -> collect the logs and outputs (1 MiB reads at
the offsets the host returns) -> release. Interrupted, the machine stops the job and
goes on from "wait for the end" (or, `detach`, leaves it running); a second interrupt
detaches. So every path ends in a release, or in a `Result` saying the attempt is
still reserved, for the command to print what finishes it.

The machine sends nothing and never sleeps: `action(now)` says what to do next (`Send`
a request, `Upload` an input, `Wait`, or `Finish`), the shell (`job_shell`) does it and
reports back (`answer`, `uploaded`, `upload_failed`, `lost`, `interrupt`). The lease
belongs to the machine too: `renewal(now)` is the next renewal once it is due, which
the shell sends from a task of its own, so neither a long upload nor a long job
outlives its lease. Every request it makes is safe to send again (a repeated prepare,
start, stop, release or observe changes nothing, and each renewal has a new sequence),
which is what lets the shell resend after a transport failure and `--resume` pick up
an attempt in whatever state it is.
"""

from __future__ import annotations

import enum
import secrets
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from ficc.execution import plan as planlib
from ficc.execution.protocol import (
    CollectRequest,
    Fence,
    ObserveRequest,
    PrepareAttempt,
    PrepareRequest,
    Read,
    ReleaseRequest,
    Renewal,
    RenewRequest,
    Request,
    StartRequest,
    StopRequest,
)
from ficc.execution.wire import (
    TERMINAL,
    AnyReply,
    AttemptRow,
    AttemptsReply,
    ErrorReply,
    ErrorRow,
    ReadRow,
    ReadsReply,
)

POLL_S = 0.25
"""Seconds between two observations while the machine waits for the host."""
READ_BYTES = 1 << 20
"""One collect read: the protocol's most per request."""
RETRY_RENEW_S = 5.0
"""After a renewal got no reply: try again this soon (at most a tenth of the lease)."""


class Phase(enum.StrEnum):
    """Where the job is; the value is what the progress line shows."""

    OBSERVE = "resuming"
    PREPARE = "admitting"
    UPLOAD = "uploading"
    READY = "preparing"
    START = "starting"
    RUN = "running"
    STOP = "stopping"
    SETTLE = "finishing"
    COLLECT = "collecting"
    RELEASE = "releasing"
    DONE = "done"


class Ending(enum.StrEnum):
    """How a run ended (the command's exit status follows from it)."""

    ENDED = "ended"
    """The job ran to its own end; released."""
    FAILED = "failed"
    """The job could not run or was stopped for a failure; released."""
    REFUSED = "refused"
    """The host refused the prepare; nothing is reserved."""
    INTERRUPTED = "interrupted"
    """Stopped on an interrupt and released (or nothing was reserved yet)."""
    DETACHED = "detached"
    """Left as it is on an interrupt; the attempt stays reserved for `--resume`."""
    UNFINISHED = "unfinished"
    """The daemon stopped answering, or refused the release: still reserved."""


RESERVED = frozenset({Ending.DETACHED, Ending.UNFINISHED})
"""Endings that leave the attempt reserved: the command prints how to finish it."""


@dataclass(frozen=True)
class Result:
    """The end of a run: how, the host's last row of the attempt, and why in words."""

    ending: Ending
    row: AttemptRow | None
    message: str = ""


class Now(NamedTuple):
    """The two clocks: monotonic seconds for waiting, wall milliseconds for leases."""

    mono: float
    wall_ms: int


@dataclass(frozen=True)
class Send:
    """Send `request` and report the reply with `answer(step, ...)`."""

    step: str
    request: Request


@dataclass(frozen=True)
class Upload:
    """Stream this input's file; report `uploaded` or `upload_failed`."""

    item: planlib.InputObject


@dataclass(frozen=True)
class Wait:
    """Nothing to do for this long (an interrupt may cut it short)."""

    seconds: float


@dataclass(frozen=True)
class Finish:
    """The run is over."""

    result: Result


Action = Send | Upload | Wait | Finish


@dataclass(frozen=True)
class Chunk:
    """Collected bytes of `name` at `offset`; `restart`: the object was replaced, so
    what was stored of it is void (its file starts again from 0)."""

    name: str
    offset: int
    data: bytes
    restart: bool = False


_WAITS = {
    Phase.READY: ("prepare", "ready"),
    Phase.RUN: ("run", "the end"),
    Phase.SETTLE: ("cleanup", "confirmed cleanup"),
}
"""What each waiting phase waits for, in the words of a timeout's message."""


def new_request_id() -> str:
    """A fresh request ID (32 hex characters)."""
    return secrets.token_hex(16)


@dataclass
class Lease:
    """The lease's schedule: renewed every third of its length, each time with the next
    sequence, so a lost reply is never repeated with a changed deadline."""

    seconds: int
    sequence: int = 1
    due_at: float = 0.0
    active: bool = False

    def start(self, now: Now, sequence: int) -> None:
        """The host holds lease `sequence`; the next renewal is due in a third of it."""
        self.sequence, self.active = sequence, True
        self.due_at = now.mono + self.seconds / 3

    def expiry_ms(self, now: Now) -> int:
        """The wall-clock deadline a renewal sent now asks for."""
        return now.wall_ms + self.seconds * 1000


@dataclass
class Collecting:
    """The objects still to read, and where the current one stands."""

    names: list[str]
    offset: int = 0
    identity: str | None = None
    sizes: dict[str, int] = field(default_factory=dict)

    def take(self, row: ReadRow) -> tuple[Chunk, bool]:
        """The bytes of one read row, and whether the object is complete now."""
        name = self.names[0]
        if self.identity is not None and row.identity != self.identity:
            self.offset, self.identity = 0, None
            return Chunk(name, 0, b"", restart=True), False
        self.identity = row.identity
        self.offset = row.next_offset
        return Chunk(name, row.offset, row.data), row.eof

    def next_object(self) -> str:
        """Done with the current object: its size, then the next one from 0."""
        name = self.names.pop(0)
        self.sizes[name] = self.offset
        self.offset, self.identity = 0, None
        return name


class JobSteps:
    """One attempt's steps; see the module docstring."""

    def __init__(
        self,
        plan: planlib.Plan,
        *,
        bindings: Mapping[str, Any] | None,
        objects: Sequence[str],
        lease_s: int,
        detach: bool = False,
        poll_s: float = POLL_S,
        wait_limit_s: float | None = None,
        new_id: Callable[[], str] = new_request_id,
    ) -> None:
        self.plan = plan
        self.bindings = dict(bindings or {})
        self.fence = Fence(plan.attempt_id, plan.generation, planlib.plan_digest(plan))
        self.lease = Lease(lease_s)
        self.collecting = Collecting(list(objects))
        self.uploads = list(plan.streamed_inputs)
        self.detach = detach
        self.poll_s = poll_s
        self.wait_limit_s = wait_limit_s
        self.new_id = new_id
        self.phase = Phase.OBSERVE if bindings is None else Phase.PREPARE
        self.since = 0.0
        self.observe_at = 0.0
        self.row: AttemptRow | None = None
        self.failure: str | None = None
        self.interrupts = 0
        self.heeded = 0
        self.stopped = False
        """Whether an interrupt stopped the job (rather than it ending by itself)."""
        self.result: Result | None = None
        self.notes: list[str] = []

    # --- what the shell asks --------------------------------------------------------------

    def action(self, now: Now) -> Action:
        """The next thing to do."""
        self._heed_interrupt(now)
        if self.result is not None:
            return Finish(self.result)
        if self.phase in (Phase.READY, Phase.RUN, Phase.SETTLE):
            return self._waiting(now)
        if self.phase is Phase.UPLOAD:
            return Upload(self.uploads[0])
        if self.phase is Phase.COLLECT:
            return self._collect_next(now)
        return self._send_for_phase(now)

    def take_notes(self) -> list[str]:
        """The step lines since the last call (what happened, in words)."""
        notes, self.notes = self.notes, []
        return notes

    # --- what the shell reports -------------------------------------------------------------

    def answer(self, step: str, reply: AnyReply, now: Now) -> list[Chunk]:
        """The reply to the `Send` of `step`; bytes to store when it was a collect."""
        if isinstance(reply, ErrorReply):
            self._refused_whole(step, reply)
            return []
        if isinstance(reply, ReadsReply):
            return self._on_read(reply.results[0], now)
        assert isinstance(reply, AttemptsReply), f"{step}: unexpected {type(reply).__name__}"
        row = reply.results[0]
        handlers = {
            "prepare": self._on_prepare,
            "observe": self._on_observe,
            "start": self._on_start,
            "stop": self._on_stop,
            "release": self._on_release,
        }
        handlers[step](row, now)
        return []

    def uploaded(self, item: planlib.InputObject, now: Now) -> None:
        """The host reports `item` complete."""
        self.uploads.remove(item)
        self.notes.append(f"upload: {item.name} complete ({item.bytes} bytes)")
        if not self.uploads:
            self._go(Phase.READY, now)

    def upload_failed(self, item: planlib.InputObject, message: str, now: Now) -> None:
        """The host refused `item`'s stream: the attempt cannot start."""
        self._fail(f"upload: {item.name}: {message}", now)

    def lost(self, step: str, message: str, *, applied: bool) -> None:
        """No trustworthy reply to `step`, even after the shell's retries; `applied`:
        the request may have run (a prepare that surely did not reserved nothing)."""
        if step == "prepare" and not applied:
            self._finish(Ending.REFUSED, f"prepare: not sent: {message}")
        else:
            self._finish(Ending.UNFINISHED, f"{step}: no reply from the daemon ({message})")

    def interrupt(self) -> None:
        """SIGINT or SIGTERM: heeded at the next `action`."""
        self.interrupts += 1

    # --- the lease ----------------------------------------------------------------------

    def renewal(self, now: Now) -> RenewRequest | None:
        """The renewal to send now, if one is due."""
        if not self._leasing() or now.mono < self.lease.due_at:
            return None
        lease = self.lease
        lease.sequence += 1
        lease.due_at = now.mono + min(RETRY_RENEW_S, lease.seconds / 10)  # until it answers
        leases = [self._renewal(lease.sequence, now)]
        return RenewRequest(version=1, id=self.new_id(), leases=leases)

    def renewed(self, reply: AnyReply | None, now: Now) -> None:
        """The renewal's reply (None: none came; the next try is soon)."""
        if reply is None:
            return
        if isinstance(reply, ErrorReply):
            error = reply.error
        else:
            assert isinstance(reply, AttemptsReply), f"renew: unexpected {type(reply).__name__}"
            row = reply.results[0]
            if isinstance(row, AttemptRow):
                self.lease.due_at = now.mono + self.lease.seconds / 3
                return
            error = row.error
        self.lease.active = False  # a refused sequence would be refused again
        self.notes.append(f"renew: refused: {error.code}: {error.message}")

    def renew_in(self, now: Now) -> float | None:
        """Seconds until the next renewal is due; None while there is no lease to keep."""
        if not self._leasing():
            return None
        return max(0.0, self.lease.due_at - now.mono)

    def _renewal(self, sequence: int, now: Now) -> Renewal:
        f = self.fence
        expires = self.lease.expiry_ms(now)
        return Renewal(f.attempt_id, f.generation, f.plan_digest, sequence, expires)

    def _leasing(self) -> bool:
        row = self.row
        if self.result is not None or row is None or not self.lease.active:
            return False
        return row.state not in TERMINAL and row.state != "released"

    # --- deciding ---------------------------------------------------------------------------

    def _go(self, phase: Phase, now: Now) -> None:
        self.phase, self.since, self.observe_at = phase, now.mono, now.mono

    def _finish(self, ending: Ending, message: str = "") -> None:
        if self.result is None:
            self.phase = Phase.DONE
            self.result = Result(ending, self.row, message)

    def _fail(self, message: str, now: Now) -> None:
        """A step failed: stop the attempt (if it may still run), then finish it off."""
        self.failure = self.failure or message
        active = self.row is None or self.row.state not in TERMINAL
        self._go(Phase.STOP if active else Phase.SETTLE, now)

    def _heed_interrupt(self, now: Now) -> None:
        if self.interrupts == self.heeded or self.result is not None:
            return
        leave = self.detach or self.interrupts > 1
        if self.phase is Phase.OBSERVE and not leave:
            return  # heeded once the attempt's state is known
        self.heeded = self.interrupts
        if self.phase is Phase.PREPARE:  # nothing was sent yet
            self._finish(Ending.INTERRUPTED, "interrupted before anything was reserved")
        elif leave:
            self._finish(Ending.DETACHED, "interrupted; the attempt was left as it is")
        elif self.phase in (Phase.UPLOAD, Phase.READY, Phase.START, Phase.RUN):
            self.notes.append("interrupted: stopping the job, then releasing it")
            self.stopped = True
            self._go(Phase.STOP, now)

    def _send_for_phase(self, now: Now) -> Send:
        fences = [self.fence]
        if self.phase is Phase.PREPARE:
            return Send("prepare", self._prepare(now))
        if self.phase is Phase.OBSERVE:
            return Send("observe", self._observe())
        if self.phase is Phase.START:
            return Send("start", StartRequest(version=1, id=self.new_id(), attempts=fences))
        if self.phase is Phase.STOP:
            return Send("stop", StopRequest(version=1, id=self.new_id(), attempts=fences))
        return Send("release", ReleaseRequest(version=1, id=self.new_id(), attempts=fences))

    def _prepare(self, now: Now) -> PrepareRequest:
        attempt = PrepareAttempt(plan=self.plan, lease=self._renewal(1, now))
        return PrepareRequest(version=1, id=self.new_id(), **self.bindings, attempts=[attempt])

    def _observe(self) -> ObserveRequest:
        return ObserveRequest(version=1, id=self.new_id(), attempts=[self.fence], detail=True)

    def _waiting(self, now: Now) -> Action:
        limit = self.wait_limit_s
        if limit is not None and now.mono - self.since > limit:
            self._waited_out(limit, now)
            return self.action(now)
        if now.mono < self.observe_at:
            return Wait(self.observe_at - now.mono)
        return Send("observe", self._observe())

    def _waited_out(self, limit: float, now: Now) -> None:
        row = self.row
        state = f"{row.state} (reason {row.reason})" if row else "unknown"
        step, what = _WAITS[self.phase]
        message = f"{step}: waited {limit:.0f} s for {what}; the attempt is {state}"
        if self.phase is Phase.SETTLE:
            self._finish(Ending.UNFINISHED, message)
        else:
            self._fail(message, now)

    def _collect_next(self, now: Now) -> Action:
        if not self.collecting.names:
            self._go(Phase.RELEASE, now)
            return self.action(now)
        f, name, offset = self.fence, self.collecting.names[0], self.collecting.offset
        read = Read(f.attempt_id, f.generation, f.plan_digest, name, offset, READ_BYTES)
        return Send("collect", CollectRequest(version=1, id=self.new_id(), reads=[read]))

    # --- answers ----------------------------------------------------------------------------

    def _refused_whole(self, step: str, reply: ErrorReply) -> None:
        message = f"{step}: {reply.error.code}: {reply.error.message}"
        if step == "prepare":
            self._finish(Ending.REFUSED, message)
        else:
            self._finish(Ending.UNFINISHED, message)

    def _on_prepare(self, row: AttemptRow | ErrorRow, now: Now) -> None:
        if isinstance(row, ErrorRow):
            self._finish(Ending.REFUSED, f"prepare: {row.error.code}: {row.error.message}")
            return
        self.row = row
        self.lease.start(now, row.lease_sequence or 1)
        if row.state != "prepared":
            self._fail(f"prepare: admitted as {row.state} (reason {row.reason})", now)
            return
        self.notes.append(f"prepare: admitted into slot {row.slot}, lease {self.lease.seconds} s")
        self._go(Phase.UPLOAD if self.uploads else Phase.READY, now)

    def _on_observe(self, row: AttemptRow | ErrorRow, now: Now) -> None:
        if isinstance(row, ErrorRow):
            self._finish(
                Ending.UNFINISHED, f"observe: refused: {row.error.code}: {row.error.message}"
            )
            return
        self.row = row
        if row.state == "released":
            self._finish(self._ending(), "the attempt was already released")
            return
        if self.phase is Phase.OBSERVE:
            self._resume_from(row, now)
            return
        self.observe_at = now.mono + self.poll_s
        if self.phase is Phase.READY:
            self._on_ready(row, now)
        elif row.state in TERMINAL and row.cleanup_confirmed:
            self._ended(row, now)

    def _on_ready(self, row: AttemptRow, now: Now) -> None:
        if row.state == "prepared" and row.ready:
            self.notes.append("ready: the provider prepared the job")
            self._go(Phase.START, now)
        elif row.state != "prepared":
            detail = f": {row.detail}" if isinstance(row.detail, str) else ""
            self._fail(f"prepare: the attempt ended {row.state} (reason {row.reason}){detail}", now)

    def _ended(self, row: AttemptRow, now: Now) -> None:
        if self.phase is Phase.RUN:
            if row.exit_code is not None and row.reason == "exited":
                said = f"the payload exited {row.exit_code}"
            else:
                detail = f": {row.detail}" if isinstance(row.detail, str) else ""
                said = f"the attempt ended {row.state} (reason {row.reason}{detail})"
            self.notes.append(f"run: {said}; cleanup confirmed ({row.stdout_bytes} bytes out)")
        self._go(Phase.COLLECT, now)

    def _resume_from(self, row: AttemptRow, now: Now) -> None:
        self.lease.start(now, max(row.lease_sequence, 1))
        self.notes.append(f"resume: the attempt's state is {row.state} (slot {row.slot})")
        if row.state in TERMINAL:
            self._go(Phase.COLLECT if row.cleanup_confirmed else Phase.SETTLE, now)
        elif row.state == "prepared":
            self._go(
                Phase.START if row.ready else Phase.UPLOAD if self.uploads else Phase.READY, now
            )
        else:
            self._go(Phase.RUN, now)

    def _on_start(self, row: AttemptRow | ErrorRow, now: Now) -> None:
        if isinstance(row, ErrorRow):
            self._fail(f"start: refused: {row.error.code}: {row.error.message}", now)
            return
        self.row = row
        self.notes.append("start: accepted; the host creates the service and checks the payload")
        self._go(Phase.RUN, now)

    def _on_stop(self, row: AttemptRow | ErrorRow, now: Now) -> None:
        if isinstance(row, AttemptRow):
            self.row = row
            self.notes.append(f"stop: requested; the attempt is {row.state}")
        else:  # already ended, say: waiting for the end tells
            self.notes.append(f"stop: {row.error.code}: {row.error.message}")
        self._go(Phase.SETTLE, now)

    def _on_read(self, row: ReadRow | ErrorRow, now: Now) -> list[Chunk]:
        collecting = self.collecting
        if isinstance(row, ErrorRow):
            name = collecting.next_object()
            self.notes.append(
                f"collect: {name}: not collected ({row.error.code}: {row.error.message})"
            )
            return []
        chunk, complete = collecting.take(row)
        if complete:
            name = collecting.next_object()
            self.notes.append(f"collect: {name}, {collecting.sizes[name]} bytes")
        return [chunk]

    def _on_release(self, row: AttemptRow | ErrorRow, now: Now) -> None:
        if isinstance(row, ErrorRow):
            self._finish(
                Ending.UNFINISHED, f"release: refused: {row.error.code}: {row.error.message}"
            )
            return
        self.row = row
        self.notes.append(f"release: {row.state} (outcome {row.outcome}); the slot is free again")
        stopped = "the job was stopped and released" if self.stopped else ""
        self._finish(self._ending(), self.failure or stopped)

    def _ending(self) -> Ending:
        if self.stopped:
            return Ending.INTERRUPTED
        return Ending.FAILED if self.failure else Ending.ENDED


__all__ = [
    "POLL_S",
    "READ_BYTES",
    "RESERVED",
    "Action",
    "Chunk",
    "Ending",
    "Finish",
    "JobSteps",
    "Lease",
    "Now",
    "Phase",
    "Result",
    "Send",
    "Upload",
    "Wait",
]
