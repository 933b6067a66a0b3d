"""The world of the Podman end-to-end tests: a real daemon running real rootless Podman.

Everything is built for real, once per test module (`podman_world`):
- three system accounts made with `useradd` (two slot accounts, one transport);
- the registry-free busybox test image (tools/testimage/build.py), an OCI archive
  pinned by its SHA-256 and image ID;
- ficc-provider-podman built into a wheel by hatchling (its build hook compiles the
  static barrier) and installed with `pip install --prefix` into a root-owned prefix
  under /run that the slot accounts can traverse (Podman, running as the slot account,
  bind-mounts the barrier from there), pinned by the digest that
  `python -m ficc.execution provider-digest podman --path SITE` prints;
- a root 0600 configuration naming the slots, the offer (device `full` allowed) and
  the provider's configuration (image, the named device `full` = /dev/full, runtime
  devices);
- the daemon (`python -m ficc.execution serve`), started with NOTIFY_SOCKET and
  waited for READY=1 (harness.DaemonProcess).

Requests go over the daemon's real transport socket with the real Client, from a
forked child running as the transport account (harness.send). Waiting is always
polling a real condition with a deadline.

The shell helper's harness.py is reused read-only for the daemon process, the sender
and the request builders; everything Podman-specific lives here.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import importlib.util
import json
import os
import pwd
import re
import secrets
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from ficc.execution.plan import InputObject, Job, Limits, Output, Payload, Plan, Runtime
from ficc.execution.protocol import (
    CollectRequest,
    InputWrite,
    InputWriteRequest,
    ObserveRequest,
    PrepareAttempt,
    PrepareRequest,
    Read,
    ReleaseRequest,
    RenewRequest,
    SnapshotRequest,
    StartRequest,
    StopRequest,
)
from ficc.execution.wire import (
    AttemptRow,
    ErrorReply,
    ErrorRow,
    InputRow,
    ReadRow,
    SnapshotReply,
)
from harness import (
    Account,
    DaemonProcess,
    InstalledProvider,
    Layout,
    SlotFilesystem,
    UnitDaemon,
    account_command,
    fence,
    new_id,
    now_ms,
    pip,
    private_directory,
    remove_slots,
    renewal,
    send,
    show_unit,
    slot_filesystems,
    wait_until,
)

ROOT = Path(__file__).resolve().parent.parent
PODMAN_SOURCE = ROOT / "packages" / "ficc-provider-podman"
TEST_IMAGE_BUILDER = ROOT / "tools" / "testimage" / "build.py"
PODMAN_DROPIN = PODMAN_SOURCE / "packaging" / "podman.conf"
MIB = 1024 * 1024
PROJECT = "5" * 32
SLOT_CLASS = "podman"
ISOLATION = "shared-kernel"
DEVICE = "full"
"""The one named device of the configuration (/dev/full); /dev/zero is never allowed."""
TERMINAL = frozenset({"succeeded", "failed", "cancelled", "expired", "unknown"})
WAIT_TIMEOUT = 120.0
SLOT_BYTES = 512 * MIB
SLOT_INODES = 20_000
"""The slot filesystems of the end-to-end world (loop-mounted ext4 images, allocated in
full under the world's directory)."""
COLLECT_CHUNK = MIB
PREBUILT_WHEELS = os.environ.get("FICC_PODMAN_WHEELS", "")
BACKENDS = tuple(os.environ.get("FICC_E2E_BACKENDS", "cgroupfs").split(","))
"""The system-service backends the end-to-end suite runs with. Default: cgroupfs (this
workplace has no systemd as PID 1); tools/systemd/run.py sets `systemd` inside its
container, where the daemon runs as the shipped unit."""
RETRY_LATER = frozenset({"inputs_preparing", "input_busy"})
"""input_write codes that mean: try again on a later polling cycle."""


def sha256(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def wait_for(condition: Callable[[], Any], what: str, timeout: float = WAIT_TIMEOUT) -> Any:
    """harness.wait_until with this module's longer default (Podman jobs are slower)."""
    return wait_until(condition, what, timeout)


# --- accounts and processes -----------------------------------------------------------


def create_account(name: str) -> Account:
    account_command("useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", name)
    entry = pwd.getpwnam(name)
    return Account(name, entry.pw_uid, entry.pw_gid)


def processes_of(uid: int) -> list[int]:
    """Live (non-zombie) PIDs whose real UID is `uid`, read from /proc."""
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/status", "rb") as status:
                fields = dict(
                    line.split(b":", 1) for line in status.read(4096).splitlines() if b":" in line
                )
        except OSError:
            continue
        real = fields.get(b"Uid", b"").split()
        if real and int(real[0]) == uid and fields.get(b"State", b"").strip()[:1] != b"Z":
            found.append(int(entry.name))
    return found


def kill_processes_of(uid: int) -> None:
    """Teardown only: SIGKILL each live process of `uid`, by PID, until none is left."""
    deadline = time.monotonic() + 30
    while pids := processes_of(uid):
        if time.monotonic() > deadline:
            raise AssertionError(f"processes {pids} of uid {uid} survive SIGKILL")
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, 9)
        time.sleep(0.05)


# --- the image and the provider ---------------------------------------------------------


def build_image(out: Path) -> dict[str, str]:
    """The busybox test image as an OCI archive; root's own copy is removed again."""
    spec = importlib.util.spec_from_file_location("ficc_testimage", TEST_IMAGE_BUILDER)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    tag = f"localhost/ficc-pe2e-{secrets.token_hex(4)}:1"
    built: dict[str, str] = module.build(out, tag)
    subprocess.run(["podman", "rmi", "-f", tag], check=False, capture_output=True)
    return built


def install_podman_provider(base: Path) -> InstalledProvider:
    """Wheel (hatchling; the hook compiles the barrier) -> root-owned prefix -> pin.

    With FICC_PODMAN_WHEELS set (inside the systemd container, which has no compiler),
    the wheel built outside is taken from that directory instead."""
    if PREBUILT_WHEELS:
        (wheel,) = Path(PREBUILT_WHEELS).glob("ficc_provider_podman-*.whl")
    else:
        wheels = base / "wheel"
        wheels.mkdir()
        pip("wheel", "--no-deps", "--no-build-isolation", "-w", str(wheels), str(PODMAN_SOURCE))
        (wheel,) = wheels.glob("ficc_provider_podman-*.whl")
    prefix = base / "prefix"
    install = ["install", "--no-deps", "--no-index", "--ignore-installed"]
    pip(*install, "--prefix", str(prefix), str(wheel))
    (site,) = prefix.glob("lib/python3*/site-packages")
    command = [sys.executable, "-m", "ficc.execution", "provider-digest", "podman"]
    result = subprocess.run(
        [*command, "--path", str(site), "--quiet"], check=True, capture_output=True, text=True
    )
    digest = result.stdout.strip()
    assert re.fullmatch(r"sha256:[0-9a-f]{64}", digest), result
    return InstalledProvider(site, digest)


def barrier_of(provider: InstalledProvider) -> Path:
    return provider.site / "ficc_provider_podman" / "_bin" / "ficc-barrier"


# --- the configuration -------------------------------------------------------------------


def write_config(
    base: Path,
    slots: Sequence[Account],
    transport: Account,
    provider: InstalledProvider,
    image: dict[str, str],
    supervisor: str,
    filesystems: Sequence[SlotFilesystem],
    slot_inodes: int,
) -> Layout:
    """The daemon's directories and root 0600 configuration (a harness.Layout) for
    these slot filesystems (one per slot account)."""
    state_dir, socket_dir = base / "state", base / "sockets"
    state_dir.mkdir(mode=0o700)
    socket_dir.mkdir()
    os.chmod(socket_dir, 0o711)
    slot_paths = [slot.path for slot in filesystems]
    resources = {
        "cpu_millis": 2000,
        "memory_bytes": 2 << 30,
        "swap_bytes": 0,
        "processes": 1024,
        "slots": len(slots),
        "devices": [DEVICE],
        "projects": [PROJECT],
        "runtimes": ["podman"],
    }
    document: dict[str, Any] = {
        "installation_id": new_id(),
        "deployment_id": new_id(),
        "node_id": new_id(),
        "mode": "voluntary",
        "transport_uid": transport.uid,
        "local_owner_uids": [],
        "maximum_lease_seconds": 600,
        "state_dir": str(state_dir),
        "socket_dir": str(socket_dir),
        "supervisor": supervisor,
        "slots": [
            {
                "id": f"s{i}",
                "class": SLOT_CLASS,
                "generation": 1,
                "path": str(path),
                "uid": account.uid,
                "gid": account.gid,
                "storage_bytes": filesystem.size,
                "storage_inodes": slot_inodes,
                "filesystem_uuid": filesystem.filesystem_uuid,
            }
            for i, (filesystem, path, account) in enumerate(
                zip(filesystems, slot_paths, slots, strict=True)
            )
        ],
        "ceiling": resources,
        "initial_offer": {"control": "active", **resources},
        "providers": [
            {
                "id": "podman",
                "package_digest": provider.digest,
                "configuration": {
                    "images": [
                        {
                            "digest": image["image_id"],
                            "archive": image["archive"],
                            "archive_sha256": image["archive_sha256"],
                            "image_id": image["image_id"],
                        }
                    ],
                    "devices": [{"name": DEVICE, "path": "/dev/full"}],
                    "runtime_devices": ["/dev/null", "/dev/random", "/dev/urandom"],
                },
            }
        ],
    }
    config_path = base / "executor-host.json"
    fd = os.open(config_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as out:
        json.dump(document, out, indent=2)
    return Layout(base, config_path, state_dir, socket_dir, slot_paths, document, [*filesystems])


# --- the suites' shared fixtures -----------------------------------------------------------

NEEDS_PODMAN = pytest.mark.skipif(
    shutil.which("podman") is None
    or shutil.which("runc") is None
    or (shutil.which("cc") is None and not PREBUILT_WHEELS),
    reason="needs podman, runc and a C compiler (apt-get install podman runc gcc libc6-dev "
    "busybox-static)",
)
"""The skip of every suite built on this world: it needs real Podman and the barrier."""


def each_test(request: pytest.FixtureRequest, world: PodmanWorld) -> Iterator[PodmanWorld]:
    """A test's use of the shared world: after it, every attempt it planned is stopped
    and released (the next test finds its slot free) and no slot-account process may be
    left. A failing test shows the daemon's log."""
    first = len(world.plans)
    yield world
    report = getattr(request.node, "report_call", None)
    if report is not None and report.failed:
        print(f"\n--- daemon log ---\n{world.process.log(80)}")
    for plan in world.plans[first:]:
        world.finish(plan)
    for account in world.slots:
        assert processes_of(account.uid) == [], f"{account.name} has processes left"


# --- the world -------------------------------------------------------------------------


@dataclass
class Collected:
    """Every collect row of one object, read to its end."""

    data: bytes
    reads: list[ReadRow]


@dataclass
class PodmanWorld:
    """The daemon and everything around it; request helpers speak as the transport."""

    base: Path
    layout: Layout
    provider: InstalledProvider
    image: dict[str, str]
    slots: list[Account]
    transport: Account
    process: DaemonProcess | UnitDaemon
    plans: list[Plan] = field(default_factory=list)

    @property
    def backend(self) -> str:
        """The daemon's system-service backend (`supervisor`): cgroupfs or systemd."""
        return str(self.layout.document["supervisor"])

    # --- the daemon process

    def restart(self) -> None:
        """A new daemon on the same configuration and ledger after the old one died,
        ready (READY=1; startup recovery runs before it says so). Under systemd the
        shipped unit's Restart=on-failure does it: we only wait for it."""
        if isinstance(self.process, UnitDaemon):
            self.process.wait_restarted()
            return
        assert not self.process.alive, "the old daemon is still running"
        self.process = DaemonProcess(self.layout, self.provider)
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
        """The attempt's service cgroup in a v1 hierarchy, where its backend puts it."""
        service = f"ficc-work-{self.layout.installation_id}-{plan.attempt_id}"
        if self.backend == "cgroupfs":
            return Path("/sys/fs/cgroup", controller, "ficc", service)
        group = show_unit(f"{service}.service", "ControlGroup")["ControlGroup"]
        assert group, f"{service}.service has no control group (not running?)"
        return Path("/sys/fs/cgroup", controller, group.lstrip("/"))

    @property
    def socket(self) -> str:
        return self.layout.socket("transport")

    def send(self, request: Any) -> Any:
        return send(self.socket, request, self.transport)

    # --- slots

    def slot_account(self, slot_id: str | None) -> Account:
        assert slot_id is not None, "the attempt holds no slot"
        return self.slots[int(slot_id.removeprefix("s"))]

    def slot_path(self, slot_id: str | None) -> Path:
        assert slot_id is not None, "the attempt holds no slot"
        return self.layout.slot_paths[int(slot_id.removeprefix("s"))]

    def attempt_dir(self, row: AttemptRow) -> Path:
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
    ) -> Plan:
        """A plan running `/bin/sh -c script` in the test image; tracked for teardown."""
        doc = self.layout.document
        plan = Plan(
            version=1,
            deployment_id=doc["deployment_id"],
            node_id=doc["node_id"],
            project_id=PROJECT,
            job_id=new_id(),
            attempt_id=new_id(),
            generation=1,
            offer_revision=1,
            job=Job(
                name="podman-e2e",
                slot_class=SLOT_CLASS,
                runtime=Runtime(
                    provider="podman",
                    package_digest=self.provider.digest,
                    image_digest=self.image["image_id"],
                    isolation=ISOLATION,
                    network="none",
                ),
                payload=Payload(argv=["/bin/sh", "-c", script], environment={}),
                limits=Limits(
                    cpu_millis=1000,
                    memory_bytes=memory_bytes,
                    swap_bytes=0,
                    processes=processes,
                    # half of a slot: the image and Podman's own files take room too
                    storage_bytes=doc["slots"][0]["storage_bytes"] // 2,
                    storage_inodes=doc["slots"][0]["storage_inodes"] // 2,
                    devices=list(devices),
                ),
                inputs=list(inputs),
                outputs=[Output(name=name, path=path) for name, path in outputs],
                sensitive=False,
            ),
        )
        self.plans.append(plan)
        return plan

    # --- requests (one row each; a refused row fails the test with its code)

    def bindings(self) -> dict[str, Any]:
        reply = send(
            self.layout.socket("admin"), SnapshotRequest(version=1, id=new_id(), after=None)
        )
        assert isinstance(reply, SnapshotReply), reply
        return reply.bindings()

    def prepare(self, plan: Plan, *, lease_ms: int = 300_000) -> AttemptRow:
        request = PrepareRequest(
            version=1,
            id=new_id(),
            **self.bindings(),
            attempts=[PrepareAttempt(plan=plan, lease=renewal(plan, 1, now_ms() + lease_ms))],
        )
        return _attempt_row(self.send(request))

    def _fenced(self, kind: Any, plan: Plan) -> AttemptRow:
        return _attempt_row(self.send(kind(version=1, id=new_id(), attempts=[fence(plan)])))

    def observe(self, plan: Plan) -> AttemptRow:
        return self._fenced(ObserveRequest, plan)

    def start(self, plan: Plan) -> AttemptRow:
        return self._fenced(StartRequest, plan)

    def stop(self, plan: Plan) -> AttemptRow:
        return self._fenced(StopRequest, plan)

    def release(self, plan: Plan) -> AttemptRow:
        return self._fenced(ReleaseRequest, plan)

    def renew(self, plan: Plan, sequence: int, expires_at_ms: int) -> AttemptRow:
        request = RenewRequest(
            version=1, id=new_id(), leases=[renewal(plan, sequence, expires_at_ms)]
        )
        return _attempt_row(self.send(request))

    def input_write(self, plan: Plan, obj: InputObject, offset: int, data: bytes) -> InputRow:
        write = InputWrite(
            attempt_id=plan.attempt_id,
            generation=plan.generation,
            plan_digest=fence(plan).plan_digest,
            object=obj.id,
            offset=offset,
            data=base64.b64encode(data).decode(),
            digest=sha256(data),
        )

        def accepted() -> InputRow | None:
            request = InputWriteRequest(version=1, id=new_id(), writes=[write])
            (row,) = rows(self.send(request))
            if isinstance(row, ErrorRow) and row.error.code in RETRY_LATER:
                return None  # the protocol's "retry on a later polling cycle"
            assert isinstance(row, InputRow), f"input_write refused: {row}"
            return row

        return wait_for(accepted, f"input_write at {offset} accepted")  # type: ignore[no-any-return]

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
        f = fence(plan)
        read = Read(
            attempt_id=f.attempt_id,
            generation=f.generation,
            plan_digest=f.plan_digest,
            object=obj,
            offset=offset,
            length=length,
        )
        (row,) = rows(self.send(CollectRequest(version=1, id=new_id(), reads=[read])))
        return row

    def collect(self, plan: Plan, obj: str) -> Collected:
        """Read `obj` in 1 MiB collect requests, each at the returned next offset, to eof."""
        data = b""
        reads: list[ReadRow] = []
        offset = 0
        while True:
            row = self.read(plan, obj, offset)
            assert isinstance(row, ReadRow), f"collect {obj} refused: {row}"
            assert row.offset == offset
            assert row.next_offset == offset + len(row.data)
            data += row.data
            reads.append(row)
            offset = row.next_offset
            if row.eof:
                return Collected(data, reads)

    # --- waiting on the record

    def wait(
        self,
        plan: Plan,
        accept: Callable[[AttemptRow], bool],
        what: str,
        timeout: float = WAIT_TIMEOUT,
    ) -> AttemptRow:
        seen: list[AttemptRow] = []

        def check() -> AttemptRow | None:
            row = self.observe(plan)
            seen.append(row)
            return row if accept(row) else None

        try:
            return wait_for(check, what, timeout)  # type: ignore[no-any-return]
        except AssertionError as error:
            raise AssertionError(f"{error}; last observe: {seen[-1] if seen else None}") from None

    def wait_settled(self, plan: Plan, timeout: float = WAIT_TIMEOUT) -> AttemptRow:
        """Until the attempt is terminal (or unknown) with its cleanup confirmed."""
        return self.wait(
            plan,
            lambda r: r.state in TERMINAL and r.cleanup_confirmed,
            "a settled state with confirmed cleanup",
            timeout,
        )

    def wait_ready(self, plan: Plan) -> AttemptRow:
        row = self.wait(plan, lambda r: r.ready or r.state != "prepared", "ready: true")
        assert (row.state, row.ready) == ("prepared", True), row
        return row

    def wait_running(self, plan: Plan) -> AttemptRow:
        row = self.wait(plan, lambda r: r.state not in ("prepared", "starting"), "running")
        assert row.state == "running", row
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


def rows(reply: Any) -> list[Any]:
    """The rows of an accepted batch reply (a whole-request refusal fails the test)."""
    assert not isinstance(reply, ErrorReply), f"refused: {reply.error.code}: {reply.error.message}"
    return list(reply.results)


def _attempt_row(reply: Any) -> AttemptRow:
    (row,) = rows(reply)
    if isinstance(row, ErrorRow):
        raise AssertionError(f"row refused: {row.error.code}: {row.error.message}")
    assert isinstance(row, AttemptRow), row
    return row


@dataclass
class PodmanLayout:
    """Everything of the world but the daemon: accounts, image, provider, slots, config."""

    base: Path
    layout: Layout
    provider: InstalledProvider
    image: dict[str, str]
    slots: list[Account]
    transport: Account


@contextlib.contextmanager
def podman_layout(
    backend: str = "cgroupfs", slot_bytes: int = SLOT_BYTES, slot_inodes: int = SLOT_INODES
) -> Iterator[PodmanLayout]:
    """The world's accounts, image, installed provider, two slot filesystems of
    `slot_bytes` and `slot_inodes` and the configuration for `backend`, without a
    daemon; all removed after (services of the installation included)."""
    tag = secrets.token_hex(3)
    base = private_directory("/run", f"ficc-pe2e-{tag}-")
    accounts: list[Account] = []
    filesystems: list[SlotFilesystem] = []
    layout: Layout | None = None
    try:
        for role in ("s0", "s1", "tr"):
            accounts.append(create_account(f"ficc-pe2e-{tag}-{role}"))
        *slots, transport = accounts
        image = build_image(base / "image")
        provider = install_podman_provider(base)
        filesystems = slot_filesystems(base, [slot_bytes] * len(slots), slot_inodes)
        layout = write_config(
            base, slots, transport, provider, image, backend, filesystems, slot_inodes
        )
        yield PodmanLayout(base, layout, provider, image, slots, transport)
    finally:
        if layout is not None:
            _purge_services(backend, layout.installation_id)
        for account in accounts:
            _remove_account(account)
        remove_slots(filesystems)
        subprocess.run(["rm", "-rf", "--one-file-system", str(base)], check=False)


@contextlib.contextmanager
def podman_world(
    backend: str = "cgroupfs", slot_bytes: int = SLOT_BYTES, slot_inodes: int = SLOT_INODES
) -> Iterator[PodmanWorld]:
    """Build the whole world (see the module docstring) with the daemon's system-service
    backend `backend` and two slot filesystems of `slot_bytes` and `slot_inodes`; tear
    all of it down after. With `systemd` the daemon runs as the shipped unit
    (harness.UnitDaemon), which needs systemd as PID 1."""
    with podman_layout(backend, slot_bytes, slot_inodes) as made:
        process: DaemonProcess | UnitDaemon | None = None
        world: PodmanWorld | None = None
        try:
            process = _daemon(backend, made.layout, made.provider)
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


def _daemon(
    backend: str, layout: Layout, provider: InstalledProvider
) -> DaemonProcess | UnitDaemon:
    if backend == "cgroupfs":
        return DaemonProcess(layout, provider)
    # The provider's drop-in, as it ships: rootless Podman's state in /run/user/<uid>.
    return UnitDaemon(layout, provider, shipped_dropins=[PODMAN_DROPIN])


def _remove_account(account: Account) -> None:
    """Kill what is left of the account, Podman's per-user state, then the account."""
    with contextlib.suppress(AssertionError):
        kill_processes_of(account.uid)
    shutil.rmtree(f"/run/user/{account.uid}", ignore_errors=True)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(f"/dev/shm/libpod_rootless_lock_{account.uid}")
    account_command("userdel", account.name)


def _purge_services(backend: str, installation_id: str) -> None:
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
