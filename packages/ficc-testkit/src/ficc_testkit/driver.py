"""The one synchronous driver of a real executor host daemon.

The daemon itself is a `daemons.DaemonProcess` (a child process that says READY=1 on
its notify socket, as it tells systemd) or a `daemons.UnitDaemon` (the systemd service
it ships as). `Driver` sends requests over the daemon's real sockets
with the real `ficc.execution.client.Client`, as root (administrator) or, in a forked
child that drops to the account's UID and GID, as the transport or a local owner.

Nothing here sleeps to win a race: waiting is for an event (a datagram, a process
exit) or for a condition polled with a bound (`ficc_testkit.waits.wait_for`).
"""

from __future__ import annotations

import asyncio
import base64
import json
import socket
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec

from ficc.execution import protocol, wire
from ficc.execution.client import Client, ClientError
from ficc.execution.frames import HEADER, REPLY_MAX
from ficc.execution.plan import InputObject, Plan, digest_of, plan_digest
from ficc_testkit.accounts import Account, run_as
from ficc_testkit.configs import Layout
from ficc_testkit.plans import make_plan, new_id
from ficc_testkit.waits import WAIT_TIMEOUT, now_ms, wait_for

COLLECT_CHUNK = 1024 * 1024
TERMINAL = frozenset({"succeeded", "failed", "cancelled", "expired", "unknown"})
"""The attempt states after which nothing more runs."""


# --- the daemon process -----------------------------------------------------------------


# --- the daemon as the systemd service ----------------------------------------------------


# --- talking to it -------------------------------------------------------------------------


class ClientFailed(AssertionError):
    """No trustworthy reply (the Client raised); `kind` is the ClientError class name."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(f"{kind}: {message}")
        self.kind = kind
        self.message = message


def _request_bytes(path: str, request: protocol.Request) -> bytes:
    try:
        reply = asyncio.run(Client(path, read_timeout=120).request(request))
    except ClientError as exc:
        return b"E" + json.dumps([type(exc).__name__, str(exc)]).encode()
    return b"R" + msgspec.json.encode(reply)


def send(path: str, request: protocol.Request, account: Account | None = None) -> wire.AnyReply:
    """Send one request as `account` (None: root) and return the decoded reply."""
    data = run_as(account, lambda: _request_bytes(path, request))
    if data.startswith(b"E"):
        kind, message = json.loads(data[1:])
        raise ClientFailed(kind, message)
    return wire.decode_reply(data[1:], request.action, rows=request.row_count or None)


def raw_exchange(
    path: str, payload: bytes, account: Account | None = None, *, half_close: bool = True
) -> dict[str, Any]:
    """Connect as `account`, send `payload` bytes as they are, read whatever comes back.

    Returns {"errno": n} if connect failed, else {"reply": bytes or None}: `reply` is
    one reply frame's payload when one arrived.
    """

    def exchange() -> bytes:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(120)
        try:
            sock.connect(path)
        except OSError as exc:
            return json.dumps({"errno": exc.errno}).encode()
        try:
            try:
                if payload:
                    sock.sendall(payload)
                if half_close:
                    sock.shutdown(socket.SHUT_WR)
            except OSError:  # refused before we finished sending: the reply may be there
                pass
            reply = read_frame(sock)
        finally:
            sock.close()
        encoded = None if reply is None else base64.b64encode(reply).decode()
        return json.dumps({"reply": encoded}).encode()

    result = json.loads(run_as(account, exchange))
    if "reply" in result and result["reply"] is not None:
        result["reply"] = base64.b64decode(result["reply"])
    return result  # type: ignore[no-any-return]


def read_frame(sock: socket.socket) -> bytes | None:
    """One reply frame's payload, or None if the daemon closed (or reset) first."""
    try:
        header = _recv_exactly(sock, HEADER.size)
        if header is None:
            return None
        (length,) = HEADER.unpack(header)
        assert 0 < length <= REPLY_MAX, f"reply length {length}"
        payload = _recv_exactly(sock, length)
        assert payload is not None, "the daemon closed inside its reply frame"
        return payload
    except ConnectionResetError:
        return None


def _recv_exactly(sock: socket.socket, n: int) -> bytes | None:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            assert not data, "the daemon closed inside a frame"
            return None
        data += chunk
    return data


def frame(payload: bytes) -> bytes:
    """`payload` as one frame (its length header first)."""
    return HEADER.pack(len(payload)) + payload


def error_code(reply: wire.AnyReply) -> str | None:
    """The whole-request error code, or None if the request was accepted."""
    return reply.error.code if isinstance(reply, wire.ErrorReply) else None


def rows(reply: wire.AnyReply) -> list[Any]:
    """The rows of an accepted batch reply (a whole-request refusal fails the test)."""
    assert not isinstance(reply, wire.ErrorReply), (
        f"refused: {reply.error.code}: {reply.error.message}"
    )
    assert isinstance(reply, wire.AttemptsReply | wire.InputsReply | wire.ReadsReply), reply
    return list(reply.results)


def row_code(row: Any) -> str | None:
    """The row's error code, or None if the row was accepted."""
    return row.error.code if isinstance(row, wire.ErrorRow) else None


def attempt(row: Any) -> wire.AttemptRow:
    """`row` as an AttemptRow; a refused row fails the test with its code."""
    if isinstance(row, wire.ErrorRow):
        raise AssertionError(f"row refused: {row.error.code}: {row.error.message}")
    assert isinstance(row, wire.AttemptRow), f"row refused: {row}"
    return row


def input_row(row: Any) -> wire.InputRow:
    """`row` as an InputRow; a refused row fails the test."""
    assert isinstance(row, wire.InputRow), f"row refused: {row}"
    return row


def fence_fields(plan: Plan) -> dict[str, Any]:
    """The three fields that bind every operation to one attempt of one plan."""
    return {
        "attempt_id": plan.attempt_id,
        "generation": plan.generation,
        "plan_digest": plan_digest(plan),
    }


def fence(plan: Plan) -> protocol.Fence:
    """The fence of `plan`'s attempt."""
    return protocol.Fence(**fence_fields(plan))


def renewal(plan: Plan, sequence: int, expires_at_ms: int) -> protocol.Renewal:
    """A lease renewal of `plan`'s attempt."""
    return protocol.Renewal(**fence_fields(plan), sequence=sequence, expires_at_ms=expires_at_ms)


def chunks(data: bytes, size: int) -> Iterator[tuple[int, bytes]]:
    """(offset, bytes) pieces of `data`, each at most `size` bytes."""
    for offset in range(0, len(data), size):
        yield offset, data[offset : offset + size]


@dataclass
class StreamedInput:
    """A streamed input object and its bytes (or wrong bytes, for mismatch tests)."""

    data: bytes
    id: str = field(default_factory=new_id)
    name: str = "input.bin"
    declared_digest: str | None = None

    def object(self) -> InputObject:
        """The plan's declaration of this object."""
        return InputObject(
            id=self.id,
            name=self.name,
            bytes=len(self.data),
            digest=self.declared_digest or digest_of(self.data),
            delivery="stream",
        )


@dataclass(frozen=True)
class Collected:
    """Every collect row of one object, read to its end."""

    data: bytes
    reads: list[wire.ReadRow]


# --- the driver --------------------------------------------------------------------------


class Driver:
    """Requests to one daemon: as root on the admin socket, as `transport` on the
    transport socket and as `owner` on its owner socket. Methods that name one plan
    return its one row; the batch methods return the reply."""

    def __init__(self, layout: Layout, transport: Account, owner: Account | None = None) -> None:
        self.layout = layout
        self.transport_account = transport
        self.owner_account = owner

    # sockets and senders

    @property
    def admin(self) -> str:
        """The path of the admin socket."""
        return self.layout.socket("admin")

    @property
    def transport(self) -> str:
        """The path of the transport socket."""
        return self.layout.socket("transport")

    @property
    def owner(self) -> str:
        """The path of the owner socket."""
        return self.layout.socket("owner")

    def as_admin(self, request: protocol.Request) -> wire.AnyReply:
        """Send `request` as root on the admin socket."""
        return send(self.admin, request)

    def as_transport(self, request: protocol.Request) -> wire.AnyReply:
        """Send `request` as the transport account on the transport socket."""
        return send(self.transport, request, self.transport_account)

    def as_owner(self, request: protocol.Request) -> wire.AnyReply:
        """Send `request` as the local owner on its socket."""
        return send(self.owner, request, self.owner_account)

    def make_plan(self, **what_varies: Any) -> Plan:
        """A valid plan for this daemon (`ficc_testkit.plans.make_plan`): its deployment
        and node, its first project and its first provider, pinned, unless given."""
        config = self.layout.config
        pinned = config.providers[0]
        defaults: dict[str, Any] = {
            "deployment_id": config.deployment_id,
            "node_id": config.node_id,
            "project_id": config.ceiling.projects[0],
            "provider": pinned.id,
            "package_digest": pinned.package_digest,
        }
        return make_plan(**(defaults | what_varies))

    # requests

    def snapshot(self, after: str | None = None) -> wire.SnapshotReply:
        """The admin snapshot (one page, after `after`)."""
        reply = self.as_admin(protocol.SnapshotRequest(version=1, id=new_id(), after=after))
        assert isinstance(reply, wire.SnapshotReply), reply
        return reply

    def bindings(self) -> dict[str, Any]:
        """The installation and ledger bindings every admission request carries."""
        return self.snapshot().bindings()

    def prepare(
        self,
        plans: Sequence[Plan],
        *,
        expires_in_ms: int = 300_000,
        bindings: dict[str, Any] | None = None,
        sender: Callable[[protocol.Request], wire.AnyReply] | None = None,
    ) -> wire.AnyReply:
        """Admit `plans` in one request, each with a first lease of `expires_in_ms`."""
        expires = now_ms() + expires_in_ms
        request = protocol.PrepareRequest(
            version=1,
            id=new_id(),
            **(bindings or self.bindings()),
            attempts=[protocol.PrepareAttempt(plan=p, lease=renewal(p, 1, expires)) for p in plans],
        )
        return (sender or self.as_transport)(request)

    def renew(self, plan: Plan, sequence: int, expires_at_ms: int) -> Any:
        """Renew `plan`'s lease; its row."""
        request = protocol.RenewRequest(
            version=1, id=new_id(), leases=[renewal(plan, sequence, expires_at_ms)]
        )
        (row,) = rows(self.as_transport(request))
        return row

    def fenced(self, kind: type[protocol.Request], plans: Sequence[Plan]) -> list[Any]:
        """A fenced request (observe, start, stop, release) for `plans`; its rows."""
        request = kind(version=1, id=new_id(), attempts=[fence(p) for p in plans])  # type: ignore[call-arg]
        return rows(self.as_transport(request))

    def observe(
        self, plan: Plan, *, usage: bool = False, detail: bool = False, payload_usage: bool = False
    ) -> Any:
        """Observe `plan`'s attempt (with `usage: true`, `detail: true`, `payload_usage:
        true` when asked); its row."""
        asked: dict[str, Any] = {"usage": True} if usage else {}
        if detail:
            asked["detail"] = True
        if payload_usage:
            asked["payload_usage"] = True
        request = protocol.ObserveRequest(version=1, id=new_id(), attempts=[fence(plan)], **asked)
        (row,) = rows(self.as_transport(request))
        return row

    def start_attempt(self, plan: Plan) -> Any:
        """Start `plan`'s attempt; its row."""
        (row,) = self.fenced(protocol.StartRequest, [plan])
        return row

    def stop_attempt(self, plan: Plan) -> Any:
        """Stop `plan`'s attempt; its row."""
        (row,) = self.fenced(protocol.StopRequest, [plan])
        return row

    def release(self, plan: Plan) -> Any:
        """Release `plan`'s attempt; its row."""
        (row,) = self.fenced(protocol.ReleaseRequest, [plan])
        return row

    def wait_state(
        self,
        plan: Plan,
        accept: Callable[[wire.AttemptRow], bool],
        what: str,
        timeout: float = WAIT_TIMEOUT,
        *,
        refused_fails: bool = False,
    ) -> wire.AttemptRow:
        """Observe until the row is an AttemptRow that `accept`s; the failure shows the
        last row seen. A refused row is polled past, or (`refused_fails`) fails at once."""
        seen: list[Any] = []

        def check() -> wire.AttemptRow | None:
            row = self.observe(plan)
            if refused_fails:
                row = attempt(row)
            seen.append(row)
            return row if isinstance(row, wire.AttemptRow) and accept(row) else None

        try:
            return wait_for(check, what, timeout)
        except AssertionError as exc:
            raise AssertionError(f"{exc}; last observe: {seen[-1] if seen else None}") from None

    def input_status(self, plan: Plan, item: StreamedInput | InputObject) -> Any:
        """The upload status of one streamed input object; its row."""
        ref = protocol.ObjectRef(**fence_fields(plan), object=item.id)
        (row,) = rows(
            self.as_transport(protocol.InputStatusRequest(version=1, id=new_id(), objects=[ref]))
        )
        return row

    def input_write(
        self, plan: Plan, item: StreamedInput | InputObject, offset: int, data: bytes
    ) -> Any:
        """One chunk of a streamed input object at `offset`; its row."""
        write = protocol.InputWrite(
            **fence_fields(plan),
            object=item.id,
            offset=offset,
            data=base64.b64encode(data).decode(),
            digest=digest_of(data),
        )
        (row,) = rows(
            self.as_transport(protocol.InputWriteRequest(version=1, id=new_id(), writes=[write]))
        )
        return row

    def read(self, plan: Plan, object_id: str, offset: int, length: int = COLLECT_CHUNK) -> Any:
        """One collect row (ReadRow, or the ErrorRow of a refusal)."""
        read = protocol.Read(**fence_fields(plan), object=object_id, offset=offset, length=length)
        (row,) = rows(
            self.as_transport(protocol.CollectRequest(version=1, id=new_id(), reads=[read]))
        )
        return row

    def collect(self, plan: Plan, object_id: str) -> Collected:
        """Read an output in COLLECT_CHUNK requests, each at the returned next offset,
        to its end."""
        data = b""
        reads: list[wire.ReadRow] = []
        offset = 0
        while True:
            row = self.read(plan, object_id, offset)
            assert isinstance(row, wire.ReadRow), f"collect {object_id} refused: {row}"
            assert row.offset == offset
            assert row.next_offset == offset + len(row.data)
            data += row.data
            reads.append(row)
            offset = row.next_offset
            if row.eof:
                return Collected(data, reads)

    def reject_absent(
        self,
        plans: Sequence[Plan],
        bindings: dict[str, Any] | None = None,
        sender: Callable[[protocol.Request], wire.AnyReply] | None = None,
    ) -> wire.AnyReply:
        """Record `plans` as rejected without running them."""
        request = protocol.RejectAbsentRequest(
            version=1, id=new_id(), **(bindings or self.bindings()), plans=list(plans)
        )
        return (sender or self.as_transport)(request)

    def reconcile_request(
        self, plans: Sequence[Plan], bindings: dict[str, Any] | None = None
    ) -> protocol.ReconcileAbsentRequest:
        """An administrator's reconcile_absent of `plans` (built, not sent)."""
        return protocol.ReconcileAbsentRequest(
            version=1,
            id=new_id(),
            **(bindings or self.bindings()),
            plans=list(plans),
            acknowledge_unknown=True,
        )

    def set_offer(self, control: str, *, sender: str = "owner") -> wire.AnyReply:
        """Set the offer's control, as the owner (or `sender="admin"`)."""
        revision = self.snapshot().offer.revision
        request = protocol.SetOfferRequest(
            version=1,
            id=new_id(),
            expected_revision=revision,
            control=control,  # type: ignore[arg-type]
        )
        return self.as_owner(request) if sender == "owner" else self.as_admin(request)
