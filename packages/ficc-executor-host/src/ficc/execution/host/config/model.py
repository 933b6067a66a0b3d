"""The administrator's configuration file: file safety, strict schema, cross-field rules.

The daemon runs as root and trusts this file completely (it pins providers and names the
accounts that run other people's work), so the file itself is checked before a single
byte is parsed: every directory on its path is a real directory owned by root and not
writable by anyone else, and the file is a regular, root-owned, 0600, singly linked file
of at most 1 MiB. Only then is it decoded (JSON or TOML, by extension) into frozen
msgspec Structs that refuse unknown keys, and checked against rules that span fields.

Three entry points, so each part stays testable on its own:
- `parse_config(data, suffix)` is pure: bytes in, `Config` out, or a `HostError`.
- `load_config(path)` reads the file safely and parses it.
- `check_host(config)` checks the directories the configuration names on this machine.

Every refusal is a `HostError` whose message starts with the key path (`slots[2].uid`)
and says what to change. Codes: `config_missing`, `config_unreadable`,
`config_unsafe_file`, `config_invalid`, `config_conflict`, `host_path_missing`,
`host_path_unsafe`.
"""

from __future__ import annotations

import errno
import itertools
import json
import math
import os
import posixpath
import pwd
import re
import stat
import tomllib
import typing
from typing import Annotated, Any, Literal

import msgspec
import msgspec.inspect

from ficc.execution.host.core.codes import HostCode
from ficc.execution.host.core.errors import HostError
from ficc.execution.host.ledger import space as ledger_space
from ficc.execution.host.linux import fsutil
from ficc.execution.host.storage import slotfs
from ficc.execution.plan import Count, Digest, Identity, Name, Positive
from ficc.execution.wire import Control

MAX_CONFIG_BYTES = 1 << 20
MAX_LEASE_SECONDS = 86_400
_MAX_JSON_DEPTH = 32

_ABSOLUTE_PATH = r"\A/[^\x00-\x1f\x7f]*\Z"
AbsolutePath = Annotated[str, msgspec.Meta(pattern=_ABSOLUTE_PATH, max_length=4095)]
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
    filesystem_uuid: Annotated[str, msgspec.Meta(pattern=slotfs.UUID_PATTERN)]
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

    metrics_textfile: AbsolutePath | None = None


def _refuse(code: str, key: str, problem: str, fix: str) -> HostError:
    return HostError(code, f"{key}: {problem}; {fix}")


# --- loading ---------------------------------------------------------------------------


def load_config(path: str) -> Config:
    """Read the configuration file at the absolute `path` safely, then parse it."""
    suffix = posixpath.splitext(path)[1]
    if suffix not in (".json", ".toml"):
        raise _refuse(
            HostCode.CONFIG_INVALID, path, "the file name must end in .json or .toml", "rename it"
        )
    return parse_config(read_trusted_file(path, MAX_CONFIG_BYTES), suffix)


def parse_config(data: bytes, suffix: str) -> Config:
    """Decode JSON or TOML bytes into a `Config` and apply every cross-field rule."""
    raw = _decode_document(data, suffix)
    try:
        config = msgspec.convert(raw, Config)
    except msgspec.ValidationError as error:
        raise _schema_refusal(str(error)) from None
    check_rules(config)
    return config


def _decode_document(data: bytes, suffix: str) -> object:
    try:
        text = data.decode("utf-8")
        if suffix == ".toml":
            return tomllib.loads(text)
        if suffix == ".json":
            return json.loads(
                text, object_pairs_hook=_refuse_duplicate_keys, parse_constant=_refuse_constant
            )
    except (UnicodeDecodeError, ValueError) as error:  # JSONDecodeError, TOMLDecodeError
        problem = f"not valid {suffix[1:]}: {error}"
        raise _refuse(HostCode.CONFIG_INVALID, "top level", problem, "fix the syntax") from None
    except RecursionError:
        problem = f"not valid {suffix[1:]}: nested too deeply"
        raise _refuse(HostCode.CONFIG_INVALID, "top level", problem, "fix the syntax") from None
    raise _refuse(
        HostCode.CONFIG_INVALID, "top level", f"unknown format {suffix!r}", "use .json or .toml"
    )


def _refuse_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A key given twice would hide one value from the reviewer, so refuse it."""
    result: dict[str, Any] = {}
    for key, value in pairs:
        if key in result:
            raise ValueError(f"key {key!r} appears twice in one object")
        result[key] = value
    return result


def _refuse_constant(name: str) -> object:
    raise ValueError(f"{name} is not a JSON number")


_SCHEMA_LOCATION = re.compile(r"^(?P<problem>.*?)(?: - at `\$(?P<key>[^`]*)`)?$", re.DOTALL)


_PATTERN_PROBLEM = re.compile(r"^Expected `str` matching regex '(?P<regex>.*)'$", re.DOTALL)
_ENUM_PROBLEM = re.compile(r"^Invalid enum value (?P<value>.*)$", re.DOTALL)


def _pattern_of(annotated: object) -> str:
    (meta,) = [m for m in typing.get_args(annotated)[1:] if isinstance(m, msgspec.Meta)]
    assert meta.pattern is not None
    return meta.pattern


_PATTERN_NAMES = {
    _pattern_of(Identity): "an identity (32 lowercase hexadecimal digits)",
    _pattern_of(Digest): "a digest (sha256: and 64 lowercase hexadecimal digits)",
    _pattern_of(Name): "a name (a lowercase letter, then up to 79 of a-z, 0-9, '_', '.', '-')",
    _ABSOLUTE_PATH: "an absolute path (starting with /, no control characters)",
    slotfs.UUID_PATTERN: (
        "a filesystem UUID (xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx, lowercase hexadecimal,"
        " as `blkid` or `ficc-executor provision-slot` prints it)"
    ),
}


def _schema_refusal(detail: str) -> HostError:
    """Turn msgspec's 'problem - at `$.slots[2].uid`' into 'slots[2].uid: problem; fix'.

    A pattern mismatch names the expected type rather than printing its regex, and an
    invalid enum value lists the allowed values.
    """
    match = _SCHEMA_LOCATION.match(detail)
    assert match is not None  # the pattern matches every string
    key = (match["key"] or "").lstrip(".") or "top level"
    problem = _readable_problem(match["problem"], key)
    if "unknown field" in problem:
        fix = "remove it or correct its spelling (unknown keys are refused)"
    elif "missing required field" in problem:
        fix = "add it"
    else:
        fix = "fix this value"
    return _refuse(
        HostCode.CONFIG_INVALID, key, problem, f"{fix}; docs/configuration.md lists every key"
    )


def _readable_problem(problem: str, key: str) -> str:
    pattern = _PATTERN_PROBLEM.match(problem)
    if pattern is not None:
        regex = pattern["regex"].encode().decode("unicode_escape")
        return f"expected {_PATTERN_NAMES.get(regex, 'a string of the documented form')}"
    enum = _ENUM_PROBLEM.match(problem)
    if enum is not None:
        allowed = _allowed_values(key)
        if allowed:
            return f"{enum['value']} is not one of {', '.join(allowed)}"
    return problem


def _allowed_values(key: str) -> list[str]:
    """The literal values allowed at a key path such as `initial_offer.control`."""
    node: Any = msgspec.inspect.type_info(Config)
    for token in re.findall(r"[^.\[\]]+", key):
        while isinstance(node, msgspec.inspect.Metadata):
            node = node.type
        if isinstance(node, msgspec.inspect.StructType):
            fields = {f.encode_name: f.type for f in node.fields}
            if token not in fields:
                return []
            node = fields[token]
        elif isinstance(node, (msgspec.inspect.VarTupleType, msgspec.inspect.ListType)):
            node = node.item_type
        else:
            return []
    while isinstance(node, msgspec.inspect.Metadata):
        node = node.type
    if isinstance(node, msgspec.inspect.LiteralType):
        return [json.dumps(value) for value in node.values]
    return []


# --- cross-field rules (pure) ----------------------------------------------------------


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
            raise _refuse(
                HostCode.CONFIG_INVALID, key, "is 0 (root)", "use a dedicated unprivileged account"
            )
        if uid in seen:
            raise _refuse(
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
            raise _refuse(
                HostCode.CONFIG_CONFLICT,
                f"slots[{i}].id",
                f"{slot.id!r} is also slots[{ids[slot.id]}].id",
                "give every slot a distinct id",
            )
        ids[slot.id] = i
        if slot.gid == 0:
            raise _refuse(
                HostCode.CONFIG_INVALID,
                f"slots[{i}].gid",
                "is 0 (root)",
                "use the slot's own group",
            )
        if slot.gid in gids:
            raise _refuse(
                HostCode.CONFIG_CONFLICT,
                f"slots[{i}].gid",
                f"GID {slot.gid} is also slots[{gids[slot.gid]}].gid",
                "give every slot its own group, so no slot can read another's inputs",
            )
        gids[slot.gid] = i
        if slot.filesystem_uuid in uuids:
            raise _refuse(
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
            raise _refuse(
                HostCode.CONFIG_INVALID,
                key,
                f"{path!r} is not a normalized absolute directory below /",
                "write it without '.', '..', repeated or trailing slashes",
            )
    ordered = sorted(paths, key=lambda entry: entry[1].split("/"))
    for (outer_key, outer), (inner_key, inner) in itertools.pairwise(ordered):
        if inner == outer or inner.startswith(outer + "/"):
            raise _refuse(
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
                raise _refuse(
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
        raise _refuse(
            HostCode.CONFIG_CONFLICT,
            "ceiling.slots",
            f"{ceiling.slots} exceeds the {len(config.slots)} configured slots",
            "lower it or configure more slots",
        )
    for field in _COUNTS:
        if getattr(offer, field) > getattr(ceiling, field):
            raise _refuse(
                HostCode.CONFIG_CONFLICT,
                f"initial_offer.{field}",
                f"{getattr(offer, field)} exceeds ceiling.{field} {getattr(ceiling, field)}",
                "lower the offer or raise the ceiling",
            )
    for field in _SETS:
        allowed = set(getattr(ceiling, field))
        for i, value in enumerate(getattr(offer, field)):
            if value not in allowed:
                raise _refuse(
                    HostCode.CONFIG_CONFLICT,
                    f"initial_offer.{field}[{i}]",
                    f"{value!r} is not in ceiling.{field}",
                    "add it to the ceiling or remove it from the offer",
                )


def _check_providers(config: Config) -> None:
    ids: dict[str, int] = {}
    for i, provider in enumerate(config.providers):
        if provider.id in ids:
            raise _refuse(
                HostCode.CONFIG_CONFLICT,
                f"providers[{i}].id",
                f"{provider.id!r} is also providers[{ids[provider.id]}].id",
                "configure each provider once",
            )
        ids[provider.id] = i
        _check_json_value(f"providers[{i}].configuration", provider.configuration, 0)
    for i, runtime in enumerate(config.ceiling.runtimes):
        if runtime not in ids:
            raise _refuse(
                HostCode.CONFIG_CONFLICT,
                f"ceiling.runtimes[{i}]",
                f"{runtime!r} is not a configured provider",
                "add it to providers or remove it from the ceiling",
            )


def _check_json_value(key: str, value: object, depth: int) -> None:
    """Provider configuration is handed over as JSON: refuse TOML dates and deep nesting."""
    if depth > _MAX_JSON_DEPTH:
        raise _refuse(HostCode.CONFIG_INVALID, key, "is nested too deeply", "flatten it")
    if isinstance(value, dict):
        for name, item in value.items():
            _check_json_value(f"{key}.{name}", item, depth + 1)
    elif isinstance(value, list):
        for i, item in enumerate(value):
            _check_json_value(f"{key}[{i}]", item, depth + 1)
    elif isinstance(value, float) and not math.isfinite(value):
        raise _refuse(HostCode.CONFIG_INVALID, key, "is not a finite number", "use a finite number")
    elif value is not None and not isinstance(value, (str, int, float)):
        raise _refuse(
            HostCode.CONFIG_INVALID,
            key,
            f"has type {type(value).__name__}, which JSON cannot carry",
            "use a string, number, boolean, null, list or table",
        )


# --- file safety (I/O) -----------------------------------------------------------------


def _check_normalized(path: str, key: str, code: str) -> None:
    if not path.startswith("/") or path.startswith("//") or posixpath.normpath(path) != path:
        raise _refuse(code, key, f"{path!r} is not a normalized absolute path", "give one")


def _check_trusted_directory(st: os.stat_result, key: str, where: str, code: str) -> None:
    if st.st_uid != 0:
        raise _refuse(code, key, f"directory {where} is owned by UID {st.st_uid}", "chown root")
    if st.st_mode & 0o022:
        mode = stat.S_IMODE(st.st_mode)
        problem = f"directory {where} has mode {mode:04o}, writable by others"
        if st.st_mode & (stat.S_ISVTX | stat.S_IWOTH):  # a shared directory such as /tmp
            raise _refuse(code, key, problem, _shared_directory_fix(key))
        raise _refuse(code, key, problem, f"chmod go-w {where}")


_USUAL_HOMES = {
    "state_dir": "/var/lib/ficc-executor",
    "socket_dir": "/run/ficc-executor",
    "metrics_textfile": "/var/lib/node_exporter/textfile_collector",
    "--image": "/var/lib/ficc-slots",
}


def _shared_directory_fix(key: str) -> str:
    """Advice for a path below a shared directory such as /tmp: move the path, with the
    usual home of what the key names, and never loosen the shared directory itself."""
    home = "/srv/ficc/slots" if key.startswith("slots[") else _USUAL_HOMES.get(key, "/etc/ficc")
    return f"move it below a directory only root can write (for example {home})"


def _open_unchanged_child(parent_fd: int, name: str, key: str, where: str, code: str) -> int:
    """The directory `name` in `parent_fd`, refused if it is a link or not a directory,
    or if what was opened is not what was looked at."""
    before = os.stat(name, dir_fd=parent_fd, follow_symlinks=False)
    if stat.S_ISLNK(before.st_mode):
        raise _refuse(code, key, f"{where} is a symbolic link", "use the real path")
    if not stat.S_ISDIR(before.st_mode):
        raise _refuse(code, key, f"{where} is not a directory", "use a directory path")
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open(name, flags, dir_fd=parent_fd)
    try:
        if not os.path.samestat(before, os.fstat(fd)):
            raise _refuse(code, key, f"{where} changed while being checked", "retry")
    except BaseException:
        os.close(fd)
        raise
    return fd


def _create_advice(key: str) -> str:
    """What to do about a missing directory: a slot's path is a filesystem of its own,
    which a plain directory would never satisfy."""
    if key.startswith("slots[") and key.endswith("].path"):
        return (
            "a slot is a filesystem of its own: make it with `ficc-executor provision-slot"
            " --image IMAGE --mount PATH --bytes N --inodes N` (or, if provision-slot made it"
            " before, mount it again with `provision-slot --remount`), or fix the path"
        )
    return "create it (owned by root) or fix the path"


def open_trusted_directory(path: str, key: str, code: str, mode: int | None = None) -> int:
    """Open the absolute directory `path` so that nobody but root could have redirected it.

    Every directory from `/` down is opened relative to its parent without following a
    symbolic link, and must be owned by root and not writable by group or others (a
    sticky world-writable directory such as /tmp is refused too). If `mode` is given,
    the final directory must have exactly that mode. The caller owns the returned fd.
    """
    _check_normalized(path, key, code)

    def open_child(parent_fd: int, name: str, where: str) -> int:
        return _open_unchanged_child(parent_fd, name, key, where, code)

    def check(fd: int, where: str) -> None:
        _check_trusted_directory(os.fstat(fd), key, where, code)

    try:
        fd = fsutil.open_dir(path, open_child=open_child, check=check)
    except FileNotFoundError:
        missing = (
            HostCode.HOST_PATH_MISSING
            if code == HostCode.HOST_PATH_UNSAFE
            else HostCode.CONFIG_MISSING
        )
        raise _refuse(missing, key, f"{path} does not exist", _create_advice(key)) from None
    except OSError as error:
        fix = (
            "run the command as root" if error.errno in (errno.EACCES, errno.EPERM) else "check it"
        )
        raise _refuse(code, key, f"cannot open {path}: {error.strerror}", fix) from None
    actual = stat.S_IMODE(os.fstat(fd).st_mode)
    if mode is not None and actual != mode:
        os.close(fd)
        raise _refuse(code, key, f"{path} has mode {actual:04o}", f"chmod {mode:04o} {path}")
    return fd


def read_trusted_file(path: str, limit: int) -> bytes:
    """Read a root-owned 0600 regular file with one link and at most `limit` bytes.

    The checks are made on the opened descriptor (fstat), not on the path, so the file
    that was checked is the file that is read.
    """
    key = path
    parent, name = posixpath.split(path)
    if not path.startswith("/") or not name:
        raise _refuse(HostCode.CONFIG_UNSAFE_FILE, key, "is not an absolute file path", "give one")
    parent_fd = open_trusted_directory(parent, key, HostCode.CONFIG_UNSAFE_FILE)
    try:
        return _read_checked_file(parent_fd, name, key, limit)
    finally:
        os.close(parent_fd)


def _read_checked_file(parent_fd: int, name: str, key: str, limit: int) -> bytes:
    code = HostCode.CONFIG_UNSAFE_FILE
    try:
        before = os.stat(name, dir_fd=parent_fd, follow_symlinks=False)
    except FileNotFoundError:
        raise _refuse(
            HostCode.CONFIG_MISSING, key, "does not exist", "create it or fix the path"
        ) from None
    except OSError as error:
        raise _unreadable(error, key) from None
    _check_config_stat(before, key, limit)  # refuse FIFOs and devices before opening them
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
    try:
        fd = os.open(name, flags, dir_fd=parent_fd)
    except OSError as error:
        if error.errno == errno.ELOOP:
            raise _refuse(code, key, "is a symbolic link", "use the real file") from None
        raise _unreadable(error, key) from None
    try:
        after = os.fstat(fd)
        if not os.path.samestat(before, after):
            raise _refuse(code, key, "changed while being checked", "retry")
        _check_config_stat(after, key, limit)
        return _read_bounded(fd, limit, key)
    finally:
        os.close(fd)


def _unreadable(error: OSError, key: str) -> HostError:
    """The file is root's and 0600: a refused read is most often a command run without
    root, which the fix says."""
    if error.errno in (errno.EACCES, errno.EPERM):
        fix = "run the command as root (the configuration is root's alone, mode 0600)"
    else:
        fix = "check the file and the disk it is on"
    return _refuse(HostCode.CONFIG_UNREADABLE, key, str(error.strerror), fix)


def _check_config_stat(st: os.stat_result, key: str, limit: int) -> None:
    code = HostCode.CONFIG_UNSAFE_FILE
    if stat.S_ISLNK(st.st_mode):
        raise _refuse(code, key, "is a symbolic link", "name the real file")
    if not stat.S_ISREG(st.st_mode):
        raise _refuse(code, key, "is not a regular file", "use a plain file")
    if st.st_uid != 0:
        raise _refuse(code, key, f"is owned by UID {st.st_uid}", f"chown root:root {key}")
    if stat.S_IMODE(st.st_mode) != 0o600:
        mode = stat.S_IMODE(st.st_mode)
        raise _refuse(code, key, f"has mode {mode:04o}", f"chmod 0600 {key}")
    if st.st_nlink != 1:
        raise _refuse(
            code, key, f"has {st.st_nlink} hard links", "keep exactly one link (copy the file)"
        )
    if st.st_size > limit:
        raise _refuse(code, key, f"is {st.st_size} bytes", f"keep it at most {limit} bytes")


def _read_bounded(fd: int, limit: int, key: str) -> bytes:
    chunks: list[bytes] = []
    total = 0
    while chunk := os.read(fd, limit + 1 - total):
        chunks.append(chunk)
        total += len(chunk)
        if total > limit:
            raise _refuse(
                HostCode.CONFIG_UNSAFE_FILE, key, "grew past the size limit", "keep it small"
            )
    return b"".join(chunks)


# --- the host's directories (I/O) ------------------------------------------------------

STATE_DIR_MODE = 0o700
SOCKET_DIR_MODE = 0o711


def check_host(config: Config) -> None:
    """Check that the directories the configuration names exist and only root controls them,
    and that every slot is a filesystem of its own run by its own account.

    `state_dir` must be mode 0700 and `socket_dir` mode 0711 (peers must be able to reach
    their socket, but not list the directory). Each slot path must be a real directory
    owned by root and not writable by group or others, because the host creates
    root-private attempt directories inside it, and the root of the slot's own mounted
    filesystem (`slotfs`).
    """
    check_directories(config)
    check_slots(config)


def check_directories(config: Config) -> None:
    """`state_dir` (0700) and `socket_dir` (0711) exist and only root controls them."""
    checks: list[tuple[str, str, int | None]] = [
        ("state_dir", config.state_dir, STATE_DIR_MODE),
        ("socket_dir", config.socket_dir, SOCKET_DIR_MODE),
    ]
    for key, path, mode in checks:
        os.close(open_trusted_directory(path, key, HostCode.HOST_PATH_UNSAFE, mode))


def check_slots(config: Config) -> None:
    """Every slot is a root-controlled directory (all checked first, so a missing one is
    named as such) that is the root of the slot's own filesystem
    (`slotfs.check_filesystem`), run by its own account."""
    fds: list[int] = []
    try:
        for i, slot in enumerate(config.slots):
            fds.append(
                open_trusted_directory(
                    slot.path,
                    f"slots[{i}].path",
                    HostCode.HOST_PATH_UNSAFE,
                )
            )
        devices: list[tuple[str, int]] = []
        for i, (slot, fd) in enumerate(zip(config.slots, fds, strict=True)):
            key = f"slots[{i}]"
            devices.append((key, slotfs.check_filesystem(slot, key, fd, open_image_parent)))
            slotfs.check_account(slot, key)
    finally:
        for fd in fds:
            os.close(fd)
    others = [("/", os.stat("/").st_dev), ("state_dir", os.stat(config.state_dir).st_dev)]
    slotfs.check_distinct(devices, others)


def open_image_parent(path: str, key: str) -> int:
    """The directory of a loop-mounted slot's image file, trusted like the config's."""
    return open_trusted_directory(path, key, HostCode.SLOT_FILESYSTEM)


def check_accounts(config: Config) -> None:
    """The transport and local-owner UIDs name existing accounts on this machine.

    A UID with no account cannot be told apart from one a later `useradd` hands to
    somebody else, so a socket owned by it is refused until the account exists.
    """
    accounts = [("transport_uid", config.transport_uid)]
    accounts += [(f"local_owner_uids[{i}]", uid) for i, uid in enumerate(config.local_owner_uids)]
    for key, uid in accounts:
        try:
            pwd.getpwuid(uid)
        except KeyError:
            raise _refuse(
                HostCode.ACCOUNT_MISSING,
                key,
                f"UID {uid} has no account on this host",
                f"create it (useradd --system --uid {uid} --no-create-home"
                " --shell /usr/sbin/nologin NAME) or fix the UID",
            ) from None


METRICS_TEXTFILE_SUFFIX = ".prom"


def check_metrics_textfile(config: Config) -> None:
    """`metrics_textfile` names a `.prom` file in a directory only root controls.

    The daemon (root) replaces that file atomically; a directory others could write
    would let them swap what node_exporter reads.
    """
    path = config.metrics_textfile
    if path is None:
        return
    key = "metrics_textfile"
    parent, name = posixpath.split(path)
    if not name.endswith(METRICS_TEXTFILE_SUFFIX) or name.startswith("."):
        raise _refuse(
            HostCode.CONFIG_INVALID,
            key,
            f"{path!r} does not name a {METRICS_TEXTFILE_SUFFIX} file",
            "name the file node_exporter's textfile collector reads, e.g. ficc.prom",
        )
    os.close(open_trusted_directory(parent, key, HostCode.HOST_PATH_UNSAFE))
