"""The public API on a real store: every rule of the contract and every refusal."""

from __future__ import annotations

import itertools
import pathlib
import sys
import threading

import pytest

import ficc.hoststate as hs
from ficc.hoststate import Status, acquire
from hs_support import HOST, plan

S = Status
PATH_TO = {
    S.QUEUED: [],
    S.RUNNING: [S.RUNNING],
    S.SUCCEEDED: [S.RUNNING, S.SUCCEEDED],
    S.FAILED_RECOVERED: [S.RUNNING, S.FAILED_RECOVERED],
    S.NEEDS_ATTENTION: [S.RUNNING, S.NEEDS_ATTENTION],
    S.UNKNOWN: [S.RUNNING, S.UNKNOWN],
    S.CANCELLED: [S.CANCELLED],
}


def drive(session: hs.Session, op_id: str, statuses: list[Status]) -> hs.Operation:
    op, _ = session.begin(op_id, plan(op_id))
    for status in statuses:
        op = session.advance(op_id, op.revision, status)
    return op


def test_public_names() -> None:
    names = {
        "acquire", "Session", "Operation", "Status", "HostStateError", "Locked",
        "Unsupported", "Conflict", "Blocked", "StaleRevision", "InvalidTransition",
        "NotFound", "Corrupt", "HostMismatch", "CapacityExceeded", "Poisoned", "Closed",
    }  # fmt: skip
    assert names <= set(hs.__all__)
    for name in names - {"acquire", "Session", "Operation", "Status"}:
        error = getattr(hs, name)
        assert issubclass(error, hs.HostStateError)
        assert error.code.islower()
        assert error.code.replace("_", "").isalpha()
    codes = [getattr(hs, n).code for n in hs.__all__ if isinstance(getattr(hs, n), type)
             and issubclass(getattr(hs, n), hs.HostStateError)]  # fmt: skip
    assert len(codes) == len(set(codes)), "every error class has its own code"


def test_begin_creates_queued_revision_1(store: pathlib.Path) -> None:
    with acquire(store, HOST) as s:
        op, created = s.begin("op-1", plan(1))
        assert created is True
        assert (op.id, op.plan_hash, op.status, op.revision) == ("op-1", plan(1), S.QUEUED, 1)
        assert s.get("op-1") == op


def test_begin_same_id_same_hash_returns_original(store: pathlib.Path) -> None:
    with acquire(store, HOST) as s:
        first, _ = s.begin("op-1", plan(1))
        running = s.advance("op-1", 1, S.RUNNING)
        again, created = s.begin("op-1", plan(1))
        assert created is False
        assert again == running != first  # the stored record, not a new one


def test_begin_same_id_same_hash_after_resolution_and_reopen(store: pathlib.Path) -> None:
    with acquire(store, HOST) as s:
        drive(s, "op-1", [S.RUNNING, S.SUCCEEDED])
    with acquire(store, HOST) as s:
        op, created = s.begin("op-1", plan("op-1"))
        assert (created, op.status, op.revision) == (False, S.SUCCEEDED, 3)


def test_begin_same_id_other_hash_conflicts(store: pathlib.Path) -> None:
    with acquire(store, HOST) as s:
        drive(s, "op-1", [S.CANCELLED])
        with pytest.raises(hs.Conflict) as info:
            s.begin("op-1", plan("other"))
        assert info.value.code == "conflict"
        assert s.get("op-1").plan_hash == plan("op-1")


@pytest.mark.parametrize("status", [S.QUEUED, S.RUNNING, S.NEEDS_ATTENTION, S.UNKNOWN])
def test_begin_other_id_blocked_while_unresolved(store: pathlib.Path, status: Status) -> None:
    with acquire(store, HOST) as s:
        drive(s, "op-1", PATH_TO[status])
        with pytest.raises(hs.Blocked) as info:
            s.begin("op-2", plan(2))
        assert "op-1" in str(info.value)
        with pytest.raises(hs.NotFound):
            s.get("op-2")
    with acquire(store, HOST) as s, pytest.raises(hs.Blocked):  # it survives a restart
        s.begin("op-2", plan(2))


@pytest.mark.parametrize("status", sorted(hs.model.TERMINAL))
def test_begin_other_id_allowed_once_resolved(store: pathlib.Path, status: Status) -> None:
    with acquire(store, HOST) as s:
        drive(s, "op-1", PATH_TO[status])
        op, created = s.begin("op-2", plan(2))
        assert created
        assert op.status is S.QUEUED


@pytest.mark.parametrize(("current", "nxt"), list(itertools.product(Status, Status)),
                         ids=lambda s: s.value)  # fmt: skip
def test_every_transition_through_a_session(
    store: pathlib.Path, current: Status, nxt: Status
) -> None:
    allowed = nxt in hs.model.TRANSITIONS[current]
    with acquire(store, HOST) as s:
        op = drive(s, "op-1", PATH_TO[current])
        assert op.status is current
        if allowed:
            new = s.advance("op-1", op.revision, nxt.value)
            assert (new.status, new.revision) == (nxt, op.revision + 1)
        else:
            with pytest.raises(hs.InvalidTransition) as info:
                s.advance("op-1", op.revision, nxt)
            assert info.value.code == "invalid_transition"
            assert s.get("op-1") == op
    with acquire(store, HOST) as s:
        assert s.get("op-1").status is (nxt if allowed else current)


def test_advance_compares_revision(store: pathlib.Path) -> None:
    with acquire(store, HOST) as s:
        s.begin("op-1", plan(1))
        for stale in (0, 2, 7):
            with pytest.raises((hs.StaleRevision, hs.InvalidArgument)):
                s.advance("op-1", stale, S.RUNNING)
        with pytest.raises(hs.StaleRevision) as info:
            s.advance("op-1", 2, S.RUNNING)
        assert info.value.code == "stale_revision"
        assert s.get("op-1").revision == 1


def test_second_claim_fails(store: pathlib.Path) -> None:
    with acquire(store, HOST) as s:
        op, _ = s.begin("op-1", plan(1))
        claimed = s.advance("op-1", op.revision, S.RUNNING)
        with pytest.raises(hs.StaleRevision):  # a second claimer holding the old revision
            s.advance("op-1", op.revision, S.RUNNING)
        with pytest.raises(hs.InvalidTransition):  # or even the current one
            s.advance("op-1", claimed.revision, S.RUNNING)
        assert s.get("op-1") == claimed


def test_stale_checked_before_transition(store: pathlib.Path) -> None:
    with acquire(store, HOST) as s:
        s.begin("op-1", plan(1))
        with pytest.raises(hs.StaleRevision):
            s.advance("op-1", 2, S.SUCCEEDED)  # both stale and invalid


def test_not_found(store: pathlib.Path) -> None:
    with acquire(store, HOST) as s:
        with pytest.raises(hs.NotFound) as info:
            s.get("nope")
        assert isinstance(info.value, KeyError)
        assert info.value.code == "not_found"
        assert "nope" in str(info.value)
        with pytest.raises(hs.NotFound):
            s.advance("nope", 1, S.RUNNING)


def test_get_returns_an_immutable_value(store: pathlib.Path) -> None:
    with acquire(store, HOST) as s:
        op, _ = s.begin("op-1", plan(1))
        with pytest.raises(AttributeError):
            op.status = S.SUCCEEDED  # type: ignore[misc]
        s.advance("op-1", 1, S.RUNNING)
        assert op.status is S.QUEUED  # the earlier value did not change under us
        assert s.get("op-1").status is S.RUNNING


@pytest.mark.parametrize(
    ("call", "args"),
    [
        ("begin", ("bad id", plan(1))),
        ("begin", ("op-1", "sha256:XYZ")),
        ("advance", ("op-1", 1, "finished")),
        ("advance", ("op-1", "1", S.RUNNING)),
        ("advance", ("-op", 1, S.RUNNING)),
        ("get", ("op/1",)),
    ],
)
def test_invalid_arguments(store: pathlib.Path, call: str, args: tuple[object, ...]) -> None:
    with acquire(store, HOST) as s:
        s.begin("op-1", plan(1))
        with pytest.raises(hs.InvalidArgument) as info:
            getattr(s, call)(*args)
        assert isinstance(info.value, ValueError)
        assert s.get("op-1").revision == 1


def test_invalid_host_id_refused_before_touching_disk(store: pathlib.Path) -> None:
    with pytest.raises(hs.InvalidArgument):
        acquire(store, "bad host")
    assert list(store.iterdir()) == []


def test_closed_session_refuses_use_and_close_is_idempotent(store: pathlib.Path) -> None:
    s = acquire(store, HOST)
    s.begin("op-1", plan(1))
    s.close()
    s.close()
    for call, args in [("begin", ("op-2", plan(2))), ("advance", ("op-1", 1, "running")),
                       ("get", ("op-1",))]:  # fmt: skip
        with pytest.raises(hs.Closed) as info:
            getattr(s, call)(*args)
        assert info.value.code == "closed"
    with acquire(store, HOST) as again:  # close released the lock
        assert again.get("op-1").revision == 1


def test_context_manager_closes_on_error(store: pathlib.Path) -> None:
    with pytest.raises(RuntimeError), acquire(store, HOST) as s:
        raise RuntimeError("boom")
    with pytest.raises(hs.Closed):
        s.get("x")


def test_second_acquire_in_same_process_is_locked(store: pathlib.Path) -> None:
    with acquire(store, HOST):
        with pytest.raises(hs.Locked) as info:
            acquire(store, HOST)
        assert info.value.code == "locked"
        assert "never delete host.lock" in str(info.value)


def test_concurrent_threads_are_serialized(store: pathlib.Path) -> None:
    with acquire(store, HOST) as s:
        barrier = threading.Barrier(8)
        results: list[bool] = []

        def worker() -> None:
            barrier.wait()
            _, created = s.begin("op-1", plan(1))
            results.append(created)
            try:
                s.advance("op-1", 1, S.RUNNING)
                results.append(True)
            except hs.StaleRevision:
                results.append(False)

        threads = [threading.Thread(target=worker) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert sorted(results) == [False] * 14 + [True] * 2  # one creation, one claim
        assert s.get("op-1").revision == 2


def test_state_survives_reopen(store: pathlib.Path) -> None:
    with acquire(store, HOST) as s:
        drive(s, "b", [S.RUNNING, S.UNKNOWN, S.FAILED_RECOVERED])
        drive(s, "a", [S.CANCELLED])
        drive(s, "c", [S.RUNNING])
    with acquire(store, HOST) as s:
        assert [(x, s.get(x).status, s.get(x).revision) for x in "abc"] == [
            ("a", S.CANCELLED, 2), ("b", S.FAILED_RECOVERED, 4), ("c", S.RUNNING, 2)
        ]  # fmt: skip


def test_unknown_and_running_survive_restart_without_replay(store: pathlib.Path) -> None:
    with acquire(store, HOST) as s:
        drive(s, "op-1", [S.RUNNING, S.UNKNOWN])
    with acquire(store, HOST) as s:
        op = s.get("op-1")
        assert (op.status, op.revision) == (S.UNKNOWN, 3)  # no automatic reset or retry


def test_files_are_private(store: pathlib.Path) -> None:
    with acquire(store, HOST) as s:
        s.begin("op-1", plan(1))
    for name in ("host.lock", "state.json"):
        assert (store / name).stat().st_mode & 0o777 == 0o600
    assert sorted(p.name for p in store.iterdir()) == ["host.lock", "state.json"]


def test_host_lock_is_never_replaced(store: pathlib.Path) -> None:
    with acquire(store, HOST) as s:
        inode = (store / "host.lock").stat().st_ino
        drive(s, "op-1", [S.RUNNING, S.SUCCEEDED])
    with acquire(store, HOST):
        assert (store / "host.lock").stat().st_ino == inode


@pytest.mark.parametrize("platform", ["darwin", "freebsd13", "aix", "cygwin"])
def test_other_systems_are_unsupported(
    store: pathlib.Path, monkeypatch: pytest.MonkeyPatch, platform: str
) -> None:
    monkeypatch.setattr(sys, "platform", platform)
    with pytest.raises(hs.Unsupported) as info:
        acquire(store, HOST)
    assert info.value.code == "unsupported_platform"
    assert list(store.iterdir()) == []
