"""What the running daemon is: the versions of its distributions and its start, read once.

Why once: the code that runs is what was imported when the daemon started, while the
installed metadata is what the next start will run. Read again at each request, the
metadata showed a release installed with `pip install` and not yet started as if it
ran, so the documented upgrade check ("its `daemon` line is the new version") passed
before the restart. The daemon captures `Build` while it opens (before it serves) and
reports that in `status`, the snapshot (`daemon: true`) and `ficc_build_info`; the
`status` command reads the installed metadata in its own process and says when the two
differ.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterable
from importlib import metadata
from typing import Final

__all__ = ["DISTRIBUTIONS", "HOST", "UNKNOWN", "Build", "capture", "installed_versions"]

HOST: Final = "ficc-executor-host"
DISTRIBUTIONS: Final = (HOST, "ficc-protocol", "ficc-provider-sdk")
"""The distributions the daemon is made of (providers are pinned by digest instead)."""
UNKNOWN: Final = "unknown"
"""The version of a distribution that is not installed (a source tree on sys.path)."""


@dataclasses.dataclass(frozen=True)
class Build:
    """The running daemon's distributions and versions, and when it started."""

    versions: tuple[tuple[str, str], ...]
    started_at_ms: int

    @property
    def version(self) -> str:
        """ficc-executor-host's version: the daemon's own."""
        return dict(self.versions).get(HOST, UNKNOWN)


def installed_versions(names: Iterable[str] = DISTRIBUTIONS) -> dict[str, str]:
    """What the installed metadata says now, by distribution (`unknown` if absent)."""
    found: dict[str, str] = {}
    for name in names:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:  # a source tree on sys.path, not installed
            found[name] = UNKNOWN
    return found


def capture() -> Build:
    """The versions installed now and the wall-clock time: call once, at the start."""
    versions = tuple(installed_versions().items())
    return Build(versions=versions, started_at_ms=time.time_ns() // 1_000_000)
