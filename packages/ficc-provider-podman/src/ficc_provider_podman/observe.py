"""What the provider can see of a running attempt, read from the host's /proc and files.

Nothing here asks Podman: a provider-side Podman command outside the service would
leave a pause process behind (see account.py), and the facts are on the host anyway.

- The barrier: the process of the slot account whose /proc/PID/exe is the installed
  barrier (device and inode recorded at prepare). The PID is the host PID.
- The device-open results: the file the barrier wrote, before waiting, in the
  container's private /run tmpfs, read through /proc/PID/root one component at a
  time without following links. Only the barrier has run in the container at that
  point, so the file is the runner's own report.
- The exit status: first the file conmon writes the moment it reaps the container
  (`exits/<ID>` under Podman's `--tmpdir`, the ID from the `--cidfile` in the
  provider's run directory), then the file the wrapper around `podman run` writes
  there when `podman run` returns (inside the service: Podman's own failures, when no
  container ran). Both are written by the slot account's processes outside the
  container, which the payload cannot reach; conmon's is what `podman run` itself
  reads, a teardown and a polling wait earlier.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Sequence

from ficc_provider_podman.account import CONMON_EXITS, PODMAN_TMPDIR, processes_of
from ficc_provider_podman.container import CONTAINER_ID, DEVICE_RESULTS
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
    except OSError as error:  # a link (never followed) or worse
        raise ProviderError("runtime_report", f"{name} cannot be read: {error}") from error
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
        data = read_below(root, parent.strip("/").split("/"), name, MAX_RESULTS_BYTES)
    finally:
        os.close(root)
    return None if data is None else parse_device_results(data, expected)


def read_below(base_fd: int, directories: list[str], name: str, limit: int) -> bytes | None:
    """`_read_small` of `name` in the directory `directories` below `base_fd`, each
    opened without following a link; None when one of them does not exist."""
    fd = os.dup(base_fd)
    try:
        for component in directories:
            try:
                nxt = os.open(component, _DIR, dir_fd=fd)
            except FileNotFoundError:
                return None
            except OSError as error:  # a link (never followed) or not a directory
                raise ProviderError(
                    "runtime_report", f"{component} is not a plain directory: {error}"
                ) from error
            os.close(fd)
            fd = nxt
        return _read_small(fd, name, limit)
    finally:
        os.close(fd)


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
    data = read_in(run_dir, name, 16)
    return None if data is None else _status(data)


def container_exit_status(run_dir: str, runtime_dir: str) -> int | None:
    """The container's exit status as conmon recorded it, or None while it runs (or
    when no container was created: the wrapper's status then tells). Below the
    account's runtime directory, every directory is the account's own and is opened
    without following a link."""
    text = container_id(run_dir)
    if text is None:
        return None
    try:
        base = os.open(runtime_dir, _DIR)
    except FileNotFoundError:
        return None
    try:
        below = [*PODMAN_TMPDIR.split("/"), CONMON_EXITS]
        data = read_below(base, below, text, 16)
    finally:
        os.close(base)
    return None if data is None else _status(data)


def container_id(run_dir: str) -> str | None:
    """The ID Podman wrote to the `--cidfile`, or None while it has not (Podman creates
    the file, then writes the ID) or when no container was created."""
    data = read_in(run_dir, CONTAINER_ID, 128)
    text = b"" if data is None else data.strip()
    if len(text) != 64 or text.strip(b"0123456789abcdef"):
        return None
    return text.decode()


def read_in(directory: str, name: str, limit: int) -> bytes | None:
    try:
        dir_fd = os.open(directory, _DIR)
    except FileNotFoundError:
        return None
    try:
        return _read_small(dir_fd, name, limit)
    finally:
        os.close(dir_fd)


def _status(data: bytes) -> int:
    text = data.decode(errors="replace").rstrip(" \n")
    if not text.isdigit() or not 0 <= int(text) <= 255:
        raise ProviderError("runtime_report", f"exit status {text!r} is not 0..255")
    return int(text)
