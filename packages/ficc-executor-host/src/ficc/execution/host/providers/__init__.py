"""Provider pinning, loading and batch calls (docs/providers.md).

- `digest`: find the one distribution registering an entry-point name and compute the
  digest an administrator pins, without importing it.
- `loader`: verify against the pin, then import through a finder that only resolves
  verified files, check API_VERSION and the driver's seven methods.
- `driver`: call a driver method with a batch of 1..64 contexts, one result per row,
  failures confined to their rows; group compatible rows.
"""

from ficc.execution.host.providers.digest import (
    GROUP,
    DistributionDigest,
    ProviderDistribution,
    compute_digest,
    find_distribution,
)
from ficc.execution.host.providers.driver import (
    MAX_BATCH,
    METHODS,
    Group,
    RowResult,
    call,
    call_grouped,
    group,
)
from ficc.execution.host.providers.loader import LoadedProvider, load_provider

__all__ = [
    "GROUP",
    "MAX_BATCH",
    "METHODS",
    "DistributionDigest",
    "Group",
    "LoadedProvider",
    "ProviderDistribution",
    "RowResult",
    "call",
    "call_grouped",
    "compute_digest",
    "find_distribution",
    "group",
    "load_provider",
]
