"""An attempt's usage as a reply shows it: the ledger's record once it ended, a live
reading while its payload runs.

The ledger records what an attempt used once, when it ends (`Ledger.apply` with the
settling event, or `Ledger.record_usage` before cleanup); from then on the reply's
`usage` is that record, `final: true`, whatever happens to the service. Before, a
started attempt's figures are read live from its service (`final: false`); an
attempt that never started has none. A settled attempt whose cleanup is confirmed is
final even with nothing recorded (a ledger written before usage was recorded, an
admission rejection): nothing will be recorded any more.

The payload's own figures (`payload_` in the record, read from the payload's own
cgroup) are recorded and read with the others, and shown as `usage.payload` only to a
request that asked (`payload_usage: true`).
"""

from __future__ import annotations

import msgspec

from ficc.execution.host.core import lifecycle
from ficc.execution.host.core.records import AttemptRecord, RecordedUsage, ResourceUsage
from ficc.execution.wire import PayloadUsage, Usage

PAYLOAD_PREFIX = "payload_"
"""The prefix of the figures that are the payload's own (`Usage.payload` on the wire)."""


def as_wire(usage: ResourceUsage, *, final: bool, payload: bool = False) -> Usage:
    """The wire's `usage`: a figure the host could not read is absent, never zero. The
    payload's own figures go in its `payload` part, and only when asked (`payload`): a
    client that asked only for `usage` refuses a field it does not know."""
    figures = {k: v for k, v in msgspec.structs.asdict(usage).items() if v is not None}
    service = {k: v for k, v in figures.items() if not k.startswith(PAYLOAD_PREFIX)}
    if not payload:
        return Usage(final=final, **service)
    own = {k.removeprefix(PAYLOAD_PREFIX): v for k, v in figures.items() if k not in service}
    return Usage(final=final, **service, payload=PayloadUsage(**own))


def is_final(record: AttemptRecord, recorded: RecordedUsage | None) -> bool:
    """Whether the record's usage will never change (see the module docstring)."""
    if recorded is not None and recorded.recorded:
        return True
    status = record.status
    settled = status.state in lifecycle.SETTLED or status.state == "released"
    return settled and status.cleanup_confirmed


def wire_usage(
    record: AttemptRecord,
    recorded: RecordedUsage | None,
    live: ResourceUsage | None,
    *,
    payload: bool = False,
) -> Usage:
    """The `usage` of one attempt row from its recorded and its live usage (with its
    `payload` part when asked)."""
    if is_final(record, recorded):
        used = recorded.usage if recorded is not None else ResourceUsage()
        return as_wire(used, final=True, payload=payload)
    return as_wire(live if live is not None else ResourceUsage(), final=False, payload=payload)


__all__ = ["PAYLOAD_PREFIX", "as_wire", "is_final", "wire_usage"]
