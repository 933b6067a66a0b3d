"""Nothing is written off the slot: a mount inside a slot receives no byte.

The slot's own filesystem is verified at its root. A mount over one of the host's
directories inside it (a tmpfs over `<slot>/ficc`, a host directory bind-mounted over
`<slot>/ficc-staging`: a stray mount, an administrator's mistake) would escape the
slot's disk bound. Every directory the host writes for an attempt is checked, on its
opened descriptor, to be on the slot's filesystem before anything is written there:
the attempt fails `storage_unverified` and the mounted filesystem stays empty.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

from ficc_testkit.driver import StreamedInput, attempt, row_code, rows
from ficc_testkit.host import Daemon
from ficc_testkit.waits import wait_for

SETTLED = {"failed", "unknown", "cancelled", "expired", "succeeded"}


@contextlib.contextmanager
def mounted_over(daemon: Daemon, name: str, how: list[str]) -> Iterator[list[Path]]:
    """`how` mounted over `<slot>/<name>` of every slot; the mounted roots."""
    targets = [Path(slot.path) / name for slot in daemon.layout.config.slots]
    sources: list[Path] = []
    try:
        for target in targets:
            target.mkdir(mode=0o700, exist_ok=True)
            if how[0] == "bind":
                source = Path(tempfile.mkdtemp(prefix="ficc-t-offslot-", dir="/run"))
                sources.append(source)
                subprocess.run(["mount", "--bind", str(source), str(target)], check=True)
            else:
                subprocess.run(["mount", *how, str(target)], check=True)
                sources.append(target)
        yield sources
    finally:
        for target in targets:
            subprocess.run(["umount", str(target)], capture_output=True, check=False)
        for source in sources:
            if source.is_relative_to("/run"):
                os.rmdir(source)


def test_a_tmpfs_over_the_attempts_directory_receives_nothing(daemon: Daemon) -> None:
    """The tmpfs has the owner and mode the host gives `ficc/` (root, 0711): only its
    filesystem tells it apart."""
    with mounted_over(daemon, "ficc", ["-t", "tmpfs", "-o", "size=8m,mode=0711", "tmpfs"]) as roots:
        plan = daemon.plan()
        rows(daemon.prepare([plan]))
        done = daemon.wait_state(plan, lambda r: r.state in SETTLED, "the refusal")
        assert (done.state, done.reason) == ("failed", "storage_unverified"), done
        for root in roots:
            assert list(root.iterdir()) == [], f"written off the slot: {list(root.iterdir())}"
    released = wait_for(lambda: _released(daemon, plan), "the release")
    assert released.outcome == "failed"


def test_a_host_directory_over_the_staging_directory_receives_no_input(daemon: Daemon) -> None:
    with mounted_over(daemon, "ficc-staging", ["bind"]) as sources:
        item = StreamedInput(os.urandom(256 * 1024))
        plan = daemon.plan(inputs=[item])
        rows(daemon.prepare([plan]))
        done = daemon.wait_state(plan, lambda r: r.state in SETTLED, "the refusal")
        assert (done.state, done.reason) == ("failed", "storage_unverified"), done
        written = daemon.input_write(plan, item, 0, item.data)
        assert row_code(written) is not None, written
        for source in sources:
            assert list(source.iterdir()) == [], f"written off the slot: {list(source.iterdir())}"
    wait_for(lambda: _released(daemon, plan), "the release")


def _released(daemon: Daemon, plan: object) -> object:
    row = attempt(daemon.observe(plan))  # type: ignore[arg-type]
    if row.cleanup_confirmed and row.state != "released":
        daemon.release(plan)  # type: ignore[arg-type]
    row = attempt(daemon.observe(plan))  # type: ignore[arg-type]
    return row if row.state == "released" else None
