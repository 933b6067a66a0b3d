"""The daemon's socket shell: accept, check the peer, read one frame, dispatch, reply.

A thin asyncio shell around the sans-I/O codecs of ficc-protocol and the daemon's
`dispatch`. Per connection, in this order:

1. `accept`, then SO_PEERCRED: a peer whose UID does not own this socket is refused
   before a single byte is read from it. The refusal is one `not_authorized` reply
   frame (request ID `"0" * 32`, since no request was read), sent without blocking,
   then the connection is closed. A reply rather than a bare close, so a misdirected
   client learns why; the Client rejects it as a ReplyMismatch (ID zero), which is
   still a clear error.
2. Connection bounds: over the overall or per-socket bound, the peer gets one `busy`
   reply (ID zero) and a close, again without anything read.
3. One frame, within `read_timeout` (a slow peer is cut off, without a reply), at most
   12 MiB, and only if the request-byte budget has room (else `busy`): the header is
   checked before the payload is received, into one buffer of exactly its length
   (nothing past the frame is read).
4. `receive_request` (large frames off the loop), then `may_send` from the socket kind
   alone; every refusal is an ErrorReply with the ProtocolError's code, its JSON path in
   the message, and the request ID when it could be read.
5. `await daemon.dispatch(sender, uid, request)`; an exception there is a bug: the peer
   gets `internal`, the log gets the traceback, the server keeps serving.
6. One reply frame within `write_timeout`, then close. One request per connection.

Logs are JSON lines on stderr (`ts, level, event, socket, uid, action, id, code,
duration_ms`), one per connection outcome.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, cast

from ficc.execution._executor import ReceivedRequest, encode_frame_into, receive_request
from ficc.execution.errors import ErrorCode, ProtocolError
from ficc.execution.frames import (
    HEADER,
    REPLY_MAX,
    REQUEST_MAX,
    FrameDecoder,
    FrameError,
)
from ficc.execution.host.context.buffers import (
    KEPT_REQUEST_BYTES,
    KEPT_REQUEST_IDLE_S,
    ReplyBuffers,
    RequestBuffers,
)
from ficc.execution.host.core.authority import SocketKind
from ficc.execution.host.core.budget import Progress, RequestBudget
from ficc.execution.host.core.errors import HostError
from ficc.execution.host.core.replies import REPLY_ENCODER, encode_reply
from ficc.execution.host.daemon import logs
from ficc.execution.host.daemon.peercred import Endpoint, check_peer, listen, peer_credentials
from ficc.execution.protocol import Sender, may_send
from ficc.execution.wire import AnyReply, ErrorReply, error_reply

SENDERS: dict[SocketKind, Sender] = {
    SocketKind.TRANSPORT: Sender.TRANSPORT,
    SocketKind.ADMINISTRATOR: Sender.ADMINISTRATOR,
    SocketKind.LOCAL_OWNER: Sender.OWNER,
}
"""The sender a socket's kind stands for: authority comes from the socket only."""

_OFF_LOOP_BYTES = 256 * 1024
"""Frames larger than this are decoded in a worker thread (base64 + SHA-256 of chunks)."""
_PROGRESS_SLACK_S = 0.01
"""How long past the progress deadline a receive may still end before the cut."""

_IDLE_REPLY_BUFFERS = 2


class Dispatcher(Protocol):
    """What the shell needs from the daemon (see docs/architecture.md)."""

    async def dispatch(self, sender: Sender, uid: int, request: ReceivedRequest) -> AnyReply: ...

    def input_chunk_bytes(self) -> int: ...


@dataclass(frozen=True)
class ServerLimits:
    """Bounds that keep a slow, busy or malicious peer from holding the daemon.

    `request_budget_bytes` bounds the request bytes the transport's connections buffer
    at once (a frame's declared length is reserved before its payload is read), so
    memory stays bounded however many peers send 12 MiB frames together; the local
    owners share `owner_budget_bytes`, and the administrator's socket has
    `admin_budget_bytes` of its own, which no other peer can take. A reserved frame
    must keep arriving (`progress`), or its connection is cut (see `budget`).
    """

    max_connections: int = 64
    max_connections_per_socket: int = 48
    read_timeout: float = 30.0
    write_timeout: float = 30.0
    request_budget_bytes: int = 48 * 1024 * 1024
    owner_budget_bytes: int = REQUEST_MAX
    admin_budget_bytes: int = REQUEST_MAX
    progress: Progress = field(default_factory=Progress)
    shutdown_grace: float = 10.0

    def __post_init__(self) -> None:
        if min(self.max_connections, self.max_connections_per_socket) < 1:
            raise ValueError("connection bounds must be at least 1")
        pools = (self.request_budget_bytes, self.owner_budget_bytes, self.admin_budget_bytes)
        if min(pools) < REQUEST_MAX:
            raise ValueError("each request budget must hold at least one largest request")

    def budget(self) -> RequestBudget:
        return RequestBudget({
            SocketKind.TRANSPORT: self.request_budget_bytes,
            SocketKind.LOCAL_OWNER: self.owner_budget_bytes,
            SocketKind.ADMINISTRATOR: self.admin_budget_bytes,
        })  # fmt: skip


Log = Callable[[dict[str, Any]], None]


def stderr_log(record: dict[str, Any]) -> None:
    """Write one JSON line to stderr (the journal under systemd; see `logs`)."""
    logs.emit(record)


class _Refused(Exception):
    """End the connection with this reply (or none); carries what the log line needs."""

    def __init__(self, reply: ErrorReply | None, event: str) -> None:
        super().__init__(event)
        self.reply = reply
        self.event = event


@dataclass
class _Connection:
    """What one connection's log line says about it."""

    endpoint: Endpoint
    uid: int | None = None
    action: str | None = None
    request_id: str | None = None
    started: float = field(default_factory=time.monotonic)
    frame: bytearray | None = None  # the request's frame, for `RequestBuffers`


class Server:
    """The listening sockets of one daemon and the connections they carry."""

    def __init__(self, daemon: Dispatcher, limits: ServerLimits, log: Log = stderr_log) -> None:
        self.daemon = daemon
        self.limits = limits
        self.log = log
        self._active: dict[str, int] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._budget = limits.budget()
        self._reply_buffers = ReplyBuffers(_IDLE_REPLY_BUFFERS)
        self._request_buffers = RequestBuffers(KEPT_REQUEST_BYTES, KEPT_REQUEST_IDLE_S)

    @property
    def active(self) -> int:
        return sum(self._active.values())

    # --- accepting ------------------------------------------------------------------

    async def accept_loop(self, endpoint: Endpoint, listener: socket.socket) -> None:
        """Accept forever on one socket; each connection runs in its own task."""
        loop = asyncio.get_running_loop()
        listener.setblocking(False)
        while True:
            try:
                conn, _ = await loop.sock_accept(listener)
            except OSError as exc:  # EMFILE and friends: back off, keep serving
                self._event("error", "accept_failed", endpoint, message=str(exc))
                await asyncio.sleep(0.1)
                continue
            self._admit(endpoint, conn)

    def _admit(self, endpoint: Endpoint, conn: socket.socket) -> None:
        """Peer check and bounds, synchronously and before any byte is read."""
        conn.setblocking(False)
        info = _Connection(endpoint)
        try:
            info.uid = peer_credentials(conn).uid
            check_peer(endpoint, info.uid)
        except HostError as exc:
            self._refuse_now(conn, info, "peer_refused", ErrorCode.NOT_AUTHORIZED, exc.message)
            return
        except OSError as exc:
            self._refuse_now(conn, info, "peer_unreadable", ErrorCode.NOT_AUTHORIZED, str(exc))
            return
        here = self._active.get(endpoint.path, 0)
        if self.active >= self.limits.max_connections:
            self._refuse_now(conn, info, "busy", ErrorCode.BUSY, _busy("the executor"))
            return
        if here >= self.limits.max_connections_per_socket:
            self._refuse_now(conn, info, "busy", ErrorCode.BUSY, _busy(endpoint.name))
            return
        self._active[endpoint.path] = here + 1
        task = asyncio.get_running_loop().create_task(self._serve(conn, info))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _refuse_now(
        self, conn: socket.socket, info: _Connection, event: str, code: str, message: str
    ) -> None:
        """Send one small refusal without waiting (a fresh socket buffer holds it), close."""
        payload = encode_reply(error_reply(None, code, message))
        with contextlib.suppress(OSError):
            conn.send(HEADER.pack(len(payload)) + payload)
        self._event("warning", event, info.endpoint, code=code, info=info)
        conn.close()

    # --- one connection ---------------------------------------------------------------

    async def _serve(self, conn: socket.socket, info: _Connection) -> None:
        try:
            reply = await self._reply_for(conn, info)
            if reply is not None:
                await self._write(conn, reply, info)
        finally:
            self._release(info)
            conn.close()  # a reply not fully sent (write timeout) is dropped with it
            self._request_buffers.give_back(info.frame)

    def _release(self, info: _Connection) -> None:
        path = info.endpoint.path
        self._active[path] -= 1
        if not self._active[path]:
            del self._active[path]

    async def _reply_for(self, conn: socket.socket, info: _Connection) -> AnyReply | None:
        """The reply to send, or None to close silently (timeout, EOF)."""
        try:
            request = await self._read_request(conn, info)
            return await self._dispatch(request, info)
        except _Refused as refused:
            code = refused.reply.error.code if refused.reply is not None else None
            self._event("warning", refused.event, info.endpoint, code=code, info=info)
            return refused.reply
        except Exception as exc:  # a bug below the decoder: answer, log, keep serving
            self._event(
                "error",
                "request_failed",
                info.endpoint,
                code=ErrorCode.INTERNAL,
                info=info,
                error=f"{type(exc).__name__}: {exc}",
                traceback=traceback.format_exc(limit=20),
            )
            return _internal(info.request_id, "the executor failed while reading this request")

    async def _read_request(self, conn: socket.socket, info: _Connection) -> ReceivedRequest:
        frame = await self._read_frame(conn, info.endpoint.kind)
        try:
            if len(frame) > _OFF_LOOP_BYTES:
                request = await asyncio.to_thread(self._decode, frame)
            else:
                request = self._decode(frame)
            # Only now may the buffer be kept: a cancelled wait above leaves the thread
            # decoding, at moments without a view of the frame.
            info.frame = frame
        except ProtocolError as exc:
            info.request_id = exc.request_id
            message = f"{exc.message} (at {exc.path})"
            refusal = error_reply(exc.request_id, exc.code, message)
            raise _Refused(refusal, "request_refused") from None
        info.action, info.request_id = request.action, request.id
        sender = SENDERS[info.endpoint.kind]
        if not may_send(sender, request.action):
            message = (
                f"{info.endpoint.name} ({sender.value}) may not send {request.action!r}; "
                "see the action table in docs/protocol.md"
            )
            raise _Refused(
                error_reply(request.id, ErrorCode.NOT_AUTHORIZED, message), "action_refused"
            )
        return request

    def _decode(self, frame: bytearray) -> ReceivedRequest:
        # msgspec decodes any buffer in place; receive_request is annotated for bytes only
        payload = cast(bytes, frame)
        return receive_request(payload, input_chunk_bytes=self.daemon.input_chunk_bytes())

    async def _read_frame(self, conn: socket.socket, kind: SocketKind) -> bytearray:
        """One frame: header within the read timeout, budget reserved from this socket
        kind's pool, then the payload, which must keep arriving (`budget.Progress`).

        The frame decoder checks the header and gives one buffer of exactly the
        declared length, which the payload is received straight into (the request
        decoder reads it in place): a stream reader would hold its own buffer, a slice
        of it and the returned copy at once, three times an 8 MiB chunk's frame.
        """
        decoder = FrameDecoder(REQUEST_MAX, self._request_buffers.take)
        try:
            async with asyncio.timeout(self.limits.read_timeout):
                while decoder.expected is None:
                    await _receive_into(conn, decoder)
                length = decoder.expected
                if not self._budget.take(kind, length):
                    message = _busy("the executor's request buffer")
                    raise _Refused(error_reply(None, ErrorCode.BUSY, message), "busy")
                try:
                    return await self._payload(conn, decoder)
                finally:
                    self._budget.give(kind, length)
        except FrameError as exc:
            raise _Refused(error_reply(None, exc.code, exc.message), "frame_refused") from None
        except TimeoutError:
            raise _Refused(None, "read_timeout") from None
        except ConnectionError:
            raise _Refused(None, "connection_reset") from None

    async def _payload(self, conn: socket.socket, decoder: FrameDecoder) -> bytearray:
        """The rest of a reserved frame, cut off (`too_slow`) once it falls behind the
        progress rule: a peer keeps its reservation only while its bytes arrive."""
        progress = self.limits.progress
        started = time.monotonic()
        payload = None
        while payload is None:
            elapsed = time.monotonic() - started
            if progress.too_slow(decoder.buffered, elapsed):
                raise _Refused(None, "too_slow")
            remaining = progress.grace_s + decoder.buffered / progress.min_rate - elapsed
            try:
                async with asyncio.timeout(max(remaining, 0.0) + _PROGRESS_SLACK_S):
                    payload = await _receive_into(conn, decoder)
            except TimeoutError:
                raise _Refused(None, "too_slow") from None
        return payload

    async def _dispatch(self, request: ReceivedRequest, info: _Connection) -> AnyReply:
        sender = SENDERS[info.endpoint.kind]
        assert info.uid is not None
        try:
            return await self.daemon.dispatch(sender, info.uid, request)
        except Exception as exc:  # a bug in the daemon: answer, log, keep serving
            self._event(
                "error",
                "handler_failed",
                info.endpoint,
                code=ErrorCode.INTERNAL,
                info=info,
                error=f"{type(exc).__name__}: {exc}",
                traceback=traceback.format_exc(limit=20),
            )
            return _internal(request.id, "the executor failed while handling this request")

    async def _write(self, conn: socket.socket, reply: AnyReply, info: _Connection) -> None:
        """One frame in one buffer, sent as it is (no header + payload concatenation)."""
        buffer = self._reply_buffers.take()
        self._frame(reply, buffer, info)
        with contextlib.suppress(OSError):  # room for the whole frame: one send, not a relay
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, len(buffer))
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.limits.write_timeout):
                await loop.sock_sendall(conn, buffer)
        except TimeoutError:  # the buffer is not reused: an unfinished send may still hold it
            self._event("warning", "write_timeout", info.endpoint, info=info)
            return
        except ConnectionError:
            self._event("warning", "peer_gone", info.endpoint, info=info)
            return
        self._reply_buffers.give_back(buffer)
        code = _code_of(reply)
        level = "info" if code is None else "warning"
        self._event(level, "request", info.endpoint, code=code, info=info)

    def _frame(self, reply: AnyReply, buffer: bytearray, info: _Connection) -> None:
        try:
            encode_frame_into(REPLY_ENCODER, reply, buffer, REPLY_MAX)
        except FrameError:  # a handler bug: never send an oversized frame
            size = len(buffer) - HEADER.size
            self._event("error", "reply_too_large", info.endpoint, info=info, bytes=size)
            internal = _internal(info.request_id, "the reply was over 2 MiB")
            encode_frame_into(REPLY_ENCODER, internal, buffer, REPLY_MAX)

    # --- logs ---------------------------------------------------------------------------

    def _event(
        self,
        level: str,
        event: str,
        endpoint: Endpoint,
        *,
        code: str | None = None,
        info: _Connection | None = None,
        **extra: Any,
    ) -> None:
        record: dict[str, Any] = {
            "ts": time.time(),
            "level": level,
            "event": event,
            "socket": endpoint.name,
        }
        if info is not None:
            record.update(
                uid=info.uid,
                action=info.action,
                id=info.request_id,
                duration_ms=round((time.monotonic() - info.started) * 1000, 3),
            )
        record["code"] = code
        record.update(extra)
        with contextlib.suppress(Exception):  # a broken log sink must not stop the server
            self.log(record)

    # --- shutdown -----------------------------------------------------------------------

    async def drain(self) -> None:
        """Let in-flight requests finish (within the grace period), then cancel the rest."""
        if not self._tasks:
            return
        _, pending = await asyncio.wait(set(self._tasks), timeout=self.limits.shutdown_grace)
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.wait(pending)


async def _receive_into(conn: socket.socket, decoder: FrameDecoder) -> bytearray | None:
    """Receive what `decoder` wants next; the payload once the frame is complete.

    A peer that connects and leaves before the first byte is not an error (no reply);
    one that leaves inside a frame gets the decoder's `bad_frame`.
    """
    view = decoder.want()
    try:  # what has arrived already, without a trip around the loop (the socket never blocks)
        received = conn.recv_into(view)
    except BlockingIOError:
        received = await asyncio.get_running_loop().sock_recv_into(conn, view)
    if not received:
        if decoder.idle:
            raise _Refused(None, "closed_empty")
        decoder.eof()  # raises FrameError
    return decoder.received(received)


def _busy(what: str) -> str:
    return f"{what} has too many open connections; retry shortly"


def _internal(request_id: str | None, message: str) -> ErrorReply:
    return error_reply(request_id, ErrorCode.INTERNAL, message)


def _code_of(reply: AnyReply) -> str | None:
    return reply.error.code if isinstance(reply, ErrorReply) else None


async def serve(
    daemon: Dispatcher,
    endpoints: list[Endpoint],
    *,
    limits: ServerLimits,
    ready: Callable[[], None] | None = None,
    log: Log = stderr_log,
) -> None:
    """Listen on every endpoint, call `ready()`, and serve until cancelled.

    Creating a socket can refuse (`socket_unsafe`, `socket_in_use`, a HostError) before
    anything is served; sockets already created are closed again. On cancellation the
    listeners close first (new peers get ECONNREFUSED), in-flight requests get
    `limits.shutdown_grace` seconds, then cancellation propagates.
    """
    server = Server(daemon, limits, log)
    listeners: list[tuple[Endpoint, socket.socket]] = []
    try:
        for endpoint in endpoints:
            listeners.append((endpoint, listen(endpoint, backlog=limits.max_connections)))
        loops = [asyncio.ensure_future(server.accept_loop(e, s)) for e, s in listeners]
        for endpoint, _ in listeners:
            server._event("info", "listening", endpoint, peer_uid=endpoint.peer_uid)
        if ready is not None:
            ready()
        try:
            await asyncio.gather(*loops)
        finally:
            for task in loops:
                task.cancel()
            await asyncio.gather(*loops, return_exceptions=True)
            for _, sock in listeners:
                sock.close()
            await server.drain()
    finally:
        for _, sock in listeners:
            with contextlib.suppress(OSError):
                sock.close()


__all__ = ["SENDERS", "Dispatcher", "Log", "Server", "ServerLimits", "serve", "stderr_log"]
