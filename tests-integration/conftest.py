"""Fixtures of the integration suite; the machinery is the test kit's (ficc_testkit).

Session: the five `ficc-it-*` accounts (created if missing, removed at the end if this
session made them), and the test provider built once and installed into a root-owned
prefix under /run. Per test: a fresh directory tree, configuration and daemon process,
so tests never share a ledger, a slot or an offer. A failing test shows the daemon's
log; a daemon that does not exit 0 on SIGTERM fails the test in teardown.
"""

from __future__ import annotations

import os
import shutil
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from ficc_testkit.accounts import Accounts
from ficc_testkit.host import Daemon, Layout, ensure_accounts
from ficc_testkit.podman import PodmanWorld
from ficc_testkit.slots import private_directory
from ficc_testkit.wheels import InstalledProvider, build_wheel, install_provider
from podman_support import BACKENDS, each_test, podman_world

PROVIDER_SOURCE = Path(__file__).resolve().parent / "providers" / "ficc-test-provider"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every integration test needs root: it creates users, /run directories and runs
    the daemon as root."""
    for item in items:
        item.add_marker(pytest.mark.root("the integration suite runs the daemon as root"))


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[Any]) -> Iterator[None]:
    """Keep each phase's report on the item, so fixtures can see whether the test failed."""
    outcome: Any = yield
    report = outcome.get_result()
    setattr(item, f"report_{report.when}", report)


@pytest.fixture(scope="session")
def accounts() -> Iterator[Accounts]:
    made = ensure_accounts()
    try:
        yield made
    finally:
        made.remove()


@pytest.fixture(scope="session")
def session_dir() -> Iterator[Path]:
    path = private_directory("/run", f"ficc-it-{os.getpid()}-")
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="session")
def provider(session_dir: Path) -> InstalledProvider:
    wheel = build_wheel(PROVIDER_SOURCE, session_dir / "wheel")
    return install_provider(wheel, session_dir / "prefix")


@pytest.fixture
def layout(
    request: pytest.FixtureRequest,
    session_dir: Path,
    accounts: Accounts,
    provider: InstalledProvider,
) -> Iterator[Layout]:
    base = private_directory(str(session_dir), "t-")
    overrides = getattr(request, "param", {})
    try:
        made = Layout.create(base, accounts, provider, **overrides)
    except BaseException:
        shutil.rmtree(base, ignore_errors=True)
        raise
    try:
        yield made
    finally:
        made.destroy()


@pytest.fixture
def daemon(
    request: pytest.FixtureRequest,
    layout: Layout,
    provider: InstalledProvider,
    accounts: Accounts,
) -> Iterator[Daemon]:
    """A started daemon; stopped with SIGTERM after the test, which must exit 0."""
    running = Daemon(layout, provider, accounts)
    running.start()
    try:
        yield running
    finally:
        failed = getattr(request.node, "report_call", None)
        if failed is not None and failed.failed:
            print(f"\n--- daemon log ({running.process.log_path}) ---\n{running.process.log()}")
        status = running.stop()
        _kill_leftovers(accounts)
        assert status == 0, f"the daemon exited {status} on SIGTERM:\n{running.process.log()}"


def _kill_leftovers(accounts: Accounts) -> None:
    """Processes a failed test may have left: anything running as a slot account."""
    slot_uids = {accounts["slot0"].uid, accounts["slot1"].uid}
    for process in psutil.process_iter(["uids"]):
        try:
            if process.info["uids"].real in slot_uids:
                os.kill(process.pid, signal.SIGKILL)
        except (psutil.Error, ProcessLookupError, TypeError, AttributeError):
            continue


@pytest.fixture(scope="module", params=BACKENDS)
def world(request: pytest.FixtureRequest) -> Iterator[PodmanWorld]:
    """One Podman world (daemon, accounts, slots, image, provider) per module and
    system-service backend (podman_support.BACKENDS); a module that needs another
    world defines its own `world`."""
    with podman_world(request.param) as built:
        yield built


@pytest.fixture
def e2e(request: pytest.FixtureRequest, world: PodmanWorld) -> Iterator[PodmanWorld]:
    """The shared world, cleaned after each test (podman_support.each_test)."""
    yield from each_test(request, world)
