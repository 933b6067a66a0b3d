"""What the runtime printed when an attempt failed before its payload ran.

When a start fails before the barrier is released (the runtime could not create the
container, say), the only account of why is what the provider's runtime wrote to the
attempt's stderr log, and release deletes that log. So the runner reads a bounded tail
of it and logs it at `error` priority with the attempt ID: the administrator sees the
runtime's own words (`runc create failed: ... permission denied`) in the journal, not
only a reason code.

Only output written before the release is ever read here: after the release the log
holds the payload's output, which never reaches the daemon's log. The text is treated
as untrusted (the slot account's processes wrote it): bounded, decoded with
replacement, and every control character but newline and tab shown as `?`.
"""

from __future__ import annotations

import os

from ficc.execution.host.core.errors import HostError
from ficc.execution.host.linux import fsutil
from ficc.execution.host.storage.layout import LOGS, STDERR
from ficc.execution.host.storage.slot_files import SlotFiles

TAIL_BYTES = 2048
"""At most this much of the end of the log is read and logged."""


def sanitized(data: bytes, *, cut: bool) -> str:
    """`data` as one printable text; `cut`: it starts mid-file, so drop the partial
    first line (unless that would drop everything)."""
    text = data.decode("utf-8", errors="replace")
    if cut and "\n" in text.rstrip("\n"):
        text = text.split("\n", 1)[1]
    shown = "".join(c if c.isprintable() or c in "\n\t" else "?" for c in text)
    return shown.strip()


def stderr_tail(files: SlotFiles, attempt_id: str) -> str:
    """The sanitized last TAIL_BYTES of the attempt's stderr log; empty when there is
    none or it cannot be read (this is a diagnostic: it never fails the caller)."""
    try:
        logs_fd = files.open_part(attempt_id, LOGS)
        try:
            fd = fsutil.open_regular_at(logs_fd, STDERR, owner_uid=0)
        finally:
            os.close(logs_fd)
    except (HostError, OSError):
        return ""
    try:
        size = os.fstat(fd).st_size
        start = max(0, size - TAIL_BYTES)
        data = os.pread(fd, TAIL_BYTES, start)
    except OSError:
        return ""
    finally:
        os.close(fd)
    return sanitized(data, cut=start > 0)
