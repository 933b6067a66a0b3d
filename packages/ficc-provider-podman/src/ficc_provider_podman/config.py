"""The administrator's configuration of the Podman provider, validated once.

The configuration comes from the host's private administrator file (never from a
request). `load` decodes it strictly (unknown fields are refused) and then checks
every file it names against the real filesystem, so a typo or a swapped file is
found when the daemon starts (`configure`), and again before every attempt
(`probe`), not halfway through a job.

Shape (JSON/TOML object passed to `configure`)::

    podman: "/usr/bin/podman"            absolute, root-owned, not group/other-writable
    runtime: "runc"                      the only runtime verified on cgroup v1 hybrid
    nofile: 1024                         RLIMIT_NOFILE of the container (<= 20000)
    storage_target: "/work"              where the attempt's storage appears (read-write)
    inputs_target: "/inputs"             where inputs appear, by name (read-only)
    images: [{digest, archive, archive_sha256, image_id}]
        `digest` is what plans name in job.runtime.image_digest
    local_inputs: [{id, path, bytes, digest}]
        administrator-local input objects (delivery "local"), by object id
    devices: [...]                       what a plan may ask for by name, each a bundle
        {name, path}                     one character node (a bundle of one own node)
        {name, kind, nodes, shared_nodes, mounts: [{source, target}], environment}
        {name, cdi: {spec, device, exclude}}   one device of a CDI spec (JSON)
        resolved into exact nodes and file identities by bundles.py
    runtime_devices: ["/dev/null", ...]  nodes Podman itself needs in the service
"""

from __future__ import annotations

import hashlib
import os
import stat
from typing import Annotated, Any

import msgspec

from ficc.execution import plan as planlib
from ficc_provider_podman.errors import ProviderError

Sha256 = Annotated[str, msgspec.Meta(pattern=r"\Asha256:[0-9a-f]{64}\Z")]
AbsolutePath = Annotated[str, msgspec.Meta(pattern=r"\A/[^\x00\n]*\Z", max_length=4096)]
Name = Annotated[str, msgspec.Meta(pattern=r"\A[a-z][a-z0-9_.-]{0,79}\Z")]
Identity = Annotated[str, msgspec.Meta(pattern=r"\A[0-9a-f]{32}\Z")]
Target = Annotated[str, msgspec.Meta(pattern=r"\A/[A-Za-z0-9_.-]+\Z")]

MAX_ULIMIT = 20000
"""Root on these hosts lacks CAP_SYS_RESOURCE: higher rlimits cannot be set."""

DEFAULT_RUNTIME_DEVICES = ("/dev/null", "/dev/random", "/dev/urandom")
"""Podman, conmon and runc open /dev/null inside the service; the other two are what
payloads most often need. Every node Podman mounts by default but not listed here is
a negative device (visible in the container, refused by the device policy)."""

OCI_DEFAULT_DEVICES = (
    "/dev/null",
    "/dev/zero",
    "/dev/full",
    "/dev/random",
    "/dev/urandom",
    "/dev/tty",
)
"""The nodes runc always puts in a container's /dev (rootless: bind mounts)."""


class _Strict(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    pass


class Image(_Strict, frozen=True):
    digest: Sha256
    archive: AbsolutePath
    archive_sha256: Sha256
    image_id: Sha256


class LocalInput(_Strict, frozen=True):
    id: Identity
    path: AbsolutePath
    bytes: planlib.Count
    digest: Sha256


Kind = Annotated[
    str, msgspec.Meta(pattern=r"\A[a-z0-9][a-z0-9.-]{0,252}/[a-zA-Z0-9][a-zA-Z0-9_.-]{0,62}\Z")
]
"""A device kind, as CDI writes it: `vendor.example/class`."""
EnvName = Annotated[str, msgspec.Meta(pattern=r"\A[A-Za-z_][A-Za-z0-9_]{0,127}\Z")]
EnvValue = Annotated[str, msgspec.Meta(pattern=r"\A[^\n\r\x00]*\Z", max_length=4096)]
CdiName = Annotated[
    str, msgspec.Meta(pattern=r"\A[^=\s]{1,320}=[a-zA-Z0-9][a-zA-Z0-9_.:-]{0,255}\Z")
]
Nodes = Annotated[list[AbsolutePath], msgspec.Meta(max_length=16)]


class DeviceMount(_Strict, frozen=True):
    """A host file mounted read-only into the job (a driver library, a tool)."""

    source: AbsolutePath
    target: AbsolutePath


class CdiDevice(_Strict, frozen=True):
    """One device of a CDI spec file; `exclude`: container paths of the spec's mounts
    to leave out (a host socket, say, which is never lent to a job)."""

    spec: AbsolutePath
    device: CdiName
    exclude: Annotated[list[AbsolutePath], msgspec.Meta(max_length=64)] = []


class Device(_Strict, frozen=True):
    """A device plans ask for by `name`, in one of three forms: `path` (one node),
    `kind` with `nodes` (and `shared_nodes`, `mounts`, `environment`), or `cdi`."""

    name: Name
    path: AbsolutePath | None = None
    kind: Kind | None = None
    nodes: Nodes = []
    shared_nodes: Nodes = []
    mounts: Annotated[list[DeviceMount], msgspec.Meta(max_length=256)] = []
    environment: dict[EnvName, EnvValue] = {}
    cdi: CdiDevice | None = None

    def __post_init__(self) -> None:
        bundle = bool(self.kind or self.nodes or self.shared_nodes or self.mounts)
        forms = [self.path is not None, bundle or bool(self.environment), self.cdi is not None]
        if forms.count(True) != 1:
            raise ValueError(
                f"device {self.name!r} must have exactly one of `path`, `kind` with `nodes`,"
                " or `cdi`"
            )
        if forms[1] and (self.kind is None or not self.nodes):
            raise ValueError(f"device {self.name!r}: a bundle needs `kind` and its own `nodes`")


class Config(_Strict, frozen=True):
    images: Annotated[list[Image], msgspec.Meta(min_length=1, max_length=64)]
    podman: AbsolutePath = "/usr/bin/podman"
    runtime: str = "runc"
    nofile: Annotated[int, msgspec.Meta(ge=64, le=MAX_ULIMIT)] = 1024
    storage_target: Target = "/work"
    inputs_target: Target = "/inputs"
    local_inputs: Annotated[list[LocalInput], msgspec.Meta(max_length=1024)] = []
    devices: Annotated[list[Device], msgspec.Meta(max_length=64)] = []
    runtime_devices: Annotated[list[AbsolutePath], msgspec.Meta(max_length=16)] = msgspec.field(
        default_factory=lambda: list(DEFAULT_RUNTIME_DEVICES)
    )

    def __post_init__(self) -> None:
        if self.runtime != "runc":
            raise ValueError("runtime must be 'runc' (crun refuses hybrid cgroup hosts)")
        if self.storage_target == self.inputs_target or "/.ficc" in (
            self.storage_target,
            self.inputs_target,
        ):
            raise ValueError("storage_target and inputs_target must differ and not be /.ficc")
        for what, values in (
            ("image digest", [i.digest for i in self.images]),
            ("local input id", [i.id for i in self.local_inputs]),
            ("device name", [d.name for d in self.devices]),
            ("device path", [d.path for d in self.devices if d.path] + list(self.runtime_devices)),
        ):
            if len(set(values)) != len(values):
                raise ValueError(f"a {what} is listed twice")

    def image(self, digest: str) -> Image | None:
        return next((i for i in self.images if i.digest == digest), None)

    def local_input(self, object_id: str) -> LocalInput | None:
        return next((i for i in self.local_inputs if i.id == object_id), None)


def _config_error(message: str) -> ProviderError:
    return ProviderError(
        "podman_config",
        f"{message}; fix the Podman provider's section of the administrator configuration",
    )


def load(configuration: Any) -> Config:
    """Decode and check the configuration; refuses with `podman_config`."""
    try:
        config = msgspec.convert(configuration, Config, strict=True)
    except msgspec.ValidationError as error:
        raise _config_error(f"invalid configuration: {error}") from error
    check_files(config)
    return config


def _trusted_stat(path: str, what: str, *, writable: bool = False) -> os.stat_result:
    """lstat a root-owned file, refusing links; only root may change it unless
    `writable` (device nodes such as /dev/null are world-writable by design)."""
    if os.path.normpath(path) != path:
        raise _config_error(f"{what} {path!r} is not a normalized absolute path")
    try:
        st = os.stat(path, follow_symlinks=False)
    except OSError as error:
        raise _config_error(f"{what} {path}: {error.strerror}") from error
    if stat.S_ISLNK(st.st_mode):
        raise _config_error(f"{what} {path} is a symbolic link; name the file itself")
    if st.st_uid != 0 or (st.st_mode & 0o022 and not writable):
        raise _config_error(f"{what} {path} must be owned by root and writable only by root")
    return st


def check_files(config: Config) -> None:
    """Every named file exists with the right type and owner (cheap: no hashing); the
    devices plans name are resolved and re-checked by bundles.py."""
    st = _trusted_stat(config.podman, "podman")
    if not stat.S_ISREG(st.st_mode) or not st.st_mode & 0o001:
        raise _config_error(f"podman {config.podman} is not an executable regular file")
    for image in config.images:
        st = _trusted_stat(image.archive, "image archive")
        if not stat.S_ISREG(st.st_mode):
            raise _config_error(f"image archive {image.archive} is not a regular file")
    for local in config.local_inputs:
        st = _trusted_stat(local.path, "local input")
        if not stat.S_ISREG(st.st_mode) or st.st_size != local.bytes:
            raise _config_error(
                f"local input {local.path} is not a regular file of {local.bytes} bytes"
            )
    for path in config.runtime_devices:  # the devices plans name: bundles.py
        st = _trusted_stat(path, "device", writable=True)
        if not stat.S_ISCHR(st.st_mode):
            raise _config_error(f"device {path} is not a character device node")


def sha256_of_fd(fd: int, *, between: Any = None, chunk: int = 8 << 20) -> str:
    """`sha256:<hex>` of an open file from offset 0, calling `between()` per chunk."""
    digest = hashlib.sha256()
    offset = 0
    while True:
        if between is not None:
            between()
        data = os.pread(fd, chunk, offset)
        if not data:
            return f"sha256:{digest.hexdigest()}"
        digest.update(data)
        offset += len(data)
