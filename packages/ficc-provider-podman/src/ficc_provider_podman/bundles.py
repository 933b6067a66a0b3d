"""Every configured device as an exact bundle, and what one job is granted of them.

`resolve` turns the configuration's `devices` into bundles (bundle.py) when the
provider is configured, in any of three forms:

- `{name, path}`: one character node; a bundle of one own node, of a kind of its own
  (the name), so no other device's node is ever shown beside it;
- `{name, kind, nodes, shared_nodes, mounts, environment}`: written by the
  administrator;
- `{name, cdi: {spec, device, exclude}}`: one device of a CDI spec (cdi.py), its own
  edits giving the own nodes and the spec-level edits the shared nodes, mounts and
  environment of both, NVIDIA's hooks reproduced as files (hooks.py).

Then it refuses (`device_conflict`) what would let two jobs meet: a node that is the
own node of two devices (by path or by number), shared nodes that differ between
devices of one kind or are another device's own, a node numbered like a runtime
device every job gets, two files at one mount target, one variable with two values,
more nodes or mounts than a prepare result can carry.

`Bundles.grant(names)` is one job's share, the device model of docs/providers.md: the
own nodes of the devices it holds and the shared nodes of their kinds (positive:
they must open), every other device of those kinds (negative: shown, and refused by
the service's device policy, so the runner's device-open results prove the isolation),
and the mounts and environment of the devices it holds. A job that holds no device
of a kind sees nothing of that kind: no node, no mount, no variable.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from ficc_provider_podman import cdi, hooks
from ficc_provider_podman.bundle import (
    CONFLICT,
    Bundle,
    FileMount,
    Node,
    check_mount_source,
    check_node,
    refused,
    still,
)
from ficc_provider_podman.config import OCI_DEFAULT_DEVICES, CdiDevice, Config, Device

MAX_NODES = 64
"""A prepare result carries at most 64 prepared and 64 negative devices."""
OCI_DEFAULT_COUNT = len(OCI_DEFAULT_DEVICES)
MAX_MOUNTS = 248
"""A prepare result carries at most 256 mounts; the provider's own take four."""
MOUNT_OPTIONS = frozenset(
    {"ro", "nosuid", "nodev", "noexec", "bind", "rbind", "rprivate", "private"}
)
"""CDI mount options the provider reproduces: a read-only file bind, nosuid and nodev
always, noexec when asked."""
MOUNT_TYPES = (None, "bind", "none")
ENV_NAME = re.compile(r"\A[A-Za-z_][A-Za-z0-9_]{0,127}\Z")


@dataclass(frozen=True)
class Grant:
    """One job's share of the devices (see the module docstring)."""

    own: list[tuple[str, Node]]
    """(device name, node) of every device the job holds."""
    shared: list[tuple[str, Node]]
    """(name of the first held device of its kind, node): the kinds' shared nodes."""
    others: list[Node]
    """Own nodes of the devices of those kinds the job does not hold."""
    mounts: list[FileMount]
    environment: dict[str, str]


@dataclass(frozen=True)
class Bundles:
    """The resolved devices, by name, in configuration order."""

    by_name: dict[str, Bundle]

    def grant(self, names: Iterable[str]) -> Grant:
        """What a job holding the devices `names` (all configured) is given and shown."""
        held = [self.by_name[name] for name in names]
        holding = {bundle.name for bundle in held}
        kinds = {bundle.kind for bundle in held}
        shared: dict[str, tuple[str, Node]] = {}
        mounts: dict[str, FileMount] = {}
        environment: dict[str, str] = {}
        for bundle in held:
            for node in bundle.shared:
                shared.setdefault(node.path, (bundle.name, node))
            mounts.update((mount.target, mount) for mount in bundle.mounts)
            environment.update(bundle.environment)
        return Grant(
            own=[(bundle.name, node) for bundle in held for node in bundle.nodes],
            shared=list(shared.values()),
            others=[
                node
                for bundle in self.by_name.values()
                if bundle.kind in kinds and bundle.name not in holding
                for node in bundle.nodes
            ],
            mounts=list(mounts.values()),
            environment=environment,
        )

    def still(self, names: Iterable[str]) -> None:
        """The devices of `names` are still what configure resolved (`device_changed`)."""
        for name in names:
            still(self.by_name[name])


def resolve(config: Config) -> Bundles:
    """Every configured device as an exact bundle, the whole set checked together."""
    specs: dict[str, cdi.Spec] = {}
    bundles = [_bundle(device, specs) for device in config.devices]
    _check_together(bundles, config.runtime_devices)
    return Bundles({bundle.name: bundle for bundle in bundles})


def _bundle(device: Device, specs: dict[str, cdi.Spec]) -> Bundle:
    where = f"device {device.name!r}"
    if device.path is not None:
        return Bundle(device.name, device.name, (check_node(device.path, where),), origin="path")
    if device.cdi is not None:
        return _from_cdi(device.name, device.cdi, specs)
    assert device.kind is not None  # the configuration's own rule
    mounts = [check_mount_source(m.source, m.target, where) for m in device.mounts]
    _distinct_targets(mounts, where)
    return Bundle(
        device.name,
        device.kind,
        tuple(check_node(path, where) for path in device.nodes),
        tuple(check_node(path, where) for path in device.shared_nodes),
        tuple(mounts),
        tuple(device.environment.items()),
        origin="bundle",
    )


def _distinct_targets(mounts: Sequence[FileMount], where: str) -> None:
    targets = [mount.target for mount in mounts]
    if len(set(targets)) != len(targets):
        raise refused(CONFLICT, f"{where}: a mount target is listed twice")


# --- one device of a CDI spec ----------------------------------------------------------------


def _from_cdi(name: str, ref: CdiDevice, specs: dict[str, cdi.Spec]) -> Bundle:
    if ref.spec not in specs:
        specs[ref.spec] = cdi.load(ref.spec)
    selected = cdi.select(specs[ref.spec], ref.spec, ref.device)
    where = f"device {name!r} ({selected.qualified} in {ref.spec})"
    for edits in (selected.shared, selected.own):
        _refuse_unsupported(edits, where)
    own = [_cdi_node(node, where) for node in selected.own.device_nodes]
    shared = [_cdi_node(node, where) for node in selected.shared.device_nodes]
    if not own:
        raise refused(
            CONFLICT,
            f"{where}: the device has no node of its own, so granting it to one job at a time"
            " would guard nothing; name a device with its own node",
        )
    draft = hooks.Draft(where, [*own, *shared], _cdi_mounts(selected, ref, where))
    hooks.apply([*selected.shared.hooks, *selected.own.hooks], draft)
    environment = _cdi_environment([*selected.shared.env, *selected.own.env], where)
    if draft.folders:
        if hooks.LIBRARY_PATH in environment:
            raise _unsupported(where, f"it sets {hooks.LIBRARY_PATH} and asks for ldconfig too")
        environment[hooks.LIBRARY_PATH] = hooks.library_path(draft.folders)
    aliases: dict[str, list[str]] = {}
    for alias, node in draft.aliases.items():
        aliases.setdefault(node, []).append(alias)
    return Bundle(
        name,
        selected.kind,
        tuple(_with_aliases(node, aliases) for node in own),
        tuple(_with_aliases(node, aliases) for node in shared),
        tuple(draft.mounts.values()),
        tuple(environment.items()),
        origin=f"cdi:{selected.qualified}",
    )


def _with_aliases(node: Node, aliases: dict[str, list[str]]) -> Node:
    return Node(node.path, node.major, node.minor, tuple(sorted(aliases.get(node.path, []))))


def _unsupported(where: str, message: str) -> Exception:
    return refused(cdi.EDIT_UNSUPPORTED, f"{where}: {message}")


def _refuse_unsupported(edits: cdi.ContainerEdits, where: str) -> None:
    for present, what in (
        (edits.intel_rdt is not None, "intelRdt (cache allocation)"),
        (bool(edits.net_devices), "netDevices (host network interfaces)"),
        (bool(edits.additional_gids), "additionalGids (the payload has the slot's group only)"),
    ):
        if present:
            raise _unsupported(where, f"it asks for {what}, which a job is never given")


def _cdi_node(node: cdi.DeviceNode, where: str) -> Node:
    """A spec's device node as an exact node; refuses what the provider cannot show."""
    if node.host_path not in (None, node.path):
        raise _unsupported(
            where,
            f"node {node.host_path} is shown at {node.path}: the provider shows each node at its"
            " host path (the device-open results name host paths)",
        )
    if node.type not in (None, "c") or node.uid is not None or node.gid is not None:
        raise _unsupported(where, f"node {node.path}: only a character node as the host has it")
    if node.permissions not in (None, "") and not {"r", "w"} <= set(node.permissions):
        raise _unsupported(
            where, f"node {node.path}: permissions {node.permissions!r} (jobs get read and write)"
        )
    found = check_node(node.path, where)
    given = node.major is not None or node.minor is not None
    if given and (node.major or 0, node.minor or 0) != found.numbers:  # CDI omits zeros
        raise _unsupported(
            where, f"node {node.path} is {found.major}:{found.minor}, not {node.major}:{node.minor}"
        )
    if node.file_mode is not None and node.file_mode & 0o777 != _mode_of(node.path):
        raise _unsupported(where, f"node {node.path}: fileMode differs from the host node's")
    return found


def _mode_of(path: str) -> int:
    return os.stat(path, follow_symlinks=False).st_mode & 0o777


def _cdi_mounts(selected: cdi.Selected, ref: CdiDevice, where: str) -> dict[str, FileMount]:
    listed = [*selected.shared.mounts, *selected.own.mounts]
    unknown = set(ref.exclude) - {mount.container_path for mount in listed}
    if unknown:
        raise refused(
            CONFLICT, f"{where}: exclude names {sorted(unknown)}, which the spec does not mount"
        )
    mounts: dict[str, FileMount] = {}
    for mount in listed:
        if mount.container_path in ref.exclude:
            continue
        options = set(mount.options)
        if "ro" not in options or not options <= MOUNT_OPTIONS or mount.type not in MOUNT_TYPES:
            raise _unsupported(
                where,
                f"mount {mount.container_path} ({mount.type or 'bind'}, {','.join(mount.options)})"
                " is not a read-only file bind",
            )
        checked = check_mount_source(
            mount.host_path, mount.container_path, where, noexec="noexec" in options
        )
        if mounts.get(checked.target, checked).identity != checked.identity:
            raise refused(CONFLICT, f"{where}: two files are mounted at {checked.target}")
        mounts[checked.target] = checked
    return mounts


def _cdi_environment(entries: list[str], where: str) -> dict[str, str]:
    environment: dict[str, str] = {}
    for entry in entries:
        key, equals, value = entry.partition("=")
        if not equals or not ENV_NAME.match(key) or any(c in value for c in "\n\r\x00"):
            raise _unsupported(where, f"environment entry {entry[:80]!r} is not KEY=VALUE")
        if environment.get(key, value) != value:
            raise refused(CONFLICT, f"{where}: {key} is set to two values")
        environment[key] = value
    return environment


# --- the set as a whole -----------------------------------------------------------------------


def _check_together(bundles: list[Bundle], runtime_devices: Sequence[str]) -> None:
    """Refuse what would let two jobs meet, or not fit in a prepare result."""
    owners: dict[object, str] = {}
    for bundle in bundles:
        for node in bundle.nodes:
            for key in (node.path, node.numbers):
                _claim(owners, key, f"{bundle.name}'s own node {node.path}")
    kinds: dict[str, Bundle] = {}
    for bundle in bundles:
        first = kinds.setdefault(bundle.kind, bundle)
        if set(first.shared) != set(bundle.shared):
            raise refused(
                CONFLICT,
                f"devices {first.name!r} and {bundle.name!r} are both of kind {bundle.kind!r}"
                " but share different nodes; one kind has one set of shared nodes",
            )
    for kind, bundle in kinds.items():
        for node in bundle.shared:
            for key in (node.path, node.numbers):
                _claim(owners, key, f"node {node.path} shared by kind {kind}")
    for path in runtime_devices:
        numbers = _runtime_numbers(path)
        if numbers in owners:
            raise refused(CONFLICT, f"{owners[numbers]} has the numbers of runtime device {path}")
    _check_paths(bundles, owners, len(runtime_devices))
    _check_files(bundles)


def _claim(owners: dict[object, str], key: object, what: str) -> None:
    if key in owners:
        raise refused(
            CONFLICT,
            f"{what} is also {owners[key]}: one node (path or major:minor) belongs to one"
            " device, or is shared by one kind",
        )
    owners[key] = what


def _runtime_numbers(path: str) -> tuple[int, int]:
    """(config.check_files made sure it is a character node.)"""
    st = os.stat(path, follow_symlinks=False)
    return (os.major(st.st_rdev), os.minor(st.st_rdev))


def _check_paths(bundles: list[Bundle], owners: dict[object, str], runtime: int) -> None:
    """Aliases are unique and no node's; every node and alias fits a prepare result
    (prepared: the runtime devices and every node; negative: the runtime's six default
    nodes and every node and alias)."""
    shown: set[str] = set()
    nodes = aliases = 0
    for bundle in bundles:
        for node in {*bundle.nodes, *bundle.shared}:
            nodes += 1
            aliases += len(node.aliases)
            for alias in node.aliases:
                if alias in owners or alias in shown:
                    raise refused(CONFLICT, f"{alias} is shown twice (a link of {node.path})")
                shown.add(alias)
    if max(runtime + nodes, OCI_DEFAULT_COUNT + nodes + aliases) > MAX_NODES:
        raise refused(
            CONFLICT,
            f"{nodes} device nodes and {aliases} links in all, with the runtime's; a job's"
            f" prepare result carries at most {MAX_NODES} devices of each side",
        )


def _check_files(bundles: list[Bundle]) -> None:
    """One file per mount target, one value per variable, across every device."""
    targets: dict[str, FileMount] = {}
    values: dict[str, str] = {}
    for bundle in bundles:
        for mount in bundle.mounts:
            if targets.setdefault(mount.target, mount).identity != mount.identity:
                raise refused(CONFLICT, f"two different files are mounted at {mount.target}")
        for key, value in bundle.environment:
            if values.setdefault(key, value) != value:
                raise refused(CONFLICT, f"{key} has two values in the devices' environment")
    if len(targets) > MAX_MOUNTS:
        raise refused(
            CONFLICT, f"{len(targets)} file mounts in all; a job can carry at most {MAX_MOUNTS}"
        )
