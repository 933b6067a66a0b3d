"""Changes to a staged file that keep its bytes: what the host's identity check of a
staged input must see, though a digest of the content would not."""

from __future__ import annotations

import os
import shutil
from pathlib import Path


def touch(path: Path) -> None:
    """The same inode and bytes, another mtime."""
    os.utime(path, ns=(1, 1))


def replace_with_copy(path: Path) -> None:
    """The same bytes, mode, owner and mtime, in another inode put in its place."""
    copy = path.with_name("replacement")
    shutil.copy2(path, copy)
    st = path.stat()
    os.chown(copy, st.st_uid, st.st_gid)
    os.replace(copy, path)
