"""An attempt's files on its slot, as the daemon uses them: the port to the slot's disk.

The runner and the request handlers create, check, open and remove a slot's attempt
directories through `SlotFiles`, kept in the slot's runtime (`SlotRuntime.files`), as
they reach services through `SystemService`. (They still read the log files' sizes and
identities, and the release marker's presence, by their paths.) `ReservedSlot` is the
one the daemon and the conformance kit build: the attempt layout (layout.py) on the
slot's reserved filesystem, which it checks (slotfs.py) before an attempt's storage is
used. Everything it creates belongs to root or the slot account, so it needs root.

The test kit's `FakeSlotFiles` implements the same port on a plain directory, without
ownership changes or filesystem checks, so the runner's own decisions (what a failed
layout, a stuck removal or a freed storage directory leads to) run in the fast lane.
The real one is proved by the root suites.
"""

from __future__ import annotations

import os
from typing import Protocol

from ficc.execution import plan as planlib
from ficc.execution import provider as sdk
from ficc.execution.errors import ErrorCode
from ficc.execution.host.core.codes import HostCode
from ficc.execution.host.core.errors import HostError
from ficc.execution.host.storage import slotfs
from ficc.execution.host.storage.layout import STORAGE, AttemptPaths, Layout, Part

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
