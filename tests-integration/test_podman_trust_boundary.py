"""A slot account turned against the host, through the real daemon and real rootless Podman.

Whatever runs as a slot account is a stranger's: a payload that escaped its container
is a process of the slot account on the host, and it may do anything the account may
do to the account's own files and processes. Root (the daemon, with the Podman
provider inside it) resets and removes those files before and after every job, and
believes the slot idle when no process of the account is left. Each test here starts
such a process for real (ficc_testkit.attacks: a program run as the slot account, not
in any container) and holds the host to what must stay true:

- a process whose thread-group leader exited while another thread runs on (its
  /proc/PID/status says `State: Z`) still counts: the slot is not idle, so no prepare
  passes while it lives and no payload ever shares the slot with it;
- root never follows the account's links: a storage directory swapped for a link to a
  root-owned directory, in a tight loop from such a hidden process, never makes root
  delete anything outside the slot;
- nothing the account plants where root cleans up wedges the slot: neither directory
  chains deeper than Python's recursion limit nor a symbolic link in place of Podman's
  run root; the next job runs, its release works, and what was planted is gone (a
  link removed as a link, its target untouched).

Every attack is on slot s0, which the daemon gives the next job (the first free slot).
The swap test comes last: on a provider that follows the link, Podman itself runs on a
storage that keeps changing under it, and what it leaves there is not the next test's.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import stat
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from ficc.execution.plan import Plan
from ficc.execution.protocol import CheckSlotsRequest, SnapshotRequest
from ficc.execution.wire import AttemptRow, SlotsReply, SlotState, SnapshotReply
from ficc_testkit import attacks
from ficc_testkit.accounts import Account, processes_of
from ficc_testkit.podman import WAIT_TIMEOUT, PodmanWorld
from ficc_testkit.slots import remove_tree
from ficc_testkit.waits import wait_for
from podman_support import NEEDS_PODMAN

pytestmark = [
    NEEDS_PODMAN,
    pytest.mark.podman("runs real jobs with rootless Podman against a hostile slot account"),
]

SLOT = "s0"
"""The slot every attack is on: the daemon admits the next job into the first free slot."""
DEPTH = 1500
"""Directories in a planted chain: well past Python's default recursion limit (1000)."""
PREPARES = 24
"""Prepares while the storage is swapped in a loop. Against a provider that checks the
directory and then opens a path through it, a prepare loses the race about one time
in five (the check must see the directory, and the open the link), so all 24 miss it
less than one time in a hundred."""
CHECK_NAMES = ("compat123", "opaque-bug-check456", "metacopy-check789")
"""Names of the directories Podman's interrupted overlay checks leave, which the provider
removes from `<storage>/overlay`."""
SLOT_BUSY_SAYS = "still has processes"
"""The provider's `slot_busy` refusal, as the daemon logs it (the attempt's reason is
`provider_failed`: a provider's own codes are not passed through)."""


# --- helpers ---------------------------------------------------------------------------


def _said_about(world: PodmanWorld, plan: Plan) -> str:
    """What the daemon logged about the plan's attempt (each structured record's
    message)."""
    said = []
    for line in world.process.log(5000).splitlines():
        if plan.attempt_id in line:
            try:
                said.append(str(json.loads(line)["message"]))
            except (ValueError, KeyError, TypeError):
                said.append(line)
    return "\n".join(said)


def _admitted(world: PodmanWorld, plan: Plan) -> AttemptRow:
    """Prepare `plan`, which must be admitted into the attacked slot."""
    admitted = world.prepare(plan)
    assert admitted.slot == SLOT, f"the job went to {admitted.slot}, not {SLOT}: {admitted}"
    return admitted


def _prepared(world: PodmanWorld, plan: Plan) -> AttemptRow:
    """Prepare `plan` and wait until its preparation ended: ready, or failed."""
    _admitted(world, plan)
    return world.wait(plan, lambda r: r.ready or r.state != "prepared", "the prepare's end")


def _run_job(world: PodmanWorld, said: str) -> AttemptRow:
    """A job printing `said` runs in the attacked slot to exit 0 and is released."""
    plan = world.plan(f"echo {said}")
    ready = _prepared(world, plan)
    assert (ready.state, ready.ready) == ("prepared", True), (ready, _said_about(world, plan))
    world.start(plan)
    done = world.wait_settled(plan)
    assert (done.state, done.exit_code) == ("succeeded", 0), (
        done,
        world.collect(plan, "stderr").data[-2000:],
        _said_about(world, plan),
    )
    assert world.collect(plan, "stdout").data == f"{said}\n".encode()
    released = world.release(plan)
    assert (released.state, released.outcome) == ("released", "succeeded"), (
        released,
        _said_about(world, plan),
    )
    return done


def _used_slot(world: PodmanWorld) -> tuple[Account, Path]:
    """The attacked slot's account and path, once a job has run there: its Podman
    directories (the storage, /run/user/<uid>) exist for the account to play with."""
    account, slot = world.slot_account(SLOT), world.slot_path(SLOT)
    if not (slot / "ficc-podman" / "storage").is_dir() or not _runtime_dir(account).is_dir():
        _run_job(world, "the-slots-first-job")
    return account, slot


def _runtime_dir(account: Account) -> Path:
    return Path(f"/run/user/{account.uid}")


def _tree(top: Path) -> dict[str, tuple[int, int, int, str]]:
    """Everything under `top` (links not followed): mode, owner, inode and, for a
    regular file, the SHA-256 of its bytes, by relative path."""
    found: dict[str, tuple[int, int, int, str]] = {}
    for directory, names, files in os.walk(top):
        for name in [*names, *files]:
            path = Path(directory, name)
            st = path.lstat()
            regular = stat.S_ISREG(st.st_mode)
            digest = hashlib.sha256(path.read_bytes()).hexdigest() if regular else ""
            found[str(path.relative_to(top))] = (st.st_mode, st.st_uid, st.st_ino, digest)
    return found


def _written(marker: Path, hidden: attacks.Attacker) -> bool:
    """Whether the hidden process writes `marker` (a running payload's) before it dies."""
    with contextlib.suppress(AssertionError):
        wait_for(lambda: marker.exists() or not hidden.alive, "the marker", WAIT_TIMEOUT)
    return marker.exists()


@contextlib.contextmanager
def _sentinel() -> Iterator[Path]:
    """A root-owned directory outside every slot (mode 0755) whose `overlay/` holds one
    directory of each name the provider removes as an interrupted overlay check, each
    with a file in it."""
    top = Path(tempfile.mkdtemp(prefix="ficc-sentinel-", dir="/var/tmp"))
    try:
        top.chmod(0o755)
        for name in CHECK_NAMES:
            (top / "overlay" / name).mkdir(parents=True)
            (top / "overlay" / name / "file").write_text(f"root's {name}\n")
        yield top
    finally:
        remove_tree(top)


# --- the tests -------------------------------------------------------------------------


def test_a_process_hidden_behind_a_zombie_leader_never_shares_the_slot_with_a_payload(
    e2e: PodmanWorld,
) -> None:
    """A process of the slot account whose leader called the raw `exit` system call
    while its other thread runs on (writing a marker into the storage of any job of
    the slot it finds running): /proc/PID/status says `State: Z`, but the slot is not
    idle. The next prepare there is refused (`slot_busy`, logged by the daemon; the
    attempt fails `provider_failed`), or the process is killed before the payload
    runs: it is never alive while the payload runs. Once the attempt is released the
    process is gone, and the next job in the slot runs to exit 0."""
    account, slot = e2e.slot_account(SLOT), e2e.slot_path(SLOT)
    with attacks.hide_behind_zombie(account, slot) as hidden:
        states = hidden.thread_states()
        assert states.pop(hidden.pid) == "Z", "the leader should be a zombie"
        assert states, "a thread should run on behind the zombie leader"
        assert "Z" not in states.values(), states
        assert processes_of(account.uid) == [hidden.pid], "the kit must see the hidden thread"

        plan = e2e.plan("while [ ! -e /work/go ]; do sleep 0.1; done; echo payload-ran")
        row = _prepared(e2e, plan)
        if row.ready:
            assert row.state == "prepared", row
            e2e.start(plan)
            running = e2e.wait_running(plan)
            storage = e2e.attempt_dir(running) / "storage"
            if hidden.alive:
                wrote = _written(storage / attacks.MARKER, hidden)
                pytest.fail(
                    "the hidden process still runs while the payload runs; it wrote into the "
                    f"payload's storage: {wrote}"
                )
            (storage / "go").touch()
            done = e2e.wait_settled(plan)
            assert (done.state, done.exit_code) == ("succeeded", 0), done
        else:
            assert (row.state, row.reason) == ("failed", "provider_failed"), row
            said = _said_about(e2e, plan)
            assert SLOT_BUSY_SAYS in said, f"not refused as slot_busy:\n{said}"
            e2e.wait_settled(plan)
        assert e2e.release(plan).state == "released"
        assert not hidden.alive, "the hidden process outlived the attempt's release"
    assert processes_of(account.uid) == []
    _run_job(e2e, "ran-after-the-hidden-process")


def test_directory_chains_deeper_than_the_recursion_limit_do_not_wedge_the_slot(
    e2e: PodmanWorld,
) -> None:
    """The slot account plants chains of 1,500 nested directories where root resets
    its files (`/run/user/<uid>/libpod/` and `<slot>/ficc-podman/home/`); nothing of
    the account runs afterwards. `shutil.rmtree` would raise RecursionError on them,
    which `ignore_errors=True` does not catch. The next job in the slot still runs to
    exit 0, its release works, and both chains are gone."""
    account, slot = _used_slot(e2e)
    chains: list[Path] = []
    try:
        for parent in (_runtime_dir(account) / "libpod", slot / "ficc-podman" / "home"):
            chains.append(attacks.deep_chain(account, parent, "ficc-deep", DEPTH))
        assert processes_of(account.uid) == []

        _run_job(e2e, "ran-after-the-deep-chains")
        left = [str(chain) for chain in chains if os.path.lexists(chain)]
        assert not left, f"the planted chains are still there: {left}"
    finally:
        for chain in chains:  # what a failed run left (the world's teardown uses rmtree)
            remove_tree(chain)


def test_a_link_planted_as_podmans_run_root_does_not_wedge_the_slot(
    e2e: PodmanWorld,
) -> None:
    """The slot account replaces `/run/user/<uid>/containers` (Podman's run root) by a
    symbolic link to a directory of its own elsewhere. Root must not follow the link,
    nor leave it for Podman to use: the next job in the slot runs to exit 0, its
    release works, the link is gone (or a real directory stands in its place), and the
    link's target is untouched."""
    account, _ = _used_slot(e2e)
    target = Path(tempfile.mkdtemp(prefix="ficc-link-target-", dir="/var/tmp"))
    aside: Path | None = None
    try:
        (target / "kept").write_text("the account's own file\n")
        for path in (target, target / "kept"):
            os.chown(path, account.uid, account.gid)
        before = _tree(target)
        link = _runtime_dir(account) / "containers"
        aside = attacks.plant_link(account, link, target)
        assert link.is_symlink(), link

        _run_job(e2e, "ran-after-the-planted-link")
        assert not link.is_symlink(), f"{link} is still the planted link"
        after = _tree(target)
        assert after == before, (
            f"the link's target was changed: new {sorted(after.keys() - before.keys())[:8]},"
            f" gone {sorted(before.keys() - after.keys())}"
        )
    finally:
        remove_tree(target)
        if aside is not None:
            remove_tree(aside)


def test_a_storage_swapped_with_a_link_in_a_loop_never_makes_root_delete_outside_the_slot(
    e2e: PodmanWorld,
) -> None:
    """A process of the slot account, hidden behind a zombie leader, exchanges
    `<slot>/ficc-podman/storage` with a symbolic link to a root-owned directory outside
    the slot as fast as it can (`renameat2(RENAME_EXCHANGE)`), while prepares run in
    the slot; each is awaited (ready or failed), the loop is stopped and the storage
    put back, and the attempt is released. The link's target holds, in `overlay/`, a
    directory of each name the provider removes as an interrupted overlay check: after
    every prepare all of them, and their files, are still there."""
    account, slot = _used_slot(e2e)
    with _sentinel() as sentinel:
        before = _tree(sentinel)
        assert len(before) == 1 + 2 * len(CHECK_NAMES), before
        outcomes: list[str] = []
        for _ in range(PREPARES):
            plan = e2e.plan("echo prepared-only")
            with attacks.swap_in_loop(account, slot / "ficc-podman", "storage", sentinel):
                row = _prepared(e2e, plan)
            outcomes.append("ready" if row.ready else f"{row.state}/{row.reason}")
            assert (slot / "ficc-podman" / "storage").is_dir()
            assert not (slot / "ficc-podman" / "storage").is_symlink()
            after = _tree(sentinel)
            assert after == before, (
                f"root changed {sentinel}, outside the slot, through the link: gone"
                f" {sorted(before.keys() - after.keys())}; the prepares so far: {outcomes}"
            )
            e2e.finish(plan)


def _slot_state(world: PodmanWorld) -> SlotState:
    """The attacked slot's health as the administrator's snapshot reports it."""
    reply = world.driver.as_admin(SnapshotRequest(version=1, id=os.urandom(16).hex(), slots=True))
    assert isinstance(reply, SnapshotReply), reply
    assert reply.slots is not None, reply
    (state,) = [slot for slot in reply.slots if slot.id == SLOT]
    return state


def _immutable(path: Path, on: bool) -> None:
    subprocess.run(["chattr", "+i" if on else "-i", str(path)], check=True)


def test_a_slot_whose_files_the_provider_cannot_reset_leaves_the_offer_until_checked(
    e2e: PodmanWorld,
) -> None:
    """Something in the account's files that root cannot remove (here: a file made
    immutable in the old HOME, which every prepare clears): the prepare is refused
    `slot_files_stuck` naming it, and the slot leaves the offer at once, however its
    own checks look, so no controller pours jobs into it. It comes back only when the
    administrator asks for a check (`check_slots`) after removing it, and then runs."""
    account, slot = _used_slot(e2e)
    home = slot / "ficc-podman" / "home"
    home.mkdir(exist_ok=True)
    os.chown(home, account.uid, account.gid)
    stuck = home / "stuck"
    stuck.write_text("root cannot remove this while it is immutable\n")
    _immutable(stuck, True)
    try:
        plan = e2e.plan("echo never-ran")
        failed = _prepared(e2e, plan)
        assert failed.state == "failed", failed
        said = _said_about(e2e, plan)
        assert str(stuck) in said, said
        state = _slot_state(e2e)
        assert (state.healthy, state.reason) == (False, "slot_files_stuck"), state
        e2e.finish(plan)
        assert not _slot_state(e2e).healthy, "the release must not bring it back"
    finally:
        _immutable(stuck, False)
    checked = e2e.driver.as_admin(CheckSlotsRequest(version=1, id=os.urandom(16).hex()))
    assert isinstance(checked, SlotsReply), checked
    assert _slot_state(e2e).healthy
    _run_job(e2e, "ran-once-the-administrator-checked")
    assert not home.exists()
