"""The offer limits the configuration sets: the administrator's ceiling and the initial
offer, as the protocol's `OfferLimits`.

Admission checks every plan against the ceiling, and the daemon opens with the initial
offer; both read them here, so the runner, the handlers and the daemon agree.
"""

from __future__ import annotations

from ficc.execution.host.config.model import Config
from ficc.execution.protocol import OfferLimits, Resources


def ceiling_limits(config: Config) -> OfferLimits:
    """The administrator's ceiling as offer limits (storage: the slots' total)."""
    ceiling = config.ceiling
    return OfferLimits(
        resources=Resources(
            attempts=ceiling.slots,
            cpu_millis=ceiling.cpu_millis,
            memory_bytes=ceiling.memory_bytes,
            swap_bytes=ceiling.swap_bytes,
            processes=ceiling.processes,
            storage_bytes=sum(s.storage_bytes for s in config.slots),
            storage_inodes=sum(s.storage_inodes for s in config.slots),
        ),
        projects=list(ceiling.projects),
        runtimes=list(ceiling.runtimes),
    )


def initial_limits(config: Config) -> OfferLimits:
    """The configured initial offer as offer limits."""
    offer = config.initial_offer
    ceiling = ceiling_limits(config)
    return OfferLimits(
        resources=Resources(
            attempts=offer.slots,
            cpu_millis=offer.cpu_millis,
            memory_bytes=offer.memory_bytes,
            swap_bytes=offer.swap_bytes,
            processes=offer.processes,
            storage_bytes=ceiling.resources.storage_bytes,
            storage_inodes=ceiling.resources.storage_inodes,
        ),
        projects=list(offer.projects),
        runtimes=list(offer.runtimes),
    )
