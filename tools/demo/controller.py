"""The controller side of the demo: every protocol step of one attempt, as a client.

This is what a controller's transport does on the host, over `transport.sock` with
`ficc.execution.client.Client`, as the transport account (the daemon checks the
peer's UID with SO_PEERCRED: root would be refused on this socket). `as_account`
forks a child that drops to that account before it connects.

The steps: snapshot (and save the admission bindings), build the plan, prepare with
the first lease, stream the input in chunks (`input_status`, `input_write`), observe
until ready, start, observe until finished and cleaned up, collect stdout, stderr and
the declared output, release. Each step prints one line with the attempt's record.
Waiting is polling `observe` with a deadline, never a fixed sleep.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from demo import job, report
from demo.layout import PROVIDER, SLOT_CLASS, SLOT_ID
from ficc.execution.client import Client, ClientError
from ficc.execution.plan import Plan, digest_of, encode_plan, plan_digest
from ficc.execution.protocol import (
    CollectRequest,
    Fence,
    InputStatusRequest,
    InputWrite,
    InputWriteRequest,
    ObjectRef,
    ObserveRequest,
    PrepareAttempt,
    PrepareRequest,
    Read,
    ReleaseRequest,
    Renewal,
    Request,
    SnapshotRequest,
    StartRequest,
    StopRequest,
)
from ficc.execution.wire import (
    TERMINAL,
    AnyReply,
    AttemptRow,
    AttemptStatus,
    ErrorReply,
    ErrorRow,
    InputRow,
    InputsReply,
    ReadRow,
    SnapshotReply,
)
from ficc_testkit.accounts import Account, run_as
from ficc_testkit.driver import chunks
from ficc_testkit.plans import new_id
from ficc_testkit.waits import now_ms

LEASE_SECONDS = 600
READY_TIMEOUT = 300.0
"""The first prepare of a slot loads the image into its Podman storage: allow time."""
RUN_TIMEOUT = 300.0
CLEANUP_TIMEOUT = 120.0
POLL = 0.1
MEANING = {
    "prepared": "prepared",
    "starting": "starting: the host creates the service; the container waits at the barrier",
    "running": "running: the payload gate passed and the host released the payload",
}
"""What a state seen while waiting means, for the step line."""
READ_BYTES = 256 * 1024


class JobFailed(Exception):
    """A step did not do what the demo expects; the message says what and why."""

    def __init__(self, step: str, message: str) -> None:
        super().__init__(f"{step}: {message}")
        self.step = step
        self.message = message


@dataclass(frozen=True)
class Target:
    """What the controller knows before it starts: where the host is and what to run."""

    socket: str
    out_dir: str
    deployment_id: str
    node_id: str
    image_id: str
    ids: job.JobIds


@dataclass
class Result:
    """What the controller reports back to the demo (as JSON over a pipe)."""

    ok: bool = False
    error: str = ""
    steps: list[dict[str, Any]] = field(default_factory=list)
    collected: dict[str, str] = field(default_factory=dict)


class Controller:
    """One attempt, step by step (see the module docstring)."""

    def __init__(self, target: Target, emit: Callable[[str], None]) -> None:
        self.target = target
        self.client = Client(target.socket)
        self.emit = emit
        self.steps: list[report.Step] = []
        self.collected: dict[str, bytes] = {}
        self.record: AttemptStatus | None = None
        self.plan: Plan | None = None
        self.bindings: dict[str, Any] = {}
        self.chunk_bytes = job.CHUNK_BYTES
        self.provider_digest = ""
        self.offer_revision = 1

    # --- plumbing ----------------------------------------------------------------------

    async def send(self, step: str, request: Request) -> AnyReply:
        try:
            reply = await self.client.request(request)
        except ClientError as exc:
            raise JobFailed(step, f"no trustworthy reply ({type(exc).__name__}): {exc}") from None
        if isinstance(reply, ErrorReply):
            raise JobFailed(step, f"refused: {reply.error.code}: {reply.error.message}")
        return reply

    async def one_row(self, step: str, request: Request) -> Any:
        reply = await self.send(step, request)
        (row,) = reply.results  # type: ignore[union-attr]
        if isinstance(row, ErrorRow):
            raise JobFailed(step, f"row refused: {row.error.code}: {row.error.message}")
        if isinstance(row, AttemptRow):
            self.record = row
        return row

    def done(self, name: str, detail: str, started: float) -> None:
        step = report.of_record(name, self.record, detail, time.monotonic() - started)
        self.steps.append(step)
        self.emit(report.line(step))

    @property
    def fence(self) -> Fence:
        assert self.plan is not None
        return Fence(self.plan.attempt_id, self.plan.generation, plan_digest(self.plan))

    def save(self, name: str, data: bytes) -> None:
        Path(self.target.out_dir, name).write_bytes(data)

    async def observe(self, step: str) -> AttemptRow:
        row: AttemptRow = await self.one_row(
            step, ObserveRequest(version=1, id=new_id(), attempts=[self.fence])
        )
        return row

    async def wait_for(
        self, step: str, accept: Callable[[AttemptRow], bool], timeout: float, what: str
    ) -> tuple[AttemptRow, int, float]:
        """Observe until `accept(row)`; prints a line whenever the state changes.

        Returns the accepted row, the number of polls, and when the last line was
        printed (the caller's closing line measures from there, so no time is counted
        twice in the summary).
        """
        deadline = time.monotonic() + timeout
        polls, started = 0, time.monotonic()
        seen = (self.record.state, self.record.ready) if self.record else None
        while True:
            row = await self.observe(step)
            polls += 1
            if accept(row):
                return row, polls, started
            if (row.state, row.ready) != seen:
                seen = (row.state, row.ready)
                meaning = MEANING.get(row.state, f"now {row.state}")
                self.done(step, f"{meaning}; waiting for {what}", started)
                started = time.monotonic()
            if time.monotonic() > deadline:
                raise JobFailed(step, f"waited {timeout:.0f} s for {what}; last record: {row}")
            await asyncio.sleep(POLL)

    # --- the steps ---------------------------------------------------------------------

    async def run(self) -> None:
        await self.snapshot()
        self.build_plan()
        await self.prepare()
        await self.stream_input()
        await self.until_ready()
        await self.start()
        finished = await self.until_finished()
        await self.until_cleaned_up()
        await self.collect()
        await self.release()
        output = f"output:{job.OUTPUT_NAME}"
        if finished.outcome == "succeeded" and output not in self.collected:
            raise JobFailed("collect", f"the payload succeeded but left no {output}")
        if finished.outcome != "succeeded":
            stderr = self.collected.get("stderr", b"").decode(errors="replace")
            raise JobFailed(
                "outcome",
                f"the attempt ended {finished.outcome} (reason {finished.reason}, exit code "
                f"{finished.exit_code}); payload stderr:\n{report.indented(stderr)}",
            )

    async def snapshot(self) -> None:
        started = time.monotonic()
        reply = await self.send("snapshot", SnapshotRequest(version=1, id=new_id()))
        assert isinstance(reply, SnapshotReply)
        self.bindings = reply.bindings()
        self.save("bindings.json", json.dumps(self.bindings, indent=2).encode() + b"\n")
        self.chunk_bytes = min(job.CHUNK_BYTES, reply.input_chunk_bytes)
        provider = next((p for p in reply.capacity.providers if p.id == PROVIDER), None)
        if provider is None or not provider.available:
            raise JobFailed(
                "snapshot",
                f"provider {PROVIDER!r} is not available on the host (it failed its pin or "
                "its configuration check): see the daemon log",
            )
        self.provider_digest = provider.package_digest
        self.offer_revision = reply.offer.revision
        free = sum(c.free for c in reply.capacity.slot_classes if c.class_ == SLOT_CLASS)
        self.done(
            "snapshot",
            f"offer {reply.offer.control} (revision {reply.offer.revision}), {free} free "
            f"{SLOT_CLASS!r} slot, provider {PROVIDER} available; bindings saved "
            f"(ledger {reply.ledger_id})",
            started,
        )

    def build_plan(self) -> None:
        started = time.monotonic()
        t = self.target
        self.plan = job.build_plan(
            t.ids,
            deployment_id=t.deployment_id,
            node_id=t.node_id,
            offer_revision=self.offer_revision,
            provider_digest=self.provider_digest,
            image_id=t.image_id,
        )
        self.save("plan.json", encode_plan(self.plan))
        self.done("plan", f"attempt {t.ids.attempt_id}, digest {plan_digest(self.plan)}", started)

    async def prepare(self) -> None:
        started = time.monotonic()
        assert self.plan is not None
        fence = self.fence
        lease = Renewal(
            attempt_id=fence.attempt_id,
            generation=fence.generation,
            plan_digest=fence.plan_digest,
            sequence=1,
            expires_at_ms=now_ms() + LEASE_SECONDS * 1000,
        )
        request = PrepareRequest(
            version=1,
            id=new_id(),
            **self.bindings,
            attempts=[PrepareAttempt(plan=self.plan, lease=lease)],
        )
        row = await self.one_row("prepare", request)
        if row.state != "prepared":
            raise JobFailed("prepare", f"admitted as {row.state} (reason {row.reason})")
        self.done(
            "prepare", f"admitted: slot {row.slot} reserved, lease {LEASE_SECONDS} s", started
        )

    def input_ref(self) -> ObjectRef:
        f = self.fence
        return ObjectRef(f.attempt_id, f.generation, f.plan_digest, self.target.ids.input_id)

    async def input_status(self) -> InputRow | ErrorRow:
        reply = await self.send(
            "input_status",
            InputStatusRequest(version=1, id=new_id(), objects=[self.input_ref()]),
        )
        assert isinstance(reply, InputsReply)  # decode_reply picks it for input_status
        (row,) = reply.results
        return row

    async def stream_input(self) -> None:
        # Staging is initialised right after prepare's reply: until then the row says
        # `inputs_preparing`. Wait for the first real status: the durable offset.
        started = time.monotonic()
        deadline = started + 60
        while True:
            status = await self.input_status()
            if not (isinstance(status, ErrorRow) and status.error.code == "inputs_preparing"):
                break
            if time.monotonic() > deadline:
                raise JobFailed("input_status", "staging was not initialised within 60 s")
            await asyncio.sleep(POLL)
        if isinstance(status, ErrorRow):
            raise JobFailed("input_status", f"{status.error.code}: {status.error.message}")
        await self.observe("input_status")
        self.done(
            "input_status",
            f"{job.INPUT_NAME}: staging ready, durable offset {status.offset} of "
            f"{status.bytes} bytes",
            started,
        )
        data, offset = job.INPUT_TEXT, status.offset
        pieces = list(chunks(data, self.chunk_bytes))
        for number, (start, chunk) in enumerate(pieces, 1):
            if start + len(chunk) <= offset:
                continue  # already durable (a resumed stream)
            started = time.monotonic()
            f = self.fence
            write = InputWrite(
                attempt_id=f.attempt_id,
                generation=f.generation,
                plan_digest=f.plan_digest,
                object=self.target.ids.input_id,
                offset=start,
                data=base64.b64encode(chunk).decode(),
                digest=digest_of(chunk),
            )
            row: InputRow = await self.one_row(
                "input_write", InputWriteRequest(version=1, id=new_id(), writes=[write])
            )
            await self.observe("input_write")
            done = " (complete)" if row.complete else ""
            self.done(
                f"input_write {number}/{len(pieces)}",
                f"bytes {start}-{start + len(chunk)} -> durable offset {row.offset}/{row.bytes}"
                + done,
                started,
            )
        started = time.monotonic()
        final = await self.input_status()
        if isinstance(final, ErrorRow) or not final.complete:
            raise JobFailed("input_status", f"the input is not complete after streaming: {final}")
        await self.observe("input_status")
        self.done("input_status", f"{job.INPUT_NAME}: complete, digest {final.digest}", started)

    async def until_ready(self) -> None:
        row, polls, started = await self.wait_for(
            "observe: ready",
            lambda r: r.ready or r.state != "prepared",
            READY_TIMEOUT,
            "ready (the provider prepares the image and inputs)",
        )
        if row.state != "prepared":
            raise JobFailed("observe", f"preparation failed: {row.state}, reason {row.reason}")
        self.done(
            "observe: ready",
            f"ready after {polls} polls: the provider prepared image, inputs and argv",
            started,
        )

    async def start(self) -> None:
        started = time.monotonic()
        row = await self.one_row(
            "start", StartRequest(version=1, id=new_id(), attempts=[self.fence])
        )
        self.done("start", f"accepted ({row.state} is durable before anything is created)", started)

    async def until_finished(self) -> AttemptRow:
        row, _, started = await self.wait_for(
            "observe: finished", lambda r: r.state in TERMINAL, RUN_TIMEOUT, "the payload to end"
        )
        self.done(
            "observe: finished",
            f"the payload ended: exit code {row.exit_code}, reason {row.reason}",
            started,
        )
        return row

    async def until_cleaned_up(self) -> None:
        _, _, started = await self.wait_for(
            "observe: cleanup", lambda r: r.cleanup_confirmed, CLEANUP_TIMEOUT, "cleanup"
        )
        self.done(
            "observe: cleanup",
            "cleanup confirmed: the service is stopped, no process of the slot account left",
            started,
        )

    async def collect(self) -> None:
        for name in ("stdout", "stderr", f"output:{job.OUTPUT_NAME}"):
            started = time.monotonic()
            try:
                data, last = await self.read_all(name)
            except JobFailed as failure:
                if not name.startswith("output:") or "object_unavailable" not in failure.message:
                    raise
                # A payload that failed may never have written its output: report the
                # outcome (below), not the missing file.
                self.done(f"collect {name}", "not written by the payload", started)
                continue
            self.collected[name] = data
            self.save(name.replace(":", "-"), data)
            state = "complete" if last.complete else "not yet complete"
            self.done(f"collect {name}", f"{len(data)} bytes, {state}", started)

    async def read_all(self, name: str) -> tuple[bytes, ReadRow]:
        """Read an object from offset 0 to its end, in bounded reads.

        The file's `identity` must not change between reads: if it did, the object was
        replaced and the earlier bytes are not part of it.
        """
        f, data, identity = self.fence, b"", None
        while True:
            read = Read(f.attempt_id, f.generation, f.plan_digest, name, len(data), READ_BYTES)
            row: ReadRow = await self.one_row(
                "collect", CollectRequest(version=1, id=new_id(), reads=[read])
            )
            if identity not in (None, row.identity):
                raise JobFailed("collect", f"{name} was replaced while it was being read")
            identity = row.identity
            data += row.data
            if row.eof:
                return data, row

    async def release(self) -> None:
        started = time.monotonic()
        row = await self.one_row(
            "release", ReleaseRequest(version=1, id=new_id(), attempts=[self.fence])
        )
        self.done(
            "release", f"slot {SLOT_ID} free again; the record keeps outcome {row.outcome}", started
        )

    async def abandon(self) -> None:
        """After a failure: stop the attempt and release it if the host confirms cleanup."""
        if self.plan is None or self.record is None or self.record.state == "released":
            return
        self.emit("  cleaning up the attempt after the failure: stop, wait for cleanup, release")
        with contextlib.suppress(JobFailed):
            started = time.monotonic()
            await self.one_row("stop", StopRequest(version=1, id=new_id(), attempts=[self.fence]))
            self.done("stop", "requested: the host stops the attempt's service", started)
        with contextlib.suppress(JobFailed):
            await self.wait_for(
                "observe",
                lambda r: r.state in TERMINAL and r.cleanup_confirmed,
                CLEANUP_TIMEOUT,
                "confirmed cleanup",
            )
            await self.release()

    def result(self, error: str = "") -> Result:
        return Result(
            ok=not error,
            error=error,
            steps=[asdict(s) for s in self.steps],
            collected={k: v.decode(errors="replace") for k, v in self.collected.items()},
        )


async def run_controller(target: Target, emit: Callable[[str], None]) -> Result:
    controller = Controller(target, emit)
    emit(report.header())
    try:
        await controller.run()
    except JobFailed as failure:
        emit(f"  FAILED at {failure.step}: {failure.message}")
        last = controller.record
        if last is not None:
            emit(f"  last record: {msgspec.json.encode(last).decode()}")
        await controller.abandon()
        return controller.result(str(failure))
    return controller.result()


# --- running it as the transport account --------------------------------------------------


def as_account(account: Account, target: Target) -> Result:
    """Run the controller in a forked child with the account's UID and GID and no groups
    (the test kit's `run_as`).

    The child inherits every imported module, so the account never has to read the
    source tree. It prints its step lines itself and sends the Result back as JSON.
    """

    def controller() -> bytes:
        return json.dumps(asdict(asyncio.run(run_controller(target, _print)))).encode()

    try:
        raw = run_as(account, controller)
    except AssertionError as crashed:  # its message carries the child's traceback
        return Result(error=f"the controller crashed:\n{crashed}")
    try:
        return Result(**json.loads(raw))
    except (ValueError, TypeError):
        return Result(error=f"the controller process sent no result ({len(raw)} bytes)")


def _print(text: str) -> None:
    print(text, flush=True)
