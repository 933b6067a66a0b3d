"""metrics.py: the exposition parses with prometheus_client's own parser (a test-only
dependency) and says what the facts and counters say. The daemon end to end is in
tests-integration/test_daemon_commands.py."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from ficc.execution.host.core import metrics

FACTS = metrics.LedgerFacts(
    version="1.2.3",
    attempts={("running", ""): 2, ("released", "succeeded"): 5},
    reasons={"lease_expired": 1, "gate_seccomp": 2, "gate_limits": 1, "exited": 5},
    cleanup_unconfirmed=1,
    slots={"small": (4, 2), "big": (1, 0)},
    providers={"podman": None, "broken": "provider_configure_failed"},
    ledger_records=7,
    ledger_bytes=65536,
)


def parsed(counters: metrics.Counters) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    text = metrics.render(FACTS, counters)
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_the_ledger_facts_become_samples() -> None:
    found = parsed(metrics.Counters())
    assert found[("ficc_build_info", frozenset({("version", "1.2.3")}))] == 1
    assert found[("ficc_attempts", frozenset({("state", "running"), ("outcome", "")}))] == 2
    key = ("ficc_attempts", frozenset({("state", "released"), ("outcome", "succeeded")}))
    assert found[key] == 5
    assert found[("ficc_lease_expiries", frozenset())] == 1
    assert found[("ficc_gate_refusals", frozenset())] == 3  # every gate_* reason
    assert found[("ficc_cleanup_unconfirmed", frozenset())] == 1
    assert found[("ficc_slots_free", frozenset({("class", "small")}))] == 2
    assert found[("ficc_slots", frozenset({("class", "big")}))] == 1
    unavailable = frozenset({("provider", "broken"), ("reason", "provider_configure_failed")})
    assert found[("ficc_provider_available", unavailable)] == 0
    assert found[("ficc_provider_available", frozenset({("provider", "podman"), ("reason", "")}))]
    assert found[("ficc_ledger_bytes", frozenset())] == 65536


def test_requests_are_counted_by_action_and_code_with_a_latency_histogram() -> None:
    counters = metrics.Counters()
    for duration, code in [(0.4, None), (3.0, None), (40_000.0, "busy")]:
        counters.observe_log(
            {"event": "request", "action": "observe", "code": code, "duration_ms": duration}
        )
    counters.observe_log({"event": "listening", "socket": "admin"})  # not a request
    counters.cleanup_not_confirmed()
    found = parsed(counters)
    ok = frozenset({("action", "observe"), ("code", "ok")})
    assert found[("ficc_requests_total", ok)] == 2
    assert found[("ficc_requests_total", frozenset({("action", "observe"), ("code", "busy")}))] == 1
    assert found[("ficc_cleanup_retries_total", frozenset())] == 1

    def bucket(le: str) -> float:
        return found[
            ("ficc_request_duration_seconds_bucket", frozenset({("action", "observe"), ("le", le)}))
        ]

    assert bucket("0.001") == 1  # 0.4 ms
    assert bucket("0.005") == 2  # 3 ms
    assert bucket("30") == 2
    assert bucket("+Inf") == 3  # 40 s
    count = found[("ficc_request_duration_seconds_count", frozenset({("action", "observe")}))]
    assert count == 3
    total = found[("ficc_request_duration_seconds_sum", frozenset({("action", "observe")}))]
    assert abs(total - 40.0034) < 1e-9


def test_label_values_are_escaped() -> None:
    facts = metrics.LedgerFacts(**{**FACTS.__dict__, "version": 'a"b\\c\nd'})
    text = metrics.render(facts, metrics.Counters())
    (family,) = [f for f in text_string_to_metric_families(text) if f.name == "ficc_build_info"]
    assert family.samples[0].labels == {"version": 'a"b\\c\nd'}


def test_what_each_slot_class_used_becomes_counters() -> None:
    facts = metrics.LedgerFacts(
        **{
            **FACTS.__dict__,
            "by_class": {
                ("small", "succeeded"): metrics.ClassUse(3, 2_500_000, 0),
                ("small", "failed"): metrics.ClassUse(1, 500_000, 2),
                ("big", "unknown"): metrics.ClassUse(1, 0, 0),
            },
        }
    )
    text = metrics.render(facts, metrics.Counters())
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for name in ("ficc_slot_class_attempts", "ficc_slot_class_cpu_seconds",
                 "ficc_slot_class_oom_kills"):  # fmt: skip
        assert families[name].type == "counter"
    found = {
        (s.name, frozenset(s.labels.items())): s.value
        for family in families.values()
        for s in family.samples
    }
    small = frozenset({("class", "small")})
    assert found[("ficc_slot_class_cpu_seconds_total", small)] == 3.0
    assert found[("ficc_slot_class_oom_kills_total", small)] == 2
    assert found[("ficc_slot_class_attempts_total", small | {("outcome", "failed")})] == 1
    assert found[("ficc_slot_class_attempts_total", small | {("outcome", "succeeded")})] == 3
    assert found[("ficc_slot_class_cpu_seconds_total", frozenset({("class", "big")}))] == 0


def test_gate_refusals_count_every_gate_check_and_nothing_else() -> None:
    """The gate records the code of the check that refused; the protocol's generic
    `gate_refused` counts too, reasons of other parts never."""
    reasons = {"gate_uid": 1, "gate_evidence": 1, "gate_refused": 1, "service_limits": 4}
    assert metrics.gate_refusals(reasons) == 3
    assert metrics.gate_refusals({"exited": 2, "lease_expired": 1}) == 0


def test_what_the_daemon_runs_and_each_slots_health_become_gauges() -> None:
    facts = metrics.LedgerFacts(
        **{
            **FACTS.__dict__,
            "running": {"ficc-executor-host": "1.2.3", "ficc-protocol": "0.9.0"},
            "started_at_seconds": 1_800_000_000.5,
            "slot_health": {
                "s0": metrics.SlotGauge("small", "slot_filesystem"),
                "s1": metrics.SlotGauge("small", None),
            },
            "usable": {"small": 1, "big": 0},
        }
    )
    text = metrics.render(facts, metrics.Counters())
    found = {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }
    protocol = frozenset({("distribution", "ficc-protocol"), ("version", "0.9.0")})
    assert found[("ficc_distribution_info", protocol)] == 1
    assert found[("ficc_start_time_seconds", frozenset())] == 1_800_000_000.5
    broken = frozenset({("slot", "s0"), ("class", "small"), ("reason", "slot_filesystem")})
    assert found[("ficc_slot_healthy", broken)] == 0
    assert found[("ficc_slot_healthy", frozenset({("slot", "s1"), ("class", "small"),
                                                  ("reason", "")}))] == 1  # fmt: skip
    assert found[("ficc_slots_usable", frozenset({("class", "small")}))] == 1
    assert found[("ficc_slots_usable", frozenset({("class", "big")}))] == 0
