"""P6: a whole attempt of a `true` payload through the daemon and the Podman provider.

Value (benchmark P6): through the real daemon (`python -m ficc.execution serve`) with
the real ficc-provider-podman installed from a wheel into a root-owned prefix and
pinned, rootless Podman as the slot account (attempt_support.podman_host). One client, a
forked child as the transport account speaking through ficc.execution.client.Client
over the real transport socket, times: sending `prepare` until `observe` reports
`ready`, plus sending `start` until `observe` reports a terminal state (`succeeded`,
exit 0). `observe` is polled with a 10 ms pause between a reply and the next request,
so each phase may read up to one pause (plus one observe round trip) late. Stop,
cleanup confirmation and release are not timed.

Baseline: `podman run --rm` of the same image with the same isolation flags as the
provider's argv (container.run_argv: network none, read-only, no capabilities,
no-new-privileges, private cgroup/IPC/UTS/PID namespaces, passthrough logs, the same
ulimits), as the same slot account in the same Podman storage, of `/bin/true`. Only the
`podman run` is timed; removing the account's pause process afterwards is not.

Rounds alternate attempt and baseline (drift hits both alike); medians of 5 (quick) or
15 rounds after one untimed round that loads the image into the slot's storage.
Target: whole attempt / baseline at most 1.5x. The two phases are reported
separately (no target), and so is the earlier direct measurement of the provider, the
cgroupfs service and the payload gate without the daemon (no target; its own world,
its own baseline).

Where the time goes (medians of 8 traced attempts, 2026-11-29, bare run ~185 ms,
whole attempt ~340-355 ms): the provider's deliberate `podman image inspect` as the slot
account at prepare ~75 ms (a whole rootless Podman start-up: kept, it is the image-ID
check); the service ~20 ms (cgroups, limits read back, one RCU grace period for the
first cgroup.procs write ~12 ms, overlapped with the shim's ~8 ms interpreter start);
`podman run` up to the waiting barrier ~150 ms and from release to its exit ~60 ms
(the bare run's own work, plus its extra mounts, the 10 ms barrier poll and the
observe polling lag); gate, ledger commits and admission ~15 ms; this client's own
10 ms observe polling ~5-10 ms. Before the shim change the service took ~36 ms.

Needs root, podman, runc and busybox-static; creates and removes its own accounts.
"""

from __future__ import annotations

import importlib.util
import pathlib
import statistics
import sys
import time
from types import ModuleType

import attempt_support as p6
from figures import Figure

HERE = pathlib.Path(__file__).resolve().parent
DIRECT_HARNESS = HERE.parents[1] / "packages/ficc-provider-podman/tests/harness.py"


def _daemon_figures(rounds: int) -> list[Figure]:
    with p6.podman_host() as world:
        p6.timed_attempt(world)  # loads the image into the slot's storage: not timed
        p6.bare_run(world)
        attempts: list[p6.Phases] = []
        bares: list[float] = []
        for _ in range(rounds):
            attempts.append(p6.timed_attempt(world))
            bares.append(p6.bare_run(world))
    baseline = statistics.median(bares)
    whole = statistics.median(a.whole for a in attempts)
    ready = statistics.median(a.prepare_to_ready for a in attempts)
    finished = statistics.median(a.start_to_finished for a in attempts)

    def figure(name: str, value: float, target: float | None = None) -> Figure:
        return Figure("P6", name, value * 1000, "ms", baseline * 1000, value / baseline, target)

    return [
        figure("whole attempt of `true` via daemon vs podman run", whole, target=1.5),
        figure("  prepare->ready via daemon vs podman run", ready),
        figure("  start->finished via daemon vs podman run", finished),
    ]


# --- the earlier measurement: provider + service + gate, no daemon -----------------------


def _direct_harness() -> ModuleType:
    """The provider tests' harness, loaded under its own name (tests-integration has a
    `harness` module too)."""
    name = "ficc_podman_direct_harness"
    spec = importlib.util.spec_from_file_location(name, DIRECT_HARNESS)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _direct_attempt(h: ModuleType, w: object) -> float:
    """Provider prepare until validated, the cgroupfs service as the slot account,
    provider start, observe to the barrier, the gate, the release marker, observe to
    finished: what the daemon runs, measured on its parts."""
    plan = h.make_plan(w, ["/bin/true"], devices=())
    attempt = h.new_attempt(w, plan)
    try:
        start = time.perf_counter()
        h.prepare(attempt)
        _, verdict = h.run_to_payload(attempt)
        if not verdict.ok:
            raise RuntimeError(f"the gate refused the benchmark payload: {verdict.failures}")
        h.release_marker(attempt)
        if h.await_finished(attempt) != 0:
            raise RuntimeError("the benchmark payload failed")
        elapsed = time.perf_counter() - start
    finally:
        h.cleanup(attempt)
    return elapsed


def _direct_figure(rounds: int) -> Figure:
    h = _direct_harness()
    with h.world() as w:
        _direct_attempt(h, w)  # loads the image into the slot's storage: not timed
        p6.bare_run_as(w.slot.uid, w.slot.gid, w.slot.path, w.driver.config, w.image)
        attempts, bares = [], []
        for _ in range(rounds):
            attempts.append(_direct_attempt(h, w))
            bares.append(
                p6.bare_run_as(w.slot.uid, w.slot.gid, w.slot.path, w.driver.config, w.image)
            )
    value, baseline = statistics.median(attempts), statistics.median(bares)
    return Figure(
        "P6",
        "(provider+service+gate, no daemon) vs podman run",
        value * 1000,
        "ms",
        baseline * 1000,
        value / baseline,
    )


def run(quick: bool) -> list[Figure]:
    rounds = 5 if quick else 15
    return [*_daemon_figures(rounds), _direct_figure(3 if quick else 11)]
