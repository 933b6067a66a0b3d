"""The administrator's configuration document for the demo host (pure).

One slot (class `demo`) whose job runs as the slot account with rootless Podman, one
transport account for the controller, no local owner, an offer that is `active` from
the start, and the Podman provider pinned by the digest `provider-digest` printed for
the wheel installed in the run's prefix, configured with the registry-free test image.
The keys are described in docs/configuration.md; the provider's own `configuration`
in docs/providers.md.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from typing import Any

from demo.layout import PROVIDER, SLOT_CLASS, SLOT_ID, RunLayout

MIB = 1024 * 1024
GIB = 1024 * MIB

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


def new_id() -> str:
    return secrets.token_hex(16)


@dataclass(frozen=True)
class Identities:
    """The host's identities; fresh for every run (every run starts a new ledger)."""

    installation_id: str = field(default_factory=new_id)
    deployment_id: str = field(default_factory=new_id)
    node_id: str = field(default_factory=new_id)


@dataclass(frozen=True)
class Account:
    name: str
    uid: int
    gid: int


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
    allowance = {**OFFER, "devices": [], "projects": [PROJECT], "runtimes": [PROVIDER]}
    return {
        "installation_id": ids.installation_id,
        "deployment_id": ids.deployment_id,
        "node_id": ids.node_id,
        "mode": "managed",
        "transport_uid": transport.uid,
        "local_owner_uids": [],
        "maximum_lease_seconds": LEASE_CEILING_SECONDS,
        "state_dir": str(layout.state_dir),
        "socket_dir": str(layout.socket_dir),
        "supervisor": "cgroupfs",
        "slots": [
            {
                "id": SLOT_ID,
                "class": SLOT_CLASS,
                "generation": 1,
                "path": str(layout.slot_dir),
                "uid": slot.uid,
                "gid": slot.gid,
                "storage_bytes": SLOT_STORAGE_BYTES,
                "storage_inodes": SLOT_STORAGE_INODES,
                "filesystem_uuid": filesystem_uuid,
            }
        ],
        "ceiling": allowance,
        "initial_offer": {"control": "active", **allowance},
        "providers": [
            {
                "id": PROVIDER,
                "package_digest": provider_digest,
                "configuration": provider_configuration(image),
            }
        ],
    }
