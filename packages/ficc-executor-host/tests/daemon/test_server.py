"""The socket shell (server.py) over real Unix sockets, with a fake daemon behind it.

The fake implements only the contract (`dispatch`, `input_chunk_bytes`) and records
every call, so each test can prove what reached the daemon and what did not. The
server runs on its own event loop in a thread; clients are plain blocking sockets or
the real ficc.execution Client. Every socket is created by `peercred.listen` in a
root-owned 0711 directory under /run, so this needs root; a socket whose peer UID is
an unused number stands in for "somebody else's socket" (root connecting to it is
the wrong peer).
"""

from __future__ import annotations

import array
import asyncio
import base64
import contextlib
import fcntl
import hashlib
import os
import select
import shutil
import socket
import tempfile
import termios
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from ficc.execution._executor import ReceivedInputWriteRequest
from ficc.execution._executor import ReceivedRequest as AnyRequest
from ficc.execution.client import Client, Refused
from ficc.execution.frames import HEADER, REPLY_MAX, REQUEST_MAX
from ficc.execution.host.context.buffers import RequestBuffers
from ficc.execution.host.core.authority import SocketKind
from ficc.execution.host.daemon.peercred import Endpoint
from ficc.execution.host.daemon.server import ServerLimits, serve
from ficc.execution.protocol import (
    ZERO_ID,
    Fence,
    InputWrite,
    InputWriteRequest,
    ObserveRequest,
    OfferLimits,
    Resources,
    Sender,
    SetOfferRequest,
    SnapshotRequest,
    encode_request,
)
from ficc.execution.wire import (
    AnyReply,
    AttemptsReply,
    Capacity,
    ErrorReply,
    Offer,
    ProviderInfo,
    ReadRow,
    ReadsReply,
    SlotClass,
    SnapshotReply,
    decode_reply,
    encode_reply,
    error_reply,
    error_row,
)
from ficc_testkit.units import MIB
from ficc_testkit.waits import wait_for

pytestmark = pytest.mark.root("needs root: sockets are owned per role under /run")

FOREIGN_UID = 3_999_998  # nobody on this machine: root is the wrong peer for it
RESOURCES = Resources(
    attempts=2,
    cpu_millis=1000,
    memory_bytes=1 << 30,
    swap_bytes=0,
    processes=256,
    storage_bytes=1 << 30,
    storage_inodes=10_000,
)


def snapshot_reply(request_id: str, next_cursor: str | None = None) -> SnapshotReply:
    return SnapshotReply(
        version=1,
        id=request_id,
        installation_id="1" * 32,
        ledger_id="2" * 32,
        admission_version=1,
        maximum_lease_seconds=600,
        input_chunk_bytes=8 * MIB,
        offer=Offer(1, "active", OfferLimits(RESOURCES, None, ["test"])),
        capacity=Capacity(
            available=RESOURCES,
            slot_classes=[SlotClass(class_="small", total=2, free=2, bytes=1 << 30, inodes=10)],
            providers=[ProviderInfo("test", "sha256:" + "a" * 64, True)],
        ),
        attempts=[],
        next=next_cursor,
    )


class FakeDaemon:
    """The contract, nothing more; records (sender, uid, action, id) of every dispatch."""

    def __init__(self) -> None:
        self.calls: list[tuple[Sender, int, str, str]] = []
        self.requests: list[AnyRequest] = []
        self.fail_next = False
        self.hold: asyncio.Event | None = None
        self.reply: Callable[[AnyRequest], AnyReply] | None = None

    def input_chunk_bytes(self) -> int:
        return 8 * MIB

    async def dispatch(self, sender: Sender, uid: int, request: AnyRequest) -> AnyReply:
        self.calls.append((sender, uid, request.action, request.id))
        self.requests.append(request)
        if self.fail_next:
            self.fail_next = False
            raise RuntimeError("a deliberate bug in the fake daemon")
        if self.hold is not None:
            await self.hold.wait()
        if self.reply is not None:
            return self.reply(request)
        if isinstance(request, SnapshotRequest):
            return snapshot_reply(request.id)
        return error_reply(request.id, "unknown_attempt", "the fake knows no attempts")


class Running:
    """A server on its own loop thread; `logs` collects its JSON log records."""

    def __init__(self, directory: Path, daemon: FakeDaemon, limits: ServerLimits) -> None:
        self.daemon = daemon
        self.logs: list[dict[str, Any]] = []
        self.on_log: Callable[[dict[str, Any]], None] | None = None
        self.paths = {
            "admin": str(directory / "admin.sock"),
            "transport": str(directory / "transport.sock"),
            "owner": str(directory / "owner-0.sock"),
            "foreign": str(directory / "foreign.sock"),
        }
        self.endpoints = [
            Endpoint(SocketKind.ADMINISTRATOR, self.paths["admin"], 0, "root"),
            Endpoint(SocketKind.TRANSPORT, self.paths["transport"], 0, "transport_uid"),
            Endpoint(SocketKind.LOCAL_OWNER, self.paths["owner"], 0, "local_owner_uids[0]"),
            Endpoint(SocketKind.TRANSPORT, self.paths["foreign"], FOREIGN_UID, "transport_uid"),
        ]
        self.limits = limits
        self.loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._task: asyncio.Task[None] | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _log(self, record: dict[str, Any]) -> None:
        self.logs.append(record)
        if self.on_log is not None:
            self.on_log(record)

    def _run(self) -> None:
        async def main() -> None:
            self._task = asyncio.ensure_future(
                serve(
                    self.daemon,
                    self.endpoints,
                    limits=self.limits,
                    ready=self._ready.set,
                    log=self._log,
                )
            )
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

        self.loop.run_until_complete(main())

    def start(self) -> None:
        self._thread.start()
        assert self._ready.wait(30), "the server did not start listening"

    def stop(self) -> None:
        assert self._task is not None
        self.loop.call_soon_threadsafe(self._task.cancel)
        self._thread.join(30)
        assert not self._thread.is_alive()
        self.loop.close()

    def call(self, function: Callable[[], None]) -> None:
        """Run `function` on the server's loop thread."""
        self.loop.call_soon_threadsafe(function)

    def events(self, name: str) -> list[dict[str, Any]]:
        return [r for r in self.logs if r["event"] == name]


@pytest.fixture
def directory() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="ficc-t-server-", dir="/run"))
    os.chmod(path, 0o711)
    try:
        yield path
    finally:
        shutil.rmtree(path)


@contextmanager
def running_server(directory: Path, daemon: FakeDaemon, **limits: Any) -> Iterator[Running]:
    server = Running(directory, daemon, ServerLimits(**limits))
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def fake() -> FakeDaemon:
    return FakeDaemon()


@pytest.fixture
def server(directory: Path, fake: FakeDaemon) -> Iterator[Running]:
    with running_server(directory, fake, read_timeout=30.0, write_timeout=30.0) as running:
        yield running


# --- clients ---------------------------------------------------------------------------


def request_id(n: int) -> str:
    return f"{n:032x}"


def ask(path: str, request: Any) -> AnyReply:
    return asyncio.run(Client(path, read_timeout=30).request(request))


def snapshot(n: int = 1) -> SnapshotRequest:
    return SnapshotRequest(version=1, id=request_id(n))


def raw_connect(path: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(30)
    sock.connect(path)
    return sock


def frame(payload: bytes) -> bytes:
    return HEADER.pack(len(payload)) + payload


def read_reply(sock: socket.socket) -> bytes | None:
    """One reply frame's payload, or None if the server closed without one."""
    try:
        header = _recv_exactly(sock, 4)
    except ConnectionResetError:  # closed with our bytes unread, and no reply
        return None
    if header is None:
        return None
    (length,) = HEADER.unpack(header)
    assert 0 < length <= REPLY_MAX
    payload = _recv_exactly(sock, length)
    assert payload is not None, "the server closed inside its reply"
    return payload


def _recv_exactly(sock: socket.socket, n: int) -> bytes | None:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            assert not data, "the server closed inside a frame"
            return None
        data += chunk
    return data


def error_of(payload: bytes | None) -> tuple[str, str, str]:
    """(code, id, message) of an ErrorReply payload."""
    assert payload is not None, "expected an error reply, the server just closed"
    reply = decode_reply(payload, "snapshot")
    assert isinstance(reply, ErrorReply), reply
    return reply.error.code, reply.id, reply.error.message


def at_eof(sock: socket.socket) -> bool:
    """The server closed: EOF, or ECONNRESET when it closed with our bytes unread."""
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


def reset_unread(sock: socket.socket) -> bool:
    """Linux resets a Unix stream peer whose sent bytes were never read by the closer."""
    try:
        sock.recv(1)
    except ConnectionResetError:
        return True
    return False


# --- the happy path --------------------------------------------------------------------


def test_each_socket_dispatches_as_its_own_sender_with_the_peer_uid(
    server: Running, fake: FakeDaemon
) -> None:
    for n, (name, sender) in enumerate(
        [("admin", Sender.ADMINISTRATOR), ("transport", Sender.TRANSPORT), ("owner", Sender.OWNER)]
    ):
        reply = ask(server.paths[name], snapshot(n))
        assert isinstance(reply, SnapshotReply)
        assert reply.id == request_id(n)
        assert fake.calls[-1] == (sender, 0, "snapshot", request_id(n))
    (request,) = [r for r in server.events("request") if r["id"] == request_id(1)]
    assert request["socket"] == "transport.sock"
    assert request["uid"] == 0
    assert request["action"] == "snapshot"
    assert request["code"] is None
    assert request["level"] == "info"
    assert isinstance(request["duration_ms"], float)
    assert isinstance(request["ts"], float)


def test_a_large_request_is_decoded_and_dispatched(server: Running, fake: FakeDaemon) -> None:
    """A 4 MiB input_write crosses the off-loop decoding path intact."""
    data = os.urandom(4 * MIB)
    reply = ask(server.paths["transport"], _large_write(7, data))
    assert isinstance(reply, ErrorReply)  # the fake knows no attempts
    (received,) = fake.requests
    assert isinstance(received, ReceivedInputWriteRequest)  # decoded straight from the frame
    assert received.writes[0].chunk == data


def _large_write(n: int, data: bytes) -> InputWriteRequest:
    """An input_write request of `data` for an attempt the fake does not know."""
    write = InputWrite(
        attempt_id="a" * 32,
        generation=1,
        plan_digest="sha256:" + "b" * 64,
        object="c" * 32,
        offset=0,
        data=base64.b64encode(data).decode(),
        digest="sha256:" + hashlib.sha256(data).hexdigest(),
    )
    return InputWriteRequest(version=1, id=request_id(n), writes=[write])


def test_large_requests_in_a_row_each_keep_their_own_bytes(
    server: Running, fake: FakeDaemon
) -> None:
    """The server receives large frames into a kept buffer: never one a request still
    reads from. The fake holds every request it got, so each holds its frame, until it
    lets go of it; then the buffer is received into again."""
    chunks = [os.urandom(2 * MIB), os.urandom(2 * MIB), os.urandom(2 * MIB + 1), os.urandom(MIB)]
    for n, data in enumerate(chunks[:2]):  # the same size: the same frame length
        assert isinstance(ask(server.paths["transport"], _large_write(n, data)), ErrorReply)
    for request, data in zip(fake.requests, chunks[:2], strict=True):
        assert isinstance(request, ReceivedInputWriteRequest)
        assert request.writes[0].chunk == data  # the second did not land in the first's
        request.release()
    for n, data in enumerate(chunks[2:], start=2):
        assert isinstance(ask(server.paths["transport"], _large_write(n, data)), ErrorReply)
    received = [r for r in fake.requests if isinstance(r, ReceivedInputWriteRequest)]
    assert [r.writes[0].chunk for r in received[2:]] == chunks[2:]
    assert [r.id for r in received] == [request_id(n) for n in range(4)]


def test_a_kept_request_buffer_is_reused_only_when_unviewed_and_dropped_when_idle() -> None:
    async def scenario() -> None:
        buffers = RequestBuffers(smallest=1024, idle_s=0.0)
        small = buffers.take(100)
        buffers.give_back(small)
        assert buffers.take(100) is not small  # small frames are never kept
        first = buffers.take(4096)
        buffers.give_back(first)
        view = memoryview(first)  # a request still reading its frame
        second = buffers.take(4096)
        assert second is not first
        view.release()
        buffers.give_back(first)
        again = buffers.take(5000)
        assert again is first
        assert len(again) == 5000  # its length is the frame's
        buffers.give_back(again)
        assert buffers.take(3000) is first
        assert len(first) == 3000
        buffers.give_back(first)
        buffers.give_back(buffers.take(100))  # a small request between two large ones
        assert buffers.take(3000) is first
        buffers.give_back(first)
        assert buffers.holding == 3000
        await asyncio.wait_for(_dropped(buffers), timeout=10)  # its idle timer: 0 s here
        assert buffers.take(3000) is not first

    asyncio.run(scenario())


async def _dropped(buffers: RequestBuffers) -> None:
    while buffers.holding:
        await asyncio.sleep(0)


def test_base64_spelled_with_json_escapes_is_received_too(
    server: Running, fake: FakeDaemon
) -> None:
    """`\\/` for `/` leaves the fast path to `decode_request`: dispatched all the same."""
    data = b"\xff" * 3000
    write = InputWrite(
        attempt_id="a" * 32,
        generation=1,
        plan_digest="sha256:" + "b" * 64,
        object="c" * 32,
        offset=0,
        data=base64.b64encode(data).decode(),
        digest="sha256:" + hashlib.sha256(data).hexdigest(),
    )
    payload = encode_request(InputWriteRequest(version=1, id=request_id(11), writes=[write]))
    sock = raw_connect(server.paths["transport"])
    sock.sendall(frame(payload.replace(b"/", b"\\/")))
    assert error_of(read_reply(sock))[:2] == ("unknown_attempt", request_id(11))  # the fake
    sock.close()
    (received,) = fake.requests
    assert isinstance(received, InputWriteRequest)
    assert received.writes[0].chunk == data


def _pieces(data: bytes, sizes: list[int]) -> Iterator[bytes]:
    """`data` cut at irregular places: the given sizes, then the rest in 64 KiB + 7 steps."""
    at = 0
    for size in sizes:
        yield data[at : at + size]
        at += size
    while at < len(data):
        yield data[at : at + 65543]
        at += 65543


def test_a_frame_sent_in_small_pieces_is_read_exactly_to_its_declared_length(
    server: Running, fake: FakeDaemon
) -> None:
    """The server receives a frame piece by piece into one buffer of the declared size.

    Each piece is sent only once the server has read everything before it, so every
    boundary (inside the header, between header and payload, inside the payload) is a
    separate receive. Bytes sent after the frame, while the request is in dispatch, stay
    unread to the end (the close resets us): the buffer is exactly the declared length
    and nothing is read ahead. Then the server keeps serving.
    """
    data = os.urandom(600 * 1024)  # a frame over the off-loop decoding threshold
    write = InputWrite(
        attempt_id="a" * 32,
        generation=1,
        plan_digest="sha256:" + "b" * 64,
        object="c" * 32,
        offset=0,
        data=base64.b64encode(data).decode(),
        digest="sha256:" + hashlib.sha256(data).hexdigest(),
    )
    sent = frame(encode_request(InputWriteRequest(version=1, id=request_id(8), writes=[write])))
    trailing = frame(encode_request(snapshot(9)))
    release = _hold(server, fake)
    sock = raw_connect(server.paths["transport"])
    for piece in _pieces(sent, [1, 2, 1, 5, 4093]):
        sock.sendall(piece)
        wait_for(lambda: _outq(sock) == 0, "the server to read the piece")
    wait_for(lambda: len(fake.calls) == 1, "the request in dispatch")
    sock.sendall(trailing)
    assert _outq(sock) > 0  # queued, unread while the request is held
    release()
    assert error_of(read_reply(sock))[:2] == ("unknown_attempt", request_id(8))  # the fake
    assert reset_unread(sock), "the server read past the declared length"
    sock.close()
    (received,) = fake.requests
    assert isinstance(received, ReceivedInputWriteRequest)
    assert received.writes[0].chunk == data
    assert isinstance(ask(server.paths["transport"], snapshot(10)), SnapshotReply)
    assert [c[3] for c in fake.calls] == [request_id(8), request_id(10)]


# --- the peer is checked before anything is read ----------------------------------------


def _outq(sock: socket.socket) -> int:
    """Bytes this socket sent that the peer has not read yet (SIOCOUTQ on AF_UNIX)."""
    buf = array.array("i", [0])
    fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, buf)
    return buf[0]


def test_a_wrong_peer_is_refused_before_a_byte_is_read(server: Running, fake: FakeDaemon) -> None:
    """The bytes the peer sent are still unread in the server's receive queue at the
    moment it refuses, and the daemon never sees a request.

    The server's loop is held while the client connects and sends, so the bytes are
    queued before the server can accept; the log hook measures, at the refusal, what
    the server has not consumed.
    """
    held, release = threading.Event(), threading.Event()

    def hold_loop() -> None:
        held.set()
        release.wait(30)

    server.call(hold_loop)
    assert held.wait(30)
    client = raw_connect(server.paths["foreign"])
    sent = frame(encode_request(snapshot(3)))
    client.sendall(sent)
    unread: list[int] = []
    server.on_log = lambda r: unread.append(_outq(client)) if r["event"] == "peer_refused" else None
    release.set()
    code, reply_id, message = error_of(read_reply(client))
    assert (code, reply_id) == ("not_authorized", ZERO_ID)
    assert f"only UID {FOREIGN_UID}" in message
    assert reset_unread(client)  # closed with the request still unread
    client.close()
    assert len(unread) == 1
    assert unread[0] >= len(sent), f"the server read the peer's bytes: {unread}"
    assert fake.calls == []
    (refusal,) = server.events("peer_refused")
    assert (refusal["socket"], refusal["uid"], refusal["code"]) == (
        "foreign.sock",
        0,
        "not_authorized",
    )


def test_the_client_reports_a_wrong_peer_refusal_as_refused(server: Running) -> None:
    """The real Client never takes the refusal for its reply: the zero-ID refusal is
    `Refused` with the code, telling the caller the request was not applied."""
    with pytest.raises(Refused) as caught:
        ask(server.paths["foreign"], snapshot(4))
    assert caught.value.code == "not_authorized"


# --- bounds and timeouts --------------------------------------------------------------------


def test_a_slow_peer_is_cut_off_and_the_server_keeps_serving(
    directory: Path, fake: FakeDaemon
) -> None:
    with running_server(directory, fake, read_timeout=0.3) as server:
        slow = raw_connect(server.paths["admin"])
        slow.sendall(b"\x00\x00")  # half a header, then nothing
        assert read_reply(slow) is None  # closed without a reply: EOF
        slow.close()
        assert len(server.events("read_timeout")) == 1
        assert isinstance(ask(server.paths["admin"], snapshot()), SnapshotReply)
        assert [c[2] for c in fake.calls] == ["snapshot"]


def _hold(server: Running, fake: FakeDaemon) -> Callable[[], None]:
    """Make dispatch wait; return the function that lets it go."""
    ready = threading.Event()

    def install() -> None:
        fake.hold = asyncio.Event()
        ready.set()

    server.call(install)
    assert ready.wait(30)

    def release() -> None:
        def go() -> None:
            assert fake.hold is not None
            fake.hold.set()

        server.call(go)

    return release


def test_over_the_connection_bound_a_peer_gets_busy_without_being_read(
    directory: Path, fake: FakeDaemon
) -> None:
    with running_server(directory, fake, max_connections=2) as server:
        release = _hold(server, fake)
        held = [raw_connect(server.paths["admin"]) for _ in range(2)]
        for n, sock in enumerate(held):
            sock.sendall(frame(encode_request(snapshot(n))))
        wait_for(lambda: len(fake.calls) == 2, "two requests in dispatch")
        extra = raw_connect(server.paths["transport"])
        with contextlib.suppress(OSError):  # the refusal may already have closed it
            extra.sendall(frame(encode_request(snapshot(9))))
        code, reply_id, _ = error_of(read_reply(extra))
        assert (code, reply_id) == ("busy", ZERO_ID)
        assert at_eof(extra)
        assert len(fake.calls) == 2
        release()
        for sock in held:
            reply = read_reply(sock)
            assert reply is not None
            assert isinstance(decode_reply(reply, "snapshot"), SnapshotReply)
        # the bound counts open connections, not history: a new one is served again
        assert isinstance(ask(server.paths["transport"], snapshot(10)), SnapshotReply)


def test_the_per_socket_bound_leaves_other_sockets_usable(
    directory: Path, fake: FakeDaemon
) -> None:
    with running_server(directory, fake, max_connections_per_socket=1) as server:
        release = _hold(server, fake)
        first = raw_connect(server.paths["transport"])
        first.sendall(frame(encode_request(snapshot(1))))
        wait_for(lambda: len(fake.calls) == 1, "one request in dispatch")
        second = raw_connect(server.paths["transport"])
        assert error_of(read_reply(second))[0] == "busy"
        admin = raw_connect(server.paths["admin"])
        admin.sendall(frame(encode_request(snapshot(2))))
        wait_for(lambda: len(fake.calls) == 2, "the admin request in dispatch")
        release()
        assert read_reply(first) is not None
        assert read_reply(admin) is not None


# --- malformed frames and requests ---------------------------------------------------------


def test_an_oversize_frame_is_refused_from_its_header(server: Running, fake: FakeDaemon) -> None:
    sock = raw_connect(server.paths["admin"])
    sock.sendall(HEADER.pack(REQUEST_MAX + 1))
    code, reply_id, _ = error_of(read_reply(sock))
    assert (code, reply_id) == ("frame_too_large", ZERO_ID)
    assert at_eof(sock)
    assert fake.calls == []


def test_a_zero_length_frame_is_a_bad_frame(server: Running) -> None:
    sock = raw_connect(server.paths["admin"])
    sock.sendall(HEADER.pack(0))
    assert error_of(read_reply(sock))[0] == "bad_frame"


def test_a_frame_cut_short_by_the_peer_is_a_bad_frame(server: Running, fake: FakeDaemon) -> None:
    sock = raw_connect(server.paths["admin"])
    sock.sendall(HEADER.pack(100) + b"{" * 10)
    sock.shutdown(socket.SHUT_WR)
    code, _, message = error_of(read_reply(sock))
    assert code == "bad_frame"
    assert "after 10 of 100 frame bytes" in message
    assert fake.calls == []


def test_bytes_that_are_not_json_are_a_bad_frame(server: Running) -> None:
    sock = raw_connect(server.paths["admin"])
    sock.sendall(frame(b"\xff\xfe not json"))
    assert error_of(read_reply(sock))[:2] == ("bad_frame", ZERO_ID)


def test_a_wrong_field_is_refused_with_its_path_and_the_request_id(
    server: Running, fake: FakeDaemon
) -> None:
    rid = request_id(42)
    payload = f'{{"version":1,"id":"{rid}","action":"snapshot","after":5}}'.encode()
    sock = raw_connect(server.paths["admin"])
    sock.sendall(frame(payload))
    code, reply_id, message = error_of(read_reply(sock))
    assert (code, reply_id) == ("invalid_request", rid)
    assert "$.after" in message
    assert fake.calls == []
    (log,) = server.events("request_refused")
    assert (log["id"], log["code"]) == (rid, "invalid_request")


def test_an_unknown_action_and_version_have_their_own_codes(server: Running) -> None:
    rid = request_id(43)
    for payload, code in [
        (f'{{"version":1,"id":"{rid}","action":"launch"}}', "unsupported_action"),
        (f'{{"version":2,"id":"{rid}","action":"snapshot"}}', "unsupported_version"),
    ]:
        sock = raw_connect(server.paths["admin"])
        sock.sendall(frame(payload.encode()))
        assert error_of(read_reply(sock))[:2] == (code, rid)


# --- authority from the socket ----------------------------------------------------------------


def set_offer(n: int) -> SetOfferRequest:
    return SetOfferRequest(version=1, id=request_id(n), expected_revision=1, control="paused")


@pytest.mark.parametrize(
    ("socket_name", "allowed"), [("transport", False), ("owner", True), ("admin", True)]
)
def test_set_offer_is_authorized_by_the_socket_kind_alone(
    server: Running, fake: FakeDaemon, socket_name: str, allowed: bool
) -> None:
    reply = ask(server.paths[socket_name], set_offer(5))
    assert isinstance(reply, ErrorReply)
    if allowed:
        assert reply.error.code == "unknown_attempt"  # the fake's answer: it got through
        assert [c[2] for c in fake.calls] == ["set_offer"]
    else:
        assert reply.error.code == "not_authorized"
        assert reply.id == request_id(5)
        assert "transport.sock" in reply.error.message
        assert fake.calls == []
        assert server.events("action_refused")[0]["action"] == "set_offer"


def test_an_owner_may_not_send_transport_actions(server: Running, fake: FakeDaemon) -> None:
    fence = Fence(attempt_id="a" * 32, generation=1, plan_digest="sha256:" + "b" * 64)
    request = ObserveRequest(version=1, id=request_id(6), attempts=[fence])
    payload = encode_request(request)
    sock = raw_connect(server.paths["owner"])
    sock.sendall(frame(payload))
    assert error_of(read_reply(sock))[:2] == ("not_authorized", request_id(6))
    assert fake.calls == []


# --- failures inside the daemon ---------------------------------------------------------------


def test_a_handler_exception_is_internal_and_the_server_keeps_serving(
    server: Running, fake: FakeDaemon
) -> None:
    fake.fail_next = True
    reply = ask(server.paths["admin"], snapshot(11))
    assert isinstance(reply, ErrorReply)
    assert (reply.error.code, reply.id) == ("internal", request_id(11))
    assert "deliberate bug" not in reply.error.message  # details go to the log only
    (failure,) = server.events("handler_failed")
    assert failure["level"] == "error"
    assert "deliberate bug" in failure["error"]
    assert "RuntimeError" in failure["traceback"]
    assert isinstance(ask(server.paths["admin"], snapshot(12)), SnapshotReply)


def test_a_failure_while_reading_a_request_is_internal_too(
    server: Running, fake: FakeDaemon, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken() -> int:
        raise RuntimeError("a deliberate bug below the decoder")

    monkeypatch.setattr(fake, "input_chunk_bytes", broken)
    sock = raw_connect(server.paths["admin"])
    sock.sendall(frame(encode_request(snapshot(14))))
    assert error_of(read_reply(sock))[:2] == ("internal", ZERO_ID)  # the ID was never read
    (failure,) = server.events("request_failed")
    assert "deliberate bug" in failure["error"]
    monkeypatch.undo()
    assert isinstance(ask(server.paths["admin"], snapshot(15)), SnapshotReply)


def test_a_reply_over_2_mib_becomes_internal(server: Running, fake: FakeDaemon) -> None:
    def huge(request: AnyRequest) -> AnyReply:
        rows = [error_row("unknown_attempt", "x" * 4000) for _ in range(600)]
        return AttemptsReply(version=1, id=request.id, results=rows)  # type: ignore[arg-type]

    fake.reply = huge
    sock = raw_connect(server.paths["admin"])
    sock.sendall(frame(encode_request(snapshot(13))))
    code, reply_id, message = error_of(read_reply(sock))
    assert (code, reply_id) == ("internal", request_id(13))
    assert "2 MiB" in message
    assert server.events("reply_too_large")[0]["bytes"] > REPLY_MAX


def reads_reply(request_id: str, size: int) -> ReadsReply:
    """A collect-shaped reply carrying `size` bytes that name the request."""
    data = (request_id.encode() * (size // 32 + 1))[:size]
    row = ReadRow(
        attempt_id="a" * 32,
        generation=1,
        plan_digest="sha256:" + "0" * 64,
        object="stdout",
        offset=0,
        data=data,
        next_offset=size,
        eof=True,
        complete=False,
        identity="sha256:" + "1" * 64,
    )
    return ReadsReply(version=1, id=request_id, results=[row])


SIZES = [1 << 20, 0, 300_000, 5, 700_000, 1 << 20, 3]


def test_replies_of_any_size_in_turn_are_each_the_canonical_encoding(
    server: Running, fake: FakeDaemon
) -> None:
    """Reply buffers are reused: a frame never carries bytes of an earlier, larger one."""
    replies: dict[str, AnyReply] = {}

    def sized(request: AnyRequest) -> AnyReply:
        size = SIZES[int(request.id, 16) % len(SIZES)]
        replies[request.id] = reads_reply(request.id, size)
        if size == 5:
            replies[request.id] = error_reply(request.id, "unknown_attempt", "small")
        return replies[request.id]

    fake.reply = sized
    for n in range(2 * len(SIZES)):
        sock = raw_connect(server.paths["transport"])
        sock.sendall(frame(encode_request(snapshot(n))))
        assert read_reply(sock) == encode_reply(replies[request_id(n)])
        assert at_eof(sock)
        sock.close()
    assert server.events("reply_too_large") == []


def test_replies_written_at_once_each_get_their_own_bytes(
    server: Running, fake: FakeDaemon
) -> None:
    fake.reply = lambda request: reads_reply(request.id, 600_000 + int(request.id, 16))
    release = _hold(server, fake)
    held = [raw_connect(server.paths["transport"]) for _ in range(6)]
    for n, sock in enumerate(held):
        sock.sendall(frame(encode_request(snapshot(n))))
    wait_for(lambda: len(fake.calls) == 6, "six requests in dispatch")
    release()
    for n, sock in enumerate(held):
        assert read_reply(sock) == encode_reply(reads_reply(request_id(n), 600_000 + n))
        sock.close()


# --- one request per connection ------------------------------------------------------------


def test_one_request_per_connection(server: Running, fake: FakeDaemon) -> None:
    sock = raw_connect(server.paths["admin"])
    sock.sendall(frame(encode_request(snapshot(21))) + frame(encode_request(snapshot(22))))
    reply = read_reply(sock)
    assert reply is not None
    first = decode_reply(reply, "snapshot")
    assert first.id == request_id(21)
    assert read_reply(sock) is None  # closed after one reply
    assert [c[3] for c in fake.calls] == [request_id(21)]


def test_a_peer_that_connects_and_leaves_is_not_an_error(server: Running, fake: FakeDaemon) -> None:
    raw_connect(server.paths["admin"]).close()
    wait_for(lambda: bool(server.events("closed_empty")), "the empty connection's log line")
    assert fake.calls == []
    assert isinstance(ask(server.paths["admin"], snapshot()), SnapshotReply)


def test_shutdown_closes_the_sockets_to_new_peers(directory: Path, fake: FakeDaemon) -> None:
    with running_server(directory, fake) as server:
        path = server.paths["admin"]
        assert isinstance(ask(path, snapshot()), SnapshotReply)
    with pytest.raises(OSError):
        raw_connect(path)


def test_a_socket_path_taken_by_something_else_refuses_to_serve(
    directory: Path, fake: FakeDaemon
) -> None:
    (directory / "admin.sock").write_text("not a socket")
    server = Running(directory, fake, ServerLimits())
    errors: list[BaseException] = []

    async def main() -> None:
        try:
            await serve(fake, server.endpoints, limits=ServerLimits(), log=server.logs.append)
        except BaseException as exc:  # recorded for the assertion
            errors.append(exc)

    asyncio.run(main())
    (error,) = errors
    assert getattr(error, "code", None) == "socket_unsafe"
    assert not os.path.exists(server.paths["transport"])  # nothing after the refusal
    assert (directory / "admin.sock").read_text() == "not a socket"  # left for the operator


# --- request-byte budgets --------------------------------------------------------------


def _announce(path: str, length: int) -> socket.socket:
    """A peer that declares a `length`-byte frame and sends one byte of it."""
    sock = raw_connect(path)
    sock.sendall(HEADER.pack(length) + b"{")
    return sock


def test_a_transport_flood_of_trickled_frames_never_starves_the_administrator(
    directory: Path, fake: FakeDaemon
) -> None:
    """Five transport connections announce 12 MiB frames and trickle: four fill the
    transport pool, the fifth is `busy`. The administrator's snapshots are still
    served at once from its own pool, and the tricklers lose their reservations (cut
    off, `too_slow`) long before the read timeout; then the transport is served."""
    with running_server(directory, fake, read_timeout=30.0) as server:
        flood = [_announce(server.paths["transport"], REQUEST_MAX) for _ in range(5)]
        readable, _, _ = select.select(flood, [], [], 30)
        assert len(readable) == 1, "exactly one announced frame does not fit the pool"
        (refused,) = readable
        code, _, _ = error_of(read_reply(refused))
        assert code == "busy"  # so the other four hold the whole transport pool now
        flood.remove(refused)
        worst = 0.0
        for n in range(10):
            started = time.monotonic()
            reply = ask(server.paths["admin"], snapshot(n))
            worst = max(worst, time.monotonic() - started)
            assert isinstance(reply, SnapshotReply), reply
        print(f"administrator's worst snapshot latency during the flood: {worst * 1000:.1f} ms")
        assert worst < 2.0
        started = time.monotonic()
        for sock in flood:
            assert read_reply(sock) is None  # cut off without a reply
            sock.close()
        assert time.monotonic() - started < 10.0
        assert len(server.events("too_slow")) == 4
        assert isinstance(ask(server.paths["transport"], snapshot(20)), SnapshotReply)


def test_owners_cannot_take_the_administrators_pool(directory: Path, fake: FakeDaemon) -> None:
    with running_server(directory, fake) as server:
        owners = [_announce(server.paths["owner"], REQUEST_MAX) for _ in range(2)]
        readable, _, _ = select.select(owners, [], [], 30)
        assert len(readable) == 1, "the owners' pool holds one largest frame"
        assert error_of(read_reply(readable[0]))[0] == "busy"
        assert isinstance(ask(server.paths["admin"], snapshot(1)), SnapshotReply)
        for sock in owners:
            sock.close()


def test_a_frame_that_keeps_arriving_is_never_cut_off(directory: Path, fake: FakeDaemon) -> None:
    """A whole large request, sent in pieces at a steady pace, is read and dispatched."""
    with running_server(directory, fake) as server:
        payload = encode_request(snapshot(3))
        sock = raw_connect(server.paths["transport"])
        sock.sendall(HEADER.pack(len(payload)))
        for piece in range(0, len(payload), 16):
            sock.sendall(payload[piece : piece + 16])
        reply = read_reply(sock)
        assert reply is not None
        assert isinstance(decode_reply(reply, "snapshot"), SnapshotReply)
        assert not server.events("too_slow")
