"""Shared test set-up: the example builders live beside the tests."""

from __future__ import annotations

import os
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).parent))

SOAK = os.environ.get("FICC_SOAK") == "1"
