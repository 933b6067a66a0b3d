"""ficc.hoststate: the durable registry of one host's operations.

    with acquire("/var/lib/ficc/hoststate", "host-1") as session:
        op, created = session.begin("op-1", "sha256:" + 64 * "0")
        op = session.advance(op.id, op.revision, Status.RUNNING)

See README.md for the guarantees and limits and docs/hoststate.md for recovery.
"""

from .errors import (
    Blocked,
    CapacityExceeded,
    Closed,
    Conflict,
    Corrupt,
    HostMismatch,
    HostStateError,
    InvalidArgument,
    InvalidTransition,
    Locked,
    NotFound,
    Poisoned,
    StaleRevision,
    Unsafe,
    Unsupported,
    UnsupportedFilesystem,
)
from .model import Operation, Status
from .session import Session, acquire

__all__ = [
    "Blocked",
    "CapacityExceeded",
    "Closed",
    "Conflict",
    "Corrupt",
    "HostMismatch",
    "HostStateError",
    "InvalidArgument",
    "InvalidTransition",
    "Locked",
    "NotFound",
    "Operation",
    "Poisoned",
    "Session",
    "StaleRevision",
    "Status",
    "Unsafe",
    "Unsupported",
    "UnsupportedFilesystem",
    "acquire",
]
