"""A real executor host daemon for the daemon benchmarks (P4, P5, P7, P8).

`bench_host(...)` starts `python -m ficc.execution serve` as a separate process, the
way the integration suite does (tests-integration/harness.py is reused read-only: its
`Layout`, `DaemonProcess` with READY=1 over NOTIFY_SOCKET, the provider wheel build and
the `provider-digest` pin), with a configuration generated for the benchmark:

- its own directory under /run (the daemon refuses group/other-writable ancestors),
  removed at the end;
- its own accounts `ficc-bn-*` (transport, owner, one per slot), created if missing
  and removed again if this process made them, so a benchmark never disturbs the
  integration suite's `ficc-it-*` accounts;
- every slot a real filesystem of its own, as the daemon requires: an ext4 image
  loop-mounted by the shipped provisioning code (`harness.slot_filesystems`), removed
  at the end;
- the test provider built into a wheel, installed into a root-owned prefix and pinned
  by its real digest;
- the `Environment=` of the packaged systemd unit (MALLOC_MMAP_THRESHOLD_), so memory
  figures are those of the daemon as it is deployed.

Clients talk raw frames over the real sockets (`exchange`) in forked children that drop
to the transport account (`as_transport`), so what a benchmark times is the daemon and
the socket, not the client library's validation.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import pathlib
import pwd
import shlex
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(ROOT / "tests-integration"))

import msgspec  # noqa: E402

import harness as h  # noqa: E402
from ficc.execution.frames import HEADER, REPLY_MAX  # noqa: E402
from ficc.execution.plan import (  # noqa: E402
    InputObject,
    Job,
    Limits,
    Output,
    Payload,
    Plan,
    Runtime,
)
from ficc.execution.protocol import (  # noqa: E402
    Fence,
    PrepareAttempt,
    PrepareRequest,
    RejectAbsentRequest,
    Request,
    SnapshotRequest,
    encode_request,
)
from ficc.execution.wire import AttemptsReply, SnapshotReply, decode_reply  # noqa: E402

MIB = 1024 * 1024
PREFIX = "ficc-bn-"
_provider_cache: dict[str, h.InstalledProvider] = {}
ROLES = ("transport", "owner")
SLOT_INODES = 2_000


# --- accounts ------------------------------------------------------------------------


def ensure_accounts(slots: int) -> h.Accounts:
    """The benchmark's own real accounts (see the module docstring): one per role and
    one per slot (`slot0`, `slot1`, ...)."""
    made = h.Accounts()
    for role in (*ROLES, *(f"slot{i}" for i in range(slots))):
        name = PREFIX + role
        try:
            pwd.getpwnam(name)
        except KeyError:
            h.account_command(
                "useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", name
            )
            made.created.append(name)
        entry = pwd.getpwnam(name)
        made.by_role[role] = h.Account(name, entry.pw_uid, entry.pw_gid)
    return made


# --- the host --------------------------------------------------------------------------


@dataclass(frozen=True)
class SlotPlan:
    """One slot to configure: its class and reserved storage."""

    slot_class: str = "small"
    storage_bytes: int = 64 * MIB


@dataclass
class BenchHost:
    """A running daemon plus what a benchmark needs to drive and measure it."""

    base: pathlib.Path
    layout: h.Layout
    provider: h.InstalledProvider
    accounts: h.Accounts
    process: h.DaemonProcess
    slot_paths: list[pathlib.Path] = field(default_factory=list)

    # -- sockets and senders

    @property
    def transport(self) -> str:
        return self.layout.socket("transport")

    @property
    def admin(self) -> str:
        return self.layout.socket("admin")

    @property
    def transport_account(self) -> h.Account:
        return self.accounts["transport"]

    def as_transport(self, function: Callable[[], bytes]) -> bytes:
        """Run `function` in a forked child as the transport account; its bytes."""
        return h.run_as(self.transport_account, function)

    def send(self, request: Request, *, admin: bool = False) -> Any:
        """One request through the real Client (setup, not timed)."""
        if admin:
            return h.send(self.admin, request)
        return h.send(self.transport, request, self.transport_account)

    # -- the process

    @property
    def pid(self) -> int:
        assert self.process.process is not None
        return self.process.process.pid

    def memory_kib(self, field_name: str) -> int:
        """`VmRSS`, `VmHWM`, ... of the daemon, in KiB, from /proc/PID/status."""
        with open(f"/proc/{self.pid}/status", encoding="ascii") as status:
            for line in status:
                if line.startswith(field_name + ":"):
                    return int(line.split()[1])
        raise KeyError(field_name)

    def reset_peak(self) -> None:
        """Reset VmHWM to the current RSS (writing 5 to clear_refs, Linux >= 4.0)."""
        with open(f"/proc/{self.pid}/clear_refs", "w", encoding="ascii") as refs:
            refs.write("5")

    def open_fds(self) -> int:
        return len(os.listdir(f"/proc/{self.pid}/fd"))

    # -- plans and records

    def plan(
        self,
        *,
        slot_class: str = "small",
        inputs: Sequence[InputObject] = (),
        outputs: Sequence[Output] = (),
        storage_bytes: int = 16 * MIB,
    ) -> Plan:
        doc = self.layout.document
        return Plan(
            version=1,
            deployment_id=doc["deployment_id"],
            node_id=doc["node_id"],
            project_id=h.PROJECT,
            job_id=h.new_id(),
            attempt_id=h.new_id(),
            generation=1,
            offer_revision=1,
            job=Job(
                name="bench-job",
                slot_class=slot_class,
                runtime=Runtime(
                    provider="test",
                    package_digest=self.provider.digest,
                    image_digest=h.IMAGE,
                    isolation="process",
                    network="none",
                ),
                payload=Payload(argv=["/bin/true"], environment={}),
                limits=Limits(
                    cpu_millis=10,
                    memory_bytes=16 * MIB,
                    swap_bytes=0,
                    processes=4,
                    storage_bytes=storage_bytes,
                    storage_inodes=100,
                    devices=[],
                ),
                inputs=list(inputs),
                outputs=list(outputs),
                sensitive=False,
            ),
        )

    def bindings(self) -> dict[str, Any]:
        reply = self.send(SnapshotRequest(version=1, id=h.new_id()), admin=True)
        assert isinstance(reply, SnapshotReply), reply
        return reply.bindings()

    def prepare(self, plans: Sequence[Plan], *, lease_ms: int = 550_000) -> list[Any]:
        """Admit `plans` in one request; every row must be admitted."""
        expires = h.now_ms() + lease_ms
        request = PrepareRequest(
            version=1,
            id=h.new_id(),
            **self.bindings(),
            attempts=[PrepareAttempt(plan=p, lease=h.renewal(p, 1, expires)) for p in plans],
        )
        results = h.rows(self.send(request))
        for row in results:
            h.attempt(row)
        return results

    def reject_absent(self, count: int, batch: int = 64) -> None:
        """`count` durable rejection records, `batch` per request, from one forked client."""
        bindings = self.bindings()
        frames: list[bytes] = []
        for start in range(0, count, batch):
            plans = [self.plan() for _ in range(min(batch, count - start))]
            request = RejectAbsentRequest(version=1, id=h.new_id(), **bindings, plans=plans)
            frames.append(encode_request(request))
        path = self.transport

        def client() -> bytes:
            for payload in frames:
                reply = decode_reply(exchange(path, payload), "reject_absent")
                assert isinstance(reply, AttemptsReply), reply
            return b"ok"

        self.as_transport(client)

    def observe_rows(self, fences: Sequence[Fence]) -> list[Any]:
        """Observe in batches of 64 (setup and checks, not timed)."""
        from ficc.execution.protocol import ObserveRequest  # noqa: PLC0415

        found: list[Any] = []
        for start in range(0, len(fences), 64):
            batch = list(fences[start : start + 64])
            found += h.rows(self.send(ObserveRequest(version=1, id=h.new_id(), attempts=batch)))
        return found

    def wait_ready(self, plans: Sequence[Plan], timeout: float = 300.0) -> None:
        """Until every plan's attempt is prepared and ready (its provider prepare done)."""
        fences = [h.fence(p) for p in plans]

        def all_ready() -> bool:
            rows = self.observe_rows(fences)
            bad = [r for r in rows if r.state != "prepared"]
            assert not bad, f"an attempt left prepared while waiting: {bad[0]}"
            return all(r.ready for r in rows)

        h.wait_until(all_ready, f"{len(plans)} attempts to become ready", timeout)

    def slot_dir(self, slot_id: str) -> pathlib.Path:
        for slot in self.layout.document["slots"]:
            if slot["id"] == slot_id:
                return pathlib.Path(slot["path"])
        raise KeyError(slot_id)


def _provider(session: pathlib.Path) -> h.InstalledProvider:
    key = str(session)
    if key not in _provider_cache:
        wheel_dir = session / "wheel"
        wheel_dir.mkdir()
        wheel = h.build_provider_wheel(wheel_dir)
        _provider_cache[key] = h.install_provider(wheel, session / "prefix")
    return _provider_cache[key]


def _document(
    base: pathlib.Path,
    accounts: h.Accounts,
    provider: h.InstalledProvider,
    slots: Sequence[SlotPlan],
    filesystems: Sequence[h.SlotFilesystem],
) -> tuple[dict[str, Any], list[pathlib.Path]]:
    state_dir, socket_dir = base / "state", base / "sockets"
    state_dir.mkdir(mode=0o700)
    socket_dir.mkdir()
    os.chmod(socket_dir, 0o711)
    entries, paths = [], []
    for i, (spec, filesystem) in enumerate(zip(slots, filesystems, strict=True)):
        paths.append(filesystem.path)
        entries.append(
            {
                "id": f"s{i}",
                "class": spec.slot_class,
                "generation": 1,
                "path": str(filesystem.path),
                "uid": accounts[f"slot{i}"].uid,
                "gid": accounts[f"slot{i}"].gid,
                "storage_bytes": spec.storage_bytes,
                "storage_inodes": SLOT_INODES,
                "filesystem_uuid": filesystem.filesystem_uuid,
            }
        )
    resources = {
        "cpu_millis": 10 * len(slots),
        "memory_bytes": 16 * MIB * len(slots),
        "swap_bytes": 0,
        "processes": 4 * len(slots),
        "slots": len(slots),
        "devices": [],
        "projects": [h.PROJECT],
        "runtimes": ["test"],
    }
    document = {
        "installation_id": h.new_id(),
        "deployment_id": h.new_id(),
        "node_id": h.new_id(),
        "mode": "voluntary",
        "transport_uid": accounts["transport"].uid,
        "local_owner_uids": [accounts["owner"].uid],
        "maximum_lease_seconds": 600,
        "state_dir": str(state_dir),
        "socket_dir": str(socket_dir),
        "supervisor": "cgroupfs",
        "slots": entries,
        "ceiling": resources,
        "initial_offer": {"control": "active", **resources},
        "providers": [
            {
                "id": "test",
                "package_digest": provider.digest,
                "configuration": {"runtime": "service"},
            }
        ],
    }
    return document, paths


UNIT = ROOT / "packages/ficc-executor-host/packaging/ficc-executor-host.service"


def unit_environment() -> dict[str, str]:
    """The `Environment=` assignments of the packaged unit (glibc reads them at start)."""
    values: dict[str, str] = {}
    for line in UNIT.read_text().splitlines():
        if line.startswith("Environment="):
            for assignment in shlex.split(line.removeprefix("Environment=")):
                name, _, value = assignment.partition("=")
                values[name] = value
    return values


@contextlib.contextmanager
def _environment(values: dict[str, str]) -> Iterator[None]:
    """Set `values` in os.environ for a child started inside (harness copies os.environ)."""
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, old in saved.items():
            if old is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = old


@contextlib.contextmanager
def bench_host(slots: Sequence[SlotPlan]) -> Iterator[BenchHost]:
    """A started daemon with these slots; stopped (SIGTERM) and removed afterwards."""
    accounts = ensure_accounts(len(slots))
    session = h.private_directory("/run", f"ficc-bench-{os.getpid()}-")
    filesystems: list[h.SlotFilesystem] = []
    try:
        provider = _provider(session)
        base = h.private_directory(str(session), "host-")
        sizes = [spec.storage_bytes for spec in slots]
        filesystems = h.slot_filesystems(base, sizes, SLOT_INODES)
        document, paths = _document(base, accounts, provider, slots, filesystems)
        config_path = base / "executor-host.json"
        fd = os.open(config_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as out:
            json.dump(document, out)
        layout = h.Layout(
            base,
            config_path,
            base / "state",
            base / "sockets",
            paths,
            document,
            filesystems,
        )
        process = h.DaemonProcess(layout, provider)
        with _environment(unit_environment()):
            process.start()
        try:
            yield BenchHost(base, layout, provider, accounts, process, paths)
        finally:
            status = process.stop()
            if status != 0:
                print(f"daemon exited {status}:\n{process.log()}", file=sys.stderr)
    finally:
        _provider_cache.pop(str(session), None)
        h.remove_slots(filesystems)
        subprocess.run(["rm", "-rf", "--one-file-system", str(session)], check=False)
        accounts.remove()


# --- raw frames -------------------------------------------------------------------------


def exchange(path: str, payload: bytes) -> bytes:
    """Send one request frame and return the reply frame's payload (blocking socket)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.connect(path)
        sock.sendall(HEADER.pack(len(payload)) + payload)
        (length,) = HEADER.unpack(_recv_exactly(sock, HEADER.size))
        if not 0 < length <= REPLY_MAX:
            raise AssertionError(f"reply frame length {length}")
        return _recv_exactly(sock, length)


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    buffer = bytearray(n)
    view = memoryview(buffer)
    got = 0
    while got < n:
        count = sock.recv_into(view[got:])
        if not count:
            raise AssertionError(f"the peer closed after {got} of {n} bytes")
        got += count
    return bytes(buffer)


def timed_exchanges(path: str, frames: Sequence[bytes]) -> tuple[float, list[float], list[bytes]]:
    """Send frames one after another; (total seconds, per-request seconds, replies)."""
    latencies: list[float] = []
    replies: list[bytes] = []
    start = time.perf_counter()
    for payload in frames:
        begin = time.perf_counter()
        replies.append(exchange(path, payload))
        latencies.append(time.perf_counter() - begin)
    return time.perf_counter() - start, latencies, replies


def sha256_digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def encode(value: Any) -> bytes:
    return msgspec.json.encode(value)


def decode(data: bytes) -> Any:
    return msgspec.json.decode(data)


__all__ = [
    "MIB",
    "BenchHost",
    "SlotPlan",
    "bench_host",
    "decode",
    "encode",
    "exchange",
    "sha256_digest",
    "timed_exchanges",
]
