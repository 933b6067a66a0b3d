"""`ficc-executor run`: one job, one command.

From a plan file (`--plan FILE`) or from an image and a command line (`--image DIGEST
-- ARGV`), as the transport account or the administrator: it fills the plan's open
fields from the host (docs/operations.md, "One job: run", lists them), streams each
`--input NAME=FILE`, prepares, renews the lease while it waits, starts, follows the
job with a progress line, collects the declared outputs and both logs into a
directory, releases, and exits with the job's exit code. Interrupted, it stops the job
and releases it, or (`--detach`) leaves it running and prints the `--resume` command
that finishes it.

Exit status: the job's own exit code when it ran to its end; 123 the run could not
finish (the daemon stopped answering, or refused the release): the attempt is still
reserved and the last line is the command that finishes it; 124 the job ended without
an exit code of its own (failed before or while it ran, expired, or unknown); 125
refused before anything was reserved (usage, the plan, an input, the output
directory, or the host's refusal); 130 interrupted.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import hashlib
import json
import os
import pathlib
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, BinaryIO

import msgspec

from ficc.execution import plan as planlib
from ficc.execution.client import Client, ClientError, Refused
from ficc.execution.errors import ErrorCode, ProtocolError
from ficc.execution.host.cli import job_plan
from ficc.execution.host.cli.job_shell import Wiring, drive
from ficc.execution.host.cli.job_steps import RESERVED, Chunk, Ending, JobSteps, Result
from ficc.execution.host.cli.run_progress import ProgressLine
from ficc.execution.host.config.load import load_config
from ficc.execution.host.core.codes import HostCode
from ficc.execution.host.core.errors import HostError
from ficc.execution.protocol import Fence, ObserveRequest, SnapshotRequest
from ficc.execution.wire import AttemptsReply, ErrorReply, ErrorRow, SnapshotReply

EXIT_UNFINISHED, EXIT_NO_EXIT_CODE, EXIT_REFUSED, EXIT_INTERRUPTED = 123, 124, 125, 130
PLAN_FILE_MAX = 1 << 20
STATE, PLAN, RESULT = "run.json", "plan.json", "result.json"
"""The files `run` keeps in its output directory beside what it collected."""
SIZE_UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
SOCKET_DIR = "/run/ficc-executor"
"""Where the shipped unit's daemon listens (its RuntimeDirectory)."""
LEASE_S = 300
"""The default lease: renewed every 100 s while the command follows the job."""


# --- exit status and what is printed last --------------------------------------------------


EXITS = {
    Ending.ENDED: EXIT_NO_EXIT_CODE,
    Ending.FAILED: EXIT_NO_EXIT_CODE,
    Ending.REFUSED: EXIT_REFUSED,
    Ending.INTERRUPTED: EXIT_INTERRUPTED,
    Ending.DETACHED: EXIT_INTERRUPTED,
    Ending.UNFINISHED: EXIT_UNFINISHED,
}
"""The exit status of each ending, but for a job that ran to its end with an exit code."""


def exit_status(result: Result) -> int:
    """The command's exit status for how the run ended (see the module docstring)."""
    row = result.row
    if result.ending is Ending.ENDED and row is not None:
        if row.exit_code is not None:
            return row.exit_code
        if row.outcome == "succeeded":
            return 0
    return EXITS[result.ending]


def verdict(result: Result, directory: pathlib.Path) -> list[str]:
    """The last lines: what became of the job, and how to finish it when it is still
    reserved (nothing is ever left reserved without this)."""
    row = result.row
    lines = [f"{result.ending.value}: {result.message}"] if result.message else []
    if row is not None and row.outcome is not None:
        code = "no exit code" if row.exit_code is None else f"exit code {row.exit_code}"
        lines.append(
            f"outcome {row.outcome} (reason {row.reason}, {code}); logs and outputs in {directory}"
        )
    if result.ending in RESERVED:
        if row is not None and row.lease_expires_at_ms and result.ending is Ending.DETACHED:
            ends = datetime.datetime.fromtimestamp(row.lease_expires_at_ms / 1000, datetime.UTC)
            lines.append(
                f"the job keeps its slot; its lease ends at {ends:%Y-%m-%d %H:%M:%S} UTC, and"
                " then the host stops it unless the run is resumed"
            )
        lines.append(f"the attempt is still reserved; to finish it: {resume_command(directory)}")
    return lines


def resume_command(directory: pathlib.Path) -> str:
    """The one command that follows a reserved attempt to its release."""
    return f"ficc-executor run --resume {directory}"


# --- the output directory ---------------------------------------------------------------------


class DirectorySink:
    """Collected objects as files: `stdout`, `stderr` and `outputs/NAME`."""

    def __init__(self, directory: pathlib.Path) -> None:
        self.directory = directory
        self.files: dict[str, BinaryIO] = {}

    def path(self, name: str) -> pathlib.Path:
        """Where object `name` (`stdout`, `stderr`, `output:NAME`) is stored."""
        if name.startswith("output:"):
            return self.directory / "outputs" / name.removeprefix("output:")
        return self.directory / name

    def store(self, chunk: Chunk) -> None:
        """Write the chunk where it belongs; a restart empties the file first."""
        file = self.files.get(chunk.name)
        if file is None:
            path = self.path(chunk.name)
            path.parent.mkdir(mode=0o700, exist_ok=True)
            file = self.files[chunk.name] = open(path, "wb")  # noqa: SIM115 - closed in close()
        if chunk.restart:
            file.seek(0)
            file.truncate()
        file.seek(chunk.offset)
        file.write(chunk.data)

    def close(self) -> None:
        """Close every file (the run is over)."""
        for file in self.files.values():
            file.close()
        self.files.clear()


def make_directory(given: str | None, attempt_id: str) -> pathlib.Path:
    """The output directory, new (or empty), mode 0700: what the job leaves is private."""
    directory = pathlib.Path(given or f"ficc-run-{attempt_id}").absolute()
    try:
        directory.mkdir(mode=0o700)
    except FileExistsError:
        if not directory.is_dir() or any(directory.iterdir()):
            raise job_plan.refuse(
                HostCode.RUN_OUTPUT_DIR,
                f"{directory} exists and is not an empty directory; name a new one with"
                " --output-dir (or remove it)",
            ) from None
    except OSError as error:
        raise job_plan.refuse(
            HostCode.RUN_OUTPUT_DIR, f"cannot create {directory}: {error.strerror}"
        ) from None
    return directory


def save_state(directory: pathlib.Path, plan: planlib.Plan, state: dict[str, Any]) -> None:
    """The plan as sent and what `--resume` needs, written before anything is sent."""
    (directory / PLAN).write_bytes(planlib.encode_plan(plan))
    (directory / STATE).write_text(json.dumps(state, indent=2, sort_keys=True) + "\n")


# --- reading what the user gave ---------------------------------------------------------------


def parse_pairs(values: Sequence[str] | None, flag: str) -> dict[str, str]:
    """`NAME=VALUE` flags as a dict; a malformed or repeated one is refused."""
    pairs: dict[str, str] = {}
    for value in values or ():
        name, sep, rest = value.partition("=")
        if not sep or not name or name in pairs:
            problem = "is given twice" if name in pairs else "is not NAME=VALUE"
            raise job_plan.refuse(HostCode.RUN_USAGE, f"{flag} {value!r} {problem}")
        pairs[name] = rest
    return pairs


def local_input(name: str, path: str) -> job_plan.LocalInput:
    """One `--input` file: its size and SHA-256, read once before anything is sent."""
    try:
        with open(path, "rb") as source:
            digest = hashlib.file_digest(source, "sha256").hexdigest()
            size = os.fstat(source.fileno()).st_size
    except OSError as error:
        raise job_plan.refuse(
            HostCode.RUN_INPUT_UNREADABLE,
            f"--input {name}={path}: cannot read the file ({error.strerror}); nothing was sent",
        ) from None
    return job_plan.LocalInput(name, os.path.abspath(path), size, f"sha256:{digest}")


def read_plan_file(path: str) -> dict[str, Any]:
    """The `--plan` file as a JSON object."""
    try:
        with open(path, "rb") as file:
            data = file.read(PLAN_FILE_MAX + 1)
    except OSError as error:
        raise job_plan.refuse(
            HostCode.RUN_PLAN_INVALID, f"cannot read the plan {path}: {error.strerror}"
        ) from None
    if len(data) > PLAN_FILE_MAX:
        raise job_plan.refuse(HostCode.RUN_PLAN_INVALID, f"{path} is larger than 1 MiB")
    return job_plan.read_document(data, path)


def size(text: str) -> int:
    """`512M`, `4G` or a plain number of bytes."""
    scale = SIZE_UNITS.get(text[-1:].upper(), 1)
    digits = text[:-1] if scale != 1 else text
    if not digits.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r} is not a size such as 4G, 512M or 1048576")
    return int(digits) * scale


# --- talking to the host before anything is reserved --------------------------------------------


def take_snapshot(client: Client, socket: str) -> SnapshotReply:
    """The host's snapshot; a daemon that does not answer is a refusal with a hint."""
    try:
        reply = asyncio.run(client.request(SnapshotRequest(version=1, id=os.urandom(16).hex())))
    except Refused as refused:
        raise HostError(
            refused.code, f"{refused.message} ({socket}: this account may not use it)"
        ) from None
    except ClientError as error:
        raise job_plan.refuse(
            HostCode.RUN_NO_DAEMON,
            f"no daemon answers on {socket} ({type(error).__name__}: {error}); start it, or"
            " name its socket with --socket",
        ) from None
    if isinstance(reply, ErrorReply):
        raise HostError(reply.error.code, reply.error.message)
    assert isinstance(reply, SnapshotReply)
    return reply


def check_new(client: Client, plan: planlib.Plan) -> None:
    """A pinned attempt ID the host already knows is refused: an attempt runs once."""
    fence = [Fence(plan.attempt_id, plan.generation, planlib.plan_digest(plan))]
    request = ObserveRequest(version=1, id=os.urandom(16).hex(), attempts=fence)
    try:
        reply = asyncio.run(client.request(request))
    except ClientError as error:
        raise job_plan.refuse(
            HostCode.RUN_NO_DAEMON, f"observe: no reply ({type(error).__name__}: {error})"
        ) from None
    if isinstance(reply, AttemptsReply):
        row = reply.results[0]
        if isinstance(row, ErrorRow) and row.error.code == ErrorCode.UNKNOWN_ATTEMPT:
            return
        state = row.state if not isinstance(row, ErrorRow) else row.error.code
        raise job_plan.refuse(
            HostCode.RUN_ATTEMPT_EXISTS,
            f"the host already has attempt {plan.attempt_id} ({state}); an attempt runs once:"
            ' leave attempt_id open ("<attempt_id>") for a new one, or follow that one with'
            " --resume DIR",
        )


# --- the command ---------------------------------------------------------------------------


@dataclass
class Prepared:
    """A run checked and written down, before anything is reserved: the machine, the
    daemon, the input files by input ID, and the output directory."""

    steps: JobSteps
    client: Client
    sources: dict[str, str]
    directory: pathlib.Path
    upload_total: int
    retries: int
    intro: list[str]


USAGE = (
    "ficc-executor run --plan FILE [--input NAME=FILE ...] [options]\n"
    "       ficc-executor run [--image DIGEST] [--class CLASS] [options] -- ARGV ...\n"
    "       ficc-executor run --resume DIR"
)


def add_parser(commands: argparse._SubParsersAction, version: str) -> None:  # type: ignore[type-arg]
    """Register `run` on the `ficc-executor` command."""
    parser = commands.add_parser(
        "run",
        help="run one job (a plan file, or an image and a command line) and collect it",
        usage=USAGE,
        description=__doc__.split("\n\n", 1)[1] if __doc__ else None,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _daemon_options(parser.add_argument_group("the daemon"))
    _job_options(parser.add_argument_group("the job (each fills a field the plan leaves open)"))
    _run_options(parser.add_argument_group("the run"))
    parser.add_argument(
        "argv", nargs=argparse.REMAINDER, metavar="-- ARGV",
        help="the job's command line (argv[0] an absolute path in the image)",
    )  # fmt: skip
    parser.add_argument("--version", action="version", version=version)
    parser.set_defaults(run=run)


def _daemon_options(group: argparse._ArgumentGroup) -> None:
    group.add_argument(
        "--config", metavar="PATH",
        help="as root: the daemon's configuration; its admin.sock, deployment, node and"
        " images are used",
    )  # fmt: skip
    group.add_argument(
        "--socket", metavar="PATH",
        help=f"the daemon's socket (default {SOCKET_DIR}/transport.sock, or admin.sock as root)",
    )  # fmt: skip
    group.add_argument("--deployment", metavar="ID", help="the host's deployment_id")
    group.add_argument("--node", metavar="ID", help="the host's node_id")


def _job_options(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--plan", metavar="FILE", help="the job's plan (JSON)")
    group.add_argument("--image", metavar="DIGEST", help="the image (job.runtime.image_digest)")
    group.add_argument("--class", dest="slot_class", metavar="CLASS", help="the slot class")
    group.add_argument("--provider", metavar="ID", help="the provider")
    group.add_argument("--isolation", help="the isolation (default shared-kernel)")
    group.add_argument("--network", help="the network (default none)")
    group.add_argument("--project", metavar="ID", help="the project_id")
    group.add_argument("--name", help="the job's name (image form; default run)")
    group.add_argument("--cpu-millis", type=int, metavar="N", help="cpu_millis (1000: one CPU)")
    group.add_argument("--memory", type=size, metavar="SIZE", help="memory_bytes, e.g. 512M")
    group.add_argument("--swap", type=size, metavar="SIZE", help="swap_bytes (default 0)")
    group.add_argument("--processes", type=int, metavar="N", help="processes")
    group.add_argument("--storage", type=size, metavar="SIZE", help="storage_bytes")
    group.add_argument("--inodes", type=int, metavar="N", help="storage_inodes")
    group.add_argument("--device", action="append", metavar="NAME", help="a device (repeatable)")
    group.add_argument("--env", action="append", metavar="KEY=VALUE", help="image form")
    group.add_argument(
        "--input", action="append", metavar="NAME=FILE",
        help="the file of a streamed input (repeatable); the image form declares it",
    )  # fmt: skip
    group.add_argument(
        "--output", action="append", metavar="NAME=PATH",
        help="image form: declare an output, PATH relative to the job's storage",
    )  # fmt: skip


def _run_options(group: argparse._ArgumentGroup) -> None:
    group.add_argument(
        "--output-dir", metavar="DIR",
        help="where the logs and outputs go (default: a new ./ficc-run-ATTEMPT)",
    )  # fmt: skip
    group.add_argument(
        "--lease", type=int, default=LEASE_S, metavar="SECONDS",
        help=f"the lease, renewed every third of it while the command waits (default {LEASE_S})",
    )  # fmt: skip
    group.add_argument(
        "--detach", action="store_true",
        help="on SIGINT or SIGTERM leave the job running and print the --resume command"
        " (default: stop it and release it)",
    )  # fmt: skip
    group.add_argument(
        "--resume", metavar="DIR",
        help="follow the attempt of an earlier run to its release, from its output directory",
    )  # fmt: skip
    group.add_argument("--timeout", type=float, default=30.0, help="seconds per request")
    group.add_argument(
        "--retries", type=int, default=5, help="transport failures in a row before giving up"
    )


def run(args: argparse.Namespace) -> int:
    """The command: check and write everything down, then follow the job."""
    try:
        prepared = resume(args) if args.resume else start(args)
    except HostError as error:
        print(f"{error.code}: {error.message}", file=sys.stderr)
        return EXIT_REFUSED
    except KeyboardInterrupt:
        print("interrupted before anything was sent; nothing is reserved", file=sys.stderr)
        return EXIT_INTERRUPTED
    return follow(prepared)


def follow(prepared: Prepared) -> int:
    """Drive the job to its end; print the verdict; the exit status."""
    report = ProgressLine(sys.stderr, prepared.upload_total)
    for line in prepared.intro:
        report.note(line)
    sink = DirectorySink(prepared.directory)
    wiring = Wiring(prepared.client, prepared.sources, sink, report, retries=prepared.retries)
    try:
        result = asyncio.run(drive(prepared.steps, wiring))
    except KeyboardInterrupt:  # outside the shell's own handlers: at its very start or end
        resume = resume_command(prepared.directory)
        print(f"interrupted; should the attempt be reserved, {resume} finishes it", file=sys.stderr)
        return EXIT_INTERRUPTED
    finally:
        sink.close()
        report.close()
    keep_result(prepared.directory, result)
    for line in verdict(result, prepared.directory):
        print(line, file=sys.stderr, flush=True)
    if result.row is not None:
        print(prepared.directory, flush=True)
    return exit_status(result)


def keep_result(directory: pathlib.Path, result: Result) -> None:
    """The host's last row in the directory; a directory of a run that reserved
    nothing holds nothing worth keeping, and goes."""
    if result.row is not None:
        (directory / RESULT).write_bytes(msgspec.json.encode(result.row) + b"\n")
        return
    if result.ending in (Ending.REFUSED, Ending.INTERRUPTED):
        for name in (PLAN, STATE):
            (directory / name).unlink(missing_ok=True)
        if not any(directory.iterdir()):
            directory.rmdir()


def start(args: argparse.Namespace) -> Prepared:
    """A new run: the plan filled and checked, the inputs read, the directory made."""
    argv = _argv(args)
    _check_usage(args, argv)
    given = parse_pairs(args.input, "--input")
    if args.plan:
        document = read_plan_file(args.plan)
    else:
        environment, outputs = parse_pairs(args.env, "--env"), parse_pairs(args.output, "--output")
        document = job_plan.template(argv, environment, list(given), outputs, name=args.name)
    job_plan.match_inputs(document, list(given))
    inputs = [local_input(name, path) for name, path in given.items()]
    client, socket, host = _host(args)
    choices = job_plan.Choices(
        slot_class=args.slot_class, provider=args.provider, image=args.image,
        isolation=args.isolation, network=args.network, project=args.project,
        limits=_limits(args), inputs=inputs,
    )  # fmt: skip
    filled = job_plan.fill_plan(document, host, choices, lambda: os.urandom(16).hex())
    plan = filled.plan
    if "$.attempt_id" not in filled.filled:
        check_new(client, plan)
    checked = _Checked(client, socket, host.snapshot, filled, inputs, built=not args.plan)
    return _prepared(args, checked)


@dataclass(frozen=True)
class _Checked:
    """A new run's checked parts, before its directory exists."""

    client: Client
    socket: str
    snapshot: SnapshotReply
    filled: job_plan.Filled
    inputs: Sequence[job_plan.LocalInput]
    built: bool
    """The plan was built from an image and a command line (not read from a file)."""


def _prepared(args: argparse.Namespace, checked: _Checked) -> Prepared:
    """Make the directory; write down the plan and what `--resume` needs."""
    plan, snapshot = checked.filled.plan, checked.snapshot
    try:
        bindings = snapshot.bindings()
    except ProtocolError as error:
        raise HostError(error.code, error.message) from None
    directory = make_directory(args.output_dir, plan.attempt_id)
    sources = {
        item.id: local.path
        for item in plan.streamed_inputs
        for local in checked.inputs
        if local.name in (item.name, item.id)
    }
    objects = ["stdout", "stderr", *(f"output:{o.name}" for o in plan.job.outputs)]
    lease_s = max(1, min(args.lease, snapshot.maximum_lease_seconds))
    save_state(directory, plan, {
        "socket": checked.socket, "inputs": sources, "objects": objects, "lease_seconds": lease_s,
    })  # fmt: skip
    steps = JobSteps(plan, bindings=bindings, objects=objects, lease_s=lease_s, detach=args.detach)
    total = sum(i.bytes for i in plan.streamed_inputs)
    intro = _intro(checked.filled, directory, built=checked.built)
    return Prepared(steps, checked.client, sources, directory, total, args.retries, intro)


def _intro(filled: job_plan.Filled, directory: pathlib.Path, *, built: bool) -> list[str]:
    """What the command is about to run, and what it filled in (nothing hidden)."""
    plan, runtime = filled.plan, filled.plan.job.runtime
    opened = ", ".join(path.removeprefix("$.") for path in filled.filled) or "nothing"
    how = "built from the snapshot and the command line" if built else f"filled in: {opened}"
    return [
        f"plan: attempt {plan.attempt_id} of job {plan.job_id}, {runtime.provider} image"
        f" {runtime.image_digest}, class {plan.job.slot_class}",
        f"plan: {how} (as sent: {PLAN} in the output directory)",
        f"output directory: {directory}",
    ]


def resume(args: argparse.Namespace) -> Prepared:
    """An earlier run's attempt, from its output directory."""
    forbidden = [flag for flag, value in _job_flags(args).items() if value]
    if forbidden or _argv(args):
        named = ", ".join(forbidden) or "a command line"
        raise job_plan.refuse(
            HostCode.RUN_USAGE,
            f"--resume takes the job from its directory; drop {named}",
        )
    directory = pathlib.Path(args.resume).absolute()
    try:
        state = json.loads((directory / STATE).read_text())
        plan = planlib.decode_plan((directory / PLAN).read_bytes())
        socket, sources = args.socket or state["socket"], dict(state["inputs"])
        objects, lease_s = list(state["objects"]), int(state["lease_seconds"])
    except (OSError, ValueError, KeyError, TypeError, msgspec.MsgspecError) as error:
        raise job_plan.refuse(
            HostCode.RUN_RESUME,
            f"{directory} is not the output directory of a `run` ({error}); name the"
            " directory the interrupted run printed",
        ) from None
    client = Client(socket, connect_timeout=args.timeout, read_timeout=args.timeout)
    steps = JobSteps(plan, bindings=None, objects=objects, lease_s=lease_s, detach=args.detach)
    total = sum(i.bytes for i in plan.streamed_inputs)
    intro = [f"resume: attempt {plan.attempt_id} in {directory}"]
    return Prepared(steps, client, sources, directory, total, args.retries, intro)


def _argv(args: argparse.Namespace) -> list[str]:
    given = list(args.argv or [])
    return given[1:] if given[:1] == ["--"] else given


def _job_flags(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "--plan": args.plan, "--image": args.image, "--class": args.slot_class,
        "--provider": args.provider, "--input": args.input, "--output": args.output,
        "--env": args.env, "--config": args.config, "--output-dir": args.output_dir,
        "--name": args.name, **{f"--{k.replace('_', '-')}": v for k, v in _limits(args).items()},
    }  # fmt: skip


def _check_usage(args: argparse.Namespace, argv: Sequence[str]) -> None:
    """The two forms do not mix, and the configuration names the host by itself."""
    problem = None
    if args.plan and argv:
        problem = "give --plan FILE or a command line after --, not both"
    elif args.plan and (args.env or args.output or args.name):
        problem = "--env, --output and --name build a plan; with --plan, write them in it"
    elif not args.plan and not argv:
        problem = "give --plan FILE, or the job's command line after -- (with --image DIGEST)"
    elif args.config and (args.deployment or args.node):
        problem = "--config names the deployment and node itself; drop --deployment and --node"
    if problem is not None:
        raise job_plan.refuse(HostCode.RUN_USAGE, f"{problem} (`ficc-executor run --help`)")


def _limits(args: argparse.Namespace) -> dict[str, Any]:
    given = {
        "cpu_millis": args.cpu_millis, "memory_bytes": args.memory, "swap_bytes": args.swap,
        "processes": args.processes, "storage_bytes": args.storage,
        "storage_inodes": args.inodes, "devices": args.device,
    }  # fmt: skip
    return {name: value for name, value in given.items() if value is not None}


def _host(args: argparse.Namespace) -> tuple[Client, str, job_plan.Host]:
    """The daemon's client, its socket, and what is known of the host."""
    config = load_config(args.config) if args.config else None
    socket = args.socket or os.path.join(
        config.socket_dir if config else SOCKET_DIR,
        "admin.sock" if config or os.geteuid() == 0 else "transport.sock",
    )
    client = Client(socket, connect_timeout=args.timeout, read_timeout=args.timeout)
    snapshot = take_snapshot(client, socket)
    if config is not None:
        return client, socket, job_plan.host_of(config, snapshot)
    return client, socket, job_plan.Host(snapshot, args.deployment, args.node)


__all__ = [
    "EXIT_INTERRUPTED",
    "EXIT_NO_EXIT_CODE",
    "EXIT_REFUSED",
    "EXIT_UNFINISHED",
    "USAGE",
    "DirectorySink",
    "add_parser",
    "exit_status",
    "run",
    "verdict",
]
