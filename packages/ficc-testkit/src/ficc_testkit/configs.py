"""A test daemon's configuration, built as the daemon's own `Config` and encoded.

Every suite that starts a daemon describes it with the host's `Config` Struct, so a key
the daemon renames or adds is one change here, not one per hand-written dictionary.
`encode_config` writes only what differs from the defaults, so the document is what an
administrator would write (and what an earlier release, which refuses keys it does not
know, still reads). `Layout` is one daemon's root-owned tree and its 0600 file.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Self

import msgspec

from ficc.execution.host.config.model import Allowance, Config, Offer, Provider, Slot
from ficc_testkit.accounts import Account
from ficc_testkit.plans import new_id
from ficc_testkit.slots import SlotFilesystem, remove_slots, remove_tree

CONFIG_FILE = "executor-host.json"


def allowance(
    *,
    cpu_millis: int,
    memory_bytes: int,
    processes: int,
    slots: int,
    projects: Sequence[str],
    runtimes: Sequence[str],
    devices: Sequence[str] = (),
    swap_bytes: int = 0,
) -> Allowance:
    """A ceiling (and, with `offer`, the initial offer) of these resources."""
    return Allowance(
        cpu_millis=cpu_millis,
        memory_bytes=memory_bytes,
        swap_bytes=swap_bytes,
        processes=processes,
        slots=slots,
        devices=tuple(devices),
        projects=tuple(projects),
        runtimes=tuple(runtimes),
    )


def offer(resources: Allowance, control: str = "active") -> Offer:
    """The initial offer: `resources` under `control`."""
    fields = msgspec.structs.asdict(resources)
    return msgspec.convert({**fields, "control": control}, Offer)


def slot(
    index: int,
    filesystem: SlotFilesystem,
    account: Account,
    *,
    slot_class: str,
    storage_inodes: int,
    storage_bytes: int | None = None,
) -> Slot:
    """Slot `s<index>` on `filesystem`, run as `account` (`storage_bytes`: the
    filesystem's size unless given)."""
    return Slot(
        id=f"s{index}",
        slot_class=slot_class,
        generation=1,
        path=str(filesystem.path),
        uid=account.uid,
        gid=account.gid,
        storage_bytes=filesystem.size if storage_bytes is None else storage_bytes,
        storage_inodes=storage_inodes,
        filesystem_uuid=filesystem.filesystem_uuid,
    )


def provider(
    provider_id: str, digest: str, configuration: Mapping[str, Any] | None = None
) -> Provider:
    """A provider pinned by `digest`, with its own `configuration`."""
    return Provider(id=provider_id, package_digest=digest, configuration=dict(configuration or {}))


def host_config(
    base: Path,
    *,
    transport: Account,
    slots: Sequence[Slot],
    resources: Allowance,
    providers: Sequence[Provider],
    owners: Sequence[Account] = (),
    mode: str = "voluntary",
    supervisor: str = "cgroupfs",
    maximum_lease_seconds: int = 600,
    **overrides: Any,
) -> Config:
    """The configuration of a daemon whose state and sockets live under `base`, with
    fresh identities, the ceiling and the active offer `resources`; `overrides` replace
    any other key (by its Config field name)."""
    config = Config(
        installation_id=new_id(),
        deployment_id=new_id(),
        node_id=new_id(),
        mode=mode,  # type: ignore[arg-type]
        transport_uid=transport.uid,
        local_owner_uids=tuple(owner.uid for owner in owners),
        maximum_lease_seconds=maximum_lease_seconds,
        state_dir=str(base / "state"),
        socket_dir=str(base / "sockets"),
        supervisor=supervisor,  # type: ignore[arg-type]
        slots=tuple(slots),
        ceiling=resources,
        initial_offer=offer(resources),
        providers=tuple(providers),
    )
    return msgspec.structs.replace(config, **overrides)


def encode_config(config: Config) -> dict[str, Any]:
    """The JSON document of `config`, without the top-level keys left at their default."""
    document: dict[str, Any] = msgspec.to_builtins(config)
    for info in msgspec.structs.fields(Config):
        if info.default is not msgspec.NODEFAULT and getattr(config, info.name) == info.default:
            del document[info.encode_name]
    return document


def write_document(path: Path, document: Mapping[str, Any], mode: int = 0o600) -> None:
    """Write `document` as JSON to a new file `path` with `mode` (the daemon wants 0600)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    with os.fdopen(fd, "w") as out:
        json.dump(document, out, indent=2)


@dataclass
class Layout:
    """One daemon's directory tree, configuration and slot filesystems, all root-owned."""

    base: Path
    config: Config
    slot_filesystems: list[SlotFilesystem] = field(default_factory=list)

    @classmethod
    def write(
        cls, base: Path, config: Config, slot_filesystems: Sequence[SlotFilesystem] = ()
    ) -> Self:
        """Make the state (0700) and socket (0711) directories and write the 0600
        configuration file; the slot filesystems are removed if that fails."""
        try:
            Path(config.state_dir).mkdir(mode=0o700, exist_ok=True)
            Path(config.socket_dir).mkdir(exist_ok=True)
            os.chmod(config.socket_dir, 0o711)  # noqa: S103 - peers traverse it to their socket
            write_document(base / CONFIG_FILE, encode_config(config))
        except BaseException:
            remove_slots(slot_filesystems)
            raise
        return cls(base, config, list(slot_filesystems))

    @property
    def config_path(self) -> Path:
        """The configuration file (root 0600)."""
        return self.base / CONFIG_FILE

    @property
    def document(self) -> dict[str, Any]:
        """The configuration as written (a fresh copy: change it, then `rewrite`)."""
        return encode_config(self.config)

    @property
    def state_dir(self) -> Path:
        """The daemon's ledger directory."""
        return Path(self.config.state_dir)

    @property
    def socket_dir(self) -> Path:
        """Where the daemon's sockets are."""
        return Path(self.config.socket_dir)

    @property
    def slot_paths(self) -> list[Path]:
        """Every slot's mount point, in slot order."""
        return [Path(s.path) for s in self.config.slots]

    @property
    def installation_id(self) -> str:
        """The configured installation identity."""
        return self.config.installation_id

    def rewrite(self, document: Mapping[str, Any], mode: int = 0o600) -> None:
        """Replace the configuration file with `document` as it is (it may be one the
        daemon refuses); `config` keeps describing what the daemon was started with."""
        self.config_path.unlink()
        write_document(self.config_path, document, mode)

    def socket(self, role: str) -> str:
        """The path of the `admin`, `transport` or (first local) `owner` socket."""
        if role == "owner":
            return str(self.socket_dir / f"owner-{self.config.local_owner_uids[0]}.sock")
        return str(self.socket_dir / {"transport": "transport.sock", "admin": "admin.sock"}[role])

    def destroy(self) -> None:
        """Unmount the slot filesystems and remove the tree (teardown; never raises)."""
        remove_slots(self.slot_filesystems)
        remove_tree(self.base)
