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

One exception, which carries nothing of the payload's output: a payload that ends with
126 or 127 may never have run, because the barrier could not execute its program
(docs/providers.md, "The barrier"). The barrier then ends the log with one line,
`ficc-barrier: cannot execute PATH: REASON (errno N)`. `exec_failure` looks for
exactly that line, for the plan's own argv[0], at the very end of the log, and
answers with a line the host writes itself from argv[0] and the errno number: a
payload that printed something else, or that ran and forged the line, gets no more
into the daemon's log than a number it could as well have made its exit status.
"""

from __future__ import annotations

import errno
import os
import re

from ficc.execution.host.core.errors import HostError
from ficc.execution.host.linux import fsutil
from ficc.execution.host.storage.layout import LOGS, STDERR
from ficc.execution.host.storage.slot_files import SlotFiles

TAIL_BYTES = 2048
"""At most this much of the end of the log is read and logged."""
EXEC_FAILED_STATUSES = frozenset({126, 127})
"""A shell's statuses for a program that cannot be executed (126) or does not exist
(127), which the barrier uses when the payload's `execve` fails."""
_EXEC_FAILURE = "ficc-barrier: cannot execute {path}: "
_REASON = re.compile(rb"\A[^\n]{1,160} \(errno (?P<errno>[0-9]{1,4})\)\n\Z")


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
    data = _tail(files, attempt_id, TAIL_BYTES + 1)
    return sanitized(data[-TAIL_BYTES:], cut=len(data) > TAIL_BYTES)


def exec_failure(files: SlotFiles, attempt_id: str, program: str, exit_code: int) -> str:
    """The barrier's report that the payload's `program` could not be executed, in the
    host's own words (see the module docstring); empty unless the attempt's stderr ends
    with that report and its errno agrees with `exit_code` (127 for ENOENT, else 126)."""
    if exit_code not in EXEC_FAILED_STATUSES:
        return ""
    prefix = _EXEC_FAILURE.format(path=program).encode("utf-8", "surrogateescape")
    data = _tail(files, attempt_id, len(prefix) + 200)
    head, found, reason = data.rpartition(prefix)
    match = _REASON.match(reason) if found else None
    if match is None or (head and not head.endswith(b"\n")):
        return ""
    number = int(match["errno"])
    if number not in errno.errorcode or (number == errno.ENOENT) != (exit_code == 127):
        return ""
    said = _EXEC_FAILURE.format(path=program) + f"{os.strerror(number)} (errno {number})"
    return sanitized(said.encode("utf-8", "surrogateescape"), cut=False)


def _tail(files: SlotFiles, attempt_id: str, length: int) -> bytes:
    """The last `length` bytes of the attempt's stderr log; empty when it cannot be
    read (a diagnostic never fails its caller)."""
    try:
        logs_fd = files.open_part(attempt_id, LOGS)
        try:
            fd = fsutil.open_regular_at(logs_fd, STDERR, owner_uid=0)
        finally:
            os.close(logs_fd)
    except (HostError, OSError):
        return b""
    try:
        size = os.fstat(fd).st_size
        return os.pread(fd, length, max(0, size - length))
    except OSError:
        return b""
    finally:
        os.close(fd)
