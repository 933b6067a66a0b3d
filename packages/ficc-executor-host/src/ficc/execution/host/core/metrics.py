"""The daemon's metrics in the Prometheus text exposition format (version 0.0.4).

Two kinds of figures:
- counted in memory since the daemon started (`Counters`, one per process, `PROCESS`):
  requests by action and result code with a latency histogram, fed from the server's
  per-connection log lines, and cleanup attempts that did not confirm;
- read from the durable state when asked (`LedgerFacts`): attempts by state and
  outcome, attempts by recorded reason (lease expiries, gate refusals, ...), free
  slots by class, provider availability, ledger size, and per slot class what the
  settled attempts used (CPU seconds and OOM kills, as recorded when each ended) and
  how they ended; with them, what the daemon holds in memory: the versions it runs
  and its start (read once when it started), and each slot's health.

`render` is pure: facts in, text out. Nothing here opens a listener; the figures leave
the daemon only through the administrator's `metrics` request.
"""

from __future__ import annotations

import bisect
import math
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final, Protocol

from ficc.execution.host.core.codes import HostCode

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
    task_index: TaskIndexLike | None = None
    """The kernel-fed task index, when the daemon runs one (its counters are shown)."""

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
    running: Mapping[str, str] = field(default_factory=dict)
    """distribution -> the version the daemon runs (read when it started)."""
    started_at_seconds: float = 0.0
    """When the daemon started, Unix seconds."""
    slot_health: Mapping[str, SlotGauge] = field(default_factory=dict)
    """slot id -> its class and health (every configured slot)."""
    usable: Mapping[str, int] = field(default_factory=dict)
    """class -> free slots of the class that pass their checks."""


@dataclass(frozen=True)
class SlotGauge:
    """One slot's health for its gauge: its class, and the failed check's code (None
    while healthy)."""

    slot_class: str
    reason: str | None


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
    _running(out, facts)
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
            [({}, gate_refusals(facts.reasons))])  # fmt: skip
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
    _slot_health(out, facts)
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
    _task_index(out, counters.task_index)
    return "\n".join(out) + "\n"


class TaskIndexStats(Protocol):
    """The task index's counters (a read-only record)."""

    @property
    def events(self) -> int: ...
    @property
    def lost(self) -> int: ...
    @property
    def resyncs(self) -> int: ...
    @property
    def audits(self) -> int: ...
    @property
    def disagreements(self) -> int: ...
    @property
    def tasks(self) -> int: ...


class TaskIndexLike(Protocol):
    """What the metrics read of the task index (ficc.execution.provider.taskindex)."""

    def stats(self) -> TaskIndexStats: ...


def _task_index(out: list[str], index: TaskIndexLike | None) -> None:
    _family(out, "ficc_task_index_told", "gauge",
            "1 when process events keep the task index, 0 when the checks walk /proc.",
            [({}, 0 if index is None else 1)])  # fmt: skip
    if index is None:
        return
    stats = index.stats()
    for name, value, text in (
        ("events_total", stats.events, "Process events read from the kernel."),
        ("lost_total", stats.lost, "Times events were lost (the index then walked again)."),
        ("resyncs_total", stats.resyncs, "Full walks that rebuilt the index."),
        ("audits_total", stats.audits, "Audit walks compared with the index."),
        ("disagreements_total", stats.disagreements, "Tasks an audit found the index wrong on."),
    ):
        _family(out, f"ficc_task_index_{name}", "counter", text, [({}, value)])
    _family(out, "ficc_task_index_tasks", "gauge", "Live tasks the index holds.",
            [({}, stats.tasks)])  # fmt: skip


GATE_REASONS: Final = frozenset(
    {code.value for code in HostCode if code.value.startswith("gate_")} | {"gate_refused"}
)
"""The reasons a gate refusal is recorded under: the code of the check that refused
(`gate_seccomp`, `gate_limits`, ...; docs/security.md lists them), and the protocol's
generic `gate_refused`, which this host does not record but a record may carry."""


def gate_refusals(reasons: Mapping[str, int]) -> int:
    """Attempts whose recorded reason is a gate refusal. The gate records the code of
    the check that refused, never one `gate_refused`, so counting that one reason alone
    gave 0 whatever the gate did."""
    return sum(count for reason, count in reasons.items() if reason in GATE_REASONS)


def _running(out: list[str], facts: LedgerFacts) -> None:
    """What the daemon runs and since when: read once when it started, so a release
    installed since (and not yet restarted into) never shows here."""
    _family(
        out,
        "ficc_distribution_info",
        "gauge",
        "Always 1: each distribution the running daemon is made of, at the version it"
        " started with.",
        [({"distribution": d, "version": v}, 1) for d, v in sorted(facts.running.items())],
    )
    _family(out, "ficc_start_time_seconds", "gauge", "When the daemon started, Unix seconds.",
            [({}, facts.started_at_seconds)])  # fmt: skip


def _slot_health(out: list[str], facts: LedgerFacts) -> None:
    """Slots that pass their checks: usable ones by class, and each slot's health with
    the failed check's code (a broken slot is out of the offer)."""
    _family(
        out,
        "ficc_slots_usable",
        "gauge",
        "Free slots by class that pass their checks (where admission can place work).",
        [({"class": c}, n) for c, n in sorted(facts.usable.items())],
    )
    _family(
        out,
        "ficc_slot_healthy",
        "gauge",
        "1 while the slot passes its checks; 0 while it is out of service, `reason` the"
        " failed check's code.",
        [
            ({"slot": s, "class": g.slot_class, "reason": g.reason or ""}, 0 if g.reason else 1)
            for s, g in sorted(facts.slot_health.items())
        ],
    )


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
