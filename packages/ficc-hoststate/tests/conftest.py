"""Shared fixtures: a fresh, correctly owned state directory per test.

The tests run with `--import-mode=importlib`, so this directory is put on sys.path
for the helper modules (hs_support, hs_mutator) and for child processes.
"""

from __future__ import annotations

import os
import pathlib
import sys

import pytest

TESTS = pathlib.Path(__file__).resolve().parent
if str(TESTS) not in sys.path:
    sys.path.insert(0, str(TESTS))


@pytest.fixture
def store(tmp_path: pathlib.Path) -> pathlib.Path:
    """An empty state directory as bootstrap would make it: owned by us, mode 0700."""
    path = tmp_path / "state"
    path.mkdir(mode=0o700)
    os.chmod(path, 0o700)
    return path
