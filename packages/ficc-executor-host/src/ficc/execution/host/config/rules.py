"""The configuration's rules across fields (pure): accounts, slot identities, paths, the
offer within the ceiling, providers, and the JSON values it may hold."""

from __future__ import annotations

import itertools
import math
import posixpath

from ficc.execution.host.config.model import Allowance, Config
from ficc.execution.host.config.trusted import refuse
from ficc.execution.host.core.codes import HostCode

_MAX_JSON_DEPTH = 32


def check_rules(config: Config) -> None:
    """Refuse a configuration whose fields are each valid but do not fit together."""
    _check_accounts(config)
    _check_slot_identities(config)
    _check_paths(config)
    _check_allowance("ceiling", config.ceiling)
    _check_allowance("initial_offer", config.initial_offer)
    _check_offer_within_ceiling(config)
    _check_providers(config)


def _check_accounts(config: Config) -> None:
    """UIDs are roles: no role is root, and no account plays two roles."""
    accounts = [("transport_uid", config.transport_uid)]
    accounts += [(f"local_owner_uids[{i}]", uid) for i, uid in enumerate(config.local_owner_uids)]
    accounts += [(f"slots[{i}].uid", slot.uid) for i, slot in enumerate(config.slots)]
    seen: dict[int, str] = {}
    for key, uid in accounts:
        if uid == 0:
            raise refuse(
                HostCode.CONFIG_INVALID, key, "is 0 (root)", "use a dedicated unprivileged account"
            )
        if uid in seen:
            raise refuse(
                HostCode.CONFIG_CONFLICT,
                key,
                f"UID {uid} is also {seen[uid]}",
                "give the transport, each local owner and each slot its own account",
            )
        seen[uid] = key


def _check_slot_identities(config: Config) -> None:
    """Slot ids name reservations and slot groups can read staged inputs: both are unique."""
    ids: dict[str, int] = {}
    gids: dict[int, int] = {}
    uuids: dict[str, int] = {}
    for i, slot in enumerate(config.slots):
        if slot.id in ids:
            raise refuse(
                HostCode.CONFIG_CONFLICT,
                f"slots[{i}].id",
                f"{slot.id!r} is also slots[{ids[slot.id]}].id",
                "give every slot a distinct id",
            )
        ids[slot.id] = i
        if slot.gid == 0:
            raise refuse(
                HostCode.CONFIG_INVALID,
                f"slots[{i}].gid",
                "is 0 (root)",
                "use the slot's own group",
            )
        if slot.gid in gids:
            raise refuse(
                HostCode.CONFIG_CONFLICT,
                f"slots[{i}].gid",
                f"GID {slot.gid} is also slots[{gids[slot.gid]}].gid",
                "give every slot its own group, so no slot can read another's inputs",
            )
        gids[slot.gid] = i
        if slot.filesystem_uuid in uuids:
            raise refuse(
                HostCode.CONFIG_CONFLICT,
                f"slots[{i}].filesystem_uuid",
                f"is also slots[{uuids[slot.filesystem_uuid]}].filesystem_uuid",
                "give every slot a filesystem of its own",
            )
        uuids[slot.filesystem_uuid] = i


def _check_paths(config: Config) -> None:
    """Directories must be normalized and disjoint: one place, one owner, one purpose."""
    paths = [("state_dir", config.state_dir), ("socket_dir", config.socket_dir)]
    paths += [(f"slots[{i}].path", slot.path) for i, slot in enumerate(config.slots)]
    for key, path in paths:
        if path == "/" or path.startswith("//") or posixpath.normpath(path) != path:
            raise refuse(
                HostCode.CONFIG_INVALID,
                key,
                f"{path!r} is not a normalized absolute directory below /",
                "write it without '.', '..', repeated or trailing slashes",
            )
    ordered = sorted(paths, key=lambda entry: entry[1].split("/"))
    for (outer_key, outer), (inner_key, inner) in itertools.pairwise(ordered):
        if inner == outer or inner.startswith(outer + "/"):
            raise refuse(
                HostCode.CONFIG_CONFLICT,
                inner_key,
                f"{inner!r} is the same as or inside {outer_key} {outer!r}",
                "use separate directories, none inside another",
            )


def _check_allowance(key: str, allowance: Allowance) -> None:
    for field in ("devices", "projects", "runtimes"):
        values: tuple[str, ...] = getattr(allowance, field)
        for i, value in enumerate(values):
            if value in values[:i]:
                raise refuse(
                    HostCode.CONFIG_INVALID,
                    f"{key}.{field}[{i}]",
                    f"{value!r} is listed twice",
                    "list each entry once",
                )


_COUNTS = ("cpu_millis", "memory_bytes", "swap_bytes", "processes", "slots")
_SETS = ("devices", "projects", "runtimes")


def _check_offer_within_ceiling(config: Config) -> None:
    ceiling, offer = config.ceiling, config.initial_offer
    if ceiling.slots > len(config.slots):
        raise refuse(
            HostCode.CONFIG_CONFLICT,
            "ceiling.slots",
            f"{ceiling.slots} exceeds the {len(config.slots)} configured slots",
            "lower it or configure more slots",
        )
    for field in _COUNTS:
        if getattr(offer, field) > getattr(ceiling, field):
            raise refuse(
                HostCode.CONFIG_CONFLICT,
                f"initial_offer.{field}",
                f"{getattr(offer, field)} exceeds ceiling.{field} {getattr(ceiling, field)}",
                "lower the offer or raise the ceiling",
            )
    for field in _SETS:
        allowed = set(getattr(ceiling, field))
        for i, value in enumerate(getattr(offer, field)):
            if value not in allowed:
                raise refuse(
                    HostCode.CONFIG_CONFLICT,
                    f"initial_offer.{field}[{i}]",
                    f"{value!r} is not in ceiling.{field}",
                    "add it to the ceiling or remove it from the offer",
                )


def _check_providers(config: Config) -> None:
    ids: dict[str, int] = {}
    for i, provider in enumerate(config.providers):
        if provider.id in ids:
            raise refuse(
                HostCode.CONFIG_CONFLICT,
                f"providers[{i}].id",
                f"{provider.id!r} is also providers[{ids[provider.id]}].id",
                "configure each provider once",
            )
        ids[provider.id] = i
        _check_json_value(f"providers[{i}].configuration", provider.configuration, 0)
    for i, runtime in enumerate(config.ceiling.runtimes):
        if runtime not in ids:
            raise refuse(
                HostCode.CONFIG_CONFLICT,
                f"ceiling.runtimes[{i}]",
                f"{runtime!r} is not a configured provider",
                "add it to providers or remove it from the ceiling",
            )


def _check_json_value(key: str, value: object, depth: int) -> None:
    """Provider configuration is handed over as JSON: refuse TOML dates and deep nesting."""
    if depth > _MAX_JSON_DEPTH:
        raise refuse(HostCode.CONFIG_INVALID, key, "is nested too deeply", "flatten it")
    if isinstance(value, dict):
        for name, item in value.items():
            _check_json_value(f"{key}.{name}", item, depth + 1)
    elif isinstance(value, list):
        for i, item in enumerate(value):
            _check_json_value(f"{key}[{i}]", item, depth + 1)
    elif isinstance(value, float) and not math.isfinite(value):
        raise refuse(HostCode.CONFIG_INVALID, key, "is not a finite number", "use a finite number")
    elif value is not None and not isinstance(value, (str, int, float)):
        raise refuse(
            HostCode.CONFIG_INVALID,
            key,
            f"has type {type(value).__name__}, which JSON cannot carry",
            "use a string, number, boolean, null, list or table",
        )
