"""The host's own stable codes: refusals and failure reasons that never go on the wire.

`ErrorCode` (ficc-protocol) holds every code a reply may carry; `HostCode` holds the
rest: why the daemon or one of its commands refuses to start or run, and the reasons a
prepare, start or cleanup failed that an operator reads in the log, in `status` or in
an attempt's record. A code is a protocol `Name` and never changes meaning; the two
sets are disjoint. Every code the host raises is a member of one of them, never a
string literal (a test walks the source), so a misspelt code is a type error, not a
new code. docs/configuration.md ("Refusal codes") and docs/operations.md say what an
operator does about each.
"""

from __future__ import annotations

import enum

__all__ = ["HostCode"]


class HostCode(enum.StrEnum):
    """A code of the host's own, never sent as a reply's `error.code`."""

    # startup and command refusals: the daemon, `status`, `provision-slot`, `run` or
    # `smoke-test` stops before serving (or, `run`, before it reserves anything)
    ACCOUNT_MISSING = "account_missing"
    CONFIG_CONFLICT = "config_conflict"
    CONFIG_INVALID = "config_invalid"
    CONFIG_MISSING = "config_missing"
    CONFIG_UNREADABLE = "config_unreadable"
    CONFIG_UNSAFE_FILE = "config_unsafe_file"
    HOST_PATH_UNSAFE = "host_path_unsafe"
    HOST_PATH_MISSING = "host_path_missing"
    CLOCK_UNAVAILABLE = "clock_unavailable"
    SOCKET_IN_USE = "socket_in_use"
    SOCKET_UNSAFE = "socket_unsafe"
    LEDGER_BUSY = "ledger_busy"
    LEDGER_CORRUPT = "ledger_corrupt"
    LEDGER_EXISTS = "ledger_exists"
    LEDGER_INSTALLATION_MISMATCH = "ledger_installation_mismatch"
    LEDGER_MISSING = "ledger_missing"
    LEDGER_SCHEMA = "ledger_schema"
    SLOT_REMOVED = "slot_removed"
    LEDGER_UNSAFE = "ledger_unsafe"
    UNSUPPORTED_FILESYSTEM = "unsupported_filesystem"
    INVALID_INSTALLATION_ID = "invalid_installation_id"
    PROVIDER_ALREADY_IMPORTED = "provider_already_imported"
    PROVIDER_AMBIGUOUS = "provider_ambiguous"
    PROVIDER_API_VERSION = "provider_api_version"
    PROVIDER_CONFIGURE_FAILED = "provider_configure_failed"
    PROVIDER_DIGEST_MISMATCH = "provider_digest_mismatch"
    PROVIDER_EDITABLE = "provider_editable"
    PROVIDER_IMPORT_FAILED = "provider_import_failed"
    PROVIDER_INVALID = "provider_invalid"
    PROVIDER_MISSING = "provider_missing"
    PROVIDER_TAMPERED = "provider_tampered"
    PROVIDER_UNSAFE = "provider_unsafe"
    PROVIDER_UNSUPPORTED = "provider_unsupported"
    STATUS_CURSOR = "status_cursor"
    SLOT_ACCOUNT = "slot_account"
    PROVISION_FAILED = "provision_failed"
    RUN_ATTEMPT_EXISTS = "run_attempt_exists"
    RUN_INPUT_MISMATCH = "run_input_mismatch"
    RUN_INPUT_NOT_GIVEN = "run_input_not_given"
    RUN_INPUT_UNDECLARED = "run_input_undeclared"
    RUN_INPUT_UNREADABLE = "run_input_unreadable"
    RUN_NO_CAPACITY = "run_no_capacity"
    RUN_NO_DAEMON = "run_no_daemon"
    RUN_NO_FREE_SLOT = "run_no_free_slot"
    RUN_NO_IMAGE = "run_no_image"
    RUN_OFFER_CLOSED = "run_offer_closed"
    RUN_OUTPUT_DIR = "run_output_dir"
    RUN_PLAN_INCOMPLETE = "run_plan_incomplete"
    RUN_PLAN_INVALID = "run_plan_invalid"
    RUN_PLAN_MISMATCH = "run_plan_mismatch"
    RUN_PROVIDER_UNAVAILABLE = "run_provider_unavailable"
    RUN_RESUME = "run_resume"
    RUN_SLOT_CLASS = "run_slot_class"
    RUN_USAGE = "run_usage"

    # prepare, start and cleanup failures: recorded as an attempt's reason or as a
    # retried cleanup, never sent as a reply's code
    BARRIER_EXITED = "barrier_exited"
    GATE_DEVICE = "gate_device"
    GATE_CAPABILITIES = "gate_capabilities"
    GATE_CGROUP = "gate_cgroup"
    GATE_EXE = "gate_exe"
    GATE_GID = "gate_gid"
    GATE_LIMITS = "gate_limits"
    GATE_MOUNT = "gate_mount"
    GATE_NAMESPACE = "gate_namespace"
    GATE_NO_NEW_PRIVS = "gate_no_new_privs"
    GATE_RLIMIT = "gate_rlimit"
    GATE_SECCOMP = "gate_seccomp"
    GATE_UID = "gate_uid"
    GATE_EVIDENCE = "gate_evidence"
    GATE_FD = "gate_fd"
    GATE_PROCESS_CHANGED = "gate_process_changed"
    RELEASE_MARKER_FAILED = "release_marker_failed"
    PREPARE_RESULT_MISSING = "prepare_result_missing"
    START_TIMEOUT = "start_timeout"
    STORAGE_UNVERIFIED = "storage_unverified"
    SLOT_FILESYSTEM = "slot_filesystem"
    SLOT_IDENTITY = "slot_identity"
    PROBE_FAILED = "probe_failed"
    PROVIDER_ERROR = "provider_error"
    PROVIDER_MALFORMED = "provider_malformed"
    PROVIDER_BATCH_SIZE = "provider_batch_size"
    PROVIDER_METHOD = "provider_method"
    SERVICE_CREATE = "service_create"
    SERVICE_DEVICES = "service_devices"
    SERVICE_DEVICES_UNENFORCEABLE = "service_devices_unenforceable"
    SERVICE_EXISTS = "service_exists"
    SERVICE_HANDLE = "service_handle"
    SERVICE_LIMITS = "service_limits"
    SERVICE_OUTPUT = "service_output"
    SERVICE_PAYLOAD = "service_payload"
    SERVICE_SPEC = "service_spec"
    SERVICE_START = "service_start"
    SERVICE_STOP_UNCONFIRMED = "service_stop_unconfirmed"
    SERVICE_SWAP_UNENFORCEABLE = "service_swap_unenforceable"
    SERVICE_UNSUPPORTED = "service_unsupported"

    # the provider conformance kit refuses to run (exit status 2)
    CONFORMANCE_USAGE = "conformance_usage"
    PLAN_UNSUPPORTED = "plan_unsupported"
    PROVIDER_UNKNOWN = "provider_unknown"
    SLOT_BUSY = "slot_busy"

    # refusals of the confined file helpers on paths only the host creates
    FILE_EXISTS = "file_exists"
    FILE_TOO_LARGE = "file_too_large"
    NOT_DIRECTORY = "not_directory"
