"""The provider conformance kit, run as an integrator runs it: the command, against a
provider installed in a root-owned prefix and pinned, on real slot filesystems and
accounts, with the host's real service backend (no daemon).

It passes on the test provider and on the Podman provider, and on the test provider
relying on what the daemon guarantees (a verified storage binding in probe, a `ready`
that carries the PID); it fails on the test provider configured with a deliberate
defect, naming the broken rule, with one outcome per rule; it stops a run whose
provider call never returns; it refuses bad arguments with exit 2.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest

from ficc.execution.host.cli.conformance import RULES
from ficc.execution.plan import Plan
from ficc_testkit.digests import fake
from ficc_testkit.host import IMAGE, PROJECT, Layout
from ficc_testkit.plans import make_plan, new_id, with_environment
from ficc_testkit.podman import ISOLATION, SLOT_CLASS
from ficc_testkit.units import MIB
from ficc_testkit.wheels import InstalledProvider
from podman_support import NEEDS_PODMAN, podman_layout

TEST_OFFER = {"images": [IMAGE], "isolations": ["process"], "networks": ["none"]}


def write_root_file(path: Path, data: bytes) -> Path:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as out:
        out.write(data)
    return path


def run_kit(
    layout: Layout,
    provider_id: str,
    site: Path,
    plan: Plan,
    configuration: dict[str, Any],
    *extra: str,
    pin: str | None = None,
) -> tuple[int, dict[str, dict[str, Any]], str]:
    """The kit's command on a copy of `layout`'s configuration whose provider has
    `configuration` (and `pin`, if given); (exit status, outcomes by rule, stderr)."""
    document = dict(layout.document)
    (provider,) = [p for p in document["providers"] if p["id"] == provider_id]
    pinned = {"package_digest": pin} if pin else {}
    document["providers"] = [{**provider, **pinned, "configuration": configuration}]
    name = new_id()
    config = write_root_file(layout.base / f"kit-{name}.json", json.dumps(document).encode())
    plan_file = write_root_file(layout.base / f"plan-{name}.json", msgspec.json.encode(plan))
    command = [
        sys.executable, "-m", "ficc.execution.host.conformance", "--config", str(config),
        "--provider", provider_id, "--provider-path", str(site), "--plan", str(plan_file),
        "--json", "--timeout", "60", *extra,
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=900, check=False)
    listed = json.loads(done.stdout) if done.stdout else []
    rules = [o["rule"] for o in listed]
    assert len(rules) == len(set(rules)), f"a rule is listed twice: {rules}"
    return done.returncode, {o["rule"]: o for o in listed}, done.stderr


def kit_plan(layout: Layout, provider: InstalledProvider) -> Plan:
    doc = layout.document
    return make_plan(
        deployment_id=doc["deployment_id"], node_id=doc["node_id"], project_id=PROJECT,
        name="kit-job", slot_class="small", package_digest=provider.digest,
        image_digest=IMAGE, isolation="process", cpu_millis=500, memory_bytes=64 * MIB,
        processes=32, storage_bytes=32 * MIB,
    )  # fmt: skip


Run = Callable[[dict[str, Any]], tuple[int, dict[str, dict[str, Any]], str]]


@pytest.fixture
def kit(layout: Layout, provider: InstalledProvider) -> Run:
    """The kit on the test provider with a given configuration."""

    def run(configuration: dict[str, Any]) -> tuple[int, dict[str, dict[str, Any]], str]:
        plan = kit_plan(layout, provider)
        return run_kit(layout, "test", provider.site, plan, configuration)

    return run


def test_the_test_provider_passes_every_rule(kit: Run) -> None:
    status, outcomes, stderr = kit({"runtime": "service", **TEST_OFFER})
    failed = {rule: o["message"] for rule, o in outcomes.items() if not o["passed"]}
    assert (status, failed) == (0, {}), stderr
    assert set(outcomes) == set(RULES)


@pytest.mark.parametrize(
    ("defect", "rule", "words"),
    [
        ("release_not_idempotent", "release.repeatable", "not_prepared"),
        ("prepare_ignores_check", "prepare.check_refusal", "returned a result"),
    ],
)
def test_a_broken_provider_fails_the_rule_it_breaks(
    kit: Run, defect: str, rule: str, words: str
) -> None:
    status, outcomes, stderr = kit({"runtime": "service", **TEST_OFFER, "defects": [defect]})
    assert status == 1, stderr
    failed = {r: o["message"] for r, o in outcomes.items() if not o["passed"]}
    assert set(failed) == {rule}, failed
    assert words in failed[rule]


def test_a_wrong_pin_refuses_to_run_unless_the_run_is_unpinned(
    layout: Layout, provider: InstalledProvider
) -> None:
    """The kit loads the provider exactly as the daemon does; `--unpinned` is the
    development escape hatch, which still verifies the installed files."""
    plan = kit_plan(layout, provider)
    configuration = {"runtime": "service", **TEST_OFFER}
    wrong = fake("0")
    status, outcomes, stderr = run_kit(
        layout, "test", provider.site, plan, configuration, pin=wrong
    )
    assert (status, outcomes) == (2, {})
    assert "cannot run: provider_digest_mismatch" in stderr
    status, outcomes, stderr = run_kit(
        layout, "test", provider.site, plan, configuration, "--unpinned", pin=wrong
    )
    assert status == 0, stderr
    assert all(o["passed"] for o in outcomes.values())


def test_a_provider_that_refuses_nothing_fails_the_probe_rules(kit: Run) -> None:
    status, outcomes, _ = kit({"runtime": "service"})
    assert status == 1
    failed = {r for r, o in outcomes.items() if not o["passed"]}
    assert failed == {
        "probe.refuses_unknown_image",
        "probe.refuses_unknown_isolation",
        "probe.refuses_unknown_network",
        "batch.probe_64",
    }
    assert "probe accepted it" in outcomes["probe.refuses_unknown_image"]["message"]


def test_a_stated_minimum_runs_and_a_plan_below_it_cannot_run_the_kit(
    layout: Layout, provider: InstalledProvider
) -> None:
    """`limits.minimum_runs` runs the quick payload at exactly the stated limits (the
    shell barrier and `/bin/true` need two processes); a `--plan` below them is refused
    before anything runs, as the daemon would refuse it."""
    stated = {"memory_bytes": 16 * MIB, "processes": 2}
    configured = {"runtime": "service", **TEST_OFFER, "minimum_limits": stated}
    plan = kit_plan(layout, provider)
    status, outcomes, stderr = run_kit(layout, "test", provider.site, plan, configured)
    failed = {rule: o["message"] for rule, o in outcomes.items() if not o["passed"]}
    assert (status, failed) == (0, {}), stderr
    below = {"runtime": "service", **TEST_OFFER, "minimum_limits": {"processes": 33}}
    status, outcomes, stderr = run_kit(layout, "test", provider.site, plan, below)
    assert (status, outcomes) == (2, {}), stderr
    assert stderr.startswith(
        "conformance: cannot run: conformance_usage: --plan: processes 32 is below the 33"
        " the test runtime needs"
    ), stderr


def test_a_minimum_the_runtime_cannot_run_at_fails_its_rule(
    layout: Layout, provider: InstalledProvider
) -> None:
    """One process is too few for the shell barrier to start the payload: the stated
    minimum is a lie, and the rule says so under its own name."""
    configured = {"runtime": "service", **TEST_OFFER, "minimum_limits": {"processes": 1}}
    status, outcomes, stderr = run_kit(
        layout, "test", provider.site, kit_plan(layout, provider), configured
    )
    assert status == 1, stderr
    failed = {rule: o["message"] for rule, o in outcomes.items() if not o["passed"]}
    assert set(failed) == {"limits.minimum_runs"}, failed


@NEEDS_PODMAN
def test_the_podman_provider_passes_every_rule() -> None:
    with podman_layout() as made:
        doc = made.layout.document
        slot = doc["slots"][0]
        plan = make_plan(
            deployment_id=doc["deployment_id"], node_id=doc["node_id"], project_id=PROJECT,
            name="kit-job", slot_class=SLOT_CLASS, provider="podman",
            package_digest=made.provider.digest, image_digest=made.image["image_id"],
            isolation=ISOLATION, processes=128, storage_bytes=slot["storage_bytes"] // 2,
            storage_inodes=slot["storage_inodes"] // 2,
        )  # fmt: skip
        (provider,) = doc["providers"]
        status, outcomes, stderr = run_kit(
            made.layout, "podman", made.provider.site, plan, provider["configuration"]
        )
    failed = {rule: o["message"] for rule, o in outcomes.items() if not o["passed"]}
    assert (status, failed) == (0, {}), stderr
    assert set(outcomes) == set(RULES)


@pytest.mark.parametrize(
    ("configuration", "environment"),
    [
        ({"verified_storage": True}, {}),
        ({}, {"FICC_TEST_PROVIDER_READY_PID": "1"}),
    ],
    ids=["probe-needs-a-verified-binding", "ready-carries-the-pid"],
)
def test_a_provider_relying_on_what_the_daemon_guarantees_passes(
    layout: Layout,
    provider: InstalledProvider,
    configuration: dict[str, Any],
    environment: dict[str, str],
) -> None:
    """The kit gives probe the verified storage binding the daemon gives it, and takes
    a `ready` observation carrying the PID as `payload` too, as the daemon does."""
    plan = with_environment(kit_plan(layout, provider), **environment)
    configured = {"runtime": "service", **TEST_OFFER, **configuration}
    status, outcomes, stderr = run_kit(layout, "test", provider.site, plan, configured)
    failed = {rule: o["message"] for rule, o in outcomes.items() if not o["passed"]}
    assert (status, failed) == (0, {}), stderr
    assert set(outcomes) == set(RULES)


def test_a_rule_failing_early_still_gives_every_rule_one_outcome(
    layout: Layout, provider: InstalledProvider
) -> None:
    """start.reply fails (a malformed start): the rules that need a started payload are
    skipped with why, the release rules still run, and stop.running fails under its own
    name, naming the rule it tripped over."""
    plan = with_environment(kit_plan(layout, provider), FICC_TEST_PROVIDER_MALFORMED="start")
    configured = {"runtime": "service", **TEST_OFFER}
    status, outcomes, stderr = run_kit(layout, "test", provider.site, plan, configured)
    assert status == 1, stderr
    assert set(outcomes) == set(RULES)
    skipped = {rule for rule, o in outcomes.items() if o["skipped"]}
    assert skipped == {
        "observe.phases",
        "observe.repeatable",
        "batch.observe_64",
        "stop.repeatable",
    }
    assert {outcomes[r]["message"] for r in skipped} == {"not run: start.reply failed"}
    failed = {rule: o["message"] for rule, o in outcomes.items() if not o["passed"]}
    assert set(failed) - skipped == {"start.reply", "stop.running"}, failed
    assert failed["stop.running"].startswith("start.reply: start replied ")


@pytest.mark.parametrize(
    ("method", "rule"), [("probe", "probe.accepts"), ("observe", "observe.phases")]
)
def test_a_provider_call_that_never_returns_fails_its_rule_and_stops_the_run(
    layout: Layout, provider: InstalledProvider, method: str, rule: str
) -> None:
    """The held call (it waits for a file the test never creates) outlasts --timeout:
    its rule fails, every later rule is skipped, and the kit exits with what it has."""
    plan = with_environment(kit_plan(layout, provider), FICC_TEST_PROVIDER_HANG=f"{method}:hold")
    configured = {"runtime": "service", **TEST_OFFER}
    status, outcomes, stderr = run_kit(
        layout, "test", provider.site, plan, configured, "--timeout", "5"
    )
    assert status == 1, stderr
    assert set(outcomes) == set(RULES)
    order = list(RULES)
    at = order.index(rule)
    assert all(outcomes[r]["passed"] for r in order[:at]), outcomes
    assert outcomes[rule] == {
        "rule": rule,
        "passed": False,
        "skipped": False,
        "message": f"{method} did not return within 5 s",
    }
    for later in order[at + 1 :]:
        assert outcomes[later]["skipped"], outcomes[later]
        assert (
            outcomes[later]["message"]
            == f"not run: the run stopped when {method} did not return within 5 s"
        )
    assert "a provider call of it never returned" in stderr


@pytest.mark.parametrize(
    ("option", "value", "words"),
    [
        ("--plan", "/nonexistent.json", "cannot read /nonexistent.json"),
        ("--plan", "<a plan missing fields>", "is not a valid plan"),
        ("--quick-argv", "[/bin/true]", "is not JSON"),
        ("--quick-argv", '["true"]', "absolute path"),
        ("--long-argv", "[]", "not a JSON list of strings"),
        ("--timeout", "0", "--timeout 0.0 is not between"),
    ],
)
def test_bad_arguments_cannot_run_and_say_why(
    layout: Layout, provider: InstalledProvider, option: str, value: str, words: str
) -> None:
    """Exit 2 (`conformance_usage`), never a traceback and never exit 1 (a rule failed)."""
    if value.startswith("<"):
        value = str(write_root_file(layout.base / f"bad-{new_id()}.json", b'{"version": 1}'))
    plan = kit_plan(layout, provider)
    configured = {"runtime": "service", **TEST_OFFER}
    status, outcomes, stderr = run_kit(
        layout, "test", provider.site, plan, configured, option, value
    )
    assert (status, outcomes) == (2, {}), stderr
    assert stderr.startswith("conformance: cannot run: conformance_usage: "), stderr
    assert words in stderr
    assert "Traceback" not in stderr
