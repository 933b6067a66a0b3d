"""The installed versions of the distributions the command is made of, as `--version`
prints them and `serve` logs them."""

from __future__ import annotations

import platform
from importlib import metadata

PROG = "ficc-executor"


def versions() -> dict[str, str]:
    """Installed versions of the distributions this command is made of."""
    found: dict[str, str] = {}
    for name in ("ficc-executor-host", "ficc-protocol"):
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:  # a source tree on sys.path, not installed
            found[name] = "unknown"
    return found


def version_line() -> str:
    """`ficc-executor 0.1.0 (ficc-protocol 0.1.0, Python 3.11.2)`."""
    found = versions()
    return (
        f"{PROG} {found['ficc-executor-host']} (ficc-protocol {found['ficc-protocol']}, "
        f"Python {platform.python_version()})"
    )
