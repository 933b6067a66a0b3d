"""Root-owned directories and real slot filesystems for a test daemon.

The daemon refuses a configuration, state or socket directory with a group- or
other-writable ancestor, and a slot that is not a filesystem of its own: so a test's
tree lives under /run in a root 0755 directory (`private_directory`), and each slot is
an ext4 image loop-mounted by the shipped provisioning code (`slot_filesystems`).
"""

from __future__ import annotations

import os
import subprocess
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ficc.execution.host.cli import provision


def private_directory(parent: str, prefix: str) -> Path:
    """A new root-owned 0755 directory under `parent` (not group/other-writable)."""
    path = Path(tempfile.mkdtemp(prefix=prefix, dir=parent))
    os.chmod(path, 0o755)  # noqa: S103 - the accounts the daemon serves traverse it
    return path


def remove_tree(path: Path) -> None:
    """`rm -rf` that stays on `path`'s filesystem (a mount left below is not entered)."""
    subprocess.run(["rm", "-rf", "--one-file-system", str(path)], check=False)


@dataclass(frozen=True)
class SlotFilesystem:
    """A real slot filesystem made for a test: an ext4 image loop-mounted on `path`."""

    path: Path
    image: Path
    filesystem_uuid: str
    size: int
    """The bytes the slot account can use (the configured `storage_bytes`)."""

    def remove(self) -> None:
        """Unmount it and delete its image."""
        provision.remove_slot(str(self.path), str(self.image))


def slot_filesystems(base: Path, sizes: Sequence[int], storage_inodes: int) -> list[SlotFilesystem]:
    """Slot filesystems of these sizes under `base/slots` (images in `base/slot-images`).

    The caller removes them (`remove_slots`), also when the test fails; what was made
    before a failure here is removed here. `base/slots` is made root 0755 if absent.
    """
    images, mounts = base / "slot-images", base / "slots"
    images.mkdir(mode=0o700, exist_ok=True)
    mounts.mkdir(mode=0o755, exist_ok=True)
    os.chmod(mounts, 0o755)  # noqa: S103 - as the administrator makes it; not the umask's
    made: list[SlotFilesystem] = []
    try:
        for i, size in enumerate(sizes):
            path, image = mounts / f"s{i}", images / f"s{i}.img"
            slot = provision.create_image_slot(str(image), str(path), size, storage_inodes)
            made.append(SlotFilesystem(path, image, slot.filesystem_uuid, size))
    except BaseException:
        remove_slots(made)
        raise
    return made


def remove_slots(slots: Sequence[SlotFilesystem]) -> None:
    """Unmount and delete every slot filesystem of `slots`."""
    for slot in slots:
        slot.remove()
