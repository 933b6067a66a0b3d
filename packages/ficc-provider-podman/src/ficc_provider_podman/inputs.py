"""Placing input objects into the attempt's runtime layout (prepare) and re-checking them.

Streamed inputs arrive as host capabilities: a root-owned, read-only file in the
host's private staging directory on the slot filesystem, with its recorded identity
(device, inode, mode, bytes, mtime_ns). They are hard-linked, never copied, into
`provider/inputs/<name>` after their identity is verified, so no stream is ever
duplicated, and the link keeps root ownership and read-only mode. Linking changes
ctime, which is why ctime is not part of the identity.

Administrator-local inputs (delivery "local") are copied from the configured path
into the same directory in bounded chunks, with the host's `check()` called before
each chunk, and their byte count and SHA-256 verified on the bytes actually written.
The copy lands on the slot's reserved filesystem, so the slot's storage bounds it.

`verify` re-checks every placed file against the identity recorded at prepare; start
refuses (`input_changed`) when any differs.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import stat
from collections.abc import Callable
from typing import Any

import msgspec

from ficc.execution import provider as sdk
from ficc_provider_podman.config import Config
from ficc_provider_podman.errors import ProviderError

CHUNK = 8 << 20
_NAME = re.compile(r"\A[A-Za-z0-9][A-Za-z0-9_.-]{0,127}\Z")


class FileIdentity(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What must stay equal for a file to be the one recorded (ctime excluded)."""

    device: int
    inode: int
    mode: int
    bytes: int
    mtime_ns: int

    @classmethod
    def of(cls, st: os.stat_result) -> FileIdentity:
        return cls(st.st_dev, st.st_ino, st.st_mode, st.st_size, st.st_mtime_ns)


class PlacedInput(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One input in the runtime layout, as recorded at prepare."""

    id: str
    name: str
    delivery: str
    identity: FileIdentity


def _changed(name: str, detail: str) -> ProviderError:
    return ProviderError(
        "input_changed",
        f"input {name!r} {detail}; start is refused: release the attempt and admit a new one",
    )


def _check_name(name: str) -> None:
    if not _NAME.match(name):
        raise ProviderError("input_name", f"input name {name!r} cannot be a file name")


def link_capability(capability: sdk.InputCapability, dir_fd: int, gid: int) -> PlacedInput:
    """Hard-link one streamed capability into `dir_fd` after verifying its identity."""
    name = capability.name
    _check_name(name)
    recorded = msgspec.convert(msgspec.to_builtins(capability.identity), FileIdentity)
    source = capability.path
    st = os.stat(source, follow_symlinks=False)
    _require_sealed(name, st, recorded, gid)
    try:
        os.link(source, name, dst_dir_fd=dir_fd, follow_symlinks=False)
    except FileExistsError:
        pass  # a repeated prepare: the check below decides whether it is the same file
    except OSError as error:
        raise ProviderError(
            "input_link_failed",
            f"cannot hard-link input {name!r} into the runtime layout ({error.strerror}); "
            "staging and the attempt must be on the same slot filesystem",
        ) from error
    linked = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    _require_sealed(name, linked, recorded, gid)
    return PlacedInput(capability.id, name, "stream", recorded)


def _require_sealed(name: str, st: os.stat_result, recorded: FileIdentity, gid: int) -> None:
    if not stat.S_ISREG(st.st_mode) or FileIdentity.of(st) != recorded:
        raise _changed(name, "is not the file recorded when its stream completed")
    if st.st_uid != 0 or st.st_gid != gid or st.st_mode & 0o222:
        raise _changed(name, "is no longer root-owned and read-only for the slot group")


def copy_local(
    obj: dict[str, Any], config: Config, dir_fd: int, gid: int, check: Callable[[], Any]
) -> PlacedInput:
    """Copy one administrator-local input in bounded chunks, verifying size and digest."""
    name = str(obj.get("name", ""))
    _check_name(name)
    local = config.local_input(str(obj.get("id", "")))
    if local is None or (local.bytes, local.digest) != (obj.get("bytes"), obj.get("digest")):
        raise ProviderError(
            "input_not_configured",
            f"local input {name!r} ({obj.get('id')}) is not configured with that size and "
            "digest; the administrator must add it to the provider's local_inputs",
        )
    with contextlib.suppress(FileNotFoundError):
        os.unlink(name, dir_fd=dir_fd)  # a repeated prepare copies again
    source = os.open(local.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        target = os.open(
            name,
            os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
            0o600,
            dir_fd=dir_fd,
        )
        try:
            digest, size = _copy(source, target, check)
            if (size, f"sha256:{digest}") != (local.bytes, local.digest):
                raise ProviderError(
                    "input_digest_mismatch",
                    f"local input {local.path} no longer has {local.bytes} bytes with digest "
                    f"{local.digest}; restore the file or fix the configuration",
                )
            os.fchown(target, 0, gid)
            os.fchmod(target, 0o440)
            os.fsync(target)
            identity = FileIdentity.of(os.fstat(target))
        finally:
            os.close(target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(name, dir_fd=dir_fd)
        raise
    finally:
        os.close(source)
    return PlacedInput(local.id, name, "local", identity)


def _copy(source: int, target: int, check: Callable[[], Any]) -> tuple[str, int]:
    digest = hashlib.sha256()
    size = 0
    while True:
        check()
        data = os.read(source, CHUNK)
        if not data:
            return digest.hexdigest(), size
        digest.update(data)
        write_all(target, data)
        size += len(data)


def write_all(fd: int, data: bytes) -> None:
    """Write every byte of `data`: os.write may write less than it was given."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def verify(placed: list[PlacedInput], dir_fd: int, gid: int) -> None:
    """Every placed input is still exactly the file recorded at prepare."""
    for entry in placed:
        try:
            st = os.stat(entry.name, dir_fd=dir_fd, follow_symlinks=False)
        except FileNotFoundError:
            raise _changed(entry.name, "is missing from the runtime layout") from None
        _require_sealed(entry.name, st, entry.identity, gid)
