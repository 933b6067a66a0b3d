"""The daemon's metrics in the Prometheus text exposition format (version 0.0.4).

Two kinds of figures:
- counted in memory since the daemon started (`Counters`, one per process, `PROCESS`):
  requests by action and result code with a latency histogram, fed from the server's
  per-connection log lines, and cleanup attempts that did not confirm;
- read from the durable state when asked (`LedgerFacts`): attempts by state and
  outcome, attempts by recorded reason (lease expiries, gate refusals, ...), free
  slots by class, provider availability, ledger size, and per slot class what the
  settled attempts used (CPU seconds and OOM kills, as recorded when each ended) and
  how they ended.

`render` is pure: facts in, text out. Nothing here opens a listener; the figures leave
the daemon only through the administrator's `metrics` request.
"""

from __future__ import annotations

import bisect
import math
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0, 30.0)
"""Upper bounds (seconds) of the request latency histogram; `+Inf` is added."""

_REQUEST_EVENTS = frozenset({"request", "request_refused", "action_refused"})


@dataclass
class _Histogram:
    buckets: list[int] = field(default_factory=lambda: [0] * len(LATENCY_BUCKETS))
    count: int = 0
    total: float = 0.0

    def observe(self, seconds: float) -> None:
        index = bisect.bisect_left(LATENCY_BUCKETS, seconds)
        if index < len(self.buckets):
            self.buckets[index] += 1
        self.count += 1
        self.total += seconds


@dataclass
class Counters:
    """What the daemon counts in memory (event-loop thread only)."""

    requests: Counter[tuple[str, str]] = field(default_factory=Counter)
    latency: dict[str, _Histogram] = field(default_factory=dict)
    cleanup_retries: int = 0

    def observe_log(self, record: Mapping[str, Any]) -> None:
        """Count one of the server's per-connection log lines (others are ignored)."""
        if record.get("event") not in _REQUEST_EVENTS:
            return
        action = str(record.get("action") or "unknown")
        code = str(record.get("code") or "ok")
        self.requests[(action, code)] += 1
        duration = record.get("duration_ms")
        if isinstance(duration, (int, float)) and math.isfinite(duration):
            self.latency.setdefault(action, _Histogram()).observe(max(0.0, duration / 1000))

    def cleanup_not_confirmed(self) -> None:
        self.cleanup_retries += 1


PROCESS = Counters()
"""The running daemon's counters (one daemon per process)."""


@dataclass(frozen=True)
class LedgerFacts:
    """Figures read from the daemon's durable state when metrics are asked for."""

    version: str
    attempts: Mapping[tuple[str, str], int]  # (state, outcome or "") -> count
    reasons: Mapping[str, int]  # recorded reason -> attempts
    cleanup_unconfirmed: int
    slots: Mapping[str, tuple[int, int]]  # class -> (total, free)
    providers: Mapping[str, str | None]  # id -> None when available, else refusal code
    ledger_records: int
    ledger_bytes: int
    by_class: Mapping[tuple[str, str], ClassUse] = field(default_factory=dict)
    """(slot class, outcome) -> what the settled attempts that held such a slot used."""


@dataclass(frozen=True)
class ClassUse:
    """Settled attempts of one slot class and outcome: how many, and what they used
    (a figure the host could not read counts as nothing)."""

    attempts: int
    cpu_us: int
    oom_kills: int

    def __add__(self, other: ClassUse) -> ClassUse:
        return ClassUse(
            self.attempts + other.attempts,
            self.cpu_us + other.cpu_us,
            self.oom_kills + other.oom_kills,
        )


def render(facts: LedgerFacts, counters: Counters) -> str:
    """The whole exposition, families in a fixed order, samples sorted."""
    out: list[str] = []
    _family(out, "ficc_build_info", "gauge", "The running daemon's version.",
            [({"version": facts.version}, 1)])  # fmt: skip
    _family(
        out,
        "ficc_attempts",
        "gauge",
        "Attempt records by state and outcome (released keeps its outcome).",
        [({"state": s, "outcome": o}, n) for (s, o), n in sorted(facts.attempts.items())],
    )
    _family(
        out,
        "ficc_attempt_reasons",
        "gauge",
        "Attempt records by recorded reason (records are never deleted).",
        [({"reason": r}, n) for r, n in sorted(facts.reasons.items())],
    )
    _family(out, "ficc_lease_expiries", "gauge", "Attempts whose lease ran out.",
            [({}, facts.reasons.get("lease_expired", 0))])  # fmt: skip
    _family(out, "ficc_gate_refusals", "gauge", "Attempts the payload gate refused.",
            [({}, facts.reasons.get("gate_refused", 0))])  # fmt: skip
    _family(out, "ficc_cleanup_unconfirmed", "gauge",
            "Settled attempts whose cleanup is not confirmed yet.",
            [({}, facts.cleanup_unconfirmed)])  # fmt: skip
    _family(out, "ficc_cleanup_retries_total", "counter",
            "Cleanup passes that could not confirm cleanup, since the daemon started.",
            [({}, counters.cleanup_retries)])  # fmt: skip
    _family(out, "ficc_slots", "gauge", "Configured slots by class.",
            [({"class": c}, t) for c, (t, _) in sorted(facts.slots.items())])  # fmt: skip
    _family(out, "ficc_slots_free", "gauge", "Free slots by class.",
            [({"class": c}, f) for c, (_, f) in sorted(facts.slots.items())])  # fmt: skip
    _family(
        out,
        "ficc_provider_available",
        "gauge",
        "1 when the provider verified against its pin and configured, else 0.",
        [
            ({"provider": p, "reason": code or ""}, 0 if code else 1)
            for p, code in sorted(facts.providers.items())
        ],
    )
    _class_usage(out, facts.by_class)
    _family(out, "ficc_ledger_records", "gauge", "Attempt records in the ledger.",
            [({}, facts.ledger_records)])  # fmt: skip
    _family(out, "ficc_ledger_bytes", "gauge", "Size of the ledger files on disk.",
            [({}, facts.ledger_bytes)])  # fmt: skip
    _family(
        out,
        "ficc_requests_total",
        "counter",
        "Requests since the daemon started, by action and result code (ok: no refusal).",
        [({"action": a, "code": c}, n) for (a, c), n in sorted(counters.requests.items())],
    )
    _histograms(out, counters.latency)
    return "\n".join(out) + "\n"


def _class_usage(out: list[str], by_class: Mapping[tuple[str, str], ClassUse]) -> None:
    """Per slot class: settled attempts by outcome, their CPU seconds and OOM kills.
    Counters: records are never deleted and a recorded usage never changes."""
    totals: dict[str, ClassUse] = {}
    for (slot_class, _), use in by_class.items():
        totals[slot_class] = totals.get(slot_class, ClassUse(0, 0, 0)) + use
    _family(
        out,
        "ficc_slot_class_attempts_total",
        "counter",
        "Settled attempts that held a slot of the class, by outcome.",
        [({"class": c, "outcome": o}, u.attempts) for (c, o), u in sorted(by_class.items())],
    )
    _family(
        out,
        "ficc_slot_class_cpu_seconds_total",
        "counter",
        "CPU seconds (user and system) the settled attempts of the class used, as recorded"
        " when each ended.",
        [({"class": c}, u.cpu_us / 1_000_000) for c, u in sorted(totals.items())],
    )
    _family(
        out,
        "ficc_slot_class_oom_kills_total",
        "counter",
        "Processes the out-of-memory killer killed in the settled attempts of the class.",
        [({"class": c}, u.oom_kills) for c, u in sorted(totals.items())],
    )


def _histograms(out: list[str], latency: Mapping[str, _Histogram]) -> None:
    name = "ficc_request_duration_seconds"
    out.append(f"# HELP {name} Time from accepting a connection to sending its reply.")
    out.append(f"# TYPE {name} histogram")
    for action, histogram in sorted(latency.items()):
        running = 0
        bounds = [*(_number(b) for b in LATENCY_BUCKETS), "+Inf"]
        for bound, count in zip(bounds, [*histogram.buckets, 0], strict=True):
            running += count
            cumulative = histogram.count if bound == "+Inf" else running
            out.append(_sample(f"{name}_bucket", {"action": action, "le": bound}, cumulative))
        out.append(_sample(f"{name}_sum", {"action": action}, histogram.total))
        out.append(_sample(f"{name}_count", {"action": action}, histogram.count))


def _family(
    out: list[str],
    name: str,
    kind: str,
    help_text: str,
    samples: Iterable[tuple[dict[str, str], float]],
) -> None:
    out.append(f"# HELP {name} {help_text}")
    out.append(f"# TYPE {name} {kind}")
    out.extend(_sample(name, labels, value) for labels, value in samples)


def _sample(name: str, labels: Mapping[str, str], value: float) -> str:
    if not labels:
        return f"{name} {_number(value)}"
    shown = ",".join(f'{k}="{_escape(v)}"' for k, v in labels.items())
    return f"{name}{{{shown}}} {_number(value)}"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _number(value: float) -> str:
    if isinstance(value, int) or float(value).is_integer():
        return str(int(value))
    return repr(float(value))
