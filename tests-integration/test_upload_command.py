"""`python -m ficc.execution upload` against the real daemon: resumes at the durable
offset, finishes the stream, and the attempt becomes ready."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from ficc.execution.plan import encode_plan
from ficc_testkit.driver import StreamedInput, input_row, row_code, rows
from ficc_testkit.host import Daemon
from ficc_testkit.units import MIB
from ficc_testkit.waits import wait_for

UPLOAD = [sys.executable, "-m", "ficc.execution", "upload"]


def _staged(daemon: Daemon, plan: object, item: StreamedInput) -> object:
    def status() -> object:
        row = daemon.input_status(plan, item)  # type: ignore[arg-type]
        return None if row_code(row) == "inputs_preparing" else row

    return wait_for(status, "staging to be initialised")


def test_upload_resumes_from_the_durable_offset_and_completes(
    daemon: Daemon, tmp_path: Path
) -> None:
    item = StreamedInput(os.urandom(9 * MIB + 1000), name="frames.tar")
    plan = daemon.plan(inputs=[item])
    rows(daemon.prepare([plan]))
    _staged(daemon, plan, item)
    # an earlier upload was interrupted after its first chunk
    first = input_row(daemon.input_write(plan, item, 0, item.data[: 256 * 1024]))
    assert first.offset == 256 * 1024
    (tmp_path / "plan.json").write_bytes(encode_plan(plan))
    (tmp_path / "frames.tar").write_bytes(item.data)

    command = [*UPLOAD, "--socket", daemon.admin, "--plan", str(tmp_path / "plan.json")]
    done = subprocess.run(
        [*command, "--input", "frames.tar", str(tmp_path / "frames.tar")],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert f"resuming frames.tar at byte {256 * 1024}" in done.stderr
    assert "upload frames.tar: 9.0 of 9.0 MiB (100.0%)" in done.stderr
    assert '"complete":true' in done.stdout
    final = input_row(daemon.input_status(plan, item))
    assert (final.offset, final.complete) == (len(item.data), True)
    ready = daemon.wait_state(plan, lambda r: r.ready or r.state != "prepared", "readiness")
    assert (ready.state, ready.ready) == ("prepared", True)


def test_upload_refuses_a_file_that_is_not_the_declared_object(
    daemon: Daemon, tmp_path: Path
) -> None:
    item = StreamedInput(os.urandom(4096), name="frames.tar")
    plan = daemon.plan(inputs=[item])
    rows(daemon.prepare([plan]))
    _staged(daemon, plan, item)
    (tmp_path / "plan.json").write_bytes(encode_plan(plan))
    (tmp_path / "other.tar").write_bytes(os.urandom(4096))

    command = [*UPLOAD, "--socket", daemon.admin, "--plan", str(tmp_path / "plan.json")]
    done = subprocess.run(
        [*command, "--input", item.id, str(tmp_path / "other.tar")],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2
    assert "SHA-256 is not the digest the plan declares" in done.stderr
    assert input_row(daemon.input_status(plan, item)).offset == 0  # nothing was sent


def test_upload_stages_an_empty_streamed_input_beside_a_full_one(
    daemon: Daemon, tmp_path: Path
) -> None:
    """A plan with an empty streamed input (as the golden streamed plan has): the tool
    asks `input_status` first, which reports the empty object at offset 0 and not
    yet complete; its one empty write completes it, and the attempt becomes ready."""
    empty = StreamedInput(b"", name="empty.bin")
    full = StreamedInput(os.urandom(4096), name="frames.tar")
    plan = daemon.plan(inputs=[empty, full])
    rows(daemon.prepare([plan]))
    before = _staged(daemon, plan, empty)
    assert (before.offset, before.bytes, before.complete) == (0, 0, False)  # type: ignore[attr-defined]
    (tmp_path / "plan.json").write_bytes(encode_plan(plan))
    (tmp_path / "empty.bin").write_bytes(b"")
    (tmp_path / "frames.tar").write_bytes(full.data)
    command = [*UPLOAD, "--socket", daemon.admin, "--plan", str(tmp_path / "plan.json")]
    for item in (empty, full):
        done = subprocess.run(
            [*command, "--input", item.name, str(tmp_path / item.name)],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert done.returncode == 0, done.stderr
        assert '"complete":true' in done.stdout
    after = input_row(daemon.input_status(plan, empty))
    assert (after.offset, after.complete) == (0, True)
    ready = daemon.wait_state(plan, lambda r: r.ready or r.state != "prepared", "readiness")
    assert (ready.state, ready.ready) == ("prepared", True)
