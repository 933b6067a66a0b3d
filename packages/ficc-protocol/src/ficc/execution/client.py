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

from ficc.execution.errors import ProtocolError
from ficc.execution.frames import REPLY_MAX, REQUEST_MAX, FrameError, read_frame, write_frame
from ficc.execution.protocol import INPUT_CHUNK_MAX_BYTES, PROTOCOL_VERSION, Request
from ficc.execution.protocol import validate_request as _validate
from ficc.execution.wire import AnyReply, decode_reply, read_envelope

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


class ReplyInvalid(ClientError):
    """The reply is not a valid version-1 reply to this request."""

    def __init__(self, error: ProtocolError) -> None:
        super().__init__(str(error))
        self.error = error


PeerCheck = Callable[[PeerCredentials], None]


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
        reader, writer = await self._connect()
        try:
            self.peer_check(peer_credentials(writer.get_extra_info("socket")))
            frame = await self._exchange(reader, writer, payload)
        finally:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()
        return self._trust(frame, request.action, request.id, request.row_count)

    async def _connect(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        try:
            async with asyncio.timeout(self.connect_timeout):
                return await asyncio.open_unix_connection(self.socket_path)
        except TimeoutError:
            raise Timeout(f"connect to {self.socket_path} timed out") from None
        except OSError as exc:
            raise ConnectFailed(f"cannot connect to {self.socket_path}: {exc}") from None

    async def _exchange(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, payload: bytes
    ) -> bytes:
        try:
            await write_frame(writer, payload, REQUEST_MAX, self.read_timeout)
            return await read_frame(reader, REPLY_MAX, self.read_timeout)
        except TimeoutError:
            raise Timeout(f"no reply within {self.read_timeout} s") from None
        except FrameError as exc:
            if exc.code == "frame_too_large":
                raise ReplyTooLarge(exc.message) from None
            raise ReplyTruncated(exc.message) from None
        except (EOFError, ConnectionError) as exc:
            raise ReplyTruncated(f"the server closed the connection: {exc}") from None

    @staticmethod
    def _trust(frame: bytes, action: str, request_id: str, rows: int) -> AnyReply:
        try:
            version, reply_id = read_envelope(frame)
        except ProtocolError as exc:
            raise ReplyInvalid(exc) from None
        if version != PROTOCOL_VERSION or isinstance(version, bool):
            raise ReplyMismatch(f"reply has protocol version {version!r}, not 1")
        if reply_id != request_id:
            raise ReplyMismatch(f"reply is for request {reply_id!r}, not {request_id}")
        try:
            return decode_reply(frame, action, rows=rows or None)
        except ProtocolError as exc:
            raise ReplyInvalid(exc) from None


__all__ = [
    "Client",
    "ClientError",
    "ConnectFailed",
    "PeerCheck",
    "PeerCredentials",
    "PeerNotRoot",
    "ReplyInvalid",
    "ReplyMismatch",
    "ReplyTooLarge",
    "ReplyTruncated",
    "RequestInvalid",
    "Timeout",
    "peer_credentials",
    "require_root_peer",
]
