"""Changes behind the host's back that its checks must see: a staged file changed but
keeping its bytes (a digest of the content would not see it), a service's limit
raised after the host set it."""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from ficc.execution.host.service import cgroups
from ficc.execution.plan import Plan
from ficc.execution.wire import TERMINAL, AttemptRow
from ficc_testkit.driver import attempt, rows
from ficc_testkit.host import Daemon
from ficc_testkit.plans import with_environment


def touch(path: Path) -> None:
    """The same inode and bytes, another mtime."""
    os.utime(path, ns=(1, 1))


def replace_with_copy(path: Path) -> None:
    """The same bytes, mode, owner and mtime, in another inode put in its place."""
    copy = path.with_name("replacement")
    shutil.copy2(path, copy)
    st = path.stat()
    os.chown(copy, st.st_uid, st.st_gid)
    os.replace(copy, path)


def service_limit_file(pid: int, attempt_id: str, name: str = "pids.max") -> Path:
    """The limit file `name` (`pids.max`, `memory.max`, ...) of the attempt's service
    cgroup that holds `pid`, in the tree where the host enforces it: the unified tree
    when it has the controller, else the v1 hierarchy of that controller. Writing it as
    root changes the limit behind the host's back."""
    controller = name.split(".", 1)[0]
    hierarchies = cgroups.parse_mountinfo(Path("/proc/self/mountinfo").read_text())
    unified = [h.mount for h in hierarchies if h.version == 2]
    v2 = bool(unified) and controller in Path(unified[0], "cgroup.controllers").read_text().split()
    (mount,) = unified[:1] if v2 else [h.mount for h in hierarchies if controller in h.controllers]
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        ids, names, path = line.split(":", 2)
        if (ids == "0") if v2 else (ids != "0" and controller in names.split(",")):
            parts = path.strip("/").split("/")
            for end, part in enumerate(parts, 1):
                if part.startswith("ficc-work-") and attempt_id in part:
                    return Path(mount, *parts[:end], name)
    raise AssertionError(f"process {pid} is in no service cgroup of attempt {attempt_id}")


@dataclass(frozen=True)
class RaisedLimit:
    """What `raise_a_limit_while_start_is_held` did."""

    plan: Plan
    ended: AttemptRow
    """The attempt's row once it ended."""
    attempt_dir: Path


def raise_a_limit_while_start_is_held(daemon: Daemon) -> RaisedLimit:
    """Start an attempt of the test provider whose start is held (the host has made the
    service and read its limits back), raise the service's `pids.max` to four times the
    plan's as root, let the start go, and wait for the attempt's end."""
    plan = with_environment(daemon.plan(), FICC_TEST_PROVIDER_HANG="start:hold")
    slot = attempt(rows(daemon.prepare([plan]))[0]).slot
    assert slot is not None
    daemon.wait_state(plan, lambda r: r.ready or r.state != "prepared", "readiness")
    attempt(daemon.start_attempt(plan))
    (configured,) = [s for s in daemon.layout.document["slots"] if s["id"] == slot]
    attempt_dir = Path(configured["path"], "ficc", plan.attempt_id)
    held = attempt_dir / "storage" / "held-start"
    row = daemon.wait_state(plan, lambda r: held.exists() or r.state != "starting", "held start")
    assert held.exists(), (row.state, row.reason)
    limit = _service_limit_of(int(configured["uid"]), plan.attempt_id)
    assert limit.read_text().strip() == str(plan.job.limits.processes)
    limit.write_text(str(plan.job.limits.processes * 4))
    (attempt_dir / "storage" / "go-start").touch()
    ended = daemon.wait_state(plan, lambda r: r.state in TERMINAL, "the attempt's end")
    return RaisedLimit(plan, ended, attempt_dir)


def _service_limit_of(uid: int, attempt_id: str) -> Path:
    """`pids.max` of the attempt's service, found through any live process of the slot
    account inside it (others of the account, and ones that exit meanwhile, are
    passed over)."""
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and entry.stat().st_uid == uid:
                return service_limit_file(int(entry.name), attempt_id)
        except (FileNotFoundError, AssertionError):
            continue
    raise AssertionError(f"no process of uid {uid} is in the service of attempt {attempt_id}")
