"""`ficc-executor` against a real daemon: status --json, metrics, provider-digest --json,
the daemon's log lines, and a provider whose configure() fails.

The metrics are parsed with prometheus_client's own text parser (a test-only
dependency), so what node_exporter or Prometheus would read is what is checked.
"""

from __future__ import annotations

import datetime
import json
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from ficc.execution.protocol import MetricsRequest
from ficc.execution.wire import TERMINAL
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
    assert text.stdout.splitlines()[0].startswith(f"daemon         {VERSION}   started ")


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
    assert checked.returncode == 4  # the unavailable provider outranks the held ledger
    assert "ledger: held by a running daemon" in checked.stdout
    assert "provider test: unavailable: provider_configure_failed" in checked.stderr
    logged = [e for e in daemon.process.events() if "unavailable" in str(e.get("message"))]
    assert [e["level"] for e in logged] == ["error"]


def check_config(daemon: Daemon, *extra: str) -> subprocess.CompletedProcess[str]:
    """`check-config` of the daemon's configuration file, as an administrator runs it."""
    return ficc_executor(
        "check-config", "--config", str(daemon.layout.config_path),
        "--provider-path", str(daemon.provider.site), *extra,
    )  # fmt: skip


def test_a_stale_pin_beside_a_running_daemon_is_not_reported_in_order(daemon: Daemon) -> None:
    """While the daemon runs, check-config cannot open the ledger (exit 5, `ledger_busy`)
    and says the rest is in order. A pin that no longer matches the installed provider
    (as after an upgrade of its files) must not hide behind that: it exits 4 on stdout
    and in `--json` alike, and no line calls the configuration in order."""
    fine = check_config(daemon)
    assert fine.returncode == 5, fine.stdout + fine.stderr
    assert fine.stdout.splitlines()[-1].endswith(
        ": in order, but a running daemon holds the ledger (ledger_busy)"
    )
    assert json.loads(check_config(daemon, "--json").stdout)["result"] == "ledger_busy"

    stale = dict(daemon.layout.document)
    stale["providers"] = [{**stale["providers"][0], "package_digest": "sha256:" + "0" * 64}]
    daemon.layout.rewrite(stale)
    shown = check_config(daemon)
    assert shown.returncode == 4, shown.stdout + shown.stderr
    assert "in order" not in shown.stdout
    assert shown.stdout.splitlines()[-1] == (
        f"{daemon.layout.config_path}: a provider is unavailable, and a running daemon holds"
        " the ledger (ledger_busy)"
    )
    assert "provider test: unavailable: provider_digest_mismatch" in shown.stderr
    document = json.loads(check_config(daemon, "--json").stdout)
    assert document["result"] == "provider_unavailable"
    assert document["ledger"].startswith("held by a running daemon")
    assert document["providers"][0]["error"]["code"] == "provider_digest_mismatch"
    allowed = check_config(daemon, "--allow-unavailable-providers")
    assert allowed.returncode == 5  # the unit's form: only the held ledger stops it now
    assert "in order" not in allowed.stdout
    assert daemon.snapshot().capacity.providers[0].available  # the daemon is untouched


def test_a_real_gate_refusal_is_counted_by_ficc_gate_refusals(daemon: Daemon) -> None:
    """The test provider runs its payload unconfined, so the payload gate refuses it
    (test_daemon_lifecycle.py); the refusal is recorded under the code of the check
    that refused, and `ficc_gate_refusals` counts it, before and after the release."""
    plan = daemon.plan()
    rows(daemon.prepare([plan]))
    daemon.wait_state(plan, lambda r: r.ready or r.state != "prepared", "readiness")
    daemon.start_attempt(plan)
    ended = daemon.wait_state(plan, lambda r: r.state in TERMINAL, "a terminal state")
    assert ended.reason is not None
    assert ended.reason.startswith("gate_"), ended
    config = str(daemon.layout.config_path)
    found = samples(ficc_executor("metrics", "--config", config).stdout)
    assert found[("ficc_attempt_reasons", (("reason", ended.reason),))] == 1
    assert found[("ficc_gate_refusals", ())] == 1
    daemon.wait_state(plan, lambda r: r.cleanup_confirmed, "confirmed cleanup")
    assert attempt(daemon.release(plan)).state == "released"
    found = samples(ficc_executor("metrics", "--config", config).stdout)
    assert found[("ficc_gate_refusals", ())] == 1  # a released record keeps its reason


def attempt_lines(text: str) -> dict[str, list[str]]:
    """The attempt rows of a `status` table, by attempt ID, in the order shown."""
    return {
        line.split()[0]: line.split()
        for line in text.splitlines()
        if re.match(r"[0-9a-f]{32} ", line)
    }


def test_status_shows_live_attempts_by_time_and_the_history_on_request(daemon: Daemon) -> None:
    """A released attempt (history), a failed one not yet released and a prepared one
    (live): `status` lists the two not released, by the time of their last change in
    UTC; `--all` adds the released one, `--since` chooses by that time; `--json` keeps
    the protocol's pages and honours the same choice."""
    started_ms = int(time.time() * 1000)
    old, failed, live = daemon.plan(), daemon.plan(), daemon.plan()
    rows(daemon.reject_absent([old]))
    assert attempt(daemon.release(old)).state == "released"
    rows(daemon.reject_absent([failed]))
    rows(daemon.prepare([live]))

    def status(*options: str) -> subprocess.CompletedProcess[str]:
        return ficc_executor("status", "--config", str(daemon.layout.config_path), *options)

    everything = json.loads(status("--all", "--json").stdout)
    times = {
        a["attempt_id"]: a["changed_at_ms"] for p in everything["pages"] for a in p["attempts"]
    }
    assert started_ms <= times[old.attempt_id] <= times[failed.attempt_id] <= times[live.attempt_id]
    assert times[live.attempt_id] <= time.time() * 1000

    def by_time(since_ms: int = 0) -> list[str]:
        kept = [(t, i) for i, t in times.items() if t >= since_ms]
        return [i for _, i in sorted(kept)]

    shown = status()
    assert shown.returncode == 0, shown.stderr
    table = attempt_lines(shown.stdout)
    assert list(table) == [i for i in by_time() if i != old.attempt_id]
    assert "attempts       2   live (not released); 1 more with --all" in shown.stdout
    for attempt_id, row in table.items():
        changed = datetime.datetime.fromtimestamp(times[attempt_id] / 1000, datetime.UTC)
        assert row[1] == changed.strftime("%Y-%m-%dT%H:%M:%SZ")  # UTC, to the second

    history = attempt_lines(status("--all").stdout)
    assert list(history) == by_time()
    assert history[old.attempt_id][2:5] == ["1", "released", "-"]  # no READY once released
    since_ms = times[failed.attempt_id]
    since = datetime.datetime.fromtimestamp(since_ms / 1000, datetime.UTC).isoformat()
    assert list(attempt_lines(status("--since", since).stdout)) == by_time(since_ms)
    assert failed.attempt_id in by_time(since_ms)
    assert list(attempt_lines(status("--since", "1h").stdout)) == by_time()

    live_only = json.loads(status("--json").stdout)
    listed = {a["attempt_id"] for p in live_only["pages"] for a in p["attempts"]}
    assert listed == {failed.attempt_id, live.attempt_id}
    refused = status("--since", "yesterday")
    assert refused.returncode == 2
    assert "neither a duration" in refused.stderr
