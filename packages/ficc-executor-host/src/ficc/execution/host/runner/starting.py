"""The start pipeline: from an accepted start to the released payload.

`Starter` takes each attempt of a start request through, in this order: staged inputs
re-verified (the start handler looked before it accepted the start; a file can change
since, and this second look fails the attempt `input_changed`), the lease deadline
handed to the lease reaper (deadlines.py), the system service created with the
provider's argv as the slot account and the plan's limits, controls read back,
provider `start`, `observe` until the barrier's PID, the barrier moved into the
service's payload node (its own usage, service/payload.py), the device-open results
checked, the payload gate run, and only on a pass the release marker written
(`Started`). The runner (pipeline.py) owns the starter: it hands it start requests and
the monitor's aborts, and uses `stop_service` for its own stops.

Decisions:
- A stop or expiry arriving while the start pipeline runs is handed to it: it stops
  the service and returns; the monitor then records `Stopped` (cancelled/expired).
  The release marker is never written once a stop is pending or the lease is gone.
- A start that fails once its lease has run out is left to the monitor, which records
  the expiry (the reaper may have ended the service).
- Start authority is checked again in the ledger as the marker is written
  (`Ledger.authorize_release`: the stop, lease and offer checks at one clock reading
  inside one transaction, the marker written inside it, so no stop or renewal comes
  between the check and the marker, and the clock read again after it: a marker that
  appeared past the deadline is refused, the attempt ends `expired`): an offer
  paused, stopped or drained since the start was accepted, or one that no longer
  covers the attempt, ends it `cancelled` (reason `offer_closed` / `offer_changed`)
  and the payload is never released.
- A start that fails before the release after the kernel's out-of-memory killer
  killed a process of its service is `failed` (`memory_exhausted`), whatever the
  failure looked like (`barrier_exited`, a timeout): the plan's memory was too small
  for the runtime itself. The detail says so, with the runtime's last words.
- The barrier exiting before release is `failed` (`barrier_exited`): the payload
  cannot have run. Its pidfd is opened before the gate and looked at again right
  before the marker is written, so a barrier that died after the gate is never
  released and its exit never taken for the payload's.
- Once released, the end of the gated process and the end of the service's main
  process each bring the monitor's next look forward (pidfds): a provider that reads
  the payload's exit while its runtime still tears down is heard within
  `observe_interval` rather than at the next tick.
- Device-open results are taken from the latest `ready` or `payload` observation.
- A provider start or observe that timed out leaves the outcome `unknown`
  (`provider_timeout`), never a replay.
- Anything that fails once the release marker is there (recording `Started`
  included, say on a full `state_dir`) stops the service and leaves the outcome
  `unknown` with the failure's code, never `failed`: the payload may have run.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import posixpath
import select
import time
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

import msgspec

from ficc.execution import plan as planlib
from ficc.execution import provider as sdk
from ficc.execution.host.config.ceiling import ceiling_limits
from ficc.execution.host.core import lifecycle
from ficc.execution.host.core.codes import HostCode
from ficc.execution.host.core.errors import HostError
from ficc.execution.host.gate import checks as gate
from ficc.execution.host.gate.expectation import (
    PrepareResult,
    build_expectation,
    check_device_opens,
    decode_prepare_result,
    service_spec,
)
from ficc.execution.host.linux import evidence as evidencelib
from ficc.execution.host.runner import runtime_errors
from ficc.execution.host.runner.attempts import (
    INTERNAL_ERROR,
    Attempt,
    AttemptWork,
    Shared,
    decoded_reply,
    observation_of,
    row_error,
)
from ficc.execution.host.runner.batching import PROVIDER_TIMEOUT, Ticket
from ficc.execution.host.runner.deadlines import Deadlines
from ficc.execution.host.service.interface import Controls, ServiceHandle
from ficc.execution.host.storage import layout
from ficc.execution.host.storage.layout import RELEASE_MARKER
from ficc.execution.provider import DeviceOpen
from ficc.execution.wire import DETAIL_MAX

__all__ = ["MAX_OBSERVATION_PAUSE", "Starter", "observation_pause"]

_log = logging.getLogger(__name__)

MAX_OBSERVATION_PAUSE = 0.25
"""The longest wait between observations of a start waiting for its payload."""

AFTER_EXIT_LOOKS = 20
"""Looks at a running attempt, `observe_interval` apart, once its payload's process
ended; the monitor's tick takes over after them."""


def observation_pause(interval: float, last_cost: float) -> float:
    """How long waiting starts pause before they observe again.

    Observing many attempts costs more per call, so the pause grows with the CPU the
    last call spent (observation then takes at most a fifth of a CPU); it never
    exceeds MAX_OBSERVATION_PAUSE, so one slow provider call (a full worker pool, a
    timeout) cannot push every waiting start towards its start deadline.
    """
    return min(max(interval, 4 * last_cost), max(interval, MAX_OBSERVATION_PAUSE))


class _Uncertain(Exception):
    """The outcome of a possibly started attempt cannot be known (OutcomeLost)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class _Aborted(Exception):
    """A stop became pending during start: the monitor records it."""


class Starter(AttemptWork):
    """The start pipeline of the runner's attempts (see the module docstring)."""

    def __init__(
        self,
        shared: Shared,
        *,
        deadlines: Deadlines,
        spawn: Callable[[Coroutine[Any, Any, None]], asyncio.Task[None]],
    ) -> None:
        super().__init__(shared)
        self._deadlines = deadlines
        self._spawn = spawn
        """Starts a task the runner keeps (and cancels when it closes)."""
        self._starting: dict[str, asyncio.Task[None]] = {}
        self._abort: set[str] = set()
        self._exit_watches: set[int] = set()
        self._payload_ended: set[str] = set()
        """Attempts whose gated payload process ended within the last looks (see
        `_look_after_payload`)."""
        """pidfds of released services' main processes and payloads (see `_watch`)."""
        self._beat: asyncio.Future[None] | None = None
        """The next shared observation instant of starts (see `_next_observation`)."""
        self._observe_cost = 0.0
        """CPU seconds the last observe call of a waiting start spent (not its wall
        time: on a busy host that is mostly waiting for a CPU, and counting it would
        slow every start's observation exactly when Podman keeps the CPUs busy)."""

    def request(self, attempt_ids: Sequence[str]) -> None:
        """Start these attempts; their provider start rows go out together."""
        # one already in the pipeline is left alone: a second start never starts twice
        fresh = [a for a in dict.fromkeys(attempt_ids) if a not in self._starting]
        cohort = self._batcher.cohort(len(fresh))
        for attempt_id in fresh:
            task = self._spawn(self._start(attempt_id, cohort.ticket()))
            self._starting[attempt_id] = task
            task.add_done_callback(functools.partial(self._start_done, attempt_id))

    def running(self, attempt_id: str) -> bool:
        """Whether this attempt's start pipeline still runs (it owns the service)."""
        return attempt_id in self._starting

    def payload_ended(self, attempt_id: str) -> bool:
        """Whether the gated payload process of this attempt ended moments ago, so a
        provider may already have its exit while the service still runs."""
        return attempt_id in self._payload_ended

    def abort(self, attempt_id: str) -> None:
        """Hand a stop to a running start pipeline: it stops the service and returns."""
        self._abort.add(attempt_id)

    def close(self) -> None:
        """Stop watching released services' main processes."""
        for fd in list(self._exit_watches):
            self._unwatch(fd)

    def _start_done(self, attempt_id: str, _: object) -> None:
        self._starting.pop(attempt_id, None)
        self._abort.discard(attempt_id)
        self._monitor.wake()

    async def _start(self, attempt_id: str, ticket: Ticket) -> None:
        """One attempt of a start batch; its ticket lets its provider start go out
        with the batch's others."""
        with ticket:
            await self._start_attempt(attempt_id, ticket)

    async def _start_attempt(self, attempt_id: str, ticket: Ticket) -> None:
        record = await self._db(self._ctx.ledger.get, attempt_id)
        if record is None or record.status.state != "starting":
            return
        if record.status.stop_pending is not None:
            return  # the monitor stops it; nothing was created
        attempt = await self._attempt(record)
        try:
            try:
                await self._start_pipeline(attempt, ticket)
            except (_Aborted, _Uncertain):
                raise
            except Exception as error:
                if await self._io(_released, attempt):
                    # The payload may have run: never a `failed` that reads "never ran".
                    _log.exception("attempt %s: start failed after the release", attempt.id)
                    code = error.code if isinstance(error, HostError) else INTERNAL_ERROR
                    raise _Uncertain(code) from error
                raise
        except _Aborted:
            await self.stop_service(attempt)
        except _Uncertain as uncertain:
            await self.stop_service(attempt)
            if not await self._apply(record, lifecycle.OutcomeLost(reason=uncertain.reason)):
                _log.error(
                    "attempt %s: its service is stopped but its outcome (unknown) could not"
                    " be recorded; it stays `starting` until the daemon restarts",
                    attempt.id,
                )
        except HostError as error:
            # Read before the stop: systemd removes a stopped unit's cgroups, counters too.
            error = await self._killed_for_memory(attempt, error)
            await self.stop_service(attempt)
            if not await self._lease_still_current(attempt.id):
                return  # the reaper may have ended the service at the deadline: expiry
            await self._log_runtime_error(attempt, error)
            await self._refused(record, lifecycle.StartFailed(reason=error.code), error)
        except Exception:
            _log.exception("attempt %s: start failed unexpectedly", attempt.id)
            await self.stop_service(attempt)
            await self._apply(record, lifecycle.StartFailed(reason=INTERNAL_ERROR))

    async def _killed_for_memory(self, attempt: Attempt, error: HostError) -> HostError:
        """`memory_exhausted` in place of `error` when the kernel's out-of-memory killer
        killed a process of the service before the release: the runtime (or the barrier)
        was killed for memory, and `barrier_exited` with a bare `Killed` would send the
        operator after the wrong cause. A gate refusal keeps its own code: it says the
        sandbox was wrong, whatever else happened."""
        handle = self._handles.get(attempt.id)
        if handle is None or error.code.startswith("gate_"):
            return error
        used = await self._usage(attempt, handle)
        if not used.oom_kills:
            return error
        return HostError(
            lifecycle.MEMORY_EXHAUSTED,
            f"the kernel's out-of-memory killer killed {used.oom_kills} process(es) of the"
            f" attempt's service before the payload was released ({error.code}: "
            f"{error.message}): memory_bytes {attempt.plan.job.limits.memory_bytes} is too"
            f" small for the provider's runtime itself{self._stated_memory(attempt)}; send a"
            " plan with more memory",
        )

    def _stated_memory(self, attempt: Attempt) -> str:
        """What the attempt's provider states its runtime needs, as a clause; empty
        when it states nothing."""
        runtime = self._ctx.providers.get(attempt.plan.job.runtime.provider)
        loaded = None if runtime is None else runtime.loaded
        needed = None if loaded is None or loaded.minimums is None else loaded.minimums.memory_bytes
        return "" if needed is None else f" (the provider states it needs at least {needed})"

    async def _log_runtime_error(self, attempt: Attempt, error: HostError) -> None:
        """The runtime's own words for a start that failed before the release (the log
        holds nothing of the payload then), at error priority: release deletes them. A
        start the runtime lost to the out-of-memory killer gets the host's explanation
        first: the runtime's last words are then only `Killed`."""
        said = await self._io(runtime_errors.stderr_tail, attempt.files, attempt.id)
        if error.code == lifecycle.MEMORY_EXHAUSTED:
            said = f"{error.message}; the runtime printed: {said}" if said else error.message
        if not said:
            return
        self._details[attempt.id] = said[-DETAIL_MAX:]
        _log.error(
            "attempt %s: start failed (%s); the runtime printed: %s",
            attempt.id,
            error.code,
            said,
            extra={
                "fields": {
                    "event": "runtime_error",
                    "attempt_id": attempt.id,
                    "code": error.code,
                    "runtime_stderr": said,
                }
            },
        )

    async def _start_pipeline(self, attempt: Attempt, ticket: Ticket) -> None:
        try:
            result = await self._prepared(attempt)
            inputs = await self._inputs(attempt)
            for capability in inputs:
                await self._io(attempt.slot.stager.verify_identity, attempt.id, capability)
            handle = await self._create_service(attempt, result)
            context = await self._later_context(attempt, inputs=inputs)
        except BaseException:
            ticket.close()  # the batch's other rows need not wait for this one's stop
            raise
        started = await ticket.call(attempt.provider, "start", context)
        if started.code == PROVIDER_TIMEOUT:
            raise _Uncertain(PROVIDER_TIMEOUT)
        if not started.ok:
            raise row_error(started, "start")
        decoded_reply(started, "start", sdk.StartReply)
        pid, devices = await self._await_payload(attempt, context, handle)
        barrier = _barrier_pidfd(pid)  # before the gate, which then vouches for it
        try:
            await self._place_payload(attempt, handle, pid, barrier)
            check_device_opens(
                result, None if devices is None else {d.path: d.opened for d in devices}
            )
            verdict = await self._io(self._run_gate, attempt, result, handle, pid)
            if not verdict.ok and _ended(barrier):
                # A barrier that ended takes its service's cgroups with it: that, not
                # the unreadable limits, is the cause.
                raise _barrier_exited()
            if not verdict.ok:
                raise HostError(verdict.failures[0].code, verdict.failures[0].message)
            await self._release_payload(attempt, barrier)
        except BaseException:
            os.close(barrier)
            raise
        self._wake_on_exit(handle.main_pid)
        self._watch(barrier, functools.partial(self._spawn_looks, attempt.id))

    async def _place_payload(
        self, attempt: Attempt, handle: ServiceHandle, pid: int, barrier: int
    ) -> None:
        """Move the reported barrier into the service's payload node (before the gate,
        which then judges it there), so the payload's own usage can be told from its
        runtime's. Bookkeeping only: a refusal is logged and the start goes on, its
        payload figures absent. Only a live barrier is moved (`barrier` is its pidfd),
        and only from inside the service, so a reused PID is never touched."""
        if _ended(barrier):
            raise _barrier_exited()
        try:
            await self._io(self._ctx.service.place_payload, handle, pid)
        except (HostError, OSError) as error:
            if _ended(barrier):
                raise _barrier_exited() from error
            _log.warning("attempt %s: payload usage not separated: %s", attempt.id, error)

    def _wake_on_exit(self, pid: int | None) -> None:
        """Wake the monitor the moment the service's main process exits.

        The monitor otherwise notices the end of a payload only at its next tick; a
        pidfd becomes readable when the process exits, so the outcome is observed at
        once. A PID that is already gone (or reused) only costs an early tick.
        """
        if pid is None:
            return
        try:
            fd = os.pidfd_open(pid)
        except OSError:
            self._monitor.wake()
            return
        self._watch(fd, self._monitor.wake)

    def _watch(self, fd: int, exited: Callable[[], object]) -> None:
        """Call `exited` once when the process of this pidfd ends."""
        self._exit_watches.add(fd)

        def readable() -> None:
            self._unwatch(fd)
            exited()

        asyncio.get_running_loop().add_reader(fd, readable)

    def _spawn_looks(self, attempt_id: str) -> None:
        self._spawn(self._look_after_payload(attempt_id))

    async def _look_after_payload(self, attempt_id: str) -> None:
        """The payload's own process (the one the gate checked) has ended: its outcome
        is looked at now, and again every `observe_interval` while the attempt is still
        `running`, for at most AFTER_EXIT_LOOKS looks.

        A provider may report the exit before the service ends (the Podman provider
        reads the container's exit status while Podman still tears the container
        down), but only a moment after the process ended: its runtime reaps it first.
        The monitor's own tick (TICK_SECONDS) would otherwise find it.
        """
        self._payload_ended.add(attempt_id)
        self._walls.ended.setdefault(attempt_id, self._ctx.clock.now().boottime_ns)
        try:
            for _ in range(AFTER_EXIT_LOOKS):
                self._monitor.wake()
                await asyncio.sleep(self._settings.observe_interval)
                record = await self._db(self._ctx.ledger.get, attempt_id)
                if record is None or record.status.state != "running":
                    return
        finally:
            self._payload_ended.discard(attempt_id)

    def _unwatch(self, fd: int) -> None:
        if fd in self._exit_watches:
            self._exit_watches.discard(fd)
            asyncio.get_running_loop().remove_reader(fd)
            os.close(fd)

    async def _prepared(self, attempt: Attempt) -> PrepareResult:
        data = await self._db(self._ctx.ledger.prepare_result, attempt.id)
        if data is None:
            raise HostError(HostCode.PREPARE_RESULT_MISSING, "no persisted prepare result")
        return decode_prepare_result(msgspec.json.decode(data))

    async def _create_service(self, attempt: Attempt, result: PrepareResult) -> ServiceHandle:
        spec = service_spec(
            attempt.service,
            result,
            uid=attempt.slot.uid,
            gid=attempt.slot.gid,
            paths=attempt.paths,
            limits=attempt.plan.job.limits,
            nofile=self._settings.nofile,
        )
        self._check_abort(attempt)
        await self._deadlines.set(attempt)
        handle: ServiceHandle = await self._io(self._ctx.service.create, spec)
        self._handles[attempt.id] = handle
        controls: Controls = await self._io(self._ctx.service.controls, handle)
        wrong = _limits_not_enforced(controls, attempt.plan.job.limits)
        if wrong:
            raise HostError(
                HostCode.SERVICE_LIMITS, f"the service does not enforce the plan: {wrong}"
            )
        return handle

    async def _lease_still_current(self, attempt_id: str) -> bool:
        record = await self._db(self._ctx.ledger.get, attempt_id)
        return record is not None and self.lease_current(record)

    async def _await_payload(
        self, attempt: Attempt, context: sdk.Context, handle: ServiceHandle
    ) -> tuple[int, list[DeviceOpen] | None]:
        """Observe until the barrier's host PID is reported (or the deadline).

        A provider reports `ready` (the device opens) before `payload` (the PID), often
        on consecutive calls, so the first `ready` is followed by the next observation
        at once; every other observation waits `observe_interval` first. A `ready` that
        already carries the PID reports both: it saves that extra call.
        """
        deadline = time.monotonic() + self._settings.start_timeout
        devices: list[DeviceOpen] | None = None
        furthest = "waiting"
        while True:
            self._check_abort(attempt)
            result = await self._batcher.call(attempt.provider, "observe", context)
            self._observe_cost = self._batcher.cpu_seconds.get((attempt.provider, "observe"), 0.0)
            if result.code == PROVIDER_TIMEOUT:
                raise _Uncertain(PROVIDER_TIMEOUT)
            seen = observation_of(result)
            if seen.devices is not None:
                devices = seen.devices
            if seen.phase in ("ready", "payload") and seen.pid is not None:
                return seen.pid, devices
            exited = await self._io(self._ctx.service.exit_status, handle)
            if seen.phase == "finished" or exited is not None:
                raise _barrier_exited()
            if time.monotonic() >= deadline:
                raise HostError(
                    HostCode.START_TIMEOUT,
                    f"no payload PID within {self._settings.start_timeout}s; the payload never"
                    " ran: check the provider",
                )
            if seen.phase == "ready" and furthest == "waiting":
                furthest = "ready"
            else:
                await self._next_observation()

    async def _next_observation(self) -> None:
        """Wait `observe_interval`, on a beat shared by every start waiting for its
        payload: they wake in the same loop turn, so their observe rows go out as one
        provider call (one walk of the provider's process table instead of one each)."""
        beat = self._beat
        if beat is None or beat.done():
            loop = asyncio.get_running_loop()
            beat = self._beat = loop.create_future()
            pause = observation_pause(self._settings.observe_interval, self._observe_cost)
            loop.call_later(pause, _settle_beat, beat)
        await asyncio.shield(beat)

    def _run_gate(
        self, attempt: Attempt, result: PrepareResult, handle: ServiceHandle, pid: int
    ) -> gate.Verdict:
        """Blocking: build the Expectation and judge the live barrier (evidence first)."""
        logs = tuple(
            evidencelib.FileIdentity(st.st_dev, st.st_ino)
            for st in (os.stat(p) for p in (attempt.paths.stdout, attempt.paths.stderr))
        )
        expectation = build_expectation(
            uid=attempt.slot.uid,
            gid=attempt.slot.gid,
            result=result,
            handle=handle,
            service_cgroup=posixpath.dirname(self._ctx.service.supervisor_cgroup(handle)),
            processes=attempt.plan.job.limits.processes,
            log_files=logs,
            nofile=self._settings.nofile,
            user_namespace=self._settings.user_namespace,
            cgroup_namespace=self._settings.cgroup_namespace,
        )
        evidence = attempt.files.open_part(attempt.id, layout.EVIDENCE)
        try:
            verdict = gate.inspect_and_check(pid, expectation, evidence)
        finally:
            os.close(evidence)
        # The limits were read back when the service was made; the provider's start ran
        # since, and anyone with root could have raised them. The service's cgroups hold
        # the barrier (gate_cgroup), so theirs bound it: read them again. A change is the
        # first failure named, whatever else the evidence shows.
        try:
            wrong = _limits_not_enforced(
                self._ctx.service.controls(handle), attempt.plan.job.limits
            )
        except (HostError, OSError) as error:
            wrong = f"they cannot be read again: {error}"
        if not wrong:
            return verdict
        failure = gate.Failure(
            HostCode.GATE_LIMITS,
            f"the service's cgroups no longer enforce the plan's limits, as the host set "
            f"and read them when it made the service ({wrong}); {gate.ADVICE}",
        )
        return msgspec.structs.replace(verdict, ok=False, failures=(failure, *verdict.failures))

    async def _release_payload(self, attempt: Attempt, barrier: int) -> None:
        """The last checks and the marker in one ledger transaction, then `Started`.
        `barrier` is a pidfd of the gated barrier: one that already ended is never
        released (its exit would be taken for the payload's)."""
        self._check_abort(attempt)
        record = attempt.record

        released_at: list[int] = []

        def release() -> None:
            """On the ledger thread, inside `authorize_release`'s transaction."""
            if _ended(barrier):
                raise _barrier_exited()
            _write_marker(attempt)
            released_at.append(self._ctx.clock.now().boottime_ns)  # the payload's wall time

        authorize = functools.partial(
            self._ctx.ledger.authorize_release,
            record.fence,
            self._ctx.clock,
            ceiling_limits(self._ctx.config),
            release=release,
        )
        lost = await self._db(authorize)
        if lost is not None:
            _log.warning("attempt %s: not released (%s)", attempt.id, lost)
            raise _Aborted()  # the service is stopped; the monitor records the outcome
        if released_at:
            self._walls.released[attempt.id] = released_at[0]
        # Raises: a released payload whose start is not on record is an unknown outcome.
        await self._db(self._ctx.ledger.apply, record.fence, lifecycle.Started())

    def _check_abort(self, attempt: Attempt) -> None:
        if attempt.id in self._abort:
            raise _Aborted()

    async def stop_service(self, attempt: Attempt) -> None:
        """Kill the service tree (provider stop first, best effort, and only with a
        verified storage binding); never raises."""
        try:
            context = await self._later_context(attempt)
            stopped = await self._batcher.call(attempt.provider, "stop", context)
            if not stopped.ok:
                _log.warning("attempt %s: provider stop: %s", attempt.id, stopped.message)
        except HostError as error:
            _log.warning("attempt %s: provider stop skipped: %s", attempt.id, error)
        try:
            handle = await self._service(attempt)
            if handle is not None:
                await self._io(self._ctx.service.stop, handle)
        except HostError as error:
            _log.warning("attempt %s: stop not confirmed yet: %s", attempt.id, error)


# --- blocking helpers (run in worker threads) ---------------------------------------


def _released(attempt: Attempt) -> bool:
    """Whether the release marker is there (the payload may have run)."""
    return os.path.lexists(f"{attempt.paths.control}/{RELEASE_MARKER}")


def _write_marker(attempt: Attempt) -> None:
    control = attempt.files.open_part(attempt.id, layout.CONTROL)
    try:
        gate.write_release_marker(control, RELEASE_MARKER, group=attempt.slot.gid)
    finally:
        os.close(control)


def _limits_not_enforced(controls: Controls, limits: planlib.Limits) -> str:
    """How the limits the kernel reports differ from the plan's (memory in whole
    pages); empty when they are the plan's."""
    page = os.sysconf("SC_PAGE_SIZE")
    wrong = []
    if controls.processes != limits.processes:
        wrong.append(f"processes {controls.processes} != {limits.processes}")
    if controls.cpu_millis != limits.cpu_millis:
        wrong.append(f"cpu_millis {controls.cpu_millis} != {limits.cpu_millis}")
    if controls.memory_bytes != limits.memory_bytes // page * page:
        wrong.append(f"memory_bytes {controls.memory_bytes} != {limits.memory_bytes}")
    if controls.swap_bytes is not None and controls.swap_bytes > limits.swap_bytes:
        wrong.append(f"swap_bytes {controls.swap_bytes} > {limits.swap_bytes}")
    return "; ".join(wrong)


def _barrier_pidfd(pid: int) -> int:
    """A pidfd of the reported barrier; `barrier_exited` when it is already gone."""
    try:
        return os.pidfd_open(pid)
    except ProcessLookupError:
        raise _barrier_exited() from None


def _barrier_exited() -> HostError:
    return HostError(
        HostCode.BARRIER_EXITED, "the barrier exited before release; the payload never ran"
    )


def _ended(pidfd: int) -> bool:
    """Whether the process of `pidfd` has exited (a pidfd is readable from then on,
    reaped or not)."""
    return bool(select.select([pidfd], [], [], 0)[0])


def _settle_beat(beat: asyncio.Future[None]) -> None:
    if not beat.done():
        beat.set_result(None)
