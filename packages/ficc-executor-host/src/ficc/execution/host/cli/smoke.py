"""`ficc-executor smoke-test`: one small job end to end through the running daemon.

An administrator's first job, and the check after every upgrade: it proves the whole
path a controller uses (the transport socket and its peer check, admission, the
provider's prepare with a configured image, the service, the gate, the payload, the
exit, collect and release) with nothing but the configuration file.

It is `ficc-executor run`'s job, made small: the same plan filling (cli/job_plan.py,
with limits of at most half a CPU, 256 MiB, 128 processes and 16 MiB of storage), the
same steps (cli/job_steps.py) and the same shell (cli/job_shell.py). As root it reads
the configuration and takes the administrator's snapshot (the bindings, the offer
revision, the provider's pin). The job itself runs in a forked child that drops to the
transport account before it connects, exactly as a controller's transport would: the
transport socket refuses root. Each step prints a line; the verdict comes last. The
attempt is always released (stopped first if it is still running), so nothing of it
is left behind; the ledger keeps its record, as it keeps every attempt's. Should the
release itself fail, the last line is the `run --resume` command that finishes it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import pathlib
import pwd
import secrets
import signal
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ficc.execution import plan as planlib
from ficc.execution.client import Client
from ficc.execution.host.cli import job_plan
from ficc.execution.host.cli.job_shell import Wiring, drive
from ficc.execution.host.cli.job_steps import RESERVED, Chunk, Ending, JobSteps, Phase, Result
from ficc.execution.host.cli.run import resume_command, save_state, take_snapshot
from ficc.execution.host.config.load import load_config
from ficc.execution.host.config.model import Config
from ficc.execution.host.core.authority import SocketKind
from ficc.execution.host.core.codes import HostCode
from ficc.execution.host.core.errors import HostError
from ficc.execution.host.daemon.peercred import socket_paths
from ficc.execution.wire import SnapshotReply

MARKER = "ficc smoke test: the payload ran"
DEFAULT_ARGV = ("/bin/sh", "-c", f"echo '{MARKER}'")
POLL_S = 0.1
SMALL = {
    "cpu_millis": 500,
    "memory_bytes": 256 << 20,
    "processes": 128,
    "storage_bytes": 16 << 20,
    "storage_inodes": 1000,
}
"""The smoke job's limits: at most these, and at most one attempt's share of the offer."""


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


def choose_plan(config: Config, snapshot: SnapshotReply, args: argparse.Namespace) -> planlib.Plan:
    """The smoke job's plan: `run`'s image and command line form, with small limits."""
    document = job_plan.template(_payload_argv(args), {}, [], {}, name="smoke-test")
    choices = job_plan.Choices(
        slot_class=args.slot_class, provider=args.provider, image=args.image,
        isolation=args.isolation, network="none", at_most=SMALL,
    )  # fmt: skip
    host = job_plan.host_of(config, snapshot)
    return job_plan.fill_plan(document, host, choices, lambda: secrets.token_hex(16)).plan


def _payload_argv(args: argparse.Namespace) -> list[str]:
    given = list(args.argv or [])
    return (given[1:] if given[:1] == ["--"] else given) or list(DEFAULT_ARGV)


# --- the transport side: run it -----------------------------------------------------------


class _Steps:
    """The smoke test's reporter: each step line goes to the root side."""

    def __init__(self, say: Callable[[str], None]) -> None:
        self.say = say

    def note(self, text: str) -> None:
        """One step line."""
        self.say(text)

    def phase(self, phase: Phase) -> None:
        """The smoke test prints steps, not phases."""

    def uploaded(self, name: str, done: int, total: int) -> None:
        """The smoke job has no inputs."""


class _Stdout:
    """The payload's stdout, in memory (the one object the smoke test collects)."""

    def __init__(self) -> None:
        self.data = bytearray()

    def store(self, chunk: Chunk) -> None:
        """Keep the chunk at its offset."""
        if chunk.restart:
            self.data.clear()
        self.data[chunk.offset : chunk.offset + len(chunk.data)] = chunk.data


def verdict(result: Result, stdout: str, expect_marker: bool) -> dict[str, Any]:
    """The smoke test's verdict on a run: passed with the payload's stdout, or why not."""
    row = result.row
    reserved = result.ending in RESERVED
    if result.ending is Ending.ENDED and row is not None and row.outcome == "succeeded":
        if expect_marker and MARKER not in stdout:
            return {"ok": False, "error": f"run: stdout lacks {MARKER!r}: {stdout!r}"}
        return {"ok": True, "stdout": stdout}
    if result.ending is Ending.ENDED and row is not None:
        error = (
            f"run: the attempt ended {row.outcome} (reason {row.reason}, exit code"
            f" {row.exit_code}); the daemon's log has the runtime's own error"
            " (`journalctl -u ficc-executor-host -p err`)"
        )
        return {"ok": False, "error": error, "reserved": False}
    return {"ok": False, "error": result.message or result.ending.value, "reserved": reserved}


def _transport_side(job: Job, uid: int, gid: int, write_fd: int) -> None:
    """The forked child: drop to the transport account, run, report JSON lines."""
    out = os.fdopen(write_fd, "w", buffering=1)

    def say(text: str) -> None:
        out.write(json.dumps({"step": text}) + "\n")

    os.setgroups([])
    os.setgid(gid)
    os.setuid(uid)
    steps = JobSteps(
        job.plan, bindings=job.bindings, objects=["stdout"], lease_s=job.lease_s,
        poll_s=POLL_S, wait_limit_s=job.timeout_s,
    )  # fmt: skip
    stdout = _Stdout()
    wiring = Wiring(Client(job.socket), {}, stdout, _Steps(say))
    result = asyncio.run(drive(steps, wiring))
    text = stdout.data.decode("utf-8", errors="replace")
    out.write(json.dumps(verdict(result, text, job.expect_marker)) + "\n")


def run_as_transport(
    job: Job, uid: int, gid: int, print_line: Callable[[str], None]
) -> dict[str, Any]:
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
    answer: dict[str, Any] = {"ok": False, "error": "the transport side ended without a verdict"}
    # the terminal's SIGINT reaches the child too, which stops and releases the job;
    # a SIGTERM sent to this process alone is passed on to it
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, lambda *_: os.kill(pid, signal.SIGTERM))
    try:
        with os.fdopen(read_fd) as lines:
            for line in lines:
                message = json.loads(line)
                if "step" in message:
                    print_line(message["step"])
                else:
                    answer = message
        os.waitpid(pid, 0)
    finally:
        signal.signal(signal.SIGINT, previous)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    return answer


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
    parser.add_argument("--slot-class", help="slot class (default: the first with a free slot)")
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


def run(args: argparse.Namespace) -> int:
    started = time.monotonic()

    def say(text: str) -> None:
        print(f"[{time.monotonic() - started:6.1f} s] {text}", flush=True)

    config = load_config(args.config)
    paths = {endpoint.kind: endpoint.path for endpoint in socket_paths(config)}
    admin, transport = paths[SocketKind.ADMINISTRATOR], paths[SocketKind.TRANSPORT]
    snapshot = take_snapshot(Client(admin), admin)
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
        lease_s=min(600, snapshot.maximum_lease_seconds),
        timeout_s=args.timeout,
        expect_marker=_payload_argv(args) == list(DEFAULT_ARGV),
    )
    uid = config.transport_uid
    result = run_as_transport(job, uid, _primary_gid(uid), say)
    if result.get("ok"):
        say(f"payload said: {result['stdout'].strip()}")
    else:
        say(f"FAILED: {result['error']}")
    if result.get("reserved"):
        say(f"the attempt is still reserved; to finish it: {_resumable(job, admin)}")
    print("smoke test passed" if result.get("ok") else "smoke test FAILED", flush=True)
    return 0 if result.get("ok") else 1


def _resumable(job: Job, admin: str) -> str:
    """A `run --resume` directory for the smoke job (as the administrator, on
    admin.sock): the command that finishes an attempt the smoke test could not."""
    directory = pathlib.Path(tempfile.mkdtemp(prefix=f"ficc-smoke-{job.plan.attempt_id}-"))
    state = {"socket": admin, "inputs": {}, "objects": ["stdout"], "lease_seconds": job.lease_s}
    save_state(directory, job.plan, state)
    return resume_command(directory)


def _primary_gid(uid: int) -> int:
    try:
        return pwd.getpwuid(uid).pw_gid
    except KeyError:
        raise HostError(
            HostCode.ACCOUNT_MISSING, f"transport_uid {uid} has no account; create it first"
        ) from None


__all__ = ["DEFAULT_ARGV", "MARKER", "add_parser", "choose_plan", "run", "verdict"]
