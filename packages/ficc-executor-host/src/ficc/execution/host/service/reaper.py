"""The lease reaper: stops an attempt's service at its lease deadline without the daemon.

The daemon's monitor stops work whose lease expired, but only while the daemon runs
and is attentive. A killed, hung (SIGSTOP) or stopped daemon must still not let a
payload outlive its lease by more than a few seconds, on both service backends. So
each attempt's deadline also lives outside the daemon:

- the daemon writes one small file per service, `<directory>/<service>.deadline`
  (JSON: boot ID, the lease deadline on CLOCK_BOOTTIME, the service's cgroup
  directories), before it creates the service, and rewrites it when a renewal moves
  the deadline (before the renewal is answered);
- one reaper process per host (this file, run as a script by the daemon's own
  interpreter with `-I -S`: the standard library only, nothing of the daemon's
  imports, no socket, no D-Bus, no database) polls that directory every 0.25 s and,
  at a deadline or for a file of another boot, kills everything in the service's
  cgroups (`cgroup.kill` where the kernel has it, else freeze, SIGKILL each member
  through a pidfd, thaw), then deletes the file once those cgroups are empty;
- the reaper holds an exclusive flock on `<directory>/reaper.lock` for its life. The
  daemon starts one whenever that lock is free (a new deadline, every monitor tick)
  and the reaper it started last is not still coming up, and the reaper exits once no
  deadline file has been left for `LINGER_SECONDS`: attempts that follow each other
  share one reaper instead of paying an interpreter start each, on the start path.

Why a reaper and not systemd's `RuntimeMaxSec=`: systemd 252 cannot change
`RuntimeMaxSec=` of a running unit (`set-property` accepts resource-control settings
only), so a renewal could not move it, and it counts CLOCK_MONOTONIC, which stands
still during suspend, where a lease must not. The reaper holds CLOCK_BOOTTIME, as the
lease rules do, and one mechanism serves both backends: under `supervisor=systemd`
it kills the unit's cgroups and systemd sees the unit's processes die.

The reaper runs in a new session outside every attempt's cgroup, so stopping an
attempt never stops it; under systemd it stays in the daemon's unit, where a daemon
stop also stops every attempt unit (`BindsTo=`).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import signal
import subprocess
import sys
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Callable

SUFFIX = ".deadline"
LOCK = "reaper.lock"
POLL_SECONDS = 0.25
LINGER_SECONDS = 5.0
"""How long a reaper with nothing to guard waits for a new deadline before it exits.
The daemon does not start a second reaper within this time of starting one that is
still running (it holds the lock, is about to take it, or found another holding it)."""
LOCK_PATIENCE = 1.0
"""How long a reaper tries again for a lock found held: a look (`reaper_running`)
holds it for a moment, another reaper for good."""
CGROUP_ROOT = "/sys/fs/cgroup/"
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,199}$")
_BOOT_ID = "/proc/sys/kernel/random/boot_id"
_MAX_FILE = 1 << 16


# --- the daemon's side ----------------------------------------------------------------


def encode(boot_id: str, deadline_ns: int, cgroups: list[str]) -> bytes:
    """One deadline file's bytes; the reaper refuses cgroups outside /sys/fs/cgroup."""
    document = {"boot_id": boot_id, "deadline_boottime_ns": deadline_ns, "cgroups": cgroups}
    return json.dumps(document, sort_keys=True).encode("ascii")


def write_deadline(
    directory: str, name: str, boot_id: str, deadline_ns: int, cgroups: list[str]
) -> None:
    """Replace the deadline of service `name` atomically (write, then rename).

    No fsync: the file only has to outlive the daemon process, not the machine (after a
    reboot the boot ID differs and every old cgroup is gone anyway).
    """
    _check_name(name)
    data = encode(boot_id, deadline_ns, cgroups)
    temporary = os.path.join(directory, f".{name}.tmp")
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)
    os.replace(temporary, os.path.join(directory, name + SUFFIX))


def drop_deadline(directory: str, name: str) -> None:
    """Forget service `name` (its service is stopped and confirmed empty)."""
    _check_name(name)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(os.path.join(directory, name + SUFFIX))


def prepare_directory(directory: str) -> None:
    """The deadline directory: root-owned, 0700 (only the daemon writes deadlines)."""
    with contextlib.suppress(FileExistsError):
        os.mkdir(directory, 0o700)
    info = os.lstat(directory)
    if not os.path.isdir(directory) or os.path.islink(directory) or info.st_uid != os.geteuid():
        raise OSError(f"{directory} is not a directory owned by the daemon's user")
    if info.st_mode & 0o077:
        os.chmod(directory, 0o700)


def reaper_running(directory: str) -> bool:
    """True while a reaper holds the directory's lock."""
    fd = os.open(os.path.join(directory, LOCK), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False
    finally:
        os.close(fd)


def spawn(directory: str, interpreter: str = sys.executable) -> subprocess.Popen[bytes]:
    """Start a reaper for `directory` in its own session, detached from the daemon's
    descriptors; it outlives the daemon. A second reaper exits at once (lock taken)."""
    return subprocess.Popen(
        [interpreter, "-I", "-S", os.path.abspath(__file__), directory],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        close_fds=True,
        cwd="/",
        env={},
        start_new_session=True,
    )


class Keeper:
    """The daemon's handle on the reaper: writes deadlines, keeps a reaper running."""

    def __init__(self, directory: str, interpreter: str = sys.executable) -> None:
        self.directory = directory
        self._interpreter = interpreter
        self._child: subprocess.Popen[bytes] | None = None
        self._spawned = 0.0
        self._prepared = False

    def set(self, name: str, boot_id: str, deadline_ns: int, cgroups: list[str]) -> None:
        if not self._prepared:
            prepare_directory(self.directory)
            self._prepared = True
        write_deadline(self.directory, name, boot_id, deadline_ns, cgroups)
        self.ensure()

    def drop(self, name: str) -> None:
        drop_deadline(self.directory, name)

    def ensure(self) -> None:
        """Start a reaper unless one holds the lock (the last one may have exited).

        A reaper started less than LINGER_SECONDS ago that still runs is not replaced
        even while the lock looks free: it is still coming up and takes the lock (or
        exits because another reaper holds it, which then sees the deadline), and it
        cannot have given up for want of deadlines yet.
        """
        if self._child is not None and self._child.poll() is not None:
            self._child = None  # reaped: no zombie stays behind
        young = time.monotonic() - self._spawned < LINGER_SECONDS
        if self._child is not None and young:
            return
        if not reaper_running(self.directory):
            self._spawned = time.monotonic()  # before the child's own clock starts
            self._child = spawn(self.directory, self._interpreter)


# --- the reaper's side ------------------------------------------------------------------


def _check_name(name: str) -> None:
    if not _NAME.fullmatch(name):
        raise ValueError(f"{name!r} is not a service name")


def parse(data: str) -> tuple[str, int, list[str]] | None:
    """(boot ID, deadline, cgroups) of a deadline file, or None if it is malformed."""
    try:
        document = json.loads(data)
        boot_id = document["boot_id"]
        deadline = document["deadline_boottime_ns"]
        cgroups = document["cgroups"]
    except (ValueError, KeyError, TypeError):
        return None
    if not (isinstance(boot_id, str) and isinstance(deadline, int) and isinstance(cgroups, list)):
        return None
    if not all(isinstance(path, str) and _under_cgroup_root(path) for path in cgroups):
        return None
    return boot_id, deadline, cgroups


def _under_cgroup_root(path: str) -> bool:
    return path.startswith(CGROUP_ROOT) and os.path.normpath(path) == path and "\0" not in path


def due(boot_id: str, deadline_ns: int, now_boot_id: str, now_ns: int) -> bool:
    """A deadline is due once passed on this boot, and at once for another boot's."""
    return boot_id != now_boot_id or now_ns >= deadline_ns


def _read(path: str) -> str:
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        return os.read(fd, _MAX_FILE).decode("ascii", "replace")
    finally:
        os.close(fd)


def _write(path: str, value: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        os.write(fd, value.encode("ascii"))
    finally:
        os.close(fd)


def _nodes(top: str) -> list[str]:
    """`top` and every cgroup below it, deepest first; empty when `top` is gone."""
    if not os.path.isdir(top) or os.path.islink(top):
        return []
    return [root for root, _dirs, _files in os.walk(top, topdown=False, followlinks=False)]


def members(top: str) -> set[int]:
    pids: set[int] = set()
    for node in _nodes(top):
        with contextlib.suppress(OSError):
            pids.update(int(p) for p in _read(os.path.join(node, "cgroup.procs")).split())
    return pids


def kill_tree(top: str) -> None:
    """SIGKILL everything in the cgroup subtree `top` (a v2 or a v1 directory)."""
    if not _nodes(top):
        return
    kill_file = os.path.join(top, "cgroup.kill")
    if os.path.exists(kill_file):
        with contextlib.suppress(OSError):
            _write(kill_file, "1")
            return
    frozen = _freeze(top, True)
    try:
        for node in _nodes(top):
            with contextlib.suppress(OSError):
                for pid in _read(os.path.join(node, "cgroup.procs")).split():
                    _kill_member(int(pid), node)
    finally:
        if frozen:
            _freeze(top, False)


def _freeze(top: str, frozen: bool) -> bool:
    """Freeze (or thaw every node of) a v1 freezer or v2 subtree; False if neither."""
    for name, on, off in (("freezer.state", "FROZEN", "THAWED"), ("cgroup.freeze", "1", "0")):
        if os.path.exists(os.path.join(top, name)):
            for node in [top] if frozen else _nodes(top):
                with contextlib.suppress(OSError):
                    _write(os.path.join(node, name), on if frozen else off)
            return True
    return False


def _kill_member(pid: int, node: str) -> None:
    """Kill `pid` through a pidfd, only if it is still in `node` (PIDs are reused)."""
    try:
        pidfd = os.pidfd_open(pid)
    except OSError:
        return
    try:
        if str(pid) in _read(os.path.join(node, "cgroup.procs")).split():
            signal.pidfd_send_signal(pidfd, signal.SIGKILL)
    except OSError:
        pass
    finally:
        os.close(pidfd)


def reap_once(directory: str, boot_id: str, now_ns: int) -> tuple[int, float]:
    """One pass: kill every due service, drop its file once empty.

    Returns (deadline files left, seconds until the next deadline or the poll interval).
    """
    left, wait = 0, POLL_SECONDS
    for entry in os.listdir(directory):
        if not entry.endswith(SUFFIX):
            continue
        path = os.path.join(directory, entry)
        try:
            parsed = parse(_read(path))
        except FileNotFoundError:
            continue
        if parsed is None:
            parsed = ("", 0, [])  # unreadable: treat as due, it guards nothing we can read
        entry_boot, deadline, cgroups = parsed
        left += 1
        if not due(entry_boot, deadline, boot_id, now_ns):
            wait = min(wait, (deadline - now_ns) / 1e9)
            continue
        for top in cgroups:
            kill_tree(top)
        if not any(members(top) for top in cgroups):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
            left -= 1
    return left, max(0.0, wait)


def run(directory: str, linger: float = LINGER_SECONDS) -> int:
    """The reaper's loop; returns when no deadline has been left for `linger` seconds
    or the directory is gone."""
    boot_id = _read(_BOOT_ID).strip()
    try:
        lock = os.open(os.path.join(directory, LOCK), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    except OSError:
        return 0  # the directory is gone
    if not _take_lock(lock):
        os.close(lock)
        return 0  # another reaper runs
    idle_since = time.monotonic()
    while True:
        try:
            left, wait = reap_once(directory, boot_id, time.clock_gettime_ns(time.CLOCK_BOOTTIME))
        except FileNotFoundError:
            return 0
        if left:
            idle_since = time.monotonic()
        elif time.monotonic() - idle_since >= linger:
            # Release, then look once more: a deadline written meanwhile either saw the
            # lock held (and is seen now) or found it free and started a new reaper.
            fcntl.flock(lock, fcntl.LOCK_UN)
            if not any(e.endswith(SUFFIX) for e in _listing(directory)):
                return 0
            if not _take_lock(lock):
                return 0
            continue
        time.sleep(min(POLL_SECONDS, wait) or 0.001)


def _take_lock(
    fd: int, patience: float = LOCK_PATIENCE, pause: Callable[[float], None] = time.sleep
) -> bool:
    """The reaper's lock, unless another reaper holds it.

    `reaper_running` takes the same lock for a moment to look, so a lock found held
    is tried again for up to `patience` seconds: only a reaper holds it that long.
    """
    deadline = time.monotonic() + patience
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() >= deadline:
                return False
            pause(0.01)


def _listing(directory: str) -> list[str]:
    try:
        return os.listdir(directory)
    except FileNotFoundError:
        return []


if __name__ == "__main__":
    sys.exit(run(sys.argv[1]))
