"""The administrator's configuration: frozen msgspec Structs that refuse unknown keys.

The daemon runs as root and trusts this configuration completely (it pins providers and
names the accounts that run other people's work), so it is read with care and checked
in parts, each testable on its own:
- `load.parse_config(data, suffix)` is pure: bytes in, `Config` out, or a `HostError`;
  `load.load_config(path)` reads the file (`trusted`) and parses it;
- `rules.check_rules(config)`: the rules across fields;
- `host.check_host(config)`: the directories the configuration names on this machine.

Every refusal is a `HostError` whose message starts with the key path (`slots[2].uid`)
and says what to change. Codes: `config_missing`, `config_unreadable`,
`config_unsafe_file`, `config_invalid`, `config_conflict`, `host_path_missing`,
`host_path_unsafe`.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
import msgspec.inspect

from ficc.execution.host.core.records import UUID_PATTERN
from ficc.execution.host.ledger import space as ledger_space
from ficc.execution.plan import Count, Digest, Identity, Name, Positive
from ficc.execution.wire import Control

MAX_LEASE_SECONDS = 86_400

ABSOLUTE_PATH = r"\A/[^\x00-\x1f\x7f]*\Z"
AbsolutePath = Annotated[str, msgspec.Meta(pattern=ABSOLUTE_PATH, max_length=4095)]
AccountId = Annotated[int, msgspec.Meta(ge=0, le=2**32 - 2)]
LedgerBytes = Annotated[int, msgspec.Meta(ge=ledger_space.MIN_LEDGER_MAX_BYTES, le=2**50)]
FreeBytes = Annotated[int, msgspec.Meta(ge=0, le=2**62)]


class Slot(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One finite unit of work capacity: an account and a filesystem of its own."""

    id: Name
    slot_class: Name = msgspec.field(name="class")
    generation: Positive
    path: AbsolutePath
    uid: AccountId
    gid: AccountId
    storage_bytes: Positive
    storage_inodes: Positive
    filesystem_uuid: Annotated[str, msgspec.Meta(pattern=UUID_PATTERN)]
    """The UUID of the slot's own filesystem (`blkid`, or `ficc-executor provision-slot`
    prints it): binds the slot to that filesystem, so nothing else is ever written to."""


class Allowance(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Resource counts plus the projects and runtimes admission may accept."""

    cpu_millis: Count
    memory_bytes: Count
    swap_bytes: Count
    processes: Count
    slots: Count
    devices: tuple[Name, ...]
    projects: tuple[Identity, ...]
    runtimes: tuple[Name, ...]


class Offer(Allowance, frozen=True, forbid_unknown_fields=True):
    """What the host offers when it first starts; a local owner may change it later."""

    control: Control


class Provider(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A pinned provider: entry-point name, digest of its installed files, its settings."""

    id: Name
    package_digest: Digest
    configuration: dict[str, Any] = msgspec.field(default_factory=dict)


class Config(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The whole administrator configuration, validated."""

    installation_id: Identity
    deployment_id: Identity
    node_id: Identity
    mode: Literal["managed", "voluntary"]
    transport_uid: AccountId
    local_owner_uids: Annotated[tuple[AccountId, ...], msgspec.Meta(max_length=64)]
    maximum_lease_seconds: Annotated[int, msgspec.Meta(ge=1, le=MAX_LEASE_SECONDS)]
    state_dir: AbsolutePath
    socket_dir: AbsolutePath
    supervisor: Literal["systemd", "cgroupfs", "auto"]
    slots: Annotated[tuple[Slot, ...], msgspec.Meta(min_length=1, max_length=1024)]
    ceiling: Allowance
    initial_offer: Offer
    providers: Annotated[tuple[Provider, ...], msgspec.Meta(min_length=1, max_length=64)]
    ledger_max_bytes: LedgerBytes = ledger_space.DEFAULT_LEDGER_MAX_BYTES
    """The ledger's hard size limit; admission stops an eighth below it."""
    state_dir_min_free_bytes: FreeBytes = ledger_space.DEFAULT_MIN_FREE_BYTES
    """Free space admission keeps on `state_dir`'s filesystem."""

    def space_bounds(self) -> ledger_space.SpaceBounds:
        return ledger_space.SpaceBounds(self.ledger_max_bytes, self.state_dir_min_free_bytes)

    provider_timeout_seconds: Annotated[int, msgspec.Meta(ge=1, le=3600)] = 300
    """How long one provider batch call may take before its rows are uncertain."""

    slot_check_seconds: Annotated[int, msgspec.Meta(ge=1, le=60)] = 30
    """How often every slot's health is checked: a broken slot is out of the offer until
    a check passes again (an administrator's `check_slots` checks at once)."""

    metrics_textfile: AbsolutePath | None = None


# --- loading ---------------------------------------------------------------------------


# --- cross-field rules (pure) ----------------------------------------------------------


# --- file safety (I/O) -----------------------------------------------------------------


# --- the host's directories (I/O) ------------------------------------------------------
