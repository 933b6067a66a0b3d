"""The shared host-wide task scan: concurrent callers share walks, and each is answered
by a walk that began after it asked, exactly as a walk of its own would answer."""

from __future__ import annotations

import os
import pathlib
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import pytest

from ficc.execution.provider import tasks
from ficc.execution.provider.tasks import SharedScan, TaskHits
from ficc_testkit import attacks
from ficc_testkit.accounts import Account
from ficc_testkit.waits import wait_for

HOST = [
    TaskHits(10, frozenset({1001}), False),
    TaskHits(11, frozenset({1001, 1002}), False),  # threads of two accounts
    TaskHits(12, frozenset(), True),  # a status that cannot be parsed
    TaskHits(13, frozenset({1003}), True),
]


def _scan_of(host: list[TaskHits]) -> Callable[[set[int]], list[TaskHits]]:
    """A walk of a made-up host: what `tasks.scan_tasks` would find there."""

    def scan(uids: set[int]) -> list[TaskHits]:
        return [
            TaskHits(t.pid, t.hits & uids, t.unreadable)
            for t in host
            if t.hits & uids or t.unreadable
        ]

    return scan


@pytest.mark.parametrize("uids", [{1001}, {1002}, {1003}, {1004}, {1001, 1003}])
def test_a_shared_answer_is_what_a_walk_of_ones_own_says(uids: set[int]) -> None:
    scan = _scan_of(HOST)
    assert SharedScan(scan).live_tasks(uids) == tasks.accounts_in(scan(uids), uids)


def test_the_accounts_of_one_walk_are_each_callers_own() -> None:
    """A process with threads of two accounts is each account's; one that cannot be read
    is everyone's (fail closed), unless it is someone's by a thread that can be read."""
    assert tasks.accounts_in(HOST, {1001}) == [(1001, 10), (1001, 11), (-1, 12), (-1, 13)]
    assert tasks.accounts_in(HOST, {1002}) == [(1002, 11), (-1, 12), (-1, 13)]
    assert tasks.accounts_in(HOST, {1003}) == [(-1, 12), (1003, 13)]


def test_callers_that_arrive_during_a_walk_share_the_next_one() -> None:
    """The first caller's walk is held; eight callers arrive meanwhile. They are answered
    by one more walk, which began after all of them asked and looked for all their UIDs."""
    started, release = threading.Event(), threading.Event()
    asked: list[set[int]] = []

    def scan(uids: set[int]) -> list[TaskHits]:
        asked.append(set(uids))
        if len(asked) == 1:
            started.set()
            release.wait()
        return [TaskHits(1000 + len(asked), frozenset(uids), False)]

    shared = SharedScan(scan)
    with ThreadPoolExecutor(max_workers=9) as pool:
        first = pool.submit(shared.live_tasks, {1})
        started.wait()
        later = [pool.submit(shared.live_tasks, {uid}) for uid in range(2, 10)]
        wait_for(lambda: shared._waiting.get(1) == 8, "eight callers to wait for the next walk")
        release.set()
        assert first.result() == [(1, 1001)]  # the walk it led
        assert [f.result() for f in later] == [[(uid, 1002)] for uid in range(2, 10)]
    assert asked == [{1}, set(range(2, 10))]
    assert shared.walks == 2
    assert not shared._waiting  # nothing is kept between walks
    assert not shared._done


def test_a_failed_walk_fails_its_callers_and_the_next_walk_is_fresh() -> None:
    calls = 0

    def scan(uids: set[int]) -> list[TaskHits]:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise PermissionError("no /proc")
        return [TaskHits(7, frozenset(uids), False)]

    shared = SharedScan(scan)
    with pytest.raises(PermissionError):
        shared.live_tasks({5})
    assert shared.live_tasks({5}) == [(5, 7)]


def test_the_shared_walk_finds_this_process_on_the_real_host() -> None:
    me = os.getuid()
    found = SharedScan().live_tasks({me})
    assert (me, os.getpid()) in found
    assert all(uid in (me, -1) for uid, _ in found)


def test_a_thread_behind_an_exited_leader_is_a_live_task(tmp_path: pathlib.Path) -> None:
    """A leader that called exit(2) while another thread runs shows `State: Z`; the
    walk reads every thread, so the process is live for its account all the same."""
    me = Account("me", os.geteuid(), os.getegid())
    with attacks.hide_behind_zombie(me, str(tmp_path / "none")) as hidden:
        assert "Z" in hidden.thread_states().values()
        assert tasks.has_live_thread(hidden.pid)
        assert (me.uid, hidden.pid) in tasks.live_tasks({me.uid})
        assert (me.uid, hidden.pid) in tasks.SHARED.live_tasks({me.uid})
        assert tasks.live_uid_of(hidden.pid, {me.uid}) == me.uid
    assert not tasks.has_live_thread(hidden.pid)
