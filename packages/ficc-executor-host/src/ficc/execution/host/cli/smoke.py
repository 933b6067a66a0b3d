"""`ficc-executor smoke-test`: one small job end to end through the running daemon.

An administrator's first job, and the check after every upgrade: it proves the whole
path a controller uses (the transport socket and its peer check, admission, the
provider's prepare with a configured image, the service, the gate, the payload, the
exit, collect and release) with nothing but the configuration file.

As root it reads the configuration and takes the administrator's snapshot (the
bindings, the offer revision, the provider's pin). The job itself runs in a forked
child that drops to the transport account before it connects, exactly as a
controller's transport would: the transport socket refuses root. Each step prints a
line; the verdict comes last. The attempt is always released (stopped first if it is
still running), so nothing of it is left behind; the ledger keeps its record, as it
keeps every attempt's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ficc.execution import plan as planlib
from ficc.execution.client import Client, ClientError
from ficc.execution.host.config.load import load_config
from ficc.execution.host.config.model import Config
from ficc.execution.host.core.authority import SocketKind
from ficc.execution.host.core.codes import HostCode
from ficc.execution.host.core.errors import HostError
from ficc.execution.host.core.records import OFFER_ALLOWS
from ficc.execution.host.daemon.peercred import socket_paths
from ficc.execution.protocol import (
    CollectRequest,
    Fence,
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
from ficc.execution.wire import TERMINAL, AttemptRow, ErrorReply, ErrorRow, ReadRow, SnapshotReply

MARKER = "ficc smoke test: the payload ran"
DEFAULT_ARGV = ("/bin/sh", "-c", f"echo '{MARKER}'")
POLL_S = 0.1
STDOUT_BYTES = 4096


class SmokeFailed(Exception):
    """A step did not do what a working host does; `str` says which and why."""


@dataclass(frozen=True)
class Job:
    """What the root side hands the transport side: where to connect and what to run."""

    socket: str
    plan: planlib.Plan
    bindings: dict[str, Any]
    lease_s: int
    timeout_s: float
    expect_marker: bool


# --- the root side: choose the job ------------------------------------------------------


def _provider_image(config: Config, provider_id: str | None, image: str | None) -> tuple[str, str]:
    """(provider id, image digest): the named ones, or the first provider with images."""
    for provider in config.providers:
        if provider_id is not None and provider.id != provider_id:
            continue
        images = provider.configuration.get("images") or []
        digests = [i.get("digest") for i in images if isinstance(i, dict)]
        if image is not None:
            return provider.id, image
        if digests and isinstance(digests[0], str):
            return provider.id, digests[0]
    named = f"provider {provider_id!r}" if provider_id else "any provider"
    raise HostError(
        HostCode.SMOKE_NO_IMAGE,
        f"{named} of the configuration has no image configured; add one to its `images`"
        ' (docs/operations.md, "Adding an image") or name one with --image',
    )


def choose_plan(config: Config, snapshot: SnapshotReply, args: argparse.Namespace) -> planlib.Plan:
    """The smoke job's plan, fitted to the current offer and the chosen slot class."""
    provider_id, image = _provider_image(config, args.provider, args.image)
    pins = {p.id: p for p in snapshot.capacity.providers}
    pin = pins.get(provider_id)
    if pin is None or not pin.available:
        raise HostError(
            HostCode.SMOKE_PROVIDER_UNAVAILABLE,
            f"provider {provider_id!r} is not available on this host (it failed its pin or"
            " its configuration check): `ficc-executor check-config --config PATH` says why",
        )
    offer = snapshot.offer
    if not {"admit", "start"} <= OFFER_ALLOWS[offer.control]:
        raise HostError(
            HostCode.SMOKE_OFFER_CLOSED,
            f"the offer is {offer.control}, so no job is admitted or started: set it to"
            f" active first (a `set_offer` with expected_revision {offer.revision} and"
            ' control "active" through `ficc-executor request --socket .../admin.sock`)',
        )
    slot_class = args.slot_class or config.slots[0].slot_class
    classes = {c.class_: c for c in snapshot.capacity.slot_classes}
    if slot_class not in classes:
        raise HostError(HostCode.SMOKE_SLOT_CLASS, f"no slot of class {slot_class!r} is configured")
    if classes[slot_class].free == 0:
        raise HostError(
            HostCode.SMOKE_NO_FREE_SLOT,
            f"every {slot_class!r} slot is in use; run the smoke test when one is free",
        )
    offered = snapshot.offer.limits.projects or list(config.ceiling.projects)
    project = offered[0] if offered else secrets.token_hex(16)
    ceiling = config.ceiling
    return planlib.Plan(
        version=1,
        deployment_id=config.deployment_id,
        node_id=config.node_id,
        project_id=project,
        job_id=secrets.token_hex(16),
        attempt_id=secrets.token_hex(16),
        generation=1,
        offer_revision=snapshot.offer.revision,
        job=planlib.Job(
            name="smoke-test",
            slot_class=slot_class,
            runtime=planlib.Runtime(provider_id, pin.package_digest, image, args.isolation, "none"),
            payload=planlib.Payload(argv=_payload_argv(args), environment={}),
            limits=planlib.Limits(
                cpu_millis=min(500, ceiling.cpu_millis),
                memory_bytes=min(256 << 20, ceiling.memory_bytes),
                swap_bytes=0,
                processes=min(128, ceiling.processes),
                storage_bytes=min(16 << 20, classes[slot_class].bytes),
                storage_inodes=min(1000, classes[slot_class].inodes),
                devices=[],
            ),
            inputs=[],
            outputs=[],
            sensitive=False,
        ),
    )


def _payload_argv(args: argparse.Namespace) -> list[str]:
    given = list(args.argv or [])
    return (given[1:] if given[:1] == ["--"] else given) or list(DEFAULT_ARGV)


# --- the transport side: run it -----------------------------------------------------------


class Runner:
    """The steps, as the transport account; `say` prints one step line."""

    def __init__(self, job: Job, say: Callable[[str], None]) -> None:
        self.job = job
        self.say = say
        self.client = Client(job.socket)
        plan = job.plan
        self.fence = Fence(plan.attempt_id, plan.generation, planlib.plan_digest(plan))
        self.admitted = False

    async def send(self, step: str, request: Request) -> Any:
        try:
            reply = await self.client.request(request)
        except ClientError as error:
            raise SmokeFailed(f"{step}: no reply ({type(error).__name__}: {error})") from None
        if isinstance(reply, ErrorReply):
            raise SmokeFailed(f"{step}: refused: {reply.error.code}: {reply.error.message}")
        return reply

    async def row(self, step: str, request: Request) -> Any:
        (row,) = (await self.send(step, request)).results
        if isinstance(row, ErrorRow):
            raise SmokeFailed(f"{step}: refused: {row.error.code}: {row.error.message}")
        return row

    async def observe(self) -> AttemptRow:
        request = ObserveRequest(version=1, id=secrets.token_hex(16), attempts=[self.fence])
        row: AttemptRow = await self.row("observe", request)
        return row

    async def until(self, step: str, done: Callable[[AttemptRow], bool], what: str) -> AttemptRow:
        deadline = time.monotonic() + self.job.timeout_s
        while True:
            row = await self.observe()
            if done(row):
                return row
            if time.monotonic() > deadline:
                raise SmokeFailed(
                    f"{step}: waited {self.job.timeout_s:.0f} s for {what}; the attempt is"
                    f" {row.state} (reason {row.reason})"
                )
            await asyncio.sleep(POLL_S)

    async def run(self) -> str:
        """Every step; the payload's stdout."""
        job, fence = self.job, self.fence
        expires = int(time.time() * 1000) + job.lease_s * 1000
        lease = Renewal(
            fence.attempt_id, fence.generation, fence.plan_digest, sequence=1, expires_at_ms=expires
        )
        prepare = PrepareRequest(
            version=1, id=secrets.token_hex(16), **job.bindings,
            attempts=[PrepareAttempt(plan=job.plan, lease=lease)],
        )  # fmt: skip
        row = await self.row("prepare", prepare)
        self.admitted = True
        if row.state != "prepared":
            raise SmokeFailed(f"prepare: admitted as {row.state} (reason {row.reason})")
        self.say(f"prepare: admitted into slot {row.slot}, lease {job.lease_s} s")
        row = await self.until("prepare", lambda r: r.ready or r.state != "prepared", "ready")
        if row.state != "prepared":
            raise SmokeFailed(f"prepare: the provider failed it ({row.state}, {row.reason})")
        self.say("ready: the provider prepared the image and the payload's barrier")
        await self.row("start", StartRequest(version=1, id=secrets.token_hex(16), attempts=[fence]))
        self.say("start: accepted; the host creates the service and checks the payload")
        row = await self.until("run", lambda r: r.state in TERMINAL and r.cleanup_confirmed, "end")
        stdout = await self.stdout()
        if row.state != "succeeded":
            raise SmokeFailed(
                f"run: the attempt ended {row.state} (reason {row.reason}, exit code"
                f" {row.exit_code}); the daemon's log has the runtime's own error"
                " (`journalctl -u ficc-executor-host -p err`)"
            )
        self.say(f"run: the payload exited 0; cleanup confirmed ({row.stdout_bytes} bytes out)")
        return stdout

    async def stdout(self) -> str:
        f = self.fence
        read = Read(f.attempt_id, f.generation, f.plan_digest, "stdout", 0, STDOUT_BYTES)
        request = CollectRequest(version=1, id=secrets.token_hex(16), reads=[read])
        row: ReadRow = await self.row("collect", request)
        return row.data.decode("utf-8", errors="replace")

    async def release(self) -> None:
        """Stop if still running, then release: the smoke test leaves nothing behind."""
        if not self.admitted:
            return
        row = await self.observe()
        if row.state not in TERMINAL and row.state != "released":
            await self.send("stop", StopRequest(version=1, id=secrets.token_hex(16),
                                                attempts=[self.fence]))  # fmt: skip
            row = await self.until("stop", lambda r: r.state in TERMINAL, "the stop")
        if row.state != "released":
            await self.until("cleanup", lambda r: r.cleanup_confirmed, "confirmed cleanup")
            release = ReleaseRequest(version=1, id=secrets.token_hex(16), attempts=[self.fence])
            row = await self.row("release", release)
        self.say(f"release: {row.state} (outcome {row.outcome}); the slot is free again")


def _transport_side(job: Job, uid: int, gid: int, write_fd: int) -> None:
    """The forked child: drop to the transport account, run, report JSON lines."""
    out = os.fdopen(write_fd, "w", buffering=1)

    def say(text: str) -> None:
        out.write(json.dumps({"step": text}) + "\n")

    os.setgroups([])
    os.setgid(gid)
    os.setuid(uid)
    runner = Runner(job, say)

    async def main() -> None:
        try:
            stdout = await runner.run()
            verdict: dict[str, Any] = {"ok": True, "stdout": stdout}
            if job.expect_marker and MARKER not in stdout:
                verdict = {"ok": False, "error": f"run: stdout lacks {MARKER!r}: {stdout!r}"}
        except SmokeFailed as failed:
            verdict = {"ok": False, "error": str(failed)}
        try:
            await runner.release()
        except SmokeFailed as failed:
            verdict = {"ok": False, "error": f"{verdict.get('error', '')} {failed}".strip()}
        out.write(json.dumps(verdict) + "\n")

    asyncio.run(main())


def run_as_transport(job: Job, uid: int, gid: int, print_line: Callable[[str], None]) -> bool:
    """Fork, run the job as the transport account, print its steps; the verdict."""
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child reports through the pipe
        os.close(read_fd)
        code = 0
        try:
            _transport_side(job, uid, gid, write_fd)
        except BaseException as error:  # the parent reports it
            os.write(write_fd, (json.dumps({"ok": False, "error": repr(error)}) + "\n").encode())
            code = 1
        finally:
            os._exit(code)
    os.close(write_fd)
    verdict: dict[str, Any] = {"ok": False, "error": "the transport side ended without a verdict"}
    with os.fdopen(read_fd) as lines:
        for line in lines:
            message = json.loads(line)
            if "step" in message:
                print_line(message["step"])
            else:
                verdict = message
    os.waitpid(pid, 0)
    if verdict.get("ok"):
        print_line(f"payload said: {verdict['stdout'].strip()}")
        return True
    print_line(f"FAILED: {verdict['error']}")
    return False


# --- the command -------------------------------------------------------------------------


def add_parser(commands: argparse._SubParsersAction, version: str) -> None:  # type: ignore[type-arg]
    """Register `smoke-test` on the `ficc-executor` command."""
    parser = commands.add_parser(
        "smoke-test",
        help="run one small job end to end through the running daemon",
        description=__doc__.split("\n\n")[1] if __doc__ else None,
    )
    parser.add_argument("--config", required=True, help="the daemon's configuration file")
    parser.add_argument("--provider", help="provider id (default: the first with images)")
    parser.add_argument("--image", help="image digest (default: the provider's first image)")
    parser.add_argument("--slot-class", help="slot class (default: the first slot's)")
    parser.add_argument(
        "--isolation", default="shared-kernel",
        help="the plan's isolation (default: shared-kernel, the Podman provider's)",
    )  # fmt: skip
    parser.add_argument(
        "--timeout", type=float, default=300.0,
        help="seconds to wait for each of ready, the end and cleanup (default 300)",
    )  # fmt: skip
    parser.add_argument(
        "argv", nargs=argparse.REMAINDER, metavar="-- ARGV",
        help=f"the payload's argv after `--` (default: a /bin/sh echo of {MARKER!r})",
    )  # fmt: skip
    parser.add_argument("--version", action="version", version=version)
    parser.set_defaults(run=run)


def _snapshot(socket: str) -> SnapshotReply:
    """The administrator's snapshot (root, admin.sock)."""
    request = SnapshotRequest(version=1, id=secrets.token_hex(16))
    reply = asyncio.run(Client(socket).request(request))
    if isinstance(reply, ErrorReply):
        raise HostError(reply.error.code, reply.error.message)
    assert isinstance(reply, SnapshotReply)
    return reply


def run(args: argparse.Namespace) -> int:
    started = time.monotonic()

    def say(text: str) -> None:
        print(f"[{time.monotonic() - started:6.1f} s] {text}", flush=True)

    config = load_config(args.config)
    paths = {endpoint.kind: endpoint.path for endpoint in socket_paths(config)}
    admin, transport = paths[SocketKind.ADMINISTRATOR], paths[SocketKind.TRANSPORT]
    try:
        snapshot = _snapshot(admin)
    except ClientError as error:
        raise HostError(
            HostCode.SMOKE_NO_DAEMON,
            f"the daemon does not answer on {admin} ({type(error).__name__}: {error});"
            " start it first",
        ) from None
    plan = choose_plan(config, snapshot, args)
    say(
        f"snapshot: ledger {snapshot.ledger_id}, offer revision {snapshot.offer.revision};"
        f" plan: {plan.job.runtime.provider} image {plan.job.runtime.image_digest},"
        f" class {plan.job.slot_class}, attempt {plan.attempt_id}"
    )
    job = Job(
        socket=transport,
        plan=plan,
        bindings=snapshot.bindings(),
        lease_s=min(600, config.maximum_lease_seconds),
        timeout_s=args.timeout,
        expect_marker=_payload_argv(args) == list(DEFAULT_ARGV),
    )
    uid = config.transport_uid
    gid = _primary_gid(uid)
    ok = run_as_transport(job, uid, gid, say)
    print("smoke test passed" if ok else "smoke test FAILED", flush=True)
    return 0 if ok else 1


def _primary_gid(uid: int) -> int:
    import pwd  # noqa: PLC0415 - only the command needs it

    try:
        return pwd.getpwuid(uid).pw_gid
    except KeyError:
        raise HostError(
            HostCode.ACCOUNT_MISSING, f"transport_uid {uid} has no account; create it first"
        ) from None


__all__ = ["DEFAULT_ARGV", "MARKER", "add_parser", "choose_plan", "run"]
