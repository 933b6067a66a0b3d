"""The start gate's socket, as the systemd backend holds it: made where only root can
create it and only the slot account can connect, then the peer's credentials, the order
(argv, environment and stdio) sent to the start shim, and its report.

The daemon's own umask (UMask=0077 in its unit) would make the socket and its
directories 0700: every mode is set explicitly.

The start gate holds as in the cgroupfs backend: the unit's program is a tiny shim
that runs as the slot account and connects to a Unix socket the host listens on,
in a root-owned directory. The host identifies the shim by SO_PEERCRED, checks it is
the unit's main process, with the slot account's credentials and rlimits, inside
the unit's cgroup in every hierarchy (then moves it into the `supervisor` leaf, so
the unit's node itself holds no process and cgroup v2 can delegate controllers to
`payload`), checks every control, and only then sends the argv, the environment
and the three stdio descriptors (SCM_RIGHTS) the host opened itself: /dev/null and
the two output files (systemd itself opens no device for the unit: its closed policy
may forbid even /dev/null). The shim execs; its end of the socket is close-on-exec,
so EOF tells the host the exec worked and `E<errno>` that it failed. If the host
dies first, the shim reads an incomplete order and exits 125 without running
anything. The argv and environment never appear in unit properties or in the
shim's /proc cmdline.
"""

from __future__ import annotations

import contextlib
import os
import socket
import stat

from ficc.execution.host.core.codes import HostCode
from ficc.execution.host.core.errors import HostError
from ficc.execution.host.service.interface import ServiceSpec


def listen(runtime_dir: str, gate_dir: str, spec: ServiceSpec, timeout: float) -> socket.socket:
    """The gate socket: only root can create it (root-owned 0711 directories), only
    the slot account (and root) can connect to it. Modes are set explicitly: the
    daemon's own umask (UMask=0077 in its unit) would make them 0700."""
    for directory in (os.path.dirname(runtime_dir), runtime_dir):
        with contextlib.suppress(FileExistsError):
            os.mkdir(directory, 0o711)
            os.chmod(directory, 0o711)  # noqa: S103  (traverse only: the shim reaches its socket)
        info = os.lstat(directory)
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != 0 or info.st_mode & 0o066:
            raise HostError(
                HostCode.SERVICE_CREATE,
                f"{directory} must be a root-owned directory that only root can list "
                "or write (0711); fix or remove it",
            )
    os.mkdir(gate_dir, 0o711)
    os.chmod(gate_dir, 0o711)  # noqa: S103  (traverse only, as above)
    empty = os.open(os.path.join(gate_dir, "empty"), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    os.fchmod(empty, 0o644)
    os.close(empty)
    path = os.path.join(gate_dir, "gate")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        listener.bind(path)
        os.chown(path, spec.uid, spec.gid, follow_symlinks=False)
        os.chmod(path, 0o600, follow_symlinks=False)
        listener.listen(1)
        listener.settimeout(timeout)
    except BaseException:
        listener.close()
        raise
    return listener


def peer(link: socket.socket) -> tuple[int, int, int]:
    raw = link.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12)
    pid, uid, gid = (int.from_bytes(raw[i : i + 4], "little") for i in (0, 4, 8))
    return pid, uid, gid


def send_order(link: socket.socket, data: bytes, stdio: list[int]) -> None:
    first = socket.send_fds(link, [data[:65536]], stdio)
    link.sendall(data[first:])


def recv_report(link: socket.socket) -> bytes:
    """EOF (b"") once the shim exec'd; `E<errno>` if exec failed."""
    try:
        return link.recv(64)
    except TimeoutError as error:
        raise HostError(HostCode.SERVICE_START, "the program was not executed in time") from error
