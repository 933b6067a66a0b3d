"""P6: a whole attempt of a `true` payload with the Podman provider vs a bare `podman run`.

Value: provider `prepare` (inputs none, the pinned image already in the slot's Podman
storage, so steady state) until the prepare result is validated (ready), plus the
host's cgroupfs service creation with the prepared argv as the slot account, provider
`start`, `observe` until the barrier's PID, the payload gate on the live barrier, the
release marker and `observe` until `finished`. That is what the daemon runs between
"prepare accepted" and "finished", measured directly on its parts (provider, service,
gate) rather than through the daemon process.

Baseline: `podman run --rm` of the same image with the same isolation flags, as the same
slot account, with `/bin/true` as the command, followed by the same cleanup of the
account's leftovers (the pause process) that every attempt must also leave behind.

Cleanup of the attempt (stop, idle check, provider release, layout removal) is not
timed on either side. QUALITY.md: ratio value / baseline at most 2x.

Needs root, podman, runc and busybox-static; creates and removes its own slot account.
"""

from __future__ import annotations

import pathlib
import statistics
import subprocess
import sys
import time

from figures import Figure

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1] / "packages/ficc-provider-podman/tests"))

import harness as h  # noqa: E402
from ficc_provider_podman.account import (  # noqa: E402
    SlotAccount,
    kill_leftovers,
    reset_runtime_state,
)
from ficc_provider_podman.container import container_name  # noqa: E402


def _attempt(w: h.World) -> float:
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


def _bare(w: h.World) -> float:
    slot = SlotAccount(w.slot.uid, w.slot.gid, w.slot.path)
    argv = [
        "setpriv",
        f"--reuid={slot.uid}",
        f"--regid={slot.gid}",
        "--clear-groups",
        "env",
        "-i",
        *(f"{k}={v}" for k, v in slot.environment().items()),
        *slot.podman(w.driver.config, log_level="fatal"),
        "run",
        "--rm",
        "--name",
        container_name("f" * 32),
        "--pull=never",
        "--network=none",
        "--read-only",
        "--cap-drop=all",
        "--security-opt",
        "no-new-privileges",
        "--cgroupns=private",
        "--ipc=private",
        "--uts=private",
        "--pid=private",
        "--log-driver=passthrough",
        "--ulimit",
        "core=0:0",
        "--ulimit",
        "nofile=1024:1024",
        "--ulimit",
        "nproc=256:256",
        w.image["image_id"].removeprefix("sha256:"),
        "/bin/true",
    ]
    start = time.perf_counter()
    subprocess.run(argv, check=True, stdout=subprocess.DEVNULL)
    kill_leftovers(slot.uid)
    elapsed = time.perf_counter() - start
    reset_runtime_state(slot)
    return elapsed


def run(quick: bool) -> list[Figure]:
    repeat = 3 if quick else 11
    with h.world() as w:
        _attempt(w)  # loads the image into the slot's storage: not timed
        _bare(w)
        attempts, bares = [], []
        for _ in range(repeat):  # interleaved, so drift hits both sides alike
            attempts.append(_attempt(w))
            bares.append(_bare(w))
    value, baseline = statistics.median(attempts), statistics.median(bares)
    return [
        Figure(
            "P6",
            "attempt of `true` (provider+service+gate) vs podman run",
            value * 1000,
            "ms",
            baseline * 1000,
            value / baseline,
            target=2.0,
        )
    ]
