"""An attempt's usage as a reply shows it: the ledger's record once it ended, a live
reading while its payload runs.

The ledger records what an attempt used once, when it ends (`Ledger.apply` with the
settling event, or `Ledger.record_usage` before cleanup); from then on the reply's
`usage` is that record, `final: true`, whatever happens to the service. Before, a
started attempt's figures are read live from its service (`final: false`); an
attempt that never started has none. A settled attempt whose cleanup is confirmed is
final even with nothing recorded (a ledger written before usage was recorded, an
admission rejection): nothing will be recorded any more.
"""

from __future__ import annotations

import msgspec

from ficc.execution.host.core import lifecycle
from ficc.execution.host.core.records import AttemptRecord, RecordedUsage, ResourceUsage
from ficc.execution.wire import Usage


def as_wire(usage: ResourceUsage, *, final: bool) -> Usage:
    """The wire's `usage`: a figure the host could not read is absent, never zero."""
    figures = {k: v for k, v in msgspec.structs.asdict(usage).items() if v is not None}
    return Usage(final=final, **figures)


def is_final(record: AttemptRecord, recorded: RecordedUsage | None) -> bool:
    """Whether the record's usage will never change (see the module docstring)."""
    if recorded is not None and recorded.recorded:
        return True
    status = record.status
    settled = status.state in lifecycle.SETTLED or status.state == "released"
    return settled and status.cleanup_confirmed


def wire_usage(
    record: AttemptRecord, recorded: RecordedUsage | None, live: ResourceUsage | None
) -> Usage:
    """The `usage` of one attempt row from its recorded and its live usage."""
    if is_final(record, recorded):
        return as_wire(recorded.usage if recorded is not None else ResourceUsage(), final=True)
    return as_wire(live if live is not None else ResourceUsage(), final=False)


__all__ = ["as_wire", "is_final", "wire_usage"]
