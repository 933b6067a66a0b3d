"""Running Podman as the slot account, outside the attempt's service.

Podman runs rootless as the slot account: the host starts the prepared `podman run`
inside the attempt's service, and the provider itself runs a few short Podman
commands as the same account at prepare (load and check the pinned image) and at
release (remove the container). Those provider-side commands run OUTSIDE any service,
so they must leave nothing behind: rootless Podman keeps a "pause" process that holds
its user namespace, and the host's idle check (no process of the slot account
anywhere) would then never pass.

The rule is simple because a slot runs one attempt at a time: before a provider-side
command the slot account must have no process at all (else `slot_busy`: something the
host has not cleaned up), and after it every process of the account is that command's
leftover and is killed through a pidfd (never a bare PID number), then confirmed gone.

Per-slot Podman state lives on the slot's reserved filesystem, owned by the account:

    <slot>/ficc-podman/          slot uid 0700
      storage/                   --root: images and container layers
      tmp/                       TMPDIR: `podman load` unpacks here, never in /var/tmp
    <slot>/ficc-podman-home/     root 0755, empty: HOME and XDG_{CONFIG,DATA,CACHE}_HOME,
                                 so no configuration of the account's making is read
    /run/user/<uid>/             slot uid 0700: XDG_RUNTIME_DIR, --runroot, --tmpdir,
                                 networks/ (--network-config-dir), reset before each command
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import re
import select
import shutil
import signal
import stat
import subprocess
import threading
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import IO

from ficc_provider_podman.config import Config
from ficc_provider_podman.errors import ProviderError

PODMAN_DIRECTORY = "ficc-podman"
NETWORKS = "networks"
"""Podman's `--network-config-dir`, in the account's runtime directory."""
CONFIG_HOME = "ficc-podman-home"
"""In the slot's root: the empty, root-owned HOME of every Podman command."""
RUN_USER = "/run/user"
PODMAN_TMPDIR = "libpod/tmp"
"""Podman's `--tmpdir`, relative to the account's runtime directory."""
CONMON_EXITS = "exits"
"""Where, under `--tmpdir`, conmon writes a container's exit status (file named by the
container's ID, written to a temporary name and renamed: never seen half-written)."""
COMMAND_TIMEOUT_S = 300.0
CONTAINERS_CONF = "/usr/share/containers/containers.conf"
"""The distribution's defaults (root-owned); the only containers.conf Podman reads."""
STORAGE_CONF = str(pathlib.Path(__file__).resolve().parent / "storage.conf")
"""Shipped in this package (pinned with it): only the driver; roots are flags."""
KILL_TIMEOUT_S = 10.0

_locks: dict[int, threading.Lock] = {}
_locks_guard = threading.Lock()


def slot_lock(uid: int) -> threading.Lock:
    """One lock per slot account: provider-side Podman commands of a slot never overlap."""
    with _locks_guard:
        return _locks.setdefault(uid, threading.Lock())


@dataclass(frozen=True)
class SlotAccount:
    """The slot account and where its Podman keeps state."""

    uid: int
    gid: int
    slot_path: str

    @property
    def base(self) -> str:
        return f"{self.slot_path}/{PODMAN_DIRECTORY}"

    @property
    def home(self) -> str:
        """Where earlier releases pointed HOME: slot-owned, so whatever a slot-account
        process left there is removed before every prepare and never read."""
        return f"{self.base}/home"

    @property
    def config_home(self) -> str:
        """HOME and every XDG base directory of every Podman command: root's, 0755,
        empty, in the slot's root (root's too), so nothing running as the slot account
        can put configuration where Podman looks for a user's (`~/.config/containers`:
        containers.conf and its .d, storage.conf, registries.conf and its .d,
        policy.json, mounts.conf, seccomp.json, libpod.conf, auth.json, ...)."""
        return f"{self.slot_path}/{CONFIG_HOME}"

    @property
    def storage(self) -> str:
        return f"{self.base}/storage"

    @property
    def tmp(self) -> str:
        return f"{self.base}/tmp"  # noqa: S108 (on the slot filesystem, slot-owned 0700)

    @property
    def runtime_dir(self) -> str:
        return f"{RUN_USER}/{self.uid}"

    def environment(self) -> dict[str, str]:
        """The complete environment of every Podman command (nothing inherited).

        CONTAINERS_CONF and CONTAINERS_STORAGE_CONF name root-owned files, and HOME and
        the XDG configuration, data and cache directories are `config_home` (root's,
        empty), so Podman reads no configuration that anything running as the slot
        account could have written.
        """
        return {
            "HOME": self.config_home,
            "XDG_CONFIG_HOME": self.config_home,
            "XDG_DATA_HOME": self.config_home,
            "XDG_CACHE_HOME": self.config_home,
            "XDG_RUNTIME_DIR": self.runtime_dir,
            "TMPDIR": self.tmp,
            "PATH": "/usr/bin:/bin",
            "CONTAINERS_CONF": CONTAINERS_CONF,
            "CONTAINERS_STORAGE_CONF": STORAGE_CONF,
        }

    @property
    def podman_tmpdir(self) -> str:
        """Podman's `--tmpdir`: the pause process's PID file, and `exits/`, where conmon
        writes each container's exit status the moment it reaps the container."""
        return f"{self.runtime_dir}/{PODMAN_TMPDIR}"

    @property
    def pause_pid_file(self) -> str:
        return f"{self.podman_tmpdir}/pause.pid"

    def podman(self, config: Config, *, log_level: str = "error") -> list[str]:
        """Podman and its global flags: every path explicit, no pulls, no events."""
        return [
            config.podman,
            "--runtime",
            config.runtime,
            "--cgroup-manager=cgroupfs",
            "--root",
            self.storage,
            "--runroot",
            f"{self.runtime_dir}/containers",
            "--tmpdir",
            self.podman_tmpdir,
            # Its default is under the (root's, read-only) config home; jobs run with
            # --network none, and what is here is forgotten before every command.
            "--network-config-dir",
            f"{self.runtime_dir}/{NETWORKS}",
            "--storage-driver",
            "overlay",
            "--events-backend=none",
            f"--log-level={log_level}",
        ]

    def ensure_runtime_dir(self) -> None:
        """Create (or check) /run/user/<uid>. Every Podman command needs it, and /run
        is a tmpfs: after a reboot it is gone even for a slot prepared before it."""
        _ensure_dir(RUN_USER, 0, 0o755, create=True, exact_mode=False)
        _ensure_dir(self.runtime_dir, self.uid, 0o700, gid=self.gid, create=True)

    def ensure_directories(self) -> None:
        """Create (or check) the account's Podman directories; refuses anything odd.
        Removes what a slot-account process may have left in the old slot-owned HOME."""
        self.ensure_runtime_dir()
        _ensure_dir(self.config_home, 0, 0o755, gid=0, create=True)
        if os.listdir(self.config_home):
            raise ProviderError(
                "podman_directory",
                f"{self.config_home} must be empty (Podman's configuration home); only root"
                " could have written to it: find out who did, then empty it",
            )
        _ensure_dir(self.base, self.uid, 0o700, gid=self.gid, create=True)
        _remove_tree(self.home)
        for path in (self.storage, self.tmp):
            _ensure_dir(path, self.uid, 0o700, gid=self.gid, create=True)
        if not live_processes_of(self.uid):  # else no Podman may start: `slot_busy`
            remove_interrupted_checks(self.storage)


INTERRUPTED_CHECK = re.compile(r"(?:compat|opaque-bug-check|metacopy-check)[0-9]+\Z")
"""The directories in which Podman's overlay driver probes the kernel (Go's
`os.MkdirTemp` names: a prefix and digits, never a layer's 64 hex digits)."""


def remove_interrupted_checks(storage: str) -> list[str]:
    """Remove what a Podman killed during its overlay checks left in `storage/overlay`,
    and return the names. Only while no process of the slot account runs.

    The overlay driver probes the kernel in temporary directories it removes
    afterwards; a power cut (or a kill) in between leaves one behind. Once a layer's
    short link under `overlay/l/` is missing too (a link made just before the cut), the
    next container mount of the slot fails: Podman's repair of the links reads a `link`
    file in each directory and fails on the leftover ("recreating the missing symlinks:
    ... opaque-bug-check.../link: no such file or directory"), and the job's start with it.
    """
    try:
        fd = os.open(f"{storage}/overlay", os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except FileNotFoundError:
        return []
    try:
        removed = [name for name in os.listdir(fd) if INTERRUPTED_CHECK.match(name)]
        for name in removed:
            if stat.S_ISDIR(os.stat(name, dir_fd=fd, follow_symlinks=False).st_mode):
                shutil.rmtree(name, dir_fd=fd)
            else:
                os.unlink(name, dir_fd=fd)
        return removed
    finally:
        os.close(fd)


def _remove_tree(path: str) -> None:
    """Remove `path` whatever it is (a link is removed, never followed)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if stat.S_ISDIR(st.st_mode):
        shutil.rmtree(path)
    else:
        os.unlink(path)


def _ensure_dir(
    path: str,
    uid: int,
    mode: int,
    *,
    gid: int | None = None,
    create: bool,
    exact_mode: bool = True,
) -> None:
    if create:
        with contextlib.suppress(FileExistsError):
            os.mkdir(path, 0o700)
            os.chown(path, uid, uid if gid is None else gid, follow_symlinks=False)
            os.chmod(path, mode, follow_symlinks=False)
    st = os.stat(path, follow_symlinks=False)
    wrong_mode = stat.S_IMODE(st.st_mode) != mode if exact_mode else st.st_mode & 0o022
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != uid or wrong_mode:
        raise ProviderError(
            "podman_directory",
            f"{path} must be a directory owned by uid {uid} with mode {mode:04o} "
            f"(found {stat.filemode(st.st_mode)} uid {st.st_uid}); remove or fix it",
        )


def run_podman(
    account: SlotAccount,
    config: Config,
    arguments: Sequence[str],
    *,
    stdin: int | IO[bytes] | None = None,
    timeout: float = COMMAND_TIMEOUT_S,
) -> subprocess.CompletedProcess[bytes]:
    """Run one Podman command as the slot account and clean up after it.

    The caller holds `slot_lock(account.uid)`. Refuses (`slot_busy`) when the account
    already has processes; kills every leftover afterwards (`slot_not_idle` if one
    survives).
    """
    if live_processes_of(account.uid):
        raise ProviderError(
            "slot_busy",
            f"the slot account {account.uid} still has processes outside a service; "
            "the host must confirm the previous attempt's cleanup first",
        )
    account.ensure_runtime_dir()
    reset_runtime_state(account)
    try:
        return subprocess.run(
            [*account.podman(config), *arguments],
            stdin=subprocess.DEVNULL if stdin is None else stdin,
            capture_output=True,
            env=account.environment(),
            cwd=account.config_home,
            user=account.uid,
            group=account.gid,
            extra_groups=[],
            umask=0o077,
            timeout=timeout,
            check=False,
        )
    except subprocess.TimeoutExpired as error:
        raise ProviderError(
            "podman_timeout", f"podman {arguments[0]} took longer than {timeout:.0f} s"
        ) from error
    finally:
        kill_leftovers(account.uid)
        forget_pause_process(account)


def reset_runtime_state(account: SlotAccount) -> None:
    """Forget Podman's runtime state, as a reboot would, while nothing of it runs.

    Called only when the account has no live process. Podman's runtime directories
    then describe processes that are gone (a killed container still "running", its
    conmon and the pause process, perhaps unreaped zombies), and Podman would try to
    join their namespaces and fail. Without them it refreshes its state as after a
    reboot: every container becomes stopped and can be removed. Images and container
    records in the storage (--root) are untouched.
    """
    for name in ("containers", "libpod", "runc", NETWORKS):
        shutil.rmtree(f"{account.runtime_dir}/{name}", ignore_errors=True)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(f"/dev/shm/libpod_rootless_lock_{account.uid}")  # noqa: S108 (Podman's name)


def forget_pause_process(account: SlotAccount) -> None:
    """Remove Podman's record of a pause process that no longer runs.

    Called only while the account has no live process: the recorded PID is then dead
    (perhaps an unreaped zombie), and Podman would try to join its namespaces and
    fail ("cannot re-exec process to join the existing user namespace").
    """
    with contextlib.suppress(FileNotFoundError):
        os.unlink(account.pause_pid_file)


def processes_of(uid: int) -> list[int]:
    """PIDs whose real UID is `uid` among the processes whose /proc files belong to
    `uid` (zombies excluded: they hold nothing).

    That is every process Podman and the container start for the account (inside the
    container's user namespace a process's files belong to its root, the account),
    found with one stat per process: cheap enough for every observe. It is not proof
    that the account has nothing left (the entry belongs to the effective UID, so a
    set-user-ID-root program of the account has root's): `live_processes_of` is.
    """
    return processes_by_uid({uid}).get(uid, [])


def processes_by_uid(uids: Collection[int]) -> dict[int, list[int]]:
    """`processes_of` for several accounts with one walk of /proc (a batch's rows
    share it); an account without processes has no key."""
    found: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            if entry.stat(follow_symlinks=False).st_uid not in uids:
                continue
        except OSError:
            continue
        parsed = _credentials(int(entry.name))
        if parsed is not None and parsed[0] in uids and not parsed[1]:
            found.setdefault(parsed[0], []).append(int(entry.name))
    return found


def live_processes_of(uid: int) -> list[int]:
    """PIDs of live processes with `uid` as their real, effective, saved or filesystem
    UID; one whose status cannot be parsed counts.

    From a walk of /proc that began after this call (`LiveWalks`): the checks that the
    account is idle, and the kills of what is left, of slots preparing or releasing at
    the same time share walks. For those checks, not for every observe.
    """
    return _LIVE.of(uid)


def live_processes_by_uid(uids: Collection[int]) -> dict[int, list[int]]:
    """`live_processes_of` for several accounts with one walk of its own (an account
    without processes has no key).

    A process's /proc entry belongs to its effective UID, so the status is read for
    every entry of an account asked for or of root (a set-user-ID-root program the
    account runs): the entries of other accounts, such as the other slots' Podman
    processes, are passed over with a stat, and kernel threads (root's, without an
    executable) with a readlink. A root entry counts for every account among its UIDs;
    any other entry only for its owner.
    """
    wanted = set(uids)
    found: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            owner = entry.stat(follow_symlinks=False).st_uid
            if owner not in wanted and (owner != 0 or not _has_executable(entry.name)):
                continue
        except OSError:
            continue
        parsed = _credentials(int(entry.name))
        if parsed is None or parsed[1]:
            continue
        candidates = wanted if owner == 0 else {owner}
        for uid in candidates if parsed[0] == -1 else candidates.intersection(parsed[2]):
            found.setdefault(uid, []).append(int(entry.name))
    return found


class _Walk:
    """One walk of /proc: the accounts it looks for, and its answer once done."""

    def __init__(self) -> None:
        self.wanted: set[int] = set()
        self.begun = False
        self.done = threading.Event()
        self.found: dict[int, list[int]] = {}
        self.error: BaseException | None = None


class LiveWalks:
    """`live_processes_of` for many threads at once, each answered by a walk of /proc
    that began after it asked.

    Who asks joins the next walk, which has not begun; it begins as soon as no walk
    runs, led by whichever of its callers gets there first, and looks for every
    account asked for until then. So an answer is exactly as fresh as a walk of one's
    own, and the slots of one batch, checked at about the same time, share walks.
    """

    def __init__(self, walk: Callable[[Collection[int]], dict[int, list[int]]]) -> None:
        self._walk = walk
        self._lock = threading.Lock()
        self._running: _Walk | None = None
        self._next: _Walk | None = None
        self.walks = 0

    def of(self, uid: int) -> list[int]:
        with self._lock:
            if self._next is None:
                self._next = _Walk()
            mine = self._next
            mine.wanted.add(uid)
        while not self._begin(mine):
            running = self._running
            if running is not None:
                running.done.wait()
        mine.done.wait()
        if mine.error is not None:
            raise mine.error
        return list(mine.found.get(uid, []))

    def _begin(self, mine: _Walk) -> bool:
        """Whether `mine` has begun; leads it (and returns once it is done) if no walk
        runs.

        Taking the lead is one step under the lock, and everything after it sits in one
        `try`: no exception, not even one raised asynchronously, can leave a walk led
        but never finished and its other callers waiting for ever.
        """
        leading = False
        try:
            with self._lock:
                if mine.begun:
                    return True
                if self._running is not None:
                    return False
                mine.begun, self._running, self._next, leading = True, mine, None, True
            mine.found = self._walk(frozenset(mine.wanted))
        except BaseException as error:
            if not leading:
                raise
            mine.error = error  # every caller of this walk gets it
        finally:
            if leading:
                self._finish(mine)
        return True

    def _finish(self, mine: _Walk) -> None:
        """Ends the walk this caller led: the next may begin, its callers wake."""
        with self._lock:
            self._running = None
            self.walks += 1
        mine.done.set()


_LIVE = LiveWalks(live_processes_by_uid)


def _has_executable(pid: str) -> bool:
    """False for a kernel thread (and a process already gone): no /proc/PID/exe. True
    when the link exists but cannot be read (a daemon without CAP_SYS_PTRACE, or one
    confined by an LSM): such a process is judged by its status, not passed over."""
    try:
        os.readlink(f"/proc/{pid}/exe")
    except (FileNotFoundError, ProcessLookupError):
        return False
    except PermissionError:
        return True
    return True


def _credentials(pid: int) -> tuple[int, bool, tuple[int, ...]] | None:
    """(real UID, zombie, all four UIDs) from /proc/PID/status; None if the process is
    gone; real UID -1 (and no UIDs) if the status cannot be parsed."""
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            status = f.read(4096)
    except OSError:
        return None
    zombie = _field(status, b"State")[:1] == b"Z"
    try:
        uids = tuple(int(value) for value in _field(status, b"Uid").split())
    except ValueError:
        return -1, zombie, ()
    if len(uids) != 4:
        return -1, zombie, ()
    return uids[0], zombie, uids


def _field(status: bytes, name: bytes) -> bytes:
    """One `Name:\tvalue` line's value from /proc/PID/status (b"" if absent), found
    without splitting the whole file: the walks run it for many processes."""
    start = status.find(b"\n" + name + b":")
    if start < 0:
        return b""
    start += len(name) + 2
    end = status.find(b"\n", start)
    return status[start : None if end < 0 else end].strip()


def kill_leftovers(uid: int) -> None:
    """SIGKILL every live process of `uid` (`live_processes_of`) through a pidfd and
    wait until all are gone."""
    deadline = time.monotonic() + KILL_TIMEOUT_S
    while pids := live_processes_of(uid):
        if time.monotonic() > deadline:
            raise ProviderError(
                "slot_not_idle",
                f"processes {pids} of slot account {uid} survived SIGKILL; investigate",
            )
        for pid in pids:
            _kill(pid, uid, deadline)


def _kill(pid: int, uid: int, deadline: float) -> None:
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    try:
        # The pidfd pins this process: re-check its credentials before the signal.
        parsed = _credentials(pid)
        if parsed is None or uid not in parsed[2]:
            return
        signal.pidfd_send_signal(fd, signal.SIGKILL)
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        poller.poll(max(0.0, deadline - time.monotonic()) * 1000)
    except (ProcessLookupError, FileNotFoundError):
        return
    finally:
        os.close(fd)
