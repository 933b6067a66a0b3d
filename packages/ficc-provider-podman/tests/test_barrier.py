"""The barrier, run for real: it waits, refuses every unsafe marker, then execs."""

from __future__ import annotations

import errno
import os
import pathlib
import subprocess
import sys
import time

import pytest

from ficc_provider_podman.barrier import (
    EXEC_FAILURE,
    BarrierExit,
    barrier_path,
    has_dynamic_loader,
)

TOKEN = "0123456789abcdef0123456789abcdef"


@pytest.fixture
def control(tmp_path: pathlib.Path) -> pathlib.Path:
    d = tmp_path / "control"
    d.mkdir(mode=0o700)
    return d


def _start(marker: pathlib.Path, *payload: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [str(barrier_path()), str(marker), TOKEN, "--", *payload],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )


def _write_marker(path: pathlib.Path, data: str) -> None:
    tmp = path.with_name(".tmp-marker")
    tmp.write_text(data)
    os.replace(tmp, path)


def test_barrier_is_static() -> None:
    assert not has_dynamic_loader(barrier_path())


def test_dynamic_executable_is_detected() -> None:
    assert has_dynamic_loader(sys.executable) or has_dynamic_loader("/bin/sh")


def test_waits_until_released_then_execs_payload(control: pathlib.Path) -> None:
    marker = control / "release"
    proc = _start(marker, "/bin/sh", "-c", "echo payload-ran; exit 7")
    try:
        # Without a marker the barrier cannot exec, so whenever we look, the live
        # process is still the barrier itself: this is what the gate inspects.
        exe = os.stat(f"/proc/{proc.pid}/exe")
        assert (exe.st_dev, exe.st_ino) == (
            os.stat(barrier_path()).st_dev,
            os.stat(barrier_path()).st_ino,
        )
        assert proc.poll() is None
        _write_marker(marker, TOKEN)
        out, _ = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 7
    assert out == b"payload-ran\n"


def test_marker_written_before_start_releases_at_once(control: pathlib.Path) -> None:
    marker = control / "release"
    _write_marker(marker, TOKEN)
    proc = _start(marker, "/bin/true")
    assert proc.wait(timeout=30) == 0


def test_symlinked_marker_is_refused(control: pathlib.Path, tmp_path: pathlib.Path) -> None:
    target = tmp_path / "elsewhere"
    target.write_text(TOKEN)
    (control / "release").symlink_to(target)
    proc = _start(control / "release", "/bin/true")
    assert proc.wait(timeout=30) == BarrierExit.MARKER_UNSAFE


def test_directory_marker_is_refused(control: pathlib.Path) -> None:
    (control / "release").mkdir()
    proc = _start(control / "release", "/bin/true")
    assert proc.wait(timeout=30) == BarrierExit.MARKER_UNSAFE


def test_fifo_marker_is_refused_without_blocking(control: pathlib.Path) -> None:
    os.mkfifo(control / "release")
    proc = _start(control / "release", "/bin/true")
    assert proc.wait(timeout=30) == BarrierExit.MARKER_UNSAFE


def test_oversized_marker_is_refused(control: pathlib.Path) -> None:
    _write_marker(control / "release", TOKEN + "x")
    proc = _start(control / "release", "/bin/true")
    assert proc.wait(timeout=30) == BarrierExit.MARKER_UNSAFE


def test_wrong_token_is_refused(control: pathlib.Path) -> None:
    _write_marker(control / "release", "f" * len(TOKEN))
    proc = _start(control / "release", "/bin/true")
    assert proc.wait(timeout=30) == BarrierExit.MARKER_TOKEN


def test_partial_marker_keeps_waiting(control: pathlib.Path) -> None:
    marker = control / "release"
    marker.write_text(TOKEN[:5])
    proc = _start(marker, "/bin/true")
    try:
        # A short marker is a write in progress: the barrier must go back to
        # waiting after it has looked at it. It only blocks in poll() after a
        # check, so seeing it blocked there proves it saw the short marker.
        _wait_until_blocked_in_poll(proc.pid)
        assert proc.poll() is None
        marker.write_text(TOKEN)
        assert proc.wait(timeout=30) == 0
    finally:
        proc.kill()


# poll (x86_64), ppoll (x86_64), ppoll (aarch64)
_POLL_SYSCALLS = {"7", "271", "73"}


def _wait_until_blocked_in_poll(pid: int) -> None:
    """Poll /proc/PID/syscall (a condition with a deadline, not a sleep)."""

    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        with open(f"/proc/{pid}/syscall") as f:
            if f.read().split(" ", 1)[0] in _POLL_SYSCALLS:
                return
        os.sched_yield()
    raise AssertionError("barrier never blocked waiting for its marker")


@pytest.mark.parametrize(
    "argv",
    [
        [],
        ["relative/marker", TOKEN, "--", "/bin/true"],
        ["/m", TOKEN, "--", "relative-program"],
        ["/m", TOKEN, "-x", "/bin/true"],
        ["/m", "", "--", "/bin/true"],
        ["/m", "t" * 129, "--", "/bin/true"],
    ],
)
def test_bad_usage_exits_120(argv: list[str]) -> None:
    proc = subprocess.run([str(barrier_path()), *argv], capture_output=True, check=False)
    assert proc.returncode == BarrierExit.USAGE


@pytest.mark.parametrize(
    ("name", "mode", "code", "status"),
    [
        (None, 0, errno.ENOENT, BarrierExit.EXEC_MISSING),
        ("data", 0o644, errno.EACCES, BarrierExit.EXEC_DENIED),
        ("garbage", 0o755, errno.ENOEXEC, BarrierExit.EXEC_DENIED),
    ],
)
def test_an_exec_failure_names_the_program_and_exits_as_a_shell_does(
    control: pathlib.Path, tmp_path: pathlib.Path, name: str | None, mode: int, code: int,
    status: int,
) -> None:  # fmt: skip
    """127 for a program that does not exist, 126 for one that cannot be executed (no
    execute bit, not an executable format), each with the one line the host shows the
    operator: the path and the C library's reason."""
    program = tmp_path / (name or "missing")
    if name is not None:
        program.write_bytes(b"\x00\x01 not a program\n")
        program.chmod(mode)
    _write_marker(control / "release", TOKEN)
    proc = _start(control / "release", str(program))
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == status
    line = EXEC_FAILURE.format(path=program, reason=os.strerror(code), errno=code)
    assert err.decode() == line + "\n"


def test_devices_are_probed_before_waiting(control: pathlib.Path, tmp_path: pathlib.Path) -> None:
    """The runner's real open() results, written complete before the barrier waits."""
    marker = control / "release"
    results = tmp_path / "devices"
    missing = tmp_path / "no-such-device"
    proc = subprocess.Popen(
        [str(barrier_path()), str(marker), TOKEN, "--devices", str(results), "/dev/null",
         str(missing), str(control), "--", "/bin/true"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )  # fmt: skip
    try:
        _wait_until_blocked_in_poll(proc.pid)
        # A directory opens O_RDWR with EISDIR: never reported as an opened device.
        assert results.read_text() == f"0 /dev/null\n2 {missing}\n21 {control}\n"
        assert not (tmp_path / "devices.tmp").exists()
        assert proc.poll() is None
        _write_marker(marker, TOKEN)
        assert proc.wait(timeout=30) == 0
    finally:
        proc.kill()


def test_an_existing_result_file_is_never_overwritten(
    control: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    results = tmp_path / "devices"
    (tmp_path / "devices.tmp").symlink_to(tmp_path / "victim")
    proc = _start_devices(control / "release", results)
    assert proc.wait(timeout=30) == BarrierExit.PROBE_FAILED
    assert not (tmp_path / "victim").exists()
    assert not results.exists()


def _start_devices(marker: pathlib.Path, results: pathlib.Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [str(barrier_path()), str(marker), TOKEN, "--devices", str(results), "/dev/null", "--",
         "/bin/true"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )  # fmt: skip


@pytest.mark.parametrize(
    "argv",
    [
        ["/m", TOKEN, "--devices"],
        ["/m", TOKEN, "--devices", "relative", "/dev/null", "--", "/bin/true"],
        ["/m", TOKEN, "--devices", "/r", "dev/null", "--", "/bin/true"],
        ["/m", TOKEN, "--devices", "/r", "/dev/null", "/bin/true"],
        ["/m", TOKEN, "--devices", "/r", *(["/dev/null"] * 65), "--", "/bin/true"],
    ],
)
def test_bad_devices_usage_exits_120(argv: list[str]) -> None:
    proc = subprocess.run([str(barrier_path()), *argv], capture_output=True, check=False)
    assert proc.returncode == BarrierExit.USAGE
