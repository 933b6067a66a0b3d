"""The slot account's leftovers: found and killed whoever owns their /proc files."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import cast

import pytest

from ficc_provider_podman.account import (
    SlotAccount,
    kill_leftovers,
    live_processes_of,
    processes_of,
    run_podman,
)
from ficc_provider_podman.config import Config
from ficc_provider_podman.errors import ProviderError
from ficc_testkit.accounts import Account, Accounts, kill_processes_of

pytestmark = pytest.mark.root("needs a real non-root account, and root to kill its processes")


@pytest.fixture
def account() -> Iterator[Account]:
    accounts = Accounts.ensure(f"ficc-lo{os.getpid() % 100000}-", ["slot"])
    try:
        yield accounts["slot"]
    finally:
        kill_processes_of(accounts["slot"].uid)
        accounts.remove()


@pytest.fixture
def setuid_cat() -> Iterator[Path]:
    """A set-user-ID root copy of cat(1) the account may run (a stand-in for any
    set-user-ID program on the host, such as the newuidmap rootless Podman runs), in
    a directory the account can reach (pytest's own are root's alone)."""
    with tempfile.TemporaryDirectory(dir="/var/tmp", prefix="ficc-setuid-") as directory:
        os.chmod(directory, 0o755)
        program = Path(directory) / "cat"
        shutil.copy2("/bin/cat", program)
        os.chown(program, 0, 0)
        program.chmod(0o4755)
        yield program


def _cat_as(account: Account, program: Path) -> subprocess.Popen[bytes]:
    """`program` (a cat) run by `account`, returned once it has echoed a line: it runs."""
    child = subprocess.Popen(
        [str(program)],
        user=account.uid,
        group=account.gid,
        extra_groups=[],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        cwd="/",
    )
    assert child.stdin is not None
    assert child.stdout is not None
    child.stdin.write(b"up\n")
    child.stdin.flush()
    assert child.stdout.readline() == b"up\n"
    return child


def test_a_set_user_id_process_of_the_account_is_found_refused_and_killed(
    account: Account, setuid_cat: Path
) -> None:
    """Its real UID is the account's but its /proc entry is root's (the owner is the
    effective UID): a walk that trusts the owner misses it, so the idle check and the
    kill read each process's credentials."""
    child = _cat_as(account, setuid_cat)
    try:
        owner = os.stat(f"/proc/{child.pid}").st_uid
        assert owner == 0, "the premise: a set-user-ID process's /proc entry is root's"
        assert child.pid not in processes_of(account.uid)  # the cheap walk cannot see it
        assert child.pid in live_processes_of(account.uid)
        slot = SlotAccount(account.uid, account.gid, "/nonexistent")
        with pytest.raises(ProviderError) as refused:
            # refused before the configuration is looked at
            run_podman(slot, cast(Config, None), ["version"])
        assert refused.value.code == "slot_busy"
        kill_leftovers(account.uid)
        assert child.wait(timeout=30) == -9
        assert live_processes_of(account.uid) == []
    finally:
        child.kill()
        child.wait()


def test_each_account_is_answered_with_its_own_processes(setuid_cat: Path) -> None:
    """A root entry (a set-user-ID program) counts for the account among its UIDs, any
    other entry only for its owner."""
    accounts = Accounts.ensure(f"ficc-lw{os.getpid() % 100000}-", ["one", "two"])
    one, two = accounts["one"], accounts["two"]
    children: list[subprocess.Popen[bytes]] = []
    try:
        children.append(_cat_as(one, Path("/bin/cat")))
        children.append(_cat_as(two, setuid_cat))
        assert live_processes_of(one.uid) == [children[0].pid]
        assert live_processes_of(two.uid) == [children[1].pid]
    finally:
        for child in children:
            child.kill()
            child.wait()
        for who in (one, two):
            kill_processes_of(who.uid)
        accounts.remove()
