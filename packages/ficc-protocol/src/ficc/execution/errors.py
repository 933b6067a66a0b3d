"""The stable error codes of protocol version 1, and the decoding error that carries one.

A code is a `Name` a controller can branch on; its meaning never changes (messages
may improve). Every code is documented in docs/protocol.md. The daemon sends these
in `{ok: false, error: {code, message}}`, either for the whole request or for a row.
"""

from __future__ import annotations

import enum


class ErrorCode(enum.StrEnum):
    """Every error code a version-1 executor may send."""

    # whole request: framing, decoding, authority
    BAD_FRAME = "bad_frame"
    FRAME_TOO_LARGE = "frame_too_large"
    INVALID_REQUEST = "invalid_request"
    UNSUPPORTED_VERSION = "unsupported_version"
    UNSUPPORTED_ACTION = "unsupported_action"
    NOT_AUTHORIZED = "not_authorized"
    BINDINGS_CHANGED = "bindings_changed"
    BUSY = "busy"
    INTERNAL = "internal"
    # per attempt row: fences and leases
    UNKNOWN_ATTEMPT = "unknown_attempt"
    FENCE_MISMATCH = "fence_mismatch"
    GENERATION_CONFLICT = "generation_conflict"
    PLAN_INVALID = "plan_invalid"
    LEASE_EXPIRED = "lease_expired"
    LEASE_SEQUENCE = "lease_sequence"
    LEASE_TOO_LONG = "lease_too_long"
    LEASE_REAPER_UNAVAILABLE = "lease_reaper_unavailable"
    # admission and offer
    ADMISSION_REJECTED = "admission_rejected"
    OFFER_CLOSED = "offer_closed"
    OFFER_REVISION = "offer_revision"
    OFFER_EXCEEDS_CEILING = "offer_exceeds_ceiling"
    OFFER_CHANGED = "offer_changed"
    SLOT_CAPACITY = "slot_capacity"
    NODE_MISMATCH = "node_mismatch"
    PROVIDER_UNAVAILABLE = "provider_unavailable"
    LIMITS_BELOW_MINIMUM = "limits_below_minimum"
    LEDGER_FULL = "ledger_full"
    UNKNOWN_NOT_ACKNOWLEDGED = "unknown_not_acknowledged"
    # lifecycle
    RUNTIME_PREPARING = "runtime_preparing"
    NOT_READY = "not_ready"
    INVALID_STATE = "invalid_state"
    NOT_TERMINAL = "not_terminal"
    CLEANUP_UNCONFIRMED = "cleanup_unconfirmed"
    PROVIDER_FAILED = "provider_failed"
    PROVIDER_TIMEOUT = "provider_timeout"
    RECONCILE_REFUSED = "reconcile_refused"
    SLOT_UNKNOWN = "slot_unknown"
    SERVICE_NOT_EMPTY = "service_not_empty"
    # streamed inputs
    INPUTS_PREPARING = "inputs_preparing"
    INPUT_BUSY = "input_busy"
    INPUT_UNKNOWN = "input_unknown"
    INPUT_OFFSET_CHANGED = "input_offset_changed"
    INPUT_DIGEST_MISMATCH = "input_digest_mismatch"
    INPUT_SIZE_MISMATCH = "input_size_mismatch"
    INPUT_COMPLETE = "input_complete"
    INPUT_TOO_LARGE = "input_too_large"
    STORAGE_FAILED = "storage_failed"
    INPUT_FAILED = "input_failed"
    INPUT_NOT_DECLARED = "input_not_declared"
    INPUT_CHANGED = "input_changed"
    INPUTS_INCOMPLETE = "inputs_incomplete"
    SLOT_FULL = "slot_full"
    INPUT_STORAGE_FAILED = "input_storage_failed"
    ATTEMPT_NOT_STAGED = "attempt_not_staged"
    # a staged file was tampered with (refusals of the host's confined file access)
    UNSAFE_PATH = "unsafe_path"
    NOT_FOUND = "not_found"
    NOT_REGULAR_FILE = "not_regular_file"
    HARD_LINK_REFUSED = "hard_link_refused"
    WRONG_OWNER = "wrong_owner"
    IO_ERROR = "io_error"
    # release and cleanup of the attempt's files
    UNEXPECTED_ENTRY = "unexpected_entry"
    STAGING_CLEANUP_FAILED = "staging_cleanup_failed"
    LAYOUT_UNSAFE = "layout_unsafe"
    LAYOUT_CLEANUP_FAILED = "layout_cleanup_failed"
    # collect
    OBJECT_UNKNOWN = "object_unknown"
    OBJECT_UNAVAILABLE = "object_unavailable"
    OBJECT_CHANGED = "object_changed"
    # raised by clients about a reply (never sent by an executor)
    INVALID_REPLY = "invalid_reply"


class ProtocolError(Exception):
    """A message that is not a valid version-1 message.

    Deliberately not a ValueError: raised from a model's `__post_init__` it passes
    through msgspec unchanged, keeping its precise code and path.

    `code` is the ErrorCode to send back, `path` the JSON path of the offending value
    (`$` for the whole document), and `request_id` the request's ID when it could be
    read, so the refusal can echo it.
    """

    def __init__(
        self, code: ErrorCode, message: str, path: str = "$", request_id: str | None = None
    ) -> None:
        super().__init__(f"{code}: {message} (at {path})")
        self.code = code
        self.message = message
        self.path = path
        self.request_id = request_id

    def at(self, prefix: str) -> ProtocolError:
        """The same error with its path below `prefix` (for nested decoding)."""
        path = prefix + self.path[1:] if self.path.startswith("$") else prefix
        return ProtocolError(self.code, self.message, path, self.request_id)


__all__ = ["ErrorCode", "ProtocolError"]
