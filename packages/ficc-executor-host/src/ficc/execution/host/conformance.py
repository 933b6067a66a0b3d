"""The provider conformance kit's command and public path:
`python -m ficc.execution.host.conformance --config PATH --provider NAME ...`.

The kit itself (`Kit`, its rules and outcomes) is `cli/conformance`; this module parses
the command line, sets the kit up from the configuration, runs it and reports."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Iterator, Sequence
from typing import Final

import msgspec

from ficc.execution import plan as planlib
from ficc.execution.errors import ErrorCode
from ficc.execution.host.cli.conformance import (
    CHECK_REFUSAL,
    RULES,
    USAGE,
    Kit,
    Outcome,
    RuleFailed,
)
from ficc.execution.host.cli.versions import version_line
from ficc.execution.host.config.load import load_config
from ficc.execution.host.core import admission
from ficc.execution.host.core.codes import HostCode
from ficc.execution.host.core.errors import HostError
from ficc.execution.host.daemon.root import service_backend
from ficc.execution.host.providers.digest import compute_digest
from ficc.execution.host.providers.loader import load_provider


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m ficc.execution.host.cli.conformance",
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
    plan = _plan(args.plan)
    quick_argv = _argv(plan, "--quick-argv", args.quick_argv)
    long_argv = _argv(plan, "--long-argv", args.long_argv)
    if not 0 < args.timeout < 86400:
        raise HostError(USAGE, f"--timeout {args.timeout} is not between 0 and 86400 seconds")
    config = load_config(args.config)
    configured = [p for p in config.providers if p.id == args.provider]
    if not configured:
        raise HostError(
            HostCode.PROVIDER_UNKNOWN, f"{args.config} configures no provider {args.provider!r}"
        )
    provider = configured[0]
    path = args.provider_path
    pin = compute_digest(provider.id, path).digest if args.unpinned else provider.package_digest
    loaded = load_provider(provider.id, pin, provider.configuration, path)
    below = admission.below_minimum(plan, loaded.minimums)
    if below is not None:
        raise HostError(USAGE, f"--plan: {below.message} (the daemon would refuse it)")
    if plan.streamed_inputs:
        raise HostError(HostCode.PLAN_UNSUPPORTED, "the kit runs plans without streamed inputs")
    slots = [
        s
        for s in config.slots
        if (s.id == args.slot if args.slot else s.slot_class == plan.job.slot_class)
    ]
    if not slots:
        raise HostError(
            ErrorCode.SLOT_UNKNOWN, "no configured slot matches --slot or the plan's class"
        )
    service = service_backend(config.supervisor, bound_to_daemon=False)
    if not service.account_idle(slots[0].uid):
        raise HostError(
            HostCode.SLOT_BUSY,
            f"slot {slots[0].id}'s account has processes: stop what uses the slot",
        )
    return Kit(
        loaded.driver,
        config,
        slots[0],
        plan,
        service,
        quick_argv=quick_argv,
        long_argv=long_argv,
        timeout=args.timeout,
        minimums=loaded.minimums,
    )


_PLAN_FILE_MAX: Final = 16 * planlib.PLAN_MAX_BYTES
"""A plan file may be spaced out; its canonical form is bounded by the plan's rules."""


def _plan(name: str) -> planlib.Plan:
    """The --plan file, decoded and checked as the daemon checks a plan."""
    try:
        with open(name, "rb") as source:
            data = source.read(_PLAN_FILE_MAX + 1)
    except OSError as error:
        raise HostError(USAGE, f"--plan: cannot read {name}: {error.strerror}") from error
    if len(data) > _PLAN_FILE_MAX:
        raise HostError(USAGE, f"--plan: {name} is larger than {_PLAN_FILE_MAX} bytes")
    try:
        return planlib.decode_plan(data)
    except (msgspec.MsgspecError, ValueError) as error:
        raise HostError(USAGE, f"--plan: {name} is not a valid plan: {error}") from error


def _argv(plan: planlib.Plan, option: str, text: str) -> list[str]:
    """A payload argv, checked as the plan's own would be (JSON list of strings, the
    first an absolute path)."""
    try:
        argv = json.loads(text)
    except ValueError as error:
        raise HostError(USAGE, f"{option} {text!r} is not JSON: {error}") from error
    if not isinstance(argv, list) or not argv or not all(isinstance(a, str) for a in argv):
        raise HostError(USAGE, f"{option} {text!r} is not a JSON list of strings")
    try:
        payload = msgspec.structs.replace(plan.job.payload, argv=argv)
        job = msgspec.structs.replace(plan.job, payload=payload)
        planlib.decode_plan(msgspec.json.encode(msgspec.structs.replace(plan, job=job)))
    except (msgspec.MsgspecError, ValueError) as error:
        raise HostError(
            USAGE, f"{option} {text!r} is not a payload argv (the first an absolute path): {error}"
        ) from error
    return argv


def _report(outcomes: Sequence[Outcome], as_json: bool) -> Iterator[str]:
    if as_json:
        yield json.dumps([dataclasses.asdict(o) for o in outcomes], indent=2)
        return
    for outcome in outcomes:
        if outcome.passed:
            yield f"pass  {outcome.rule}"
        elif outcome.skipped:
            yield f"SKIP  {outcome.rule}: {outcome.message}"
        else:
            yield f"FAIL  {outcome.rule}: {outcome.message}"
    passed = sum(o.passed for o in outcomes)
    skipped = sum(o.skipped for o in outcomes)
    yield f"{passed} passed, {len(outcomes) - passed - skipped} failed, {skipped} skipped"


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


__all__ = ["CHECK_REFUSAL", "RULES", "USAGE", "Kit", "Outcome", "RuleFailed", "main"]

if __name__ == "__main__":
    sys.exit(main())
