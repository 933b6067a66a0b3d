"""A slot account's processes anywhere on the host: whether any is alive, and killing
them all. What a cgroup holds is not enough: a process of the account may have left
the service's tree (a daemonized child of a runtime, say)."""

from __future__ import annotations

import os
import signal
import time

from ficc.execution.host.core.codes import HostCode
from ficc.execution.host.core.errors import HostError
from ficc.execution.provider import tasks

KILL_LOOK_PAUSE = 0.05


def kill_account(uid: int, timeout: float) -> bool:
    """SIGKILL every live process that runs as `uid` (any of its UIDs), wait until
    none is left (`service_stop_unconfirmed` after `timeout`), and say whether the
    account is idle then (what `account_idle` would say, without a second walk).

    Each is killed through a pidfd after its credentials were read again through
    that pidfd's process, so a PID reused meanwhile is never hit. A process whose
    status cannot be parsed is not killed (it may be anyone's); it keeps the account
    from being idle, as `account_idle` says.
    """
    deadline = time.monotonic() + timeout
    while True:
        found = tasks.SHARED.live_tasks({uid})
        pids = [pid for who, pid in found if who == uid]
        if not pids:
            return not found
        if time.monotonic() >= deadline:
            raise HostError(
                HostCode.SERVICE_STOP_UNCONFIRMED,
                f"processes {pids[:16]} of slot account {uid} survived SIGKILL for {timeout}s;"
                " investigate them (uninterruptible sleep on a dead mount?)",
            )
        for pid in pids:
            _kill_if_account(pid, uid)
        # Each look walks every task on the host: look again after a pause, not at once.
        time.sleep(min(KILL_LOOK_PAUSE, max(0.0, deadline - time.monotonic())))


def _kill_if_account(pid: int, uid: int) -> None:
    try:
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    try:
        if tasks.live_uid_of(pid, {uid}) == uid:  # still the account's, now pinned
            signal.pidfd_send_signal(pidfd, signal.SIGKILL)
    except ProcessLookupError:
        pass
    finally:
        os.close(pidfd)


def has_live_tasks(uid: int) -> bool:
    """Any live task on the host with `uid` among its credentials (or one whose
    status cannot be read: fail closed)."""
    return bool(tasks.SHARED.live_tasks({uid}))
