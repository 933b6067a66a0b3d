"""An attempt's files on its slot, as the daemon uses them: the port to the slot's disk.

The runner and the request handlers create, check, open and remove a slot's attempt
directories through `SlotFiles`, kept in the slot's runtime (`SlotRuntime.files`), as
they reach services through `SystemService`. (They still read the log files' sizes and
identities, and the release marker's presence, by their paths.) `ReservedSlot` is the
one the daemon and the conformance kit build: the attempt layout (layout.py) on the
slot's reserved filesystem, which it checks (slotfs.py) before an attempt's storage is
used. Everything it creates belongs to root or the slot account, so it needs root.
`check()` is the slot's health check (every check of the slot as a whole), which the
daemon runs on its own schedule to take a broken slot out of the offer.

The test kit's `FakeSlotFiles` implements the same port on a plain directory, without
ownership changes or filesystem checks, so the runner's own decisions (what a failed
layout, a stuck removal or a freed storage directory leads to) run in the fast lane.
The real one is proved by the root suites.
"""

from __future__ import annotations

import os
import stat
from typing import Final, Protocol

from ficc.execution import plan as planlib
from ficc.execution import provider as sdk
from ficc.execution.errors import ErrorCode
from ficc.execution.host.core.codes import HostCode
from ficc.execution.host.core.errors import HostError
from ficc.execution.host.storage import slotfs
from ficc.execution.host.storage.layout import (
    ATTEMPTS_DIRECTORY,
    STORAGE,
    AttemptPaths,
    Layout,
    Part,
)
from ficc.execution.host.storage.staging import STAGING_DIRECTORY

__all__ = ["ReservedSlot", "SlotFiles"]


class SlotFiles(Protocol):
    """What the daemon does with the attempt directories of one slot."""

    def paths(self, attempt_id: str) -> AttemptPaths:
        """Where the attempt's parts are (no I/O)."""
        ...

    def verify(self) -> None:
        """Refuse (`slot_filesystem`, `slot_identity`) unless the slot is still its
        reserved filesystem."""
        ...

    def check(self) -> None:
        """Every check of the slot as a whole, for its health: `verify()`, its account
        (`slot_account`) and the host's directories at its top (`layout_unsafe`,
        `storage_unverified`). It changes nothing an attempt uses (only allocates an
        image's holes again, as `verify()` does), so it may run beside an attempt."""
        ...

    def create(self, attempt_id: str) -> AttemptPaths:
        """Create the attempt's layout, or check an existing one (idempotent)."""
        ...

    def storage_binding(self, attempt_id: str, limits: planlib.Limits) -> sdk.StorageBinding:
        """The attempt's storage directory, checked to be on the slot's filesystem."""
        ...

    def open_part(self, attempt_id: str, part: Part) -> int:
        """One part of the attempt as a checked directory fd."""
        ...

    def in_use(self) -> tuple[int, int]:
        """(bytes, inodes) in use on the slot's filesystem."""
        ...

    def usage(self) -> slotfs.Usage:
        """What an unprivileged writer still has on the slot (is it full?)."""
        ...

    def storage_freed(self, attempt_id: str) -> bool:
        """Whether an earlier release already deleted what the payload wrote."""
        ...

    def free_payload_data(self, attempt_id: str) -> None:
        """Delete what the payload wrote (storage and logs); absent is success."""
        ...

    def remove(self, attempt_id: str) -> None:
        """Delete the attempt's layout; absent is success."""
        ...

    def leftovers(self) -> list[str]:
        """Every entry left under the slot's attempt and staging directories."""
        ...


class ReservedSlot(Layout):
    """The attempt layout on the slot's reserved filesystem (the daemon's `SlotFiles`)."""

    def __init__(self, slot: slotfs.SlotSpec, open_parent: slotfs.OpenParent) -> None:
        super().__init__(slot)
        self._slot = slot
        self._open_parent = open_parent

    def verify(self) -> None:
        slotfs.verify(self._slot, self._open_parent)

    def check(self) -> None:
        self.verify()
        slotfs.check_account(self._slot, f"slot {self._slot.id}")
        try:
            _check_top(self._slot)
        except OSError as error:
            raise HostError(
                HostCode.SLOT_FILESYSTEM,
                f"slot {self._slot.id}: cannot check {self._slot.path}: {error}; check the mount",
            ) from None

    def storage_binding(self, attempt_id: str, limits: planlib.Limits) -> sdk.StorageBinding:
        """The slot-owned storage directory, on the slot's filesystem (not a mount on it)."""
        fd = self.open_part(attempt_id, STORAGE)
        try:
            st = os.fstat(fd)
        finally:
            os.close(fd)
        slot = os.stat(self.slot_path, follow_symlinks=False)
        paths = self.paths(attempt_id)
        if st.st_dev != slot.st_dev:
            raise HostError(
                HostCode.STORAGE_UNVERIFIED,
                f"{paths.storage} is not on the slot's reserved filesystem; check the slot",
            )
        return sdk.StorageBinding(
            path=paths.storage,
            device=st.st_dev,
            inode=st.st_ino,
            bytes=limits.storage_bytes,
            inodes=limits.storage_inodes,
        )

    def in_use(self) -> tuple[int, int]:
        return slotfs.in_use(self.slot_path)

    def usage(self) -> slotfs.Usage:
        return slotfs.usage(self.slot_path)

    def storage_freed(self, attempt_id: str) -> bool:
        """The storage directory is gone from its (checked) attempt directory, or the
        attempt directory itself is gone."""
        try:
            attempt_fd = self.open_attempt(attempt_id)
        except HostError as error:
            if error.code == ErrorCode.NOT_FOUND:
                return True
            raise
        try:
            os.stat(STORAGE.name, dir_fd=attempt_fd, follow_symlinks=False)
        except FileNotFoundError:
            return True
        finally:
            os.close(attempt_fd)
        return False


_TOP: Final = (ATTEMPTS_DIRECTORY, STAGING_DIRECTORY)
"""The host's directories at the top of a slot (made on first use, never removed)."""


def _check_top(slot: slotfs.SlotSpec) -> None:
    """The slot's directory and the host's directories in it, as far as they exist: root's,
    not writable by group or others, on the slot's own filesystem (a mount over one of
    them would take what the host writes off the slot). Tolerant of a directory the
    host is making right now (root 0700 before its final mode), so it never races an
    attempt's own use of the slot."""
    fd = os.open(slot.path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        top = os.fstat(fd)
        _check_private(f"slot {slot.id}", slot.path, top)
        for name in _TOP:
            try:
                st = os.stat(name, dir_fd=fd, follow_symlinks=False)
            except FileNotFoundError:
                continue
            _check_private(f"slot {slot.id}", f"{slot.path}/{name}", st)
            if st.st_dev != top.st_dev:
                raise HostError(
                    HostCode.STORAGE_UNVERIFIED,
                    f"slot {slot.id}: another filesystem is mounted on {slot.path}/{name};"
                    " unmount it (what the host writes there must stay on the slot)",
                )
    finally:
        os.close(fd)


def _check_private(key: str, path: str, st: os.stat_result) -> None:
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != 0 or st.st_mode & 0o022:
        raise HostError(
            ErrorCode.LAYOUT_UNSAFE,
            f"{key}: {path} is {stat.filemode(st.st_mode)} owned by uid {st.st_uid}, not a"
            " directory of root's that only root may write; investigate who changed it,"
            " then restore it (chown root:root, chmod go-w) or remove it",
        )
