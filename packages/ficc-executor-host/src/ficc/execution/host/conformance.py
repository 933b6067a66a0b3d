"""The provider conformance kit: runs an installed provider through the contract
without the daemon, and names every rule it breaks.

    python -m ficc.execution.host.conformance --config FILE --provider ID \\
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
(`RULES`); a run prints one line per rule, `pass` or `FAIL` with what was wrong, and
exits 0 when every rule passed, 1 when one failed, 2 when it could not run.

Needs root, like the daemon, and a slot that no daemon is using.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import hashlib
import json
import os
import secrets
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Final, TypeVar

import msgspec

from ficc.execution import plan as planlib
from ficc.execution.host import gate, layout, sdk, slotfs
from ficc.execution.host.commands import version_line
from ficc.execution.host.config import Config, Slot, load_config, open_image_parent
from ficc.execution.host.daemon import service_backend
from ficc.execution.host.errors import HostError
from ficc.execution.host.expectation import (
    DEFAULT_NOFILE,
    check_device_opens,
    check_prepare_result,
    device_rules,
)
from ficc.execution.host.layout import AttemptPaths, service_name
from ficc.execution.host.providers.digest import compute_digest
from ficc.execution.host.providers.driver import RowResult, call
from ficc.execution.host.providers.loader import load_provider
from ficc.execution.host.service.interface import ServiceHandle, ServiceSpec, SystemService

__all__ = ["CHECK_REFUSAL", "RULES", "Kit", "Outcome", "RuleFailed", "main"]

RULES: Final = {
    "probe.accepts": "probe accepts the given plan (`ok` true)",
    "probe.refuses_unknown_image": "probe refuses an image it does not offer, with a code",
    "probe.refuses_unknown_isolation": "probe refuses an isolation it does not offer, with a code",
    "probe.refuses_unknown_network": "probe refuses a network it does not offer, with a code",
    "batch.probe_64": "a 64-row probe answers each row for itself, in order",
    "prepare.check_refusal": "when check() refuses midway, prepare stops, refuses the row with"
    " check()'s code and leaves the provider directory empty and the slot account idle",
    "prepare.calls_check": "prepare calls check() before it prepares",
    "prepare.result": "prepare returns a prepare result the host accepts for the plan",
    "start.reply": "start answers `started` for an argv running in the host's service",
    "observe.phases": "observe goes waiting -> ready -> payload (the barrier's PID, in the"
    " service) -> finished with the payload's exit code, never backwards",
    "observe.repeatable": "observing a finished attempt again gives the same reply",
    "batch.observe_64": "a 64-row observe gives every row the one-row reply",
    "stop.repeatable": "stop can be repeated",
    "release.clean": "release leaves the provider directory empty and the slot account idle",
    "release.repeatable": "release can be repeated and stays clean",
    "stop.running": "stop of a running payload: the service is then empty, the account idle,"
    " and its release leaves the provider directory empty",
}
"""Every rule the kit checks, by its stable name."""

CHECK_REFUSAL: Final = "conformance_check"
"""The code of the kit's check() refusal, which prepare must pass through unchanged."""
MAX_CHECK_CALLS: Final = 32
"""Refusing check() at call 1, 2, ... stops here (a prepare calling it more is fine)."""
SERVICE_ENVIRONMENT: Final = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8"}

_S = TypeVar("_S", bound=msgspec.Struct)


class RuleFailed(Exception):
    """A broken rule: its name and what was wrong."""

    def __init__(self, rule: str, message: str) -> None:
        super().__init__(f"{rule}: {message}")
        self.rule = rule
        self.message = message


@dataclasses.dataclass(frozen=True)
class Outcome:
    """One rule's result; `message` says what was wrong (empty when it passed)."""

    rule: str
    passed: bool
    message: str = ""


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
    ) -> None:
        self.driver = driver
        self.config = config
        self.slot = slot
        self.plan = plan
        self.service = service
        self.quick_argv = list(quick_argv)
        self.long_argv = list(long_argv)
        self.timeout = timeout
        self.place = layout.Layout(slot)
        self.outcomes: list[Outcome] = []
        self._open: list[_Attempt] = []

    # --- running -------------------------------------------------------------------

    def run(self) -> list[Outcome]:
        """Every rule in order; a broken rule is recorded and the run goes on where it
        can (a rule that needs what a broken one should have made is not run)."""
        try:
            self._probe_rules()
            self._prepare_rules()
            self._lifecycle_rules()
            self._stop_rules()
        finally:
            for attempt in list(self._open):
                self._discard(attempt)
        return self.outcomes

    def _rule(self, name: str, check: Callable[[], None]) -> bool:
        try:
            check()
        except RuleFailed as failed:
            self.outcomes.append(Outcome(failed.rule, False, failed.message))
            return False
        except Exception as error:  # the provider broke the host's part: this rule fails
            self.outcomes.append(Outcome(name, False, f"{type(error).__name__}: {error}"))
            return False
        self.outcomes.append(Outcome(name, True))
        return True

    # --- probe ---------------------------------------------------------------------

    def _probe_rules(self) -> None:
        good = self._new_plan(self.quick_argv)
        runtime = good.job.runtime
        unknown_image = "sha256:" + hashlib.sha256(secrets.token_bytes(16)).hexdigest()
        variants = {
            "probe.refuses_unknown_image": {"image_digest": unknown_image},
            "probe.refuses_unknown_isolation": {"isolation": "conformance-unknown"},
            "probe.refuses_unknown_network": {"network": "conformance-unknown"},
        }

        def accepts() -> None:
            (result,) = call(self.driver, "probe", [self._probe_context(good)])
            reply = _decoded("probe.accepts", "probe", result, sdk.ProbeReply)
            _require("probe.accepts", reply.ok, f"probe answered ok false: {result.reply!r}")

        self._rule("probe.accepts", accepts)
        for rule, change in variants.items():
            bad = _with_runtime(good, msgspec.structs.replace(runtime, **change))
            self._rule(rule, functools.partial(self._refused, rule, bad))

        def batch() -> None:
            bad = _with_runtime(good, msgspec.structs.replace(runtime, image_digest=unknown_image))
            plans = [good if i % 2 == 0 else bad for i in range(sdk.MAX_BATCH)]
            results = call(self.driver, "probe", [self._probe_context(p) for p in plans])
            for i, result in enumerate(results):
                if i % 2 == 0:
                    _decoded("batch.probe_64", "probe", result, sdk.ProbeReply)
                else:
                    _require("batch.probe_64", not result.ok, f"row {i} (unknown image) passed")

        self._rule("batch.probe_64", batch)

    def _refused(self, rule: str, plan: planlib.Plan) -> None:
        (result,) = call(self.driver, "probe", [self._probe_context(plan)])
        _require(rule, result.reply is None, f"probe accepted it: {result.reply!r}")
        _require(
            rule,
            result.code not in ("provider_error", "provider_malformed"),
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
        (result,) = call(self.driver, "prepare", [context])
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
        attempt = self._new_attempt(self.quick_argv)
        if not self._rule("prepare.result", lambda: self._prepare(attempt)):
            return
        if not self._rule("start.reply", lambda: self._start(attempt)):
            return
        finished: list[sdk.Reply] = []
        if not self._rule("observe.phases", lambda: finished.append(self._run_out(attempt))):
            return

        def again() -> None:
            for _ in range(2):
                (result,) = call(self.driver, "observe", [self._context(attempt)])
                _require(
                    "observe.repeatable",
                    result.reply == finished[0],
                    f"observed {result.reply!r} ({result.code}) after {finished[0]!r}",
                )

        self._rule("observe.repeatable", again)

        def batch() -> None:
            contexts = [self._context(attempt)] * sdk.MAX_BATCH
            for i, result in enumerate(call(self.driver, "observe", contexts)):
                _require(
                    "batch.observe_64",
                    result.reply == finished[0],
                    f"row {i}: {result.reply!r} ({result.code}), not {finished[0]!r}",
                )

        self._rule("batch.observe_64", batch)

        def stops() -> None:
            for _ in range(2):
                (result,) = call(self.driver, "stop", [self._context(attempt)])
                _decoded("stop.repeatable", "stop", result, sdk.StopReply)

        self._rule("stop.repeatable", stops)
        self._releases(attempt)

    def _releases(self, attempt: _Attempt) -> None:
        self._stop_service(attempt)

        def release(rule: str) -> None:
            (result,) = call(self.driver, "release", [self._context(attempt)])
            _decoded(rule, "release", result, sdk.ReleaseReply)
            self._require_clean(rule, attempt, "after release")

        if self._rule("release.clean", lambda: release("release.clean")):
            self._rule("release.repeatable", lambda: release("release.repeatable"))
        self._discard(attempt)

    def _prepare(self, attempt: _Attempt) -> None:
        rule = "prepare.result"
        context = self._prepare_context(attempt, lambda: None)
        (result,) = call(self.driver, "prepare", [context])
        prepared = _decoded(rule, "prepare", result, sdk.PrepareResult)
        try:
            check_prepare_result(prepared, attempt.plan)
        except HostError as error:
            raise RuleFailed(rule, error.message) from error
        attempt.prepared = prepared

    def _start(self, attempt: _Attempt) -> None:
        assert attempt.prepared is not None
        attempt.handle = self.service.create(self._spec(attempt, attempt.prepared))
        (result,) = call(self.driver, "start", [self._context(attempt)])
        _decoded("start.reply", "start", result, sdk.StartReply)

    def _run_out(self, attempt: _Attempt) -> sdk.Reply:
        """Observe to the payload PID, release the barrier, observe to the end."""
        rule = "observe.phases"
        self._await_payload(attempt)
        deadline = time.monotonic() + self.timeout
        while True:
            (result,) = call(self.driver, "observe", [self._context(attempt)])
            seen = _decoded(rule, "observe", result, sdk.Observation)
            _require(rule, seen.phase in ("payload", "finished"), f"{seen.phase} after payload")
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
        """waiting* -> ready? -> payload: checks the order, the device results and the
        PID, then writes the release marker as the host does."""
        rule = "observe.phases"
        assert attempt.handle is not None
        assert attempt.prepared is not None
        deadline = time.monotonic() + self.timeout
        order = {"waiting": 0, "ready": 1, "payload": 2}
        furthest = 0
        devices: dict[str, bool] | None = None
        while True:
            (result,) = call(self.driver, "observe", [self._context(attempt)])
            seen = _decoded(rule, "observe", result, sdk.Observation)
            _require(rule, seen.phase != "finished", "finished before the barrier was released")
            _require(rule, order[seen.phase] >= furthest, f"{seen.phase} after a later phase")
            furthest = order[seen.phase]
            if seen.devices is not None:
                devices = {d.path: d.opened for d in seen.devices}
            if seen.phase == "payload" and seen.pid is not None:
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
        attempt = self._new_attempt(self.long_argv)
        rule = "stop.running"

        def stop() -> None:
            self._prepare(attempt)
            self._start(attempt)
            self._await_payload(attempt)
            (result,) = call(self.driver, "observe", [self._context(attempt)])
            seen = _decoded(rule, "observe", result, sdk.Observation)
            _require(
                rule, seen.phase == "payload", f"{self.long_argv} is {seen.phase}, not running"
            )
            (result,) = call(self.driver, "stop", [self._context(attempt)])
            _decoded(rule, "stop", result, sdk.StopReply)
            self._stop_service(attempt)
            self._require_clean(rule, attempt, "after stop", provider_files=False)
            (result,) = call(self.driver, "release", [self._context(attempt)])
            _decoded(rule, "release", result, sdk.ReleaseReply)
            self._require_clean(rule, attempt, "after the stopped payload's release")

        self._rule(rule, stop)
        self._discard(attempt)

    # --- the host's part -----------------------------------------------------------

    def _new_plan(self, argv: Sequence[str]) -> planlib.Plan:
        payload = msgspec.structs.replace(self.plan.job.payload, argv=list(argv))
        job = msgspec.structs.replace(self.plan.job, payload=payload)
        return msgspec.structs.replace(
            self.plan, job_id=secrets.token_hex(16), attempt_id=secrets.token_hex(16), job=job
        )

    def _new_attempt(self, argv: Sequence[str]) -> _Attempt:
        plan = self._new_plan(argv)
        slotfs.verify(self.slot, open_image_parent)
        paths = self.place.create(plan.attempt_id)
        attempt = _Attempt(plan, paths, service_name(self.config.installation_id, plan.attempt_id))
        self._open.append(attempt)
        return attempt

    def _probe_context(self, plan: planlib.Plan) -> sdk.Context:
        """Probe needs no layout: the paths are where the attempt's would be."""
        paths = self.place.paths(plan.attempt_id)
        name = service_name(self.config.installation_id, plan.attempt_id)
        return self._context(_Attempt(plan, paths, name), verified=False)

    def _context(self, attempt: _Attempt, *, verified: bool = True) -> sdk.Context:
        slot, paths, plan = self.slot, attempt.paths, attempt.plan
        storage = sdk.StorageBinding(path=paths.storage)
        if verified:
            st = os.stat(paths.storage, follow_symlinks=False)
            limits = plan.job.limits
            storage = sdk.StorageBinding(
                paths.storage, st.st_dev, st.st_ino, limits.storage_bytes, limits.storage_inodes
            )
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
        limits = attempt.plan.job.limits
        return msgspec.convert(
            {
                "name": attempt.service,
                "argv": result.argv,
                "uid": self.slot.uid,
                "gid": self.slot.gid,
                "cwd": attempt.paths.storage,
                "environment": SERVICE_ENVIRONMENT,
                "limits": {
                    "cpu_millis": limits.cpu_millis,
                    "memory_bytes": limits.memory_bytes,
                    "swap_bytes": limits.swap_bytes,
                    "processes": limits.processes,
                    "nofile": DEFAULT_NOFILE,
                },
                "devices": msgspec.to_builtins(device_rules(result)),
                "stdout": attempt.paths.stdout,
                "stderr": attempt.paths.stderr,
            },
            ServiceSpec,
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
        release; a failure here is reported on stderr, never raised."""
        if attempt not in self._open:
            return
        self._open.remove(attempt)
        try:
            if attempt.handle is not None:
                self.service.stop(attempt.handle)
                self.service.remove(attempt.handle)
                attempt.handle = None
            call(self.driver, "release", [self._context(attempt, verified=False)])
            self.place.remove(attempt.plan.attempt_id)
        except (HostError, OSError) as error:
            print(f"conformance: attempt {attempt.plan.attempt_id} not cleaned up: {error}",
                  file=sys.stderr)  # fmt: skip


def _with_runtime(plan: planlib.Plan, runtime: planlib.Runtime) -> planlib.Plan:
    return msgspec.structs.replace(plan, job=msgspec.structs.replace(plan.job, runtime=runtime))


# --- the command --------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m ficc.execution.host.conformance",
        description="Run an installed provider through the provider contract, without "
        "the daemon (docs/providers.md).",
    )
    parser.add_argument("--config", required=True, help="the daemon's configuration file")
    parser.add_argument("--provider", required=True, help="the provider ID to test")
    parser.add_argument("--plan", required=True, help="a JSON plan the provider can run")
    parser.add_argument(
        "--provider-path",
        action="append",
        help="a site directory to find the provider in (repeatable; default: sys.path)",
    )
    parser.add_argument("--slot", help="the configured slot to use (default: the first of "
                        "the plan's slot class)")  # fmt: skip
    parser.add_argument(
        "--unpinned",
        action="store_true",
        help="pin whatever is installed instead of the configured package_digest "
        "(a development install; never on a host)",
    )
    parser.add_argument("--quick-argv", default='["/bin/true"]', help="JSON argv exiting 0")
    parser.add_argument(
        "--long-argv", default='["/bin/sleep", "600"]', help="JSON argv running until stopped"
    )
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds per wait")
    parser.add_argument("--json", action="store_true", help="print the outcomes as JSON")
    parser.add_argument("--version", action="version", version=version_line())
    return parser


def _setup(args: argparse.Namespace) -> Kit:
    config = load_config(args.config)
    configured = [p for p in config.providers if p.id == args.provider]
    if not configured:
        raise HostError(
            "provider_unknown", f"{args.config} configures no provider {args.provider!r}"
        )
    provider = configured[0]
    path = args.provider_path
    pin = compute_digest(provider.id, path).digest if args.unpinned else provider.package_digest
    loaded = load_provider(provider.id, pin, provider.configuration, path)
    with open(args.plan, "rb") as source:
        plan = planlib.decode_plan(source.read())
    if plan.streamed_inputs:
        raise HostError("plan_unsupported", "the kit runs plans without streamed inputs")
    slots = [
        s
        for s in config.slots
        if (s.id == args.slot if args.slot else s.slot_class == plan.job.slot_class)
    ]
    if not slots:
        raise HostError("slot_unknown", "no configured slot matches --slot or the plan's class")
    service = service_backend(config.supervisor)
    if not service.account_idle(slots[0].uid):
        raise HostError(
            "slot_busy", f"slot {slots[0].id}'s account has processes: stop what uses the slot"
        )
    return Kit(
        loaded.driver,
        config,
        slots[0],
        plan,
        service,
        quick_argv=_argv(args.quick_argv),
        long_argv=_argv(args.long_argv),
        timeout=args.timeout,
    )


def _argv(text: str) -> list[str]:
    argv = json.loads(text)
    if not isinstance(argv, list) or not argv or not all(isinstance(a, str) for a in argv):
        raise HostError("conformance_usage", f"{text!r} is not a JSON list of strings")
    return argv


def _report(outcomes: Sequence[Outcome], as_json: bool) -> Iterator[str]:
    if as_json:
        yield json.dumps([dataclasses.asdict(o) for o in outcomes], indent=2)
        return
    for outcome in outcomes:
        if outcome.passed:
            yield f"pass  {outcome.rule}"
        else:
            yield f"FAIL  {outcome.rule}: {outcome.message}"
    failed = sum(not o.passed for o in outcomes)
    yield f"{len(outcomes) - failed} passed, {failed} failed"


def main(argv: Sequence[str] | None = None) -> int:
    """The command; see the module docstring."""
    args = _parser().parse_args(argv)
    try:
        kit = _setup(args)
        outcomes = kit.run()
    except HostError as error:
        print(f"conformance: cannot run: {error.code}: {error.message}", file=sys.stderr)
        return 2
    for line in _report(outcomes, args.json):
        print(line)
    return 0 if all(o.passed for o in outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
