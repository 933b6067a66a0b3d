"""A real executor host daemon for the daemon benchmarks (P4, P5, P7, P8).

`bench_host(...)` starts `python -m ficc.execution serve` as a separate process, the
way the integration suite does (the test kit's `DaemonProcess` with READY=1 over
NOTIFY_SOCKET, the provider wheel build and the `provider-digest` pin), with a
configuration built from the daemon's `Config` for the benchmark:

- its own directory under /run (the daemon refuses group/other-writable ancestors),
  removed at the end;
- its own accounts `ficc-bn-*` (transport, owner, one per slot), created if missing
  and removed again if this process made them, so a benchmark never disturbs the
  integration suite's `ficc-it-*` accounts;
- every slot a real filesystem of its own, as the daemon requires: an ext4 image
  loop-mounted by the shipped provisioning code (`ficc_testkit.slots`), removed
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
import os
import pathlib
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec

from ficc.execution.frames import HEADER, REPLY_MAX
from ficc.execution.plan import InputObject, Output, Plan
from ficc.execution.protocol import (
    Fence,
    ObserveRequest,
    RejectAbsentRequest,
    Request,
    encode_request,
)
from ficc.execution.wire import AttemptsReply, decode_reply
from ficc_testkit import configs
from ficc_testkit.accounts import Account, Accounts, run_as
from ficc_testkit.daemons import DaemonProcess
from ficc_testkit.driver import Driver, attempt, fence, rows
from ficc_testkit.host import IMAGE, PROJECT
from ficc_testkit.plans import new_id
from ficc_testkit.slots import (
    SlotFilesystem,
    private_directory,
    remove_slots,
    remove_tree,
    slot_filesystems,
)
from ficc_testkit.units import MIB
from ficc_testkit.waits import wait_for
from ficc_testkit.wheels import InstalledProvider, build_wheel, install_provider

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parents[1]
PROVIDER_SOURCE = ROOT / "tests-integration" / "providers" / "ficc-test-provider"
PREFIX = "ficc-bn-"
_provider_cache: dict[str, InstalledProvider] = {}
ROLES = ("transport", "owner")
SLOT_INODES = 2_000


def ensure_accounts(slots: int) -> Accounts:
    """The benchmark's own real accounts (see the module docstring): one per role and
    one per slot (`slot0`, `slot1`, ...)."""
    return Accounts.ensure(PREFIX, (*ROLES, *(f"slot{i}" for i in range(slots))))


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
    layout: configs.Layout
    provider: InstalledProvider
    accounts: Accounts
    process: DaemonProcess
    slot_paths: list[pathlib.Path] = field(default_factory=list)

    @property
    def driver(self) -> Driver:
        """The kit's driver of this daemon, as the transport account."""
        return Driver(self.layout, self.transport_account)

    # -- sockets and senders

    @property
    def transport(self) -> str:
        return self.layout.socket("transport")

    @property
    def admin(self) -> str:
        return self.layout.socket("admin")

    @property
    def transport_account(self) -> Account:
        return self.accounts["transport"]

    def as_transport(self, function: Callable[[], bytes]) -> bytes:
        """Run `function` in a forked child as the transport account; its bytes."""
        return run_as(self.transport_account, function)

    def send(self, request: Request, *, admin: bool = False) -> Any:
        """One request through the real Client (setup, not timed)."""
        return self.driver.as_admin(request) if admin else self.driver.as_transport(request)

    # -- the process

    @property
    def pid(self) -> int:
        return self.process.pid

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
        return self.driver.make_plan(
            name="bench-job",
            slot_class=slot_class,
            package_digest=self.provider.digest,
            image_digest=IMAGE,
            isolation="process",
            cpu_millis=10,
            memory_bytes=16 * MIB,
            processes=4,
            storage_bytes=storage_bytes,
            storage_inodes=100,
            inputs=inputs,
            outputs={o.name: o.path for o in outputs},
        )

    def bindings(self) -> dict[str, Any]:
        return self.driver.bindings()

    def prepare(self, plans: Sequence[Plan], *, lease_ms: int = 550_000) -> list[Any]:
        """Admit `plans` in one request; every row must be admitted."""
        results = rows(self.driver.prepare(plans, expires_in_ms=lease_ms))
        for row in results:
            attempt(row)
        return results

    def reject_absent(self, count: int, batch: int = 64) -> None:
        """`count` durable rejection records, `batch` per request, from one forked client."""
        bindings = self.bindings()
        frames: list[bytes] = []
        for start in range(0, count, batch):
            plans = [self.plan() for _ in range(min(batch, count - start))]
            request = RejectAbsentRequest(version=1, id=new_id(), **bindings, plans=plans)
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
        found: list[Any] = []
        for start in range(0, len(fences), 64):
            batch = list(fences[start : start + 64])
            found += rows(self.send(ObserveRequest(version=1, id=new_id(), attempts=batch)))
        return found

    def wait_ready(self, plans: Sequence[Plan], timeout: float = 300.0) -> None:
        """Until every plan's attempt is prepared and ready (its provider prepare done)."""
        fences = [fence(p) for p in plans]

        def all_ready() -> bool:
            found = self.observe_rows(fences)
            bad = [r for r in found if r.state != "prepared"]
            assert not bad, f"an attempt left prepared while waiting: {bad[0]}"
            return all(r.ready for r in found)

        wait_for(all_ready, f"{len(plans)} attempts to become ready", timeout)

    def slot_dir(self, slot_id: str) -> pathlib.Path:
        for slot in self.layout.config.slots:
            if slot.id == slot_id:
                return pathlib.Path(slot.path)
        raise KeyError(slot_id)


def _provider(session: pathlib.Path) -> InstalledProvider:
    key = str(session)
    if key not in _provider_cache:
        wheel = build_wheel(PROVIDER_SOURCE, session / "wheel")
        _provider_cache[key] = install_provider(wheel, session / "prefix")
    return _provider_cache[key]


def _config(
    base: pathlib.Path,
    accounts: Accounts,
    provider: InstalledProvider,
    slots: Sequence[SlotPlan],
    filesystems: Sequence[SlotFilesystem],
) -> configs.Config:
    """Every slot its own class and storage; the offer is what one bench plan needs, once
    per slot."""
    entries = [
        configs.slot(
            i, filesystem, accounts[f"slot{i}"], slot_class=spec.slot_class,
            storage_inodes=SLOT_INODES, storage_bytes=spec.storage_bytes,
        )
        for i, (spec, filesystem) in enumerate(zip(slots, filesystems, strict=True))
    ]  # fmt: skip
    resources = configs.allowance(
        cpu_millis=10 * len(slots),
        memory_bytes=16 * MIB * len(slots),
        processes=4 * len(slots),
        slots=len(slots),
        projects=[PROJECT],
        runtimes=["test"],
    )
    return configs.host_config(
        base,
        transport=accounts["transport"],
        owners=[accounts["owner"]],
        slots=entries,
        resources=resources,
        providers=[configs.provider("test", provider.digest, {"runtime": "service"})],
    )


@contextlib.contextmanager
def bench_host(slots: Sequence[SlotPlan]) -> Iterator[BenchHost]:
    """A started daemon with these slots; stopped (SIGTERM) and removed afterwards."""
    accounts = ensure_accounts(len(slots))
    session = private_directory("/run", f"ficc-bench-{os.getpid()}-")
    filesystems: list[SlotFilesystem] = []
    try:
        provider = _provider(session)
        base = private_directory(str(session), "host-")
        sizes = [spec.storage_bytes for spec in slots]
        filesystems = slot_filesystems(base, sizes, SLOT_INODES)
        config = _config(base, accounts, provider, slots, filesystems)
        layout = configs.Layout.write(base, config, filesystems)
        process = DaemonProcess.of(layout, provider)  # the shipped unit's settings
        process.start()
        try:
            yield BenchHost(base, layout, provider, accounts, process, layout.slot_paths)
        finally:
            status = process.stop()
            if status != 0:
                print(f"daemon exited {status}:\n{process.log()}", file=sys.stderr)
    finally:
        _provider_cache.pop(str(session), None)
        remove_slots(filesystems)
        remove_tree(session)
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


def encode(value: Any) -> bytes:
    return msgspec.json.encode(value)


def decode(data: bytes) -> Any:
    return msgspec.json.decode(data)


@contextlib.contextmanager
def profiled(pid: int) -> Iterator[None]:
    """py-spy on the daemon while the block runs, when FICC_BENCH_PYSPY names a file
    (collapsed stacks, `--format raw`, with thread names). FICC_BENCH_PYSPY_RATE sets
    the samples per second (200); FICC_BENCH_PYSPY_GIL=1 samples only the thread that
    holds the interpreter's lock, which is what a daemon bound by that lock spends."""
    target = os.environ.get("FICC_BENCH_PYSPY")
    if not target:
        yield
        return
    rate = os.environ.get("FICC_BENCH_PYSPY_RATE", "200")
    argv = ["py-spy", "record", "--pid", str(pid), "--format", "raw", "--rate", rate, "--threads"]
    if os.environ.get("FICC_BENCH_PYSPY_GIL") == "1":
        argv.append("--gil")
    spy = subprocess.Popen([*argv, "--output", target], stdout=subprocess.DEVNULL)
    try:
        yield
    finally:
        spy.send_signal(signal.SIGINT)
        spy.wait(timeout=60)


__all__ = [
    "MIB",
    "BenchHost",
    "SlotPlan",
    "bench_host",
    "decode",
    "encode",
    "exchange",
    "profiled",
    "timed_exchanges",
]
