"""The provider's one refusal type: a stable lowercase code and an operator message."""

from __future__ import annotations


class ProviderError(Exception):
    """A refusal of one row (or of the configuration), with a stable code.

    The driver turns it into the row `{"error": code, "message": message}`; codes are
    listed in docs/providers.md.
    """

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
