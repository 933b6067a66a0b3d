"""The integration harness: a real executor host daemon, real users, a real provider.

Everything here is real: system accounts made with `useradd`, a root-owned directory
tree under /run (not /tmp: the daemon refuses group- or other-writable ancestors), the
test provider built into a wheel with hatchling and installed with pip into a
root-owned prefix, pinned by the digest `provider-digest` computes, a root 0600
configuration file, and the daemon started as a separate process
(`python -m ficc.execution serve`) that tells us READY=1 over a datagram socket, the
way it tells systemd. Requests go over the daemon's real sockets with the real
`ficc.execution.client.Client`, as root (administrator) or, in a forked child that
drops to the account's UID and GID, as the transport, a local owner or a stranger.

Nothing here sleeps to win a race: waiting is always for an event (a datagram, a
process exit) or for a condition polled with a deadline.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import os
import pwd
import re
import secrets
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from ficc.execution.client import Client, ClientError
from ficc.execution.frames import HEADER, REPLY_MAX
from ficc.execution.host import provision
from ficc.execution.plan import (
    InputObject,
    Job,
    Limits,
    Payload,
    Plan,
    Runtime,
    digest_of,
    plan_digest,
)
from ficc.execution.protocol import (
    Fence,
    InputStatusRequest,
    InputWrite,
    InputWriteRequest,
    ObjectRef,
    ObserveRequest,
    PrepareAttempt,
    PrepareRequest,
    ReconcileAbsentRequest,
    RejectAbsentRequest,
    ReleaseRequest,
    Renewal,
    RenewRequest,
    Request,
    SetOfferRequest,
    SnapshotRequest,
    StartRequest,
    StopRequest,
)
from ficc.execution.wire import (
    AnyReply,
    AttemptRow,
    AttemptsReply,
    ErrorReply,
    ErrorRow,
    InputRow,
    InputsReply,
    SnapshotReply,
    decode_reply,
)

ROOT = Path(__file__).resolve().parent.parent
PROVIDER_SOURCE = ROOT / "tests-integration" / "providers" / "ficc-test-provider"
PREFIX = "ficc-it-"
ACCOUNTS = ("transport", "owner", "slot0", "slot1", "other")
MIB = 1024 * 1024
SLOT_BYTES = 64 * MIB
SLOT_INODES = 4_000
"""Each test daemon's two slots: real ext4 filesystems this size (loop-mounted)."""
PROJECT = "3" * 32
IMAGE = "sha256:" + "0" * 64
PROVIDER_CALLS = "provider-calls.log"
PROVIDER_BATCHES = "provider-batches.log"
"""The test provider appends `<method> <attempt_id>` here for every row of every call."""
READY_TIMEOUT = 120.0
WAIT_TIMEOUT = 60.0


def new_id() -> str:
    return secrets.token_hex(16)


def now_ms() -> int:
    return time.time_ns() // 1_000_000


def wait_until(condition: Callable[[], Any], what: str, timeout: float = WAIT_TIMEOUT) -> Any:
    """Poll `condition` until it returns something truthy; fail after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        result = condition()
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.05)


# --- accounts ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Account:
    name: str
    uid: int
    gid: int


def account_command(*command: str) -> None:
    """useradd/userdel, retrying while another process holds the passwd lock."""
    deadline = time.monotonic() + 30
    while True:
        result = subprocess.run(command, check=False, capture_output=True, text=True)
        if result.returncode == 0:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"{' '.join(command)}: {result.stderr.strip()}")
        time.sleep(0.1)


def _exists(name: str) -> bool:
    try:
        pwd.getpwnam(name)
    except KeyError:
        return False
    return True


@dataclass
class Accounts:
    """The five real accounts of the suite: created if missing, removed if we made them."""

    by_role: dict[str, Account] = field(default_factory=dict)
    created: list[str] = field(default_factory=list)

    @classmethod
    def ensure(cls) -> Accounts:
        accounts = cls()
        for role in ACCOUNTS:
            name = PREFIX + role
            if not _exists(name):
                command = ["useradd", "--system", "--no-create-home"]
                command += ["--shell", "/usr/sbin/nologin", name]
                result = subprocess.run(command, check=False, capture_output=True, text=True)
                if result.returncode == 0:
                    accounts.created.append(name)
                elif not _exists(name):  # not made by a concurrent session either: retry
                    account_command(*command)
                    accounts.created.append(name)
            entry = pwd.getpwnam(name)
            accounts.by_role[role] = Account(name, entry.pw_uid, entry.pw_gid)
        return accounts

    def remove(self) -> None:
        """Best effort: another session may still run processes as these accounts."""
        for name in self.created:
            try:
                account_command("userdel", name)
            except AssertionError as exc:
                print(f"warning: could not remove account {name}: {exc}", file=sys.stderr)

    def __getitem__(self, role: str) -> Account:
        return self.by_role[role]


# --- the provider --------------------------------------------------------------------------


def pip(*args: str) -> None:
    """pip of this interpreter, quiet, writing world-readable files (root installs)."""
    subprocess.run(
        [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q", *args],
        check=True,
        umask=0o022,
    )


@dataclass(frozen=True)
class InstalledProvider:
    site: Path
    digest: str


def build_provider_wheel(out: Path) -> Path:
    """The test provider's wheel, built by hatchling from its source tree."""
    pip("wheel", "--no-deps", "--no-build-isolation", "-w", str(out), str(PROVIDER_SOURCE))
    (wheel,) = out.glob("ficc_test_provider-*.whl")
    return wheel


def install_provider(wheel: Path, prefix: Path) -> InstalledProvider:
    """pip install into a root-owned prefix, then ask the host for the digest to pin."""
    pip(
        "install",
        "--no-deps",
        "--no-index",
        "--ignore-installed",
        "--prefix",
        str(prefix),
        str(wheel),
    )
    (site,) = prefix.glob("lib/python3*/site-packages")
    command = [sys.executable, "-m", "ficc.execution", "provider-digest", "test"]
    result = subprocess.run(
        [*command, "--path", str(site), "--quiet"],
        check=True,
        capture_output=True,
        text=True,
    )
    digest = result.stdout.strip()
    assert re.fullmatch(r"sha256:[0-9a-f]{64}", digest), result
    return InstalledProvider(site, digest)


def private_directory(parent: str, prefix: str) -> Path:
    """A root-owned 0755 directory under `parent` (not group/other-writable)."""
    path = Path(tempfile.mkdtemp(prefix=prefix, dir=parent))
    os.chmod(path, 0o755)
    return path


# --- the configuration ---------------------------------------------------------------------


@dataclass(frozen=True)
class SlotFilesystem:
    """A real slot filesystem made for a test: an ext4 image loop-mounted on `path`."""

    path: Path
    image: Path
    filesystem_uuid: str
    size: int
    """The bytes the slot account can use (the configured `storage_bytes`)."""

    def remove(self) -> None:
        provision.remove_slot(str(self.path), str(self.image))


def slot_filesystems(base: Path, sizes: Sequence[int], storage_inodes: int) -> list[SlotFilesystem]:
    """Slot filesystems of these sizes under `base/slots` (images in `base/slot-images`), made
    by the shipped provisioning code; the caller removes them (`remove_slots`), also
    when the test fails. `base/slots` is made root 0755 if absent."""
    images, mounts = base / "slot-images", base / "slots"
    images.mkdir(mode=0o700, exist_ok=True)
    mounts.mkdir(mode=0o755, exist_ok=True)
    made: list[SlotFilesystem] = []
    try:
        for i, size in enumerate(sizes):
            path, image = mounts / f"s{i}", images / f"s{i}.img"
            slot = provision.create_image_slot(str(image), str(path), size, storage_inodes)
            made.append(SlotFilesystem(path, image, slot.filesystem_uuid, size))
    except BaseException:
        remove_slots(made)
        raise
    return made


def remove_slots(slots: Sequence[SlotFilesystem]) -> None:
    for slot in slots:
        slot.remove()


@dataclass
class Layout:
    """One daemon's directory tree and configuration file, all root-owned."""

    base: Path
    config_path: Path
    state_dir: Path
    socket_dir: Path
    slot_paths: list[Path]
    document: dict[str, Any]
    slot_filesystems: list[SlotFilesystem] = field(default_factory=list)

    def destroy(self) -> None:
        """Unmount the slot filesystems and remove the tree (teardown; never raises)."""
        remove_slots(self.slot_filesystems)
        subprocess.run(["rm", "-rf", "--one-file-system", str(self.base)], check=False)

    @classmethod
    def create(
        cls,
        base: Path,
        accounts: Accounts,
        provider: InstalledProvider,
        slot_bytes: Sequence[int] = (SLOT_BYTES, SLOT_BYTES),
        **overrides: Any,
    ) -> Layout:
        state_dir, socket_dir = base / "state", base / "sockets"
        state_dir.mkdir(mode=0o700)
        socket_dir.mkdir()
        os.chmod(socket_dir, 0o711)
        filesystems = slot_filesystems(base, slot_bytes, SLOT_INODES)
        slot_paths = [slot.path for slot in filesystems]
        resources = {
            "cpu_millis": 2000,
            "memory_bytes": 1 << 30,
            "swap_bytes": 0,
            "processes": 512,
            "slots": 2,
            "devices": [],
            "projects": [PROJECT],
            "runtimes": ["test"],
        }
        document: dict[str, Any] = {
            "installation_id": new_id(),
            "deployment_id": new_id(),
            "node_id": new_id(),
            "mode": "voluntary",
            "transport_uid": accounts["transport"].uid,
            "local_owner_uids": [accounts["owner"].uid],
            "maximum_lease_seconds": 600,
            "state_dir": str(state_dir),
            "socket_dir": str(socket_dir),
            "supervisor": "cgroupfs",
            "slots": [
                {
                    "id": f"s{i}",
                    "class": "small",
                    "generation": 1,
                    "path": str(path),
                    "uid": accounts[f"slot{i}"].uid,
                    "gid": accounts[f"slot{i}"].gid,
                    "storage_bytes": slot_bytes[i],
                    "storage_inodes": SLOT_INODES,
                    "filesystem_uuid": filesystems[i].filesystem_uuid,
                }
                for i, path in enumerate(slot_paths)
            ],
            "ceiling": resources,
            "initial_offer": {"control": "active", **resources},
            "providers": [
                {
                    "id": "test",
                    "package_digest": provider.digest,
                    # `service`: the host's system service runs the provider's barrier as
                    # the slot account; it is unconfined, so the payload gate refuses it
                    "configuration": {
                        "runtime": "service",
                        "call_log": str(base / PROVIDER_CALLS),
                        "batch_log": str(base / PROVIDER_BATCHES),
                    },
                }
            ],
        }
        document.update(overrides)
        config_path = base / "executor-host.json"
        try:
            fd = os.open(config_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as out:
                json.dump(document, out, indent=2)
        except BaseException:
            remove_slots(filesystems)
            raise
        return cls(base, config_path, state_dir, socket_dir, slot_paths, document, filesystems)

    def provider_calls(self, method: str, attempt_id: str) -> int:
        """How many rows of `method` the provider has been called with for the attempt."""
        try:
            lines = (self.base / PROVIDER_CALLS).read_text().splitlines()
        except FileNotFoundError:
            return 0
        return lines.count(f"{method} {attempt_id}")

    def provider_batches(self, method: str) -> list[int]:
        """The row count of every driver call of `method`, in call order."""
        try:
            lines = (self.base / PROVIDER_BATCHES).read_text().splitlines()
        except FileNotFoundError:
            return []
        return [int(rows) for name, rows in (line.split() for line in lines) if name == method]

    @property
    def installation_id(self) -> str:
        return str(self.document["installation_id"])

    def socket(self, role: str) -> str:
        if role == "owner":
            return str(self.socket_dir / f"owner-{self.document['local_owner_uids'][0]}.sock")
        return str(self.socket_dir / {"transport": "transport.sock", "admin": "admin.sock"}[role])


# --- the daemon process ---------------------------------------------------------------------


class DaemonFailed(AssertionError):
    """The daemon exited or never became ready; the message carries its log."""


class DaemonProcess:
    """`python -m ficc.execution serve` as a child process, ready when it says READY=1."""

    def __init__(
        self, layout: Layout, provider: InstalledProvider, python: str = sys.executable
    ) -> None:
        self.layout = layout
        self.provider = provider
        self.python = python  # the interpreter whose installed ficc-executor-host runs
        self.log_path = layout.base / f"daemon-{secrets.token_hex(3)}.log"
        self.process: subprocess.Popen[bytes] | None = None
        self.notify_path = layout.base / "notify.sock"

    def start(self) -> None:
        notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
        if self.notify_path.exists():
            self.notify_path.unlink()
        notify.bind(str(self.notify_path))
        env = {k: v for k, v in os.environ.items() if not k.startswith(("NOTIFY_", "WATCHDOG_"))}
        env["NOTIFY_SOCKET"] = str(self.notify_path)
        command = [self.python, "-m", "ficc.execution", "serve"]
        command += ["--config", str(self.layout.config_path)]
        command += ["--provider-path", str(self.provider.site)]
        with notify, open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                command, stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=env
            )
            self._wait_ready(notify)

    def _wait_ready(self, notify: socket.socket) -> None:
        assert self.process is not None
        deadline = time.monotonic() + READY_TIMEOUT
        while time.monotonic() < deadline:
            readable, _, _ = select.select([notify], [], [], 0.2)
            if readable:
                lines = notify.recv(4096).decode().split("\n")
                if "READY=1" in lines:
                    return
            if self.process.poll() is not None:
                raise DaemonFailed(
                    f"the daemon exited with {self.process.returncode} before READY=1:\n"
                    + self.log()
                )
        self.kill()
        raise DaemonFailed(f"no READY=1 within {READY_TIMEOUT} s:\n" + self.log())

    def stop(self) -> int:
        """SIGTERM and wait; returns the exit status (0 is a clean stop)."""
        if self.process is None or self.process.poll() is not None:
            return self.process.returncode if self.process else 0
        self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(60)
        except subprocess.TimeoutExpired:
            self.kill()
            raise DaemonFailed("the daemon ignored SIGTERM for 60 s:\n" + self.log()) from None

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(30)

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def log(self, tail: int = 200) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except FileNotFoundError:
            return "(no log)"
        return "\n".join(lines[-tail:])

    def events(self) -> list[dict[str, Any]]:
        records = []
        for line in self.log_path.read_text(errors="replace").splitlines():
            if line.startswith("{"):
                try:
                    records.append(json.loads(line))
                except ValueError:
                    continue
        return records


UNIT = "ficc-executor-host.service"
SYSTEMCTL = "/usr/bin/systemctl"
UNIT_DIR = Path("/etc/systemd/system")


def shipped_unit_file() -> Path:
    """The unit file the package ships: in the repository, or where tools/systemd/run.py
    copies it inside the systemd container (next to tests-integration/)."""
    packaged = ROOT / "packages" / "ficc-executor-host" / "packaging" / UNIT
    return packaged if packaged.exists() else ROOT / UNIT


def show_unit(unit: str, *keys: str) -> dict[str, str]:
    """`systemctl show` of the given properties, as a dict."""
    argv = [SYSTEMCTL, "show", unit, *(f"--property={k}" for k in keys)]
    output = subprocess.run(argv, capture_output=True, text=True, check=True).stdout
    return dict(line.split("=", 1) for line in output.splitlines() if "=" in line)


class UnitDaemon:
    """The daemon as the systemd service it ships as (needs systemd as PID 1).

    The shipped unit file is installed as is, plus a drop-in that only points it (its
    check-config and its serve) at this layout's configuration and provider, opens this
    layout's directories (and `read_write`) to it, and shortens the restart delay;
    `dropin` adds lines to the drop-in's [Service] section, and `shipped_dropins` are
    drop-in files a package ships, installed as they are (test.conf sorts after them,
    so it wins). The same interface as DaemonProcess: `start` returns after READY=1
    (`systemctl start` waits for it), `kill` is a SIGKILL of the main process (after
    which the unit's Restart=on-failure brings a new daemon back: see
    `wait_restarted`), `stop` is `systemctl stop`.
    """

    def __init__(
        self,
        layout: Layout,
        provider: InstalledProvider,
        *,
        read_write: Sequence[str] = (),
        dropin: str = "",
        shipped_dropins: Sequence[Path] = (),
    ) -> None:
        self.layout = layout
        self.provider = provider
        self.pid = 0
        self.dropin_dir = UNIT_DIR / f"{UNIT}.d"
        shutil.copy(shipped_unit_file(), UNIT_DIR / UNIT)
        self.dropin_dir.mkdir(exist_ok=True)
        for shipped in shipped_dropins:
            shutil.copy(shipped, self.dropin_dir / shipped.name)
        paths = " ".join([str(layout.base), "/sys/fs/cgroup", *read_write])
        (self.dropin_dir / "test.conf").write_text(
            "[Service]\n"
            "ExecStartPre=\n"
            f"ExecStartPre={sys.executable} -I -m ficc.execution check-config"
            f" --config {layout.config_path} --provider-path {provider.site}"
            " --allow-unavailable-providers\n"
            "ExecStart=\n"
            f"ExecStart={sys.executable} -I -m ficc.execution serve"
            f" --config {layout.config_path} --provider-path {provider.site}\n"
            # Reset first: the shipped /srv/ficc/slots does not exist here.
            "ReadWritePaths=\n"
            f"ReadWritePaths={paths}\n"
            "RestartSec=100ms\n" + dropin
        )
        self._systemctl("daemon-reload")
        self._systemctl("reset-failed", UNIT, check=False)

    @staticmethod
    def _systemctl(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return subprocess.run([SYSTEMCTL, *args], capture_output=True, text=True, check=check)

    def show(self, *keys: str) -> dict[str, str]:
        return show_unit(UNIT, *keys)

    def start(self) -> None:
        started = self._systemctl("start", UNIT, check=False)
        if started.returncode != 0:
            raise DaemonFailed(f"systemctl start {UNIT}: {started.stderr}\n{self.log()}")
        self.pid = int(self.show("MainPID")["MainPID"])

    def stop(self) -> int:
        """`systemctl stop`; 0 when the unit stopped cleanly (Result=success)."""
        self._systemctl("stop", UNIT, check=False)
        result = self.show("ActiveState", "Result")
        return 0 if result == {"ActiveState": "inactive", "Result": "success"} else 1

    def restart_cleanly(self) -> None:
        """`systemctl restart`: SIGTERM, a clean stop, then a new daemon up to READY=1."""
        old = self.pid
        restarted = self._systemctl("restart", UNIT, check=False)
        if restarted.returncode != 0:
            raise DaemonFailed(f"systemctl restart {UNIT}: {restarted.stderr}\n{self.log()}")
        self.pid = int(self.show("MainPID")["MainPID"])
        assert self.pid not in {0, old}, self.show("MainPID", "ActiveState")

    def kill(self) -> None:
        """SIGKILL the daemon's main process and wait until systemd has seen it die."""
        old = self.pid
        self._systemctl("kill", "--kill-whom=main", "--signal=SIGKILL", UNIT, check=False)
        wait_until(lambda: self.show("MainPID")["MainPID"] != str(old), "systemd to see the kill")

    def wait_restarted(self) -> None:
        """Restart=on-failure at work: a new main process that said READY=1."""
        old = self.pid

        def running() -> bool:
            state = self.show("ActiveState", "SubState", "MainPID")
            return state["SubState"] == "running" and state["MainPID"] not in {"0", str(old)}

        wait_until(running, "systemd to restart the daemon", READY_TIMEOUT)
        self.pid = int(self.show("MainPID")["MainPID"])

    @property
    def alive(self) -> bool:
        state = self.show("ActiveState", "MainPID")
        return state["ActiveState"] == "active" and state["MainPID"] == str(self.pid)

    def log(self, tail: int = 200) -> str:
        argv = ["journalctl", "-u", UNIT, "-u", "ficc-work-*", "--no-pager", "-n", str(tail)]
        return subprocess.run(argv, capture_output=True, text=True, check=False).stdout

    def uninstall(self) -> None:
        """Stop the unit and remove it with its drop-in."""
        self._systemctl("stop", UNIT, check=False)
        self._systemctl("reset-failed", UNIT, check=False)
        shutil.rmtree(self.dropin_dir, ignore_errors=True)
        (UNIT_DIR / UNIT).unlink(missing_ok=True)
        self._systemctl("daemon-reload")


# --- talking to it -----------------------------------------------------------------------


class ClientFailed(AssertionError):
    """No trustworthy reply (the Client raised); `kind` is the ClientError class name."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(f"{kind}: {message}")
        self.kind = kind
        self.message = message


def run_as(account: Account | None, function: Callable[[], bytes]) -> bytes:
    """Run `function` as `account` (UID, GID, no groups) in a forked child; its bytes.

    The child inherits every imported module, so the unprivileged account never needs
    to read the interpreter or the source tree. SO_PEERCRED records the child's
    credentials when it connects.
    """
    if account is None:
        return function()
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # child
        status = 0
        try:
            os.close(read_end)
            os.setgroups([])
            os.setresgid(account.gid, account.gid, account.gid)
            os.setresuid(account.uid, account.uid, account.uid)
            result = b"R" + function()
        except BaseException:
            result = b"X" + traceback.format_exc().encode()
            status = 1
        try:
            with os.fdopen(write_end, "wb") as out:
                out.write(result)
        finally:
            os._exit(status)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as source:
        data = source.read()
    _, status = os.waitpid(pid, 0)
    if not data.startswith(b"R"):
        raise AssertionError(f"the child as {account.name} failed:\n{data[1:].decode()}")
    return data[1:]


def _request_bytes(path: str, request: Request) -> bytes:
    try:
        reply = asyncio.run(Client(path, read_timeout=120).request(request))
    except ClientError as exc:
        return b"E" + json.dumps([type(exc).__name__, str(exc)]).encode()
    return b"R" + msgspec.json.encode(reply)


def send(path: str, request: Request, account: Account | None = None) -> AnyReply:
    """Send one request as `account` (None: root) and return the decoded reply."""
    data = run_as(account, lambda: _request_bytes(path, request))
    if data.startswith(b"E"):
        kind, message = json.loads(data[1:])
        raise ClientFailed(kind, message)
    return decode_reply(data[1:], request.action, rows=request.row_count or None)


def raw_exchange(
    path: str, payload: bytes, account: Account | None = None, *, half_close: bool = True
) -> dict[str, Any]:
    """Connect as `account`, send `payload` bytes as they are, read whatever comes back.

    Returns {"errno": n} if connect failed, else {"reply": bytes or None, "closed": bool}:
    `reply` is one reply frame's payload when one arrived.
    """

    def exchange() -> bytes:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(120)
        try:
            sock.connect(path)
        except OSError as exc:
            return json.dumps({"errno": exc.errno}).encode()
        try:
            try:
                if payload:
                    sock.sendall(payload)
                if half_close:
                    sock.shutdown(socket.SHUT_WR)
            except OSError:  # refused before we finished sending: the reply may be there
                pass
            reply = _read_frame(sock)
        finally:
            sock.close()
        encoded = None if reply is None else base64.b64encode(reply).decode()
        return json.dumps({"reply": encoded}).encode()

    result = json.loads(run_as(account, exchange))
    if "reply" in result and result["reply"] is not None:
        result["reply"] = base64.b64decode(result["reply"])
    return result  # type: ignore[no-any-return]


def _read_frame(sock: socket.socket) -> bytes | None:
    try:
        header = _recv_exactly(sock, HEADER.size)
        if header is None:
            return None
        (length,) = HEADER.unpack(header)
        assert 0 < length <= REPLY_MAX, f"reply length {length}"
        payload = _recv_exactly(sock, length)
        assert payload is not None, "the daemon closed inside its reply frame"
        return payload
    except ConnectionResetError:
        return None


def _recv_exactly(sock: socket.socket, n: int) -> bytes | None:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            assert not data, "the daemon closed inside a frame"
            return None
        data += chunk
    return data


def frame(payload: bytes) -> bytes:
    return HEADER.pack(len(payload)) + payload


def error_code(reply: AnyReply) -> str | None:
    """The whole-request error code, or None if the request was accepted."""
    return reply.error.code if isinstance(reply, ErrorReply) else None


def rows(reply: AnyReply) -> list[Any]:
    assert not isinstance(reply, ErrorReply), f"refused: {reply.error.code}: {reply.error.message}"
    assert isinstance(reply, AttemptsReply | InputsReply), reply
    return list(reply.results)


def row_code(row: Any) -> str | None:
    return row.error.code if isinstance(row, ErrorRow) else None


def attempt(row: Any) -> AttemptRow:
    assert isinstance(row, AttemptRow), f"row refused: {row}"
    return row


def input_row(row: Any) -> InputRow:
    assert isinstance(row, InputRow), f"row refused: {row}"
    return row


# --- plans and requests --------------------------------------------------------------------


def chunk_digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


@dataclass
class StreamedInput:
    """A streamed input object and its bytes (or wrong bytes, for mismatch tests)."""

    data: bytes
    id: str = field(default_factory=new_id)
    name: str = "input.bin"
    declared_digest: str | None = None

    def object(self) -> InputObject:
        return InputObject(
            id=self.id,
            name=self.name,
            bytes=len(self.data),
            digest=self.declared_digest or chunk_digest(self.data),
            delivery="stream",
        )


class Daemon:
    """A running daemon plus request builders bound to its configuration."""

    def __init__(self, layout: Layout, provider: InstalledProvider, accounts: Accounts) -> None:
        self.layout = layout
        self.provider = provider
        self.accounts = accounts
        self.process = DaemonProcess(layout, provider)

    # sockets and senders

    @property
    def admin(self) -> str:
        return self.layout.socket("admin")

    @property
    def transport(self) -> str:
        return self.layout.socket("transport")

    @property
    def owner(self) -> str:
        return self.layout.socket("owner")

    def as_admin(self, request: Request) -> AnyReply:
        return send(self.admin, request)

    def as_transport(self, request: Request) -> AnyReply:
        return send(self.transport, request, self.accounts["transport"])

    def as_owner(self, request: Request) -> AnyReply:
        return send(self.owner, request, self.accounts["owner"])

    # lifecycle of the process

    def start(self) -> None:
        self.process.start()

    def stop(self) -> int:
        return self.process.stop()

    def restart(self) -> None:
        status = self.stop()
        assert status == 0, f"the daemon exited {status} on SIGTERM:\n{self.process.log()}"
        self.process = DaemonProcess(self.layout, self.provider)
        self.start()

    # builders

    def plan(
        self,
        *,
        job_id: str | None = None,
        attempt_id: str | None = None,
        generation: int = 1,
        offer_revision: int = 1,
        inputs: Sequence[StreamedInput] = (),
        memory_bytes: int = 64 * MIB,
        slot_class: str = "small",
    ) -> Plan:
        doc = self.layout.document
        return Plan(
            version=1,
            deployment_id=doc["deployment_id"],
            node_id=doc["node_id"],
            project_id=PROJECT,
            job_id=job_id or new_id(),
            attempt_id=attempt_id or new_id(),
            generation=generation,
            offer_revision=offer_revision,
            job=Job(
                name="it-job",
                slot_class=slot_class,
                runtime=Runtime(
                    provider="test",
                    package_digest=self.provider.digest,
                    image_digest=IMAGE,
                    isolation="process",
                    network="none",
                ),
                payload=Payload(argv=["/bin/true"], environment={}),
                limits=Limits(
                    cpu_millis=500,
                    memory_bytes=memory_bytes,
                    swap_bytes=0,
                    processes=32,
                    storage_bytes=32 * MIB,
                    storage_inodes=1000,
                    devices=[],
                ),
                inputs=[i.object() for i in inputs],
                outputs=[],
                sensitive=False,
            ),
        )

    def snapshot(self, after: str | None = None) -> SnapshotReply:
        reply = self.as_admin(SnapshotRequest(version=1, id=new_id(), after=after))
        assert isinstance(reply, SnapshotReply), reply
        return reply

    def bindings(self) -> dict[str, Any]:
        return self.snapshot().bindings()

    def prepare(
        self,
        plans: Sequence[Plan],
        *,
        expires_in_ms: int = 300_000,
        bindings: dict[str, Any] | None = None,
        sender: Callable[[Request], AnyReply] | None = None,
    ) -> AnyReply:
        expires = now_ms() + expires_in_ms
        request = PrepareRequest(
            version=1,
            id=new_id(),
            **(bindings or self.bindings()),
            attempts=[PrepareAttempt(plan=p, lease=renewal(p, 1, expires)) for p in plans],
        )
        return (sender or self.as_transport)(request)

    def renew(self, plan: Plan, sequence: int, expires_at_ms: int) -> Any:
        request = RenewRequest(
            version=1, id=new_id(), leases=[renewal(plan, sequence, expires_at_ms)]
        )
        (row,) = rows(self.as_transport(request))
        return row

    def fenced(self, kind: type[Request], plans: Sequence[Plan]) -> list[Any]:
        request = kind(version=1, id=new_id(), attempts=[fence(p) for p in plans])  # type: ignore[call-arg]
        return rows(self.as_transport(request))

    def observe(self, plan: Plan) -> Any:
        (row,) = self.fenced(ObserveRequest, [plan])
        return row

    def start_attempt(self, plan: Plan) -> Any:
        (row,) = self.fenced(StartRequest, [plan])
        return row

    def stop_attempt(self, plan: Plan) -> Any:
        (row,) = self.fenced(StopRequest, [plan])
        return row

    def release(self, plan: Plan) -> Any:
        (row,) = self.fenced(ReleaseRequest, [plan])
        return row

    def wait_state(self, plan: Plan, accept: Callable[[AttemptRow], bool], what: str) -> AttemptRow:
        def check() -> AttemptRow | None:
            row = self.observe(plan)
            return row if isinstance(row, AttemptRow) and accept(row) else None

        try:
            return wait_until(check, what)  # type: ignore[no-any-return]
        except AssertionError as exc:
            raise AssertionError(f"{exc}; last observe: {self.observe(plan)}") from None

    def input_status(self, plan: Plan, item: StreamedInput) -> Any:
        request = InputStatusRequest(
            version=1, id=new_id(), objects=[ObjectRef(**_fence_fields(plan), object=item.id)]
        )
        (row,) = rows(self.as_transport(request))
        return row

    def input_write(self, plan: Plan, item: StreamedInput, offset: int, data: bytes) -> Any:
        write = InputWrite(
            **_fence_fields(plan),
            object=item.id,
            offset=offset,
            data=base64.b64encode(data).decode(),
            digest=chunk_digest(data),
        )
        (row,) = rows(self.as_transport(InputWriteRequest(version=1, id=new_id(), writes=[write])))
        return row

    def reject_absent(self, plans: Sequence[Plan], bindings: dict[str, Any] | None = None,
                      sender: Callable[[Request], AnyReply] | None = None) -> AnyReply:  # fmt: skip
        request = RejectAbsentRequest(
            version=1, id=new_id(), **(bindings or self.bindings()), plans=list(plans)
        )
        return (sender or self.as_transport)(request)

    def reconcile_request(
        self, plans: Sequence[Plan], bindings: dict[str, Any] | None = None
    ) -> ReconcileAbsentRequest:
        return ReconcileAbsentRequest(
            version=1,
            id=new_id(),
            **(bindings or self.bindings()),
            plans=list(plans),
            acknowledge_unknown=True,
        )

    def set_offer(self, control: str, *, sender: str = "owner") -> AnyReply:
        revision = self.snapshot().offer.revision
        request = SetOfferRequest(
            version=1,
            id=new_id(),
            expected_revision=revision,
            control=control,  # type: ignore[arg-type]
        )
        return self.as_owner(request) if sender == "owner" else self.as_admin(request)


def _fence_fields(plan: Plan) -> dict[str, Any]:
    return {
        "attempt_id": plan.attempt_id,
        "generation": plan.generation,
        "plan_digest": plan_digest(plan),
    }


def fence(plan: Plan) -> Fence:
    return Fence(**_fence_fields(plan))


def renewal(plan: Plan, sequence: int, expires_at_ms: int) -> Renewal:
    return Renewal(**_fence_fields(plan), sequence=sequence, expires_at_ms=expires_at_ms)


def chunks(data: bytes, size: int) -> Iterator[tuple[int, bytes]]:
    for offset in range(0, len(data), size):
        yield offset, data[offset : offset + size]


__all__ = [
    "ACCOUNTS",
    "MIB",
    "PROJECT",
    "Account",
    "Accounts",
    "ClientFailed",
    "Daemon",
    "DaemonFailed",
    "DaemonProcess",
    "InstalledProvider",
    "Layout",
    "StreamedInput",
    "attempt",
    "build_provider_wheel",
    "chunk_digest",
    "chunks",
    "digest_of",
    "error_code",
    "fence",
    "frame",
    "input_row",
    "install_provider",
    "new_id",
    "now_ms",
    "private_directory",
    "raw_exchange",
    "renewal",
    "row_code",
    "rows",
    "run_as",
    "send",
    "wait_until",
]
