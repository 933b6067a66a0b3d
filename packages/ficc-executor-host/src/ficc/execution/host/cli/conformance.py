"""The provider conformance kit: runs an installed provider through the contract
without the daemon, and names every rule it breaks.

    python -m ficc.execution.host.cli.conformance --config FILE --provider ID \\
        --plan PLAN.json [--provider-path SITE] [--slot ID] [--unpinned] [--json]

The configuration file is the daemon's own (docs/configuration.md): the provider is
verified against its pin and configured from it exactly as `serve` does, and the kit
uses one configured slot (its account and its slot filesystem, checked as before an
attempt) and the configured service backend. `--plan` is a plan the provider can run
(the kit gives each attempt fresh IDs and its own payloads: `--quick-argv`, which
must exit 0, and `--long-argv`, which must run until stopped). `--unpinned` pins
whatever is installed (a development install; never on a host).

The kit plays the host's part: it creates each attempt's layout, calls the driver
through the host's own batch adapter, validates every reply with the provider SDK,
runs the prepared argv in a real system service as the slot account, and writes the
release marker when the provider reports the payload PID. It does not run the
payload gate (the daemon does; docs/security.md). Each rule has a stable name
(`RULES`); a run prints exactly one line per rule, `pass`, `FAIL` with what was wrong,
or `SKIP` with why it could not run (a rule that needs what a failed one should have
made), and exits 0 when every rule passed, 1 when one failed, 2 when it could not run
(`conformance_usage` for a bad argument). Every provider call is bounded by
`--timeout`: a call that does not return by then fails its rule and stops the run
(the call cannot be stopped; the kit reports what it has and exits).

Needs root, like the daemon, and a slot that no daemon is using.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import os
import secrets
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Final, TypeVar

import msgspec

from ficc.execution import plan as planlib
from ficc.execution import provider as sdk
from ficc.execution.host.cli.conformance_rules import RULES
from ficc.execution.host.config.host import open_image_parent
from ficc.execution.host.config.model import Config, Slot
from ficc.execution.host.core.codes import HostCode
from ficc.execution.host.core.errors import HostError
from ficc.execution.host.gate import checks as gate
from ficc.execution.host.gate.expectation import (
    DEFAULT_NOFILE,
    check_device_opens,
    check_prepare_result,
    service_spec,
)
from ficc.execution.host.providers.driver import RowResult, call
from ficc.execution.host.service.interface import ServiceHandle, ServiceSpec, SystemService
from ficc.execution.host.storage import layout
from ficc.execution.host.storage.layout import AttemptPaths, service_name
from ficc.execution.host.storage.slot_files import ReservedSlot

__all__ = ["CHECK_REFUSAL", "RULES", "USAGE", "Kit", "Outcome", "RuleFailed"]


CHECK_REFUSAL: Final = "conformance_check"
"""The code of the kit's check() refusal, which prepare must pass through unchanged."""
MAX_CHECK_CALLS: Final = 32
"""Refusing check() at call 1, 2, ... stops here (a prepare calling it more is fine)."""
USAGE: Final = HostCode.CONFORMANCE_USAGE
"""The code of a run that could not start because of its arguments (exit 2)."""

_S = TypeVar("_S", bound=msgspec.Struct)


class RuleFailed(Exception):
    """A broken rule: its name and what was wrong."""

    def __init__(self, rule: str, message: str) -> None:
        super().__init__(f"{rule}: {message}")
        self.rule = rule
        self.message = message


class ProviderHung(Exception):
    """A provider call that did not return within the kit's timeout: it cannot be
    stopped, so the run stops."""

    def __init__(self, method: str, seconds: float) -> None:
        super().__init__(f"{method} did not return within {seconds:g} s")
        self.method = method


@dataclasses.dataclass(frozen=True)
class Outcome:
    """One rule's result; `message` says what was wrong, or why the rule was skipped
    (empty when it passed). A skipped rule has not passed."""

    rule: str
    passed: bool
    message: str = ""
    skipped: bool = False


def _require(rule: str, condition: bool, message: str) -> None:
    if not condition:
        raise RuleFailed(rule, message)


def _decoded(rule: str, method: str, result: RowResult, kind: type[_S]) -> _S:
    """The row's reply as its SDK Struct; a refusal or a malformed reply breaks `rule`."""
    if result.reply is None:
        raise RuleFailed(rule, f"{method} refused the row: {result.code}: {result.message}")
    try:
        return sdk.decode_reply(method, result.reply, kind)
    except (msgspec.ValidationError, ValueError) as error:
        raise RuleFailed(rule, f"{method} replied {result.reply!r}: {error}") from error


@dataclasses.dataclass
class _Attempt:
    plan: planlib.Plan
    paths: AttemptPaths
    service: str
    handle: ServiceHandle | None = None
    prepared: sdk.PrepareResult | None = None


class Kit:
    """One provider, one slot, one service backend: the rules, run in order."""

    def __init__(
        self,
        driver: Any,
        config: Config,
        slot: Slot,
        plan: planlib.Plan,
        service: SystemService,
        *,
        quick_argv: Sequence[str] = ("/bin/true",),
        long_argv: Sequence[str] = ("/bin/sleep", "600"),
        timeout: float = 120.0,
        minimums: sdk.MinimumLimits | None = None,
    ) -> None:
        self.driver = driver
        self.minimums = minimums
        """What the driver stated when it was loaded (`limits.minimum_runs`)."""
        self.config = config
        self.slot = slot
        self.plan = plan
        self.service = service
        self.quick_argv = list(quick_argv)
        self.long_argv = list(long_argv)
        self.timeout = timeout
        self.place = ReservedSlot(slot, open_image_parent)
        self.outcomes: list[Outcome] = []
        self._open: list[_Attempt] = []
        self._hung: set[str] = set()

    # --- running -------------------------------------------------------------------

    def run(self) -> list[Outcome]:
        """Every rule in order, one outcome each: a broken rule is recorded and the run
        goes on where it can (a rule that needs what a broken one should have made is
        skipped); a provider call that never returns stops the run."""
        stopped = ""
        try:
            self._probe_rules()
            self._prepare_rules()
            self._lifecycle_rules()
            self._stop_rules()
            self._minimum_rules()
        except ProviderHung as hung:
            stopped = f"not run: the run stopped when {hung}"
        finally:
            for attempt in list(self._open):
                self._discard(attempt)
        self._skip(list(RULES), stopped or "not run")
        order = list(RULES)
        return sorted(self.outcomes, key=lambda o: order.index(o.rule))

    def _rule(self, name: str, check: Callable[[], None]) -> bool:
        """Run one rule and record its one outcome under `name`; a hung provider call
        is recorded, then stops the run."""
        try:
            check()
        except RuleFailed as failed:
            prefix = "" if failed.rule == name else f"{failed.rule}: "
            self._record(Outcome(name, False, prefix + failed.message))
            return False
        except ProviderHung as hung:
            self._record(Outcome(name, False, str(hung)))
            raise
        except Exception as error:  # the provider broke the host's part: this rule fails
            self._record(Outcome(name, False, f"{type(error).__name__}: {error}"))
            return False
        self._record(Outcome(name, True))
        return True

    def _record(self, outcome: Outcome) -> None:
        if all(o.rule != outcome.rule for o in self.outcomes):
            self.outcomes.append(outcome)

    def _skip(self, rules: Sequence[str], reason: str) -> None:
        """Rules that could not run, with why (those already recorded keep theirs)."""
        for rule in rules:
            self._record(Outcome(rule, False, reason, skipped=True))

    def _call(self, method: str, contexts: Sequence[sdk.Context]) -> list[RowResult]:
        """One driver call through the host's batch adapter, bounded by the timeout: the
        call runs in a daemon thread, and one that has not returned by then is
        abandoned (its attempts are marked hung) and stops the run."""
        box: list[list[RowResult] | BaseException] = []

        def target() -> None:
            try:
                box.append(call(self.driver, method, contexts))
            except BaseException as error:  # handed to the kit's thread
                box.append(error)

        thread = threading.Thread(target=target, name=f"conformance-{method}", daemon=True)
        thread.start()
        thread.join(self.timeout)
        if thread.is_alive():
            self._hung.update(c.attempt_id for c in contexts)
            raise ProviderHung(method, self.timeout)
        (result,) = box
        if isinstance(result, BaseException):
            raise result
        return result

    # --- probe ---------------------------------------------------------------------

    def _probe_rules(self) -> None:
        before = list(self._open)
        try:
            self._probes()
        finally:
            for attempt in [a for a in self._open if a not in before]:
                self._discard(attempt)

    def _probes(self) -> None:
        good = self._new_plan(self.quick_argv)
        runtime = good.job.runtime
        unknown_image = "sha256:" + hashlib.sha256(secrets.token_bytes(16)).hexdigest()
        variants = {
            "probe.refuses_unknown_image": {"image_digest": unknown_image},
            "probe.refuses_unknown_isolation": {"isolation": "conformance-unknown"},
            "probe.refuses_unknown_network": {"network": "conformance-unknown"},
        }

        def accepts() -> None:
            (result,) = self._call("probe", [self._probe_context(good)])
            reply = _decoded("probe.accepts", "probe", result, sdk.ProbeReply)
            _require("probe.accepts", reply.ok, f"probe answered ok false: {result.reply!r}")

        self._rule("probe.accepts", accepts)
        for rule, change in variants.items():
            bad = self._fresh(_with_runtime(good, msgspec.structs.replace(runtime, **change)))
            self._rule(rule, functools.partial(self._refused, rule, bad))

        def batch() -> None:
            bad = self._fresh(
                _with_runtime(good, msgspec.structs.replace(runtime, image_digest=unknown_image))
            )
            rows = [self._probe_context(good), self._probe_context(bad)]
            results = self._call("probe", [rows[i % 2] for i in range(sdk.MAX_BATCH)])
            for i, result in enumerate(results):
                if i % 2 == 0:
                    _decoded("batch.probe_64", "probe", result, sdk.ProbeReply)
                else:
                    _require("batch.probe_64", not result.ok, f"row {i} (unknown image) passed")

        self._rule("batch.probe_64", batch)

    def _refused(self, rule: str, plan: planlib.Plan) -> None:
        (result,) = self._call("probe", [self._probe_context(plan)])
        _require(rule, result.reply is None, f"probe accepted it: {result.reply!r}")
        _require(
            rule,
            result.code not in (HostCode.PROVIDER_ERROR, HostCode.PROVIDER_MALFORMED),
            f"not refused with a code of its own: {result.code}: {result.message}",
        )

    # --- prepare -------------------------------------------------------------------

    def _prepare_rules(self) -> None:
        calls: list[int] = []

        def refusals() -> None:
            for refuse_at in range(1, MAX_CHECK_CALLS + 1):
                attempt = self._new_attempt(self.quick_argv)
                counted = self._prepare_refusing(attempt, refuse_at, calls)
                self._discard(attempt)
                if counted < refuse_at:
                    return  # prepare finished before the refusing call: every point covered

        self._rule("prepare.check_refusal", refusals)

        def called() -> None:
            _require("prepare.calls_check", bool(calls), "never ran (see prepare.check_refusal)")
            _require("prepare.calls_check", calls[-1] >= 1, "prepare never called check()")

        self._rule("prepare.calls_check", called)

    def _prepare_refusing(self, attempt: _Attempt, refuse_at: int, calls: list[int]) -> int:
        """Prepare with check() refusing at its `refuse_at`-th call; the calls made (also
        appended to `calls`)."""
        rule = "prepare.check_refusal"
        count = 0

        def check() -> None:
            nonlocal count
            count += 1
            if count >= refuse_at:
                raise sdk.Refused(CHECK_REFUSAL, "the conformance kit refuses this check()")

        context = self._prepare_context(attempt, check)
        (result,) = self._call("prepare", [context])
        calls.append(count)
        if count < refuse_at:
            _decoded(rule, "prepare", result, sdk.PrepareResult)
            return count
        where = f"check() refused at call {refuse_at}"
        _require(rule, count == refuse_at, f"{where}, but prepare called it again")
        _require(rule, result.reply is None, f"{where}, but prepare returned a result")
        _require(
            rule,
            result.code == CHECK_REFUSAL,
            f"{where}, but the row was refused with {result.code!r}, not check()'s code",
        )
        self._require_clean(rule, attempt, where)
        return count

    # --- one payload from prepare to release ---------------------------------------

    def _lifecycle_rules(self) -> None:
        made: list[_Attempt] = []

        def prepare() -> None:
            made.append(self._new_attempt(self.quick_argv))
            self._prepare(made[0])

        if not self._rule("prepare.result", prepare):
            self._skip(_LIFECYCLE, "not run: prepare.result failed")
            for attempt in made:
                self._discard(attempt)
            return
        (attempt,) = made
        finished: list[sdk.Reply] = []
        if not self._rule("start.reply", lambda: self._start(attempt)):
            self._skip(_OBSERVING, "not run: start.reply failed")
        elif not self._rule("observe.phases", lambda: finished.append(self._run_out(attempt))):
            self._skip(_OBSERVING, "not run: observe.phases failed")
        else:
            self._finished_rules(attempt, finished[0])
        self._releases(attempt)

    def _finished_rules(self, attempt: _Attempt, finished: sdk.Reply) -> None:
        def again() -> None:
            for _ in range(2):
                (result,) = self._call("observe", [self._context(attempt)])
                _require(
                    "observe.repeatable",
                    result.reply == finished,
                    f"observed {result.reply!r} ({result.code}) after {finished!r}",
                )

        self._rule("observe.repeatable", again)

        def batch() -> None:
            contexts = [self._context(attempt)] * sdk.MAX_BATCH
            for i, result in enumerate(self._call("observe", contexts)):
                _require(
                    "batch.observe_64",
                    result.reply == finished,
                    f"row {i}: {result.reply!r} ({result.code}), not {finished!r}",
                )

        self._rule("batch.observe_64", batch)

        def stops() -> None:
            for _ in range(2):
                (result,) = self._call("stop", [self._context(attempt)])
                _decoded("stop.repeatable", "stop", result, sdk.StopReply)

        self._rule("stop.repeatable", stops)

    def _releases(self, attempt: _Attempt) -> None:
        def release(rule: str) -> None:
            self._stop_service(attempt)
            (result,) = self._call("release", [self._context(attempt)])
            _decoded(rule, "release", result, sdk.ReleaseReply)
            self._require_clean(rule, attempt, "after release")

        if self._rule("release.clean", lambda: release("release.clean")):
            self._rule("release.repeatable", lambda: release("release.repeatable"))
        else:
            self._skip(["release.repeatable"], "not run: release.clean failed")
        self._discard(attempt)

    def _prepare(self, attempt: _Attempt) -> None:
        rule = "prepare.result"
        context = self._prepare_context(attempt, lambda: None)
        (result,) = self._call("prepare", [context])
        prepared = _decoded(rule, "prepare", result, sdk.PrepareResult)
        try:
            check_prepare_result(prepared, attempt.plan)
        except HostError as error:
            raise RuleFailed(rule, error.message) from error
        attempt.prepared = prepared

    def _start(self, attempt: _Attempt) -> None:
        assert attempt.prepared is not None
        attempt.handle = self.service.create(self._spec(attempt, attempt.prepared))
        (result,) = self._call("start", [self._context(attempt)])
        _decoded("start.reply", "start", result, sdk.StartReply)

    def _run_out(self, attempt: _Attempt) -> sdk.Reply:
        """Observe to the payload PID, release the barrier, observe to the end."""
        rule = "observe.phases"
        self._await_payload(attempt)
        deadline = time.monotonic() + self.timeout
        while True:
            (result,) = self._call("observe", [self._context(attempt)])
            seen = _decoded(rule, "observe", result, sdk.Observation)
            _require(rule, _rank(seen) >= _PAYLOAD, f"{seen.phase} after payload")
            if seen.phase == "finished":
                assert result.reply is not None
                assert attempt.handle is not None
                _require(rule, seen.exit_code == 0, f"{self.quick_argv} exited {seen.exit_code}")
                exited = self.service.exit_status(attempt.handle)
                _require(
                    rule,
                    exited is None or exited == seen.exit_code,
                    f"finished with {seen.exit_code}, the service's process with {exited}",
                )
                return result.reply
            _require(rule, time.monotonic() < deadline, f"not finished in {self.timeout}s")
            time.sleep(0.05)

    def _await_payload(self, attempt: _Attempt) -> int:
        """waiting* -> ready? -> payload (or a `ready` that carries the PID, which counts
        as both, as for the daemon): checks the order, the device results and the PID,
        then writes the release marker as the host does."""
        rule = "observe.phases"
        assert attempt.handle is not None
        assert attempt.prepared is not None
        deadline = time.monotonic() + self.timeout
        furthest = 0
        devices: dict[str, bool] | None = None
        while True:
            (result,) = self._call("observe", [self._context(attempt)])
            seen = _decoded(rule, "observe", result, sdk.Observation)
            _require(rule, seen.phase != "finished", "finished before the barrier was released")
            _require(rule, _rank(seen) >= furthest, f"{seen.phase} after a later phase")
            furthest = _rank(seen)
            if seen.devices is not None:
                devices = {d.path: d.opened for d in seen.devices}
            if seen.pid is not None and furthest == _PAYLOAD:
                members = self.service.members(attempt.handle)
                _require(rule, seen.pid in members, f"PID {seen.pid} is not in the service")
                try:
                    check_device_opens(attempt.prepared, devices)
                except HostError as error:
                    raise RuleFailed(rule, error.message) from error
                self._write_marker(attempt)
                return seen.pid
            _require(rule, time.monotonic() < deadline, f"no payload PID in {self.timeout}s")
            time.sleep(0.05)

    # --- stop of a running payload -------------------------------------------------

    def _stop_rules(self) -> None:
        rule = "stop.running"
        made: list[_Attempt] = []

        def stop() -> None:
            made.append(self._new_attempt(self.long_argv))
            attempt = made[0]
            self._prepare(attempt)
            self._start(attempt)
            self._await_payload(attempt)
            (result,) = self._call("observe", [self._context(attempt)])
            seen = _decoded(rule, "observe", result, sdk.Observation)
            _require(
                rule, _rank(seen) == _PAYLOAD, f"{self.long_argv} is {seen.phase}, not running"
            )
            (result,) = self._call("stop", [self._context(attempt)])
            _decoded(rule, "stop", result, sdk.StopReply)
            self._stop_service(attempt)
            self._require_clean(rule, attempt, "after stop", provider_files=False)
            (result,) = self._call("release", [self._context(attempt)])
            _decoded(rule, "release", result, sdk.ReleaseReply)
            self._require_clean(rule, attempt, "after the stopped payload's release")

        try:
            self._rule(rule, stop)
        finally:
            for attempt in made:
                self._discard(attempt)

    # --- the runtime's stated minimum ----------------------------------------------

    def _minimum_rules(self) -> None:
        """The driver's statement is what admission refuses below, so a plan at exactly
        it must run; a provider that states nothing has nothing to prove here."""
        rule = "limits.minimum_runs"
        stated = self.minimums
        if stated is None or stated == sdk.MinimumLimits():
            self._rule(rule, lambda: None)
            return
        made: list[_Attempt] = []

        def runs() -> None:
            made.append(self._open_attempt(_at_minimum(self._new_plan(self.quick_argv), stated)))
            attempt = made[0]
            self._prepare(attempt)
            self._start(attempt)
            self._run_out(attempt)
            self._stop_service(attempt)
            (result,) = self._call("release", [self._context(attempt)])
            _decoded(rule, "release", result, sdk.ReleaseReply)

        try:
            self._rule(rule, runs)
        finally:
            for attempt in made:
                self._discard(attempt)

    # --- the host's part -----------------------------------------------------------

    def _new_plan(self, argv: Sequence[str]) -> planlib.Plan:
        payload = msgspec.structs.replace(self.plan.job.payload, argv=list(argv))
        job = msgspec.structs.replace(self.plan.job, payload=payload)
        return self._fresh(msgspec.structs.replace(self.plan, job=job))

    @staticmethod
    def _fresh(plan: planlib.Plan) -> planlib.Plan:
        """The plan as a new attempt of a new job."""
        return msgspec.structs.replace(
            plan, job_id=secrets.token_hex(16), attempt_id=secrets.token_hex(16)
        )

    def _new_attempt(self, argv: Sequence[str]) -> _Attempt:
        return self._open_attempt(self._new_plan(argv))

    def _open_attempt(self, plan: planlib.Plan) -> _Attempt:
        """The attempt's layout, created as before a prepare."""
        self.place.verify()
        paths = self.place.create(plan.attempt_id)
        attempt = _Attempt(plan, paths, service_name(self.config.installation_id, plan.attempt_id))
        self._open.append(attempt)
        return attempt

    def _probe_context(self, plan: planlib.Plan) -> sdk.Context:
        """Probe runs, as in the daemon, once the attempt's layout exists, with the
        verified storage binding (the layout is created once per plan)."""
        for attempt in self._open:
            if attempt.plan is plan:
                return self._context(attempt)
        return self._context(self._open_attempt(plan))

    def _storage(self, attempt: _Attempt) -> sdk.StorageBinding:
        """The storage binding as the daemon verifies it."""
        return self.place.storage_binding(attempt.plan.attempt_id, attempt.plan.job.limits)

    def _context(self, attempt: _Attempt, *, verified: bool = True) -> sdk.Context:
        slot, paths, plan = self.slot, attempt.paths, attempt.plan
        storage = self._storage(attempt) if verified else sdk.StorageBinding(path=paths.storage)
        return layout.provider_context(
            plan=plan,
            plan_digest=planlib.plan_digest(plan),
            slot=slot,
            paths=paths,
            service=attempt.service,
            cgroup=self.service.planned_supervisor_cgroup(attempt.service),
            backend=self.service.backend,
            storage=storage,
            prepared=attempt.prepared,
        )

    def _prepare_context(self, attempt: _Attempt, check: Callable[[], None]) -> sdk.PrepareContext:
        context = self._context(attempt)
        return sdk.PrepareContext(**msgspec.structs.asdict(context), check=check)

    def _spec(self, attempt: _Attempt, result: sdk.PrepareResult) -> ServiceSpec:
        return service_spec(
            attempt.service,
            result,
            uid=self.slot.uid,
            gid=self.slot.gid,
            paths=attempt.paths,
            limits=attempt.plan.job.limits,
            nofile=DEFAULT_NOFILE,
        )

    def _write_marker(self, attempt: _Attempt) -> None:
        control = self.place.open_part(attempt.plan.attempt_id, layout.CONTROL)
        try:
            gate.write_release_marker(control, layout.RELEASE_MARKER, group=self.slot.gid)
        finally:
            os.close(control)

    def _stop_service(self, attempt: _Attempt) -> None:
        if attempt.handle is not None:
            self.service.stop(attempt.handle)

    def _require_clean(
        self, rule: str, attempt: _Attempt, when: str, *, provider_files: bool = True
    ) -> None:
        if provider_files:
            left = sorted(os.listdir(attempt.paths.provider))
            _require(rule, not left, f"{when}: the provider directory still holds {left}")
        if attempt.handle is not None:
            members = self.service.members(attempt.handle)
            _require(rule, not members, f"{when}: the service still holds {sorted(members)}")
        _require(
            rule,
            self.service.account_idle(self.slot.uid),
            f"{when}: the slot account {self.slot.uid} still has processes",
        )

    def _discard(self, attempt: _Attempt) -> None:
        """Undo what the kit made for an attempt (service, layout), with a last provider
        release; a failure here is reported on stderr, never raised. An attempt whose
        provider call never returned gets no further call and keeps its layout (the
        call may still be working in it)."""
        if attempt not in self._open:
            return
        self._open.remove(attempt)
        attempt_id = attempt.plan.attempt_id
        try:
            if attempt.handle is not None:
                self.service.stop(attempt.handle)
                self.service.remove(attempt.handle)
                attempt.handle = None
            if attempt_id in self._hung:
                print(f"conformance: attempt {attempt_id} left in {attempt.paths.root}: a"
                      " provider call of it never returned", file=sys.stderr)  # fmt: skip
                return
            self._call("release", [self._context(attempt, verified=False)])
            self.place.remove(attempt_id)
        except (HostError, OSError, ProviderHung) as error:
            print(f"conformance: attempt {attempt_id} not cleaned up: {error}",
                  file=sys.stderr)  # fmt: skip


_PAYLOAD: Final = 2
_LIFECYCLE: Final = (
    "start.reply",
    "observe.phases",
    "observe.repeatable",
    "batch.observe_64",
    "stop.repeatable",
    "release.clean",
    "release.repeatable",
)
_OBSERVING: Final = ("observe.phases", "observe.repeatable", "batch.observe_64", "stop.repeatable")


def _rank(seen: sdk.Observation) -> int:
    """How far an observation is; a `ready` that carries the PID counts as `payload`."""
    if seen.phase == "ready" and seen.pid is not None:
        return _PAYLOAD
    return {"waiting": 0, "ready": 1, "payload": _PAYLOAD, "finished": 3}[seen.phase]


def _at_minimum(plan: planlib.Plan, stated: sdk.MinimumLimits) -> planlib.Plan:
    """`plan` with each limit the driver states a minimum for set to exactly it."""
    figures = {name: value for name in stated.__struct_fields__ if (value := getattr(stated, name))}
    limits = msgspec.structs.replace(plan.job.limits, **figures)
    return msgspec.structs.replace(plan, job=msgspec.structs.replace(plan.job, limits=limits))


def _with_runtime(plan: planlib.Plan, runtime: planlib.Runtime) -> planlib.Plan:
    return msgspec.structs.replace(plan, job=msgspec.structs.replace(plan.job, runtime=runtime))


# --- the command --------------------------------------------------------------------
