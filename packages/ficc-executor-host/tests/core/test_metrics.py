"""metrics.py: the exposition parses with prometheus_client's own parser (a test-only
dependency) and says what the facts and counters say. The daemon end to end is in
tests-integration/test_daemon_commands.py."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from ficc.execution.host.core import metrics

FACTS = metrics.LedgerFacts(
    version="1.2.3",
    attempts={("running", ""): 2, ("released", "succeeded"): 5},
    reasons={"lease_expired": 1, "gate_refused": 2, "exited": 5},
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
    assert found[("ficc_gate_refusals", frozenset())] == 2
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
