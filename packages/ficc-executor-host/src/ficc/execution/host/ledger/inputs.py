"""Streamed input writes: the committed offset of each input file and the end of its
stream.
"""

from __future__ import annotations

import msgspec

from ficc.execution.errors import ErrorCode
from ficc.execution.host.core import leases, lifecycle
from ficc.execution.host.core.errors import HostError
from ficc.execution.host.core.leases import Clock, Now
from ficc.execution.host.core.records import (
    InputRecord,
    StreamState,
    lease_is_current,
)
from ficc.execution.host.ledger import schema as ledger_schema
from ficc.execution.host.ledger.transactions import identity_blob, spending_reserve
from ficc.execution.host.ledger.transitions import Transitions
from ficc.execution.host.linux import fsutil
from ficc.execution.protocol import Fence


class InputWrites(Transitions):
    """The offsets of streamed inputs."""

    @spending_reserve
    def commit_input_offset(
        self,
        fence: Fence,
        object_id: str,
        expected_offset: int,
        new_offset: int,
        identity: fsutil.FileIdentity | None = None,
        *,
        when: Now | Clock | None = None,
    ) -> InputRecord:
        """Advance an object's durable offset after its bytes are synced (compare-and-set).

        The object is complete exactly when the offset reaches its declared size;
        completeness is derived, never claimed. `identity` is the sealed file's, given
        with the final chunk. With `when` (every client write), the lease must be
        current at `when` read inside this transaction (`lease_expired`).
        """
        with self._write() as ordinal:
            current = self._staging_input(fence, object_id, expected_offset, when)
            if not expected_offset <= new_offset <= current.bytes:
                raise HostError(
                    ErrorCode.INPUT_SIZE_MISMATCH,
                    f"offset {new_offset} is outside {expected_offset}..{current.bytes}",
                )
            complete = new_offset == current.bytes
            kept = identity if complete else None
            self._db.execute(
                "UPDATE input_objects SET offset = ?, complete = ?, identity = ?"
                " WHERE attempt_id = ? AND object_id = ?",
                (new_offset, complete, identity_blob(kept), fence.attempt_id, object_id),
            )
            self._db.execute(
                "UPDATE attempts SET updated = ? WHERE attempt_id = ?", (ordinal, fence.attempt_id)
            )
            return msgspec.structs.replace(
                current, offset=new_offset, complete=complete, identity=kept
            )

    @spending_reserve
    def commit_stream(
        self,
        fence: Fence,
        state: StreamState,
        expected_offset: int,
        *,
        when: Now | Clock | None = None,
    ) -> InputRecord:
        """Commit what `Stager.write` reports (pass this as its `commit`).

        A failed object is recorded as failed and, in the same transaction, the attempt
        fails (`input_digest_mismatch` or `storage_failed`): it can never start, and it
        follows the normal cleanup and release path. `when`: as for
        `commit_input_offset` (a failure is recorded whatever the lease).
        """
        if state.failed is None:
            return self.commit_input_offset(
                fence, state.id, expected_offset, state.offset, state.identity, when=when
            )
        reason = (
            ErrorCode.INPUT_DIGEST_MISMATCH
            if state.failed == ErrorCode.INPUT_DIGEST_MISMATCH
            else ErrorCode.STORAGE_FAILED
        )
        with self._write() as ordinal:
            current = self._staging_input(fence, state.id, expected_offset)
            self._db.execute(
                "UPDATE input_objects SET failed = ?, complete = 0"
                " WHERE attempt_id = ? AND object_id = ?",
                (state.failed, fence.attempt_id, state.id),
            )
            records = self._records([fence.attempt_id])
            result = self._apply_one(
                fence, lifecycle.PrepareFailed(reason=reason), ordinal, records
            )
            if isinstance(result, HostError):
                raise result
            return msgspec.structs.replace(current, failed=state.failed, complete=False)

    def _staging_input(
        self,
        fence: Fence,
        object_id: str,
        expected_offset: int,
        when: Now | Clock | None = None,
    ) -> InputRecord:
        """The object, if the attempt is still staging (with a lease current at `when`,
        when given) and the offset is still expected."""
        record = self._fenced(fence)
        if record.status.state != "prepared" or record.status.ready or record.status.preparing:
            raise HostError(
                ErrorCode.INVALID_STATE,
                f"inputs are written only while staging; the attempt is {record.status.state}",
            )
        if when is not None and not lease_is_current(record.lease, leases.reading(when)):
            raise HostError(
                ErrorCode.LEASE_EXPIRED,
                "the lease ran out before this chunk was committed; inputs are closed:"
                " release the attempt when it is terminal",
            )
        current = self._input(fence.attempt_id, object_id)
        if current.failed is not None:
            raise HostError(ErrorCode.INPUT_FAILED, f"the object failed earlier ({current.failed})")
        if current.complete:
            raise HostError(ErrorCode.INPUT_COMPLETE, "the object is complete and read-only")
        if current.offset != expected_offset:
            raise HostError(
                ErrorCode.INPUT_OFFSET_CHANGED,
                f"the durable offset is {current.offset}, not {expected_offset};"
                " read input_status and continue there",
            )
        return current

    def _input(self, attempt_id: str, object_id: str) -> InputRecord:
        row = self._db.execute(
            "SELECT * FROM input_objects WHERE attempt_id = ? AND object_id = ?",
            (attempt_id, object_id),
        ).fetchone()
        if row is None:
            raise HostError(ErrorCode.INPUT_UNKNOWN, "not a declared streamed input of this plan")
        return ledger_schema.input_record(row)
