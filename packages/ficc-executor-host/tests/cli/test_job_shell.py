"""The shell's one decision of its own: which transport failures are worth sending a
request again for, and when to give up (cli/job_shell.py `Exchange`)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from ficc.execution.client import Client, ConnectFailed, PeerNotRoot, Refused, Timeout
from ficc.execution.host.cli.job_shell import Exchange, Lost
from ficc.execution.protocol import SnapshotRequest

REQUEST = SnapshotRequest(version=1, id="12" * 16)


class Flaky(Client):
    """Fails with each of `failures` in turn, then answers `reply`."""

    def __init__(self, *failures: Exception) -> None:
        super().__init__("/nonexistent.sock")
        self.failures = list(failures)
        self.sent = 0

    async def request(self, message: Any) -> Any:
        self.sent += 1
        if self.failures:
            raise self.failures.pop(0)
        return "reply"


def send(client: Flaky, retries: int = 3) -> Any:
    return asyncio.run(Exchange(client, retries, pause_s=0).send(REQUEST))


def test_a_lost_reply_or_a_busy_daemon_is_asked_again() -> None:
    client = Flaky(Timeout("slow"), Refused("busy", "later"), ConnectFailed("gone"))
    assert send(client) == "reply"
    assert client.sent == 4


def test_after_the_retries_the_step_is_lost_and_may_have_run() -> None:
    client = Flaky(*(Timeout("slow") for _ in range(4)))
    with pytest.raises(Lost) as lost:
        send(client)
    assert (lost.value.applied, client.sent) == (True, 4)
    assert "3 retries used" in str(lost.value)


@pytest.mark.parametrize("failure", [Refused("not_authorized", "no"), PeerNotRoot("spoof")])
def test_what_asking_again_cannot_fix_is_lost_at_once_and_was_not_applied(
    failure: Exception,
) -> None:
    client = Flaky(failure)
    with pytest.raises(Lost) as lost:
        send(client)
    assert (lost.value.applied, client.sent) == (False, 1)
