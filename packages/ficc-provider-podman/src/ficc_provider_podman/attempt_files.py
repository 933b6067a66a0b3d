"""The provider's part of an attempt's layout: `provider/` (root's, 0711, made by the
host) holds `inputs/` (root's: the inputs, hard-linked or copied), `run/` (the slot
account's: Podman's `--cidfile` and the run wrapper's exit status), the environment
file Podman reads and the provider's own record of the prepare (`state.json`).

`run/` belongs to the slot account, so everything in `provider/` is made, reset and
removed through descriptors from `provider/` itself (beneath.py); what cannot be
removed refuses by name (`slot_files_stuck`).
"""

from __future__ import annotations

import contextlib
import os
import stat

import msgspec

from ficc_provider_podman import account as accounts
from ficc_provider_podman import beneath, container, inputs
from ficc_provider_podman.account import SlotAccount
from ficc_provider_podman.container import ENVIRONMENT, INPUTS, RUN, STATE, AttemptPaths
from ficc_provider_podman.errors import ProviderError


class State(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What prepare recorded in the provider's layout (root 0600), for later methods."""

    attempt_id: str
    image_id: str
    barrier: str
    barrier_device: int
    barrier_inode: int
    inputs: list[inputs.PlacedInput]
    positive: list[str]
    negative: list[str]


def remove_provider_files(paths: AttemptPaths) -> None:
    """Everything the provider made in its part of the attempt layout. `run/` belongs
    to the slot account, so it is removed through descriptors, whatever its depth and
    whatever stands in it (beneath.py); what cannot be removed refuses by name."""
    provider = beneath.open_trusted(paths.provider)
    try:
        problems = [
            *beneath.remove_entry(provider, RUN, paths.run),
            *beneath.remove_entry(provider, INPUTS, paths.inputs),
        ]
        for name in (ENVIRONMENT, f"{ENVIRONMENT}.tmp", STATE, f"{STATE}.tmp"):
            problems += beneath.remove_entry(provider, name, f"{paths.provider}/{name}")
    finally:
        os.close(provider)
    beneath.refuse_leftovers(accounts.SLOT_FILES, problems, "the provider's attempt files")


def check_host_layout(paths: AttemptPaths, slot: SlotAccount) -> None:
    """The host created these; refuse anything that is not exactly its layout."""
    for path, uid, mode in (
        (paths.provider, 0, 0o711),
        (paths.control, 0, 0o755),
        (paths.storage, slot.uid, None),
    ):
        st = os.stat(path, follow_symlinks=False)
        if (
            not stat.S_ISDIR(st.st_mode)
            or st.st_uid != uid
            or (mode is not None and stat.S_IMODE(st.st_mode) != mode)
        ):
            raise ProviderError(
                "layout_unexpected", f"{path} is not the host's attempt layout; check the host"
            )
        if any(char in path for char in ":,\n"):
            raise ProviderError("path_unsupported", f"{path} cannot be given to podman -v")


def fresh_layout(paths: AttemptPaths, slot: SlotAccount) -> int:
    """(Re)create the provider's `inputs/` (root's) and `run/` (the slot account's,
    where Podman writes its container ID), with the exit status file blanked in `run/`;
    return `inputs/`'s descriptor. A repeated prepare starts from nothing."""
    provider = beneath.open_trusted(paths.provider)
    try:
        run = fresh_dir(provider, RUN, uid=slot.uid, gid=slot.gid, mode=0o700, where=paths.run)
        try:
            blank_exit_status(run, f"{container.EXIT_STATUS}.tmp", slot)
        finally:
            os.close(run)
        return fresh_dir(provider, INPUTS, uid=0, gid=slot.gid, mode=0o750, where=paths.inputs)
    finally:
        os.close(provider)


def blank_exit_status(run: int, name: str, slot: SlotAccount) -> None:
    """The file the run wrapper overwrites with the exit status, allocated on disk now
    (written and synced) so that recording the status needs no space at exit."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open(name, flags, 0o600, dir_fd=run)
    try:
        os.write(fd, container.EXIT_STATUS_BLANK)
        os.fchown(fd, slot.uid, slot.gid)
        os.fsync(fd)
    finally:
        os.close(fd)


def fresh_dir(parent: int, name: str, *, uid: int, gid: int, mode: int, where: str) -> int:
    """(Re)create a provider directory in `parent` and return its descriptor."""
    beneath.refuse_leftovers(
        accounts.SLOT_FILES, beneath.remove_entry(parent, name, where), "an earlier prepare's files"
    )
    return beneath.ensure_directory(parent, name, uid=uid, gid=gid, mode=mode, where=where)


def write_private(path: str, data: bytes, *, gid: int, mode: int) -> None:
    """Write a provider file complete under a temporary name, then rename it."""
    tmp = f"{path}.tmp"
    with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        os.fchown(fd, 0, gid)
        os.fchmod(fd, mode)
        inputs.write_all(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)


def write_environment(paths: AttemptPaths, environment: dict[str, str], gid: int) -> None:
    """Podman's --env-file: read by Podman as the slot account, never in a command line."""
    lines = []
    for key, value in sorted(environment.items()):
        if "\n" in value or "\r" in value:
            raise ProviderError(
                "environment_unsupported",
                f"environment value of {key} contains a line break, which Podman cannot pass",
            )
        lines.append(f"{key}={value}\n")
    write_private(paths.env_file, "".join(lines).encode(), gid=gid, mode=0o440)


def write_state(paths: AttemptPaths, state: State) -> None:
    write_private(paths.state_file, msgspec.json.encode(state), gid=0, mode=0o600)


def read_state(paths: AttemptPaths) -> State:
    try:
        fd = os.open(paths.state_file, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        raise ProviderError(
            "not_prepared", "the provider has no record of preparing this attempt"
        ) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != 0 or st.st_size > 1 << 20:
            raise ProviderError("not_prepared", f"{paths.state_file} is not the provider's record")
        data = os.read(fd, st.st_size + 1)
    finally:
        os.close(fd)
    return msgspec.json.decode(data, type=State)
