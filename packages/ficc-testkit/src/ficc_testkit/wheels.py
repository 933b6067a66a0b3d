"""Provider wheels built, installed into a root-owned prefix and pinned for real.

A test daemon loads its provider from a prefix given with `--provider-path`, and pins it
by the digest `python -m ficc.execution provider-digest` computes over what is installed
there, exactly as an administrator does.
"""

from __future__ import annotations

import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

DIGEST = re.compile(r"sha256:[0-9a-f]{64}")


def pip(*args: str) -> None:
    """pip of this interpreter, quiet, writing world-readable files (root installs)."""
    subprocess.run(
        [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q", *args],
        check=True,
        umask=0o022,
    )


def build_wheel(source: Path, out: Path) -> Path:
    """The wheel of the project at `source`, built into `out` (no build isolation: the
    build tools are those of this environment, and no index is reached)."""
    out.mkdir(parents=True, exist_ok=True)
    pip("wheel", "--no-deps", "--no-build-isolation", "-w", str(out), str(source))
    name = _distribution(source).replace("-", "_")
    (wheel,) = out.glob(f"{name}-*.whl")
    return wheel


def _distribution(source: Path) -> str:
    """The `[project] name` of the pyproject.toml at `source`."""
    match = re.search(
        r'^name\s*=\s*"([^"]+)"', (source / "pyproject.toml").read_text(), re.MULTILINE
    )
    assert match is not None, f"{source}/pyproject.toml names no project"
    return match.group(1)


@dataclass(frozen=True)
class InstalledProvider:
    """A provider installed for a daemon: its site-packages and the digest that pins it."""

    site: Path
    digest: str


def provider_digest(provider_id: str, site: Path, python: str = sys.executable) -> str:
    """What `provider-digest` prints for the provider installed at `site`."""
    command = [python, "-m", "ficc.execution", "provider-digest", provider_id]
    result = subprocess.run(
        [*command, "--path", str(site), "--quiet"], check=True, capture_output=True, text=True
    )
    digest = result.stdout.strip()
    assert DIGEST.fullmatch(digest), result
    return digest


def install_into(wheel: Path, prefix: Path, *extra: str) -> Path:
    """pip install `wheel` under `prefix` as a system or virtualenv install would, never
    touching this environment's own copies; returns the prefix's site-packages.

    (Not `--target`: pip then records console scripts at paths that do not exist.)
    """
    pip(
        "install",
        "--no-deps",
        "--no-index",
        "--ignore-installed",
        "--prefix",
        str(prefix),
        *extra,
        str(wheel),
    )
    (site,) = prefix.glob("lib/python3*/site-packages")
    return site


def install_provider(wheel: Path, prefix: Path, provider_id: str = "test") -> InstalledProvider:
    """pip install `wheel` into the root-owned `prefix`, then ask the host for the pin."""
    site = install_into(wheel, prefix)
    return InstalledProvider(site, provider_digest(provider_id, site))
