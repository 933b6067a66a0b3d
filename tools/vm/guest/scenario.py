"""Put the deployed host in a known state, churn jobs until the power is cut, and check
after the next boot that the host kept every promise (the VM lane's reboot and power
cut checks).

    scenario.py setup                     # the four attempts the checks follow
    scenario.py verify ACKS               # after a boot, check what ACKS (JSON lines) say
    scenario.py verify-churn ACKS CMD...  # verify, setup, then churn jobs (and run CMD,
                                          # the hoststate loop) until the power goes

Runs in the daemon's own venv (/opt/ficc/venv) as root; the controller's requests go
over transport.sock from a child that drops to the transport account, as
`ficc-executor smoke-test` does. Everything the host acknowledged is printed as one
`FICC-ACK {json}` line on the serial console the moment the reply arrives, so the
host (outside the guest) knows what must survive a cut. What `setup` leaves:

- `partial`: admitted, a streamed input of 8 chunks with 3 written (acked offsets);
- `running`: started, its payload sleeping (running when the power goes);
- `finished`: succeeded and cleaned up, not released;
- `released`: run and released.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import json
import os
import pwd
import secrets
import sqlite3
import subprocess
import sys
import time
from typing import Any

import console

from ficc.execution import plan as planlib
from ficc.execution.client import Client
from ficc.execution.host.config.load import load_config
from ficc.execution.host.ledger.store import LEDGER_FILE
from ficc.execution.protocol import (
    Fence,
    InputWrite,
    InputWriteRequest,
    ObserveRequest,
    PrepareAttempt,
    PrepareRequest,
    ReleaseRequest,
    Renewal,
    SnapshotRequest,
    StartRequest,
    StopRequest,
)
from ficc.execution.wire import TERMINAL, AttemptRow, ErrorReply, ErrorRow

CONFIG = "/etc/ficc/executor-host.toml"
CHUNK = 64 * 1024
CHUNKS = 8
WAIT_S = float(os.environ.get("FICC_VM_WAIT_S", "900"))
"""How long to wait for one attempt's state change (the guest is slow)."""
REPLY_S = float(os.environ.get("FICC_VM_REPLY_S", "300"))
"""How long one reply may take: two guests of one emulated CPU each, sharing two cores,
kept a daemon from answering for over 30 s (the client's default)."""


def note(text: str) -> None:
    console.line("scenario:", text)


class Failed(Exception):
    pass


class Controller:
    """The transport side: one connection's worth of requests, with ack lines."""

    def __init__(self, socket: str, facts: dict[str, Any]) -> None:
        self.client = Client(socket, connect_timeout=REPLY_S, read_timeout=REPLY_S)
        self.facts = facts
        self.bindings: dict[str, Any] = {}

    async def send(self, request: Any) -> Any:
        reply = await self.client.request(request)
        if isinstance(reply, ErrorReply):
            raise Failed(f"{type(request).__name__}: {reply.error.code}: {reply.error.message}")
        return reply

    async def row(self, request: Any) -> Any:
        (row,) = (await self.send(request)).results
        if isinstance(row, ErrorRow):
            raise Failed(f"{type(request).__name__}: {row.error.code}: {row.error.message}")
        return row

    async def snapshot(self) -> Any:
        snap = await self.send(SnapshotRequest(version=1, id=secrets.token_hex(16)))
        self.bindings = snap.bindings()
        return snap

    def plan(self, argv: list[str], data: bytes | None, revision: int) -> planlib.Plan:
        f = self.facts
        inputs = []
        if data is not None:
            inputs.append(planlib.InputObject(
                id=secrets.token_hex(16), name="data.bin", bytes=len(data),
                digest="sha256:" + hashlib.sha256(data).hexdigest(), delivery="stream",
            ))  # fmt: skip
        return planlib.Plan(
            version=1, deployment_id=f["deployment_id"], node_id=f["node_id"],
            project_id=f["project"], job_id=secrets.token_hex(16),
            attempt_id=secrets.token_hex(16), generation=1, offer_revision=revision,
            job=planlib.Job(
                name="vm-lane", slot_class="small",
                runtime=planlib.Runtime("podman", f["package_digest"], f["image"],
                                        "shared-kernel", "none"),
                payload=planlib.Payload(argv=argv, environment={}),
                limits=planlib.Limits(cpu_millis=500, memory_bytes=128 << 20, swap_bytes=0,
                                      processes=64, storage_bytes=16 << 20,
                                      storage_inodes=1000, devices=[]),
                inputs=inputs, outputs=[], sensitive=False,
            ),
        )  # fmt: skip

    async def prepare(self, argv: list[str], data: bytes | None = None) -> tuple[Fence, Any]:
        snap = await self.snapshot()
        plan = self.plan(argv, data, snap.offer.revision)
        fence = Fence(plan.attempt_id, plan.generation, planlib.plan_digest(plan))
        expires = int(time.time() * 1000) + 600_000
        lease = Renewal(fence.attempt_id, 1, fence.plan_digest, sequence=1, expires_at_ms=expires)
        request = PrepareRequest(version=1, id=secrets.token_hex(16), **self.bindings,
                                 attempts=[PrepareAttempt(plan=plan, lease=lease)])  # fmt: skip
        row = await self.row(request)
        console.ack("admit", **_fence(fence), state=row.state, slot=row.slot)
        if row.state != "prepared":
            raise Failed(f"admitted as {row.state} ({row.reason})")
        return fence, plan

    async def write(self, fence: Fence, plan: planlib.Plan, data: bytes, chunks: int) -> None:
        (obj,) = plan.job.inputs
        for index in range(chunks):
            piece = data[index * CHUNK : (index + 1) * CHUNK]
            write = InputWrite(
                fence.attempt_id, fence.generation, fence.plan_digest, obj.id, index * CHUNK,
                base64.b64encode(piece).decode(), "sha256:" + hashlib.sha256(piece).hexdigest(),
            )  # fmt: skip
            row = await self.accepted(InputWriteRequest(version=1, id=secrets.token_hex(16),
                                                        writes=[write]))  # fmt: skip
            console.ack("input", **_fence(fence), object=obj.id, offset=row.offset)

    async def accepted(self, request: InputWriteRequest) -> Any:
        """The write's row, retried while the daemon still initializes the staging
        directory (`inputs_preparing`: retry on a later polling cycle, as documented)."""
        deadline = time.monotonic() + WAIT_S
        while True:
            (row,) = (await self.send(request)).results
            if not isinstance(row, ErrorRow):
                return row
            if row.error.code != "inputs_preparing" or time.monotonic() > deadline:
                raise Failed(f"InputWriteRequest: {row.error.code}: {row.error.message}")
            await asyncio.sleep(0.2)
            request = InputWriteRequest(version=1, id=secrets.token_hex(16), writes=request.writes)

    async def observe(self, fence: Fence) -> AttemptRow:
        """The row, with the runtime's own words (`detail`) when a start failed: a
        failure the lane reports then says what Podman printed."""
        request = ObserveRequest(version=1, id=secrets.token_hex(16), attempts=[fence], detail=True)
        row: AttemptRow = await self.row(request)
        return row

    async def until(self, fence: Fence, done: Any, what: str) -> AttemptRow:
        deadline = time.monotonic() + WAIT_S
        while True:
            row = await self.observe(fence)
            if done(row):
                return row
            if time.monotonic() > deadline:
                raise Failed(f"{fence.attempt_id}: no {what} in {WAIT_S:.0f} s ({row.state})")
            await asyncio.sleep(0.2)

    async def start(self, fence: Fence) -> None:
        await self.until(fence, lambda r: r.ready or r.state != "prepared", "ready")
        await self.row(StartRequest(version=1, id=secrets.token_hex(16), attempts=[fence]))
        console.ack("start", **_fence(fence))

    async def release(self, fence: Fence) -> AttemptRow:
        row = await self.observe(fence)
        if row.state == "released":
            return row
        if row.state not in TERMINAL:
            await self.row(StopRequest(version=1, id=secrets.token_hex(16), attempts=[fence]))
        await self.until(fence, lambda r: r.state in TERMINAL and r.cleanup_confirmed, "cleanup")
        row = await self.row(ReleaseRequest(version=1, id=secrets.token_hex(16), attempts=[fence]))
        console.ack("release", **_fence(fence), outcome=row.outcome)
        return row

    async def run_to_end(self, fence: Fence) -> AttemptRow:
        await self.start(fence)
        row = await self.until(fence, lambda r: r.state in TERMINAL and r.cleanup_confirmed, "end")
        console.ack("finished", **_fence(fence), state=row.state)
        return row


def _fence(fence: Fence) -> dict[str, Any]:
    return {"attempt": fence.attempt_id, "generation": fence.generation,
            "plan_digest": fence.plan_digest}  # fmt: skip


def _from(ack: dict[str, Any]) -> Fence:
    return Fence(ack["attempt"], ack["generation"], ack["plan_digest"])


# --- the scenarios ----------------------------------------------------------------------


async def setup(c: Controller) -> None:
    """The four attempts at once, one in each slot (the guest is slow: one after the
    other they took most of a minute)."""

    async def released() -> None:
        fence, _ = await c.prepare(["/bin/sh", "-c", "echo released"])
        await c.run_to_end(fence)
        await c.release(fence)
        note("released: done")

    async def finished() -> None:
        fence, _ = await c.prepare(["/bin/sh", "-c", "echo finished"])
        row = await c.run_to_end(fence)
        if row.state != "succeeded":
            raise Failed(f"the finished attempt ended {row.state} ({row.reason})")
        note("finished: done")

    async def running() -> None:
        fence, _ = await c.prepare(["/bin/sleep", "100000"])
        await c.start(fence)
        await c.until(fence, lambda r: r.state == "running", "running")
        console.ack("running", **_fence(fence))
        note("running: done")

    async def partial() -> None:
        data = os.urandom(CHUNK * CHUNKS)
        fence, plan = await c.prepare(["/bin/sh", "-c", "sha256sum /inputs/data.bin"], data)
        await c.write(fence, plan, data, 3)
        note("partial: done")

    await asyncio.gather(released(), finished(), running(), partial())


async def churn(c: Controller) -> None:
    """Jobs in the last free slot, one after another, each with a streamed input; the
    host cuts the power at a moment of its choosing."""
    console.line("FICC-VM", "cut-window")
    while True:
        data = os.urandom(CHUNK * 2)
        fence, plan = await c.prepare(["/bin/sh", "-c", "sleep 1; wc -c /inputs/data.bin"], data)
        await c.write(fence, plan, data, 2)
        await c.run_to_end(fence)
        await c.release(fence)


async def verify(c: Controller, acks: list[dict[str, Any]]) -> dict[str, int]:
    """Every acknowledged attempt is remembered and settles with cleanup confirmed;
    none that was running at the cut claims an outcome; a release acknowledged before
    the cut stays done; then everything is released.

    Acknowledged input offsets are checked in the ledger (`inputs_kept`): a boot ends
    every lease (a lease is bound to the boot that granted it), so an attempt that was
    still staging has ended and the daemon no longer answers input_status for it."""
    failures: list[str] = []
    by_attempt: dict[str, list[dict[str, Any]]] = {}
    for ack in acks:
        if "attempt" in ack:
            by_attempt.setdefault(ack["attempt"], []).append(ack)
    await asyncio.gather(*(settle(c, its, failures) for its in by_attempt.values()))
    unacknowledged = await reconcile(c, set(by_attempt), failures)
    for failure in failures:
        console.fail(failure)
    return {"attempts": len(by_attempt), "unacknowledged": unacknowledged,
            "failures": len(failures)}  # fmt: skip


async def settle(c: Controller, its: list[dict[str, Any]], failures: list[str]) -> None:
    """One acknowledged attempt: it settles as its acknowledgements allow, then it is
    released."""
    attempt, kinds, fence = its[0]["attempt"], {a["kind"] for a in its}, _from(its[0])
    try:
        row = await c.until(fence, lambda r: r.state in TERMINAL | {"released"}
                            and (r.cleanup_confirmed or r.state == "released"),
                            "settled state")  # fmt: skip
    except Failed as error:
        failures.append(f"{attempt}: acknowledged {sorted(kinds)}: {error}")
        return
    if "release" in kinds and row.state != "released":
        failures.append(f"{attempt}: its release was acknowledged, now {row.state}")
    if "running" in kinds and "finished" not in kinds and row.outcome == "succeeded":
        failures.append(f"{attempt}: was running at the cut, now claims succeeded")
    if "running" in kinds and "finished" not in kinds and row.outcome != "unknown":
        failures.append(f"{attempt}: was running at the cut, outcome {row.outcome}")
    try:
        await c.release(fence)
    except Failed as error:
        failures.append(f"{attempt}: release after the boot: {error}")


async def reconcile(c: Controller, known: set[str], failures: list[str]) -> int:
    """What a controller does after it lost replies: every attempt the host lists that
    no acknowledgement named (admitted, but the cut came before its reply reached the
    console) is remembered by the host, settles with cleanup confirmed and is
    released, so its slot is free for the next job. Returns how many there were."""
    found: list[Fence] = []
    after: str | None = None
    while True:
        snap = await c.send(SnapshotRequest(version=1, id=secrets.token_hex(16), after=after))
        found += [Fence(a.attempt_id, a.generation, a.plan_digest) for a in snap.attempts
                  if a.attempt_id not in known and a.state != "released"]  # fmt: skip
        if snap.next is None:
            break
        after = snap.next
    for fence in found:
        try:
            await c.release(fence)
        except Failed as error:
            failures.append(f"{fence.attempt_id} (unacknowledged): release after the boot: {error}")
    return len(found)


def inputs_kept(ledger: str, acks: list[dict[str, Any]]) -> tuple[int, list[str]]:
    """Every acknowledged input offset is in the ledger (read-only, as root): the
    daemon committed it before it replied, so no boot or cut may take it back."""
    acked: dict[tuple[str, str], int] = {}
    for ack in acks:
        if ack["kind"] == "input":
            key = (ack["attempt"], ack["object"])
            acked[key] = max(acked.get(key, 0), ack["offset"])
    failures = []
    with contextlib.closing(sqlite3.connect(f"file:{ledger}?mode=ro", uri=True)) as db:
        for (attempt, obj), offset in sorted(acked.items()):
            found = db.execute(
                "SELECT offset FROM input_objects WHERE attempt_id = ? AND object_id = ?",
                (attempt, obj),
            ).fetchone()
            if found is None or found[0] < offset:
                failures.append(f"{attempt}: input {obj} acknowledged at offset {offset},"
                                f" the ledger has {found and found[0]}")  # fmt: skip
    return len(acked), failures


async def next_jobs(c: Controller, slots: int) -> int:
    """One job in every slot at once: each must succeed."""
    fences = [(await c.prepare(["/bin/sh", "-c", "echo next"]))[0] for _ in range(slots)]
    rows = await asyncio.gather(*(c.run_to_end(f) for f in fences))
    for fence in fences:
        await c.release(fence)
    for row in rows:
        if row.state != "succeeded":
            console.fail(f"the next job {row.attempt_id} in slot {row.slot} ended {row.state}"
                         f" ({row.reason}; {row.detail})")  # fmt: skip
    return sum(1 for row in rows if row.state == "succeeded")


# --- root side ------------------------------------------------------------------------


def facts() -> dict[str, Any]:
    config = load_config(CONFIG)
    (provider,) = config.providers
    image = provider.configuration["images"][0]["digest"]
    return {
        "deployment_id": config.deployment_id, "node_id": config.node_id,
        "project": config.ceiling.projects[0], "package_digest": provider.package_digest,
        "image": image, "socket": os.path.join(config.socket_dir, "transport.sock"),
        "uid": config.transport_uid, "slots": len(config.slots),
        "ledger": os.path.join(config.state_dir, LEDGER_FILE),
    }  # fmt: skip


def as_transport(f: dict[str, Any], body: Any) -> Any:
    """Run `body(controller)` in a child that is the transport account; its result."""
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read_fd)
        code = 1
        try:
            os.setgroups([])
            os.setgid(pwd.getpwuid(f["uid"]).pw_gid)
            os.setuid(f["uid"])
            result = asyncio.run(body(Controller(f["socket"], f)))
            os.write(write_fd, json.dumps({"ok": True, "result": result}).encode())
            code = 0
        except BaseException as error:
            os.write(write_fd, json.dumps({"ok": False, "error": repr(error)}).encode())
        finally:
            os._exit(code)
    os.close(write_fd)
    with os.fdopen(read_fd) as pipe:
        text = pipe.read()
    os.waitpid(pid, 0)
    outcome = json.loads(text or '{"ok": false, "error": "no verdict"}')
    if not outcome["ok"]:
        raise Failed(outcome["error"])
    return outcome["result"]


def boot_order() -> list[str]:
    """Each slot's mount unit became active before the daemon's main process started."""

    def mono(unit: str, prop: str) -> int:
        out = subprocess.run(
            ["systemctl", "show", "-p", prop, "--value", unit],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        return int(out or 0)  # fmt: skip

    daemon = mono("ficc-executor-host.service", "ExecMainStartTimestampMonotonic")
    failures = [] if daemon else ["the daemon's unit has not started"]
    for n in range(4):
        unit = subprocess.run(["systemd-escape", "--path", "--suffix=mount",
                               f"/srv/ficc/slots/small-{n}"], capture_output=True, text=True,
                              check=True).stdout.strip()  # fmt: skip
        mounted = mono(unit, "ActiveEnterTimestampMonotonic")
        if not mounted or mounted > daemon:
            failures.append(f"{unit} active at {mounted}, the daemon started at {daemon}")
    return failures


def check(f: dict[str, Any], acks_path: str) -> int:
    """After a boot: what the last boot acknowledged is kept (`verify`, the ledger's
    input offsets, the boot order), then the next job in every slot runs. Every
    failure is a FICC-FAIL line; returns the exit status."""
    with open(acks_path) as file:
        acks = [json.loads(line) for line in file if line.strip()]
    failures = boot_order()
    inputs, lost = inputs_kept(f["ledger"], acks)
    failures += lost
    for failure in failures:
        console.fail(failure)
    counts = as_transport(f, lambda c: verify(c, acks))
    ran = as_transport(f, lambda c: next_jobs(c, f["slots"]))
    console.figure({"verify": counts, "inputs_checked": inputs,
                    "next_jobs_succeeded": ran, "slots": f["slots"]})  # fmt: skip
    return 1 if failures or counts["failures"] or ran != f["slots"] else 0


def main() -> int:
    """One process per boot's work: Python starts slowly in the guest."""
    command = sys.argv[1]
    f = facts()
    if command == "setup":
        as_transport(f, setup)
    elif command == "verify":
        return check(f, sys.argv[2])
    elif command == "verify-churn":
        try:
            code = check(f, sys.argv[2])
        except Exception as error:  # every cause named, and the cut still comes
            console.fail(f"the check after the boot stopped: {error!r}")
            code = 1
        console.line("FICC-VM", f"verify exit {code}")
        as_transport(f, setup)
        subprocess.Popen(sys.argv[3:])  # the hoststate loop churns beside the jobs
        as_transport(f, churn)
    return 0


if __name__ == "__main__":
    sys.exit(main())
