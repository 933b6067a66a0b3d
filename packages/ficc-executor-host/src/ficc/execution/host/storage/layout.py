"""Where one attempt lives on its slot's reserved filesystem: the single source of paths.

Every file the host keeps for an attempt is on the slot's reserved filesystem, so the
slot's finite storage bounds it and release frees it. Layout, for slot path S::

    S/ficc/                      root 0711  (traversable, not listable)
    S/ficc/<attempt>/            root 0711
      provider/                  root 0711  the provider's private runtime layout
      storage/                   slot uid:gid 0700  the payload's writable storage
      logs/                      root 0700
      logs/stdout, logs/stderr   root 0600  opened by the host, given to the service
      control/                   root 0755  the release marker (read-only in the payload)
      evidence/                  root 0700  gate evidence, written before any assertion
    S/ficc-staging/<attempt>/    root 0700  streamed inputs (owned by `staging`)

`provider/` is 0711 rather than 0700 so a provider whose runtime runs as the slot
account (rootless Podman) can give it a slot-owned subdirectory it can reach; the
directory itself stays unlistable and root-owned.

Names come only from validated IDs (32 lowercase hex), never from a request path.
Everything is opened relative to directory fds without following links (`fsutil`),
and an existing directory must have exactly the owner and mode above, or it is
refused (`layout_unsafe`): nothing the payload could have changed is trusted.

`remove` deletes an attempt's tree without ever following a link: links, FIFOs,
sockets and character device 0:0 (an overlayfs whiteout, which any user may make) the
payload left are unlinked as names; any other device node, a mount point (another
filesystem) or an unknown name at a fixed level refuses removal (`unexpected_entry`)
and leaves the rest for an operator. The walk holds one directory fd at a time and
climbs back with `..`, checking each parent is the directory it came from, so a deep
tree cannot exhaust file descriptors.

All methods are synchronous; the daemon calls them from its I/O threads.
"""

from __future__ import annotations

import dataclasses
import errno
import os
import re
import stat
from collections.abc import Sequence
from typing import Final, Protocol

from ficc.execution import plan as planlib
from ficc.execution import provider as sdk
from ficc.execution.errors import ErrorCode
from ficc.execution.host.core.codes import HostCode
from ficc.execution.host.core.errors import HostError
from ficc.execution.host.linux import fsutil
from ficc.execution.host.storage import slotfs
from ficc.execution.host.storage.staging import STAGING_DIRECTORY

ATTEMPTS_DIRECTORY: Final = "ficc"
STDOUT: Final = "stdout"
STDERR: Final = "stderr"
_ROOT: Final = 0
_IDENTITY: Final = re.compile(r"\A[0-9a-f]{32}\Z")
_DIR_FLAGS: Final = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_WHITEOUT: Final = os.makedev(0, 0)


class SlotLike(Protocol):
    """The slot fields the layout needs (config `Slot` and context `SlotRuntime` fit)."""

    @property
    def path(self) -> str: ...
    @property
    def uid(self) -> int: ...
    @property
    def gid(self) -> int: ...


@dataclasses.dataclass(frozen=True)
class Part:
    """One fixed directory of the attempt: its name, owner (`slot` or root) and mode."""

    name: str
    slot_owned: bool
    mode: int


PROVIDER: Final = Part("provider", False, 0o711)
STORAGE: Final = Part("storage", True, 0o700)
LOGS: Final = Part("logs", False, 0o700)
CONTROL: Final = Part("control", False, 0o755)
EVIDENCE: Final = Part("evidence", False, 0o700)
PARTS: Final = (PROVIDER, STORAGE, LOGS, CONTROL, EVIDENCE)
_FIXED_FILES: Final = {LOGS.name, CONTROL.name, EVIDENCE.name}
"""Parts that hold only regular files the host writes (no subdirectories)."""
_TREES: Final = {PROVIDER.name, STORAGE.name}
"""Parts whose content someone else shapes (provider, payload): removed as a tree."""
_BASE_MODE: Final = 0o711


@dataclasses.dataclass(frozen=True)
class AttemptPaths:
    """Absolute paths of one attempt's layout (for provider contexts and the service)."""

    root: str
    staging: str
    provider: str
    storage: str
    logs: str
    stdout: str
    stderr: str
    control: str
    evidence: str


def service_name(installation_id: str, attempt_id: str) -> str:
    """The attempt's system service: `ficc-work-<installation>-<attempt>` (both 32-hex)."""
    check_attempt_id(installation_id)
    check_attempt_id(attempt_id)
    return f"ficc-work-{installation_id}-{attempt_id}"


def check_attempt_id(attempt_id: str) -> None:
    """Refuse anything but an Identity: it becomes a directory name."""
    if not isinstance(attempt_id, str) or not _IDENTITY.match(attempt_id):
        raise HostError(
            ErrorCode.UNSAFE_PATH, f"attempt ID {attempt_id!r} is not 32 lowercase hex characters"
        )


def _unsafe(where: str, st: os.stat_result, uid: int, mode: int | None) -> HostError:
    wanted = "" if mode is None else f" with mode {mode:04o}"
    return HostError(
        ErrorCode.LAYOUT_UNSAFE,
        f"{where} is {stat.filemode(st.st_mode)} owned by uid {st.st_uid}, expected a"
        f" directory owned by uid {uid}{wanted}; investigate, then fix or remove it",
    )


class Layout:
    """The attempt directories of one slot."""

    def __init__(self, slot: SlotLike) -> None:
        self.slot_path = slot.path
        self.uid = slot.uid
        self.gid = slot.gid

    # -- paths ----------------------------------------------------------------------

    @property
    def base(self) -> str:
        return f"{self.slot_path}/{ATTEMPTS_DIRECTORY}"

    def attempt_dir(self, attempt_id: str) -> str:
        check_attempt_id(attempt_id)
        return f"{self.base}/{attempt_id}"

    def paths(self, attempt_id: str) -> AttemptPaths:
        root = self.attempt_dir(attempt_id)
        return AttemptPaths(
            root=root,
            staging=f"{self.slot_path}/{STAGING_DIRECTORY}/{attempt_id}",
            provider=f"{root}/{PROVIDER.name}",
            storage=f"{root}/{STORAGE.name}",
            logs=f"{root}/{LOGS.name}",
            stdout=f"{root}/{LOGS.name}/{STDOUT}",
            stderr=f"{root}/{LOGS.name}/{STDERR}",
            control=f"{root}/{CONTROL.name}",
            evidence=f"{root}/{EVIDENCE.name}",
        )

    # -- creating and opening -------------------------------------------------------

    def create(self, attempt_id: str) -> AttemptPaths:
        """Create the attempt's layout, or check an existing one (idempotent).

        Log files are created empty here, so `collect` of a log before start reads
        zero bytes rather than failing, and the service appends to the host's file.
        A slot that cannot take the layout (full, read-only, failing) refuses with
        `slot_full` or `storage_failed`: the attempt fails and can be released.
        """
        check_attempt_id(attempt_id)
        try:
            self._create(attempt_id)
        except OSError as error:
            raise fsutil.storage_refusal(
                f"the layout of attempt {attempt_id}", error, ErrorCode.STORAGE_FAILED
            ) from error
        return self.paths(attempt_id)

    def _create(self, attempt_id: str) -> None:
        base_fd = self._ensure_base()
        try:
            attempt_fd = _ensure_dir(base_fd, attempt_id, _ROOT, _ROOT, _BASE_MODE)
        finally:
            os.close(base_fd)
        try:
            for part in PARTS:
                uid, gid = (self.uid, self.gid) if part.slot_owned else (_ROOT, _ROOT)
                os.close(_ensure_dir(attempt_fd, part.name, uid, gid, part.mode))
            logs_fd = fsutil.open_dir_below(attempt_fd, LOGS.name)
            try:
                for name in (STDOUT, STDERR):
                    _ensure_log(logs_fd, name)
                fsutil.fsync_dir(logs_fd)
            finally:
                os.close(logs_fd)
            fsutil.fsync_dir(attempt_fd)
        finally:
            os.close(attempt_fd)

    def open_attempt(self, attempt_id: str) -> int:
        """The attempt directory as a checked fd (`not_found` if it does not exist)."""
        check_attempt_id(attempt_id)
        slot_fd = fsutil.open_dir(self.slot_path)
        try:
            base_fd = _open_checked(slot_fd, ATTEMPTS_DIRECTORY, _ROOT, _BASE_MODE)
        finally:
            os.close(slot_fd)
        try:
            return _open_checked(base_fd, attempt_id, _ROOT, _BASE_MODE)
        finally:
            os.close(base_fd)

    def open_part(self, attempt_id: str, part: Part) -> int:
        """One part of the attempt as a checked directory fd (owner and mode exact,
        except `storage`, whose mode the payload may change: only its owner is checked)."""
        attempt_fd = self.open_attempt(attempt_id)
        try:
            uid, gid = (self.uid, self.gid) if part.slot_owned else (_ROOT, _ROOT)
            mode = None if part is STORAGE else part.mode
            return _open_checked(attempt_fd, part.name, uid, mode, gid)
        finally:
            os.close(attempt_fd)

    def exists(self, attempt_id: str) -> bool:
        """Whether anything is at the attempt directory's name (without following links)."""
        check_attempt_id(attempt_id)
        try:
            os.stat(self.attempt_dir(attempt_id), follow_symlinks=False)
        except FileNotFoundError:
            return False
        except NotADirectoryError:
            return False
        return True

    def leftovers(self) -> list[str]:
        """Every entry under S/ficc and S/ficc-staging (for reconciliation: none may be
        left), as paths relative to the slot, sorted."""
        found: list[str] = []
        slot_fd = fsutil.open_dir(self.slot_path)
        try:
            for top in (ATTEMPTS_DIRECTORY, STAGING_DIRECTORY):
                try:
                    fd = fsutil.open_dir_at(slot_fd, top)
                except HostError as error:
                    if error.code == ErrorCode.NOT_FOUND:
                        continue
                    raise
                try:
                    found += [f"{top}/{name}" for name in os.listdir(fd)]
                finally:
                    os.close(fd)
        finally:
            os.close(slot_fd)
        return sorted(found)

    # -- removing -------------------------------------------------------------------

    def remove(self, attempt_id: str) -> None:
        """Delete the attempt's layout (after confirmed cleanup); absent is success.

        Raises `unexpected_entry` (an entry the host never expects: left untouched for
        an operator), `layout_unsafe`, or `layout_cleanup_failed` (an OS error).
        """
        check_attempt_id(attempt_id)
        try:
            slot_fd = fsutil.open_dir(self.slot_path)
            try:
                try:
                    base_fd = _open_checked(slot_fd, ATTEMPTS_DIRECTORY, _ROOT, _BASE_MODE)
                except HostError as error:
                    if error.code == ErrorCode.NOT_FOUND:
                        return
                    raise
            finally:
                os.close(slot_fd)
            try:
                self._remove_attempt(base_fd, attempt_id)
            finally:
                os.close(base_fd)
        except OSError as error:
            raise HostError(
                ErrorCode.LAYOUT_CLEANUP_FAILED,
                f"removing the layout of attempt {attempt_id} on slot {self.slot_path} failed"
                f" ({error.strerror or error}); the reservation stays: fix the slot"
                " filesystem and retry the release",
            ) from error

    def free_payload_data(self, attempt_id: str) -> None:
        """Delete what the payload wrote (its storage tree and the logs) and nothing else.

        Release calls this first, once cleanup is confirmed: a payload that filled its
        slot must not leave the provider's release (which may need a little space, as
        `podman rm` does) without room. Absent parts are success; refusals as `remove`.
        """
        check_attempt_id(attempt_id)
        try:
            attempt_fd = self.open_attempt(attempt_id)
        except HostError as error:
            if error.code == ErrorCode.NOT_FOUND:
                return
            raise
        try:
            device = os.fstat(attempt_fd).st_dev
            for part in (STORAGE, LOGS):
                try:
                    st = os.stat(part.name, dir_fd=attempt_fd, follow_symlinks=False)
                except FileNotFoundError:
                    continue
                if not stat.S_ISDIR(st.st_mode) or st.st_dev != device:
                    raise _unexpected(f"{self.attempt_dir(attempt_id)}/{part.name}", st)
                if part is STORAGE:
                    _remove_tree(attempt_fd, part.name, device)
                else:
                    _remove_flat(attempt_fd, part.name)
            fsutil.fsync_dir(attempt_fd)
        except OSError as error:
            raise HostError(
                ErrorCode.LAYOUT_CLEANUP_FAILED,
                f"removing what attempt {attempt_id} wrote on slot {self.slot_path} failed"
                f" ({error.strerror or error}); the reservation stays: retry the release",
            ) from error
        finally:
            os.close(attempt_fd)

    def _remove_attempt(self, base_fd: int, attempt_id: str) -> None:
        try:
            attempt_fd = _open_checked(base_fd, attempt_id, _ROOT, _BASE_MODE)
        except HostError as error:
            if error.code == ErrorCode.NOT_FOUND:
                return
            raise
        try:
            device = os.fstat(attempt_fd).st_dev
            for name in sorted(os.listdir(attempt_fd)):
                st = os.stat(name, dir_fd=attempt_fd, follow_symlinks=False)
                if name in _TREES and stat.S_ISDIR(st.st_mode) and st.st_dev == device:
                    _remove_tree(attempt_fd, name, device)
                elif name in _FIXED_FILES and stat.S_ISDIR(st.st_mode) and st.st_dev == device:
                    _remove_flat(attempt_fd, name)
                else:
                    raise _unexpected(f"{self.attempt_dir(attempt_id)}/{name}", st)
            fsutil.fsync_dir(attempt_fd)
        finally:
            os.close(attempt_fd)
        os.rmdir(attempt_id, dir_fd=base_fd)
        fsutil.fsync_dir(base_fd)

    def _ensure_base(self) -> int:
        slot_fd = fsutil.open_dir(self.slot_path)
        try:
            return _ensure_dir(slot_fd, ATTEMPTS_DIRECTORY, _ROOT, _ROOT, _BASE_MODE)
        finally:
            os.close(slot_fd)


# --- helpers ------------------------------------------------------------------------


def _open_checked(
    parent_fd: int, name: str, uid: int, mode: int | None, gid: int | None = None
) -> int:
    """Open a directory and refuse it unless owned by `uid` with exactly `mode`.

    One exception: a directory this host was killed while creating (see
    `_finish_half_created`) is finished instead of refused, when `gid` is known. A
    directory on another filesystem than its parent (a mount inside the slot) is
    refused (`storage_unverified`).
    """
    fd = fsutil.open_dir_below(parent_fd, name)
    try:
        st = os.fstat(fd)
        if st.st_uid != uid or (mode is not None and stat.S_IMODE(st.st_mode) != mode):
            group = _ROOT if gid is None and uid == _ROOT else gid
            if mode is None or group is None or not _finish_half_created(fd, st, uid, group, mode):
                raise _unsafe(f"directory {name!r}", st, uid, mode)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _finish_half_created(fd: int, st: os.stat_result, uid: int, gid: int, mode: int) -> bool:
    """Finish a directory left between `mkdir` and `fchown`/`fchmod` by a SIGKILL.

    `_ensure_dir` creates every directory root-owned 0700, then gives it its owner and
    mode. Killed in between, it leaves an EMPTY root-owned 0700 directory: only root
    can make one, and nothing has used it yet, so completing the two calls is exactly
    what the killed daemon would have done. Anything else stays refused.
    """
    if st.st_uid != _ROOT or stat.S_IMODE(st.st_mode) != 0o700 or os.listdir(fd):
        return False
    os.fchown(fd, uid, gid)
    os.fchmod(fd, mode)
    os.fsync(fd)
    return True


def _ensure_dir(parent_fd: int, name: str, uid: int, gid: int, mode: int) -> int:
    """Create a directory with exact owner and mode, or check an existing one."""
    fsutil.check_name(name)
    try:
        os.mkdir(name, 0o700, dir_fd=parent_fd)
    except FileExistsError:
        return _open_checked(parent_fd, name, uid, mode, gid)
    fd = fsutil.open_dir_below(parent_fd, name)
    try:
        os.fchown(fd, uid, gid)
        os.fchmod(fd, mode)
        fsutil.fsync_dir(parent_fd)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _ensure_log(logs_fd: int, name: str) -> None:
    try:
        fd = fsutil.create_exclusive(logs_fd, name, 0o600, os.O_WRONLY)
    except HostError as error:
        if error.code != HostCode.FILE_EXISTS:
            raise
        fd = fsutil.open_regular_at(logs_fd, name, os.O_RDONLY, owner_uid=_ROOT)
    os.close(fd)


def _unexpected(where: str, st: os.stat_result) -> HostError:
    return HostError(
        ErrorCode.UNEXPECTED_ENTRY,
        f"{where} ({stat.filemode(st.st_mode)}, uid {st.st_uid}) is not something the host"
        " creates or may delete blindly (a device, a mount point or a foreign name);"
        " inspect and remove it by hand, then retry the release",
    )


def _remove_flat(parent_fd: int, name: str) -> None:
    """Remove a host-written part: regular files only (links are unlinked as names)."""
    fd = fsutil.open_dir_at(parent_fd, name)
    try:
        for entry in os.listdir(fd):
            st = os.stat(entry, dir_fd=fd, follow_symlinks=False)
            if not (stat.S_ISREG(st.st_mode) or stat.S_ISLNK(st.st_mode)):
                raise _unexpected(f"{name}/{entry}", st)
            os.unlink(entry, dir_fd=fd)
    finally:
        os.close(fd)
    os.rmdir(name, dir_fd=parent_fd)


@dataclasses.dataclass
class _Frame:
    name: str
    parent: tuple[int, int]
    pending: list[str]


def _key(fd: int) -> tuple[int, int]:
    st = os.fstat(fd)
    return st.st_dev, st.st_ino


def _clear_names(fd: int, device: int) -> list[str]:
    """Unlink every non-directory in `fd`; return its subdirectories (same filesystem)."""
    subdirectories = []
    for name in os.listdir(fd):
        st = os.stat(name, dir_fd=fd, follow_symlinks=False)
        mode = st.st_mode
        if stat.S_ISDIR(mode):
            if st.st_dev != device:
                raise _unexpected(name, st)
            subdirectories.append(name)
        elif stat.S_ISREG(mode) or stat.S_ISLNK(mode) or stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode):
            os.unlink(name, dir_fd=fd)
        elif stat.S_ISCHR(mode) and st.st_rdev == _WHITEOUT:
            os.unlink(name, dir_fd=fd)  # any user may make one (overlayfs whiteouts)
        else:
            raise _unexpected(name, st)
    return subdirectories


def _remove_tree(top_fd: int, name: str, device: int) -> None:
    """Remove the directory `name` in `top_fd` and everything below it (see the module
    docstring: one fd at a time, links never followed, other filesystems refused)."""
    fd = fsutil.open_dir_at(top_fd, name)
    try:
        frames = [_Frame(name, _key(top_fd), _clear_names(fd, device))]
        while frames:
            frame = frames[-1]
            if frame.pending:
                child = frame.pending.pop()
                child_fd = fsutil.open_dir_at(fd, child)  # O_NOFOLLOW: a swapped link fails
                try:
                    if os.fstat(child_fd).st_dev != device:
                        raise _unexpected(child, os.fstat(child_fd))
                    frames.append(_Frame(child, _key(fd), _clear_names(child_fd, device)))
                except BaseException:
                    os.close(child_fd)
                    raise
                os.close(fd)
                fd = child_fd
                continue
            frames.pop()
            parent_fd = os.open("..", _DIR_FLAGS, dir_fd=fd)
            if _key(parent_fd) != frame.parent:
                os.close(parent_fd)
                raise OSError(errno.ESTALE, f"directory {frame.name!r} moved during removal")
            os.close(fd)
            fd = parent_fd
            os.rmdir(frame.name, dir_fd=fd)
    finally:
        os.close(fd)


__all__ = [
    "ATTEMPTS_DIRECTORY",
    "CONTROL",
    "EVIDENCE",
    "LOGS",
    "PARTS",
    "PROVIDER",
    "STDERR",
    "STDOUT",
    "STORAGE",
    "AttemptPaths",
    "Layout",
    "Part",
    "check_attempt_id",
    "service_name",
]


# --- the provider context of an attempt ------------------------------------------------

RELEASE_MARKER: Final = "release"
"""The file in `control/` whose appearance releases the barrier to run the payload."""


class SlotFacts(slotfs.SlotSpec, Protocol):
    """What the provider context says of a slot (a configured or a running slot): the
    slot checks' fields and its class."""

    @property
    def slot_class(self) -> str: ...


def provider_context(
    *,
    plan: planlib.Plan,
    plan_digest: str,
    slot: SlotFacts,
    paths: AttemptPaths,
    service: str,
    cgroup: str,
    backend: str,
    storage: sdk.StorageBinding,
    inputs: Sequence[sdk.InputCapability] = (),
    prepared: sdk.PrepareResult | None = None,
) -> sdk.Context:
    """The context of one provider row, as the daemon (and the conformance kit) builds
    it: every path is the attempt layout's, never anything a request named."""
    return sdk.Context(
        attempt_id=plan.attempt_id,
        plan=plan,
        plan_digest=plan_digest,
        slot=sdk.Slot(
            id=slot.id,
            slot_class=slot.slot_class,
            path=slot.path,
            uid=slot.uid,
            gid=slot.gid,
            storage_bytes=slot.storage_bytes,
            storage_inodes=slot.storage_inodes,
        ),
        storage=storage,
        attempt_directory=paths.root,
        provider_directory=paths.provider,
        control_directory=paths.control,
        release_marker=f"{paths.control}/{RELEASE_MARKER}",
        logs=sdk.Logs(stdout=paths.stdout, stderr=paths.stderr),
        service=service,
        cgroup=cgroup,
        supervisor=sdk.Supervisor(backend=backend, service=service),
        inputs=tuple(inputs),
        prepared=prepared,
    )
