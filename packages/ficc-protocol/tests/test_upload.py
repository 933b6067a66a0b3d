"""The upload loop against a scripted executor on a real Unix socket: it resumes from
`input_status` after a lost reply, a dropped connection or `input_busy`, and stops on a
real refusal. (The run against the real daemon is tests-integration/test_upload_command.py.)
"""

from __future__ import annotations

import asyncio
import hashlib
import io
import os
import pathlib
import subprocess
import sys
from typing import Any

import msgspec
import pytest

import ficc_protocol_examples as ex
from ficc.execution import _upload
from ficc.execution.client import Client
from ficc.execution.frames import REPLY_MAX, REQUEST_MAX, FrameDecoder, encode_frame
from ficc.execution.plan import InputObject, Plan, encode_plan
from ficc.execution.protocol import (
    AnyRequest,
    InputStatusRequest,
    InputWriteRequest,
    SnapshotRequest,
    decode_request,
)
from ficc.execution.wire import InputRow, InputsReply, encode_reply, error_row

pytestmark = pytest.mark.root(
    "the client trusts only a root server, and the in-process server is root only under root"
)

CHUNK = 1000
DATA = os.urandom(4 * CHUNK + 123)


def _plan() -> Plan:
    stream = InputObject(
        id=ex.STREAM_ID,
        name="data.tar",
        bytes=len(DATA),
        digest="sha256:" + hashlib.sha256(DATA).hexdigest(),
        delivery="stream",
    )
    plan = ex.plan(1, streamed=False)
    job = msgspec.structs.replace(plan.job, inputs=[*plan.job.inputs, stream])
    return msgspec.structs.replace(plan, job=job)


class Executor:
    """Keeps one durable offset; faults are scripted per request number."""

    def __init__(self, target: _upload.Target, faults: dict[int, str]) -> None:
        self.target = target
        self.faults = faults
        self.offset = 0
        self.received = bytearray()
        self.count = 0
        self.writes: list[int] = []

    def _row(self) -> InputRow:
        ref = self.target.ref()
        return InputRow(
            **ref,
            offset=self.offset,
            bytes=len(DATA),
            digest=self.target.item.digest,
            complete=self.offset == len(DATA),
        )

    def answer(self, request: AnyRequest) -> Any:
        fault = self.faults.get(self.count)
        if isinstance(request, SnapshotRequest):
            reply = ex.replies()["snapshot"]
            return msgspec.structs.replace(reply, id=request.id, input_chunk_bytes=CHUNK)
        if fault == "busy":
            return InputsReply(version=1, id=request.id, results=[error_row("input_busy", "x")])
        if fault == "refuse":
            row = error_row("input_failed", "the stream failed")
            return InputsReply(version=1, id=request.id, results=[row])
        if isinstance(request, InputWriteRequest):
            (write,) = request.writes
            self.writes.append(write.offset)
            if write.offset != self.offset:
                row = error_row("input_offset_changed", "not the durable offset")
                return InputsReply(version=1, id=request.id, results=[row])
            self.received += write.chunk
            self.offset += len(write.chunk)
        assert isinstance(request, InputStatusRequest | InputWriteRequest)
        return InputsReply(version=1, id=request.id, results=[self._row()])

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        decoder = FrameDecoder(REQUEST_MAX)
        frames: list[bytes] = []
        while not frames:
            data = await reader.read(1 << 16)
            if not data:
                return
            frames = decoder.feed(data)
        self.count += 1
        reply = self.answer(decode_request(frames[0]))
        if self.faults.get(self.count - 1) != "drop":  # "drop": applied, reply lost
            writer.write(encode_frame(encode_reply(reply), REPLY_MAX))
            await writer.drain()
        writer.close()


def _run(
    tmp_path: pathlib.Path, faults: dict[int, str], retries: int = 3, start: int = 0
) -> tuple[Any, Executor, str]:
    """Upload DATA to a scripted executor that already holds `start` bytes."""
    target = _upload.find_target(encode_plan(_plan()), "data.tar")
    executor = Executor(target, faults)
    executor.offset, executor.received = start, bytearray(DATA[:start])
    stderr = io.StringIO()

    async def go() -> Any:
        server = await asyncio.start_unix_server(executor.serve, path=str(tmp_path / "s"))
        async with server:
            client = Client(str(tmp_path / "s"), connect_timeout=5, read_timeout=5)
            progress = _upload.Progress("data.tar", len(DATA), stderr)

            async def no_wait(_: float) -> None:
                return None

            uploader = _upload.Uploader(
                client, target, io.BytesIO(DATA), progress, retries=retries, sleep=no_wait
            )
            return await uploader.run()

    return asyncio.run(go()), executor, stderr.getvalue()


def test_a_clean_upload_sends_each_chunk_once(tmp_path: pathlib.Path) -> None:
    row, executor, _ = _run(tmp_path, {})
    assert row.complete
    assert bytes(executor.received) == DATA
    assert executor.writes == [0, 1000, 2000, 3000, 4000]


def test_a_lost_reply_resumes_from_input_status(tmp_path: pathlib.Path) -> None:
    # request 0 snapshot, 1 status, 2 write@0, 3 write@1000 (applied, reply lost)
    row, executor, stderr = _run(tmp_path, {3: "drop"})
    assert row.complete
    assert bytes(executor.received) == DATA  # nothing written twice, nothing skipped
    assert executor.writes == [0, 1000, 2000, 3000, 4000]
    assert "asking where the input stands" in stderr


def test_busy_is_waited_out(tmp_path: pathlib.Path) -> None:
    row, executor, _ = _run(tmp_path, {2: "busy", 1: "busy"})
    assert row.complete
    assert bytes(executor.received) == DATA


def test_a_refusal_stops_the_upload(tmp_path: pathlib.Path) -> None:
    with pytest.raises(_upload.UploadFailed) as info:
        _run(tmp_path, {3: "refuse"})
    assert info.value.status == _upload.EXIT_REFUSED
    assert "input_failed" in str(info.value)


def test_transport_failures_in_a_row_give_up(tmp_path: pathlib.Path) -> None:
    faults = dict.fromkeys(range(2, 40), "drop")
    with pytest.raises(_upload.UploadFailed) as info:
        _run(tmp_path, faults, retries=2)
    assert info.value.status == _upload.EXIT_TRANSPORT


def test_a_started_upload_resumes_where_the_executor_stands(tmp_path: pathlib.Path) -> None:
    row, executor, stderr = _run(tmp_path, {}, start=2000)
    assert row.complete
    assert bytes(executor.received) == DATA
    assert executor.writes == [2000, 3000, 4000]
    assert "resuming data.tar at byte 2000" in stderr
    assert _upload.find_target(encode_plan(_plan()), ex.STREAM_ID).item.name == "data.tar"


def test_a_local_input_or_an_unknown_one_is_refused() -> None:
    with pytest.raises(_upload.UploadFailed, match="delivered locally"):
        _upload.find_target(encode_plan(_plan()), "model.bin")
    with pytest.raises(_upload.UploadFailed, match=r"streamed: data.tar"):
        _upload.find_target(encode_plan(_plan()), "nothing")


def test_the_command_checks_the_file_before_connecting(tmp_path: pathlib.Path) -> None:
    (tmp_path / "plan.json").write_bytes(encode_plan(_plan()))
    (tmp_path / "short").write_bytes(DATA[:-1])
    (tmp_path / "changed").write_bytes(DATA[:-1] + b"\x00" if DATA[-1] else DATA[:-1] + b"\x01")
    base = [sys.executable, "-m", "ficc.execution", "upload", "--socket", str(tmp_path / "none")]
    base += ["--plan", str(tmp_path / "plan.json"), "--input", "data.tar"]
    short = subprocess.run(
        [*base, str(tmp_path / "short")], capture_output=True, text=True, check=False
    )
    assert short.returncode == 2
    assert f"has {len(DATA) - 1} bytes; the plan declares {len(DATA)}" in short.stderr
    changed = subprocess.run(
        [*base, str(tmp_path / "changed")], capture_output=True, text=True, check=False
    )
    assert changed.returncode == 2
    assert "SHA-256" in changed.stderr
