"""A Container Device Interface (CDI) spec file: read safely, decoded strictly.

Vendor tools (`nvidia-ctk cdi generate`, AMD's and Intel's) describe a host's devices
in a CDI spec: a `kind` (`nvidia.com/gpu`), named `devices`, each with its own
`containerEdits` (device nodes, mounts, environment, hooks), and a spec-level
`containerEdits` that applies when any of its devices is used. The administrator
names a spec file and one device in it (`nvidia.com/gpu=0`); bundles.py turns the
selected edits into an exact bundle.

The spec is administrator input, read by root, so it is opened like the host's own
configuration: every directory from `/` down is a real directory owned by root and
not writable by group or others, the file is a regular root-owned file nobody else
may write, never a link, at most `MAX_SPEC_BYTES`. It is decoded into Structs that
refuse unknown fields, and its `cdiVersion` must be a released version that has every
field the spec uses. JSON only: YAML would need a parser this package does not carry
(`nvidia-ctk cdi generate --format=json` writes JSON).
"""

from __future__ import annotations

import errno
import os
import re
import stat
from dataclasses import dataclass
from typing import Any

import msgspec

from ficc_provider_podman.errors import ProviderError

MAX_SPEC_BYTES = 4 << 20
VERSIONS = ("0.3.0", "0.4.0", "0.5.0", "0.6.0", "0.7.0", "0.8.0", "1.0.0", "1.1.0")
"""Every released CDI spec version, oldest first (spec 1.1)."""
KIND = re.compile(
    r"\A[a-z0-9]([a-z0-9.-]{0,251}[a-z0-9])?/[a-zA-Z0-9]([a-zA-Z0-9_.-]{0,61}[a-zA-Z0-9])?\Z"
)
ALL = "all"
"""The device vendor tools add for "every device": never one device's bundle."""

UNSAFE_FILE = "cdi_file_unsafe"
INVALID = "cdi_invalid"
VERSION = "cdi_version"
DEVICE_UNKNOWN = "cdi_device_unknown"
DEVICE_ALL = "cdi_device_all"
EDIT_UNSUPPORTED = "cdi_edit_unsupported"


class _Cdi(msgspec.Struct, frozen=True, forbid_unknown_fields=True, rename="camel"):
    pass


class DeviceNode(_Cdi, frozen=True):
    path: str
    host_path: str | None = None
    type: str | None = None
    major: int | None = None
    minor: int | None = None
    file_mode: int | None = None
    permissions: str | None = None
    uid: int | None = None
    gid: int | None = None


class Mount(_Cdi, frozen=True):
    host_path: str
    container_path: str
    options: list[str] = []
    type: str | None = None


class Hook(_Cdi, frozen=True):
    hook_name: str
    path: str
    args: list[str] = []
    env: list[str] = []
    timeout: int | None = None


class ContainerEdits(_Cdi, frozen=True):
    env: list[str] = []
    device_nodes: list[DeviceNode] = []
    net_devices: list[dict[str, Any]] = []
    hooks: list[Hook] = []
    mounts: list[Mount] = []
    intel_rdt: dict[str, Any] | None = None
    additional_gids: list[int] = []


class Device(_Cdi, frozen=True):
    name: str
    annotations: dict[str, str] = {}
    container_edits: ContainerEdits = ContainerEdits()


class Spec(_Cdi, frozen=True):
    cdi_version: str
    kind: str
    devices: list[Device]
    annotations: dict[str, str] = {}
    container_edits: ContainerEdits = ContainerEdits()


@dataclass(frozen=True)
class Selected:
    """One device of a spec: its kind, its own edits and the spec-level (shared) edits."""

    spec_path: str
    kind: str
    device: str
    own: ContainerEdits
    shared: ContainerEdits

    @property
    def qualified(self) -> str:
        return f"{self.kind}={self.device}"


def refusal(code: str, path: str, message: str) -> ProviderError:
    """A refusal of the spec at `path`, saying what to change."""
    return ProviderError(
        code, f"CDI spec {path}: {message}; fix the spec or the provider's `devices` entry"
    )


def load(path: str) -> Spec:
    """The decoded spec at `path` (see the module docstring for every rule)."""
    if not path.endswith(".json"):
        raise refusal(
            INVALID,
            path,
            "only JSON specs are read (write it with `nvidia-ctk cdi generate --format=json`"
            " or convert it) and the name must end in .json",
        )
    data = read_trusted(path)
    try:
        spec = msgspec.json.decode(data, type=Spec)
    except msgspec.DecodeError as error:
        raise refusal(INVALID, path, f"not a CDI spec this provider reads: {error}") from error
    _check_version(spec, path)
    if not KIND.match(spec.kind):
        raise refusal(INVALID, path, f"kind {spec.kind!r} is not `vendor.example/class`")
    return spec


def select(spec: Spec, path: str, qualified: str) -> Selected:
    """The device `kind=name` of `spec`; refuses another kind, `all` and unknown names."""
    kind, _, name = qualified.partition("=")
    if kind != spec.kind:
        raise refusal(
            DEVICE_UNKNOWN, path, f"it describes kind {spec.kind!r}, not {kind!r} ({qualified})"
        )
    if name == ALL:
        raise refusal(
            DEVICE_ALL,
            path,
            f"{qualified} is every device of the kind; name one device per entry so that"
            " each is granted to one job at a time",
        )
    found = [device for device in spec.devices if device.name == name]
    if len(found) != 1:
        names = [d.name for d in spec.devices if d.name != ALL]
        raise refusal(
            DEVICE_UNKNOWN, path, f"{qualified} is {'listed twice' if found else 'not in it'}"
            f" (its devices: {', '.join(names[:16])})",
        )  # fmt: skip
    return Selected(path, spec.kind, name, found[0].container_edits, spec.container_edits)


def _uses(spec: Spec) -> str:
    """The oldest version that has every field the spec uses (the CDI rule)."""
    edits = [spec.container_edits, *(d.container_edits for d in spec.devices)]
    if any(e.net_devices for e in edits):
        return "1.1.0"
    if any(e.intel_rdt is not None or e.additional_gids for e in edits):
        return "0.7.0"
    if spec.annotations or any(d.annotations for d in spec.devices):
        return "0.6.0"
    if any(n.host_path is not None for e in edits for n in e.device_nodes):
        return "0.5.0"
    if any(m.type is not None for e in edits for m in e.mounts):
        return "0.4.0"
    return "0.3.0"


def _check_version(spec: Spec, path: str) -> None:
    if spec.cdi_version not in VERSIONS:
        raise refusal(
            VERSION,
            path,
            f"cdiVersion {spec.cdi_version!r} is not a released CDI version this provider"
            f" knows ({', '.join(VERSIONS)})",
        )
    needed = _uses(spec)
    if VERSIONS.index(spec.cdi_version) < VERSIONS.index(needed):
        raise refusal(
            VERSION, path, f"it uses fields of CDI {needed} but says cdiVersion {spec.cdi_version}"
        )


# --- the trusted read --------------------------------------------------------------------

_DIRECTORY = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def _unsafe(st: os.stat_result) -> bool:
    """Not root's, or writable by group or others (a sticky /tmp included)."""
    return st.st_uid != 0 or bool(st.st_mode & 0o022)


def read_trusted(path: str) -> bytes:
    """The bytes of a root-owned administrator file, reached from `/` one component at
    a time without following a link, every directory root's and closed to others."""
    if not path.startswith("/") or os.path.normpath(path) != path:
        raise refusal(UNSAFE_FILE, path, "the path must be absolute and normalized")
    *directories, name = path.strip("/").split("/")
    fd = os.open("/", _DIRECTORY)
    try:
        for component in directories:
            below = _open_or_refuse(path, component, _DIRECTORY, fd)
            os.close(fd)
            fd = below
            if _unsafe(os.fstat(fd)):
                raise refusal(UNSAFE_FILE, path, f"directory {component!r} is not root's alone")
        flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
        file_fd = _open_or_refuse(path, name, flags, fd)
    finally:
        os.close(fd)
    try:
        st = os.fstat(file_fd)
        if not stat.S_ISREG(st.st_mode) or _unsafe(st) or st.st_nlink != 1:
            raise refusal(
                UNSAFE_FILE,
                path,
                "it must be a regular file with one link, owned by root, writable only by root",
            )
        if st.st_size > MAX_SPEC_BYTES:
            raise refusal(UNSAFE_FILE, path, f"it is larger than {MAX_SPEC_BYTES} bytes")
        data = os.read(file_fd, MAX_SPEC_BYTES + 1)
    finally:
        os.close(file_fd)
    if len(data) > MAX_SPEC_BYTES:
        raise refusal(UNSAFE_FILE, path, f"it grew past {MAX_SPEC_BYTES} bytes while read")
    return data


def _open_or_refuse(path: str, name: str, flags: int, dir_fd: int) -> int:
    try:
        return os.open(name, flags, dir_fd=dir_fd)
    except OSError as error:
        linked = error.errno in (errno.ELOOP, errno.ENOTDIR)
        reason = "a symbolic link, or not a directory" if linked else error.strerror
        raise refusal(UNSAFE_FILE, path, f"{name!r} cannot be opened safely ({reason})") from error
