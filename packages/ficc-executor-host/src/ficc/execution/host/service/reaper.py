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
  through a pidfd, thaw). It never deletes a deadline file: the daemon drops it (and
  the reaper's evidence) once the attempt's cleanup is confirmed;
- the reaper is the enforcer of record, and a renewal must never be answered OK
  while the reaper kills at the old deadline. So a kill is decided in two steps the
  daemon can see: the reaper first creates `.<service>.reaping` (its intent), then
  reads the deadline file again; if that second reading is still due it renames the
  intent to `<service>.reaped` (the evidence, kept until the daemon drops it) and
  kills, else it removes the intent and kills nothing. The daemon rewrites the
  deadline file first and looks for the intent and the evidence after (`move`): one
  of the two always sees the other's step, so either the reaper judges by the new
  deadline, or the daemon learns the reaper has already decided (the renewal is
  refused `lease_expired` and the attempt ends `expired`). An intent still there is
  waited for (a reaper decides in microseconds) up to `SETTLE_PATIENCE`;
- a file the reaper cannot read or act on (any `OSError`) is reported on its
  standard error (the journal under systemd: the daemon's, or the reaper unit's)
  and tried again on the next pass; the other files are reaped all the same;
- the reaper holds an exclusive flock on `<directory>/reaper.lock` for its life. The
  daemon starts one whenever that lock is free (a new deadline, every monitor tick)
  and the reaper it started last is not still coming up (below, for each
  supervisor), and the reaper exits once no deadline is left to guard for
  `LINGER_SECONDS` (a reaped file whose cgroups are empty guards nothing): attempts
  that follow each other share one reaper instead of paying an interpreter start
  each, on the start path. The daemon also starts one at its own start whenever any
  deadline file is there.

Why a reaper and not systemd's `RuntimeMaxSec=`: systemd 252 cannot change
`RuntimeMaxSec=` of a running unit (`set-property` accepts resource-control settings
only), so a renewal could not move it, and it counts CLOCK_MONOTONIC, which stands
still during suspend, where a lease must not. The reaper holds CLOCK_BOOTTIME, as the
lease rules do, and one mechanism serves both backends: under `supervisor=systemd`
it kills the unit's cgroups and systemd sees the unit's processes die.

Where the reaper runs, so that neither stopping an attempt nor freezing, stopping or
killing the daemon stops it (the process is the same script either way):

- under `supervisor=cgroupfs` the daemon spawns it in a new session (`spawn`) and
  moves it into a cgroup of its own (`<base>/lease-reaper`, `Keeper(place=...)`);
  the daemon starts it again whenever it finds the lock free;
- under `supervisor=systemd` it is a transient service unit of its own,
  `ficc-lease-reaper-<installation>.service` in the attempts' slice, started with
  `systemd-run` (`Keeper(launch=...)`; the unit's properties are in
  service/systemd.py, `reaper_properties`). Nothing binds it to the daemon's unit,
  so a stopped, crashed or frozen daemon leaves it running, and `Restart=on-failure`
  makes systemd start it again if it dies (not after a clean exit: lingering done,
  the lock found taken, or SIGTERM, which systemd counts as clean; the daemon starts
  one again on its next look). The start is synchronous (`Type=exec`: when
  `systemd-run` returns, the reaper has been executed) and systemd refuses a second
  unit of the name while one is there, so "still coming up" needs no bookkeeping in
  the daemon: the lock free and the unit refused means a reaper is coming up, about
  to be restarted or exiting, and the daemon looks again until a reaper holds the
  lock or the unit is gone and a new one starts (up to `UNIT_PATIENCE`). Its
  standard error is the unit's, so the journal's.
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
REAPED = ".reaped"
"""`<service>.reaped`: the reaper decided the deadline passed and killed the service."""
INTENT = ".reaping"
"""`.<service>.reaping`: the reaper is deciding; the daemon waits for the decision."""
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
SETTLE_PATIENCE = 2.0
"""How long the daemon waits for a reaper's intent to become a decision (`move`)."""
UNIT_PATIENCE = 5.0
"""How long the daemon keeps looking while the reaper's unit is there but no reaper
holds the lock (it is coming up, waiting to be restarted or exiting: each takes far
less) before it gives up (`ReaperUnavailable`)."""
_BOOT_ID = "/proc/sys/kernel/random/boot_id"
_MAX_FILE = 1 << 16


class ReaperUnavailable(OSError):
    """No reaper could be started for the directory (its unit could not be started, or
    none took the lock within `UNIT_PATIENCE`)."""


class ReaperUndecided(TimeoutError):
    """The reaper's intent on a deadline stayed past `SETTLE_PATIENCE` (a stopped or
    dead reaper): the daemon cannot know whether it kills at the old deadline."""


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


def move(
    directory: str,
    name: str,
    boot_id: str,
    deadline_ns: int,
    cgroups: list[str],
    *,
    patience: float = SETTLE_PATIENCE,
    pause: Callable[[float], None] = time.sleep,
) -> bool:
    """Move the deadline of a live service (a renewal); True once the reaper is known to
    judge by the new one, False when it had already decided to kill by an earlier one.

    The deadline is written before the reaper's steps are looked at, in that order (see
    the module docstring). `ReaperUndecided` when an intent outlasts `patience`.
    """
    write_deadline(directory, name, boot_id, deadline_ns, cgroups)
    return not settled_reaped(directory, name, patience=patience, pause=pause)


def settled_reaped(
    directory: str,
    name: str,
    *,
    patience: float = SETTLE_PATIENCE,
    pause: Callable[[float], None] = time.sleep,
) -> bool:
    """Whether the reaper decided to kill service `name`, once no decision is under way:
    the intent is looked at first, then the evidence (the intent becomes the evidence by
    a rename, so in the other order a decision made in between would be missed)."""
    _check_name(name)
    intent = os.path.join(directory, f".{name}{INTENT}")
    give_up = time.monotonic() + patience
    while os.path.lexists(intent):
        if time.monotonic() >= give_up:
            raise ReaperUndecided(
                f"the lease reaper has been deciding on {name} for over {patience}s"
            )
        pause(0.005)
    return reaped(directory, name)


def reaped(directory: str, name: str) -> bool:
    """Whether the reaper stopped service `name` at its deadline (its evidence is there)."""
    _check_name(name)
    return os.path.lexists(os.path.join(directory, name + REAPED))


def drop_deadline(directory: str, name: str) -> None:
    """Forget service `name` (its service is stopped and confirmed empty): its deadline
    file, then the reaper's intent and evidence."""
    _check_name(name)
    for path in (name + SUFFIX, f".{name}{INTENT}", name + REAPED):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(directory, path))


def any_deadline(directory: str) -> bool:
    """Whether any deadline file is there (the daemon starts a reaper at its start)."""
    return any(entry.endswith(SUFFIX) for entry in _listing(directory))


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


def command(directory: str, interpreter: str = sys.executable) -> list[str]:
    """The reaper's command line: this file, by absolute path, run by `interpreter`
    with the standard library only (`-I -S`)."""
    return [interpreter, "-I", "-S", os.path.abspath(__file__), directory]


def spawn(directory: str, interpreter: str = sys.executable) -> subprocess.Popen[bytes]:
    """Start a reaper for `directory` in its own session, detached from the daemon's
    descriptors but its standard error (its reports reach the daemon's log); it
    outlives the daemon. A second reaper exits at once (lock taken)."""
    return subprocess.Popen(
        command(directory, interpreter),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        close_fds=True,
        cwd="/",
        env={},
        start_new_session=True,
    )


class Keeper:
    """The daemon's handle on the reaper: writes deadlines, keeps a reaper running.

    With `launch` (supervisor=systemd) the reaper is started as a unit of its own:
    `launch(argv)` starts it and returns True once it has been executed, False when
    the unit is still there (see the module docstring); it raises `OSError` when the
    unit cannot be started. Without it the reaper is the daemon's child, which
    `place` moves out of the daemon's cgroup (supervisor=cgroupfs).
    """

    def __init__(
        self,
        directory: str,
        interpreter: str = sys.executable,
        place: Callable[[int], None] | None = None,
        *,
        launch: Callable[[list[str]], bool] | None = None,
        patience: float = UNIT_PATIENCE,
        pause: Callable[[float], None] = time.sleep,
    ) -> None:
        self.directory = directory
        self._interpreter = interpreter
        self._place = place
        """Moves a reaper just started out of the daemon's cgroup (never raises)."""
        self._launch = launch
        self._patience = patience
        self._pause = pause
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

        As the daemon's child: a reaper started less than LINGER_SECONDS ago that
        still runs is not replaced even while the lock looks free: it is still coming
        up and takes the lock (or exits because another reaper holds it, which then
        sees the deadline), and it cannot have given up for want of deadlines yet.
        As a unit: see `_ensure_unit`.
        """
        if self._launch is not None:
            self._ensure_unit(self._launch)
            return
        if self._child is not None and self._child.poll() is not None:
            self._child = None  # reaped: no zombie stays behind
        young = time.monotonic() - self._spawned < LINGER_SECONDS
        if self._child is not None and young:
            return
        if not reaper_running(self.directory):
            self._spawned = time.monotonic()  # before the child's own clock starts
            self._child = spawn(self.directory, self._interpreter)
            if self._place is not None:
                self._place(self._child.pid)

    def _ensure_unit(self, launch: Callable[[list[str]], bool]) -> None:
        """Start the reaper's unit unless a reaper holds the lock.

        The unit refused (False) while the lock is free means its reaper is coming up
        (it takes the lock within moments of being executed), waiting for systemd to
        restart it, or exiting (it let go of the lock after lingering): look again
        until a reaper holds the lock or a new unit starts. Each reaper judges every
        deadline file it finds, so one that held the lock when a deadline was written,
        or that starts after, enforces it.
        """
        give_up = time.monotonic() + self._patience
        while not reaper_running(self.directory):
            if launch(command(self.directory, self._interpreter)):
                return
            if time.monotonic() >= give_up:
                raise ReaperUnavailable(
                    f"the lease reaper's unit for {self.directory} is there, but no reaper "
                    f"took {LOCK} within {self._patience}s; its journal says why"
                )
            self._pause(0.05)


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


def reap_once(
    directory: str,
    boot_id: str,
    now_ns: int,
    *,
    hook: Callable[[str, str], None] | None = None,
) -> tuple[int, float]:
    """One pass: kill every due service (see the module docstring for the decision).

    Returns (deadline files left to guard, seconds until the next deadline or the poll
    interval). A file whose handling fails with an `OSError` is reported and counted as
    left (it is tried again next pass); the others are reaped all the same.
    `hook(step, name)` (a test's) runs once a first reading found the deadline due
    (step "due") and once the intent is there, before the second reading ("intent").
    """
    left, wait = 0, POLL_SECONDS
    for entry in _listing(directory):
        if not entry.endswith(SUFFIX) or entry.startswith("."):
            continue
        name = entry[: -len(SUFFIX)]
        try:
            guarding, until = _reap_entry(directory, name, boot_id, now_ns, hook)
        except (OSError, ValueError) as error:
            _report(f"lease reaper: {entry}: {error}; trying again on the next pass")
            guarding, until = True, POLL_SECONDS
        left += guarding
        wait = min(wait, until)
    return left, max(0.0, wait)


def _reap_entry(
    directory: str,
    name: str,
    boot_id: str,
    now_ns: int,
    hook: Callable[[str, str], None] | None,
) -> tuple[bool, float]:
    """(still guarding, seconds until its deadline) for service `name`."""
    path = os.path.join(directory, name + SUFFIX)
    evidence = os.path.join(directory, name + REAPED)
    first = _deadline_of(path)
    if first is None:
        return False, POLL_SECONDS  # dropped by the daemon meanwhile
    if os.path.lexists(evidence):  # decided earlier: kill what is left, nothing else
        return _kill(first[2]), POLL_SECONDS
    if not due(first[0], first[1], boot_id, now_ns):
        return True, (first[1] - now_ns) / 1e9
    if hook is not None:
        hook("due", name)
    intent = os.path.join(directory, f".{name}{INTENT}")
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open(intent, flags, 0o600)
    try:
        if hook is not None:
            hook("intent", name)
        # Read again after the intent: a deadline the daemon moved before it looked for
        # the intent is seen here.
        second = _deadline_of(path)
        if second is None:
            os.unlink(intent)
            return False, POLL_SECONDS
        if not due(second[0], second[1], boot_id, now_ns):
            os.unlink(intent)
            return True, (second[1] - now_ns) / 1e9
        entry_boot, deadline, cgroups = second
        judged = {"boot_id": entry_boot, "deadline_boottime_ns": deadline, "at": now_ns}
        os.write(fd, json.dumps(judged, sort_keys=True).encode("ascii"))
    finally:
        os.close(fd)
    os.rename(intent, evidence)
    return _kill(cgroups), POLL_SECONDS


def _deadline_of(path: str) -> tuple[str, int, list[str]] | None:
    """The parsed deadline file, None once the daemon dropped it. A malformed one is
    due at once and guards nothing the reaper can read (the daemon writes every file
    whole, by a rename, so only damage makes one)."""
    try:
        parsed = parse(_read(path))
    except FileNotFoundError:
        return None
    return parsed if parsed is not None else ("", 0, [])


def _guarding(directory: str) -> bool:
    """Whether any deadline file still guards something (a look that acts on nothing,
    for a reaper about to exit without its lock)."""
    for entry in _listing(directory):
        if not entry.endswith(SUFFIX) or entry.startswith("."):
            continue
        name = entry[: -len(SUFFIX)]
        if not os.path.lexists(os.path.join(directory, name + REAPED)):
            return True
        parsed = _deadline_of(os.path.join(directory, entry))
        if parsed is not None and any(members(top) for top in parsed[2]):
            return True
    return False


def _kill(cgroups: list[str]) -> bool:
    """Kill every member of `cgroups`; whether any is still there."""
    for top in cgroups:
        kill_tree(top)
    return any(members(top) for top in cgroups)


def _report(message: str) -> None:
    with contextlib.suppress(OSError, ValueError):
        sys.stderr.write(message + "\n")
        sys.stderr.flush()


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
        if not os.path.isdir(directory):
            return 0
        left, wait = reap_once(directory, boot_id, time.clock_gettime_ns(time.CLOCK_BOOTTIME))
        if left:
            idle_since = time.monotonic()
        elif time.monotonic() - idle_since >= linger:
            # Release, then look once more: a deadline written meanwhile either saw the
            # lock held (and is seen now) or found it free and started a new reaper.
            fcntl.flock(lock, fcntl.LOCK_UN)
            if not _guarding(directory):
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
    except OSError:
        return []


if __name__ == "__main__":
    sys.exit(run(sys.argv[1]))
