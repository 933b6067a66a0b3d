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

import os
import pathlib
import re
import select
import signal
import subprocess
import threading
import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import IO

from ficc.execution import provider as sdk
from ficc.execution.provider import tasks
from ficc_provider_podman import beneath
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
PAUSE_PID = "pause.pid"
SHM = "/dev/shm"  # noqa: S108 (where Podman keeps its rootless lock; root-owned, sticky)
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
        return f"{self.podman_tmpdir}/{PAUSE_PID}"

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
        os.close(self.open_runtime_dir())

    def open_runtime_dir(self) -> int:
        """/run/user/<uid>, created or checked, as a descriptor (see beneath.py)."""
        run = beneath.open_trusted("/run")
        try:
            users = beneath.ensure_directory(
                run, "user", uid=0, gid=0, mode=0o755, where=RUN_USER, exact_mode=False
            )
        finally:
            os.close(run)
        try:
            return beneath.ensure_directory(
                users, str(self.uid), uid=self.uid, gid=self.gid, mode=0o700,
                where=self.runtime_dir,
            )  # fmt: skip
        finally:
            os.close(users)

    def ensure_directories(self) -> None:
        """Create (or check) the account's Podman directories; refuses anything odd.

        Only while the account has no live task anywhere on the host (`slot_busy`
        otherwise: something the host has not cleaned up, perhaps a thread behind an
        exited leader). Resets Podman's runtime state (the job's own `podman run` may
        be the first Podman command since the last attempt, and must not run on
        whatever the account left there), and removes what a slot-account process may
        have left in the old slot-owned HOME and what an interrupted overlay check left
        in the storage. Every step works through descriptors (beneath.py): the account
        owns these directories and could swap any of them for a link at any moment.
        """
        refuse_if_busy(self.uid)
        reset_runtime_state(self)
        slot = beneath.open_trusted(self.slot_path)
        try:
            self._ensure_config_home(slot)
            base = beneath.ensure_directory(
                slot, PODMAN_DIRECTORY, uid=self.uid, gid=self.gid, mode=0o700, where=self.base
            )
        finally:
            os.close(slot)
        try:
            problems = beneath.remove_entry(base, "home", self.home)
            beneath.refuse_leftovers(SLOT_FILES, problems, "files the slot account left")
            os.close(beneath.ensure_directory(
                base, "tmp", uid=self.uid, gid=self.gid, mode=0o700, where=self.tmp
            ))  # fmt: skip
            storage = beneath.ensure_directory(
                base, "storage", uid=self.uid, gid=self.gid, mode=0o700, where=self.storage
            )
        finally:
            os.close(base)
        try:
            remove_interrupted_checks(storage, self.storage)
        finally:
            os.close(storage)

    def _ensure_config_home(self, slot: int) -> None:
        home = beneath.ensure_directory(
            slot, CONFIG_HOME, uid=0, gid=0, mode=0o755, where=self.config_home
        )
        try:
            if os.listdir(home):
                raise ProviderError(
                    "podman_directory",
                    f"{self.config_home} must be empty (Podman's configuration home); only"
                    " root could have written to it: find out who did, then empty it",
                )
        finally:
            os.close(home)


SLOT_FILES = sdk.SLOT_FILES_STUCK
"""The refusal when the slot account's files cannot be reset (named in the message):
the host takes the slot out of the offer until the administrator's check."""

INTERRUPTED_CHECK = re.compile(r"(?:compat|opaque-bug-check|metacopy-check)[0-9]+\Z")
"""The directories in which Podman's overlay driver probes the kernel (Go's
`os.MkdirTemp` names: a prefix and digits, never a layer's 64 hex digits)."""


def remove_interrupted_checks(storage: int, where: str) -> list[str]:
    """Remove what a Podman killed during its overlay checks left in `overlay/` of the
    storage directory `storage` (a descriptor), and return the names. Only while no
    task of the slot account lives.

    The overlay driver probes the kernel in temporary directories it removes
    afterwards; a power cut (or a kill) in between leaves one behind. Once a layer's
    short link under `overlay/l/` is missing too (a link made just before the cut), the
    next container mount of the slot fails: Podman's repair of the links reads a `link`
    file in each directory and fails on the leftover ("recreating the missing symlinks:
    ... opaque-bug-check.../link: no such file or directory"), and the job's start with it.
    """
    try:
        overlay = beneath.open_beneath(storage, "overlay")
    except FileNotFoundError:
        return []
    except OSError as error:
        raise ProviderError(
            "podman_directory",
            f"{where}/overlay is not a plain directory ({error.strerror}); remove it",
        ) from error
    try:
        removed = [name for name in os.listdir(overlay) if INTERRUPTED_CHECK.match(name)]
        problems: list[str] = []
        for name in removed:
            problems += beneath.remove_entry(overlay, name, f"{where}/overlay/{name}")
        beneath.refuse_leftovers(SLOT_FILES, problems, "interrupted overlay checks")
        return removed
    finally:
        os.close(overlay)


def refuse_if_busy(uid: int) -> None:
    """`slot_busy` while any task of the account lives anywhere on the host."""
    if live_processes_of(uid):
        raise ProviderError(
            "slot_busy",
            f"the slot account {uid} still has processes outside a service; "
            "the host must confirm the previous attempt's cleanup first",
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
    refuse_if_busy(account.uid)
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

    Called only when the account has no live task. Podman's runtime directories
    then describe processes that are gone (a killed container still "running", its
    conmon and the pause process, perhaps unreaped zombies), and Podman would try to
    join their namespaces and fail. Without them it refreshes its state as after a
    reboot: every container becomes stopped and can be removed. Images and container
    records in the storage (--root) are untouched. Whatever stands at those names (a
    tree of any depth, a link planted in place of a directory) is removed as what it
    is; what cannot be is refused by name (`slot_files_stuck`), never left silently
    for Podman to trip over.
    """
    runtime = account.open_runtime_dir()
    try:
        problems: list[str] = []
        for name in ("containers", "libpod", "runc", NETWORKS):
            problems += beneath.remove_entry(runtime, name, f"{account.runtime_dir}/{name}")
    finally:
        os.close(runtime)
    beneath.refuse_leftovers(SLOT_FILES, problems, "Podman's runtime state")
    shm = beneath.open_trusted(SHM)
    try:
        beneath.unlink_entry(shm, f"libpod_rootless_lock_{account.uid}")  # Podman's name
    finally:
        os.close(shm)


def forget_pause_process(account: SlotAccount) -> None:
    """Remove Podman's record of a pause process that no longer runs.

    Called only while the account has no live task: the recorded PID is then dead
    (perhaps an unreaped zombie), and Podman would try to join its namespaces and
    fail ("cannot re-exec process to join the existing user namespace"). The record
    is reached through descriptors: the account owns every directory on the way.
    """
    runtime = account.open_runtime_dir()
    try:
        tmpdir = beneath.open_beneath(runtime, PODMAN_TMPDIR)
    except OSError:
        return  # no such directory (or not a plain one): no record Podman would read
    finally:
        os.close(runtime)
    try:
        beneath.unlink_entry(tmpdir, PAUSE_PID)
    finally:
        os.close(tmpdir)


def processes_of(uid: int) -> list[int]:
    """PIDs whose real UID is `uid` among the processes whose /proc files belong to
    `uid` (a zombie counts only while another of its threads lives).

    That is every process Podman and the container start for the account (inside the
    container's user namespace a process's files belong to its root, the account),
    found with one stat per process: cheap enough for every observe. It is not proof
    that the account has nothing left (the entry belongs to the effective UID, so a
    set-user-ID-root program of the account has root's, and credentials are per
    thread): `live_processes_of` is.
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
        parsed = _leader(entry.name)
        if parsed is None or parsed[1][0] not in uids:
            continue
        if parsed[0] != b"Z" or tasks.has_live_thread(int(entry.name)):
            found.setdefault(parsed[1][0], []).append(int(entry.name))
    return found


def _leader(pid: str) -> tuple[bytes, tuple[int, ...]] | None:
    """The leader's state letter and four UIDs; None when gone or unparsable."""
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            return tasks.state_and_uids(f.read(tasks.TASK_STATUS_BYTES))
    except OSError:
        return None


def live_processes_of(uid: int) -> list[int]:
    """PIDs of processes with a live thread that has `uid` as its real, effective,
    saved or filesystem UID; one with a thread whose status cannot be parsed counts.

    From a walk of every thread on the host that began after this call, shared with
    whoever asks at the same time, the host's own checks included
    (`ficc.execution.provider.tasks`): a leader that exited while another thread
    runs hides nothing. For the checks that the account is idle and the kills of what
    is left, not for every observe.
    """
    return sorted({pid for _, pid in tasks.SHARED.live_tasks({uid})})


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
        if tasks.live_uid_of(pid, {uid}) != uid:
            return
        signal.pidfd_send_signal(fd, signal.SIGKILL)
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        poller.poll(max(0.0, deadline - time.monotonic()) * 1000)
    except (ProcessLookupError, FileNotFoundError):
        return
    finally:
        os.close(fd)
