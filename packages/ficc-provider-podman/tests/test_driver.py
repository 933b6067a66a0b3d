"""The Podman provider against REAL rootless Podman, inside the host's real service.

Each test drives an attempt the way the host runner does (see harness.py): the
host's layout and stager, the provider's prepare, the host's cgroupfs service
running the prepared argv as a real slot account, start, observe, the host's payload
gate on the live barrier, the release marker, the exit status, then stop, idle
check and release. Nothing is simulated: the limits, the device policy and the gate
act on a real container.
"""

from __future__ import annotations

import os
import shutil
import stat
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

import msgspec

import harness as h
from ficc.execution import provider as sdk
from ficc_provider_podman import driver as podman_driver
from ficc_provider_podman.account import SlotAccount, processes_of, run_podman, slot_lock
from ficc_provider_podman.container import container_name
from ficc_testkit.digests import digest_of
from ficc_testkit.waits import wait_for

pytestmark = pytest.mark.podman("the driver runs real containers")

STREAMED = b"streamed input bytes\n"


@pytest.fixture(scope="module")
def w() -> Iterator[h.World]:
    with h.world() as world:
        yield world


def _finish(attempt: h.Attempt) -> None:
    assert h.cleanup(attempt)
    assert processes_of(attempt.w.slot.uid) == []


def test_a_real_job_passes_the_gate_runs_and_is_cleaned_up(w: h.World) -> None:
    argv = [
        "/bin/sh",
        "-c",
        "cat /inputs/data.txt > /work/out.txt; cat /inputs/local.txt; echo $GREETING; "
        "echo to-stderr >&2; exit 0",
    ]
    plan = h.make_plan(w, argv, streamed=STREAMED, local=True)
    attempt = h.new_attempt(w, plan, STREAMED)
    result = h.prepare(attempt)
    # check() ran before preparation and between every bounded step.
    assert attempt.checks >= 4
    assert result.argv[0] == "/usr/bin/env"
    assert "/usr/bin/podman" in result.argv
    for flag in ("--network=none", "--read-only", "--cap-drop=all", "--cgroupns=private"):
        assert flag in result.argv
    # The streamed input is a hard link of the staged file, not a copy.
    staged = os.stat(attempt.capabilities[0].path)
    linked = os.stat(f"{attempt.paths.provider}/inputs/data.txt")
    assert (linked.st_dev, linked.st_ino) == (staged.st_dev, staged.st_ino)
    assert (linked.st_uid, linked.st_mode & 0o777) == (0, 0o440)
    try:
        pid, verdict = h.run_to_payload(attempt)
        assert verdict.ok, verdict.failures
        assert os.stat(f"/proc/{pid}/exe").st_ino == result.barrier.identity.inode
        # The runner's real device-open results: requested and runtime nodes open,
        # nodes Podman mounts but the policy does not allow are refused.
        assert attempt.ready is not None
        opened = {d["path"]: d["opened"] for d in attempt.ready["devices"]}
        assert opened == {
            "/dev/full": True,
            "/dev/null": True,
            "/dev/random": True,
            "/dev/urandom": True,
            "/dev/zero": False,
            "/dev/tty": False,
        }
        assert set(result.positive_devices) == {p for p, ok in opened.items() if ok}
        assert set(result.negative_devices) == {p for p, ok in opened.items() if not ok}
        h.release_marker(attempt)
        assert h.await_finished(attempt) == 0
        assert Path(attempt.paths.storage, "out.txt").read_bytes() == STREAMED
        assert Path(attempt.paths.stdout).read_text() == "administrator-local input\nhello\n"
        assert Path(attempt.paths.stderr).read_text() == "to-stderr\n"
    finally:
        _finish(attempt)
    assert not os.path.exists(attempt.paths.root)


def test_prepare_asks_podman_again_only_when_the_image_record_changed(
    w: h.World, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Once Podman has confirmed the image in the slot's storage, a prepare that finds
    the storage's image record file unchanged (and the account idle) runs no Podman
    command; once the image is removed (the record changes) prepare goes back to
    Podman, loads it again, and the job runs."""
    commands: list[str] = []

    def spy(account: SlotAccount, config: object, arguments: list[str], **kw: object) -> object:
        commands.append(arguments[0])
        return run_podman(account, config, arguments, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(podman_driver, "run_podman", spy)
    plan = h.make_plan(w, ["/bin/true"], devices=())
    first = h.new_attempt(w, plan)
    try:
        h.prepare(first)  # confirms (or loads) the image
    finally:
        _finish(first)
    commands.clear()
    second = h.new_attempt(w, h.make_plan(w, ["/bin/true"], devices=()))
    try:
        h.prepare(second)
        assert commands == []
    finally:
        _finish(second)

    slot = SlotAccount(w.slot.uid, w.slot.gid, w.slot.path)
    image = w.image["image_id"].removeprefix("sha256:")
    with slot_lock(slot.uid):
        removed = run_podman(slot, w.driver.config, ["rmi", "--force", image])
    assert removed.returncode == 0, removed.stderr
    commands.clear()
    third = h.new_attempt(w, h.make_plan(w, ["/bin/true"], devices=()))
    try:
        h.prepare(third)
        assert commands == ["image", "load", "image"]
        _, verdict = h.run_to_payload(third)
        assert verdict.ok, verdict.failures
        h.release_marker(third)
        assert h.await_finished(third) == 0
    finally:
        _finish(third)


def test_a_nonzero_exit_is_observed(w: h.World) -> None:
    attempt = h.new_attempt(w, h.make_plan(w, ["/bin/sh", "-c", "exit 7"], devices=()))
    try:
        _, verdict = h.run_to_payload(attempt)
        assert verdict.ok, verdict.failures
        h.release_marker(attempt)
        assert h.await_finished(attempt) == 7
    finally:
        _finish(attempt)


def test_a_released_payload_is_observed_without_walking_proc(
    w: h.World, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Once its payload is released and reported, a row is answered from the attempt's
    own files (`payload`, then its exit): the host-wide walk for the account's
    processes, which only a row still waiting for its barrier needs, is not made."""
    attempt = h.new_attempt(w, h.make_plan(w, ["/bin/sleep", "1"], devices=()))
    walks: list[set[int]] = []
    walk = podman_driver.accounts.processes_by_uid

    def counted(uids: set[int]) -> dict[int, list[int]]:
        walks.append(set(uids))
        return walk(uids)

    monkeypatch.setattr(podman_driver.accounts, "processes_by_uid", counted)
    try:
        h.released(attempt)
        assert walks  # observing up to the barrier walked /proc
        walks.clear()
        assert h.await_finished(attempt) == 0
        assert walks == []
    finally:
        _finish(attempt)


def test_the_container_exit_is_read_from_conmon_without_waiting_for_podman(w: h.World) -> None:
    """conmon records the container's exit the moment it reaps it; `podman run` only
    later (a teardown and a polling wait), and the wrapper after that. Here nothing
    after conmon's record can happen: the service may not fork once the payload is
    released (its process limit is set to 1, which the processes it has already
    exceed), so neither Podman's cleanup command (which would remove conmon's file)
    nor the wrapper's `mv` can run. The exit is observed all the same, from conmon's
    file, the same answer stays once the file is gone, and the container ID file names
    the real container."""
    attempt = h.new_attempt(w, h.make_plan(w, ["/bin/sh", "-c", "exit 7"], devices=()))
    try:
        _, verdict = h.run_to_payload(attempt)
        assert verdict.ok, verdict.failures
        assert attempt.handle is not None
        pids = Path(attempt.handle.cgroups["pids"])
        (pids / "pids.max").write_text("1\n")
        h.release_marker(attempt)
        assert h.await_finished(attempt) == 7
        run = Path(attempt.paths.provider) / "run"
        assert not (run / "exit-status").exists()  # the wrapper never recorded it
        container_id = (run / "container-id").read_text().strip()
        attempt.call("stop")
        w.service.stop(attempt.handle)
        # Podman's cleanup command would remove conmon's record: the answer stays.
        slot_runtime = Path(f"/run/user/{w.slot.uid}/libpod/tmp/exits")
        (slot_runtime / container_id).unlink()
        assert attempt.call("observe") == {"phase": "finished", "exit_code": 7}
        slot = SlotAccount(w.slot.uid, w.slot.gid, w.slot.path)
        with slot_lock(slot.uid):
            name = container_name(attempt.id)
            inspected = run_podman(
                slot, w.driver.config, ["container", "inspect", "--format", "{{.Id}}", name]
            )
        assert inspected.stdout.decode().strip() == container_id, inspected.stderr
    finally:
        _finish(attempt)


class _PodmanSpy:
    """Real `run_podman`, with each Podman command the driver starts written down."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.commands: list[list[str]] = []
        real = podman_driver.run_podman

        def spy(slot: SlotAccount, config: object, arguments: list[str], **kw: object) -> object:
            self.commands.append(list(arguments))
            return real(slot, config, arguments, **kw)  # type: ignore[arg-type]

        monkeypatch.setattr(podman_driver, "run_podman", spy)


def _nothing_of_the_container_left(w: h.World, attempt: h.Attempt) -> None:
    """Asked of Podman itself and of containers-storage's own record, after release."""
    slot = SlotAccount(w.slot.uid, w.slot.gid, w.slot.path)
    with slot_lock(slot.uid):
        listed = run_podman(slot, w.driver.config, ["ps", "--all", "--format", "{{.Names}}"])
    assert listed.returncode == 0, listed.stderr
    assert listed.stdout.decode().split() == []
    records = Path(slot.storage, "overlay-containers", "containers.json").read_text()
    assert msgspec.json.decode(records) == []
    assert container_name(attempt.id) not in records


def test_a_run_that_removed_its_container_is_released_without_starting_podman(
    w: h.World, monkeypatch: pytest.MonkeyPatch
) -> None:
    attempt = h.new_attempt(w, h.make_plan(w, ["/bin/sh", "-c", "exit 3"], devices=()))
    try:
        h.released(attempt)
        assert h.await_finished(attempt) == 3
        assert h.await_main_exit(attempt) == 3  # `podman run --rm` removes, then returns
        spy = _PodmanSpy(monkeypatch)
    finally:
        _finish(attempt)
    assert spy.commands == []
    _nothing_of_the_container_left(w, attempt)


def test_a_run_stopped_before_its_removal_is_released_with_podman_rm(
    w: h.World, monkeypatch: pytest.MonkeyPatch
) -> None:
    attempt = h.new_attempt(w, h.make_plan(w, ["/bin/sh", "-c", "sleep 600"], devices=()))
    try:
        h.released(attempt)
        run = Path(attempt.paths.provider) / "run"
        wait_for((run / "container-id").is_file, "the container ID")
        spy = _PodmanSpy(monkeypatch)
    finally:
        _finish(attempt)  # the stop kills `podman run` with its container
    assert spy.commands == [["rm", "--force", "--time", "0", container_name(attempt.id)]]
    _nothing_of_the_container_left(w, attempt)


def test_a_podman_check_cut_short_by_a_power_cut_does_not_fail_the_next_job(w: h.World) -> None:
    """What a power cut left in a slot's storage, seen on a real host: a directory of the
    overlay driver's kernel check, and a layer's short link that never reached the disk.
    Podman then fails the next container mount ("recreating the missing symlinks"); prepare
    removes the check's leftovers, and Podman recreates the link itself."""
    first = h.new_attempt(w, h.make_plan(w, ["/bin/true"], devices=()))
    try:
        h.released(first)  # the image is in the slot's storage now
        assert h.await_finished(first) == 0
    finally:
        _finish(first)
    overlay = Path(SlotAccount(w.slot.uid, w.slot.gid, w.slot.path).storage, "overlay")
    leftover = overlay / "opaque-bug-check2718281828"
    (leftover / "l1" / "d").mkdir(parents=True)
    os.chown(leftover, w.slot.uid, w.slot.gid)
    links = sorted((overlay / "l").iterdir())
    assert links, "the image's layers have short links"
    links[0].unlink()
    attempt = h.new_attempt(w, h.make_plan(w, ["/bin/sh", "-c", "exit 5"], devices=()))
    try:
        h.released(attempt)
        assert h.await_finished(attempt) == 5
    finally:
        _finish(attempt)
    assert not leftover.exists()
    assert links[0].is_symlink()  # recreated by Podman


def test_the_service_memory_limit_kills_the_container(w: h.World) -> None:
    # 64 MiB of shell variable, 512 MiB of input: the service's 128 MiB must stop it.
    hog = ["/bin/sh", "-c", "x=$(head -c 536870912 /dev/urandom | tr -d '\\000'); echo survived"]
    attempt = h.new_attempt(w, h.make_plan(w, hog, devices=(), memory=128 << 20))
    try:
        _, verdict = h.run_to_payload(attempt)
        assert verdict.ok, verdict.failures
        h.release_marker(attempt)
        assert h.await_finished(attempt) != 0
        assert attempt.handle is not None
        # The kill is counted in the victim's cgroup: somewhere in the service's tree.
        memory = Path(attempt.handle.cgroups["memory"])
        kills = [
            int(f.read_text().split("oom_kill ")[1].split()[0])
            for f in memory.rglob("memory.oom_control")
        ]
        assert sum(kills) >= 1, kills
        assert "survived" not in Path(attempt.paths.stdout).read_text()
    finally:
        _finish(attempt)


def test_the_service_pids_limit_blocks_forks(w: h.World) -> None:
    storm = ["/bin/sh", "-c", "for i in $(seq 200); do sleep 60 & done; wait"]
    attempt = h.new_attempt(w, h.make_plan(w, storm, devices=(), processes=64))
    try:
        _, verdict = h.run_to_payload(attempt)
        assert verdict.ok, verdict.failures
        h.release_marker(attempt)
        assert attempt.handle is not None
        pids = Path(attempt.handle.cgroups["pids"])
        wait_for(lambda: "can't fork" in Path(attempt.paths.stderr).read_text(), "a refused fork")
        assert int((pids / "pids.current").read_text()) <= 64
        # The refusal is counted in the forking task's cgroup, inside the service.
        events = [int(f.read_text().split()[1]) for f in pids.rglob("pids.events")]
        assert sum(events) >= 1, events
    finally:
        _finish(attempt)


def test_stop_kills_the_whole_running_tree(w: h.World) -> None:
    argv = ["/bin/sh", "-c", "sleep 1000 & sleep 1000 & echo started; wait"]
    attempt = h.new_attempt(w, h.make_plan(w, argv, devices=()))
    try:
        _, verdict = h.run_to_payload(attempt)
        assert verdict.ok, verdict.failures
        h.release_marker(attempt)
        wait_for(lambda: "started" in Path(attempt.paths.stdout).read_text(), "the payload")
        assert attempt.call("observe")["phase"] == "payload"
        assert len(processes_of(w.slot.uid)) >= 4
        assert attempt.call("stop") == {"stopped": True}
        assert processes_of(w.slot.uid) == []
    finally:
        _finish(attempt)


def test_a_replaced_barrier_is_refused_by_the_gate(w: h.World) -> None:
    """Same bytes, another inode, mounted as the entrypoint: not the barrier."""
    attempt = h.new_attempt(w, h.make_plan(w, ["/bin/true"], devices=()))
    result = h.prepare(attempt)
    copy = Path(w.base, f"barrier-copy-{attempt.id}")
    shutil.copy2(result.barrier.path, copy)
    argv = [a.replace(result.barrier.path, str(copy)) for a in result.argv]
    try:
        h.create_service(attempt, argv)
        assert attempt.call("start") == {"started": True}
        pid = wait_for(lambda: _entrypoint(w.slot.uid, copy), "the copied barrier")
        verdict = h.run_gate(attempt, pid)
        assert not verdict.ok
        assert "gate_exe" in {f.code for f in verdict.failures}
    finally:
        _finish(attempt)
        copy.unlink()


def _entrypoint(uid: int, path: Path) -> int | None:
    st = os.stat(path)
    for pid in processes_of(uid):
        try:
            exe = os.stat(f"/proc/{pid}/exe")
        except OSError:
            continue
        if (exe.st_dev, exe.st_ino) == (st.st_dev, st.st_ino):
            return pid
    return None


def test_a_changed_staged_input_refuses_start(w: h.World) -> None:
    plan = h.make_plan(w, ["/bin/true"], streamed=STREAMED, devices=())
    attempt = h.new_attempt(w, plan, STREAMED)
    try:
        h.prepare(attempt)
        staged = attempt.capabilities[0].path
        os.utime(staged, ns=(1, 1))  # the same inode, another mtime
        refused = attempt.call("start")
        assert refused["error"] == "input_changed", refused
    finally:
        _finish(attempt)


def test_a_check_refusal_stops_prepare_before_anything_is_loaded(w: h.World) -> None:
    def check() -> None:
        raise sdk.Refused("lease_expired", "the lease expired during preparation")

    attempt = h.new_attempt(w, h.make_plan(w, ["/bin/true"], devices=()))
    try:
        reply = attempt.call("prepare", check=check)
        assert reply == {
            "error": "lease_expired",
            "message": "the lease expired during preparation",
        }
        assert not os.path.exists(f"{attempt.paths.provider}/state.json")
    finally:
        _finish(attempt)


@pytest.mark.parametrize(
    ("change", "code"),
    [
        ({"isolation": "vm"}, "isolation_unsupported"),
        ({"network": "host"}, "network_unsupported"),
        ({"image_digest": digest_of(b"other image")}, "image_unknown"),
    ],
)
def test_probe_refuses_what_the_provider_does_not_offer(
    w: h.World, change: dict[str, str], code: str
) -> None:
    plan = h.make_plan(w, ["/bin/true"], devices=())
    runtime = msgspec.structs.replace(plan.job.runtime, **change)
    plan = msgspec.structs.replace(plan, job=msgspec.structs.replace(plan.job, runtime=runtime))
    attempt = h.Attempt(w, plan, h.layout.Layout(w.slot).paths(plan.attempt_id))
    assert attempt.call("probe")["error"] == code
    ok = h.Attempt(w, h.make_plan(w, ["/bin/true"]), attempt.paths)
    assert ok.call("probe")["ok"] is True


def test_probe_refuses_an_unconfigured_device(w: h.World) -> None:
    plan = h.make_plan(w, ["/bin/true"], devices=("gpu0",))
    attempt = h.Attempt(w, plan, h.layout.Layout(w.slot).paths(plan.attempt_id))
    assert attempt.call("probe")["error"] == "device_unknown"


def test_a_payload_started_outside_the_barrier_is_never_reported_and_is_refused(
    w: h.World,
) -> None:
    attempt = h.new_attempt(w, h.make_plan(w, ["/bin/true"], devices=()))
    result = h.prepare(attempt)
    image = w.image["image_id"].removeprefix("sha256:")
    argv = list(result.argv[: result.argv.index(image)])
    argv[argv.index("--entrypoint") + 1] = "/bin/sleep"
    try:
        h.create_service(attempt, [*argv, image, "1000"])
        pid = wait_for(lambda: _running(w.slot.uid, "sleep"), "the unbarriered payload")
        # The provider reports only the barrier: never this process.
        assert attempt.call("observe") == {"phase": "waiting"}
        verdict = h.run_gate(attempt, pid)
        assert "gate_exe" in {f.code for f in verdict.failures}
    finally:
        _finish(attempt)


def _running(uid: int, comm: str) -> int | None:
    for pid in processes_of(uid):
        try:
            if Path(f"/proc/{pid}/comm").read_text().strip() == comm:
                return pid
        except OSError:
            continue
    return None


def test_a_refused_row_does_not_fail_the_rest_of_the_batch(w: h.World) -> None:
    good = h.make_plan(w, ["/bin/true"], devices=())
    bad = h.make_plan(w, ["/bin/true"], devices=("not-configured",))
    rows = [
        h.Attempt(w, plan, h.layout.Layout(w.slot).paths(plan.attempt_id)).context()
        for plan in (good, bad, good)
    ]
    replies = w.driver.probe(rows)
    assert [reply.get("ok") for reply in replies] == [True, None, True]
    assert replies[1]["error"] == "device_unknown"


PLANTED = {
    # Every per-user file rootless Podman (containers/common, containers/image,
    # containers/storage) looks for under HOME or XDG_CONFIG_HOME.
    ".config/containers/containers.conf": '[containers]\nseccomp_profile = "unconfined"\n',
    ".config/containers/containers.conf.d/99-planted.conf": "[containers]\npids_limit = 0\n",
    ".config/containers/storage.conf": '[storage]\ndriver = "vfs"\n',
    ".config/containers/mounts.conf": "/etc/hostname:/etc/planted-by-the-slot\n",
    ".config/containers/registries.conf": 'unqualified-search-registries = ["planted.example"]\n',
    ".config/containers/registries.conf.d/99-planted.conf": "[aliases]\n",
    ".config/containers/policy.json": '{"default": [{"type": "reject"}]}\n',
    ".config/containers/seccomp.json": '{"defaultAction": "SCMP_ACT_ALLOW"}\n',
    ".config/containers/libpod.conf": 'runtime = "planted"\n',
    ".config/containers/auth.json": '{"auths": {}}\n',
    ".local/share/containers/storage.conf": '[storage]\ndriver = "vfs"\n',
}


def test_podman_configuration_in_the_slot_home_is_ignored(w: h.World) -> None:
    """Anything running as the slot account can write its old HOME (slot-owned): a
    file planted there for each place rootless Podman reads a user's configuration
    (mounts.conf would mount a host file into every later container, which the gate
    refuses, wedging the slot) changes nothing for the next two jobs, and is removed
    before Podman runs again. Podman's HOME is root's and empty."""
    slot = SlotAccount(w.slot.uid, w.slot.gid, w.slot.path)
    home = Path(slot.home)
    for relative, text in PLANTED.items():
        path = home / relative
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        path.write_text(text)
    for path in (Path(slot.base), *Path(slot.base).rglob("*")):
        os.chown(path, w.slot.uid, w.slot.gid)
        if path.is_dir():
            path.chmod(0o700)
    for _ in range(2):
        attempt = h.new_attempt(w, h.make_plan(w, ["/bin/true"], devices=()))
        try:
            _, verdict = h.run_to_payload(attempt)
            assert verdict.ok, verdict.failures
        finally:
            _finish(attempt)
        assert not home.exists(), "the planted configuration was left in place"
    st = os.stat(slot.config_home)
    assert (st.st_uid, stat.S_IMODE(st.st_mode), os.listdir(slot.config_home)) == (0, 0o755, [])
    assert slot.environment()["HOME"] == slot.config_home
