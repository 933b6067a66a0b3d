"""The administrator's configuration document for the demo host (pure).

One slot (class `demo`) whose job runs as the slot account with rootless Podman, one
transport account for the controller, no local owner, an offer that is `active` from
the start, and the Podman provider pinned by the digest `provider-digest` printed for
the wheel installed in the run's prefix, configured with the registry-free test image.
The document is the daemon's own `Config` built by the test kit and encoded; the keys
are described in docs/configuration.md, the provider's own `configuration` in
docs/providers.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from demo.layout import PROVIDER, SLOT_CLASS, SLOT_ID, RunLayout
from ficc_testkit import configs
from ficc_testkit.accounts import Account
from ficc_testkit.plans import new_id
from ficc_testkit.slots import SlotFilesystem
from ficc_testkit.units import GIB

PROJECT = "de" * 16
"""The demo's project: the only project the offer admits."""

# What the host offers: the whole (small) machine, one slot at a time.
OFFER = {
    "cpu_millis": 1000,
    "memory_bytes": 1 * GIB,
    "swap_bytes": 0,
    "processes": 512,
    "slots": 1,
}
SLOT_STORAGE_BYTES = 1 * GIB
"""The slot's own filesystem (an image file allocated in full); it also holds the slot
account's Podman storage (the loaded image)."""
SLOT_STORAGE_INODES = 100_000
LEASE_CEILING_SECONDS = 600


@dataclass(frozen=True)
class Identities:
    """The host's identities; fresh for every run (every run starts a new ledger)."""

    installation_id: str = field(default_factory=new_id)
    deployment_id: str = field(default_factory=new_id)
    node_id: str = field(default_factory=new_id)


@dataclass(frozen=True)
class Image:
    """What tools/testimage/build.py printed: the values the provider pins."""

    archive: str
    archive_sha256: str
    image_id: str


def provider_configuration(image: Image) -> dict[str, Any]:
    """The Podman provider's `configuration`: the pinned image, defaults otherwise."""
    return {
        "images": [
            {
                "digest": image.image_id,
                "archive": image.archive,
                "archive_sha256": image.archive_sha256,
                "image_id": image.image_id,
            }
        ],
    }


def admin_config(
    layout: RunLayout,
    ids: Identities,
    *,
    transport: Account,
    slot: Account,
    provider_digest: str,
    image: Image,
    filesystem_uuid: str,
) -> dict[str, Any]:
    """The whole configuration document, as the daemon reads it (JSON)."""
    allowance = configs.allowance(**OFFER, projects=[PROJECT], runtimes=[PROVIDER])
    filesystem = SlotFilesystem(
        layout.slot_dir, layout.slot_image, filesystem_uuid, SLOT_STORAGE_BYTES
    )
    config = configs.host_config(
        layout.root,
        transport=transport,
        slots=[
            configs.slot(
                int(SLOT_ID.removeprefix("s")), filesystem, slot,
                slot_class=SLOT_CLASS, storage_inodes=SLOT_STORAGE_INODES,
            )
        ],
        resources=allowance,
        providers=[
            configs.provider(PROVIDER, provider_digest, provider_configuration(image))
        ],
        mode="managed",
        maximum_lease_seconds=LEASE_CEILING_SECONDS,
        installation_id=ids.installation_id,
        deployment_id=ids.deployment_id,
        node_id=ids.node_id,
    )  # fmt: skip
    return configs.encode_config(config)
