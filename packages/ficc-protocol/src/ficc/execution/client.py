"""The async client: one request, one bounded reply, over the executor's Unix socket.

It trusts a reply only from a server whose socket peer is root (SO_PEERCRED), only
when the reply names the protocol version and the request ID it sent, and only up to
REPLY_MAX bytes. It never retries: a missing reply does not mean the request failed
(query state, e.g. `input_status` or `observe`, and decide).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import NoReturn, cast

import msgspec

from ficc.execution.errors import ErrorCode, ProtocolError
from ficc.execution.frames import REPLY_MAX, REQUEST_MAX, FrameDecoder, FrameError, encode_frame
from ficc.execution.protocol import INPUT_CHUNK_MAX_BYTES, PROTOCOL_VERSION, ZERO_ID, Request
from ficc.execution.protocol import validate_request as _validate
from ficc.execution.wire import AnyReply, ErrorReply, decode_reply, read_envelope

_UCRED = struct.Struct("3i")


@dataclass(frozen=True)
class PeerCredentials:
    """What the kernel recorded for the server socket when it called listen()."""

    pid: int
    uid: int
    gid: int


class ClientError(Exception):
    """A request whose reply could not be trusted or obtained. The request may have run."""


class ConnectFailed(ClientError):
    """The socket is missing, refused the connection, or the connect timed out."""


class PeerNotRoot(ClientError):
    """The server's socket is not owned by root: not the executor, or a spoof."""


class RequestInvalid(ClientError):
    """The request does not validate locally; nothing was sent."""

    def __init__(self, error: ProtocolError) -> None:
        super().__init__(str(error))
        self.error = error


class Timeout(ClientError):
    """The server did not accept the request or reply within the timeout."""


class ReplyTooLarge(ClientError):
    """The reply's declared length is over REPLY_MAX; it was not read."""


class ReplyTruncated(ClientError):
    """The server closed the connection before a whole reply frame arrived."""


class ReplyMismatch(ClientError):
    """The reply has another protocol version or request ID than the request."""


class Refused(ClientError):
    """The server refused the connection before reading the request (`busy`,
    `not_authorized`, or an unreadable frame): the request was NOT applied.

    The server signals this with an error reply carrying the zero request ID, which
    it sends only when it has not read (or could not read) the request. Retrying
    later is safe.
    """

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


class ReplyInvalid(ClientError):
    """The reply is not a valid version-1 reply to this request."""

    def __init__(self, error: ProtocolError) -> None:
        super().__init__(str(error))
        self.error = error


PeerCheck = Callable[[PeerCredentials], None]

_CONNECT_PAUSE = 0.001
_CONNECT_PAUSE_MAX = 0.05
"""Pauses between connect attempts while the server's listen queue is full."""


def peer_credentials(sock: socket.socket) -> PeerCredentials:
    """SO_PEERCRED of a connected Unix socket."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
    return PeerCredentials(*_UCRED.unpack(raw))


def require_root_peer(peer: PeerCredentials) -> None:
    """The default and only production peer check: the server is UID 0."""
    if peer.uid != 0:
        raise PeerNotRoot(
            f"the socket's server runs as UID {peer.uid} (pid {peer.pid}), not root;"
            " check the socket path: it is not the executor"
        )


class Client:
    """`await Client(path).request(message)`: one connection per request.

    `peer_check` exists so tests that cannot run as root can substitute a check; a
    production caller leaves the strict default.
    """

    def __init__(
        self,
        socket_path: str,
        *,
        connect_timeout: float = 5.0,
        read_timeout: float = 30.0,
        peer_check: PeerCheck = require_root_peer,
        input_chunk_bytes: int = INPUT_CHUNK_MAX_BYTES,
    ) -> None:
        self.socket_path = socket_path
        self.connect_timeout = connect_timeout
        self.read_timeout = read_timeout
        self.peer_check = peer_check
        self.input_chunk_bytes = input_chunk_bytes

    async def request(self, message: Request) -> AnyReply:
        """Validate, send, and return the decoded reply (an ErrorReply if refused).

        Raises a ClientError subclass when no trustworthy reply was obtained; in that
        case the request may or may not have been applied.
        """
        try:
            request, payload = _validate(message, input_chunk_bytes=self.input_chunk_bytes)
        except ProtocolError as exc:
            raise RequestInvalid(exc) from None
        sock = await self._connect()
        try:
            self.peer_check(peer_credentials(sock))
            frame = await self._exchange(sock, encode_frame(payload, REQUEST_MAX))
        finally:
            sock.close()
        return self._trust(frame, request.action, request.id, request.row_count)

    async def _connect(self) -> socket.socket:
        """A connected socket, or ConnectFailed (nothing was sent).

        A Unix-socket connect completes at once or fails; EAGAIN means the server's
        listen queue is full (the executor is overloaded or hung). asyncio's
        `sock_connect` would take EAGAIN for a connect in progress and hand back an
        unconnected socket, whose peer then reads as UID -1; so this tries again,
        with growing pauses, until `connect_timeout`, as a blocking connect waits.
        """
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        sock.setblocking(False)
        deadline = asyncio.get_running_loop().time() + self.connect_timeout
        pause = _CONNECT_PAUSE
        while True:
            try:
                sock.connect(self.socket_path)
                return sock
            except BlockingIOError:
                left = deadline - asyncio.get_running_loop().time()
                if left <= 0:
                    sock.close()
                    raise ConnectFailed(
                        f"{self.socket_path}: the executor's listen queue stayed full for"
                        f" {self.connect_timeout} s (it is overloaded or hung); nothing was"
                        " sent: try again later"
                    ) from None
                await asyncio.sleep(min(pause, left))
                pause = min(pause * 2, _CONNECT_PAUSE_MAX)
            except OSError as exc:
                sock.close()
                raise ConnectFailed(f"cannot connect to {self.socket_path}: {exc}") from None

    async def _exchange(self, sock: socket.socket, frame: bytes) -> bytes:
        """Send one frame, read one reply frame, both within `read_timeout`.

        Raw socket calls rather than asyncio streams, for one reason: a server that
        refuses before reading (busy, wrong peer) closes while we may still be
        writing. The kernel still delivers its refusal, queued before the close, to
        `recv`; a stream reader would report only the reset and lose it.
        """
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.read_timeout):
                with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                    await loop.sock_sendall(sock, frame)
                return await _read_one_frame(loop, sock)
        except TimeoutError:
            raise Timeout(f"no reply within {self.read_timeout} s") from None
        except FrameError as exc:
            if exc.code == "frame_too_large":
                raise ReplyTooLarge(exc.message) from None
            raise ReplyTruncated(exc.message) from None
        except ConnectionError as exc:
            raise ReplyTruncated(f"the server closed the connection: {exc}") from None

    @staticmethod
    def _trust(frame: bytes, action: str, request_id: str, rows: int) -> AnyReply:
        try:
            version, reply_id = read_envelope(frame)
        except ProtocolError as exc:
            raise ReplyInvalid(exc) from None
        if version != PROTOCOL_VERSION or isinstance(version, bool):
            raise ReplyMismatch(f"reply has protocol version {version!r}, not 1")
        if reply_id == ZERO_ID and reply_id != request_id:
            _raise_refusal(frame)
        if reply_id != request_id:
            raise ReplyMismatch(f"reply is for request {reply_id!r}, not {request_id}")
        try:
            return decode_reply(frame, action, rows=rows or None)
        except ProtocolError as exc:
            raise ReplyInvalid(exc) from None


async def _read_one_frame(loop: asyncio.AbstractEventLoop, sock: socket.socket) -> bytes:
    """One reply frame, received straight into the decoder's buffers.

    The header is checked before any payload byte is read, then the payload lands in
    one buffer of its declared length: a 1.4 MB collect reply is neither gathered
    from 64 KiB pieces nor copied once more.
    """
    decoder = FrameDecoder(REPLY_MAX)
    payload = None
    while payload is None:
        count = await loop.sock_recv_into(sock, decoder.want())
        if not count:
            if decoder.idle:
                raise ReplyTruncated("the server closed the connection without a reply")
            decoder.eof()  # raises: the server closed inside the frame
        payload = decoder.received(count)
    if _more_is_waiting(sock):
        raise ReplyInvalid(
            ProtocolError(ErrorCode.BAD_FRAME, "the server sent more than one reply frame")
        )
    # msgspec decodes any buffer in place; the reply decoders are annotated for bytes only
    return cast(bytes, payload)


def _more_is_waiting(sock: socket.socket) -> bool:
    """Whether bytes past the reply frame have already arrived (never waits for any)."""
    try:
        return bool(sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT))
    except (BlockingIOError, ConnectionError):
        return False


def _raise_refusal(frame: bytes) -> NoReturn:
    """Turn a zero-ID error reply into Refused; anything else there is a mismatch."""
    try:
        reply = msgspec.json.decode(frame, type=ErrorReply)
    except (msgspec.ValidationError, msgspec.DecodeError):
        raise ReplyMismatch("reply carries the zero request ID but is not a refusal") from None
    raise Refused(reply.error.code, reply.error.message)


__all__ = [
    "Client",
    "ClientError",
    "ConnectFailed",
    "PeerCheck",
    "PeerCredentials",
    "PeerNotRoot",
    "Refused",
    "ReplyInvalid",
    "ReplyMismatch",
    "ReplyTooLarge",
    "ReplyTruncated",
    "RequestInvalid",
    "Timeout",
    "peer_credentials",
    "require_root_peer",
]
