"""Who may talk to the daemon, and send what (docs/protocol.md; reliability target R4).

Real accounts on real sockets: the transport user on transport.sock, the local owner
on owner-<uid>.sock, root on admin.sock. Authority comes from the socket alone; a
wrong UID is refused by the kernel (0600 socket files) and, where the file system lets
it through (root, or a loosened mode), by the daemon's SO_PEERCRED check before a
single frame byte is read.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Callable

import pytest

from ficc.execution.protocol import (
    ACTIONS,
    ZERO_ID,
    CheckSlotsRequest,
    CollectRequest,
    InputStatusRequest,
    InputWrite,
    InputWriteRequest,
    MetricsRequest,
    ObjectRef,
    ObserveRequest,
    PrepareAttempt,
    PrepareRequest,
    Read,
    ReconcileAbsentRequest,
    RejectAbsentRequest,
    ReleaseRequest,
    RenewRequest,
    Request,
    SetOfferRequest,
    SnapshotRequest,
    StartRequest,
    StopRequest,
    encode_request,
)
from ficc.execution.wire import ErrorReply, decode_reply
from ficc_testkit.accounts import Account
from ficc_testkit.driver import ClientFailed, error_code, fence, frame, raw_exchange, renewal, send
from ficc_testkit.host import Daemon
from ficc_testkit.plans import new_id

FORBIDDEN = {
    "transport": {"reconcile_absent", "set_offer", "metrics", "check_slots"},
    "owner": ACTIONS - {"snapshot", "set_offer"},
    "admin": set(),
}
"""The action table of docs/protocol.md, written out: what each socket may NOT send."""

WRONG_BINDINGS = {"installation_id": "0" * 32, "ledger_id": "0" * 32, "admission_version": 1}
"""Bindings no ledger has: an allowed prepare/reject/reconcile is refused later, harmlessly."""


def one_request(daemon: Daemon, action: str) -> Request:
    """A well-formed request of `action` that changes nothing if it is allowed."""
    plan = daemon.plan()
    rid = new_id()
    f = fence(plan)
    builders: dict[str, Callable[[], Request]] = {
        "prepare": lambda: PrepareRequest(
            version=1,
            id=rid,
            **WRONG_BINDINGS,
            attempts=[PrepareAttempt(plan=plan, lease=renewal(plan, 1, 2**40))],
        ),
        "renew": lambda: RenewRequest(version=1, id=rid, leases=[renewal(plan, 2, 2**40)]),
        "start": lambda: StartRequest(version=1, id=rid, attempts=[f]),
        "observe": lambda: ObserveRequest(version=1, id=rid, attempts=[f]),
        "stop": lambda: StopRequest(version=1, id=rid, attempts=[f]),
        "release": lambda: ReleaseRequest(version=1, id=rid, attempts=[f]),
        "collect": lambda: CollectRequest(
            version=1,
            id=rid,
            reads=[
                Read(
                    attempt_id=f.attempt_id,
                    generation=f.generation,
                    plan_digest=f.plan_digest,
                    object="stdout",
                    offset=0,
                    length=1024,
                )
            ],
        ),
        "input_status": lambda: InputStatusRequest(
            version=1,
            id=rid,
            objects=[
                ObjectRef(
                    attempt_id=f.attempt_id,
                    generation=f.generation,
                    plan_digest=f.plan_digest,
                    object=new_id(),
                )
            ],
        ),
        "input_write": lambda: InputWriteRequest(
            version=1,
            id=rid,
            writes=[
                InputWrite(
                    attempt_id=f.attempt_id,
                    generation=f.generation,
                    plan_digest=f.plan_digest,
                    object=new_id(),
                    offset=0,
                    data="YQ==",
                    digest="sha256:ca978112ca1bbdcafac231b39a23dc4da786eff8147c4e72b9807785afee48bb",
                )
            ],
        ),
        "reject_absent": lambda: RejectAbsentRequest(
            version=1, id=rid, **WRONG_BINDINGS, plans=[plan]
        ),
        "reconcile_absent": lambda: ReconcileAbsentRequest(
            version=1, id=rid, **WRONG_BINDINGS, plans=[plan], acknowledge_unknown=True
        ),
        "snapshot": lambda: SnapshotRequest(version=1, id=rid),
        "set_offer": lambda: SetOfferRequest(
            version=1, id=rid, expected_revision=999_999, control="active"
        ),
        "metrics": lambda: MetricsRequest(version=1, id=rid),
        "check_slots": lambda: CheckSlotsRequest(version=1, id=rid),
    }
    assert set(builders) == ACTIONS
    return builders[action]()


def sender_of(daemon: Daemon, role: str) -> tuple[str, Account | None]:
    if role == "admin":
        return daemon.admin, None
    return (
        (daemon.transport, daemon.accounts["transport"])
        if role == "transport"
        else (
            daemon.owner,
            daemon.accounts["owner"],
        )
    )


@pytest.mark.parametrize("role", ["transport", "owner", "admin"])
def test_the_action_matrix_on_each_socket_with_its_real_user(daemon: Daemon, role: str) -> None:
    path, account = sender_of(daemon, role)
    outcomes: dict[str, str | None] = {}
    for action in sorted(ACTIONS):
        request = one_request(daemon, action)
        reply = send(path, request, account)
        assert reply.id == request.id
        outcomes[action] = error_code(reply)
    refused = {action for action, code in outcomes.items() if code == "not_authorized"}
    assert refused == FORBIDDEN[role], outcomes
    # the snapshot is the one action every socket may send, and it succeeds
    assert outcomes["snapshot"] is None


def test_nothing_a_forbidden_request_asked_for_happened(daemon: Daemon) -> None:
    """set_offer from the transport changes no offer; reconcile_absent records nothing."""
    before = daemon.snapshot()
    plan = daemon.plan()
    offer = SetOfferRequest(
        version=1, id=new_id(), expected_revision=before.offer.revision, control="stopped"
    )
    assert error_code(daemon.as_transport(offer)) == "not_authorized"
    reconcile = daemon.reconcile_request([plan])
    assert error_code(daemon.as_transport(reconcile)) == "not_authorized"
    after = daemon.snapshot()
    assert after.offer == before.offer
    assert after.attempts == before.attempts == []


def test_socket_files_belong_to_their_one_peer_with_mode_0600(daemon: Daemon) -> None:
    accounts = daemon.accounts
    expected = {
        daemon.transport: accounts["transport"].uid,
        daemon.owner: accounts["owner"].uid,
        daemon.admin: 0,
    }
    for path, uid in expected.items():
        st = os.lstat(path)
        assert stat.S_ISSOCK(st.st_mode), path
        assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (uid, 0o600), path
    assert stat.S_IMODE(os.stat(daemon.layout.socket_dir).st_mode) == 0o711


@pytest.mark.parametrize("role", ["transport", "owner", "admin"])
def test_a_stranger_is_refused_by_the_kernel_on_every_socket(daemon: Daemon, role: str) -> None:
    path, _ = sender_of(daemon, role)
    result = raw_exchange(path, b"", daemon.accounts["other"])
    assert result == {"errno": errno.EACCES}


def test_the_transport_cannot_reach_the_admin_or_owner_socket(daemon: Daemon) -> None:
    transport = daemon.accounts["transport"]
    for path in (daemon.admin, daemon.owner):
        assert raw_exchange(path, b"", transport) == {"errno": errno.EACCES}


def _refused_before_reading(result: dict[str, object]) -> None:
    payload = result.get("reply")
    assert isinstance(payload, bytes), f"expected a refusal frame, got {result}"
    reply = decode_reply(payload, "snapshot")
    assert isinstance(reply, ErrorReply)
    assert (reply.error.code, reply.id) == ("not_authorized", ZERO_ID)


@pytest.mark.parametrize("role", ["transport", "owner"])
def test_root_on_another_role_socket_is_refused_by_the_daemon(daemon: Daemon, role: str) -> None:
    """Root passes the file mode; the daemon's own SO_PEERCRED check must refuse it,
    answering with the zero request ID because it never read the request."""
    path, _ = sender_of(daemon, role)
    request = encode_request(SnapshotRequest(version=1, id=new_id()))
    _refused_before_reading(raw_exchange(path, frame(request)))
    with pytest.raises(ClientFailed):  # the real Client never takes it for its reply
        send(path, SnapshotRequest(version=1, id=new_id()))


def test_a_loosened_socket_mode_still_lets_nobody_else_in(daemon: Daemon) -> None:
    """An administrator's `chmod 0666` on transport.sock: strangers reach the socket,
    and the daemon refuses them before reading; the transport itself still works."""
    os.chmod(daemon.transport, 0o666)
    try:
        request = encode_request(SnapshotRequest(version=1, id=new_id()))
        for role in ("other", "owner", "slot0"):
            _refused_before_reading(
                raw_exchange(daemon.transport, frame(request), daemon.accounts[role])
            )
        reply = daemon.as_transport(SnapshotRequest(version=1, id=new_id()))
        assert error_code(reply) is None
    finally:
        os.chmod(daemon.transport, 0o600)
    assert daemon.process.alive
    refusals = [e for e in daemon.process.events() if e.get("event") == "peer_refused"]
    assert {e["uid"] for e in refusals} >= {
        daemon.accounts[r].uid for r in ("other", "owner", "slot0")
    }
