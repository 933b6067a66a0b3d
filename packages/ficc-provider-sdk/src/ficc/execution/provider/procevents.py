"""The kernel's process events (the proc connector), as bytes in and events out.

Sans-I/O: `decode` turns one datagram read from a `NETLINK_CONNECTOR` socket bound to
the `CN_IDX_PROC` group into `ProcEvent`s, `subscription` makes the datagram that
starts (or stops) the kernel's announcements, and `Sequences` tells from the
connector's per-CPU sequence numbers whether an event was lost. The socket itself is
taskindex.py's.

Layout (linux/netlink.h, linux/connector.h, linux/cn_proc.h): a 16-byte `nlmsghdr`,
a 20-byte `cn_msg` (id.idx, id.val, seq, ack, len, flags), then `struct proc_event`:
`what`, `cpu`, an 8-byte timestamp, and the event's data: fork (parent pid and tgid,
child pid and tgid), exec and the ID changes (pid, tgid, then the real and effective
IDs), exit (pid, tgid, exit code, signal, parent pid and tgid). `pid` is a task's
(thread's) ID, `tgid` its process's.
"""

from __future__ import annotations

import enum
import struct
from typing import NamedTuple

__all__ = [
    "CN_IDX_PROC",
    "NETLINK_CONNECTOR",
    "Kind",
    "ProcEvent",
    "Sequences",
    "decode",
    "subscription",
]

NETLINK_CONNECTOR = 11
CN_IDX_PROC = 1
CN_VAL_PROC = 1
PROC_CN_MCAST_LISTEN = 1
PROC_CN_MCAST_IGNORE = 2
NLMSG_DONE = 3
NLMSG_ERROR = 2
NLMSG_NOOP = 1

_NLMSGHDR = struct.Struct("=IHHII")
_CN_MSG = struct.Struct("=IIIIHH")
_EVENT_HEAD = struct.Struct("=IIQ")
_FOUR = struct.Struct("=iiii")
_TWO = struct.Struct("=ii")
_HEADERS = _NLMSGHDR.size + _CN_MSG.size


class Kind(enum.IntEnum):
    """The events the task index reacts to (cn_proc.h's `what`)."""

    NONE = 0  # the kernel's answer to a subscription
    FORK = 0x1
    EXEC = 0x2
    UID = 0x4
    EXIT = 0x80000000


class ProcEvent(NamedTuple):
    """One event: its kind (a `Kind`, or another number of cn_proc.h), the CPU and that
    CPU's sequence number, and the task (`pid`) and process (`tgid`) it is about (for a
    fork: the child; 0 for the kinds the index ignores)."""

    kind: int
    cpu: int
    seq: int
    pid: int
    tgid: int


def subscription(*, listen: bool = True, port: int = 0) -> bytes:
    """The datagram that asks the kernel to start (or stop) announcing events."""
    op = struct.pack("=I", PROC_CN_MCAST_LISTEN if listen else PROC_CN_MCAST_IGNORE)
    cn = _CN_MSG.pack(CN_IDX_PROC, CN_VAL_PROC, 0, 0, len(op), 0) + op
    return _NLMSGHDR.pack(_NLMSGHDR.size + len(cn), NLMSG_DONE, 0, 0, port) + cn


def decode(datagram: bytes) -> list[ProcEvent]:
    """Every process event in one datagram, in order. Events the index has no use for
    (comm, sid, ptrace, gid, coredump) come with their own `kind` number and no task:
    their sequence numbers still count. A truncated or foreign message raises
    `ValueError`: the caller treats it as a lost event."""
    events: list[ProcEvent] = []
    offset = 0
    while offset + _NLMSGHDR.size <= len(datagram):
        length, kind, _flags, _seq, _port = _NLMSGHDR.unpack_from(datagram, offset)
        if length < _NLMSGHDR.size or offset + length > len(datagram):
            raise ValueError(f"a netlink message of {length} bytes at {offset} is truncated")
        if kind == NLMSG_ERROR:
            raise ValueError("the kernel answered the subscription with an error")
        if kind != NLMSG_NOOP:
            event = _event(datagram[offset + _NLMSGHDR.size : offset + length])
            if event is not None:
                events.append(event)
        offset += (length + 3) & ~3
    return events


def _event(message: bytes) -> ProcEvent | None:
    if len(message) < _CN_MSG.size:
        raise ValueError("a connector message is shorter than its header")
    idx, val, seq, _ack, size, _flags = _CN_MSG.unpack_from(message)
    if (idx, val) != (CN_IDX_PROC, CN_VAL_PROC):
        return None
    data = message[_CN_MSG.size : _CN_MSG.size + size]
    if len(data) < _EVENT_HEAD.size:
        raise ValueError("a process event is shorter than its header")
    what, cpu, _timestamp = _EVENT_HEAD.unpack_from(data)
    body = _EVENT_HEAD.size
    if what == Kind.FORK:
        _ppid, _ptgid, pid, tgid = _FOUR.unpack_from(data, body)
    elif what in (Kind.EXEC, Kind.UID, Kind.EXIT):
        pid, tgid = _TWO.unpack_from(data, body)
    else:
        pid = tgid = 0
    return ProcEvent(what, cpu, seq, pid, tgid)


class Sequences:
    """The last sequence number seen per CPU. The kernel numbers every process event
    per CPU, so a number that is not the next one means events were lost."""

    def __init__(self) -> None:
        self._last: dict[int, int] = {}

    def gap(self, event: ProcEvent) -> bool:
        """Record `event`'s number; True when one or more before it were missed."""
        if event.kind == Kind.NONE:
            return False  # the answer to a subscription is numbered apart
        last = self._last.get(event.cpu)
        self._last[event.cpu] = event.seq
        return last is not None and event.seq != (last + 1) & 0xFFFFFFFF

    def forget(self) -> None:
        """After a full walk the numbers start again from what comes next."""
        self._last.clear()
