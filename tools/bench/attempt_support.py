"""The real daemon with the real Podman provider, for P6 (a whole attempt of `true`).

`podman_host()` builds the test kit's Podman world (ficc_testkit.podman), as the Podman
end-to-end tests do: the busybox test image as a pinned OCI archive,
ficc-provider-podman built into a wheel, installed into a root-owned prefix and pinned
by its digest, a root 0600 configuration naming the Podman provider, and `python -m
ficc.execution serve` started with NOTIFY_SOCKET and waited for READY=1. Differences,
so the figure measures one thing:
- ONE slot (one slot account, `ficc-bp6-*`), so every attempt and every baseline run
  uses the same rootless Podman storage, which holds the image after the first
  (untimed) attempt;
- the daemon gets the `Environment=` of the packaged unit, as daemon_support does.

`timed_attempt()` runs prepare -> ready -> start -> finished from one forked child
as the transport account, through the real Client over the real transport socket,
polling `observe` every POLL_S between replies. `bare_run()` is the baseline: `podman
run --rm` of the same image with the provider's isolation flags, as the slot account.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import pathlib
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import msgspec

from ficc.execution.client import Client
from ficc.execution.plan import Payload, Plan
from ficc.execution.protocol import (
    Fence,
    ObserveRequest,
    PrepareAttempt,
    PrepareRequest,
    StartRequest,
)
from ficc.execution.wire import AttemptRow, ErrorReply, ErrorRow
from ficc_provider_podman import config as podman_config
from ficc_provider_podman.account import (
    SlotAccount,
    forget_pause_process,
    kill_leftovers,
    reset_runtime_state,
)
from ficc_provider_podman.config import MAX_ULIMIT, Config
from ficc_provider_podman.container import container_name, isolation_flags
from ficc_testkit import podman
from ficc_testkit.accounts import run_as
from ficc_testkit.driver import TERMINAL, fence, renewal
from ficc_testkit.plans import new_id
from ficc_testkit.podman import PodmanWorld
from ficc_testkit.waits import now_ms

ROOT = pathlib.Path(__file__).resolve().parents[2]

POLL_S = 0.010
"""Pause between one observe reply and the next observe request."""
PHASE_TIMEOUT_S = 120.0
PROCESSES = 128
"""The plan's process limit, and so the container's nproc ulimit on both sides."""


@dataclass(frozen=True)
class Phases:
    """Seconds from sending prepare to observing ready, and from start to finished."""

    prepare_to_ready: float
    start_to_finished: float

    @property
    def whole(self) -> float:
        return self.prepare_to_ready + self.start_to_finished


@contextlib.contextmanager
def podman_host(slots: int = 1, slot_bytes: int = podman.SLOT_BYTES) -> Iterator[PodmanWorld]:
    """A started daemon with the pinned Podman provider and `slots` slots of one class
    (each a real slot filesystem, as the end-to-end suite's, and its own account); the
    offer is scaled so that every slot can hold an attempt at once. All removed after."""
    with podman.podman_world(
        podman.Sources(ROOT), "cgroupfs", slot_bytes, slots=slots, name="ficc-bp6",
        offer_per_slot=True,
    ) as world:  # fmt: skip
        yield world


def true_plan(world: PodmanWorld, argv: tuple[str, ...] = ("/bin/true",)) -> Plan:
    """A plan whose payload is `argv` itself (default `/bin/true`, no shell), tracked
    for teardown."""
    plan = world.plan("true", processes=PROCESSES)
    payload = Payload(argv=list(argv), environment={})
    job = msgspec.structs.replace(plan.job, payload=payload)
    world.plans[-1] = plan = msgspec.structs.replace(plan, job=job)
    return plan


def timed_attempt(world: PodmanWorld) -> Phases:
    """One attempt of `true`, timed in the client; then stopped/released (untimed)."""
    plan = true_plan(world)
    request = PrepareRequest(
        version=1,
        id=new_id(),
        **world.bindings(),
        attempts=[PrepareAttempt(plan=plan, lease=renewal(plan, 1, now_ms() + 300_000))],
    )
    socket = world.socket
    raw = run_as(
        world.transport, lambda: json.dumps(asyncio.run(_phases(socket, request))).encode()
    )
    result = json.loads(raw)
    world.finish(plan)
    if result["error"]:
        raise RuntimeError(f"the benchmark attempt did not finish: {result['error']}")
    return Phases(result["prepare_to_ready"], result["start_to_finished"])


async def _phases(socket: str, prepare: PrepareRequest) -> dict[str, object]:
    """Runs in the transport account's child: the timed part of one attempt."""
    client = Client(socket, read_timeout=PHASE_TIMEOUT_S)
    fenced = fence(prepare.attempts[0].plan)
    began = time.perf_counter()
    _row(await client.request(prepare))
    ready = await _poll(client, fenced, lambda r: r.ready or r.state != "prepared")
    readied = time.perf_counter()
    _row(await client.request(StartRequest(version=1, id=new_id(), attempts=[fenced])))
    done = await _poll(client, fenced, lambda r: r.state in TERMINAL)
    finished = time.perf_counter()
    error = None
    if (ready.state, ready.ready) != ("prepared", True):
        error = f"not ready: {ready}"
    elif (done.state, done.exit_code) != ("succeeded", 0):
        error = f"not succeeded: {done}"
    return {
        "prepare_to_ready": readied - began,
        "start_to_finished": finished - readied,
        "error": error,
    }


async def _poll(client: Client, fence: Fence, accept: Callable[[AttemptRow], bool]) -> AttemptRow:
    deadline = time.monotonic() + PHASE_TIMEOUT_S
    while True:
        row = _row(await client.request(ObserveRequest(version=1, id=new_id(), attempts=[fence])))
        if accept(row):
            return row
        if time.monotonic() > deadline:
            raise RuntimeError(f"no progress within {PHASE_TIMEOUT_S} s: {row}")
        await asyncio.sleep(POLL_S)


def _row(reply: object) -> AttemptRow:
    if isinstance(reply, ErrorReply):
        raise RuntimeError(f"refused: {reply.error.code}: {reply.error.message}")
    (row,) = reply.results  # type: ignore[attr-defined]
    if isinstance(row, ErrorRow):
        raise RuntimeError(f"row refused: {row.error.code}: {row.error.message}")
    assert isinstance(row, AttemptRow), row
    return row


def bare_run(world: PodmanWorld) -> float:
    """The baseline in the daemon's world: its one slot, storage and configuration."""
    (account,) = world.slots
    config = podman_config.load(world.layout.config.providers[0].configuration)
    slot_path = world.layout.slot_paths[0]
    return bare_run_as(account.uid, account.gid, slot_path, config, world.image)


def bare_run_as(
    uid: int, gid: int, slot_path: object, config: Config, image: dict[str, str]
) -> float:
    """`podman run --rm IMAGE /bin/true` as the slot account with the provider's
    isolation flags (container.run_argv); seconds. The slot account's leftovers (the
    rootless pause process) are removed afterwards, untimed, so the next attempt's
    provider finds the account idle."""
    slot = SlotAccount(uid, gid, str(slot_path))
    argv = bare_argv(slot, config, image, ("/bin/true",))
    start = time.perf_counter()
    subprocess.run(argv, check=True, stdout=subprocess.DEVNULL, cwd=slot.config_home)
    elapsed = time.perf_counter() - start
    bare_cleanup(slot)
    return elapsed


def bare_argv(
    slot: SlotAccount, config: Config, image: dict[str, str], payload: tuple[str, ...]
) -> list[str]:
    """`podman run --rm` of `payload` in the image, as the slot account, with the
    provider's isolation flags and the plan's process limit."""
    nproc = min(PROCESSES, MAX_ULIMIT)
    return [
        "setpriv",
        f"--reuid={slot.uid}",
        f"--regid={slot.gid}",
        "--clear-groups",
        "env",
        "-i",
        *(f"{k}={v}" for k, v in slot.environment().items()),
        *slot.podman(config, log_level="fatal"),
        "run",
        "--rm",
        "--name",
        container_name(f"{slot.uid:032x}"),
        *isolation_flags(config, nproc),
        image["image_id"].removeprefix("sha256:"),
        *payload,
    ]


def bare_cleanup(slot: SlotAccount) -> None:
    """After a bare run: the account's leftovers killed and Podman's runtime state
    forgotten, as the provider does around its own commands."""
    kill_leftovers(slot.uid)
    reset_runtime_state(slot)
    forget_pause_process(slot)
