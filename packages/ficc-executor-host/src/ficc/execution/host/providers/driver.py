"""Batch calls into a provider driver, where a bad reply costs only its own rows.

A driver method takes an ordered list of 1..64 context dicts and returns one dict per
context, in the same order. A row may instead be `{"error": CODE, "message": TEXT}`:
the provider refuses that row with its own stable code (a `Name`), and the daemon
records the refusal under that code. The daemon runs `call` in a worker thread (driver methods
are synchronous and may block). Whatever the provider does -- raise, exit, return the
wrong number of rows, return a non-dict row -- the result is one `RowResult` per
input context, so a failure is recorded against exactly the rows it concerns and
never escapes into the daemon.

Contexts are the provider SDK's frozen Structs (sdk.py) and go through untouched
(never serialized here, so prepare's `check` callable passes as it is). A mapping
row, as scripted tests pass, goes as a shallow copy, so a driver that edits it
does not change the caller's dict.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from ficc.execution.host.core.codes import HostCode
from ficc.execution.host.core.errors import HostError

_NAME = re.compile(r"\A[a-z][a-z0-9_.-]{0,79}\Z")

METHODS = ("probe", "prepare", "start", "observe", "stop", "collect", "release")
MAX_BATCH = 64
MAX_MESSAGE = 512

T = TypeVar("T")
K = TypeVar("K", bound=Hashable)


@dataclass(frozen=True)
class RowResult:
    """One row's outcome: the provider's reply dict, or a stable failure code."""

    reply: dict[str, Any] | None
    code: str | None = None
    message: str | None = None

    @property
    def ok(self) -> bool:
        return self.reply is not None

    @classmethod
    def failed(cls, code: str, message: str) -> RowResult:
        return cls(None, code, message[:MAX_MESSAGE])


def bounded(error: BaseException) -> str:
    """`Type: text`, cut to MAX_MESSAGE; a provider's __str__ may itself misbehave."""
    try:
        text = str(error)
    except Exception:
        text = "<unprintable>"
    return f"{type(error).__name__}: {text}"[:MAX_MESSAGE]


def call(driver: Any, method: str, contexts: Sequence[object]) -> list[RowResult]:
    """Call `driver.method` once with 1..64 contexts; exactly one result per context."""
    if method not in METHODS:
        raise HostError(HostCode.PROVIDER_METHOD, f"{method!r} is not a provider driver method")
    if not 1 <= len(contexts) <= MAX_BATCH:
        raise HostError(
            HostCode.PROVIDER_BATCH_SIZE, f"a batch has 1..{MAX_BATCH} rows, not {len(contexts)}"
        )
    count = len(contexts)
    try:
        rows = [dict(c) if isinstance(c, Mapping) else c for c in contexts]
        replies = getattr(driver, method)(rows)
    except (Exception, SystemExit) as error:
        return [RowResult.failed(HostCode.PROVIDER_ERROR, f"{method}: {bounded(error)}")] * count
    if not isinstance(replies, list) or len(replies) != count:
        got = f"{len(replies)} rows" if isinstance(replies, list) else type(replies).__name__
        message = f"{method} returned {got} for {count} contexts"
        return [RowResult.failed(HostCode.PROVIDER_MALFORMED, message)] * count
    return [_row(method, reply) for reply in replies]


def _row(method: str, reply: object) -> RowResult:
    if not isinstance(reply, dict) or not all(isinstance(key, str) for key in reply):
        return RowResult.failed(
            HostCode.PROVIDER_MALFORMED,
            f"{method} returned a {type(reply).__name__} row, not a dict",
        )
    if "error" in reply:
        return _refusal(method, reply)
    return RowResult(reply)


def _refusal(method: str, reply: dict[str, Any]) -> RowResult:
    """A provider's own refusal of one row; a code that is not a Name is not trusted."""
    code, message = reply.get("error"), reply.get("message")
    text = message if isinstance(message, str) else f"{method} refused the row"
    if isinstance(code, str) and _NAME.match(code):
        return RowResult.failed(code, text)
    return RowResult.failed(
        HostCode.PROVIDER_ERROR, f"{method} refused with a malformed code: {text}"
    )


@dataclass(frozen=True)
class Group(Generic[K]):
    """Rows (by input index, ascending) that can share one driver call."""

    key: K
    indices: tuple[int, ...]


def group(rows: Sequence[T], key: Callable[[T], K]) -> list[Group[K]]:
    """Group compatible rows (same key, e.g. (provider, method)) into batches of <= 64.

    Groups come out in order of their first row; inside a group rows keep input order.
    """
    pending: dict[K, list[int]] = {}
    for index, row in enumerate(rows):
        pending.setdefault(key(row), []).append(index)
    return [
        Group(k, tuple(indices[start : start + MAX_BATCH]))
        for k, indices in pending.items()
        for start in range(0, len(indices), MAX_BATCH)
    ]


def call_grouped(
    rows: Sequence[T],
    key: Callable[[T], K],
    invoke: Callable[[K, list[T]], list[RowResult]],
) -> list[RowResult]:
    """Run `invoke` once per group and put each result back at its row's input index."""
    results: list[RowResult | None] = [None] * len(rows)
    for batch in group(rows, key):
        outcome = invoke(batch.key, [rows[i] for i in batch.indices])
        if len(outcome) != len(batch.indices):
            raise HostError(HostCode.PROVIDER_BATCH_SIZE, "a grouped call lost or added rows")
        for index, result in zip(batch.indices, outcome, strict=True):
            results[index] = result
    return [r for r in results if r is not None]
