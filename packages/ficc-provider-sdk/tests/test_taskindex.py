"""The kernel's process events as bytes (procevents.py) and the index they keep
(taskindex.py), without a kernel: made-up datagrams and a made-up host. The real
connector, under storms of forks, threads, credential changes, execs and exits, is
tested with root in ficc-executor-host (tests/linux/test_task_index.py)."""

from __future__ import annotations

import struct

import pytest

from ficc.execution.provider import procevents, taskindex
from ficc.execution.provider.procevents import Kind, ProcEvent
from ficc.execution.provider.taskindex import Index, Task


def _datagram(*events: tuple[int, int, int, bytes]) -> bytes:
    """Netlink messages, each a connector message carrying one process event
    (what, cpu, seq, data), as the kernel lays them out."""
    out = b""
    for what, cpu, seq, data in events:
        event = struct.pack("=IIQ", what, cpu, 123) + data
        cn = struct.pack("=IIIIHH", 1, 1, seq, 0, len(event), 0) + event
        message = struct.pack("=IHHII", 16 + len(cn), 3, 0, 0, 0) + cn
        out += message + b"\0" * (-len(message) % 4)
    return out


def test_every_kind_the_index_needs_is_decoded_with_its_task() -> None:
    data = _datagram(
        (Kind.FORK, 0, 7, struct.pack("=iiii", 1, 1, 501, 500)),
        (Kind.EXEC, 1, 3, struct.pack("=ii", 500, 500)),
        (Kind.UID, 1, 4, struct.pack("=iiII", 501, 500, 1000, 1000)),
        (Kind.EXIT, 0, 8, struct.pack("=iiIIii", 501, 500, 0, 17, 1, 1)),
        (0x200, 0, 9, b"\0" * 24),  # a name change: numbered, no task
    )
    assert procevents.decode(data) == [
        ProcEvent(Kind.FORK, 0, 7, 501, 500),
        ProcEvent(Kind.EXEC, 1, 3, 500, 500),
        ProcEvent(Kind.UID, 1, 4, 501, 500),
        ProcEvent(Kind.EXIT, 0, 8, 501, 500),
        ProcEvent(0x200, 0, 9, 0, 0),
    ]


@pytest.mark.parametrize("cut", [1, 10, 20, 40])
def test_a_truncated_datagram_is_a_lost_event_never_a_guess(cut: int) -> None:
    data = _datagram((Kind.FORK, 0, 7, struct.pack("=iiii", 1, 1, 501, 500)))
    with pytest.raises(ValueError):
        procevents.decode(data[:-cut])


def test_the_subscription_is_a_connector_message_with_the_listen_operation() -> None:
    length, kind, _, _, _ = struct.unpack_from("=IHHII", procevents.subscription())
    assert (length, kind) == (40, procevents.NLMSG_DONE)
    assert procevents.subscription()[-4:] == struct.pack("=I", 1)
    assert procevents.subscription(listen=False)[-4:] == struct.pack("=I", 2)


def test_a_gap_in_a_cpus_numbers_is_seen_and_cpus_are_apart() -> None:
    sequences = procevents.Sequences()
    assert not sequences.gap(ProcEvent(Kind.FORK, 0, 10, 1, 1))
    assert not sequences.gap(ProcEvent(Kind.FORK, 1, 500, 1, 1))
    assert not sequences.gap(ProcEvent(Kind.EXIT, 0, 11, 1, 1))
    assert not sequences.gap(ProcEvent(Kind.NONE, 0, 0, 0, 0))  # the subscription's answer
    assert sequences.gap(ProcEvent(Kind.EXIT, 0, 13, 1, 1))
    assert not sequences.gap(ProcEvent(Kind.FORK, 1, 501, 1, 1))


def test_the_numbers_wrap_at_32_bits() -> None:
    sequences = procevents.Sequences()
    sequences.gap(ProcEvent(Kind.FORK, 0, 0xFFFFFFFF, 1, 1))
    assert not sequences.gap(ProcEvent(Kind.FORK, 0, 0, 1, 1))


class _Host:
    """A made-up host: what a status read of each task says now."""

    def __init__(self) -> None:
        self.tasks: dict[int, Task] = {}

    def read(self, tgid: int, tid: int) -> Task | None:
        task = self.tasks.get(tid)
        return task if task is not None and task.tgid == tgid else None


def _task(tgid: int, *uids: int) -> Task:
    return Task(tgid, frozenset(uids), True)


def test_forks_credential_changes_execs_and_exits_keep_the_accounts_tasks() -> None:
    host = _Host()
    index = Index(host.read)
    host.tasks = {100: _task(100, 0)}
    index.replace(dict(host.tasks))
    assert index.live_tasks({1001}) == []
    host.tasks[101] = _task(100, 0)  # a thread of root's process
    index.apply(ProcEvent(Kind.FORK, 0, 1, 101, 100))
    host.tasks[101] = _task(100, 1001, 0)  # the thread alone takes the account's real UID
    index.apply(ProcEvent(Kind.UID, 0, 2, 101, 100))
    assert index.live_tasks({1001}) == [(1001, 100)], "a thread whose IDs differ from its leader's"
    host.tasks[200] = _task(200, 1001)
    index.apply(ProcEvent(Kind.FORK, 0, 3, 200, 200))
    assert index.live_tasks({1001, 1002}) == [(1001, 100), (1001, 200)]
    del host.tasks[100]
    index.apply(ProcEvent(Kind.EXIT, 0, 4, 100, 100))  # the leader exits, its thread runs
    assert index.live_tasks({1001}) == [(1001, 100), (1001, 200)]
    host.tasks = {200: _task(200, 1002)}  # the thread execs: takes the leader's ID 200...
    index.apply(ProcEvent(Kind.EXEC, 0, 5, 200, 200))
    assert index.live_tasks({1001}) == [(1001, 100)]
    assert index.live_tasks({1002}) == [(1002, 200)]
    del host.tasks[200]
    index.apply(ProcEvent(Kind.EXIT, 0, 6, 200, 200))
    index.apply(ProcEvent(Kind.EXIT, 0, 7, 101, 100))
    assert index.live_tasks({1001, 1002}) == []
    assert len(index) == 0


def test_an_exec_drops_the_threads_it_ended() -> None:
    host = _Host()
    host.tasks = {300: _task(300, 1001), 301: _task(300, 1001), 302: _task(300, 1001)}
    index = Index(host.read)
    index.replace(dict(host.tasks))
    host.tasks = {300: _task(300, 1001)}  # thread 302 exec'd and became 300
    index.apply(ProcEvent(Kind.EXEC, 0, 1, 300, 300))
    assert index.snapshot() == {300: _task(300, 1001)}


def test_a_task_whose_status_cannot_be_parsed_counts_for_every_account() -> None:
    host = _Host()
    host.tasks = {400: Task(400, frozenset(), False), 500: _task(500, 1001)}
    index = Index(host.read)
    index.replace(dict(host.tasks))
    assert index.live_tasks({1002}) == [(-1, 400)]
    assert index.live_tasks({1001}) == [(-1, 400), (1001, 500)]


def test_a_fork_of_a_task_that_is_already_gone_adds_nothing() -> None:
    host = _Host()
    index = Index(host.read)
    index.apply(ProcEvent(Kind.FORK, 0, 1, 600, 600))
    assert len(index) == 0


def test_an_audit_counts_only_what_is_still_wrong_when_read_again() -> None:
    host = _Host()
    host.tasks = {700: _task(700, 1001), 701: _task(701, 1001)}
    index = {700: _task(700, 1001)}
    walked = {700: _task(700, 1001), 701: _task(701, 1001), 702: _task(702, 1001)}
    found = taskindex.differences(index, walked, host.read)  # 702 ended since the walk
    assert found == ["task 701 (process 701, UIDs [1001]) was missing"]
    host.tasks[700] = _task(700, 1002)
    assert len(taskindex.differences(index, walked, host.read)) == 2
