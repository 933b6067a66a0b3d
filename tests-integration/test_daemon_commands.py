"""`ficc-executor` against a real daemon: status --json, metrics, provider-digest --json,
the daemon's log lines, and a provider whose configure() fails.

The metrics are parsed with prometheus_client's own text parser (a test-only
dependency), so what node_exporter or Prometheus would read is what is checked.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from ficc.execution.protocol import MetricsRequest
from ficc_testkit.accounts import Accounts
from ficc_testkit.driver import attempt, rows
from ficc_testkit.host import Daemon, Layout
from ficc_testkit.waits import wait_for
from ficc_testkit.wheels import InstalledProvider

COMMAND = Path(sys.executable).parent / "ficc-executor"
VERSION = metadata.version("ficc-executor-host")
RFC3339 = re.compile(r"\A\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}Z\Z")


def ficc_executor(*argv: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """The installed console command; the timeout is a hang guard, not an assertion."""
    return subprocess.run(
        [str(COMMAND), *argv], capture_output=True, text=True, check=False, timeout=timeout
    )


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of the exposition, keyed by name and sorted labels."""
    found: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            found[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return found


def test_metrics_parse_as_prometheus_text_and_count_what_happened(daemon: Daemon) -> None:
    plans = [daemon.plan() for _ in range(3)]
    results = rows(daemon.reject_absent(plans))
    assert {attempt(r).state for r in results} == {"failed"}
    daemon.snapshot()
    result = ficc_executor("metrics", "--config", str(daemon.layout.config_path))
    assert result.returncode == 0, result.stderr
    families = {f.name: f for f in text_string_to_metric_families(result.stdout)}
    assert {"ficc_build_info", "ficc_attempts", "ficc_slots_free", "ficc_provider_available",
            "ficc_requests", "ficc_request_duration_seconds", "ficc_lease_expiries",
            "ficc_gate_refusals", "ficc_cleanup_retries", "ficc_ledger_records",
            "ficc_ledger_bytes"} <= set(families)  # fmt: skip
    assert families["ficc_request_duration_seconds"].type == "histogram"
    assert families["ficc_requests"].type == "counter"
    found = samples(result.stdout)
    assert found[("ficc_build_info", (("version", VERSION),))] == 1
    assert found[("ficc_attempts", (("outcome", "failed"), ("state", "failed")))] == 3
    assert found[("ficc_attempt_reasons", (("reason", "admission_rejected"),))] == 3
    assert found[("ficc_slots_free", (("class", "small"),))] == 2
    assert found[("ficc_provider_available", (("provider", "test"), ("reason", "")))] == 1
    assert found[("ficc_ledger_records", ())] == 3
    assert found[("ficc_ledger_bytes", ())] > 0
    assert found[("ficc_requests_total", (("action", "reject_absent"), ("code", "ok")))] == 1
    assert found[("ficc_requests_total", (("action", "snapshot"), ("code", "ok")))] >= 1
    count = found[("ficc_request_duration_seconds_count", (("action", "reject_absent"),))]
    inf = found[
        ("ficc_request_duration_seconds_bucket", (("action", "reject_absent"), ("le", "+Inf")))
    ]
    assert count == inf == 1


def test_metrics_are_for_the_administrator_only(daemon: Daemon) -> None:
    for reply in (
        daemon.as_owner(MetricsRequest(version=1, id="a" * 32)),
        daemon.as_transport(MetricsRequest(version=1, id="b" * 32)),
    ):
        assert getattr(reply, "error", None) is not None
        assert reply.error.code == "not_authorized"  # type: ignore[union-attr]


def test_status_json_has_every_page_and_the_daemon_version(daemon: Daemon) -> None:
    plans = [daemon.plan() for _ in range(70)]  # two snapshot pages
    for start in range(0, 70, 64):
        rows(daemon.reject_absent(plans[start : start + 64]))
    result = ficc_executor("status", "--config", str(daemon.layout.config_path), "--json")
    assert result.returncode == 0, result.stderr
    shown = json.loads(result.stdout)
    assert shown["daemon_version"] == VERSION
    assert len(shown["pages"]) == 2
    ids = [a["attempt_id"] for page in shown["pages"] for a in page["attempts"]]
    assert ids == sorted(p.attempt_id for p in plans)
    assert shown["pages"][0]["installation_id"] == daemon.layout.installation_id
    text = ficc_executor("status", "--config", str(daemon.layout.config_path))
    assert text.stdout.splitlines()[0] == f"daemon         {VERSION}"


def test_provider_digest_json_is_the_pin(daemon: Daemon) -> None:
    result = ficc_executor("provider-digest", "test", "--path", str(daemon.provider.site), "--json")
    assert result.returncode == 0, result.stderr
    shown = json.loads(result.stdout)
    assert shown["package_digest"] == daemon.provider.digest
    assert (shown["id"], shown["distribution"]) == ("test", "ficc-test-provider")


def test_log_lines_are_json_with_rfc3339_times_and_the_version(daemon: Daemon) -> None:
    daemon.snapshot()
    events = daemon.process.events()
    assert all(RFC3339.match(e["ts"]) and e["level"] in ("info", "warning", "error", "debug")
               for e in events)  # fmt: skip
    (starting,) = [e for e in events if e["event"] == "starting"]
    assert starting["version"] == VERSION
    assert starting["ficc_protocol_version"] == metadata.version("ficc-protocol")
    assert starting["protocol"] == 1
    # not under systemd: no syslog priority prefix, every line is plain JSON
    assert all(line.startswith("{") for line in daemon.process.log_path.read_text().splitlines())


def _started(layout: Layout, provider: InstalledProvider, accounts: Accounts) -> Daemon:
    running = Daemon(layout, provider, accounts)
    running.start()
    return running


@pytest.fixture
def broken_daemon(
    layout: Layout, provider: InstalledProvider, accounts: Accounts
) -> Iterator[Daemon]:
    """A daemon whose one provider refuses its configuration (configure() raises)."""
    document = dict(layout.document)
    document["providers"] = [{**document["providers"][0], "configuration": {"argv": "x"}}]
    layout.rewrite(document)
    running = _started(layout, provider, accounts)
    try:
        yield running
    finally:
        assert running.stop() == 0, running.process.log()


@pytest.fixture
def textfile_daemon(
    layout: Layout, provider: InstalledProvider, accounts: Accounts
) -> Iterator[Daemon]:
    """A daemon configured with `metrics_textfile` in a root-owned directory."""
    directory = layout.base / "textfile"
    directory.mkdir(mode=0o755)
    layout.rewrite({**layout.document, "metrics_textfile": str(directory / "ficc.prom")})
    running = _started(layout, provider, accounts)
    try:
        yield running
    finally:
        assert running.stop() == 0, running.process.log()


def test_metrics_textfile_is_written_atomically_for_node_exporter(textfile_daemon: Daemon) -> None:
    path = textfile_daemon.layout.base / "textfile" / "ficc.prom"
    text = wait_for(lambda: path.exists() and path.read_text(), "the metrics textfile")
    assert path.stat().st_mode & 0o777 == 0o644
    found = samples(text)
    assert found[("ficc_build_info", (("version", VERSION),))] == 1
    assert found[("ficc_slots_free", (("class", "small"),))] == 2
    assert [p.name for p in path.parent.iterdir()] == ["ficc.prom"]  # no temporary left


def test_a_provider_whose_configure_fails_is_unavailable_everywhere(broken_daemon: Daemon) -> None:
    """The daemon starts (it must recover and release), and every view says unavailable."""
    daemon = broken_daemon
    (provider,) = daemon.snapshot().capacity.providers
    assert provider.available is False
    status = ficc_executor("status", "--config", str(daemon.layout.config_path))
    (line,) = [line for line in status.stdout.splitlines() if line.startswith("test ")]
    assert line.split()[1] == "UNAVAILABLE"
    found = samples(ficc_executor("metrics", "--config", str(daemon.layout.config_path)).stdout)
    reason = (("provider", "test"), ("reason", "provider_configure_failed"))
    assert found[("ficc_provider_available", reason)] == 0
    checked = ficc_executor(
        "check-config", "--config", str(daemon.layout.config_path),
        "--provider-path", str(daemon.provider.site),
    )  # fmt: skip
    assert checked.returncode == 5  # the running daemon holds the ledger: reported first
    assert "ledger: held by a running daemon" in checked.stdout
    assert "provider test: unavailable: provider_configure_failed" in checked.stderr
    logged = [e for e in daemon.process.events() if "unavailable" in str(e.get("message"))]
    assert [e["level"] for e in logged] == ["error"]
