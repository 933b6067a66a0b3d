"""Request-byte pools by socket kind, and the progress a reserved frame must keep."""

from __future__ import annotations

from ficc.execution.host.core.authority import SocketKind
from ficc.execution.host.core.budget import Progress, RequestBudget


def test_each_socket_kind_takes_only_from_its_own_pool() -> None:
    budget = RequestBudget({SocketKind.TRANSPORT: 10, SocketKind.ADMINISTRATOR: 4,
                            SocketKind.LOCAL_OWNER: 4})  # fmt: skip
    assert budget.take(SocketKind.TRANSPORT, 10)
    assert not budget.take(SocketKind.TRANSPORT, 1)
    assert budget.take(SocketKind.ADMINISTRATOR, 4)  # untouched by the transport
    assert budget.take(SocketKind.LOCAL_OWNER, 3)
    assert not budget.take(SocketKind.LOCAL_OWNER, 2)
    budget.give(SocketKind.TRANSPORT, 10)
    assert budget.free(SocketKind.TRANSPORT) == 10


def test_a_frame_is_too_slow_only_after_the_grace_and_below_the_rate() -> None:
    rule = Progress(grace_s=2.0, min_rate=1000)
    assert not rule.too_slow(0, 2.0)  # nothing arrived, but still in the grace
    assert rule.too_slow(0, 2.1)
    assert not rule.too_slow(1000, 3.0)  # exactly on pace
    assert rule.too_slow(999, 3.0)
    assert not rule.too_slow(10**9, 100.0)
