"""The client against real Unix-socket servers: one in-process (root), one run by a real
non-root user, and servers that misbehave in every way the client must catch."""

from __future__ import annotations

import asyncio
import os
import pathlib
import pwd
import signal
import socket
import struct
import subprocess
import tempfile
from collections.abc import Awaitable, Callable, Iterator

import pytest

import ficc_protocol_examples as ex
from ficc.execution.client import (
    Client,
    ClientError,
    ConnectFailed,
    PeerCredentials,
    PeerNotRoot,
    Refused,
    ReplyInvalid,
    ReplyMismatch,
    ReplyTooLarge,
    ReplyTruncated,
    RequestInvalid,
    Timeout,
    peer_credentials,
)
from ficc.execution.frames import REPLY_MAX, REQUEST_MAX, FrameDecoder
from ficc.execution.plan import EMPTY_DIGEST
from ficc.execution.protocol import (
    ZERO_ID,
    Fence,
    InputWriteRequest,
    SnapshotRequest,
    StartRequest,
    decode_request,
    encode_request,
)
from ficc.execution.wire import AttemptsReply, Error, ErrorReply, SnapshotReply, encode_reply

pytestmark = pytest.mark.root(
    "the client trusts only a root server, and the in-process server is root only under root"
)

PEER_USER = "ficc-test-peer"
Handler = Callable[[bytes, asyncio.StreamWriter], Awaitable[None]]


@pytest.fixture
def sock_dir() -> Iterator[pathlib.Path]:
    with tempfile.TemporaryDirectory(prefix="ficc-proto-client-") as path:
        yield pathlib.Path(path)


def _reply_for(payload: bytes) -> bytes:
    """A correct reply to a start or snapshot request."""
    request = decode_request(payload)
    replies = ex.replies()
    if request.action == "snapshot":
        model = replies["snapshot"]
    else:
        model = AttemptsReply(
            version=1,
            id=request.id,
            results=[
                ex.replies()["prepare"].results[1]  # an error row per request row
                for _ in range(request.row_count)
            ],
        )
    data = encode_reply(model)
    return data.replace(ex.REQUEST_ID.encode(), request.id.encode())


async def _read_request(reader: asyncio.StreamReader) -> bytes:
    """One request frame, read by a test server through the shared frame decoder."""
    decoder = FrameDecoder(REQUEST_MAX)
    async with asyncio.timeout(5):
        while True:
            data = await reader.read(65536)
            if not data:
                decoder.eof()
                raise EOFError("the client closed the connection without a frame")
            frames = decoder.feed(data)
            if frames:
                return frames[0]


def _frame(payload: bytes) -> bytes:
    return struct.pack(">I", len(payload)) + payload


async def _serve_once(
    path: pathlib.Path, handler: Handler, client: Client, message: object
) -> object:
    """Run a one-connection server and the client request against it."""
    done = asyncio.Event()

    async def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            payload = await _read_request(reader)
            await handler(payload, writer)
            await writer.drain()
        finally:
            await done.wait()  # keep the connection until the client has finished
            writer.close()

    server = await asyncio.start_unix_server(on_connect, path=str(path))
    try:
        return await client.request(message)  # type: ignore[arg-type]
    finally:
        done.set()
        server.close()
        await server.wait_closed()


def _run(path: pathlib.Path, handler: Handler, message: object = None, **kw: float) -> object:
    client = Client(str(path), connect_timeout=5, read_timeout=kw.get("read_timeout", 5))
    message = message or ex.requests()["start"]
    return asyncio.run(_serve_once(path, handler, client, message))


# --- a correct root server ----------------------------------------------------------


def test_root_server_reply_is_decoded(sock_dir: pathlib.Path) -> None:
    async def good(payload: bytes, writer: asyncio.StreamWriter) -> None:
        writer.write(_frame(_reply_for(payload)))

    reply = _run(sock_dir / "s", good)
    assert isinstance(reply, AttemptsReply)
    assert reply.id == ex.REQUEST_ID
    assert len(reply.results) == 2
    snap = _run(sock_dir / "t", good, ex.requests()["snapshot"])
    assert isinstance(snap, SnapshotReply)


def test_error_reply_is_returned_not_raised(sock_dir: pathlib.Path) -> None:
    async def refuse(payload: bytes, writer: asyncio.StreamWriter) -> None:
        writer.write(_frame(encode_reply(ex.replies()["error"])))

    reply = _run(sock_dir / "s", refuse)
    assert isinstance(reply, ErrorReply)
    assert reply.error.code == "not_authorized"


def test_request_is_sent_exactly_once_and_canonical(sock_dir: pathlib.Path) -> None:
    seen: list[bytes] = []

    async def record(payload: bytes, writer: asyncio.StreamWriter) -> None:
        seen.append(payload)
        writer.write(_frame(_reply_for(payload)))

    _run(sock_dir / "s", record)
    assert seen == [encode_request(ex.requests()["start"])]


# --- misbehaving servers ------------------------------------------------------------


def _expect(
    sock_dir: pathlib.Path, handler: Handler, error: type[ClientError], **kw: float
) -> ClientError:
    with pytest.raises(error) as info:
        _run(sock_dir / "s", handler, **kw)
    return info.value


def test_wrong_request_id(sock_dir: pathlib.Path) -> None:
    async def other_id(payload: bytes, writer: asyncio.StreamWriter) -> None:
        writer.write(_frame(_reply_for(payload).replace(ex.REQUEST_ID.encode(), b"f" * 32)))

    assert "f" * 32 in str(_expect(sock_dir, other_id, ReplyMismatch))


def test_wrong_version(sock_dir: pathlib.Path) -> None:
    async def version_2(payload: bytes, writer: asyncio.StreamWriter) -> None:
        writer.write(_frame(_reply_for(payload).replace(b'"version":1', b'"version":2')))

    assert "version 2" in str(_expect(sock_dir, version_2, ReplyMismatch))


def test_oversize_reply_is_refused_from_its_header(sock_dir: pathlib.Path) -> None:
    async def huge(payload: bytes, writer: asyncio.StreamWriter) -> None:
        writer.write(struct.pack(">I", REPLY_MAX + 1) + b"{" * 1024)

    _expect(sock_dir, huge, ReplyTooLarge)


def test_largest_reply_is_read(sock_dir: pathlib.Path) -> None:
    async def padded(payload: bytes, writer: asyncio.StreamWriter) -> None:
        body = _reply_for(payload)
        body = body[:-1] + b" " * (REPLY_MAX - len(body)) + b"}"
        writer.write(_frame(body))

    assert isinstance(_run(sock_dir / "s", padded), AttemptsReply)


def test_truncated_reply(sock_dir: pathlib.Path) -> None:
    async def cut(payload: bytes, writer: asyncio.StreamWriter) -> None:
        body = _reply_for(payload)
        writer.write(struct.pack(">I", len(body)) + body[:10])
        writer.write_eof()

    assert "10 of" in str(_expect(sock_dir, cut, ReplyTruncated))


def test_closed_after_the_header_or_inside_it(sock_dir: pathlib.Path) -> None:
    async def header_only(payload: bytes, writer: asyncio.StreamWriter) -> None:
        writer.write(struct.pack(">I", 100))
        writer.write_eof()

    async def half_header(payload: bytes, writer: asyncio.StreamWriter) -> None:
        writer.write(b"\x00\x00")
        writer.write_eof()

    assert "0 of 100" in str(_expect(sock_dir, header_only, ReplyTruncated))
    assert "header" in str(_expect(sock_dir, half_header, ReplyTruncated))


def test_a_second_frame_after_the_reply_is_invalid(sock_dir: pathlib.Path) -> None:
    async def twice(payload: bytes, writer: asyncio.StreamWriter) -> None:
        writer.write(_frame(_reply_for(payload)) + _frame(_reply_for(payload)))

    assert "more than one" in str(_expect(sock_dir, twice, ReplyInvalid))


def test_closed_without_reply(sock_dir: pathlib.Path) -> None:
    async def silent_close(payload: bytes, writer: asyncio.StreamWriter) -> None:
        writer.write_eof()

    _expect(sock_dir, silent_close, ReplyTruncated)


def test_zero_length_reply(sock_dir: pathlib.Path) -> None:
    async def empty(payload: bytes, writer: asyncio.StreamWriter) -> None:
        writer.write(struct.pack(">I", 0))

    _expect(sock_dir, empty, ReplyTruncated)


def test_malformed_reply(sock_dir: pathlib.Path) -> None:
    async def wrong_rows(payload: bytes, writer: asyncio.StreamWriter) -> None:
        body = encode_reply(AttemptsReply(version=1, id=ex.REQUEST_ID, results=[]))
        writer.write(_frame(body))

    error = _expect(sock_dir, wrong_rows, ReplyInvalid)
    assert isinstance(error, ReplyInvalid)
    assert error.error.path == "$.results"


def test_slow_server_times_out(sock_dir: pathlib.Path) -> None:
    async def never(payload: bytes, writer: asyncio.StreamWriter) -> None:
        await asyncio.Event().wait()

    async def run() -> None:
        client = Client(str(sock_dir / "s"), connect_timeout=5, read_timeout=0.2)
        handler_task: list[asyncio.Task[None]] = []

        async def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            handler_task.append(asyncio.current_task())  # type: ignore[arg-type]
            await never(await _read_request(reader), writer)

        server = await asyncio.start_unix_server(on_connect, path=str(sock_dir / "s"))
        try:
            with pytest.raises(Timeout):
                await client.request(ex.requests()["start"])
        finally:
            for task in handler_task:
                task.cancel()
            server.close()
            await server.wait_closed()

    asyncio.run(run())


def test_missing_socket(sock_dir: pathlib.Path) -> None:
    client = Client(str(sock_dir / "absent"))
    with pytest.raises(ConnectFailed):
        asyncio.run(client.request(ex.requests()["start"]))


def _full_listen_queue(path: pathlib.Path) -> tuple[socket.socket, list[socket.socket]]:
    """A listener that never accepts, with its listen queue filled by waiting connects."""
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(path))
    server.listen(0)
    waiting: list[socket.socket] = []
    while True:
        filler = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        filler.setblocking(False)
        try:
            filler.connect(str(path))
        except BlockingIOError:
            filler.close()
            return server, waiting
        waiting.append(filler)


def test_a_full_listen_queue_is_a_connect_failure_not_an_impostor(
    sock_dir: pathlib.Path,
) -> None:
    """An overloaded or hung executor whose listen queue is full: the client keeps
    trying until `connect_timeout`, then says so; it never reads the credentials of
    a socket that is not connected (UID -1, which looked like an impostor server)."""
    server, waiting = _full_listen_queue(sock_dir / "s")
    try:
        checked: list[object] = []
        client = Client(str(sock_dir / "s"), connect_timeout=0.2, peer_check=checked.append)
        with pytest.raises(ConnectFailed, match="listen queue stayed full"):
            asyncio.run(client.request(ex.requests()["start"]))
        assert checked == []  # nothing was sent, no peer was looked at
    finally:
        for sock in [server, *waiting]:
            sock.close()


def test_a_connect_waits_for_room_in_the_listen_queue(sock_dir: pathlib.Path) -> None:
    """Once the server accepts a waiting connection, the client's next try connects."""
    server, waiting = _full_listen_queue(sock_dir / "s")

    async def run() -> socket.socket:
        connecting = asyncio.ensure_future(Client(str(sock_dir / "s"))._connect())
        await asyncio.sleep(0)  # the task's first try found the queue full
        assert not connecting.done()
        accepted, _ = server.accept()
        accepted.close()
        return await connecting

    try:
        connected = asyncio.run(run())
        try:
            assert peer_credentials(connected).pid == os.getpid()  # connected to `server`
        finally:
            connected.close()
    finally:
        for sock in [server, *waiting]:
            sock.close()


def test_invalid_request_is_never_sent(sock_dir: pathlib.Path) -> None:
    fence = ex.fence(ex.plan(1))
    bad = StartRequest(
        version=1, id=ex.REQUEST_ID, attempts=[fence, Fence("X" * 32, 1, EMPTY_DIGEST)]
    )
    client = Client(str(sock_dir / "absent"))  # a send would fail with ConnectFailed
    with pytest.raises(RequestInvalid) as info:
        asyncio.run(client.request(bad))
    assert info.value.error.path == "$.attempts[1].attempt_id"
    surrogate = SnapshotRequest(version=1, id="\ud800" * 32)
    with pytest.raises(RequestInvalid):
        asyncio.run(client.request(surrogate))


# --- a real non-root server peer ----------------------------------------------------


def _serve_one_as(uid: int, gid: int, path: pathlib.Path, reply: bytes, ready: int) -> None:
    """Child process body: drop to uid/gid, then bind, listen and answer one request.

    The kernel records the listener's credentials at listen(), which is what the
    client's SO_PEERCRED reports; so the drop must come first.
    """
    os.setgroups([])
    os.setresgid(gid, gid, gid)
    os.setresuid(uid, uid, uid)
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(path))
    server.listen(1)
    os.write(ready, struct.pack(">I", os.getuid()))
    conn, _ = server.accept()
    (n,) = struct.unpack(">I", conn.recv(4, socket.MSG_WAITALL))
    while n:
        n -= len(conn.recv(min(n, 65536)))
    conn.sendall(struct.pack(">I", len(reply)) + reply)
    conn.recv(1)  # until the client closes


@pytest.fixture(scope="module")
def peer_user() -> Iterator[pwd.struct_passwd]:
    """The real non-root system user; created for this module if missing, then removed."""
    try:
        yield pwd.getpwnam(PEER_USER)
        return
    except KeyError:
        pass
    subprocess.run(
        ["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", PEER_USER],
        check=True,
    )
    try:
        yield pwd.getpwnam(PEER_USER)
    finally:
        subprocess.run(["userdel", PEER_USER], check=True)


@pytest.fixture
def non_root_server(
    sock_dir: pathlib.Path, peer_user: pwd.struct_passwd
) -> Iterator[tuple[pathlib.Path, int]]:
    """A server process that became PEER_USER before it bound and listened."""
    user = peer_user
    os.chown(sock_dir, user.pw_uid, user.pw_gid)
    path = sock_dir / "peer.sock"
    reply = _reply_for_start().encode()
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: never return into pytest
        code = 1
        try:
            os.close(read_end)
            _serve_one_as(user.pw_uid, user.pw_gid, path, reply, write_end)
            code = 0
        finally:
            os._exit(code)
    os.close(write_end)
    try:
        ready = os.read(read_end, 4)
        assert len(ready) == 4, "the peer server failed before listening"
        assert struct.unpack(">I", ready)[0] == user.pw_uid
        yield path, user.pw_uid
    finally:
        os.close(read_end)
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)


def _reply_for_start() -> str:
    return _reply_for(encode_request(ex.requests()["start"])).decode()


def test_non_root_server_is_refused(non_root_server: tuple[pathlib.Path, int]) -> None:
    path, uid = non_root_server
    client = Client(str(path), connect_timeout=5, read_timeout=5)
    with pytest.raises(PeerNotRoot) as info:
        asyncio.run(client.request(ex.requests()["start"]))
    assert f"UID {uid}" in str(info.value)


def test_same_server_passes_only_with_an_injected_check(
    non_root_server: tuple[pathlib.Path, int],
) -> None:
    """Proves the refusal above came from the UID check and nothing else."""
    path, uid = non_root_server
    seen: list[PeerCredentials] = []
    client = Client(str(path), connect_timeout=5, read_timeout=5, peer_check=seen.append)
    reply = asyncio.run(client.request(ex.requests()["start"]))
    assert isinstance(reply, AttemptsReply)
    assert seen[0].uid == uid
    assert seen[0].pid > 0


def test_root_peer_credentials_are_read(sock_dir: pathlib.Path) -> None:
    seen: list[PeerCredentials] = []

    async def good(payload: bytes, writer: asyncio.StreamWriter) -> None:
        writer.write(_frame(_reply_for(payload)))

    async def run() -> None:
        client = Client(str(sock_dir / "s"), peer_check=seen.append)
        await _serve_once(sock_dir / "s", good, client, ex.requests()["start"])

    asyncio.run(run())
    assert seen == [PeerCredentials(os.getpid(), 0, os.getgid())]


# --- refusals before the request is read -------------------------------------------


def _refuse_without_reading(code: str) -> bytes:
    reply = ErrorReply(version=1, id=ZERO_ID, error=Error(code=code, message="try later"))
    return _frame(encode_reply(reply))


async def _refusing_server_run(path: pathlib.Path, refusal: bytes, message: object) -> object:
    """A server that, like the daemon over its bounds, answers before reading a byte."""

    async def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(refusal)
        await writer.drain()
        writer.close()

    server = await asyncio.start_unix_server(on_connect, path=str(path))
    try:
        client = Client(str(path), connect_timeout=5, read_timeout=5)
        return await client.request(message)  # type: ignore[arg-type]
    finally:
        server.close()
        await server.wait_closed()


def test_a_refusal_before_reading_is_refused_not_a_mismatch(sock_dir: pathlib.Path) -> None:
    message = ex.requests()["start"]
    with pytest.raises(Refused) as caught:
        asyncio.run(_refusing_server_run(sock_dir / "s", _refuse_without_reading("busy"), message))
    assert caught.value.code == "busy"


def test_a_refusal_while_a_large_request_is_still_being_written(
    sock_dir: pathlib.Path,
) -> None:
    """The server closes with most of an 8 MiB request unread: the write fails, and the
    refusal already in the receive buffer is still what the client reports."""
    big = InputWriteRequest(
        version=1, id=ex.REQUEST_ID, writes=[ex.chunk_write(ex.plan(1), b"x" * (8 << 20))]
    )
    assert len(encode_request(big)) > 10 << 20
    with pytest.raises(Refused) as caught:
        asyncio.run(
            _refusing_server_run(sock_dir / "s", _refuse_without_reading("not_authorized"), big)
        )
    assert caught.value.code == "not_authorized"


def test_a_zero_id_reply_that_is_not_a_refusal_is_a_mismatch(sock_dir: pathlib.Path) -> None:
    snapshot = encode_reply(ex.replies()["snapshot"])
    reply = _frame(snapshot.replace(ex.REQUEST_ID.encode(), ZERO_ID.encode()))
    with pytest.raises(ReplyMismatch):
        asyncio.run(_refusing_server_run(sock_dir / "s", reply, ex.requests()["snapshot"]))
