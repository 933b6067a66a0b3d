"""The job's step machine (cli/job_steps.py) fed scripted replies: every decision of
`run` and `smoke-test` (what to send next, when to renew, what an interrupt does, how
a run ends), with no daemon, no socket and no clock but the one the test turns."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from ficc.execution import plan as planlib
from ficc.execution.host.cli.job_steps import (
    READ_BYTES,
    Chunk,
    Ending,
    Finish,
    JobSteps,
    Now,
    Phase,
    Send,
    Upload,
    Wait,
)
from ficc.execution.host.cli.run import (
    EXIT_INTERRUPTED,
    EXIT_NO_EXIT_CODE,
    EXIT_REFUSED,
    EXIT_UNFINISHED,
    exit_status,
    verdict,
)
from ficc.execution.protocol import (
    CollectRequest,
    ObserveRequest,
    PrepareRequest,
    ReleaseRequest,
    RenewRequest,
    StartRequest,
    StopRequest,
)
from ficc.execution.wire import (
    AttemptRow,
    AttemptsReply,
    Error,
    ErrorReply,
    ErrorRow,
    ReadRow,
    ReadsReply,
)
from ficc_testkit.plans import make_plan

ID = "77" * 16
BINDINGS = {"installation_id": "1f" * 16, "ledger_id": "2e" * 16, "admission_version": 1}
STREAMED = planlib.InputObject(
    id="3c" * 16, name="data.bin", bytes=10, digest="sha256:" + "ab" * 32, delivery="stream"
)


def plan(inputs: tuple[planlib.InputObject, ...] = ()) -> planlib.Plan:
    return make_plan(inputs=inputs, outputs={"result": "out.bin"})


def machine(job: planlib.Plan | None = None, **options: Any) -> JobSteps:
    settings: dict[str, Any] = {"bindings": BINDINGS, "objects": ["stdout", "output:result"],
                                "lease_s": 30} | options  # fmt: skip
    return JobSteps(job or plan(), new_id=lambda: ID, **settings)


def at(seconds: float) -> Now:
    return Now(seconds, 1_800_000_000_000 + int(seconds * 1000))


def row(steps: JobSteps, state: str, **fields: Any) -> AttemptRow:
    outcome = state if state in ("succeeded", "failed", "cancelled", "expired", "unknown") else None
    values: dict[str, Any] = {
        "attempt_id": steps.fence.attempt_id, "generation": 1,
        "plan_digest": steps.fence.plan_digest, "state": state, "ready": False,
        "outcome": outcome, "reason": None, "exit_code": None, "lease_sequence": 1,
        "lease_expires_at_ms": 1_800_000_030_000, "slot": "s0", "staged_bytes": 0,
        "stdout_bytes": 0, "stderr_bytes": 0, "cleanup_confirmed": False,
    } | fields  # fmt: skip
    return AttemptRow(**values)


def rows(*results: Any) -> AttemptsReply:
    return AttemptsReply(version=1, id=ID, results=list(results))


def refused(code: str, message: str = "no") -> ErrorRow:
    return ErrorRow(error=Error(code, message))


def read(
    steps: JobSteps, name: str, offset: int, data: bytes, *, eof: bool, identity: str = "a"
) -> ReadsReply:
    f = steps.fence
    done = ReadRow(
        attempt_id=f.attempt_id, generation=1, plan_digest=f.plan_digest, object=name,
        offset=offset, data=data, next_offset=offset + len(data), eof=eof, complete=eof,
        identity="sha256:" + identity * 64,
    )  # fmt: skip
    return ReadsReply(version=1, id=ID, results=[done])


def sends(steps: JobSteps, now: Now, kind: type[Any]) -> Any:
    action = steps.action(now)
    assert isinstance(action, Send), action
    assert isinstance(action.request, kind), action
    return action.request


def ended(steps: JobSteps, now: Now) -> Any:
    action = steps.action(now)
    assert isinstance(action, Finish), action
    return action.result


def run_to_running(steps: JobSteps) -> None:
    sends(steps, at(0), PrepareRequest)
    steps.answer("prepare", rows(row(steps, "prepared")), at(0))
    sends(steps, at(0), ObserveRequest)
    steps.answer("observe", rows(row(steps, "prepared", ready=True)), at(0))
    sends(steps, at(0), StartRequest)
    steps.answer("start", rows(row(steps, "starting", ready=True)), at(0))
    sends(steps, at(0), ObserveRequest)
    steps.answer("observe", rows(row(steps, "running", ready=True)), at(0))


def collect_and_release(steps: JobSteps, now: Now, outcome: str = "succeeded") -> Any:
    for name in ("stdout", "output:result"):
        request = sends(steps, now, CollectRequest)
        assert request.reads[0].object == name
        steps.answer("collect", read(steps, name, 0, b"x", eof=True), now)
    sends(steps, now, ReleaseRequest)
    released = row(steps, "released", outcome=outcome, cleanup_confirmed=True, exit_code=0)
    steps.answer("release", rows(released), now)
    return ended(steps, now)


def test_a_job_runs_prepare_upload_ready_start_end_collect_release() -> None:
    steps = machine(plan((STREAMED,)))
    prepare = sends(steps, at(0), PrepareRequest)
    assert prepare.installation_id == BINDINGS["installation_id"]
    assert prepare.attempts[0].lease.sequence == 1
    assert prepare.attempts[0].lease.expires_at_ms == at(0).wall_ms + 30_000
    steps.answer("prepare", rows(row(steps, "prepared")), at(0))
    assert steps.action(at(0)) == Upload(STREAMED)
    steps.uploaded(STREAMED, at(1))
    sends(steps, at(1), ObserveRequest)
    steps.answer("observe", rows(row(steps, "prepared")), at(1))
    assert steps.action(at(1.1)) == Wait(pytest.approx(0.15))  # type: ignore[arg-type]
    sends(steps, at(1.25), ObserveRequest)
    steps.answer("observe", rows(row(steps, "prepared", ready=True)), at(1.25))
    sends(steps, at(1.25), StartRequest)
    steps.answer("start", rows(row(steps, "starting", ready=True)), at(1.25))
    sends(steps, at(1.25), ObserveRequest)
    done = row(steps, "succeeded", reason="exited", exit_code=0, cleanup_confirmed=True)
    steps.answer("observe", rows(done), at(2))
    result = collect_and_release(steps, at(2))
    assert (result.ending, result.row.state) == (Ending.ENDED, "released")
    assert steps.take_notes() == [
        "prepare: admitted into slot s0, lease 30 s",
        "upload: data.bin complete (10 bytes)",
        "ready: the provider prepared the job",
        "start: accepted; the host creates the service and checks the payload",
        "run: the payload exited 0; cleanup confirmed (0 bytes out)",
        "collect: stdout, 1 bytes",
        "collect: output:result, 1 bytes",
        "release: released (outcome succeeded); the slot is free again",
    ]


def test_collect_reads_1_mib_at_the_offsets_the_host_returns() -> None:
    steps = machine(objects=["stdout"])
    run_to_running(steps)
    steps.answer("observe", rows(row(steps, "failed", cleanup_confirmed=True)), at(1))
    first = sends(steps, at(1), CollectRequest).reads[0]
    assert (first.offset, first.length) == (0, READ_BYTES)
    stored = steps.answer("collect", read(steps, "stdout", 0, b"a" * 700, eof=False), at(1))
    assert stored == [Chunk("stdout", 0, b"a" * 700)]
    assert sends(steps, at(1), CollectRequest).reads[0].offset == 700
    replaced = read(steps, "stdout", 700, b"b", eof=True, identity="b")
    assert steps.answer("collect", replaced, at(1)) == [Chunk("stdout", 0, b"", restart=True)]
    assert sends(steps, at(1), CollectRequest).reads[0].offset == 0  # the file was replaced
    steps.answer("collect", read(steps, "stdout", 0, b"new", eof=True, identity="b"), at(1))
    sends(steps, at(1), ReleaseRequest)


def test_an_object_that_cannot_be_read_is_noted_and_skipped() -> None:
    steps = machine()
    run_to_running(steps)
    steps.answer("observe", rows(row(steps, "failed", cleanup_confirmed=True)), at(1))
    sends(steps, at(1), CollectRequest)
    steps.answer(
        "collect", ReadsReply(version=1, id=ID, results=[refused("object_unavailable")]), at(1)
    )
    assert sends(steps, at(1), CollectRequest).reads[0].object == "output:result"
    assert "collect: stdout: not collected (object_unavailable: no)" in steps.take_notes()


def test_an_interrupt_stops_the_job_then_collects_and_releases_it() -> None:
    steps = machine()
    run_to_running(steps)
    steps.interrupt()
    sends(steps, at(1), StopRequest)
    steps.answer("stop", rows(row(steps, "running")), at(1))
    sends(steps, at(1), ObserveRequest)
    steps.answer("observe", rows(row(steps, "cancelled", cleanup_confirmed=True)), at(2))
    result = collect_and_release(steps, at(2), outcome="cancelled")
    assert result.ending is Ending.INTERRUPTED
    assert exit_status(result) == EXIT_INTERRUPTED


def test_a_second_interrupt_or_detach_leaves_the_attempt_reserved_with_a_resume() -> None:
    steps = machine()
    run_to_running(steps)
    steps.interrupt()
    sends(steps, at(1), StopRequest)
    steps.interrupt()
    steps.answer("stop", rows(row(steps, "running")), at(1))
    result = ended(steps, at(1))
    assert result.ending is Ending.DETACHED
    detached = machine(detach=True)
    run_to_running(detached)
    detached.interrupt()
    assert ended(detached, at(1)).ending is Ending.DETACHED
    lines = verdict(result, Path("/srv/out"))
    resume = "ficc-executor run --resume /srv/out"
    assert lines[-1] == f"the attempt is still reserved; to finish it: {resume}"


def test_an_interrupt_before_the_prepare_reserves_nothing() -> None:
    steps = machine()
    steps.interrupt()
    result = ended(steps, at(0))
    assert (result.ending, result.row) == (Ending.INTERRUPTED, None)


def test_a_refused_prepare_ends_the_run_with_nothing_reserved() -> None:
    steps = machine()
    sends(steps, at(0), PrepareRequest)
    steps.answer("prepare", rows(refused("admission_rejected", "slot_capacity: no slot")), at(0))
    result = ended(steps, at(0))
    assert (result.ending, result.message) == (
        Ending.REFUSED, "prepare: admission_rejected: slot_capacity: no slot",
    )  # fmt: skip
    assert exit_status(result) == EXIT_REFUSED


def test_a_refused_start_stops_and_releases_the_attempt_as_failed() -> None:
    steps = machine()
    sends(steps, at(0), PrepareRequest)
    steps.answer("prepare", rows(row(steps, "prepared")), at(0))
    sends(steps, at(0), ObserveRequest)
    steps.answer("observe", rows(row(steps, "prepared", ready=True)), at(0))
    sends(steps, at(0), StartRequest)
    steps.answer("start", rows(refused("input_changed", "data.bin changed")), at(0))
    sends(steps, at(0), StopRequest)
    steps.answer("stop", rows(row(steps, "failed")), at(0))
    sends(steps, at(0), ObserveRequest)
    steps.answer("observe", rows(row(steps, "failed", cleanup_confirmed=True)), at(0))
    result = collect_and_release(steps, at(0), outcome="failed")
    assert (result.ending, result.message) == (
        Ending.FAILED, "start: refused: input_changed: data.bin changed",
    )  # fmt: skip


def test_waiting_past_the_limit_fails_the_job_and_stops_it() -> None:
    steps = machine(wait_limit_s=10)
    run_to_running(steps)
    sends(steps, at(11), StopRequest)
    assert steps.failure == "run: waited 10 s for the end; the attempt is running (reason None)"


def test_a_job_that_exits_non_zero_ends_with_its_exit_code() -> None:
    steps = machine()
    run_to_running(steps)
    steps.answer(
        "observe",
        rows(row(steps, "failed", reason="exited", exit_code=7, cleanup_confirmed=True)),
        at(1),
    )
    for _ in range(2):
        sends(steps, at(1), CollectRequest)
        steps.answer("collect", read(steps, "stdout", 0, b"", eof=True), at(1))
    sends(steps, at(1), ReleaseRequest)
    last = row(
        steps, "released", outcome="failed", reason="exited", exit_code=7, cleanup_confirmed=True
    )
    steps.answer("release", rows(last), at(1))
    result = ended(steps, at(1))
    assert (result.ending, exit_status(result)) == (Ending.ENDED, 7)


def test_the_lease_is_renewed_every_third_with_a_new_sequence_until_the_end() -> None:
    steps = machine()
    assert steps.renewal(at(0)) is None  # nothing admitted yet
    sends(steps, at(0), PrepareRequest)
    steps.answer("prepare", rows(row(steps, "prepared")), at(0))
    assert steps.renew_in(at(0)) == 10
    assert steps.renewal(at(9)) is None
    first = steps.renewal(at(10))
    assert isinstance(first, RenewRequest)
    assert (first.leases[0].sequence, first.leases[0].expires_at_ms) == (2, at(10).wall_ms + 30_000)
    steps.renewed(None, at(11))  # no reply: try again soon, with the next sequence
    again = steps.renewal(at(13))
    assert again is not None
    assert again.leases[0].sequence == 3
    steps.renewed(rows(row(steps, "prepared", lease_sequence=3)), at(13))
    assert steps.renew_in(at(13)) == 10
    steps.renewed(rows(refused("lease_sequence")), at(14))
    assert steps.renew_in(at(14)) is None  # refused: repeating would be refused again
    assert "renew: refused: lease_sequence: no" in steps.take_notes()


def test_no_renewal_once_the_attempt_ended() -> None:
    steps = machine()
    run_to_running(steps)
    steps.answer("observe", rows(row(steps, "succeeded", cleanup_confirmed=False)), at(1))
    assert steps.renewal(at(100)) is None


@pytest.mark.parametrize(
    ("state", "fields", "next_request", "phase"),
    [
        ("running", {}, ObserveRequest, Phase.RUN),
        ("prepared", {"ready": True}, StartRequest, Phase.START),
        ("failed", {"cleanup_confirmed": True}, CollectRequest, Phase.COLLECT),
    ],
)
def test_resume_picks_up_the_attempt_in_its_state(
    state: str, fields: dict[str, Any], next_request: type[Any], phase: Phase
) -> None:
    steps = machine(bindings=None)
    sends(steps, at(0), ObserveRequest)
    steps.answer("observe", rows(row(steps, state, lease_sequence=5, **fields)), at(0))
    assert steps.phase is phase
    if phase is not Phase.RUN:
        sends(steps, at(0), next_request)
    if phase is not Phase.COLLECT:
        renewal = steps.renewal(at(10))
        assert renewal is not None
        assert renewal.leases[0].sequence == 6


def test_resume_of_a_prepared_attempt_uploads_its_inputs_again() -> None:
    steps = machine(plan((STREAMED,)), bindings=None)
    sends(steps, at(0), ObserveRequest)
    steps.answer("observe", rows(row(steps, "prepared")), at(0))
    assert steps.action(at(0)) == Upload(STREAMED)  # the upload resumes at the host's offset


def test_lost_replies_end_the_run_unfinished_unless_nothing_was_sent() -> None:
    steps = machine()
    sends(steps, at(0), PrepareRequest)
    steps.lost("prepare", "not_authorized: no", applied=False)
    assert ended(steps, at(0)).ending is Ending.REFUSED
    steps = machine()
    run_to_running(steps)
    steps.lost("observe", "Timeout", applied=True)
    result = ended(steps, at(1))
    assert (result.ending, exit_status(result)) == (Ending.UNFINISHED, EXIT_UNFINISHED)


def test_a_refused_release_ends_the_run_unfinished() -> None:
    steps = machine(objects=[])
    run_to_running(steps)
    steps.answer("observe", rows(row(steps, "succeeded", cleanup_confirmed=True)), at(1))
    sends(steps, at(1), ReleaseRequest)
    steps.answer("release", rows(refused("cleanup_unconfirmed")), at(1))
    assert ended(steps, at(1)).ending is Ending.UNFINISHED


def test_an_unknown_outcome_or_a_whole_refusal_has_no_exit_code_of_its_own() -> None:
    steps = machine(objects=[])
    run_to_running(steps)
    steps.answer(
        "observe",
        rows(row(steps, "unknown", reason="executor_restarted", cleanup_confirmed=True)),
        at(1),
    )
    sends(steps, at(1), ReleaseRequest)
    steps.answer(
        "release", rows(row(steps, "released", outcome="unknown", cleanup_confirmed=True)), at(1)
    )
    assert exit_status(ended(steps, at(1))) == EXIT_NO_EXIT_CODE
    whole = machine()
    sends(whole, at(0), PrepareRequest)
    whole.answer(
        "prepare", ErrorReply(version=1, id=ID, error=Error("bindings_changed", "x")), at(0)
    )
    assert ended(whole, at(0)).ending is Ending.REFUSED
