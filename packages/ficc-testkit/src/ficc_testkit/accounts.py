"""Real system accounts for tests, and running code as one of them.

Accounts are made with `useradd --system` (no home, no login shell) and removed again
only by whoever made them; a test talks to the daemon as an account from a forked child
that drops to its UID and GID (`run_as`), so the kernel's SO_PEERCRED is the real one.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import secrets
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

USERADD = ("useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin")


@dataclass(frozen=True)
class Account:
    """One system account: its name, UID and primary GID."""

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


def lookup(name: str) -> Account | None:
    """The account called `name`, or None if there is none."""
    try:
        entry = pwd.getpwnam(name)
    except KeyError:
        return None
    return Account(name, entry.pw_uid, entry.pw_gid)


def create_account(name: str) -> Account:
    """A new system account (fails if `name` exists)."""
    account_command(*USERADD, name)
    made = lookup(name)
    assert made is not None, name
    return made


@contextlib.contextmanager
def temporary_account(prefix: str) -> Iterator[Account]:
    """A fresh system account, `prefix` and 8 hex characters, removed afterwards: no
    other test's or session's processes ever run as it."""
    account = create_account(f"{prefix}{secrets.token_hex(4)}")
    try:
        yield account
    finally:
        account_command("userdel", account.name)


@dataclass
class Accounts:
    """Accounts by role (`prefix + role`): made if missing, removed if we made them."""

    by_role: dict[str, Account] = field(default_factory=dict)
    created: list[str] = field(default_factory=list)

    @classmethod
    def ensure(cls, prefix: str, roles: Iterable[str]) -> Accounts:
        """The account of every role, made if missing (also when a concurrent session
        makes the same one at the same moment)."""
        accounts = cls()
        for role in roles:
            name = prefix + role
            if lookup(name) is None:
                result = subprocess.run(
                    [*USERADD, name], check=False, capture_output=True, text=True
                )
                if result.returncode == 0:
                    accounts.created.append(name)
                elif lookup(name) is None:  # not made by a concurrent session either: retry
                    account_command(*USERADD, name)
                    accounts.created.append(name)
            made = lookup(name)
            assert made is not None, name
            accounts.by_role[role] = made
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


def processes_of(uid: int) -> list[int]:
    """PIDs (thread-group IDs) of the processes with a live (non-zombie) thread that
    has `uid` as its real, effective, saved or filesystem UID, read from /proc.

    Every thread's status is read, not only the leader's: a leader that called the
    raw `exit` system call while another thread runs shows `State: Z`, and the live
    thread is only seen in /proc/PID/task/. Credentials are per thread, too.
    """
    found = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit() and _has_live_task_of(entry.name, uid):
            found.append(int(entry.name))
    return found


def _has_live_task_of(pid: str, uid: int) -> bool:
    """Whether a live thread of process `pid` holds `uid` among its four UIDs."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return False
    for task in tasks:
        try:
            with open(f"/proc/{pid}/task/{task}/status", "rb") as status:
                fields = dict(
                    line.split(b":", 1) for line in status.read(4096).splitlines() if b":" in line
                )
        except OSError:
            continue
        uids = fields.get(b"Uid", b"").split()
        live = fields.get(b"State", b"").strip()[:1] != b"Z"
        if live and uid in {int(value) for value in uids}:
            return True
    return False


def kill_processes_of(uid: int) -> None:
    """Teardown only: SIGKILL each live process of `uid`, by PID, until none is left."""
    deadline = time.monotonic() + 30
    while pids := processes_of(uid):
        if time.monotonic() > deadline:
            raise AssertionError(f"processes {pids} of uid {uid} survive SIGKILL")
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, 9)
        time.sleep(0.05)


def run_as(account: Account | None, function: Callable[[], bytes]) -> bytes:
    """Run `function` as `account` (UID, GID, no groups) in a forked child; its bytes.

    None runs it here, as the caller. The child inherits every imported module, so the
    unprivileged account never needs to read the interpreter or the source tree. A
    child that raises fails the caller with its traceback; an interrupt of the caller
    (Ctrl-C) kills the child first.
    """
    if account is None:
        return function()
    sys.stdout.flush()  # what is buffered now is printed once, not once more by the child
    sys.stderr.flush()
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
            sys.stdout.flush()
        finally:
            os._exit(status)
    os.close(write_end)
    try:
        with os.fdopen(read_end, "rb") as source:
            data = source.read()
    except BaseException:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        raise
    os.waitpid(pid, 0)
    if not data.startswith(b"R"):
        raise AssertionError(f"the child as {account.name} failed:\n{data[1:].decode()}")
    return data[1:]
