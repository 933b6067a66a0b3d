"""Changes behind the host's back that its checks must see: a staged file changed but
keeping its bytes (a digest of the content would not see it), a service's limit
raised after the host set it."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from ficc.execution.host.service import cgroups


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


def service_limit_file(pid: int, attempt_id: str, name: str = "pids.max") -> Path:
    """The limit file `name` (`pids.max`, `memory.max`, ...) of the attempt's service
    cgroup that holds `pid`, in the tree where the host enforces it: the unified tree
    when it has the controller, else the v1 hierarchy of that controller. Writing it as
    root changes the limit behind the host's back."""
    controller = name.split(".", 1)[0]
    hierarchies = cgroups.parse_mountinfo(Path("/proc/self/mountinfo").read_text())
    unified = [h.mount for h in hierarchies if h.version == 2]
    v2 = bool(unified) and controller in Path(unified[0], "cgroup.controllers").read_text().split()
    (mount,) = unified[:1] if v2 else [h.mount for h in hierarchies if controller in h.controllers]
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        ids, names, path = line.split(":", 2)
        if (ids == "0") if v2 else (ids != "0" and controller in names.split(",")):
            parts = path.strip("/").split("/")
            for end, part in enumerate(parts, 1):
                if part.startswith("ficc-work-") and attempt_id in part:
                    return Path(mount, *parts[:end], name)
    raise AssertionError(f"process {pid} is in no service cgroup of attempt {attempt_id}")
