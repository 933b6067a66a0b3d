"""Deprecated: the provider contract is `ficc.execution.provider` (ficc-provider-sdk).

This path keeps working, with a DeprecationWarning, for the 0.1 releases of
ficc-executor-host and is gone in 0.2. Every name here is the same object as in
`ficc.execution.provider`, so a provider that still imports it talks to the same
contract as the host.
"""

from __future__ import annotations

import warnings

from ficc.execution.provider import *  # noqa: F403 - the whole contract, re-exported
from ficc.execution.provider import __all__  # noqa: F401 - the same public surface

warnings.warn(
    "ficc.execution.host.sdk is deprecated and goes away in ficc-executor-host 0.2: "
    "install ficc-provider-sdk and import ficc.execution.provider instead",
    DeprecationWarning,
    stacklevel=2,
)
