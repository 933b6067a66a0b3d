"""`python -m ficc.execution upload`: stream a local file into a declared streamed input.

The hand tool an integrator uses to feed a prepared attempt. It never trusts its own
memory of what was sent: it asks `input_status` for the durable next offset, sends
the file from there in chunks of the executor's `input_chunk_bytes`, and after any
interruption (a lost reply, a dropped connection, the tool itself killed and run
again) it asks again and resumes from the offset the executor reports. Before
sending anything it checks that the file has the size and SHA-256 the plan declares,
because a wrong file would only be found out at the last byte, and would fail the
attempt. Progress goes to stderr; stdout gets the final input row as JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import hashlib
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, BinaryIO

import msgspec

from ficc.execution.client import Client, ClientError, PeerNotRoot, Refused, RequestInvalid
from ficc.execution.errors import ErrorCode
from ficc.execution.plan import InputObject, Plan, decode_plan, plan_digest
from ficc.execution.protocol import (
    InputStatusRequest,
    InputWrite,
    InputWriteRequest,
    ObjectRef,
    Request,
    SnapshotRequest,
)
from ficc.execution.wire import ErrorReply, ErrorRow, InputRow, SnapshotReply

EXIT_OK, EXIT_REFUSED, EXIT_USAGE, EXIT_TRANSPORT = 0, 1, 2, 3
_HASH_BLOCK = 1 << 20
_WAIT = {ErrorCode.INPUTS_PREPARING, ErrorCode.INPUT_BUSY}
"""Row codes that mean "not now": ask again after a short pause."""
_PAUSE = 0.2


class UploadFailed(Exception):
    """The upload cannot go on; `status` is the command's exit status."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class Target:
    """Where the bytes go: one streamed input of one attempt, and its fence."""

    plan: Plan
    item: InputObject
    digest: str  # the plan's digest (the fence), not the object's

    def ref(self) -> dict[str, Any]:
        """The fence fields and object ID every row of this upload carries."""
        return {
            "attempt_id": self.plan.attempt_id,
            "generation": self.plan.generation,
            "plan_digest": self.digest,
            "object": self.item.id,
        }


def _new_id() -> str:
    return os.urandom(16).hex()


def find_target(plan_data: bytes, wanted: str) -> Target:
    """The plan's streamed input whose ID or name is `wanted`. Raises UploadFailed."""
    try:
        plan = decode_plan(plan_data)
    except (msgspec.MsgspecError, ValueError) as exc:
        raise UploadFailed(EXIT_USAGE, f"the plan does not decode: {exc}") from None
    found = [i for i in plan.job.inputs if wanted in (i.id, i.name)]
    if not found:
        names = ", ".join(f"{i.name} ({i.id})" for i in plan.streamed_inputs) or "none"
        raise UploadFailed(EXIT_USAGE, f"no input {wanted!r} in the plan; streamed: {names}")
    if found[0].delivery != "stream":
        raise UploadFailed(EXIT_USAGE, f"input {wanted!r} is delivered locally, not streamed")
    return Target(plan, found[0], plan_digest(plan))


def check_file(source: BinaryIO, item: InputObject, progress: Progress) -> None:
    """The file has exactly the declared size and SHA-256 (read once, nothing sent)."""
    size = os.fstat(source.fileno()).st_size
    if size != item.bytes:
        message = f"the file has {size} bytes; the plan declares {item.bytes} for {item.name}"
        raise UploadFailed(EXIT_USAGE, message)
    sha = hashlib.sha256()
    source.seek(0)
    done = 0
    while block := source.read(_HASH_BLOCK):
        sha.update(block)
        done += len(block)
        progress.show("checking", done)
    if "sha256:" + sha.hexdigest() != item.digest:
        message = f"the file's SHA-256 is not the digest the plan declares for {item.name}"
        raise UploadFailed(EXIT_USAGE, message)


class Progress:
    """One status line on stderr: rewritten in place on a terminal, else once a second."""

    def __init__(self, name: str, total: int, stream: Any = None) -> None:
        self.name = name
        self.total = total
        self.stream = stream if stream is not None else sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.started = time.monotonic()
        self.first = 0
        self._shown = 0.0

    def start_at(self, offset: int) -> None:
        """Rates count from here (a resumed upload did not send the earlier bytes)."""
        self.started, self.first = time.monotonic(), offset

    def show(self, what: str, done: int, *, final: bool = False) -> None:
        """Report `done` of the total bytes (at most once a second unless `final`)."""
        now = time.monotonic()
        if not final and not self.tty and now - self._shown < 1.0:
            return
        self._shown = now
        percent = 100.0 if not self.total else 100.0 * done / self.total
        rate = (done - self.first) / max(now - self.started, 1e-6)
        line = (
            f"{what} {self.name}: {_mib(done)} of {_mib(self.total)} MiB ({percent:.1f}%),"
            f" {_mib(int(rate))} MiB/s"
        )
        end = "\n" if final or not self.tty else ""
        self.stream.write(("\r" + line + "\x1b[K" + end) if self.tty else line + end)
        self.stream.flush()

    def note(self, message: str) -> None:
        """A line of its own (a resume, a retry)."""
        self.stream.write(("\r\x1b[K" if self.tty else "") + message + "\n")
        self.stream.flush()


def _mib(count: int) -> str:
    return f"{count / (1 << 20):.1f}"


class Uploader:
    """The loop: status, chunk at the durable offset, repeat; resume on interruption."""

    def __init__(
        self,
        client: Client,
        target: Target,
        source: BinaryIO,
        progress: Progress,
        *,
        retries: int,
        sleep: Callable[[float], Any] = asyncio.sleep,
    ) -> None:
        self.client = client
        self.target = target
        self.source = source
        self.progress = progress
        self.retries = retries
        self.sleep = sleep
        self.failures = 0

    async def run(self) -> InputRow:
        """Upload until the executor reports the object complete; its last input row."""
        chunk_bytes = await self._chunk_bytes()
        row = await self._status()
        if row.offset:
            self.progress.note(f"resuming {self.target.item.name} at byte {row.offset}")
        self.progress.start_at(row.offset)
        while not row.complete:
            self.progress.show("upload", row.offset)
            row = await self._write(row.offset, chunk_bytes)
        self.progress.show("upload", row.offset, final=True)
        return row

    async def _chunk_bytes(self) -> int:
        reply = await self._send(SnapshotRequest(version=1, id=_new_id(), after=None))
        if isinstance(reply, ErrorReply):
            raise UploadFailed(EXIT_REFUSED, f"snapshot: {reply.error.code}: {reply.error.message}")
        assert isinstance(reply, SnapshotReply)
        return reply.input_chunk_bytes

    async def _status(self) -> InputRow:
        """The durable next offset, waiting out `inputs_preparing` and `input_busy`."""
        request = InputStatusRequest(
            version=1, id=_new_id(), objects=[ObjectRef(**self.target.ref())]
        )
        while True:
            row = await self._row(request)
            if isinstance(row, InputRow):
                return row
            await self._pause_or_fail("input_status", row)

    async def _write(self, offset: int, chunk_bytes: int) -> InputRow:
        """One chunk at `offset`; on any doubt, the executor's word on where it stands."""
        self.source.seek(offset)
        data = self.source.read(min(chunk_bytes, self.target.item.bytes - offset))
        write = InputWrite(
            **self.target.ref(),
            offset=offset,
            data=base64.b64encode(data).decode(),
            digest="sha256:" + hashlib.sha256(data).hexdigest(),
        )
        request = InputWriteRequest(version=1, id=_new_id(), writes=[write])
        try:
            row = await self._row(request)
        except _Interrupted as lost:
            self.progress.note(f"{lost}; asking where the input stands")
            return await self._status()
        if isinstance(row, InputRow):
            return row
        if row.error.code == ErrorCode.INPUT_OFFSET_CHANGED:
            return await self._status()  # another writer, or our own lost reply
        await self._pause_or_fail("input_write", row)
        return await self._status()

    async def _pause_or_fail(self, action: str, row: ErrorRow) -> None:
        if row.error.code not in _WAIT:
            raise UploadFailed(EXIT_REFUSED, f"{action}: {row.error.code}: {row.error.message}")
        await self.sleep(_PAUSE)

    async def _row(self, request: InputStatusRequest | InputWriteRequest) -> InputRow | ErrorRow:
        while True:
            try:
                reply = await self._send(request)
            except _Interrupted as lost:
                if isinstance(request, InputWriteRequest):
                    raise
                self.progress.note(f"{lost}; asking again")
                continue
            if isinstance(reply, ErrorReply):
                error = reply.error
                raise UploadFailed(EXIT_REFUSED, f"{request.action}: {error.code}: {error.message}")
            (row,) = reply.results
            return row  # type: ignore[no-any-return]

    async def _send(self, request: Request) -> Any:
        """One exchange; a transport failure is `_Interrupted` until retries run out."""
        try:
            reply = await self.client.request(request)
        except (RequestInvalid, PeerNotRoot) as exc:
            raise UploadFailed(EXIT_USAGE, f"{type(exc).__name__}: {exc}") from None
        except Refused as exc:
            if exc.code != ErrorCode.BUSY:  # not applied, and asking again will not help
                raise UploadFailed(EXIT_REFUSED, f"{request.action}: {exc}") from None
            return await self._retry(exc)
        except ClientError as exc:
            return await self._retry(exc)
        self.failures = 0
        return reply

    async def _retry(self, exc: ClientError) -> Any:
        """Count a failed exchange; `_Interrupted` after a pause, or give up."""
        self.failures += 1
        if self.failures > self.retries:
            message = f"transport: {type(exc).__name__}: {exc} ({self.retries} retries used)"
            raise UploadFailed(EXIT_TRANSPORT, message)
        await self.sleep(min(_PAUSE * 2**self.failures, 5.0))
        raise _Interrupted(f"{type(exc).__name__}: {exc}")


class _Interrupted(Exception):
    """A request whose reply never came: it may or may not have been applied."""


def upload_command(argv: Sequence[str]) -> int:
    """Parse the arguments, check the file against the plan, and upload it."""
    parser = argparse.ArgumentParser(
        prog="python -m ficc.execution upload",
        description="Stream a local file into a declared streamed input of a prepared "
        "attempt, resuming from the executor's durable offset.",
    )
    parser.add_argument("--socket", required=True, help="the executor's Unix socket")
    parser.add_argument("--plan", required=True, help="the attempt's plan (JSON file)")
    parser.add_argument("--input", required=True, help="the streamed input's ID or name")
    parser.add_argument("file", help="the local file to send")
    parser.add_argument("--timeout", type=float, default=30.0, help="seconds per request")
    parser.add_argument(
        "--retries", type=int, default=5, help="transport failures in a row before giving up"
    )
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:
        return EXIT_OK if exc.code == 0 else EXIT_USAGE
    try:
        with open(args.plan, "rb") as plan_file:
            target = find_target(plan_file.read(1 << 20), args.input)
        with open(args.file, "rb") as source:
            progress = Progress(target.item.name, target.item.bytes)
            check_file(source, target.item, progress)
            client = Client(args.socket, connect_timeout=args.timeout, read_timeout=args.timeout)
            uploader = Uploader(client, target, source, progress, retries=args.retries)
            row = asyncio.run(uploader.run())
    except OSError as exc:
        print(f"cannot read: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except UploadFailed as exc:
        print(str(exc), file=sys.stderr)
        return exc.status
    sys.stdout.buffer.write(msgspec.json.encode(row) + b"\n")
    return EXIT_OK
