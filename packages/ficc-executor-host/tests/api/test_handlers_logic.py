"""The request handlers' own decisions, without root: the real ledger (owned by this
process), a system service kept in memory and a runner that records what it is handed.

No daemon, no socket, no provider call: the handlers are called as the server calls
them, on the host of fakes (fake_host.py). What needs the kernel (sockets per role,
real services, the runner's work) is test_handlers.py's and test_pipeline.py's, with
root; these tests keep the logic in the fast lane.
"""

from __future__ import annotations

import types
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest

from fake_host import Host, plan
from ficc.execution import protocol, wire
from ficc.execution.host.storage.layout import service_name
from ficc.execution.protocol import Sender
from ficc_testkit.driver import now_ms, renewal
from ficc_testkit.fakes import FakeUnit
from ficc_testkit.plans import new_id


@pytest.fixture
def host(tmp_path: Path) -> Iterator[Host]:
    with Host(tmp_path) as made:
        yield made


def test_prepare_admits_and_hands_the_admitted_attempts_to_the_runner(host: Host) -> None:
    first, second = plan(), plan()
    rows = host.prepare(first, second)
    assert [type(r) for r in rows] == [wire.AttemptRow, wire.AttemptRow]
    assert [r.attempt_id for r in rows] == [first.attempt_id, second.attempt_id]
    assert {r.slot for r in rows} == {"s0", "s1"}
    assert host.runner.calls == [("admitted", (first.attempt_id, second.attempt_id))]


def test_a_repeated_prepare_is_answered_from_the_ledger_and_hands_nothing_new(host: Host) -> None:
    job = plan()
    (row,) = host.prepare(job)
    (again,) = host.prepare(job)
    assert again == row
    assert host.runner.calls == [("admitted", (job.attempt_id,))]


def test_a_plan_pinning_another_provider_package_is_rejected_in_its_row(host: Host) -> None:
    good, foreign = plan(), plan(package_digest="sha256:" + "b" * 64)
    rows = host.prepare(good, foreign)
    assert isinstance(rows[0], wire.AttemptRow)
    assert isinstance(rows[1], wire.ErrorRow), rows[1]
    assert rows[1].error.code == "admission_rejected"
    assert rows[1].error.message.startswith("provider_unavailable: the plan pins provider package")
    assert host.runner.calls == [("admitted", (good.attempt_id,))]


def test_stale_bindings_refuse_the_whole_prepare(host: Host) -> None:
    job = plan()
    request = protocol.PrepareRequest(
        version=1, id=new_id(), **(host.bindings() | {"ledger_id": "f" * 32}),
        attempts=[protocol.PrepareAttempt(plan=job, lease=renewal(job, 1, now_ms() + 1000))],
    )  # fmt: skip
    reply = host.send(request)
    assert isinstance(reply, wire.ErrorReply)
    assert reply.error.code == "bindings_changed"
    assert host.runner.calls == []


def test_renew_extends_the_lease_and_tells_the_runner(host: Host) -> None:
    job = plan()
    host.prepare(job)
    expires = now_ms() + 600_000
    request = protocol.RenewRequest(version=1, id=new_id(), leases=[renewal(job, 2, expires)])
    (row,) = host.send(request).results
    assert isinstance(row, wire.AttemptRow), row
    assert (row.lease_sequence, row.lease_expires_at_ms) == (2, expires)
    assert host.runner.calls[-1] == ("leases_renewed", (job.attempt_id,))


def test_a_renewal_after_the_reaper_stopped_the_attempt_is_lease_expired(host: Host) -> None:
    job = plan()
    host.prepare(job)
    host.runner.reaped.add(job.attempt_id)
    request = protocol.RenewRequest(
        version=1, id=new_id(), leases=[renewal(job, 2, now_ms() + 600_000)]
    )
    (row,) = host.send(request).results
    assert isinstance(row, wire.ErrorRow)
    assert row.error.code == "lease_expired"
    assert host.runner.calls[-1] == ("stop_requested", (job.attempt_id,))
    assert host.ctx.ledger.get(job.attempt_id).status.state == "expired"


def test_snapshot_shows_the_admitted_attempt_and_the_offer(host: Host) -> None:
    job = plan()
    host.prepare(job)
    reply = host.send(protocol.SnapshotRequest(version=1, id=new_id()))
    assert [a.attempt_id for a in reply.attempts] == [job.attempt_id]
    assert reply.offer.revision == 1
    assert reply.installation_id == host.config.installation_id


def test_reconcile_absent_is_refused_while_a_service_of_the_host_is_left(host: Host) -> None:
    ghost = new_id()
    name = service_name(host.config.installation_id, ghost)
    host.service.units[name] = FakeUnit(types.SimpleNamespace(name=name))  # type: ignore[arg-type]
    request = protocol.ReconcileAbsentRequest(
        version=1,
        id=new_id(),
        **host.bindings(),
        plans=[plan(attempt_id=ghost)],
        acknowledge_unknown=True,
    )
    refused = host.send(request, Sender.ADMINISTRATOR)
    assert isinstance(refused, wire.ErrorReply)
    assert refused.error.code == "reconcile_refused"
    assert f"service {name} still exists" in refused.error.message
    del host.service.units[name]
    request = msgspec.structs.replace(request, id=new_id())
    (row,) = host.send(request, Sender.ADMINISTRATOR).results
    assert (row.attempt_id, row.state, row.outcome) == (ghost, "unknown", "unknown")
    assert row.reason == "legacy_absence_acknowledged"
