"""A device bundle: what granting one named device gives a job, made exact.

A GPU is not one character node. Granting `gpu0` gives the job its own nodes
(`/dev/nvidia0`), the nodes every device of its kind shares (`/dev/nvidiactl`,
`/dev/nvidia-uvm`, or AMD's `/dev/kfd`), the host driver's user-space files, which
must match the loaded kernel module and so come from the host, never from the image
(read-only file mounts), and environment. Everything here is resolved when the
provider is configured: a node is a path with its exact major and minor, a mount a
source with its recorded identity (device, inode), so the prepare result the host
checks, and the gate that judges the live payload, compare real files with what the
administrator configured.

The rules every bundle file meets (`check_node`, `check_mount_source`):
- a node is a character device owned by root that every account may read and write
  (slot accounts belong to no group: a node only a group can open would never open
  for a job), reached without following a link, its path free of the characters
  Podman's command line cannot carry;
- a mount source is a regular file owned by root that nobody else may write, never a
  link; it is mounted read-only, `nosuid,nodev`.
"""

from __future__ import annotations

import os
import stat
from typing import Annotated

import msgspec

from ficc_provider_podman.errors import ProviderError

NODE_INVALID = "device_node_invalid"
MOUNT_UNSAFE = "device_mount_unsafe"
CONFLICT = "device_conflict"
CHANGED = "device_changed"

_UNSAFE_ON_COMMAND_LINE = (":", ",", "\n", "\x00")
"""Characters `podman --device` and `-v` cannot carry in a path."""
FORBIDDEN_TARGETS = ("/proc", "/sys", "/dev", "/.ficc")
"""Where a bundle's file may not be mounted: the runtime's own trees, the barrier's."""
FORBIDDEN_FILES = ("/etc/hosts", "/etc/hostname", "/etc/resolv.conf")

Path = Annotated[str, msgspec.Meta(pattern=r"\A/[^\x00\n]*\Z", max_length=4096)]


class Node(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A character node, shown to the container at its host path, with its numbers.
    `aliases`: other paths at which the container sees the same node (the links a
    vendor's hook would make, such as `/dev/dri/by-path/...-render`)."""

    path: Path
    major: int
    minor: int
    aliases: tuple[Path, ...] = ()

    @property
    def numbers(self) -> tuple[int, int]:
        return (self.major, self.minor)


class FileMount(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A host file mounted read-only at `target`, with the identity recorded now."""

    source: Path
    target: Path
    device: int
    inode: int
    noexec: bool = False

    @property
    def identity(self) -> tuple[int, int]:
        return (self.device, self.inode)


class Bundle(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One grantable device: `name` (what plans ask for), its `kind`, its own nodes,
    the nodes it shares with every device of its kind, its file mounts and
    environment. `origin` says where it came from, for messages (`cdi:...`)."""

    name: str
    kind: str
    nodes: tuple[Node, ...]
    shared: tuple[Node, ...] = ()
    mounts: tuple[FileMount, ...] = ()
    environment: tuple[tuple[str, str], ...] = ()
    origin: str = ""


def refused(code: str, message: str) -> ProviderError:
    """A configuration refusal, ending with what the administrator can do."""
    return ProviderError(
        code, f"{message}; fix the Podman provider's `devices` (docs/providers.md, devices)"
    )


def _normalized(path: str) -> bool:
    return path.startswith("/") and os.path.normpath(path) == path and path != "/"


def check_node(path: str, where: str) -> Node:
    """The node at `path` as it is now; refuses anything but an open-to-all root node."""
    if not _normalized(path) or any(c in path for c in _UNSAFE_ON_COMMAND_LINE):
        raise refused(
            NODE_INVALID, f"{where}: node path {path!r} is not a normalized absolute path free"
            " of ':' and ','",
        )  # fmt: skip
    try:
        st = os.stat(path, follow_symlinks=False)
    except OSError as error:
        raise refused(NODE_INVALID, f"{where}: node {path}: {error.strerror}") from error
    if not stat.S_ISCHR(st.st_mode):
        kind = "a symbolic link" if stat.S_ISLNK(st.st_mode) else "not a character device"
        raise refused(NODE_INVALID, f"{where}: {path} is {kind}; name the character node itself")
    if st.st_uid != 0:
        raise refused(NODE_INVALID, f"{where}: node {path} is not owned by root")
    if st.st_mode & 0o006 != 0o006:
        raise refused(
            NODE_INVALID,
            f"{where}: node {path} has mode {stat.S_IMODE(st.st_mode):04o}: a slot account"
            " (in no group) could not open it; let every account read and write it (a udev"
            ' rule with MODE="0666", as NVIDIA\'s own nodes are)',
        )
    return Node(path, os.major(st.st_rdev), os.minor(st.st_rdev))


def check_mount_target(target: str, where: str) -> None:
    """A bundle file may go anywhere in the image but the runtime's own places."""
    inside = any(target == top or target.startswith(f"{top}/") for top in FORBIDDEN_TARGETS)
    if not _normalized(target) or inside or target in FORBIDDEN_FILES:
        raise refused(
            MOUNT_UNSAFE,
            f"{where}: mount target {target!r} is not a normalized absolute path outside"
            f" {', '.join(FORBIDDEN_TARGETS)} and {', '.join(FORBIDDEN_FILES)}",
        )
    if any(c in target for c in _UNSAFE_ON_COMMAND_LINE):
        raise refused(MOUNT_UNSAFE, f"{where}: mount target {target!r} holds ':' or ','")


def check_mount_source(source: str, target: str, where: str, *, noexec: bool = False) -> FileMount:
    """The file mount `source` -> `target` with the source's identity recorded now."""
    check_mount_target(target, where)
    if not _normalized(source) or any(c in source for c in _UNSAFE_ON_COMMAND_LINE):
        raise refused(MOUNT_UNSAFE, f"{where}: mount source {source!r} is not usable")
    try:
        st = os.stat(source, follow_symlinks=False)
    except OSError as error:
        raise refused(MOUNT_UNSAFE, f"{where}: mount source {source}: {error.strerror}") from error
    if not stat.S_ISREG(st.st_mode):
        kind = "a symbolic link" if stat.S_ISLNK(st.st_mode) else "not a regular file"
        raise refused(
            MOUNT_UNSAFE,
            f"{where}: mount source {source} is {kind}; name the file itself (a socket or a"
            " directory is never lent to a job)",
        )
    if st.st_uid != 0 or st.st_mode & 0o022:
        raise refused(
            MOUNT_UNSAFE,
            f"{where}: mount source {source} must be owned by root and writable only by root",
        )
    return FileMount(source, target, st.st_dev, st.st_ino, noexec)


def still(bundle: Bundle) -> None:
    """Every node and file of `bundle` is still what was resolved at configure time
    (`device_changed` otherwise: a driver update replaced a library or renumbered a
    node; regenerate the spec and restart the daemon)."""
    for node in (*bundle.nodes, *bundle.shared):
        try:
            st = os.stat(node.path, follow_symlinks=False)
        except OSError:
            st = None
        if (
            st is None
            or not stat.S_ISCHR(st.st_mode)
            or (os.major(st.st_rdev), os.minor(st.st_rdev)) != node.numbers
        ):
            raise _changed(bundle, f"node {node.path} is no longer {node.major}:{node.minor}")
    for mount in bundle.mounts:
        try:
            st = os.stat(mount.source, follow_symlinks=False)
        except OSError:
            st = None
        if st is None or (st.st_dev, st.st_ino) != mount.identity or st.st_mode & 0o022:
            raise _changed(bundle, f"{mount.source} is not the file resolved at configure time")


def _changed(bundle: Bundle, what: str) -> ProviderError:
    return ProviderError(
        CHANGED,
        f"device {bundle.name!r} ({bundle.origin or bundle.kind}): {what}; the host's devices"
        " or driver changed since the provider was configured: regenerate the device spec"
        " if it has one, then restart the daemon",
    )
