"""The I/O shell around `job_steps.JobSteps`: what `run` and `smoke-test` share.

It sends what the machine asks for, streams inputs with the `upload` command's own
code (`ficc.execution._upload`: its resumable `Uploader`, fed a progress that reports
here), keeps the lease from a task of its own, hands collected bytes to a sink, and
turns SIGINT and SIGTERM into the machine's `interrupt`. It decides nothing about the
job: every decision is the machine's, and is tested there without a daemon.

A transport failure is not the end of a job: every request of a job is safe to send
again, so `Exchange` resends after a pause, and only after `retries` failures in a row
reports the step lost (the command then prints how to resume).
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import signal
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Protocol, TypeVar

from ficc.execution._upload import EXIT_TRANSPORT, Progress, Target, Uploader, UploadFailed
from ficc.execution.client import Client, ClientError, PeerNotRoot, Refused, RequestInvalid
from ficc.execution.errors import ErrorCode
from ficc.execution.host.cli.job_steps import (
    Chunk,
    Finish,
    JobSteps,
    Now,
    Phase,
    Result,
    Send,
    Upload,
    Wait,
)
from ficc.execution.plan import InputObject
from ficc.execution.protocol import Request
from ficc.execution.wire import AnyReply

RETRY_PAUSE_S = 0.5
"""The first pause before a request is sent again; it doubles, up to `RETRY_MAX_S`."""
RETRY_MAX_S = 5.0
IDLE_S = 1.0
"""How often the lease task looks again while there is no lease to keep."""

T = TypeVar("T")


class Reporter(Protocol):
    """Where the shell says what happens (a progress line, or a smoke test's steps)."""

    def note(self, text: str) -> None:
        """One step line."""

    def phase(self, phase: Phase) -> None:
        """The machine's phase, after each action."""

    def uploaded(self, name: str, done: int, total: int) -> None:
        """Bytes of input `name` the host holds durably."""


class Sink(Protocol):
    """Where collected bytes go."""

    def store(self, chunk: Chunk) -> None:
        """Keep `chunk.data` at `chunk.offset` of `chunk.name` (or void it: `restart`)."""


@dataclass
class Wiring:
    """What the shell talks to: the daemon, the input files (by input ID), the sink
    and the reporter."""

    client: Client
    sources: Mapping[str, str]
    sink: Sink
    report: Reporter
    retries: int = 5
    signals: bool = True


class Lost(Exception):
    """No trustworthy reply after the retries; `applied`: the request may have run."""

    def __init__(self, message: str, *, applied: bool) -> None:
        super().__init__(message)
        self.applied = applied


def now() -> Now:
    """The machine's two clocks, read now."""
    return Now(time.monotonic(), int(time.time() * 1000))


class Exchange:
    """One request, sent again after a transport failure (a job's requests are all
    safe to repeat), until `retries` failures in a row."""

    def __init__(self, client: Client, retries: int, pause_s: float = RETRY_PAUSE_S) -> None:
        self.client = client
        self.retries = retries
        self.pause_s = pause_s

    async def send(self, request: Request) -> AnyReply:
        """The reply; raises `Lost`."""
        failures = 0
        while True:
            try:
                return await self.client.request(request)
            except (RequestInvalid, PeerNotRoot) as error:
                raise Lost(f"{type(error).__name__}: {error}", applied=False) from None
            except Refused as error:  # not read, so not applied
                if error.code != ErrorCode.BUSY:
                    raise Lost(str(error), applied=False) from None
                failure: ClientError = error
            except ClientError as error:
                failure = error
            failures += 1
            if failures > self.retries:
                message = f"{type(failure).__name__}: {failure}; {self.retries} retries used"
                raise Lost(message, applied=not isinstance(failure, Refused))
            await asyncio.sleep(min(self.pause_s * 2 ** (failures - 1), RETRY_MAX_S))


class _UploadProgress(Progress):
    """The upload command's progress, reported to the shell's reporter instead of
    printed, so one progress line shows the whole job."""

    def __init__(self, item: InputObject, report: Reporter) -> None:
        super().__init__(item.name, item.bytes, stream=io.StringIO())
        self.report = report

    def show(self, what: str, done: int, *, final: bool = False) -> None:
        """Bytes the host holds durably."""
        self.report.uploaded(self.name, done, self.total)

    def note(self, message: str) -> None:
        """A resume or a retry of the upload."""
        self.report.note(f"upload: {message}")


@contextlib.contextmanager
def _signals(handler: Callable[[], None], enabled: bool) -> Iterator[None]:
    """SIGINT and SIGTERM call `handler` (instead of killing the command) meanwhile."""
    loop = asyncio.get_running_loop()
    caught = (signal.SIGINT, signal.SIGTERM) if enabled else ()
    for number in caught:
        loop.add_signal_handler(number, handler)
    try:
        yield
    finally:
        for number in caught:
            loop.remove_signal_handler(number)


async def _until_woken(wake: asyncio.Event, work: Awaitable[T]) -> asyncio.Future[T] | None:
    """Run `work` until it ends (its future) or `wake` is set (None; `work` is cancelled)."""
    task = asyncio.ensure_future(work)
    woken = asyncio.ensure_future(wake.wait())
    await asyncio.wait({task, woken}, return_when=asyncio.FIRST_COMPLETED)
    woken.cancel()
    if task.done():
        return task
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    return None


async def drive(steps: JobSteps, wiring: Wiring, clock: Callable[[], Now] = now) -> Result:
    """Run the machine to its end; the result."""
    wake = asyncio.Event()
    exchange = Exchange(wiring.client, wiring.retries)

    def interrupted() -> None:
        steps.interrupt()
        wake.set()

    with _signals(interrupted, wiring.signals):
        keeper = asyncio.create_task(_keep_lease(steps, exchange, clock))
        try:
            return await _steps(steps, exchange, wiring, wake, clock)
        finally:
            keeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await keeper


async def _steps(
    steps: JobSteps,
    exchange: Exchange,
    wiring: Wiring,
    wake: asyncio.Event,
    clock: Callable[[], Now],
) -> Result:
    while True:
        wake.clear()  # the machine sees every interrupt so far in `action`
        action = steps.action(clock())
        for text in steps.take_notes():
            wiring.report.note(text)
        if isinstance(action, Finish):
            return action.result
        wiring.report.phase(steps.phase)
        if isinstance(action, Send):
            await _send(steps, exchange, action, wiring, clock)
        elif isinstance(action, Wait):
            await _until_woken(wake, asyncio.sleep(action.seconds))
        elif isinstance(action, Upload):
            await _upload(steps, action.item, wiring, wake, clock)


async def _send(
    steps: JobSteps, exchange: Exchange, action: Send, wiring: Wiring, clock: Callable[[], Now]
) -> None:
    """One request (never cut short by an interrupt: its answer says what happened)."""
    try:
        reply = await exchange.send(action.request)
    except Lost as lost:
        steps.lost(action.step, str(lost), applied=lost.applied)
        return
    for chunk in steps.answer(action.step, reply, clock()):
        wiring.sink.store(chunk)


async def _upload(
    steps: JobSteps,
    item: InputObject,
    wiring: Wiring,
    wake: asyncio.Event,
    clock: Callable[[], Now],
) -> None:
    """Stream one input with the upload command's resumable loop."""
    target = Target(steps.plan, item, steps.fence.plan_digest)
    path = wiring.sources[item.id]
    try:
        with open(path, "rb") as source:
            progress = _UploadProgress(item, wiring.report)
            uploader = Uploader(wiring.client, target, source, progress, retries=wiring.retries)
            finished = await _until_woken(wake, uploader.run())
            if finished is None:
                return  # interrupted: the machine decides what now
            finished.result()
    except OSError as error:
        steps.upload_failed(item, f"cannot read {path}: {error}", clock())
    except UploadFailed as failed:
        if failed.status == EXIT_TRANSPORT:
            steps.lost("upload", str(failed), applied=True)
        else:
            steps.upload_failed(item, str(failed), clock())
    else:
        steps.uploaded(item, clock())


async def _keep_lease(steps: JobSteps, exchange: Exchange, clock: Callable[[], Now]) -> None:
    """Send each renewal when it is due, for as long as the machine holds a lease."""
    while True:
        delay = steps.renew_in(clock())
        await asyncio.sleep(IDLE_S if delay is None else delay)
        request = steps.renewal(clock())
        if request is None:
            continue
        try:
            reply: AnyReply | None = await exchange.send(request)
        except Lost:
            reply = None
        steps.renewed(reply, clock())


__all__ = ["Exchange", "Lost", "Reporter", "Sink", "Wiring", "drive", "now"]
