"""The start gate's shim (service/shim.py): its order codec and both programs, run for real.

The backends' behaviour suites run the shims inside real services; these tests pin
what those cannot reach: the codec's round trip and refusals, and that a shim given an
incomplete, oversized or malformed order exits 125 without running anything.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import socket
import subprocess
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ficc.execution.host.core.errors import HostError
from ficc.execution.host.service import shim
from ficc.execution.host.service.launch import DEFAULT_INTERPRETER

TIMEOUT_S = 30.0
NOFILE = 256

_text = st.text(st.characters(blacklist_characters="\0", blacklist_categories=("Cs",)))
_names = st.from_regex(r"\A[A-Za-z_][A-Za-z0-9_]{0,16}\Z")


def _decoder() -> Any:
    namespace: dict[str, Any] = {}
    exec(shim.DECODE_SOURCE, namespace)  # the shims' own source, under test
    return namespace["decode"]


@given(argv=st.lists(_text, min_size=1, max_size=8), env=st.dictionaries(_names, _text))
def test_an_order_decodes_to_exactly_what_was_encoded(argv: list[str], env: dict[str, str]) -> None:
    decoded_argv, decoded_env = _decoder()(shim.encode_order(argv, env))
    assert decoded_argv == [os.fsencode(a) for a in argv]
    assert decoded_env == {os.fsencode(k): os.fsencode(v) for k, v in env.items()}


@pytest.mark.parametrize(
    ("argv", "env"),
    [
        ([], {}),
        (["/bin/true", "a\0b"], {}),
        (["/bin/true"], {"A": "x\0y"}),
        (["/bin/true"], {"A=B": "x"}),
        (["/bin/true"], {"": "x"}),
        (["/bin/true\ud800"], {}),
        (["/bin/true", "x" * shim.ORDER_LIMIT], {}),
    ],
)
def test_what_execve_cannot_carry_is_refused(argv: list[str], env: dict[str, str]) -> None:
    with pytest.raises(HostError) as caught:
        shim.encode_order(argv, env)
    assert caught.value.code == "service_spec"


@pytest.mark.parametrize(
    "data",
    [b"", b"2\0/bin/true\0", b"1\0/bin/true", b"0\0", b"x\0/bin/true\0", b"1\0/bin/true\0A\0"],
)
def test_a_malformed_order_does_not_decode(data: bytes) -> None:
    with pytest.raises(ValueError):
        _decoder()(data)


def test_the_socket_shim_survives_systemd_command_line_expansion() -> None:
    assert "$" not in shim.SOCKET_SOURCE
    assert "%" not in shim.SOCKET_SOURCE
    assert "\\" not in shim.SOCKET_SOURCE


# --- the pipe shim (cgroupfs), for real ---------------------------------------------------


def _pipe_shim(order: bytes) -> tuple[int, bytes]:
    """Run the pipe shim as this process's child; returns (exit status, ready report
    after "R": b"" when the exec happened)."""
    gate_read, gate_write = os.pipe()
    ready_read, ready_write = os.pipe()
    fds = [str(gate_read), str(ready_write), str(NOFILE)]
    process = subprocess.Popen(
        [DEFAULT_INTERPRETER, "-I", "-S", "-c", shim.PIPE_SOURCE, *fds],
        pass_fds=(gate_read, ready_write),
        env={},
    )
    os.close(gate_read)
    os.close(ready_write)
    try:
        assert os.read(ready_read, 1) == b"R"
        view = memoryview(order)
        while view:
            view = view[os.write(gate_write, view) :]
        os.close(gate_write)
        gate_write = -1
        report = b"".join(iter(lambda: os.read(ready_read, 64), b""))
        return process.wait(TIMEOUT_S), report
    finally:
        os.close(ready_read)
        if gate_write >= 0:
            os.close(gate_write)
        if process.poll() is None:
            process.kill()
            process.wait()


def _writer(target: pathlib.Path) -> list[str]:
    """A program that proves it ran, and with which environment."""
    return ["/bin/sh", "-c", 'printf "%s" "$GREETING" > "$0"', str(target)]


def test_the_pipe_shim_execs_the_order_with_its_environment(tmp_path: pathlib.Path) -> None:
    target = tmp_path / "ran"
    status, report = _pipe_shim(shim.encode_order(_writer(target), {"GREETING": "hi there"}))
    assert (status, report) == (0, b"")
    assert target.read_text() == "hi there"


def test_the_pipe_shim_reports_a_failed_exec() -> None:
    status, report = _pipe_shim(shim.encode_order([f"/nonexistent-{os.getpid()}"], {}))
    assert (status, report) == (125, b"E2")


@pytest.mark.parametrize("cut", [1, 5, -1])
def test_the_pipe_shim_runs_nothing_from_an_incomplete_order(
    tmp_path: pathlib.Path, cut: int
) -> None:
    target = tmp_path / "ran"
    order = shim.encode_order(_writer(target), {"GREETING": "hi"})
    status, report = _pipe_shim(order[:cut])
    assert (status, report) == (125, b"")
    assert not target.exists()


def test_the_pipe_shim_refuses_an_oversized_order(tmp_path: pathlib.Path) -> None:
    target = tmp_path / "ran"
    order = shim.encode_order(_writer(target), {})
    status, _ = _pipe_shim(order + b"x" * shim.ORDER_LIMIT)
    assert status == 125
    assert not target.exists()


def test_the_pipe_shim_sets_its_rlimits_before_ready(tmp_path: pathlib.Path) -> None:
    target = tmp_path / "limits"
    argv = ["/bin/sh", "-c", 'ulimit -c > "$0"; ulimit -n >> "$0"', str(target)]
    assert _pipe_shim(shim.encode_order(argv, {})) == (0, b"")
    assert target.read_text().split() == ["0", str(NOFILE)]


# --- the socket shim (systemd), for real ----------------------------------------------------


def _socket_shim(tmp_path: pathlib.Path, order: bytes, stdio: list[int]) -> tuple[int, bytes]:
    """Run the socket shim as a child connecting to a real listening socket; returns
    (exit status, report after the order: b"" when the exec happened)."""
    path = str(tmp_path / "gate")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
        listener.bind(path)
        listener.listen(1)
        listener.settimeout(TIMEOUT_S)
        process = subprocess.Popen(
            [DEFAULT_INTERPRETER, "-I", "-S", "-c", shim.SOCKET_SOURCE, path], env={}
        )
        try:
            link, _ = listener.accept()
            with link:
                link.settimeout(TIMEOUT_S)
                assert link.recv(1) == b"R"
                # A shim refusing the first message may be gone before the rest is sent.
                with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                    first = socket.send_fds(link, [order[:65536]], stdio)
                    link.sendall(order[first:])
                    link.shutdown(socket.SHUT_WR)
                report = b"".join(iter(lambda: link.recv(64), b""))
            return process.wait(TIMEOUT_S), report
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()


def _stdio(tmp_path: pathlib.Path) -> list[int]:
    null = os.open(os.devnull, os.O_RDONLY)
    out = os.open(tmp_path / "out", os.O_WRONLY | os.O_CREAT, 0o600)
    err = os.open(tmp_path / "err", os.O_WRONLY | os.O_CREAT, 0o600)
    return [null, out, err]


def test_the_socket_shim_execs_with_the_descriptors_it_was_given(tmp_path: pathlib.Path) -> None:
    stdio = _stdio(tmp_path)
    argv = ["/bin/sh", "-c", 'printf "%s" "$GREETING"; printf oops >&2']
    try:
        result = _socket_shim(tmp_path, shim.encode_order(argv, {"GREETING": "hi"}), stdio)
    finally:
        for fd in stdio:
            os.close(fd)
    assert result == (0, b"")
    assert (tmp_path / "out").read_text() == "hi"
    assert (tmp_path / "err").read_text() == "oops"


def test_the_socket_shim_reports_a_failed_exec(tmp_path: pathlib.Path) -> None:
    stdio = _stdio(tmp_path)
    try:
        order = shim.encode_order([f"/nonexistent-{os.getpid()}"], {})
        result = _socket_shim(tmp_path, order, stdio)
    finally:
        for fd in stdio:
            os.close(fd)
    assert result == (125, b"E2")


@pytest.mark.parametrize("count", [2, 4])
def test_the_socket_shim_runs_nothing_without_exactly_three_descriptors(
    tmp_path: pathlib.Path, count: int
) -> None:
    stdio = _stdio(tmp_path)
    try:
        order = shim.encode_order(["/bin/sh", "-c", "echo ran"], {})
        status, _ = _socket_shim(tmp_path, order, (stdio * 2)[:count])
    finally:
        for fd in stdio:
            os.close(fd)
    assert status == 125
    assert (tmp_path / "out").read_text() == ""


def test_the_socket_shim_runs_nothing_from_an_incomplete_order(tmp_path: pathlib.Path) -> None:
    stdio = _stdio(tmp_path)
    try:
        order = shim.encode_order(["/bin/sh", "-c", "echo ran"], {})
        status, _ = _socket_shim(tmp_path, order[:-1], stdio)
    finally:
        for fd in stdio:
            os.close(fd)
    assert status == 125
    assert (tmp_path / "out").read_text() == ""
