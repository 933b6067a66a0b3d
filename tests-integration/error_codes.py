"""The inventory of every error code the executor host daemon can send, as data.

One entry per code a reply can carry: whole-request `ErrorReply` codes, batch-row
`ErrorRow` codes, and the precise causes an `admission_rejected` row names at the start
of its message. Each entry says how the code is produced through the real daemon (the
test in test_daemon_error_codes.py that asserts it), or where it is unit-tested and why
it cannot be produced through the socket. test_daemon_error_codes.py checks this table
against `ErrorCode`, against the code table of docs/protocol.md, and against every code
literal the host package raises, so a new code cannot ship unlisted.

Kinds:
- SOCKET: produced through the real daemon's socket; `test` asserts the exact code.
- DETAIL: never a row code by itself: an admission refusal is always sent as
  `admission_rejected` (a durable failed record), with this code as the first word of
  the message (`<code>: ...`); `test` asserts exactly that.
- UNIT: can be sent, but only under a condition the integration suite cannot make
  (a daemon bug, a provider hanging past the 300 s provider timeout); `unit` names the
  test that covers the code.
- NEVER: never sent by this executor (client-only, reserved for other executors, or
  shadowed by an earlier check that answers another code); `why` says which.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Kind = Literal["socket", "detail", "unit", "never"]
Scope = Literal["whole", "row", "detail", "-"]

HOST_TESTS = "packages/ficc-executor-host/tests"


@dataclass(frozen=True)
class Entry:
    code: str
    kind: Kind
    scope: Scope
    why: str
    """How the daemon produces it (SOCKET, DETAIL) or why the socket cannot show it."""
    test: str | None = None
    """The test function in test_daemon_error_codes.py (SOCKET and DETAIL)."""
    unit: str | None = None
    """Where the code is unit-tested (UNIT, and NEVER where it has a producer)."""


def _socket(code: str, scope: Scope, why: str) -> Entry:
    return Entry(code, "socket", scope, why, test=f"test_{code}")


def _detail(code: str, why: str) -> Entry:
    return Entry(code, "detail", "detail", why, test=f"test_admission_detail_{code}")


ENTRIES: tuple[Entry, ...] = (
    # --- whole request: framing, decoding, authority (daemon/server.py, ficc-protocol) -------
    _socket("bad_frame", "whole", "a frame whose payload is not JSON"),
    _socket("frame_too_large", "whole", "a header declaring 12 MiB + 1"),
    _socket("invalid_request", "whole", "a snapshot whose `after` is a number"),
    _socket("unsupported_version", "whole", "a request with version 2"),
    _socket("unsupported_action", "whole", "a request with an unknown action"),
    _socket("not_authorized", "whole", "the local owner sends `observe` on its socket"),
    _socket("bindings_changed", "whole", "prepare with another ledger ID"),
    _socket("busy", "whole", "48 idle connections held on admin.sock, then one more"),
    Entry(
        "internal",
        "unit",
        "whole",
        "only an exception in a handler (a daemon bug) or an oversized reply produces it",
        unit=f"{HOST_TESTS}/daemon/test_server.py::test_a_handler_exception_is_internal_and_the"
        "_server_keeps_serving",
    ),
    _socket("offer_revision", "whole", "set_offer with a stale expected_revision"),
    _socket("offer_exceeds_ceiling", "whole", "set_offer with cpu above the ceiling"),
    _socket("reconcile_refused", "whole", "reconcile_absent while an attempt holds a slot"),
    # --- rows: fences and leases ---------------------------------------------------
    _socket("unknown_attempt", "row", "observe of an attempt never prepared"),
    _socket("fence_mismatch", "row", "observe with another generation of a recorded attempt"),
    _socket("generation_conflict", "row", "reject_absent of a newer generation of an active job"),
    Entry(
        "plan_invalid",
        "never",
        "-",
        "this executor refuses host-rule violations (unknown slot class, provider, device)"
        " at admission with a durable `admission_rejected` record instead (docs/protocol.md)",
    ),
    _socket("lease_expired", "row", "start right after a renewal that ended the lease"),
    _socket("lease_sequence", "row", "renew with sequence 1 again and another expiry"),
    Entry(
        "lease_too_long",
        "never",
        "-",
        "this executor caps a long expiry at maximum_lease_seconds (core/leases.py) instead of"
        " refusing it",
        unit=f"{HOST_TESTS}/core/test_leases.py::test_renew_caps_the_deadline_at_the_maximum_lease",
    ),
    # --- admission and offer ---------------------------------------------------------
    _socket("admission_rejected", "row", "a plan whose project is not in the offer"),
    _socket("offer_closed", "row", "start of a ready attempt while the offer is paused"),
    _socket("offer_changed", "row", "start after the offer's memory dropped below the plan's"),
    _socket(
        "ledger_full",
        "whole",
        "prepare when state_dir_min_free_bytes is above the free space (test_daemon_ledger_full.py"
        " fills a real state_dir filesystem and the ledger's own bound)",
    ),
    Entry(
        "lease_reaper_unavailable",
        "unit",
        "whole",
        "a renewal of a started attempt whose deadline file cannot be written; needs a"
        " held attempt and the lease reaper, so it is produced in its own suite",
        unit="tests-integration/test_daemon_lease_reaper.py::test_a_renewal_the_reaper_cannot"
        "_get_is_refused_until_it_can",
    ),
    _detail("node_mismatch", "a plan addressed to another node of the deployment"),
    _detail("slot_capacity", "a plan of a slot class no slot has"),
    _detail("provider_unavailable", "a plan pinning another provider package digest"),
    _detail("limits_below_minimum", "a plan below the memory the test provider states it needs"),
    _detail("offer_revision", "a plan made for another offer revision"),
    _detail("offer_closed", "prepare while the offer is paused"),
    _detail("lease_expired", "prepare with a first lease already past"),
    _detail("generation_conflict", "prepare of a second generation while the first is active"),
    _detail("unknown_not_acknowledged", "a retry of a job with an unknown, unacknowledged attempt"),
    # --- lifecycle --------------------------------------------------------------------
    _socket("runtime_preparing", "row", "start while the provider's probe is held"),
    _socket("not_ready", "row", "start while a streamed input is not uploaded"),
    _socket("invalid_state", "row", "renew of a cancelled attempt"),
    _socket("not_terminal", "row", "release of a prepared attempt"),
    _socket("cleanup_unconfirmed", "row", "release while a process of the slot account lives"),
    _socket("provider_failed", "row", "release while every provider call fails"),
    Entry(
        "provider_timeout",
        "unit",
        "row",
        "a release whose provider call hangs past the 300 s provider timeout; too slow"
        " for this suite",
        unit=f"{HOST_TESTS}/runner/test_pipeline.py::test_a_hung_provider_call_leaves_its_rows_timed_out",
    ),
    Entry(
        "slot_unknown",
        "never",
        "-",
        "a daemon whose ledger holds an unreleased attempt on a slot the configuration no"
        " longer has refuses to start (`slot_removed`), so no request meets such a record",
        unit="tests-integration/test_daemon_error_codes.py::test_a_removed_slot_refuses_the_start",
    ),
    _socket("service_not_empty", "row", "release after a process joined the attempt's cgroup"),
    # --- streamed inputs --------------------------------------------------------------
    _socket("inputs_preparing", "row", "input_status right after admission (retried race)"),
    _socket("input_busy", "row", "a probe write while a large write is in flight (race)"),
    _socket("input_unknown", "row", "input_status of an object the plan does not declare"),
    _socket("input_offset_changed", "row", "a first write at offset 5"),
    _socket("input_digest_mismatch", "row", "an object whose bytes miss the declared digest"),
    _socket("input_size_mismatch", "row", "a chunk longer than the declared object"),
    _socket("input_complete", "row", "a write to a completed object"),
    Entry(
        "input_too_large",
        "never",
        "-",
        "streams that cannot fit the slot are refused at admission"
        " (`admission_rejected`, detail slot_capacity)",
    ),
    Entry(
        "storage_failed",
        "never",
        "-",
        "a record reason (an input or the attempt's layout failed on disk), never a row"
        " code: the write that failed answers the precise code (slot_full,"
        " input_storage_failed, io_error...)",
    ),
    _socket("input_failed", "row", "input_status of an object that failed its digest"),
    Entry(
        "input_not_declared",
        "never",
        "-",
        "the handler checks the ledger first and answers input_unknown; staging's own"
        " check is defence in depth",
        unit=f"{HOST_TESTS}/storage/test_staging.py::test_unknown_attempts_and_undeclared_objects"
        "_are_refused",
    ),
    _socket(
        "input_changed",
        "row",
        "a write after a restart, when the staged prefix was shortened; also the start row"
        " of a ready attempt whose staged input changed (test_podman_e2e.py::"
        "test_a_changed_staged_input_refuses_start)",
    ),
    Entry(
        "inputs_incomplete",
        "never",
        "-",
        "raised by Stager.capabilities, which the runner calls only once every stream is complete",
        unit=f"{HOST_TESTS}/storage/test_staging.py::test_several_streams_are_independent_and_all"
        "_must_complete",
    ),
    _socket("slot_full", "row", "an 8 MiB chunk into a slot on a 12 MiB tmpfs"),
    _socket("input_storage_failed", "row", "a write past the daemon's RLIMIT_FSIZE (EFBIG)"),
    Entry(
        "attempt_not_staged",
        "never",
        "-",
        "handlers._not_staged_yet answers inputs_preparing instead (the client retries)",
        unit=f"{HOST_TESTS}/storage/test_staging.py::test_unknown_attempts_and_undeclared_objects"
        "_are_refused",
    ),
    # --- the staged file, refused by fsutil.open_regular_at during input_write --------
    _socket("unsafe_path", "row", "the staged file replaced by a symlink"),
    _socket("not_found", "row", "the staged file deleted"),
    _socket("not_regular_file", "row", "the staged file replaced by a FIFO"),
    _socket("hard_link_refused", "row", "a second hard link to the staged file"),
    _socket("wrong_owner", "row", "the staged file chowned away from root"),
    _socket("io_error", "row", "the staged file made append-only (open O_RDWR: EPERM)"),
    # --- release and cleanup of the attempt's files -------------------------------------
    _socket("unexpected_entry", "row", "release with a foreign file in the attempt directory"),
    _socket("staging_cleanup_failed", "row", "release with an immutable staged file"),
    _socket("layout_unsafe", "row", "release with the attempt directory at mode 0700"),
    _socket("layout_cleanup_failed", "row", "release with an immutable log file"),
    # --- collect ----------------------------------------------------------------------
    _socket("object_unknown", "row", "collect of an output the plan does not declare"),
    _socket("object_unavailable", "row", "collect of a declared output that does not exist"),
    _socket("object_changed", "row", "collect of a never-run attempt's stdout at offset 5"),
    # --- client only ------------------------------------------------------------------
    Entry(
        "invalid_reply",
        "never",
        "-",
        "raised by clients about a reply (decode_reply), never sent by an executor",
    ),
)

# Codes the host package raises that never reach a reply: startup refusals (the daemon
# does not start), record reasons (observed in `reason`, never as an error code), and
# errors the pipeline turns into a reason. test_daemon_error_codes.py checks that every
# code literal of the host package is either here or in ENTRIES.
HOST_ONLY: dict[str, str] = {
    **dict.fromkeys(
        (
            "account_missing",
            "config_conflict",
            "config_invalid",
            "config_missing",
            "config_unreadable",
            "config_unsafe_file",
            "host_path_unsafe",
            "host_path_missing",
            "clock_unavailable",
            "socket_in_use",
            "socket_unsafe",
            "ledger_busy",
            "ledger_corrupt",
            "ledger_exists",
            "ledger_installation_mismatch",
            "ledger_missing",
            "ledger_schema",
            "slot_removed",
            "ledger_unsafe",
            "unsupported_filesystem",
            "invalid_installation_id",
            "provider_already_imported",
            "provider_ambiguous",
            "provider_api_version",
            "provider_configure_failed",
            "provider_digest_mismatch",
            "provider_editable",
            "provider_import_failed",
            "provider_invalid",
            "provider_missing",
            "provider_tampered",
            "provider_unsafe",
            "provider_unsupported",
            "status_cursor",
            "slot_account",
            "provision_failed",
            "run_attempt_exists",
            "run_input_mismatch",
            "run_input_not_given",
            "run_input_undeclared",
            "run_input_unreadable",
            "run_no_capacity",
            "run_no_daemon",
            "run_no_free_slot",
            "run_no_image",
            "run_offer_closed",
            "run_output_dir",
            "run_plan_incomplete",
            "run_plan_invalid",
            "run_plan_mismatch",
            "run_provider_unavailable",
            "run_resume",
            "run_slot_class",
            "run_usage",
        ),
        "startup or command refusal: the daemon (or `status`, `provision-slot`, `run`,"
        " `smoke-test`) stops before serving (`run`: before it reserves anything)",
    ),
    **dict.fromkeys(
        (
            "barrier_exited",
            "gate_device",
            "gate_capabilities",
            "gate_cgroup",
            "gate_exe",
            "gate_gid",
            "gate_limits",
            "gate_mount",
            "gate_namespace",
            "gate_no_new_privs",
            "gate_rlimit",
            "gate_seccomp",
            "gate_uid",
            "gate_evidence",
            "gate_fd",
            "gate_process_changed",
            "release_marker_failed",
            "prepare_result_missing",
            "start_timeout",
            "storage_unverified",
            "slot_filesystem",
            "slot_identity",
            "probe_failed",
            "provider_error",
            "provider_malformed",
            "provider_batch_size",
            "provider_method",
            "service_create",
            "service_devices",
            "service_devices_unenforceable",
            "service_exists",
            "service_handle",
            "service_limits",
            "service_output",
            "service_spec",
            "service_start",
            "service_stop_unconfirmed",
            "service_swap_unenforceable",
            "service_unsupported",
        ),
        "a prepare/start/cleanup failure: recorded as the attempt's reason (or a retried"
        " cleanup), never sent as an error code; release maps provider failures to"
        " provider_failed",
    ),
    **dict.fromkeys(
        ("conformance_usage", "plan_unsupported", "provider_unknown", "slot_busy"),
        "the provider conformance kit's command refuses to run (exit 2); no daemon involved",
    ),
    "service_payload": (
        "logged only (a warning): the gated payload could not be moved into its own payload"
        " cgroup; the start goes on and its payload figures are absent"
    ),
    **dict.fromkeys(
        ("file_exists", "file_too_large", "not_directory"),
        "fsutil refusals on paths only the host creates (layout and staging set-up, config"
        " reading): they fail the attempt or the start, or are turned into object_*",
    ),
}

BY_CODE: dict[str, list[Entry]] = {}
for _entry in ENTRIES:
    BY_CODE.setdefault(_entry.code, []).append(_entry)

SENT: frozenset[str] = frozenset(e.code for e in ENTRIES if e.kind != "never")
"""Every code a reply of this executor can carry as `error.code`, or as a detail."""

__all__ = ["BY_CODE", "ENTRIES", "HOST_ONLY", "SENT", "Entry"]
