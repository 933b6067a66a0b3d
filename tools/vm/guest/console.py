"""Lines for the host, on the guest's serial console.

Two guest programs (the scenario and the hoststate loop) speak at once, so each line
goes out in one `write(2)` of well under the tty's 2 KiB chunk, which the kernel never
interleaves with another writer's. A `print` may write the text and its newline
separately, and another program's line then lands between them.
"""

from __future__ import annotations

import json
import os
from typing import Any


def line(tag: str, text: str) -> None:
    """`TAG text` and its newline in one write to standard output."""
    os.write(1, f"{tag} {text}\n".encode())


def ack(kind: str, **fields: Any) -> None:
    """What a call acknowledged, the moment it returned."""
    line("FICC-ACK", json.dumps({"kind": kind, **fields}, sort_keys=True))


def figure(fields: dict[str, Any]) -> None:
    line("FICC-FIGURE", json.dumps(fields, sort_keys=True))


def fail(text: str) -> None:
    line("FICC-FAIL", text)
