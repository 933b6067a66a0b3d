"""Authority: the full action matrix, and real peers of real users on real Unix sockets."""

from __future__ import annotations

import asyncio
import os
import pwd
import shutil
import socket
import stat
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from ficc.execution.host.config.load import parse_config
from ficc.execution.host.config.model import Config
from ficc.execution.host.core.authority import ALL_ACTIONS, SocketKind, allowed, authorize
from ficc.execution.host.core.errors import HostError
from ficc.execution.host.daemon.peercred import (
    Endpoint,
    check_peer,
    listen,
    peer_credentials,
    socket_paths,
)

pytestmark = pytest.mark.root(
    "real peers are real users: it creates accounts and sockets owned by them"
)

T, A, OW = SocketKind.TRANSPORT, SocketKind.ADMINISTRATOR, SocketKind.LOCAL_OWNER

# docs/protocol.md "Who may send", written out independently of the module under test.
EXPECTED = {
    "prepare": {T, A},
    "renew": {T, A},
    "start": {T, A},
    "observe": {T, A},
    "stop": {T, A},
    "release": {T, A},
    "collect": {T, A},
    "input_status": {T, A},
    "input_write": {T, A},
    "reject_absent": {T, A},
    "reconcile_absent": {A},
    "snapshot": {T, OW, A},
    "set_offer": {OW, A},
    "metrics": {A},
    "check_slots": {A},
}


def test_the_module_knows_exactly_the_protocol_actions() -> None:
    assert set(ALL_ACTIONS) == set(EXPECTED)


@pytest.mark.parametrize("kind", list(SocketKind))
@pytest.mark.parametrize("action", sorted(EXPECTED))
def test_the_action_matrix(kind: SocketKind, action: str) -> None:
    expected = kind in EXPECTED[action]
    assert allowed(kind, action) is expected
    if expected:
        authorize(kind, action)
    else:
        with pytest.raises(HostError) as excinfo:
            authorize(kind, action, "owner-1001.sock")
        assert excinfo.value.code == "not_authorized"
        assert "owner-1001.sock" in excinfo.value.message
        assert action in excinfo.value.message


@pytest.mark.parametrize("kind", list(SocketKind))
@pytest.mark.parametrize("action", ["", "PREPARE", "shutdown", "snapshot ", "set-offer"])
def test_an_unknown_action_is_refused_everywhere(kind: SocketKind, action: str) -> None:
    assert not allowed(kind, action)
    with pytest.raises(HostError) as excinfo:
        authorize(kind, action)
    assert excinfo.value.code == "not_authorized"


# --- real users, real sockets ----------------------------------------------------------

PYTHON = "/usr/bin/python3"  # the system interpreter, executable by any user
ACCOUNTS = ("ficc-t-auth-transport", "ficc-t-auth-owner", "ficc-t-auth-other")
CONNECT = """
import socket, sys
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
try:
    s.connect(sys.argv[1])
except OSError as error:
    print("refused", error.errno, flush=True)
    sys.exit(3)
print("connected", flush=True)
s.recv(1)
"""


class Account:
    def __init__(self, name: str) -> None:
        entry = pwd.getpwnam(name)
        self.name, self.uid, self.gid = name, entry.pw_uid, entry.pw_gid


@pytest.fixture(scope="module")
def accounts() -> Iterator[dict[str, Account]]:
    """Three real system users, created for this module if absent, removed afterwards."""
    if not os.access(PYTHON, os.X_OK) or shutil.which("setpriv") is None:
        pytest.skip(f"needs {PYTHON} and setpriv to run a real unprivileged peer")
    created = []
    for name in ACCOUNTS:
        try:
            pwd.getpwnam(name)
        except KeyError:
            subprocess.run(["useradd", "--system", "--no-create-home", name], check=True)
            created.append(name)
    try:
        yield {name.rsplit("-", 1)[1]: Account(name) for name in ACCOUNTS}
    finally:
        for name in created:
            subprocess.run(["userdel", name], check=False)


def make_config(socket_dir: Path, accounts: dict[str, Account]) -> Config:
    doc = f"""{{
      "installation_id": "{"0" * 32}", "deployment_id": "{"1" * 32}", "node_id": "{"2" * 32}",
      "mode": "voluntary", "transport_uid": {accounts["transport"].uid},
      "local_owner_uids": [{accounts["owner"].uid}], "maximum_lease_seconds": 60,
      "state_dir": "/srv/ficc-t-auth/state", "socket_dir": "{socket_dir}",
      "supervisor": "cgroupfs",
      "slots": [{{"id": "s0", "class": "small", "generation": 1, "path": "/srv/ficc-t-auth/s0",
                  "uid": 3999999, "gid": 3999999, "storage_bytes": 1, "storage_inodes": 1,
                  "filesystem_uuid": "00000000-0000-4000-8000-000000000001"}}],
      "ceiling": {{"cpu_millis": 1, "memory_bytes": 1, "swap_bytes": 0, "processes": 1,
                   "slots": 1, "devices": [], "projects": [], "runtimes": ["podman"]}},
      "initial_offer": {{"control": "active", "cpu_millis": 1, "memory_bytes": 1,
                   "swap_bytes": 0, "processes": 1, "slots": 1, "devices": [], "projects": [],
                   "runtimes": []}},
      "providers": [{{"id": "podman", "package_digest": "sha256:{"a" * 64}"}}]
    }}"""
    return parse_config(doc.encode(), ".json")


@pytest.fixture
def socket_dir() -> Iterator[Path]:
    """A root-owned 0711 directory under /run (peers may traverse it, not list it)."""
    path = Path(tempfile.mkdtemp(prefix="ficc-t-auth-", dir="/run"))
    os.chmod(path, 0o711)
    yield path
    shutil.rmtree(path)


@pytest.fixture
def endpoints(socket_dir: Path, accounts: dict[str, Account]) -> dict[SocketKind, Endpoint]:
    return {e.kind: e for e in socket_paths(make_config(socket_dir, accounts))}


def connect_as(path: str, account: Account | None) -> subprocess.Popen[str]:
    """Start a real process, as `account` (or root), that connects to `path`."""
    command = [PYTHON, "-c", CONNECT, path]
    if account is not None:
        command = [
            "setpriv",
            f"--reuid={account.uid}",
            f"--regid={account.gid}",
            "--clear-groups",
            *command,
        ]
    return subprocess.Popen(command, stdout=subprocess.PIPE, text=True)


def accept_peer(listener: socket.socket, client: subprocess.Popen[str]) -> tuple[int, int]:
    """Accept the client's connection; return the (pid, uid) the kernel reports."""
    assert client.stdout is not None
    assert client.stdout.readline() == "connected\n"
    listener.settimeout(30)
    conn, _ = listener.accept()
    with conn:
        pid, uid, _gid = peer_credentials(conn)
    client.wait(timeout=30)
    return pid, uid


def test_socket_paths_name_one_socket_per_role(
    socket_dir: Path, accounts: dict[str, Account]
) -> None:
    found = socket_paths(make_config(socket_dir, accounts))
    assert [(e.kind, e.path, e.peer_uid) for e in found] == [
        (T, f"{socket_dir}/transport.sock", accounts["transport"].uid),
        (A, f"{socket_dir}/admin.sock", 0),
        (OW, f"{socket_dir}/owner-{accounts['owner'].uid}.sock", accounts["owner"].uid),
    ]


def test_each_socket_file_has_its_owner_and_mode_0600(
    endpoints: dict[SocketKind, Endpoint],
) -> None:
    for endpoint in endpoints.values():
        with listen(endpoint):
            st = os.lstat(endpoint.path)
            assert stat.S_ISSOCK(st.st_mode)
            assert (st.st_uid, st.st_gid) == (endpoint.peer_uid, 0)
            assert stat.S_IMODE(st.st_mode) == 0o600


@pytest.mark.parametrize("kind", list(SocketKind))
def test_the_right_peer_is_seen_and_accepted(
    kind: SocketKind, endpoints: dict[SocketKind, Endpoint], accounts: dict[str, Account]
) -> None:
    account = {T: accounts["transport"], A: None, OW: accounts["owner"]}[kind]
    endpoint = endpoints[kind]
    with listen(endpoint) as listener:
        client = connect_as(endpoint.path, account)
        pid, uid = accept_peer(listener, client)
    assert pid == client.pid
    assert uid == (0 if account is None else account.uid)
    check_peer(endpoint, uid)


WRONG = {
    T: ("owner", "other", "root"),
    A: ("transport", "owner", "other"),
    OW: ("transport", "other", "root"),
}


@pytest.mark.parametrize(
    ("kind", "who"), [(kind, who) for kind, names in WRONG.items() for who in names]
)
def test_a_wrong_peer_is_refused_even_when_the_file_mode_lets_it_in(
    kind: SocketKind,
    who: str,
    endpoints: dict[SocketKind, Endpoint],
    accounts: dict[str, Account],
) -> None:
    endpoint = endpoints[kind]
    account = None if who == "root" else accounts[who]
    with listen(endpoint) as listener:
        os.chmod(endpoint.path, 0o666)  # a mistake by hand: the UID check must still hold
        _pid, uid = accept_peer(listener, connect_as(endpoint.path, account))
    assert uid == (0 if account is None else account.uid)
    with pytest.raises(HostError) as excinfo:
        check_peer(endpoint, uid)
    assert excinfo.value.code == "not_authorized"
    assert endpoint.name in excinfo.value.message


@pytest.mark.parametrize(
    ("kind", "who"),
    [(kind, who) for kind, names in WRONG.items() for who in names if who != "root"],
)
def test_a_wrong_user_cannot_even_connect_through_mode_0600(
    kind: SocketKind,
    who: str,
    endpoints: dict[SocketKind, Endpoint],
    accounts: dict[str, Account],
) -> None:
    endpoint = endpoints[kind]
    with listen(endpoint):
        client = connect_as(endpoint.path, accounts[who])
        out, _ = client.communicate(timeout=30)
    assert out == "refused 13\n"  # EACCES
    assert client.returncode == 3


def test_a_stale_socket_is_replaced(endpoints: dict[SocketKind, Endpoint]) -> None:
    endpoint = endpoints[T]
    listen(endpoint).close()  # the file stays behind, owned by the transport UID
    assert stat.S_ISSOCK(os.lstat(endpoint.path).st_mode)
    with listen(endpoint) as listener:
        client = connect_as(endpoint.path, None)
        assert accept_peer(listener, client) == (client.pid, 0)  # the new one answers


def test_a_live_socket_is_not_taken_over(endpoints: dict[SocketKind, Endpoint]) -> None:
    endpoint = endpoints[A]
    with listen(endpoint), pytest.raises(HostError) as excinfo:
        listen(endpoint)
    assert excinfo.value.code == "socket_in_use"


def test_a_regular_file_in_place_of_a_socket_is_left_alone(
    endpoints: dict[SocketKind, Endpoint],
) -> None:
    endpoint = endpoints[A]
    Path(endpoint.path).write_text("not a socket")
    with pytest.raises(HostError) as excinfo:
        listen(endpoint)
    assert excinfo.value.code == "socket_unsafe"
    assert Path(endpoint.path).read_text() == "not a socket"


def test_a_symlink_in_place_of_a_socket_is_not_followed(
    socket_dir: Path, endpoints: dict[SocketKind, Endpoint]
) -> None:
    endpoint = endpoints[A]
    target = socket_dir / "elsewhere"
    target.write_text("keep")
    os.symlink(target, endpoint.path)
    with pytest.raises(HostError) as excinfo:
        listen(endpoint)
    assert excinfo.value.code == "socket_unsafe"
    assert os.path.islink(endpoint.path)
    assert target.read_text() == "keep"


def test_a_socket_owned_by_another_user_is_not_removed(
    endpoints: dict[SocketKind, Endpoint], accounts: dict[str, Account]
) -> None:
    endpoint = endpoints[A]
    listen(endpoint).close()
    os.chown(endpoint.path, accounts["other"].uid, 0, follow_symlinks=False)
    with pytest.raises(HostError) as excinfo:
        listen(endpoint)
    assert excinfo.value.code == "socket_unsafe"


@pytest.mark.parametrize("mode", [0o755, 0o700, 0o733])
def test_the_socket_dir_must_be_mode_0711(
    socket_dir: Path, endpoints: dict[SocketKind, Endpoint], mode: int
) -> None:
    os.chmod(socket_dir, mode)
    with pytest.raises(HostError) as excinfo:
        listen(endpoints[T])
    assert excinfo.value.code == "host_path_unsafe"
    assert not os.path.lexists(endpoints[T].path)


def test_a_symlinked_socket_dir_is_refused(socket_dir: Path, accounts: dict[str, Account]) -> None:
    real = socket_dir / "real"
    real.mkdir()
    os.chmod(real, 0o711)
    (socket_dir / "link").symlink_to(real)
    endpoint = socket_paths(make_config(socket_dir / "link", accounts))[0]
    with pytest.raises(HostError) as excinfo:
        listen(endpoint)
    assert excinfo.value.code == "host_path_unsafe"
    assert os.listdir(real) == []


def test_peer_credentials_exist_only_on_unix_sockets() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock, pytest.raises(HostError):
        peer_credentials(sock)


def test_peer_credentials_work_on_an_asyncio_transport_socket(
    endpoints: dict[SocketKind, Endpoint], accounts: dict[str, Account]
) -> None:
    """The daemon reads credentials from asyncio's socket wrapper, before any frame."""
    endpoint = endpoints[T]
    seen: list[int] = []

    async def main() -> subprocess.Popen[str]:
        done = asyncio.Event()

        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            seen.append(peer_credentials(writer.get_extra_info("socket")).uid)
            writer.close()
            done.set()

        server = await asyncio.start_unix_server(handle, sock=listen(endpoint))
        async with server:
            client = connect_as(endpoint.path, accounts["transport"])
            await asyncio.wait_for(done.wait(), timeout=30)
        return client

    client = asyncio.run(main())
    client.wait(timeout=30)
    assert seen == [accounts["transport"].uid]
    check_peer(endpoint, seen[0])
