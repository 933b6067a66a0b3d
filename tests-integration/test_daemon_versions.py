"""The running daemon tells the truth about its version.

After `pip install` of a new release and before the restart, the old code runs: `status`,
the snapshot (`daemon: true`) and `ficc_build_info` must name the version the daemon
started with, and `status` must say that the installed one differs; after the restart
they name the new one.

How a release is "installed" here without touching anything another test sees: the
daemon and the commands run under a throwaway interpreter (a virtual environment whose
own site directory comes first and which then adds this environment's, so the code is
the same), and the test writes a `.dist-info` of a newer ficc-executor-host into that
first site directory while the daemon runs. The daemon is a separate process: nothing in
it is patched.
"""

from __future__ import annotations

import json
import site
import subprocess
import sys
import time
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from ficc.execution import wire
from ficc.execution.protocol import MetricsRequest, SnapshotRequest
from ficc_testkit.accounts import Accounts
from ficc_testkit.daemons import DaemonProcess
from ficc_testkit.host import Daemon, Layout
from ficc_testkit.plans import new_id
from ficc_testkit.wheels import InstalledProvider

RUNNING = metadata.version("ficc-executor-host")
NEWER = "99.0.0"


class Overlay:
    """A throwaway interpreter: this environment's packages behind a site directory of
    its own, where a test may install metadata no other interpreter ever reads."""

    def __init__(self, root: Path) -> None:
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True)
        self.python = root / "bin" / "python"
        found = subprocess.run(
            [str(self.python), "-c", "import site; print(site.getsitepackages()[0])"],
            capture_output=True, text=True, check=True,
        ).stdout.strip()  # fmt: skip
        self.site = Path(found)
        ours = "".join(f"import site; site.addsitedir({d!r})\n" for d in site.getsitepackages())
        (self.site / "zz-ficc-environment.pth").write_text(ours)

    def install_newer_host(self) -> None:
        """What `pip install` of a newer ficc-executor-host leaves for metadata readers."""
        info = self.site / f"ficc_executor_host-{NEWER}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(
            f"Metadata-Version: 2.1\nName: ficc-executor-host\nVersion: {NEWER}\n"
        )

    def command(self, *argv: str) -> subprocess.CompletedProcess[str]:
        """`ficc-executor ARGV` under this interpreter (a hang guard, not an assertion)."""
        return subprocess.run(
            [str(self.python), "-m", "ficc.execution", *argv],
            capture_output=True, text=True, check=False, timeout=120,
        )  # fmt: skip


@pytest.fixture
def overlay(layout: Layout) -> Overlay:
    """Inside the test's own tree, which its teardown removes."""
    return Overlay(layout.base / "overlay")


def restart(daemon: Daemon, overlay: Overlay) -> None:
    """A clean stop, then a new daemon under the same interpreter."""
    assert daemon.stop() == 0, daemon.process.log()
    daemon.process = DaemonProcess.of(daemon.layout, daemon.provider, python=str(overlay.python))
    daemon.start()


@pytest.fixture
def overlaid(
    layout: Layout, provider: InstalledProvider, accounts: Accounts, overlay: Overlay
) -> Iterator[Daemon]:
    """The suite's daemon, run by the overlay's interpreter."""
    daemon = Daemon(layout, provider, accounts)
    daemon.process = DaemonProcess.of(layout, provider, python=str(overlay.python))
    daemon.start()
    try:
        yield daemon
    finally:
        assert daemon.stop() == 0, daemon.process.log()


def build_info(daemon: Daemon) -> list[str]:
    reply = daemon.as_admin(MetricsRequest(version=1, id=new_id()))
    assert isinstance(reply, wire.MetricsReply), reply
    (family,) = [
        f for f in text_string_to_metric_families(reply.text) if f.name == "ficc_build_info"
    ]
    return [s.labels["version"] for s in family.samples]


def running_versions(daemon: Daemon) -> wire.DaemonInfo:
    reply = daemon.as_transport(SnapshotRequest(version=1, id=new_id(), daemon=True))
    assert isinstance(reply, wire.SnapshotReply), reply
    assert isinstance(reply.daemon, wire.DaemonInfo), reply
    return reply.daemon


def test_an_installed_release_shows_only_after_the_restart(
    overlaid: Daemon, overlay: Overlay
) -> None:
    config = str(overlaid.layout.config_path)
    before = running_versions(overlaid)
    versions = {v.distribution: v.version for v in before.versions}
    assert versions["ficc-executor-host"] == RUNNING
    assert set(versions) == {"ficc-executor-host", "ficc-protocol", "ficc-provider-sdk"}
    assert before.started_at_ms <= time.time_ns() // 1_000_000
    shown = overlay.command("status", "--config", config)
    assert shown.stdout.splitlines()[0].startswith(f"daemon         {RUNNING}   started "), shown
    assert "  installed" not in shown.stdout

    overlay.install_newer_host()  # `pip install` of the next release, no restart yet
    assert overlay.command("--version").stdout.startswith(f"ficc-executor {NEWER} ")
    assert build_info(overlaid) == [RUNNING]
    assert running_versions(overlaid) == before
    shown = overlay.command("status", "--config", config)
    assert shown.returncode == 0, shown.stderr
    lines = shown.stdout.splitlines()
    assert lines[0].startswith(f"daemon         {RUNNING}   started "), shown.stdout
    assert lines[1] == (
        f"  installed    ficc-executor-host {NEWER}, but the daemon runs {RUNNING}:"
        " restart the daemon to run what is installed"
    )
    document = json.loads(overlay.command("status", "--config", config, "--json").stdout)
    assert document["daemon_version"] == RUNNING
    assert document["installed_differs"] == [
        {"distribution": "ficc-executor-host", "running": RUNNING, "installed": NEWER}
    ]

    restart(overlaid, overlay)  # the documented upgrade check passes only now
    assert build_info(overlaid) == [NEWER]
    after = running_versions(overlaid)
    assert after.started_at_ms > before.started_at_ms
    shown = overlay.command("status", "--config", config)
    assert shown.stdout.splitlines()[0].startswith(f"daemon         {NEWER}   started ")
    assert "  installed" not in shown.stdout
