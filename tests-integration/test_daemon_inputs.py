"""Streamed inputs over the real socket: resumable after a lost reply.

`input_busy` (two writes of one attempt in flight at once) is produced over the socket
in test_daemon_error_codes.py and deterministically in staging's own tests
(packages/ficc-executor-host/tests/storage/test_staging.py).
"""

from __future__ import annotations

import os

from ficc_testkit.digests import digest_of
from ficc_testkit.driver import StreamedInput, attempt, chunks, input_row, row_code, rows
from ficc_testkit.host import Daemon
from ficc_testkit.waits import wait_for

CHUNK = 256 * 1024


def staged(daemon: Daemon, plan: object, item: StreamedInput) -> object:
    """input_status once staging is initialised (`inputs_preparing` until then)."""

    def status() -> object:
        row = daemon.input_status(plan, item)  # type: ignore[arg-type]
        return None if row_code(row) == "inputs_preparing" else row

    return wait_for(status, "staging to be initialised")


def test_a_stream_resumes_at_the_durable_offset_after_a_lost_reply(daemon: Daemon) -> None:
    item = StreamedInput(os.urandom(3 * CHUNK + 1000))
    plan = daemon.plan(inputs=[item])
    (row,) = rows(daemon.prepare([plan]))
    assert attempt(row).ready is False
    first = input_row(staged(daemon, plan, item))
    assert (first.offset, first.bytes, first.complete) == (0, len(item.data), False)
    assert first.digest == digest_of(item.data)

    parts = list(chunks(item.data, CHUNK))
    written = input_row(daemon.input_write(plan, item, *parts[0]))
    assert written.offset == CHUNK
    # the controller lost that reply and sends the same chunk again: refused, nothing moves
    assert row_code(daemon.input_write(plan, item, *parts[0])) == "input_offset_changed"
    status = input_row(daemon.input_status(plan, item))
    assert (status.offset, status.complete) == (CHUNK, False)
    # resume from the durable offset
    for offset, data in parts[1:]:
        row = input_row(daemon.input_write(plan, item, offset, data))
        assert row.offset == offset + len(data)
    final = input_row(daemon.input_status(plan, item))
    assert (final.offset, final.complete) == (len(item.data), True)
    assert row_code(daemon.input_write(plan, item, 0, parts[0][1])) in {
        "input_complete",
        "input_offset_changed",
    }
    # every stream complete: preparation starts by itself and the attempt becomes ready
    ready = daemon.wait_state(plan, lambda r: r.ready or r.state != "prepared", "readiness")
    assert (ready.state, ready.ready) == ("prepared", True)
    assert ready.staged_bytes == len(item.data)


def test_start_is_refused_while_inputs_are_incomplete(daemon: Daemon) -> None:
    item = StreamedInput(os.urandom(CHUNK))
    plan = daemon.plan(inputs=[item])
    rows(daemon.prepare([plan]))
    staged(daemon, plan, item)
    refused = daemon.start_attempt(plan)
    assert row_code(refused) is not None
    assert attempt(daemon.observe(plan)).state == "prepared"


def test_bytes_that_do_not_match_the_declared_digest_fail_the_input(daemon: Daemon) -> None:
    good = os.urandom(2 * CHUNK)
    item = StreamedInput(good, declared_digest=digest_of(b"another object" + good[14:]))
    plan = daemon.plan(inputs=[item])
    rows(daemon.prepare([plan]))
    staged(daemon, plan, item)
    (offset, data), (last_offset, last) = list(chunks(good, CHUNK))
    input_row(daemon.input_write(plan, item, offset, data))
    assert row_code(daemon.input_write(plan, item, last_offset, last)) == "input_digest_mismatch"
    assert row_code(daemon.input_status(plan, item)) == "input_failed"
    failed = daemon.wait_state(plan, lambda r: r.state != "prepared", "the attempt to fail")
    assert (failed.state, failed.reason) == ("failed", "input_digest_mismatch")
    assert row_code(daemon.start_attempt(plan)) is not None or (
        attempt(daemon.observe(plan)).state == "failed"
    )


def test_a_write_past_the_declared_size_is_refused(daemon: Daemon) -> None:
    item = StreamedInput(os.urandom(1000))
    plan = daemon.plan(inputs=[item])
    rows(daemon.prepare([plan]))
    staged(daemon, plan, item)
    assert row_code(daemon.input_write(plan, item, 0, os.urandom(1001))) == "input_size_mismatch"
    assert input_row(daemon.input_status(plan, item)).offset == 0


def test_an_undeclared_object_is_refused(daemon: Daemon) -> None:
    item = StreamedInput(os.urandom(1000))
    plan = daemon.plan(inputs=[item])
    rows(daemon.prepare([plan]))
    staged(daemon, plan, item)
    stranger = StreamedInput(os.urandom(10))
    assert row_code(daemon.input_status(plan, stranger)) is not None
    assert row_code(daemon.input_write(plan, stranger, 0, stranger.data)) is not None
