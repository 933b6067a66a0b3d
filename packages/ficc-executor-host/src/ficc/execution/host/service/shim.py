"""The start gate's shim: the program both backends start first, and the order it awaits.

A service's first process is this shim, run by the slot account's Python as
`python -I -S -c SOURCE ...` (no environment, no site, no user directory). It reports
that it is up, blocks until the host has checked and confined it, reads the order
(the provider's argv and environment) and execs it. The backends differ only in the
channel: the cgroupfs backend uses two inherited pipes and lets the shim set its own
rlimits (`PIPE_SOURCE`); under systemd the shim connects to a Unix socket of the
host, which also hands over the stdio descriptors (`SOCKET_SOURCE`).

Why the order is NUL-separated fields rather than JSON: the shim runs on the start
path of every attempt, and `import json` (which pulls in `re`) doubles the time
Python needs to come up. The shims import nothing but `os`, `sys` and one builtin
module (`resource`, or `_socket` rather than `socket`, which pulls in `enum` and
`selectors`). The format needs no escaping because no field can contain NUL: the
kernel's execve(2) takes NUL-terminated strings, so `encode_order` refuses one.

    COUNT NUL ARG... NUL-terminated, then NAME=VALUE... NUL-terminated

A shim that reads an incomplete or malformed order (the host died while sending, or
a bug) exits 125 without running anything.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

from ficc.execution.host.core.codes import HostCode
from ficc.execution.host.core.errors import HostError

__all__ = ["ORDER_LIMIT", "PIPE_SOURCE", "SOCKET_SOURCE", "encode_order"]

ORDER_LIMIT = 16 << 20
"""The largest order (argv and environment) a shim reads, in bytes."""


def encode_order(argv: Sequence[str], environment: Mapping[str, str]) -> bytes:
    """The order's bytes; refuses what execve(2) could not carry unchanged."""
    fields = [str(len(argv)), *argv]
    for name, value in environment.items():
        if not name or "=" in name:
            raise HostError(HostCode.SERVICE_SPEC, f"environment name {name!r} cannot be passed")
        fields.append(f"{name}={value}")
    try:
        encoded = [os.fsencode(field) for field in fields]
    except UnicodeEncodeError as error:
        raise HostError(
            HostCode.SERVICE_SPEC, f"argv or environment is not encodable: {error}"
        ) from None
    if not argv or any(b"\0" in field for field in encoded):
        raise HostError(
            HostCode.SERVICE_SPEC, "argv must be non-empty and no field may contain NUL"
        )
    data = b"".join(field + b"\0" for field in encoded)
    if len(data) > ORDER_LIMIT:
        raise HostError(HostCode.SERVICE_SPEC, "argv and environment exceed 16 MiB; shorten them")
    return data


# `decode(data) -> (argv, env)`: the inverse of `encode_order`, in the shims' source.
# `bytes(1)` is NUL, written without a backslash: the sources hold no escape sequence
# for systemd's command-line handling (or anything else) to interpret.
DECODE_SOURCE = """\
def decode(data):
    fields = data.split(bytes(1))
    count = int(fields[0])
    if fields[-1] or not 0 < count <= len(fields) - 2:
        raise ValueError("malformed order")
    env = dict(field.split(b"=", 1) for field in fields[count + 1 : -1])
    return fields[1 : count + 1], env
"""

# argv: gate fd, ready fd, nofile. The ready pipe says "R" once the rlimits are set,
# then stays open close-on-exec: EOF after the order means the exec succeeded,
# "E<errno>" that it failed.
PIPE_SOURCE = """\
import os, resource, sys
DECODE
gate, ready, nofile = (int(a) for a in sys.argv[1:4])
try:
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))
    os.write(ready, b"R")
    os.set_inheritable(ready, False)
    parts, size = [], 0
    while chunk := os.read(gate, 65536):
        size += len(chunk)
        if size > ORDER_LIMIT:
            os._exit(125)
        parts.append(chunk)
    os.close(gate)
    argv, env = decode(b"".join(parts))
    try:
        os.execve(argv[0], argv, env)
    except OSError as error:
        os.write(ready, b"E" + str(error.errno).encode())
except BaseException:
    pass
os._exit(125)
""".replace("DECODE", DECODE_SOURCE).replace("ORDER_LIMIT", str(ORDER_LIMIT))

# argv: socket path. systemd expands `$NAME` in ExecStart arguments, so the source
# must contain no dollar sign (checked by a test) and no percent sign (specifiers, in
# case a systemd version expands them). The first message carries exactly three
# descriptors (SCM_RIGHTS): the new stdin, stdout and stderr.
SOCKET_SOURCE = """\
import os, _socket, sys
DECODE
FDS = 3
try:
    link = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
    link.connect(sys.argv[1])
    link.sendall(b"R")
    data, ancillary, flags, _ = link.recvmsg(65536, _socket.CMSG_LEN(FDS * 4))
    fds = []
    for level, kind, raw in ancillary:
        if (level, kind) == (_socket.SOL_SOCKET, _socket.SCM_RIGHTS):
            ends = range(4, len(raw) + 1, 4)
            fds += [int.from_bytes(raw[end - 4 : end], sys.byteorder) for end in ends]
    if len(fds) != FDS or flags & _socket.MSG_CTRUNC:
        os._exit(125)
    parts, size = [data], len(data)
    while chunk := link.recv(65536):
        size += len(chunk)
        if size > ORDER_LIMIT:
            os._exit(125)
        parts.append(chunk)
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
    for fd in fds:
        os.close(fd)
    argv, env = decode(b"".join(parts))
    try:
        os.execve(argv[0], argv, env)
    except OSError as error:
        link.sendall(b"E" + str(error.errno).encode())
except BaseException:
    pass
os._exit(125)
""".replace("DECODE", DECODE_SOURCE).replace("ORDER_LIMIT", str(ORDER_LIMIT))
