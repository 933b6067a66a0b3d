"""The real ledger, owned by whoever runs the tests.

The daemon's ledger must be root's (`Ledger.create`/`open` check it); these tests of the
ledger's own logic name this process's UID as the owner instead, so they run in the
fast lane without root. Tests of what the daemon refuses about ownership pass root
explicitly and keep the `root` marker.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ficc.execution.host.ledger.store import Ledger

OWNER = os.geteuid()


def create_ledger(state_dir: str | Path, *args: Any, **kwargs: Any) -> Ledger:
    return Ledger.create(str(state_dir), *args, **{"owner": OWNER, **kwargs})


def open_ledger(state_dir: str | Path, *args: Any, **kwargs: Any) -> Ledger:
    return Ledger.open(str(state_dir), *args, **{"owner": OWNER, **kwargs})
