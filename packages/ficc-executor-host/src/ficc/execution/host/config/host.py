"""The checks of the host a configuration describes: its directories, slots, accounts
and metrics file, at start and by `check-config`."""

from __future__ import annotations

import os
import posixpath
import pwd

from ficc.execution.host.config.model import Config
from ficc.execution.host.config.trusted import open_trusted_directory, refuse
from ficc.execution.host.core.codes import HostCode
from ficc.execution.host.storage import slotfs

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
            raise refuse(
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
        raise refuse(
            HostCode.CONFIG_INVALID,
            key,
            f"{path!r} does not name a {METRICS_TEXTFILE_SUFFIX} file",
            "name the file node_exporter's textfile collector reads, e.g. ficc.prom",
        )
    os.close(open_trusted_directory(parent, key, HostCode.HOST_PATH_UNSAFE))
