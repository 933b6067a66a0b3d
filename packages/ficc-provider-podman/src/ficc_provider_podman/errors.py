"""The provider's one refusal type: a stable lowercase code and an operator message."""

from __future__ import annotations

from ficc.execution.provider import Refused


class ProviderError(Refused):
    """A refusal of one row (or of the configuration), with a stable code.

    The driver turns it into the row `{"error": code, "message": message}` (the SDK's
    `Refusal`); codes are listed in docs/providers.md.
    """
