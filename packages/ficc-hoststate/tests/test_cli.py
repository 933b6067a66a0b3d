"""`python -m ficc.hoststate inspect`: read-only verification, run as a real command."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
from importlib import metadata

from ficc.hoststate import Status, acquire
from hs_support import HOST, plan

TESTS = pathlib.Path(__file__).resolve().parent


def inspect(directory: pathlib.Path, host: str = HOST) -> subprocess.CompletedProcess[str]:
    """Run the real command; the timeout is a hang guard, not a timing assertion."""
    return subprocess.run(
        [sys.executable, "-m", "ficc.hoststate", "inspect", str(directory), "--host-id", host],
        check=False, capture_output=True, text=True, timeout=60,
    )  # fmt: skip


def files_state(directory: pathlib.Path) -> dict[str, tuple[bytes, int, int, int]]:
    out = {}
    for p in sorted(directory.iterdir()):
        st = p.stat()
        out[p.name] = (p.read_bytes(), st.st_mtime_ns, st.st_ctime_ns, st.st_ino)
    return out


def populated(store: pathlib.Path) -> None:
    with acquire(store, HOST) as s:
        op, _ = s.begin("deploy-1", plan(1))
        op = s.advance(op.id, op.revision, Status.RUNNING)
        s.advance(op.id, op.revision, Status.SUCCEEDED)
        s.begin("deploy-2", plan(2))


def test_inspect_while_another_process_holds_the_lock(store: pathlib.Path) -> None:
    populated(store)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), *sys.path])}
    holder = subprocess.Popen(
        [sys.executable, "-c", f"import hs_mutator as m; m.hold({str(store)!r})"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    try:
        assert holder.stdout is not None
        assert holder.stdout.readline() == "held\n"
        before = files_state(store)
        result = inspect(store)
        assert result.returncode == 0, result.stderr
        assert files_state(store) == before  # no byte, mtime, ctime or inode changed
        assert holder.poll() is None  # and the holder still holds it
    finally:
        holder.kill()
        holder.wait()
    lines = result.stdout.splitlines()
    assert "2 operations" in lines[0]
    assert "checksum verified" in lines[0]
    assert lines[2].split() == ["ID", "STATUS", "REVISION", "PLAN", "HASH"]
    assert lines[3].split() == ["deploy-1", "succeeded", "3", plan(1)]
    assert lines[4].split() == ["deploy-2", "queued", "1", plan(2)]


def test_inspect_empty_directory_creates_nothing(store: pathlib.Path) -> None:
    result = inspect(store)
    assert result.returncode == 0, result.stderr
    assert "never initialized" in result.stdout
    assert list(store.iterdir()) == []


def test_inspect_reports_missing_marker(store: pathlib.Path) -> None:
    populated(store)
    os.truncate(store / "host.lock", 0)
    result = inspect(store)
    assert result.returncode == 0
    assert "marker missing" in result.stdout
    assert (store / "host.lock").read_bytes() == b""  # inspect does not repair


def test_inspect_integrity_failure_exits_nonzero(store: pathlib.Path) -> None:
    populated(store)
    data = bytearray((store / "state.json").read_bytes())
    data[200] ^= 1
    (store / "state.json").write_bytes(bytes(data))
    result = inspect(store)
    assert result.returncode == 1
    assert "[corrupt]" in result.stderr
    assert "state.json" in result.stderr


def test_inspect_missing_snapshot_after_marker(store: pathlib.Path) -> None:
    populated(store)
    os.unlink(store / "state.json")
    result = inspect(store)
    assert result.returncode == 1
    assert "[corrupt]" in result.stderr
    assert "missing" in result.stderr
    assert "restore state.json from a backup" in result.stderr  # what to do, as acquire says


def test_inspect_host_mismatch(store: pathlib.Path) -> None:
    populated(store)
    result = inspect(store, "host-b")
    assert result.returncode == 1
    assert "[host_mismatch]" in result.stderr
    assert "use that host ID or the directory bootstrap made for this host" in result.stderr


def test_inspect_unsafe_and_bad_arguments(store: pathlib.Path, tmp_path: pathlib.Path) -> None:
    result = inspect(tmp_path / "absent")
    assert result.returncode == 1
    assert "[unsafe_store]" in result.stderr
    result = inspect(store, "bad host")
    assert result.returncode == 2
    assert "[invalid_argument]" in result.stderr
    usage = subprocess.run(
        [sys.executable, "-m", "ficc.hoststate"], check=False, capture_output=True
    )
    assert usage.returncode == 2


def test_inspect_json_reports_a_refusal_as_json_too(store: pathlib.Path) -> None:
    populated(store)
    result = subprocess.run(
        [sys.executable, "-m", "ficc.hoststate", "inspect", str(store), "--host-id", "host-b",
         "--json"],
        check=False, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 1
    error = json.loads(result.stdout)["error"]
    assert error["code"] == "host_mismatch"
    assert "use that host ID" in error["message"]
    assert "[host_mismatch]" in result.stderr


def test_inspect_json_carries_the_same_facts_as_the_table(store: pathlib.Path) -> None:
    populated(store)
    result = subprocess.run(
        [sys.executable, "-m", "ficc.hoststate", "inspect", str(store), "--host-id", HOST,
         "--json"],
        check=False, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    document = json.loads(result.stdout)
    assert document["directory"] == str(store)
    assert "checksum verified" in document["note"]
    assert document["operations"] == [
        {"id": "deploy-1", "status": "succeeded", "revision": 3, "plan_hash": plan(1)},
        {"id": "deploy-2", "status": "queued", "revision": 1, "plan_hash": plan(2)},
    ]


def test_the_console_command_has_help_and_version_everywhere(store: pathlib.Path) -> None:
    """`ficc-hoststate` is on the interpreter's PATH (a console script of the wheel)."""
    command = pathlib.Path(sys.executable).parent / "ficc-hoststate"
    assert command.exists(), "the ficc-hoststate console script is not installed"
    expected = f"ficc-hoststate {metadata.version('ficc-hoststate')}\n"
    for argv in (["--version"], ["inspect", "--version"]):
        shown = subprocess.run([command, *argv], check=False, capture_output=True, text=True)
        assert (shown.returncode, shown.stdout) == (0, expected), shown.stderr
    helped = subprocess.run([command, "--help"], check=False, capture_output=True, text=True)
    assert helped.returncode == 0
    assert "inspect" in helped.stdout
    populated(store)
    listed = subprocess.run(
        [command, "inspect", str(store), "--host-id", HOST], check=False, capture_output=True,
        text=True,
    )  # fmt: skip
    assert listed.returncode == 0, listed.stderr
    assert "2 operations" in listed.stdout
