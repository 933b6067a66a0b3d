"""What the request handlers ask of the runner (`RunnerPort`; the runner's pipeline
implements it) and the shape of a handler."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Protocol

from ficc.execution.host.context.parts import HostContext
from ficc.execution.host.core.errors import HostError
from ficc.execution.host.ledger import store as ledgerlib
from ficc.execution.protocol import (
    Sender,
)
from ficc.execution.wire import (
    AnyReply,
)


class RunnerPort(Protocol):
    """What the handlers ask of the runner (pipeline.Runner implements it)."""

    def admitted(self, attempt_ids: Sequence[str]) -> None: ...
    def inputs_complete(self, attempt_id: str) -> None: ...
    def start_requested(self, attempt_ids: Sequence[str]) -> None: ...
    def stop_requested(self, attempt_ids: Sequence[str]) -> None: ...
    def settled(self, attempt_ids: Sequence[str]) -> None: ...
    async def release_batch(self, attempt_ids: Sequence[str]) -> list[HostError | None]: ...
    async def leases_renewed(
        self, records: Sequence[ledgerlib.AttemptRecord]
    ) -> frozenset[str]: ...
    async def usage_now(
        self, records: Sequence[ledgerlib.AttemptRecord]
    ) -> dict[str, ledgerlib.ResourceUsage]: ...
    def details(self, attempt_ids: Sequence[str]) -> dict[str, str]: ...


Handler = Callable[[HostContext, RunnerPort, Sender, Any], Awaitable[AnyReply]]
