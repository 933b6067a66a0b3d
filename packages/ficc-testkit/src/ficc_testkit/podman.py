"""The world of the Podman end-to-end tests: a real daemon running real rootless Podman.

Everything is built for real (`podman_world`):
- system accounts made with `useradd` (one per slot, one transport);
- the registry-free busybox test image (the repository's tools/testimage/build.py), an
  OCI archive pinned by its SHA-256 and image ID;
- ficc-provider-podman built into a wheel by hatchling (its build hook compiles the
  static barrier) and installed into a root-owned prefix under /run that the slot
  accounts can traverse (Podman, running as the slot account, bind-mounts the barrier
  from there), pinned by the digest `provider-digest podman` prints;
- a root 0600 configuration built from `Config`: the slots, the offer (device `full`
  allowed) and the provider's configuration (image, the named device `full` =
  /dev/full, runtime devices);
- the daemon, as a child process (`DaemonProcess`) or, with the `systemd` backend, as
  the shipped unit (`UnitDaemon`, which needs systemd as PID 1).

Requests go over the daemon's real transport socket (the kit's `Driver`), from a forked
child running as the transport account. Waiting is polling a real condition with a bound.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import secrets
import shutil
import subprocess
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ficc.execution.host.config.model import Config
from ficc.execution.plan import InputObject, Plan
from ficc.execution.wire import AttemptRow, ErrorRow, InputRow
from ficc_testkit import configs
from ficc_testkit.accounts import Account, account_command, create_account, kill_processes_of
from ficc_testkit.daemons import DaemonProcess, UnitDaemon, show_unit
from ficc_testkit.driver import COLLECT_CHUNK, TERMINAL, Collected, Driver, attempt, rows, send
from ficc_testkit.slots import (
    SlotFilesystem,
    private_directory,
    remove_slots,
    remove_tree,
    slot_filesystems,
)
from ficc_testkit.units import GIB, MIB
from ficc_testkit.waits import wait_for
from ficc_testkit.wheels import InstalledProvider, build_wheel, install_provider

PROJECT = "5" * 32
SLOT_CLASS = "podman"
ISOLATION = "shared-kernel"
DEVICE = "full"
"""The one named device of the configuration (/dev/full); /dev/zero is never allowed."""
WAIT_TIMEOUT = 120.0
"""Podman jobs are slower than the test provider's: waits are longer."""
SLOT_BYTES = 512 * MIB
SLOT_INODES = 20_000
WORLD_PARENT = os.environ.get("FICC_TEST_WORLD_PARENT", "/run")
"""Where each world's tree is made. /run by default; a Debian host booted with an
initramfs mounts /run `noexec` (the installed provider's barrier could not run) as a
tmpfs of a tenth of the memory (too small for the slot images), so the VM lane names a
directory on the root disk."""
"""The slot filesystems of the end-to-end world (loop-mounted ext4 images, allocated in
full under the world's directory)."""
RETRY_LATER = frozenset({"inputs_preparing", "input_busy"})
"""input_write codes that mean: try again on a later polling cycle."""
RUNTIME_DEVICES = ("/dev/null", "/dev/random", "/dev/urandom")
UNIFIED = Path("/sys/fs/cgroup/cgroup.controllers").exists()
"""A pure cgroup v2 host (one unified tree at /sys/fs/cgroup), as every systemd host
users deploy on; else the v1 hierarchies of a hybrid host."""


def _keyed(path: Path, key: str) -> int:
    """The value of `key` in a flat-keyed cgroup file (`oom_kill 3`)."""
    for line in path.read_text().splitlines():
        name, _, value = line.partition(" ")
        if name == key:
            return int(value)
    raise AssertionError(f"{path} has no {key!r}")


@dataclass(frozen=True)
class Sources:
    """Where the world's pieces come from: a checkout of the repository at `root`, or
    (`prebuilt_wheels`) a directory holding the provider's wheel built elsewhere (a
    machine without a compiler)."""

    root: Path
    prebuilt_wheels: Path | None = None

    @property
    def provider(self) -> Path:
        """ficc-provider-podman's source tree."""
        return self.root / "packages" / "ficc-provider-podman"

    @property
    def image_builder(self) -> Path:
        """The script that builds the busybox test image."""
        return self.root / "tools" / "testimage" / "build.py"

    @property
    def dropin(self) -> Path:
        """The provider's drop-in for the daemon's unit, as it ships."""
        return self.provider / "packaging" / "podman.conf"


# --- the image and the provider ---------------------------------------------------------


def build_image(
    sources: Sources, out: Path, tag: str | None = None, extra: Sequence[Path] = ()
) -> dict[str, str]:
    """The busybox test image as an OCI archive (the builder removes root's own copy);
    `extra`: host files copied in at their own paths."""
    spec = importlib.util.spec_from_file_location("ficc_testimage", sources.image_builder)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    built: dict[str, str] = module.build(
        out, tag or f"localhost/ficc-pe2e-{secrets.token_hex(4)}:1", extra
    )
    return built


def install_podman_provider(sources: Sources, base: Path) -> InstalledProvider:
    """Wheel (hatchling; the hook compiles the barrier) -> root-owned prefix -> pin."""
    if sources.prebuilt_wheels is not None:
        (wheel,) = sources.prebuilt_wheels.glob("ficc_provider_podman-*.whl")
    else:
        wheel = build_wheel(sources.provider, base / "wheel")
    return install_provider(wheel, base / "prefix", "podman")


def barrier_of(provider: InstalledProvider) -> Path:
    """The static barrier the installed provider bind-mounts into every container."""
    return provider.site / "ficc_provider_podman" / "_bin" / "ficc-barrier"


# --- the configuration -------------------------------------------------------------------


def podman_config(
    base: Path,
    *,
    slots: Sequence[Account],
    transport: Account,
    provider: InstalledProvider,
    image: Mapping[str, str],
    supervisor: str,
    filesystems: Sequence[SlotFilesystem],
    slot_inodes: int,
    offer_per_slot: bool = False,
    devices: Sequence[Mapping[str, Any]] | None = None,
) -> Config:
    """The configuration for these slot filesystems (one per slot account); the offer
    is that of one 2-CPU host, or (`offer_per_slot`) that much for every slot.
    `devices`: the provider's `devices` entries instead of the one named `full`
    (/dev/full); the offer allows every one of them."""
    scale = len(slots) if offer_per_slot else 1
    devices = [{"name": DEVICE, "path": "/dev/full"}] if devices is None else list(devices)
    resources = configs.allowance(
        cpu_millis=2000 * scale,
        memory_bytes=2 * GIB * scale,
        processes=1024 * scale,
        slots=len(slots),
        devices=[str(device["name"]) for device in devices],
        projects=[PROJECT],
        runtimes=["podman"],
    )
    configuration = {
        "images": [
            {
                "digest": image["image_id"],
                "archive": image["archive"],
                "archive_sha256": image["archive_sha256"],
                "image_id": image["image_id"],
            }
        ],
        "devices": devices,
        "runtime_devices": list(RUNTIME_DEVICES),
    }
    return configs.host_config(
        base,
        transport=transport,
        slots=[
            configs.slot(i, fs, account, slot_class=SLOT_CLASS, storage_inodes=slot_inodes)
            for i, (fs, account) in enumerate(zip(filesystems, slots, strict=True))
        ],
        resources=resources,
        providers=[configs.provider("podman", provider.digest, configuration)],
        supervisor=supervisor,
    )


# --- the world -------------------------------------------------------------------------


@dataclass
class PodmanWorld:
    """The daemon and everything around it; request helpers speak as the transport and
    return the one row of their plan (a refused row fails the test with its code)."""

    base: Path
    layout: configs.Layout
    provider: InstalledProvider
    image: dict[str, str]
    slots: list[Account]
    transport: Account
    process: DaemonProcess | UnitDaemon
    plans: list[Plan] = field(default_factory=list)

    @property
    def driver(self) -> Driver:
        """The kit's driver of this world's daemon, as its transport account."""
        return Driver(self.layout, self.transport)

    @property
    def backend(self) -> str:
        """The daemon's system-service backend (`supervisor`): cgroupfs or systemd."""
        return self.layout.config.supervisor

    # --- the daemon process

    def restart(self) -> None:
        """A new daemon on the same configuration and ledger after the old one died,
        ready (READY=1; startup recovery runs before it says so). Under systemd the
        shipped unit's Restart=on-failure does it: we only wait for it."""
        if isinstance(self.process, UnitDaemon):
            self.process.wait_restarted()
            return
        assert not self.process.alive, "the old daemon is still running"
        environment = self.process.environment
        self.process = DaemonProcess.of(self.layout, self.provider, environment=environment)
        self.process.start()

    def restart_cleanly(self) -> None:
        """A clean restart: SIGTERM (under systemd, `systemctl restart`), then a new
        daemon on the same ledger, ready."""
        if isinstance(self.process, UnitDaemon):
            self.process.restart_cleanly()
            return
        status = self.process.stop()
        assert status == 0, f"the daemon exited {status} on SIGTERM:\n{self.process.log()}"
        self.restart()

    def service_cgroup(self, plan: Plan, controller: str) -> Path:
        """The attempt's service cgroup, where its backend puts it: in the v1 hierarchy
        of `controller`, or in the one unified tree of a pure cgroup v2 host."""
        tree = Path("/sys/fs/cgroup") if UNIFIED else Path("/sys/fs/cgroup", controller)
        service = f"ficc-work-{self.layout.installation_id}-{plan.attempt_id}"
        if self.backend == "cgroupfs":
            return tree / "ficc" / service
        group = show_unit(f"{service}.service", "ControlGroup")["ControlGroup"]
        assert group, f"{service}.service has no control group (not running?)"
        return tree / group.lstrip("/")

    def oom_kills(self, plan: Plan) -> int:
        """OOM kills in the attempt's service tree, counted by the kernel (v1: each
        cgroup's `memory.oom_control`; v2: the service's hierarchical `memory.events`)."""
        top = self.service_cgroup(plan, "memory")
        if UNIFIED:
            return _keyed(top / "memory.events", "oom_kill")
        return sum(_keyed(f, "oom_kill") for f in top.rglob("memory.oom_control"))

    @property
    def socket(self) -> str:
        """The transport socket's path."""
        return self.layout.socket("transport")

    def send(self, request: Any) -> Any:
        """One request as the transport account; the reply."""
        return send(self.socket, request, self.transport)

    # --- slots

    def slot_account(self, slot_id: str | None) -> Account:
        """The account of slot `slot_id` (`s<index>`)."""
        assert slot_id is not None, "the attempt holds no slot"
        return self.slots[int(slot_id.removeprefix("s"))]

    def slot_path(self, slot_id: str | None) -> Path:
        """The mount point of slot `slot_id`."""
        assert slot_id is not None, "the attempt holds no slot"
        return self.layout.slot_paths[int(slot_id.removeprefix("s"))]

    def attempt_dir(self, row: AttemptRow) -> Path:
        """The attempt's directory on its slot."""
        return self.slot_path(row.slot) / "ficc" / row.attempt_id

    # --- plans

    def plan(
        self,
        script: str,
        *,
        inputs: Sequence[InputObject] = (),
        outputs: Sequence[tuple[str, str]] = (),
        devices: Sequence[str] = (),
        memory_bytes: int = 256 * MIB,
        processes: int = 128,
        cpu_millis: int = 1000,
    ) -> Plan:
        """A plan running `/bin/sh -c script` in the test image; tracked for teardown."""
        first = self.layout.config.slots[0]
        plan = self.driver.make_plan(
            name="podman-e2e",
            slot_class=SLOT_CLASS,
            package_digest=self.provider.digest,
            image_digest=self.image["image_id"],
            isolation=ISOLATION,
            argv=["/bin/sh", "-c", script],
            memory_bytes=memory_bytes,
            processes=processes,
            cpu_millis=cpu_millis,
            # half of a slot: the image and Podman's own files take room too
            storage_bytes=first.storage_bytes // 2,
            storage_inodes=first.storage_inodes // 2,
            devices=devices,
            inputs=inputs,
            outputs=dict(outputs),
        )
        self.plans.append(plan)
        return plan

    # --- requests (one row each; a refused row fails the test with its code)

    def bindings(self) -> dict[str, Any]:
        """The bindings an admission request carries, from the admin snapshot."""
        return self.driver.bindings()

    def prepare(self, plan: Plan, *, lease_ms: int = 300_000) -> AttemptRow:
        """Admit `plan` with a lease of `lease_ms`."""
        (row,) = rows(self.driver.prepare([plan], expires_in_ms=lease_ms))
        return attempt(row)

    def observe(self, plan: Plan) -> AttemptRow:
        """The attempt's record."""
        return attempt(self.driver.observe(plan))

    def usage(self, plan: Plan, *, payload: bool = False) -> AttemptRow:
        """The attempt's record with what it used (`observe` with `usage: true`; with
        `payload`, `payload_usage: true`: the payload's own share too)."""
        return attempt(self.driver.observe(plan, usage=True, payload_usage=payload))

    def start(self, plan: Plan) -> AttemptRow:
        """Start the attempt."""
        return attempt(self.driver.start_attempt(plan))

    def stop(self, plan: Plan) -> AttemptRow:
        """Stop the attempt."""
        return attempt(self.driver.stop_attempt(plan))

    def release(self, plan: Plan) -> AttemptRow:
        """Release the attempt."""
        return attempt(self.driver.release(plan))

    def renew(self, plan: Plan, sequence: int, expires_at_ms: int) -> AttemptRow:
        """Renew the attempt's lease."""
        return attempt(self.driver.renew(plan, sequence, expires_at_ms))

    def input_write(self, plan: Plan, obj: InputObject, offset: int, data: bytes) -> InputRow:
        """One chunk at `offset`, retried while the daemon says to try again later."""

        def accepted() -> InputRow | None:
            row = self.driver.input_write(plan, obj, offset, data)
            if isinstance(row, ErrorRow) and row.error.code in RETRY_LATER:
                return None  # the protocol's "retry on a later polling cycle"
            assert isinstance(row, InputRow), f"input_write refused: {row}"
            return row

        return wait_for(accepted, f"input_write at {offset} accepted", WAIT_TIMEOUT)

    def stream(self, plan: Plan, obj: InputObject, data: bytes, chunk: int = MIB) -> InputRow:
        """Upload `data` in `chunk`-sized writes, each at the offset the last reply returned."""
        offset = 0
        row: InputRow | None = None
        while offset < len(data):
            row = self.input_write(plan, obj, offset, data[offset : offset + chunk])
            assert row.offset == min(offset + chunk, len(data)), row
            offset = row.offset
        assert row is not None
        return row

    def read(self, plan: Plan, obj: str, offset: int, length: int = COLLECT_CHUNK) -> Any:
        """One collect row (ReadRow, or the ErrorRow of a refusal)."""
        return self.driver.read(plan, obj, offset, length)

    def collect(self, plan: Plan, obj: str) -> Collected:
        """Read `obj` in 1 MiB collect requests, each at the returned next offset, to eof."""
        return self.driver.collect(plan, obj)

    # --- waiting on the record

    def wait(
        self,
        plan: Plan,
        accept: Callable[[AttemptRow], bool],
        what: str,
        timeout: float = WAIT_TIMEOUT,
    ) -> AttemptRow:
        """Observe until `accept` takes the row (a refused observe fails at once)."""
        return self.driver.wait_state(plan, accept, what, timeout, refused_fails=True)

    def wait_settled(self, plan: Plan, timeout: float = WAIT_TIMEOUT) -> AttemptRow:
        """Until the attempt is terminal (or unknown) with its cleanup confirmed."""
        return self.wait(
            plan,
            lambda r: r.state in TERMINAL and r.cleanup_confirmed,
            "a settled state with confirmed cleanup",
            timeout,
        )

    def wait_ready(self, plan: Plan) -> AttemptRow:
        """Until the prepared attempt is ready (its provider prepare done)."""
        row = self.wait(plan, lambda r: r.ready or r.state != "prepared", "ready: true")
        assert (row.state, row.ready) == ("prepared", True), row
        return row

    def wait_running(self, plan: Plan) -> AttemptRow:
        """Until the started attempt runs."""
        row = self.wait(plan, lambda r: r.state not in ("prepared", "starting"), "running")
        assert row.state == "running", (row.state, row.reason, row.detail, row)
        return row

    def run_to_running(self, plan: Plan) -> AttemptRow:
        """prepare (no streamed inputs) -> ready -> start -> running."""
        self.prepare(plan)
        self.wait_ready(plan)
        self.start(plan)
        return self.wait_running(plan)

    def finish(self, plan: Plan) -> None:
        """Teardown of one attempt: stop it if still active, wait, release."""
        row = self.observe(plan)
        if row.state == "released":
            return
        if row.state not in TERMINAL:
            self.stop(plan)
        self.wait_settled(plan)
        released = self.release(plan)
        assert released.state == "released", released


@dataclass
class PodmanLayout:
    """Everything of the world but the daemon: accounts, image, provider, slots, config."""

    base: Path
    layout: configs.Layout
    provider: InstalledProvider
    image: dict[str, str]
    slots: list[Account]
    transport: Account


@contextlib.contextmanager
def podman_layout(
    sources: Sources,
    backend: str = "cgroupfs",
    slot_bytes: int = SLOT_BYTES,
    slot_inodes: int = SLOT_INODES,
    *,
    slots: int = 2,
    name: str = "ficc-pe2e",
    offer_per_slot: bool = False,
    devices: Sequence[Mapping[str, Any]] | None = None,
    image_files: Sequence[Path] = (),
) -> Iterator[PodmanLayout]:
    """The world's accounts (`name-<tag>-s<i>`, `-tr`), image, installed provider,
    `slots` slot filesystems of `slot_bytes` and `slot_inodes` and the configuration
    for `backend` (`devices`: see `podman_config`; `image_files`: host files the image
    holds too), without a daemon; all removed after (services of the installation
    included)."""
    tag = secrets.token_hex(3)
    base = private_directory(WORLD_PARENT, f"{name}-{tag}-")
    accounts: list[Account] = []
    filesystems: list[SlotFilesystem] = []
    layout: configs.Layout | None = None
    try:
        for role in (*(f"s{i}" for i in range(slots)), "tr"):
            accounts.append(create_account(f"{name}-{tag}-{role}"))
        *slot_accounts, transport = accounts
        image = build_image(sources, base / "image", extra=image_files)
        provider = install_podman_provider(sources, base)
        filesystems = slot_filesystems(base, [slot_bytes] * slots, slot_inodes)
        config = podman_config(
            base, slots=slot_accounts, transport=transport, provider=provider, image=image,
            supervisor=backend, filesystems=filesystems, slot_inodes=slot_inodes,
            offer_per_slot=offer_per_slot, devices=devices,
        )  # fmt: skip
        layout = configs.Layout.write(base, config, filesystems)
        yield PodmanLayout(base, layout, provider, image, slot_accounts, transport)
    finally:
        if layout is not None:
            purge_services(backend, layout.installation_id)
        for account in accounts:
            remove_account(account)
        remove_slots(filesystems)
        remove_tree(base)


@contextlib.contextmanager
def podman_world(
    sources: Sources,
    backend: str = "cgroupfs",
    slot_bytes: int = SLOT_BYTES,
    slot_inodes: int = SLOT_INODES,
    *,
    slots: int = 2,
    name: str = "ficc-pe2e",
    offer_per_slot: bool = False,
    environment: Mapping[str, str] | None = None,
    devices: Sequence[Mapping[str, Any]] | None = None,
    image_files: Sequence[Path] = (),
) -> Iterator[PodmanWorld]:
    """Build the whole world (see the module docstring) with the daemon's system-service
    backend `backend` (`environment`: added to the daemon's, cgroupfs only; `devices`:
    the provider's, see `podman_config`; `image_files`: host files the image holds too);
    tear all of it down after. The daemon must
    stop cleanly at the end. With `systemd` the daemon runs as the shipped unit, which
    needs systemd as PID 1."""
    with podman_layout(
        sources, backend, slot_bytes, slot_inodes,
        slots=slots, name=name, offer_per_slot=offer_per_slot, devices=devices,
        image_files=image_files,
    ) as made:  # fmt: skip
        process: DaemonProcess | UnitDaemon | None = None
        world: PodmanWorld | None = None
        try:
            if backend == "cgroupfs":
                process = DaemonProcess.of(made.layout, made.provider, environment=environment)
            else:  # the provider's drop-in, as it ships: rootless Podman's state in /run/user
                process = UnitDaemon(made.layout, made.provider, shipped_dropins=[sources.dropin])
            process.start()
            world = PodmanWorld(
                made.base, made.layout, made.provider, made.image, made.slots, made.transport,
                process,
            )  # fmt: skip
            yield world
            status = world.process.stop()
            assert status == 0, (
                f"the daemon did not stop cleanly ({status}):\n{world.process.log()}"
            )
        finally:
            if world is not None:
                process = world.process  # a restart may have replaced it
            if isinstance(process, UnitDaemon):
                process.uninstall()
            elif process is not None:
                process.kill()


def remove_account(account: Account) -> None:
    """Kill what is left of the account, Podman's per-user state, then the account."""
    with contextlib.suppress(AssertionError):
        kill_processes_of(account.uid)
    shutil.rmtree(f"/run/user/{account.uid}", ignore_errors=True)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(f"/dev/shm/libpod_rootless_lock_{account.uid}")  # noqa: S108 - Podman's name
    account_command("userdel", account.name)


def purge_services(backend: str, installation_id: str) -> None:
    """Services a failed test left behind (a passing run releases every one)."""
    prefix = f"ficc-work-{installation_id}-"
    if backend == "systemd":
        for verb in ("stop", "reset-failed"):
            subprocess.run(["systemctl", verb, f"{prefix}*"], check=False, capture_output=True)
        return
    from ficc.execution.host.service.cgroupfs import CgroupfsService  # noqa: PLC0415

    service = CgroupfsService()
    names: set[str] = set()
    for hierarchy in service.layout.hierarchies:
        top = Path(hierarchy.mount, "ficc")
        if top.is_dir():
            names |= {p.name for p in top.iterdir() if p.name.startswith(prefix)}
    for name in sorted(names):
        with contextlib.suppress(Exception):
            handle = service.adopt(name)
            if handle is not None:
                service.stop(handle)
                service.remove(handle)
