"""What the provider can see of a running attempt, read from the host's /proc and files.

Nothing here asks Podman: a provider-side Podman command outside the service would
leave a pause process behind (see account.py), and the facts are on the host anyway.

- The barrier: the process of the slot account whose /proc/PID/exe is the installed
  barrier (device and inode recorded at prepare). The PID is the host PID.
- The device-open results: the file the barrier wrote, before waiting, in the
  container's private /run tmpfs, read through /proc/PID/root one component at a
  time without following links. Only the barrier has run in the container at that
  point, so the file is the runner's own report.
- The exit status: the file the wrapper around `podman run` writes in the provider's
  run directory when `podman run` returns (inside the service).
"""

from __future__ import annotations

import os
import stat
from collections.abc import Sequence

from ficc_provider_podman.account import processes_of
from ficc_provider_podman.container import DEVICE_RESULTS
from ficc_provider_podman.errors import ProviderError

MAX_RESULTS_BYTES = 64 << 10
_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FILE = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


def barrier_processes(
    uid: int, barrier: tuple[int, int], pids: Sequence[int] | None = None
) -> list[int]:
    """PIDs of the slot account that are executing the barrier right now (among
    `pids`, the account's processes if already read)."""
    found = []
    for pid in processes_of(uid) if pids is None else pids:
        try:
            st = os.stat(f"/proc/{pid}/exe")
        except OSError:
            continue
        if (st.st_dev, st.st_ino) == barrier:
            found.append(pid)
    return found


def alive(pid: int, uid: int) -> bool:
    return pid in processes_of(uid)


def _read_small(dir_fd: int, name: str, limit: int) -> bytes | None:
    """A regular file's bytes (at most `limit`), or None when it does not exist."""
    try:
        fd = os.open(name, _FILE, dir_fd=dir_fd)
    except FileNotFoundError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > limit:
            raise ProviderError("runtime_report", f"{name} is not a small regular file")
        return os.read(fd, limit + 1)
    finally:
        os.close(fd)


def device_results(pid: int, expected: list[str]) -> list[dict[str, object]] | None:
    """The barrier's device-open results, or None while it has not written them."""
    try:
        root = os.open(f"/proc/{pid}/root", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    try:
        parent, name = os.path.split(DEVICE_RESULTS)
        fd = os.dup(root)
        for component in parent.strip("/").split("/"):
            try:
                nxt = os.open(component, _DIR, dir_fd=fd)
            finally:
                os.close(fd)
            fd = nxt
        try:
            data = _read_small(fd, name, MAX_RESULTS_BYTES)
        finally:
            os.close(fd)
    finally:
        os.close(root)
    return None if data is None else parse_device_results(data, expected)


def parse_device_results(data: bytes, expected: list[str]) -> list[dict[str, object]]:
    """Lines `ERRNO PATH` -> [{path, opened}], exactly one per expected device."""
    results: dict[str, bool] = {}
    try:
        for line in data.decode().splitlines():
            code, path = line.split(" ", 1)
            if path in results or not code.isdigit():
                raise ValueError(line)
            results[path] = int(code) == 0
    except ValueError as error:
        raise ProviderError("runtime_report", f"malformed device results: {error}") from error
    if sorted(results) != sorted(expected):
        raise ProviderError(
            "runtime_report",
            f"the barrier reported devices {sorted(results)}, expected {sorted(expected)}",
        )
    return [{"path": path, "opened": results[path]} for path in expected]


def exit_status(run_dir: str, name: str) -> int | None:
    """The recorded exit status of `podman run`, or None while it runs."""
    try:
        dir_fd = os.open(run_dir, _DIR)
    except FileNotFoundError:
        return None
    try:
        data = _read_small(dir_fd, name, 16)
    finally:
        os.close(dir_fd)
    if data is None:
        return None
    text = data.decode(errors="replace").rstrip(" \n")
    if not text.isdigit() or not 0 <= int(text) <= 255:
        raise ProviderError("runtime_report", f"exit status {text!r} is not 0..255")
    return int(text)
