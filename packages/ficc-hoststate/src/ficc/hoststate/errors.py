"""Every refusal of ficc.hoststate, each with a stable `code` an operator can search for.

Messages say what is wrong and what to do; the code never changes between releases,
so scripts and logs can match on it instead of on the wording.
"""

from __future__ import annotations


class HostStateError(Exception):
    """Base of every ficc.hoststate error."""

    code = "host_state_error"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def __str__(self) -> str:
        return f"[{self.code}] {self.message}"


class InvalidArgument(HostStateError, ValueError):
    """An ID, plan hash, revision or status that does not match its documented shape."""

    code = "invalid_argument"


class Unsafe(HostStateError):
    """The state directory or one of its files cannot be trusted: symlink, owner, mode."""

    code = "unsafe_store"


class Locked(HostStateError):
    """Another session (in this or another process) holds the host lock."""

    code = "locked"


class Unsupported(HostStateError):
    """This operating system has no supported lock and durability path."""

    code = "unsupported_platform"


class UnsupportedFilesystem(Unsupported):
    """The state directory is on a network or distributed filesystem (NFS, SMB, ...)."""

    code = "unsupported_filesystem"


class Conflict(HostStateError):
    """The operation ID is already registered with a different plan hash."""

    code = "conflict"


class Blocked(HostStateError):
    """Another operation is unresolved; it must reach a terminal status first."""

    code = "blocked"


class StaleRevision(HostStateError):
    """The caller's revision is not the stored one: someone advanced it meanwhile."""

    code = "stale_revision"


class InvalidTransition(HostStateError):
    """The requested status change is not in the allowed transition table."""

    code = "invalid_transition"


class NotFound(HostStateError, KeyError):
    """No operation with this ID is registered."""

    code = "not_found"

    def __str__(self) -> str:  # KeyError would otherwise print the repr of the message
        return HostStateError.__str__(self)


class Corrupt(HostStateError):
    """The stored state failed an integrity check and is not used."""

    code = "corrupt"


class HostMismatch(HostStateError):
    """The store belongs to another host ID."""

    code = "host_mismatch"


class CapacityExceeded(HostStateError):
    """Admitting this operation would take the snapshot over its size limit.

    It does not poison the session: reads and the active record's advances still work.
    """

    code = "capacity_exceeded"


class Poisoned(HostStateError):
    """A save failed part-way; the on-disk state is uncertain until reacquired."""

    code = "poisoned"


class Closed(HostStateError):
    """The session was closed (or belongs to the process it was forked from)."""

    code = "closed"
