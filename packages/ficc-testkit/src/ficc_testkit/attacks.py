"""Programs of a slot account turned against the host, for the trust-boundary tests.

Each stands for a payload that escaped its container: a real process on the host
running as the slot account (its UID and GID, no supplementary groups), a short
Python program run by the system's interpreter (the test environment's may live
where the account cannot read it). A long-running attacker prints one line once it
is doing its harm, and its starter waits for that line: a test waits on a real
signal, never for a length of time. Every running attacker is an `Attacker`, which
`stop` (or leaving its `with` block) kills for good.

- `hide_behind_zombie`: the process's thread-group leader calls the raw `exit`
  system call (not `exit_group`) while another thread keeps running. /proc/PID/status
  then says `State: Z`, and whoever reads only the leaders' status and skips zombies
  believes the account idle; the live thread writes a marker file into the storage
  of every job of its slot it finds running, as long as it runs.
- `swap_in_loop`: behind such a zombie leader, exchanges a directory of the account's
  with a symbolic link (`renameat2(RENAME_EXCHANGE)`) in a tight loop, so that root,
  checking the directory and then using a path through it, acts wherever the link
  points. `SwapLoop.stop` puts the directory back under its name.
- `deep_chain`: a chain of directories deeper than Python's recursion limit, which
  `shutil.rmtree` cannot remove (its RecursionError is not an OSError, so
  `ignore_errors=True` does not catch it).
- `plant_link`: replaces an entry of the account's by a symbolic link to a directory
  elsewhere.
"""

from __future__ import annotations

import contextlib
import os
import platform
import select
import shutil
import signal
import stat
import subprocess
import time
from pathlib import Path
from types import TracebackType

from ficc_testkit.accounts import Account

READY_TIMEOUT = 30.0
"""How long an attacker may take to say it is ready (or a one-shot attacker to end)."""
KILL_TIMEOUT = 10.0
SYS_EXIT = {"x86_64": 60, "aarch64": 93, "riscv64": 93, "ppc64le": 1, "s390x": 1}
"""The number of the `exit` system call (one thread), by machine: glibc's `_exit`
is `exit_group`, which would end every thread."""
RENAME_EXCHANGE = 2
MARKER = "intruder"
"""The file the hidden process writes into the storage of each job it finds running."""

_HIDE = r"""
import ctypes, os, sys, threading, traceback

_libc = ctypes.CDLL(None, use_errno=True)
SYS_EXIT = int(sys.argv[1])


def say(line):
    os.write(1, (line + "\n").encode())


def behind_a_zombie(work):
    # work() runs in a second thread once the leader has exited by itself (the raw
    # `exit` system call: this thread only), so /proc/PID/status shows `State: Z`.
    def thread():
        try:
            status = "/proc/%d/status" % os.getpid()
            while True:
                with open(status, "rb") as f:
                    if b"\nState:\tZ" in f.read():
                        break
            work()
        except BaseException:
            traceback.print_exc()
            sys.stderr.flush()
            os._exit(1)

    threading.Thread(target=thread).start()
    _libc.syscall(SYS_EXIT, 0)  # ctypes releases the GIL: the thread runs on
    os._exit(2)  # never reached
"""

_HIDER = (
    _HIDE
    + r"""
import time

SLOT, MARKER = sys.argv[2], sys.argv[3]


def storages():
    # A job's storage, from the Podman command lines on the host (`-v SRC:TARGET:OPTS`).
    for pid in os.listdir("/proc"):
        try:
            with open("/proc/%s/cmdline" % pid, "rb") as f:
                argv = f.read().decode(errors="replace").split("\0")
        except OSError:
            continue
        for flag, value in zip(argv, argv[1:]):
            source = value.split(":", 1)[0]
            if flag == "-v" and source.startswith(SLOT + "/") and source.endswith("/storage"):
                yield source


def work():
    say("hidden")
    while True:
        for directory in set(storages()):
            try:
                with open(os.path.join(directory, MARKER), "a") as f:
                    f.write("written by a hidden process\n")
            except OSError:
                pass
        time.sleep(0.05)  # the attacker's pace, not a wait for anything


behind_a_zombie(work)
"""
)

_SWAPPER = (
    _HIDE
    + r"""
DIRECTORY, NAME, LINK, TARGET = sys.argv[2:6]


def work():
    fd = os.open(DIRECTORY, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    os.symlink(TARGET, LINK, dir_fd=fd)
    renameat2 = _libc.renameat2
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p,
                          ctypes.c_uint]
    name, link = NAME.encode(), LINK.encode()

    def exchange():
        if renameat2(fd, name, fd, link, 2) != 0:
            error = ctypes.get_errno()
            raise OSError(error, os.strerror(error), NAME)

    exchange()
    exchange()  # both ways once: the directory is under its own name again
    say("swapping")
    while True:
        exchange()


behind_a_zombie(work)
"""
)

_CHAIN = r"""
import os, sys

parent, top, depth = sys.argv[1], sys.argv[2], int(sys.argv[3])
os.makedirs(parent, mode=0o700, exist_ok=True)
os.chdir(parent)
os.mkdir(top)
os.chdir(top)
for _ in range(depth - 1):
    os.mkdir("d")
    os.chdir("d")
print("planted", depth)
"""

_LINK = r"""
import os, sys

path, target, aside = sys.argv[1:4]
if os.path.lexists(path):
    os.rename(path, aside)
os.symlink(target, path)
print("planted", os.readlink(path))
"""


def interpreter() -> str:
    """The system's Python, which any account can run (the test environment's may be
    under a directory only root can enter)."""
    found = shutil.which("python3", path="/usr/bin:/bin")
    assert found is not None, "the attackers need the system's python3 (/usr/bin/python3)"
    return found


def _command(source: str, *arguments: object) -> list[str]:
    return [interpreter(), "-I", "-S", "-c", source, *map(str, arguments)]


def _spawn(account: Account, command: list[str]) -> subprocess.Popen[bytes]:
    """`command` as `account` (no supplementary groups), in a session of its own, with
    a bare environment; its stdout and stderr are pipes. An account that is the
    caller's own is kept as it is (a test without root attacks itself)."""
    switch = account.uid != os.geteuid()
    return subprocess.Popen(
        command,
        user=account.uid if switch else None,
        group=account.gid if switch else None,
        extra_groups=[] if switch else None,
        env={"PATH": "/usr/bin:/bin", "LC_ALL": "C.UTF-8"},
        cwd="/",
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )


class Attacker:
    """A running attacker program: its process (a child of the caller, so its PID is
    never reused before `stop` reaps it), its output lines, and its end."""

    def __init__(self, account: Account, what: str, command: list[str]) -> None:
        self.account = account
        self.what = what
        self.process = _spawn(account, command)
        self._pending = b""
        self._status: int | None = None
        self.errors = ""
        """What the program wrote to stderr, once it was stopped."""

    @property
    def pid(self) -> int:
        """The thread-group ID: the leader's PID, zombie or not."""
        return self.process.pid

    @property
    def alive(self) -> bool:
        """Whether any thread of the program still runs: one not yet reaped that is
        neither a zombie nor dead (the group can be reaped only once its last thread
        has ended, however early its leader exited)."""
        if self.process.poll() is not None:
            return False
        return any(state not in ("Z", "X") for state in self.thread_states().values())

    def thread_states(self) -> dict[int, str]:
        """Each thread's `State:` letter, by thread ID ({} once it is gone)."""
        states: dict[int, str] = {}
        try:
            tasks = os.listdir(f"/proc/{self.pid}/task")
        except OSError:
            return states
        for task in tasks:
            with contextlib.suppress(OSError):
                for line in Path(f"/proc/{self.pid}/task/{task}/status").read_text().splitlines():
                    if line.startswith("State:"):
                        states[int(task)] = line.split()[1]
        return states

    def wait_for_line(self, expected: str, timeout: float = READY_TIMEOUT) -> str:
        """The program's next output line, which must start with `expected`; fails (and
        stops it) if it ends or says nothing for `timeout` seconds."""
        assert self.process.stdout is not None
        fd = self.process.stdout.fileno()
        deadline = time.monotonic() + timeout
        while b"\n" not in self._pending:
            left = deadline - time.monotonic()
            readable, _, _ = select.select([fd], [], [], max(0.0, left))
            chunk = os.read(fd, 4096) if readable else b""
            if not chunk:
                self.stop()
                ended = "ended" if readable else f"said nothing for {timeout} s"
                raise AssertionError(f"{self.what} {ended}:\n{self.errors}")
            self._pending += chunk
        line, _, self._pending = self._pending.partition(b"\n")
        said = line.decode(errors="replace")
        if not said.startswith(expected):
            self.stop()
            raise AssertionError(f"{self.what} said {said!r}, not {expected!r}:\n{self.errors}")
        return said

    def stop(self) -> int:
        """SIGKILL the thread group (through a pidfd of its leader: every thread dies,
        the leader a zombie or not), reap it, keep its stderr; its exit status."""
        if self._status is not None:
            return self._status
        if self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                pidfd = os.pidfd_open(self.pid)
                try:
                    signal.pidfd_send_signal(pidfd, signal.SIGKILL)
                finally:
                    os.close(pidfd)
        _, stderr = self.process.communicate(timeout=KILL_TIMEOUT)
        self.errors = stderr.decode(errors="replace")
        self._status = self.process.wait(timeout=KILL_TIMEOUT)
        return self._status

    def __enter__(self) -> Attacker:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop()


def _started(attacker: Attacker, ready: str) -> Attacker:
    """`attacker` once it said `ready`; stopped if it did not."""
    try:
        attacker.wait_for_line(ready)
    except BaseException:
        attacker.stop()
        raise
    return attacker


def hide_behind_zombie(account: Account, slot: str | Path) -> Attacker:
    """A process of `account` whose leader has exited while its second thread runs on,
    20 times a second writing a `MARKER` file into the storage of every job of `slot`
    it finds running (Podman's command line names it: `-v <storage>:...`); returned
    once the leader is a zombie and the thread runs."""
    command = _command(_HIDER, SYS_EXIT[platform.machine()], slot, MARKER)
    return _started(Attacker(account, "the hidden process", command), "hidden")


class SwapLoop(Attacker):
    """`swap_in_loop`'s attacker: it knows the directory it swaps, to put it back."""

    def __init__(self, account: Account, directory: Path, name: str, target: Path) -> None:
        self.directory = directory
        self.name = name
        self.link = f".{name}-swap"
        command = _command(
            _SWAPPER, SYS_EXIT[platform.machine()], directory, name, self.link, target
        )
        super().__init__(account, "the swap loop", command)

    def stop(self) -> int:
        """Kill the loop, then (as root) put the directory back under its name and
        remove the link, whichever of the two names the loop left each under."""
        status = super().stop()
        named, spare = self.directory / self.name, self.directory / self.link
        if spare.is_symlink():
            spare.unlink()
        elif named.is_symlink():
            assert stat.S_ISDIR(os.lstat(spare).st_mode), f"{spare} is not the directory"
            named.unlink()
            spare.rename(named)
        return status


def swap_in_loop(account: Account, directory: Path, name: str, target: Path) -> SwapLoop:
    """A process of `account`, hidden behind a zombie leader, that makes a symbolic link
    to `target` next to `directory/name` and exchanges the two names as fast as it
    can; returned once it swapped both ways once and loops."""
    attacker = SwapLoop(account, directory, name, target)
    _started(attacker, "swapping")
    return attacker


def _run_once(account: Account, what: str, command: list[str]) -> str:
    """Run a one-shot attacker to its end (so nothing of the account is left running);
    its one output line."""
    with Attacker(account, what, command) as attacker:
        said = attacker.wait_for_line("planted")
        status = attacker.process.wait(timeout=READY_TIMEOUT)
    assert status == 0, f"{what} exited {status}:\n{attacker.errors}"
    return said


def deep_chain(account: Account, parent: Path, top: str, depth: int) -> Path:
    """As `account`: `parent/top/d/d/...`, `depth` directories in all (`parent` made
    first if missing); returns `parent/top` once the program has ended."""
    said = _run_once(account, "the deep chain", _command(_CHAIN, parent, top, depth))
    assert said == f"planted {depth}", said
    return parent / top


def plant_link(account: Account, path: Path, target: Path) -> Path:
    """As `account`: `path` (moved aside to `path.planted-aside` if it exists, as only
    its owner's parent directory allows) replaced by a symbolic link to `target`;
    returns where the old entry went once the program has ended."""
    aside = path.with_name(f"{path.name}.planted-aside")
    said = _run_once(account, "the link planting", _command(_LINK, path, target, aside))
    assert said == f"planted {target}", said
    return aside
