"""An in-place upgrade from the previous release to the current build (`nox -s upgrade`).

`nox -s upgrade` builds the previous release's wheels (the newest release tag, or the
baseline commit named in the noxfile while there is none) and the current ones, and
runs this file with:

- FICC_UPGRADE_HOST_PYTHON: a virtualenv's python holding the previous release of
  ficc-protocol and ficc-executor-host (the "installed host");
- FICC_UPGRADE_NEW_WHEELS: a directory with the current build's wheels and the wheels
  they depend on (the administrator's wheelhouse);
- FICC_UPGRADE_CONTROLLER_PYTHON: a virtualenv's python holding only the previous
  ficc-protocol (a controller that has not upgraded);
- FICC_UPGRADE_OLD_PROVIDER: the previous release's test provider source (it speaks
  the previous provider contract; this build's speaks the typed SDK).

The scenario is what an administrator does: the old daemon runs with a ledger that
holds finished and active attempts; it is stopped; the same prefix is upgraded with
pip, and the provider with it (the contract changed); the new daemon starts on the
same configuration and ledger. Then: the ledger
opens, bindings and records are unchanged, active attempts follow the restart rule,
the provider pin is verified again by the new code, and the old controller runs a new
job through the new host.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ficc.execution.plan import encode_plan
from ficc_testkit.daemons import DaemonProcess
from ficc_testkit.driver import attempt, rows
from ficc_testkit.host import Daemon, Layout, ensure_accounts
from ficc_testkit.slots import private_directory
from ficc_testkit.wheels import InstalledProvider, build_wheel, install_provider

ROOT = Path(__file__).resolve().parents[2]
PROVIDER_SOURCE = ROOT / "tests-integration" / "providers" / "ficc-test-provider"

HOST_PYTHON = os.environ.get("FICC_UPGRADE_HOST_PYTHON", "")
NEW_WHEELS = Path(os.environ.get("FICC_UPGRADE_NEW_WHEELS", "/nonexistent"))
CONTROLLER_PYTHON = os.environ.get("FICC_UPGRADE_CONTROLLER_PYTHON", "")
OLD_PROVIDER = os.environ.get("FICC_UPGRADE_OLD_PROVIDER", "")
CONTROLLER = Path(__file__).resolve().parent / "controller.py"

if os.geteuid() != 0 or not HOST_PYTHON or not CONTROLLER_PYTHON or not OLD_PROVIDER:
    pytest.skip(
        "run through `nox -s upgrade` (as root): it builds the previous release and "
        "the two virtualenvs this test upgrades and drives",
        allow_module_level=True,
    )


def host(*argv: str) -> str:
    """A command of the installed host (`python -m ficc.execution ...`), its stdout."""
    result = subprocess.run(
        [HOST_PYTHON, "-m", "ficc.execution", *argv],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


NEW_SLOT_KEYS = frozenset({"filesystem_uuid"})
"""Slot keys this release added: the previous release refuses them."""


def upgrade_in_place() -> None:
    """What the administrator runs: pip of the installed prefix, the new wheels, with
    what they depend on from the same directory (a release may add a dependency)."""
    wheels = [str(w) for w in sorted(NEW_WHEELS.glob("ficc_*.whl"))]
    subprocess.run(
        [HOST_PYTHON, "-m", "pip", "install", "-q", "--disable-pip-version-check",
         "--no-index", "--find-links", str(NEW_WHEELS), "--upgrade", "--force-reinstall",
         *wheels],
        check=True, umask=0o022, timeout=600,
    )  # fmt: skip


def upgrade_provider(base: Path) -> None:
    """The provider's upgrade: this build's test provider replaces the previous one in
    the same prefix (a new pin follows)."""
    wheel = build_wheel(PROVIDER_SOURCE, base / "new-wheel")
    shutil.rmtree(base / "provider")
    install_provider(wheel, base / "provider")


def write_config(layout: Layout, digest: str, *, previous: bool = False) -> None:
    """The configuration with this pin; `previous`: as the previous release reads it,
    without the keys it does not know (it refuses unknown keys)."""
    document = dict(layout.document)
    document["providers"] = [{**document["providers"][0], "package_digest": digest}]
    if previous:
        document["slots"] = [
            {k: v for k, v in slot.items() if k not in NEW_SLOT_KEYS} for slot in document["slots"]
        ]
    layout.rewrite(document)


def start(daemon: Daemon) -> None:
    daemon.process = DaemonProcess.of(daemon.layout, daemon.provider, python=HOST_PYTHON)
    daemon.start()


@pytest.fixture
def world() -> Iterator[tuple[Daemon, Path]]:
    accounts = ensure_accounts()
    base = private_directory("/run", "ficc-upgrade-")
    daemon: Daemon | None = None
    layout: Layout | None = None
    try:
        wheel = build_wheel(Path(OLD_PROVIDER), base / "wheel")
        current = install_provider(wheel, base / "provider")
        old_pin = host("provider-digest", "test", "--path", str(current.site), "--quiet").strip()
        provider = InstalledProvider(current.site, old_pin)
        (base / "host").mkdir(mode=0o755)
        layout = Layout.create(base / "host", accounts, provider)
        write_config(layout, old_pin, previous=True)
        daemon = Daemon(layout, provider, accounts)
        start(daemon)
        yield daemon, base
    finally:
        if daemon is not None:
            daemon.stop()
        if layout is not None:
            layout.destroy()
        shutil.rmtree(base, ignore_errors=True)
        accounts.remove()


def statuses(daemon: Daemon) -> dict[str, Any]:
    return {a.attempt_id: a for a in daemon.snapshot().attempts}


def test_upgrade_in_place_keeps_the_ledger_and_serves_an_old_controller(
    world: tuple[Daemon, Path],
) -> None:
    daemon, base = world

    # --- the old release: finished and active attempts -------------------------------
    rejected = [daemon.plan() for _ in range(2)]
    rows(daemon.reject_absent(rejected))
    ran = daemon.plan()
    rows(daemon.prepare([ran]))
    daemon.wait_state(ran, lambda r: r.ready or r.state != "prepared", "readiness")
    daemon.start_attempt(ran)
    daemon.wait_state(ran, lambda r: r.outcome is not None and r.cleanup_confirmed, "the end")
    assert attempt(daemon.release(ran)).state == "released"
    active = daemon.plan()
    rows(daemon.prepare([active], expires_in_ms=3_600_000))
    daemon.wait_state(active, lambda r: r.ready or r.state != "prepared", "readiness")
    before_snapshot = daemon.snapshot()
    before = statuses(daemon)
    assert daemon.stop() == 0

    # --- upgrade the same prefix in place, start the new daemon ----------------------
    upgrade_in_place()
    upgrade_provider(base)
    # the release notes' step: bind each slot to its filesystem (`filesystem_uuid`)
    write_config(daemon.layout, daemon.provider.digest)
    version_line = host("--version")
    new_version = version_line.split()[1]
    new_pin = host("provider-digest", "test", "--path", str(daemon.provider.site), "--quiet")
    new_pin = new_pin.strip()
    start(daemon)
    (starting,) = [e for e in daemon.process.events() if e["event"] == "starting"]
    assert starting["version"] == new_version  # the new code runs

    after_snapshot = daemon.snapshot()
    assert after_snapshot.bindings() == before_snapshot.bindings()  # the ledger opened
    after = statuses(daemon)
    assert sorted(after) == sorted(before)
    for plan in [*rejected, ran]:  # finished records are unchanged
        assert after[plan.attempt_id] == before[plan.attempt_id]
    kept = after[active.attempt_id]
    # the restart rule: a prepared attempt never ran; it stays prepared or is unknown
    assert kept.state in {"prepared", "unknown"}, kept
    assert daemon.layout.provider_calls("start", active.attempt_id) == 0

    # --- the pin is verified again, by the new code ----------------------------------
    (provider,) = after_snapshot.capacity.providers
    assert provider.available is (new_pin == daemon.provider.digest)
    if new_pin != daemon.provider.digest:
        refusals = [e for e in daemon.process.events() if "provider_digest_mismatch" in
                    str(e.get("message"))]  # fmt: skip
        assert refusals, daemon.process.log()
        assert daemon.stop() == 0
        write_config(daemon.layout, new_pin)  # the administrator re-pins (upgrade step 4)
        daemon.provider = InstalledProvider(daemon.provider.site, new_pin)
        start(daemon)
        (provider,) = daemon.snapshot().capacity.providers
        assert provider.available

    # --- a controller with the old ficc-protocol runs a new job --------------------
    plan = daemon.plan()
    plan_file, controller = base / "plan.json", base / "controller.py"
    plan_file.write_bytes(encode_plan(plan))
    shutil.copyfile(CONTROLLER, controller)  # readable by the transport account
    for path in (plan_file, controller):
        os.chmod(path, 0o644)
    transport = daemon.accounts["transport"]
    driven = subprocess.run(
        [CONTROLLER_PYTHON, "-I", str(controller), daemon.transport, str(plan_file)],
        capture_output=True, text=True, timeout=300, check=False,
        user=transport.uid, group=transport.gid, extra_groups=[], cwd="/",
    )  # fmt: skip
    assert driven.returncode == 0, driven.stderr + daemon.process.log()
    report = json.loads(driven.stdout)
    assert report["bindings"] == before_snapshot.bindings()
    assert report["states"][0] == "prepared"
    assert report["ready"] is True
    assert report["states"][-1] == "released"
    assert report["outcome"] is not None
    record = statuses(daemon)[plan.attempt_id]
    assert (record.state, record.outcome, record.cleanup_confirmed) == (
        "released",
        report["outcome"],
        True,
    )
