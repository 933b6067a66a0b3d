"""The daemon's listening sockets and the kernel-checked identity of each peer.

`socket_dir` holds one socket per role: `transport.sock` (the transport
UID), `admin.sock` (root) and `owner-<uid>.sock` for each local owner. Each socket file
is mode 0600 and owned by the one UID allowed to connect, so the file system refuses
other users first; the daemon then checks the peer's SO_PEERCRED UID against the same
UID before it reads a frame, so a loosened file mode still lets nobody else in.

Creating a socket never follows a link: the directory is opened through
`config.open_trusted_directory` (root-owned at every level, mode 0711 so peers can reach
their socket but not list the directory), the socket is bound through that directory's
fd, and an old entry is removed only if it is a socket owned by root or by the
socket's own UID that nothing is listening on any more.

Refusal codes: `not_authorized`, `socket_unsafe`, `socket_in_use`, and those of
`open_trusted_directory` (`host_path_missing`, `host_path_unsafe`).
"""

from __future__ import annotations

import errno
import os
import posixpath
import socket
import stat
import struct
from typing import NamedTuple, Protocol

import msgspec

from ficc.execution.errors import ErrorCode
from ficc.execution.host.config.host import SOCKET_DIR_MODE
from ficc.execution.host.config.model import Config
from ficc.execution.host.config.trusted import open_trusted_directory
from ficc.execution.host.core.authority import SocketKind
from ficc.execution.host.core.codes import HostCode
from ficc.execution.host.core.errors import HostError

SOCKET_MODE = 0o600
_UCRED = struct.Struct("iII")  # struct ucred: pid_t pid; uid_t uid; gid_t gid


class Endpoint(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One listening socket: its kind, file path, and the only UID that may use it."""

    kind: SocketKind
    path: str
    peer_uid: int
    key: str  # the configuration key that names `peer_uid`, for messages

    @property
    def name(self) -> str:
        return posixpath.basename(self.path)


class PeerCredentials(NamedTuple):
    pid: int
    uid: int
    gid: int


class _Socket(Protocol):
    """A connected socket: `socket.socket` or asyncio's `TransportSocket`."""

    @property
    def family(self) -> int: ...

    def getsockopt(self, level: int, optname: int, buflen: int, /) -> bytes: ...


def socket_paths(config: Config) -> tuple[Endpoint, ...]:
    """Every socket the daemon listens on for this configuration, in a stable order."""
    join = posixpath.join
    endpoints = [
        Endpoint(
            SocketKind.TRANSPORT,
            join(config.socket_dir, "transport.sock"),
            config.transport_uid,
            "transport_uid",
        ),
        Endpoint(SocketKind.ADMINISTRATOR, join(config.socket_dir, "admin.sock"), 0, "root"),
    ]
    endpoints += [
        Endpoint(
            SocketKind.LOCAL_OWNER,
            join(config.socket_dir, f"owner-{uid}.sock"),
            uid,
            f"local_owner_uids[{i}]",
        )
        for i, uid in enumerate(config.local_owner_uids)
    ]
    return tuple(endpoints)


def peer_credentials(sock: _Socket) -> PeerCredentials:
    """The (pid, uid, gid) the kernel recorded for the peer when it connected."""
    if sock.family != socket.AF_UNIX:
        raise HostError(ErrorCode.NOT_AUTHORIZED, "peer credentials exist only on Unix sockets")
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
    return PeerCredentials(*_UCRED.unpack(raw))


def check_peer(endpoint: Endpoint, uid: int) -> None:
    """Refuse a peer whose UID is not the one this socket belongs to."""
    if uid != endpoint.peer_uid:
        raise HostError(
            ErrorCode.NOT_AUTHORIZED,
            f"peer UID {uid} may not use {endpoint.name}; only UID {endpoint.peer_uid} "
            f"({endpoint.key}) may connect to it",
        )


def listen(endpoint: Endpoint, backlog: int = 64) -> socket.socket:
    """Create, own and chmod the endpoint's socket file, then start listening.

    `listen()` is called only after the file has its final owner and mode, so no peer
    can connect through a looser file in between.
    """
    directory, name = posixpath.split(endpoint.path)
    dir_fd = open_trusted_directory(
        directory,
        "socket_dir",
        HostCode.HOST_PATH_UNSAFE,
        SOCKET_DIR_MODE,
    )
    try:
        _remove_stale(dir_fd, name, endpoint)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            sock.bind(_through(dir_fd, name))
            os.chown(name, endpoint.peer_uid, 0, dir_fd=dir_fd, follow_symlinks=False)
            os.chmod(name, SOCKET_MODE, dir_fd=dir_fd)
            _check_socket_file(os.stat(name, dir_fd=dir_fd, follow_symlinks=False), endpoint)
            sock.listen(backlog)
        except BaseException:
            sock.close()
            raise
        return sock
    finally:
        os.close(dir_fd)


def _through(dir_fd: int, name: str) -> str:
    """A short path to `name` that resolves through the already-checked directory fd."""
    return f"/proc/self/fd/{dir_fd}/{name}"


def _remove_stale(dir_fd: int, name: str, endpoint: Endpoint) -> None:
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode) or st.st_uid not in (0, endpoint.peer_uid):
        raise HostError(
            HostCode.SOCKET_UNSAFE,
            f"{endpoint.path} exists and is not a socket this daemon made; "
            "inspect it and remove it by hand",
        )
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    try:
        probe.setblocking(False)
        result = probe.connect_ex(_through(dir_fd, name))
    finally:
        probe.close()
    if result != errno.ECONNREFUSED:
        raise HostError(
            HostCode.SOCKET_IN_USE,
            f"something is listening on {endpoint.path}; stop the other daemon first",
        )
    os.unlink(name, dir_fd=dir_fd)


def _check_socket_file(st: os.stat_result, endpoint: Endpoint) -> None:
    mode = stat.S_IMODE(st.st_mode)
    if not stat.S_ISSOCK(st.st_mode) or st.st_uid != endpoint.peer_uid or mode != SOCKET_MODE:
        raise HostError(
            HostCode.SOCKET_UNSAFE,
            f"{endpoint.path} did not take owner {endpoint.peer_uid} and mode 0600 "
            f"(it has owner {st.st_uid}, mode {mode:04o}); check the file system of socket_dir",
        )
