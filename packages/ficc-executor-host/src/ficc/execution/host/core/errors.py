"""The one refusal type of the daemon.

Every refusal carries a stable `code` (a protocol `Name`, documented in
docs/protocol.md or docs/operations.md) that a controller or operator can act on,
and a message that says what is wrong and what to do about it. Codes never change
meaning; messages may improve.
"""

from __future__ import annotations


class HostError(Exception):
    """A refusal with a stable error code and an operator-facing message."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
