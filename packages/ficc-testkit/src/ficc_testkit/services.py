"""Cleaning up after a test that made real system services with the cgroupfs backend."""

from __future__ import annotations

import os

from ficc.execution.host.service.cgroupfs import CgroupfsService


def purge_cgroups(backend: CgroupfsService, base: str) -> None:
    """Stop and remove every service under `base` in every hierarchy, then `base`."""
    names = set()
    for hierarchy in backend.layout.hierarchies:
        top = os.path.join(hierarchy.mount, base)
        if os.path.isdir(top):
            names |= {e.name for e in os.scandir(top) if e.is_dir(follow_symlinks=False)}
    for name in names:
        handle = backend.adopt(name)
        if handle is not None:
            backend.stop(handle)
            backend.remove(handle)
    for hierarchy in backend.layout.hierarchies:
        top = os.path.join(hierarchy.mount, base)
        if os.path.isdir(top):
            os.rmdir(top)
