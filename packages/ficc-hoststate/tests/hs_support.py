"""Helpers shared by the ficc-hoststate tests (imported by name; see conftest.py)."""

from __future__ import annotations

import hashlib
import os

HOST = "host-a"


def plan(n: int | str) -> str:
    """A valid, distinct plan hash per `n`."""
    return "sha256:" + hashlib.sha256(str(n).encode()).hexdigest()


def soak_size(ci: int, soak: int) -> int:
    """The loop size: the soak size under FICC_SOAK=1 (nox -s soak), else the CI size."""
    return soak if os.environ.get("FICC_SOAK") == "1" else ci
