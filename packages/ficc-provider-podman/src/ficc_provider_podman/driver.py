"""The Podman provider driver: `API_VERSION`, `configure`, and the seven batch methods.

The host loads this module through the `ficc.executor` entry point `podman` (after
verifying the installed distribution's digest) and calls `configure` with the
administrator's configuration (config.py). Every method takes a list of 1..64
contexts (the provider SDK's `Context`, `PrepareContext` for prepare) and returns one
dict per context, in order, built from the SDK's reply Structs. A row that cannot be
served returns `sdk.refusal(CODE, TEXT)`; it never fails the other rows.

Context parts used: `plan`, `slot` (path, uid, gid), `attempt_directory`, `inputs`
(streamed-input capabilities), `check` (prepare only). Paths of the attempt layout
are the host's (`provider/`, `storage/`, `control/` under the attempt directory).

Methods:
- minimum_limits (once, after configure): the smallest memory and processes a plan
  must have for Podman itself to start (`MINIMUM_LIMITS`).
- probe: refuses an unknown image, isolation other than `shared-kernel`, a network
  other than `none`, an unconfigured device or local input, a device whose node or
  file changed since `configure` resolved its bundle (bundles.py), a plan variable its
  devices set; re-checks the files.
- prepare: builds the provider's per-attempt layout, places the inputs, makes sure
  the pinned image is in the slot's Podman storage, records its own state, and
  returns the prepare result (argv, barrier, devices, mounts, generated_targets,
  positive_devices, negative_devices).
- start: an acknowledgement once the barrier and every placed input are still the
  files recorded at prepare (the host runs the argv itself, in its service).
- observe: waiting -> ready (device-open results) -> payload (host PID) -> finished
  (exit status).
- stop: kills every process of the slot account (the service stop is the guarantee).
- collect: nothing to add (the host reads logs and outputs itself).
- release: makes sure the container is gone from the slot's Podman storage (proven
  from the slot's files when `podman run --rm` removed it, else `podman rm`) and
  removes the provider's part of the attempt layout.
"""

from __future__ import annotations

import concurrent.futures
import os
import stat
import threading
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import msgspec

from ficc.execution import plan as planlib
from ficc.execution import provider as sdk
from ficc_provider_podman import account as accounts
from ficc_provider_podman import (
    attempt_files,
    beneath,
    bundles,
    container,
    inputs,
    observe,
    removal,
)
from ficc_provider_podman.account import PODMAN_DIRECTORY, SlotAccount, run_podman, slot_lock
from ficc_provider_podman.barrier import barrier_path
from ficc_provider_podman.config import Config, Image, check_files, load, sha256_of_fd
from ficc_provider_podman.container import AttemptPaths
from ficc_provider_podman.errors import ProviderError

API_VERSION = 1
MAX_PARALLEL_SLOTS = 8
"""Slots of one batch whose rows run at the same time (prepare, stop, release)."""
ISOLATION = "shared-kernel"
NETWORK = "none"
MINIMUM_LIMITS = sdk.MinimumLimits(memory_bytes=64 << 20, processes=64)
"""What `minimum_limits` states. Measured with `true` as the payload through the daemon
on Debian 12 (Podman 4.3, runc 1.1, rootless, cgroup v1 hybrid): the smallest limits
that ran were 26 MiB and 32 processes (25-27 MiB and 31-36 tasks at the peak, with
Podman's Go threads); 24 MiB was OOM-killed and 30 processes could not start Podman.
Both are stated about twice over, for Go's thread count on bigger hosts and cgroup
v2's fuller memory accounting: the VM lane runs plans of 64 processes."""

Context = sdk.Context
Reply = sdk.Reply
_C = TypeVar("_C", bound=sdk.Context)


def _account(context: Context) -> SlotAccount:
    slot = context.slot
    return SlotAccount(slot.uid, slot.gid, slot.path)


def _paths(context: Context) -> AttemptPaths:
    return AttemptPaths(context.attempt_directory)


def _row(fn: Callable[[_C], Reply], context: _C) -> Reply:
    """One row: its reply, or a refusal (the host's check() code included)."""
    try:
        return fn(context)
    except sdk.Refused as error:
        return sdk.refusal(error.code, error.message)
    except Exception as error:  # an OS error or a bug: this row only
        return sdk.refusal("provider_failed", str(error)[:512])


def _slot_key(context: Context) -> int:
    """Rows of one slot account run one after another."""
    return context.slot.uid


def configure(configuration: Any) -> Driver:
    """Validate the administrator configuration; returns the driver (raises on refusal)."""
    return Driver(load(configuration))


class Driver:
    """The seven batch methods; see the module docstring."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.bundles = bundles.resolve(config)
        """The configured devices as exact bundles (nodes, files, environment), resolved
        once: a refusal here is `configure`'s."""
        self._ready_reported: set[str] = set()
        self._payload_pid: dict[str, int] = {}
        self._exit_code: dict[str, int] = {}
        """The first exit status observed per attempt: conmon's record is removed by
        Podman's cleanup soon after, so a later observe answers from here."""
        self._conmon_status: dict[str, int] = {}
        """The exit status read from conmon's own record, where observe read it (the
        release checks that Podman's state agrees with it)."""
        self._lock = threading.Lock()
        self._images_seen: dict[tuple[int, str, str], _Fingerprint] = {}
        """(slot uid, storage, image ID) -> the image record file as it was when
        Podman last confirmed the image there (see `_image_unchanged`)."""

    def _each(self, contexts: Sequence[_C], fn: Callable[[_C], Reply]) -> list[Reply]:
        return [_row(fn, context) for context in contexts]

    def _per_slot(self, contexts: Sequence[_C], fn: Callable[[_C], Reply]) -> list[Reply]:
        """`_each`, with the rows of different slot accounts run at the same time (each
        slot has its own account, storage and lock; its rows keep their order)."""
        groups: dict[int, list[int]] = {}
        for index, context in enumerate(contexts):
            groups.setdefault(_slot_key(context), []).append(index)
        if len(groups) < 2:
            return self._each(contexts, fn)
        unrun = sdk.refusal("provider_failed", "the row was not run")
        replies: list[Reply] = [unrun] * len(contexts)

        def run(indices: list[int]) -> None:
            for index in indices:
                replies[index] = _row(fn, contexts[index])

        workers = min(len(groups), MAX_PARALLEL_SLOTS)
        with concurrent.futures.ThreadPoolExecutor(workers, "ficc-podman-slot") as pool:
            for done in [pool.submit(run, indices) for indices in groups.values()]:
                done.result()
        return replies

    # --- what the runtime needs ----------------------------------------------------

    def minimum_limits(self) -> Reply:
        """The smallest plan limits with which Podman can start a payload here (they
        bound Podman, conmon and runc too, in the attempt's service); the host reads
        them once and refuses a plan below them at admission (see `MINIMUM_LIMITS`)."""
        return sdk.reply(MINIMUM_LIMITS)

    # --- probe ---------------------------------------------------------------------

    def probe(self, contexts: list[Context]) -> list[Reply]:
        return self._each(contexts, self._probe)

    def _probe(self, context: Context) -> Reply:
        check_files(self.config)
        self._image_for(context.plan)
        return sdk.reply(sdk.ProbeReply(ok=True))

    def _image_for(self, plan: planlib.Plan) -> Image:
        """Everything probe refuses, as one check also repeated by prepare."""
        runtime = plan.job.runtime
        image = self.config.image(runtime.image_digest)
        if image is None:
            raise ProviderError(
                "image_unknown",
                f"image {runtime.image_digest} is not pinned in the provider configuration",
            )
        if runtime.isolation != ISOLATION:
            raise ProviderError(
                "isolation_unsupported",
                f"isolation {runtime.isolation!r} is not offered; this provider runs "
                f"{ISOLATION!r} only",
            )
        if runtime.network != NETWORK:
            raise ProviderError(
                "network_unsupported", f"network {runtime.network!r} is not offered; only 'none'"
            )
        configured = {device.name for device in self.config.devices}
        for name in plan.job.limits.devices:
            if name not in configured:
                raise ProviderError("device_unknown", f"device {name!r} is not configured")
        self.bundles.still(plan.job.limits.devices)
        self._environment(plan)
        for obj in plan.job.inputs:
            if obj.delivery == "local" and self.config.local_input(obj.id) is None:
                raise ProviderError(
                    "input_not_configured", f"local input {obj.name!r} ({obj.id}) is not configured"
                )
        return image

    def _environment(self, plan: planlib.Plan) -> dict[str, str]:
        """The payload's environment: the plan's and its devices' (never both setting
        one variable: which value wins would be a guess)."""
        devices = self.bundles.grant(plan.job.limits.devices).environment
        payload = plan.job.payload.environment
        clash = sorted(set(devices) & set(payload))
        if clash:
            raise ProviderError(
                "environment_unsupported",
                f"the plan sets {', '.join(clash)}, which its devices set; leave them out of"
                " the plan's environment",
            )
        return {**payload, **devices}

    # --- prepare -------------------------------------------------------------------

    def prepare(self, contexts: list[sdk.PrepareContext]) -> list[Reply]:
        return self._per_slot(contexts, self._prepare)

    def _prepare(self, context: sdk.PrepareContext) -> Reply:
        check = context.check
        check()
        plan = context.plan
        image = self._image_for(plan)
        slot = _account(context)
        paths = _paths(context)
        attempt_files.check_host_layout(paths, slot)
        try:
            return self._prepare_layout(context, plan, image, slot, paths)
        except BaseException:
            attempt_files.remove_provider_files(paths)  # a refused prepare leaves nothing behind
            raise

    def _prepare_layout(
        self,
        context: sdk.PrepareContext,
        plan: planlib.Plan,
        image: Image,
        slot: SlotAccount,
        paths: AttemptPaths,
    ) -> Reply:
        check = context.check
        placed = self._place_inputs(context, plan, paths, slot, check)
        attempt_files.write_environment(paths, self._environment(plan), slot.gid)
        check()
        with slot_lock(slot.uid):
            slot.ensure_directories()
            self._ensure_image(slot, image, check)
        check()
        barrier = barrier_path()
        identity = os.stat(barrier)
        devices = container.plan_devices(self.config, plan.job.limits.devices, self.bundles)
        try:
            argv = container.run_argv(
                self.config,
                slot,
                paths,
                attempt_id=plan.attempt_id,
                image_id=image.image_id,
                barrier=str(barrier),
                devices=devices,
                payload=plan.job.payload.argv,
                processes=plan.job.limits.processes,
            )
        except ValueError as error:
            raise ProviderError("path_unsupported", str(error)) from error
        state = attempt_files.State(
            plan.attempt_id,
            image.image_id,
            str(barrier),
            identity.st_dev,
            identity.st_ino,
            placed,
            devices.positive,
            devices.negative,
        )
        attempt_files.write_state(paths, state)
        result = sdk.PrepareResult(
            argv=argv,
            barrier=sdk.BarrierSpec(
                path=str(barrier),
                identity=sdk.Identity(device=identity.st_dev, inode=identity.st_ino),
            ),
            devices=msgspec.convert(devices.prepared, list[sdk.PreparedDevice]),
            mounts=msgspec.convert(
                container.mounts(self.config, paths, str(barrier), devices.mounts),
                list[sdk.MountSpec],
            ),
            generated_targets=msgspec.convert(
                container.generated_targets(devices, container.host_dev_fs_type()),
                list[sdk.GeneratedTarget],
            ),
            positive_devices=devices.positive,
            negative_devices=devices.negative,
        )
        return sdk.reply(result)

    def _place_inputs(
        self,
        context: Context,
        plan: planlib.Plan,
        paths: AttemptPaths,
        slot: SlotAccount,
        check: Callable[[], Any],
    ) -> list[inputs.PlacedInput]:
        capabilities = {c.id: c for c in context.inputs}
        dir_fd = attempt_files.fresh_layout(paths, slot)
        placed = []
        try:
            for obj in plan.job.inputs:
                check()
                if obj.delivery == "stream":
                    capability = capabilities.get(obj.id)
                    if capability is None or (
                        capability.name,
                        capability.bytes,
                        capability.digest,
                    ) != (obj.name, obj.bytes, obj.digest):
                        raise ProviderError(
                            "input_missing", f"streamed input {obj.name!r} has no capability"
                        )
                    placed.append(inputs.link_capability(capability, dir_fd, slot.gid))
                else:
                    placed.append(
                        inputs.copy_local(
                            msgspec.to_builtins(obj), self.config, dir_fd, slot.gid, check
                        )
                    )
        finally:
            os.close(dir_fd)
        return placed

    def _ensure_image(self, slot: SlotAccount, image: Image, check: Callable[[], Any]) -> None:
        """The pinned image in the slot's storage: verified by ID, loaded if missing."""
        if self._image_unchanged(slot, image):
            return
        if self._image_present(slot, image):
            self._image_seen(slot, image)
            return
        fd = os.open(image.archive, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != 0 or st.st_mode & 0o022:
                raise ProviderError("image_archive", f"{image.archive} is not a root-owned file")
            if sha256_of_fd(fd, between=check) != image.archive_sha256:
                raise ProviderError(
                    "image_digest_mismatch",
                    f"{image.archive} does not have the pinned SHA-256 {image.archive_sha256}; "
                    "restore the archive or re-pin it",
                )
            os.lseek(fd, 0, os.SEEK_SET)
            # The archive is streamed from the fd that was hashed: no path is re-opened.
            loaded = run_podman(slot, self.config, ["load", "--quiet"], stdin=fd)
        finally:
            os.close(fd)
        if loaded.returncode != 0:
            raise ProviderError(
                "image_load_failed", f"podman load: {loaded.stderr.decode(errors='replace')[-400:]}"
            )
        if not self._image_present(slot, image):
            run_podman(slot, self.config, ["rmi", "--force", _hex(image.image_id)])
            raise ProviderError(
                "image_id_mismatch",
                f"{image.archive} does not contain image {image.image_id}; re-pin the image",
            )
        self._image_seen(slot, image)

    def _image_seen(self, slot: SlotAccount, image: Image) -> None:
        """Right after Podman confirmed the image (the account has no process left, so
        nothing of it is writing the storage): remember its image record file."""
        key = (slot.uid, slot.storage, image.image_id)
        seen = _fingerprint(slot)
        with self._lock:
            if seen is None:
                self._images_seen.pop(key, None)
            else:
                self._images_seen[key] = seen

    def _image_unchanged(self, slot: SlotAccount, image: Image) -> bool:
        """Whether Podman's answer for this image is still the one it gave: the storage's
        image record file is the very file it was then (device, inode, size, mtime and
        ctime, which no unprivileged process can set back), and the account has no
        task that could be changing it (`ensure_directories` refused `slot_busy` just
        before, under the same slot lock, after a walk of every thread on the host).
        `podman image inspect` reads that same file, so it could answer nothing else;
        any change sends prepare back to Podman."""
        with self._lock:
            seen = self._images_seen.get((slot.uid, slot.storage, image.image_id))
        return seen is not None and seen == _fingerprint(slot)

    def _image_present(self, slot: SlotAccount, image: Image) -> bool:
        found = run_podman(
            slot, self.config, ["image", "inspect", "--format", "{{.Id}}", _hex(image.image_id)]
        )
        return found.returncode == 0 and found.stdout.strip().decode() == _hex(image.image_id)

    # --- start ---------------------------------------------------------------------

    def start(self, contexts: list[Context]) -> list[Reply]:
        return self._each(contexts, self._start)

    def _start(self, context: Context) -> Reply:
        slot = _account(context)
        paths = _paths(context)
        state = attempt_files.read_state(paths)
        st = os.stat(state.barrier)
        if (st.st_dev, st.st_ino) != (state.barrier_device, state.barrier_inode):
            raise ProviderError(
                "barrier_changed", f"{state.barrier} is not the barrier recorded at prepare"
            )
        dir_fd = os.open(paths.inputs, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        try:
            inputs.verify(state.inputs, dir_fd, slot.gid)
        finally:
            os.close(dir_fd)
        return sdk.reply(sdk.StartReply(started=True))

    # --- observe -------------------------------------------------------------------

    def observe(self, contexts: list[Context]) -> list[Reply]:
        # One walk of /proc for the batch, before any exit status is read: an account
        # with no process here and no exit status after has truly lost its runtime.
        # A payload released and reported needs no walk: its row answers `payload`
        # or its exit, never from the account's processes.
        uids = {_slot_key(c) for c in contexts if not self._running_payload(c)}
        processes = accounts.processes_by_uid(uids) if uids else {}
        return self._each(contexts, lambda context: self._observe(context, processes))

    def _running_payload(self, context: Context) -> bool:
        """Whether the row's payload was released (the host's marker) and its PID
        reported in an earlier observation."""
        with self._lock:
            reported = context.attempt_id in self._payload_pid
        marker = f"{_paths(context).control}/{container.RELEASE_MARKER}"
        return reported and os.path.lexists(marker)

    def _observe(self, context: Context, processes: dict[int, list[int]]) -> Reply:
        slot = _account(context)
        paths = _paths(context)
        state = attempt_files.read_state(paths)
        attempt = state.attempt_id
        code = self._exit_of(attempt, slot, paths)
        if code is not None:
            return _observed(sdk.Observation(phase="finished", exit_code=code))
        released = os.path.lexists(f"{paths.control}/{container.RELEASE_MARKER}")
        identity = (state.barrier_device, state.barrier_inode)
        waiting = observe.barrier_processes(slot.uid, identity, processes.get(slot.uid, []))
        if len(waiting) > 1:
            raise ProviderError("runtime_report", f"several barrier processes: {waiting}")
        if waiting and not released:
            pid = waiting[0]
            devices = observe.device_results(pid, [*state.positive, *state.negative])
            if devices is None:
                return _observed(sdk.Observation(phase="waiting"))
            with self._lock:
                first = attempt not in self._ready_reported
                self._ready_reported.add(attempt)
                self._payload_pid[attempt] = pid
            opened = msgspec.convert(devices, list[sdk.DeviceOpen])
            if first:
                return _observed(sdk.Observation(phase="ready", pid=pid, devices=opened))
            return _observed(sdk.Observation(phase="payload", pid=pid, devices=opened))
        with self._lock:
            known = self._payload_pid.get(attempt) or (waiting[0] if waiting else None)
        if released and known is not None:
            return _observed(sdk.Observation(phase="payload", pid=known))
        if not processes.get(slot.uid):
            raise ProviderError(
                "runtime_lost",
                "no process of the attempt is left and no exit status was recorded",
            )
        return _observed(sdk.Observation(phase="waiting"))

    def _exit_of(self, attempt: str, slot: SlotAccount, paths: AttemptPaths) -> int | None:
        """The attempt's exit status: conmon's record, else the wrapper's, and the same
        answer ever after once one was read (observing again never goes backwards)."""
        with self._lock:
            if attempt in self._exit_code:
                return self._exit_code[attempt]
        conmon = observe.container_exit_status(paths.run, slot.runtime_dir)
        code = conmon
        if code is None:
            code = observe.exit_status(paths.run, container.EXIT_STATUS)
        if code is None:
            return None
        with self._lock:
            if conmon is not None:
                self._conmon_status.setdefault(attempt, conmon)
            return self._exit_code.setdefault(attempt, code)

    # --- stop, collect, release ----------------------------------------------------

    def stop(self, contexts: list[Context]) -> list[Reply]:
        return self._per_slot(contexts, self._stop)

    def _stop(self, context: Context) -> Reply:
        accounts.kill_leftovers(_account(context).uid)
        return sdk.reply(sdk.StopReply(stopped=True))

    def collect(self, contexts: list[Context]) -> list[Reply]:
        return self._each(contexts, lambda _: sdk.reply(sdk.CollectReply(ok=True)))

    def release(self, contexts: list[Context]) -> list[Reply]:
        return self._per_slot(contexts, self._release)

    def _release(self, context: Context) -> Reply:
        slot = _account(context)
        paths = _paths(context)
        plan = context.plan
        if os.path.isdir(slot.base):
            with slot_lock(slot.uid):
                with self._lock:
                    conmon = self._conmon_status.get(plan.attempt_id)
                if removal.not_shown(slot, paths, conmon) is not None:
                    self._remove_container(slot, plan.attempt_id)
        attempt_files.remove_provider_files(paths)
        with self._lock:
            self._ready_reported.discard(plan.attempt_id)
            self._payload_pid.pop(plan.attempt_id, None)
            self._exit_code.pop(plan.attempt_id, None)
            self._conmon_status.pop(plan.attempt_id, None)
        return sdk.reply(sdk.ReleaseReply(released=True))

    def _remove_container(self, slot: SlotAccount, attempt_id: str) -> None:
        """`podman rm`, when `podman run --rm` cannot be shown to have removed it (the
        caller holds the slot's lock)."""
        removed = run_podman(
            slot,
            self.config,
            ["rm", "--force", "--time", "0", container.container_name(attempt_id)],
        )
        error = removed.stderr.decode(errors="replace")
        if removed.returncode != 0 and "no such container" not in error.lower():
            raise ProviderError("container_remove_failed", f"podman rm: {error[-400:]}")


def _observed(observation: sdk.Observation) -> Reply:
    return sdk.reply(observation)


# --- the slot's image record -----------------------------------------------------------

_Fingerprint = tuple[int, int, int, int, int]


def _fingerprint(slot: SlotAccount) -> _Fingerprint | None:
    """Identity of the storage's image record file, reached through descriptors (the
    slot account owns every directory below the slot's root; nothing is followed)."""
    folder, name = removal.IMAGE_RECORDS
    try:
        root = beneath.open_trusted(slot.slot_path)
    except OSError:
        return None
    try:
        records = beneath.open_beneath(root, f"{PODMAN_DIRECTORY}/storage/{folder}")
    except OSError:
        return None
    finally:
        os.close(root)
    try:
        st = os.stat(name, dir_fd=records, follow_symlinks=False)
    except OSError:
        return None
    finally:
        os.close(records)
    if not stat.S_ISREG(st.st_mode):
        return None
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def _hex(image_id: str) -> str:
    return image_id.removeprefix("sha256:")
