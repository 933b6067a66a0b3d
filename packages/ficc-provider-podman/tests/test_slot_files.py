"""Root in the slot account's files while a process of the account fights back.

The process stands for a payload that escaped its container: a real process of the
slot account on the host (ficc_testkit.attacks). Through the real daemon these attacks
are refused earlier (`slot_busy`: tests-integration/test_podman_trust_boundary.py);
here the provider's own file operations face them directly, to show that each holds
by itself: root reaches the account's directories through descriptors and never acts
where a swapped link points, and its idle checks see a thread whose leader exited.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from ficc_provider_podman import beneath
from ficc_provider_podman.account import (
    SlotAccount,
    kill_leftovers,
    live_processes_of,
    processes_of,
    remove_interrupted_checks,
)
from ficc_provider_podman.errors import ProviderError
from ficc_testkit import attacks
from ficc_testkit.accounts import Account, Accounts, kill_processes_of

pytestmark = pytest.mark.root("a real slot account's processes, and root's clean-up against them")

CHECKS = ("compat123", "opaque-bug-check456", "metacopy-check789")
"""Names Podman's interrupted overlay checks leave, which the clean-up removes."""


@pytest.fixture
def account() -> Iterator[Account]:
    accounts = Accounts.ensure(f"ficc-sf{os.getpid() % 100000}-", ["slot"])
    try:
        yield accounts["slot"]
    finally:
        kill_processes_of(accounts["slot"].uid)
        accounts.remove()


def _reachable_dir() -> Path:
    """A root-owned 0755 directory the account can enter (pytest's are root's alone)."""
    path = Path(tempfile.mkdtemp(dir="/var/tmp", prefix="ficc-slot-files-"))
    path.chmod(0o755)
    return path


def _remove(path: Path) -> None:
    parent = os.open(path.parent, beneath.DIRECTORY)
    try:
        assert beneath.remove_entry(parent, path.name, str(path)) == []
    finally:
        os.close(parent)


def _owned(path: Path, account: Account) -> Path:
    path.mkdir()
    os.chown(path, account.uid, account.gid)
    path.chmod(0o700)
    return path


@pytest.fixture
def slot(account: Account) -> Iterator[Path]:
    """A slot's root (root's) with the account's `ficc-podman/storage/overlay`."""
    root = _reachable_dir()
    try:
        storage = _owned(_owned(root / "ficc-podman", account) / "storage", account)
        _owned(storage / "overlay", account)
        yield root
    finally:
        kill_processes_of(account.uid)
        _remove(root)
        if os.path.lexists(f"/run/user/{account.uid}"):
            _remove(Path(f"/run/user/{account.uid}"))


@pytest.fixture
def sentinel() -> Iterator[Path]:
    """Root's directories outside the slot, named as the clean-up's targets."""
    root = _reachable_dir()
    try:
        for name in CHECKS:
            (root / "overlay" / name).mkdir(parents=True)
            (root / "overlay" / name / "keep").write_bytes(b"root's")
        yield root
    finally:
        _remove(root)


def test_a_storage_swapped_for_a_link_in_a_loop_never_makes_root_remove_outside(
    account: Account, slot: Path, sentinel: Path
) -> None:
    """The clean-up of interrupted overlay checks runs hundreds of times while the
    account exchanges `storage` with a link to `sentinel`. A path through `storage`
    lands in the sentinel (shown, so the attack is live); the clean-up's descriptors
    never do, and the sentinel keeps every entry."""
    storage = slot / "ficc-podman" / "storage"
    outside = os.stat(sentinel / "overlay").st_ino
    landed = cleaned = 0
    with attacks.swap_in_loop(account, slot / "ficc-podman", "storage", sentinel) as loop:
        assert loop.pid in live_processes_of(account.uid), "the hidden swapper is found"
        top = beneath.open_trusted(str(slot))
        try:
            for _ in range(10_000):
                if landed and cleaned >= 200:
                    break
                by_path = os.open(f"{storage}/overlay", beneath.DIRECTORY)
                landed += os.fstat(by_path).st_ino == outside
                os.close(by_path)
                try:
                    storage_fd = beneath.open_beneath(top, "ficc-podman/storage")
                except OSError:
                    continue  # the link stood at the name: refused, never followed
                try:
                    remove_interrupted_checks(storage_fd, str(storage))
                    cleaned += 1
                finally:
                    os.close(storage_fd)
        finally:
            os.close(top)
        with pytest.raises(ProviderError) as busy:
            SlotAccount(account.uid, account.gid, str(slot)).ensure_directories()
        assert busy.value.code == "slot_busy"
    assert landed > 0, "a path through the swapped directory never reached the link's target"
    assert cleaned >= 200
    for name in CHECKS:
        assert (sentinel / "overlay" / name / "keep").read_bytes() == b"root's"


def test_a_thread_behind_an_exited_leader_is_found_refused_and_killed(
    account: Account, slot: Path
) -> None:
    """The leader's status says `Z`; its live thread is the account's all the same."""
    with attacks.hide_behind_zombie(account, str(slot / "ficc-podman" / "*")) as hidden:
        assert "Z" in hidden.thread_states().values()
        assert hidden.pid in processes_of(account.uid)
        assert hidden.pid in live_processes_of(account.uid)
        with pytest.raises(ProviderError) as busy:
            SlotAccount(account.uid, account.gid, str(slot)).ensure_directories()
        assert busy.value.code == "slot_busy"
        kill_leftovers(account.uid)
        hidden.process.wait(timeout=attacks.KILL_TIMEOUT)
        assert not hidden.alive
    assert live_processes_of(account.uid) == []


def test_the_accounts_directories_are_made_and_reset_whatever_it_planted(
    account: Account, slot: Path, tmp_path: Path
) -> None:
    """A deep tree in the old HOME and a link at an interrupted check's name, as the
    account left them: prepare's reset removes both (the link as a link)."""
    base = slot / "ficc-podman"
    attacks.deep_chain(account, base, "home", 1_500)
    elsewhere = _reachable_dir()
    try:
        (elsewhere / "keep").write_bytes(b"root's")
        attacks.plant_link(account, base / "storage" / "overlay" / CHECKS[0], elsewhere)
        SlotAccount(account.uid, account.gid, str(slot)).ensure_directories()
        assert not (base / "home").exists()
        assert not os.path.lexists(base / "storage" / "overlay" / CHECKS[0])
        assert (elsewhere / "keep").read_bytes() == b"root's"
    finally:
        _remove(elsewhere)
