"""`python -m ficc.execution request` end to end: a real subprocess, a real socket."""

from __future__ import annotations

import json
import os
import pathlib
import socket
import struct
import subprocess
import sys
import tempfile
import textwrap
import threading
from collections.abc import Callable, Iterator

import pytest

import ficc_protocol_examples as ex
from ficc.execution.protocol import ZERO_ID, decode_request, encode_request
from ficc.execution.wire import AttemptsReply, Error, ErrorReply, encode_reply

Reply = Callable[[bytes], bytes]


class OneShotServer:
    """A root Unix-socket server (this test process) answering each request with `reply`."""

    def __init__(self, path: pathlib.Path, reply: Reply) -> None:
        self.path = path
        self.reply = reply
        self.received: list[bytes] = []
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(str(path))
        self.sock.listen(4)
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                (n,) = struct.unpack(">I", conn.recv(4, socket.MSG_WAITALL))
                payload = conn.recv(n, socket.MSG_WAITALL)
                self.received.append(payload)
                body = self.reply(payload)
                conn.sendall(struct.pack(">I", len(body)) + body)

    def close(self) -> None:
        self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()
        self.thread.join(5)


@pytest.fixture
def sock_dir() -> Iterator[pathlib.Path]:
    with tempfile.TemporaryDirectory(prefix="ficc-proto-cmd-") as path:
        yield pathlib.Path(path)


def _command(
    stdin: bytes, *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(
        [sys.executable, "-m", "ficc.execution", *args],
        input=stdin,
        capture_output=True,
        timeout=60,
        env=env,
        check=False,
    )


def _attempt_rows(payload: bytes, *, fail_row: int | None = None) -> bytes:
    request = decode_request(payload)
    replies = ex.replies()["prepare"]
    ok_row, err_row = replies.results
    rows = [err_row if i == fail_row else ok_row for i in range(request.row_count)]
    return encode_reply(AttemptsReply(version=1, id=request.id, results=rows))


START = encode_request(ex.requests()["start"])

#: the client trusts only a root server, and the in-process one is root only under root
root_server = pytest.mark.root("these tests talk to an in-process server that must be root")


@root_server
def test_request_prints_the_reply_and_exits_0(sock_dir: pathlib.Path) -> None:
    server = OneShotServer(sock_dir / "admin.sock", _attempt_rows)
    try:
        pretty = json.dumps(json.loads(START), indent=2).encode()
        done = _command(pretty, "request", "--socket", str(server.path), "--timeout", "10")
    finally:
        server.close()
    assert done.returncode == 0, done.stderr
    reply = json.loads(done.stdout)
    assert reply["id"] == ex.REQUEST_ID
    assert reply["ok"] is True
    assert len(reply["results"]) == 2
    assert server.received == [START]  # validated, then sent canonically, once


@root_server
def test_refused_row_exits_1_with_the_code(sock_dir: pathlib.Path) -> None:
    server = OneShotServer(sock_dir / "s", lambda p: _attempt_rows(p, fail_row=1))
    try:
        done = _command(START, "request", "--socket", str(server.path))
    finally:
        server.close()
    assert done.returncode == 1
    assert b"row 1: fence_mismatch" in done.stderr
    assert json.loads(done.stdout)["results"][1]["ok"] is False


@root_server
def test_refused_request_exits_1_with_the_code(sock_dir: pathlib.Path) -> None:
    def refuse(payload: bytes) -> bytes:
        return encode_reply(ex.replies()["error"])

    server = OneShotServer(sock_dir / "s", refuse)
    try:
        done = _command(START, "request", "--socket", str(server.path))
    finally:
        server.close()
    assert done.returncode == 1
    assert done.stderr.startswith(b"not_authorized: ")


@root_server
def test_a_refusal_before_the_request_was_read_exits_1_not_3(sock_dir: pathlib.Path) -> None:
    """`busy` with the zero ID: refused, not applied; not a transport failure."""

    def busy(payload: bytes) -> bytes:
        error = Error(code="busy", message="too many connections; retry later")
        return encode_reply(ErrorReply(version=1, id=ZERO_ID, error=error))

    server = OneShotServer(sock_dir / "s", busy)
    try:
        done = _command(START, "request", "--socket", str(server.path))
    finally:
        server.close()
    assert done.returncode == 1, done.stderr
    assert done.stderr.startswith(b"busy: too many connections")
    assert done.stdout == b""


@pytest.mark.parametrize(
    ("stdin", "message"),
    [
        (b"{", b"bad_frame"),
        (START.replace(b'"version":1', b'"version":1,"version":1'), b"appears twice"),
        (START.replace(b'"start"', b'"format"'), b"unsupported_action"),
        (START.replace(b'"generation":1', b'"generation":true', 1), b"$.attempts[0].generation"),
        (b"", b"bad_frame"),
    ],
)
def test_invalid_input_exits_2_and_sends_nothing(
    sock_dir: pathlib.Path, stdin: bytes, message: bytes
) -> None:
    server = OneShotServer(sock_dir / "s", _attempt_rows)
    try:
        done = _command(stdin, "request", "--socket", str(server.path))
    finally:
        server.close()
    assert done.returncode == 2
    assert message in done.stderr
    assert done.stdout == b""
    assert server.received == []


def test_transport_failure_exits_3(sock_dir: pathlib.Path) -> None:
    done = _command(START, "request", "--socket", str(sock_dir / "absent"))
    assert done.returncode == 3
    assert b"ConnectFailed" in done.stderr


def test_usage_errors_exit_2() -> None:
    assert _command(b"", "request").returncode == 2  # --socket is required
    assert _command(b"").returncode == 2


def test_other_commands_need_the_host_distribution() -> None:
    code = textwrap.dedent(
        """
        import sys
        sys.modules["ficc.execution.host"] = None  # as if ficc-executor-host were absent
        from ficc.execution.__main__ import main
        sys.exit(main(["serve", "--config", "x"]))
        """
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, check=False)
    assert done.returncode == 2
    assert b"install ficc-executor-host for `serve`" in done.stderr


def test_other_commands_are_handed_to_the_host(tmp_path: pathlib.Path) -> None:
    host = tmp_path / "ficc" / "execution" / "host"
    host.mkdir(parents=True)
    (host / "__init__.py").write_text("")
    (host / "commands.py").write_text(
        "def main(argv):\n    print('host got', argv)\n    return 7\n"
    )
    env = dict(os.environ, PYTHONPATH=str(tmp_path))
    done = _command(b"", "status", "--all", env=env)
    assert done.returncode == 7
    assert done.stdout == b"host got ['status', '--all']\n"
