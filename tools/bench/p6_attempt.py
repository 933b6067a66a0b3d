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

Where the time goes (medians of 6 traced attempts, 2026-12-01, bare run ~258 ms, whole
attempt ~412 ms, 1.60x; timestamps at each step of the runner, not committed):
prepare to ready ~32 ms: the slot filesystem check and the attempt layout ~13 ms, the
provider's prepare ~15 ms (inputs, the environment and exit-status files, each
synced; the image check is now a stat of the storage's image record, see
docs/providers.md), ledger records and polling ~5 ms. Start to finished ~380 ms:
ledger reads and the lease reaper's deadline file ~7 ms; the service ~28 ms
(cgroups, limits read back, the start shim's interpreter); `podman run` up to the
barrier's device report ~268 ms (the bare run's own start plus its extra mounts,
seen by an observation every 10 ms); the payload gate ~9 ms; the release marker and
`Started` ~4 ms; then the payload, Podman's exit and `--rm`, and the observation of
the exit ~89 ms (the bare run's own ~60 ms plus the wake-up on the service's exit and
one observe); this client's 10 ms polling ~10 ms. The direct measurement without
the daemon (last figure) was 1.19-1.61x over the same day's runs, the whole attempt
1.56-1.67x on a machine to itself: most of what is left is the service and Podman
running inside it.

Traced again later the same day (timestamps per runner step, py-spy of the daemon,
strace of the service's processes; medians of 6 to 9, bare run ~290 ms, whole attempt
~426-450 ms): start to the service ~8 ms (ledger reads, the deadline file, and a fork
of the daemon to start a lease reaper); the service ~25-32 ms, of which ~18-30 ms is
spawning the shim and joining it to the attempt's cgroups: on this kernel the first
cgroup migration after a quiet spell waits for an RCU grace period (a cold write to
cgroup.procs took 17-21 ms, the next one 0.1 ms). The shim's interpreter (`-I -S`,
importing `os`, `sys` and `resource` only) is up before that join completes, so it
is not on the critical path. Starting a no-op migration of the daemon before the
nodes are made, to overlap that wait, measured slower (A/B over 24 creates: 28 ms
against 23 ms) and was not kept. The provider's argv run directly as the slot
account, without the service, took what the bare run takes (313 ms against 320 ms
with `--rm` and 310 ms without, medians of 9): its extra mounts, `--env-file`,
`--device`s and the exit-status wrapper cost nothing measurable; inside the service
+~60 ms (the service's creation and exit). The plan's CPU limit (1000 millis) never
throttled Podman (cpu.stat: nr_throttled 0). The daemon itself is idle most of the
attempt (py-spy): its CPU is not what delays Podman. The gate ~10 ms; the release
marker and `Started` ~7 ms; the exit's observation ~10 ms plus this client's poll.

Cut after that trace: a lease reaper no longer starts per attempt (a Python
interpreter, ~40 ms of CPU during Podman's own start, and a second one whenever a
monitor tick found the first still coming up): it stays 5 s after its last deadline
and the daemon does not start another while its last one comes up; the release
marker is linked without two syncs of the slot filesystem between the gate and the
barrier's release.

Traced a third time (medians of 14 traced attempts, a daemon with timestamps at
each step and in the client; not committed): prepare to ready ~34 ms, start to the
provider's `start` ~34 ms (the service ~23 ms), then Podman up to the barrier, the
gate ~13 ms, the release ~3 ms, the payload and Podman's exit, and ~14 ms from the
service's exit to the client's next poll. Inside the service, the shim's cgroup join
(14 ms, the RCU grace period above) and the shim's interpreter start (~15 ms from its
spawn) run side by side, so taking either away alone saves ~1 ms: with the cgroup2
hierarchy remounted `favordynmods` (the kernel then skips that grace period; the
machine kept it until its next reboot) the join took 0.7 ms and the shim's `R` came
15.5 ms after its spawn instead. Only a shim that is not a Python interpreter and a
join without the grace period together would take ~14 ms off; neither is done. A
bare `podman run --rm` started inside cgroups like the service's (CPU quota, 256 MiB
memory, 128 processes) took ~30 ms more than outside them (medians of 14: 390 against
359 ms, on a machine another session loaded), so Podman inside the service costs
more than the service's creation; which controller, was not isolated. The waiting
start observed every 13-30 ms although `observe_interval` is 10 ms: the pause grew
with the observe call's wall time, which on a busy machine is mostly waiting for a
CPU. Cut: the pause now grows with the CPU the call spent (median 1.9 ms, so 10 ms),
and a `ready` that carries the barrier's PID (the Podman provider's does) is gated at
once instead of observing again for `payload` (~3 ms).

Cut on 2026-12-02 (1.60-1.73x before; 1.30x, 1.35x and 1.36x in three quick runs
after): the exit. `podman run` returns only after tearing the container down, and
its wait for the container polls: from the container's first output to `podman run`
returning took 77-271 ms in a one-off measurement (10 bare runs, in a slow state of
the machine), which the bare run pays once but the attempt paid on top of its own
look at the service's end. conmon writes the container's exit status the moment it
reaps the container (Podman's `--tmpdir`/exits/<ID>, the ID from `--cidfile`): the
Podman provider now reads it there first, and the runner watches the gated payload
process with a pidfd, looking again at once and every `observe_interval` after it
ends (conmon needs a moment to reap it). No check is removed: the status is conmon's
record, which `podman run` itself returns, and the payload cannot reach it. Podman's
teardown now happens after `finished` (the cleanup kills it), outside the timed span,
as the container's removal (`podman rm` at release) always was; P9 times both.

Cut on 2026-12-01 (2.40x before, same machine and day): the per-prepare `podman
image inspect` as the slot account (~75-95 ms, a whole rootless Podman start; now
done only when the storage's image record file changed), the gate's interpretation
of the same seccomp filter on every start (~50 ms of CPU; the judgement of a filter
set is kept), the barrier's 10 ms poll for the marker (now 2 ms). Every check stays.

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
    """The provider tests' harness, loaded from its file under a name of its own."""
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
