"""GPUs lent as device bundles: the real daemon, real rootless Podman, real nodes.

The host has two stand-in GPUs of one kind and the node they share (ficc_testkit.gpus:
character nodes with the numbers of /dev/zero, /dev/full and /dev/fuse under
`/dev/ficc-gpu-<tag>/`, a driver library and an `nvidia-smi` stand-in), described by
a CDI spec of the shape `nvidia-ctk cdi generate --format=json` writes. The Podman
provider is configured with `gpu0` and `gpu1`, each a device of that spec; the daemon
resolves nothing itself, it grants names one job at a time and builds each job's
closed device policy from the prepare result.

What is shown, from the runner's own device-open results (the barrier's
`/run/.ficc-devices`, the file the provider's `ready` observation reads, copied out by
the payload), the payload's own opens, the gate's evidence and the daemon's rows:
- two jobs at once, on gpu0 and gpu1: each opens its own GPU and the shared node and
  is refused the other's GPU (shown in its container, at its node and its by-path
  link); each sees the driver files at their targets with the links `ldconfig` and
  the spec's link hook would make, and `nvidia-smi -L` lists its own GPU only;
- a job without devices, at the same time, sees no accelerator node, file or variable;
- a second job asking for a held GPU is refused at admission;
- a device in the single-node form `{name, path}` is granted as before and shown to
  no other job;
- a device policy widened behind the host's back, after the service was made and
  before the container ran, is caught: the runner's results contradict the prepared
  policy and the payload is never released (`gate_device`).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from ficc.execution.plan import Plan
from ficc_testkit import gpus, podman
from ficc_testkit.driver import row_code, rows
from ficc_testkit.podman import UNIFIED, WAIT_TIMEOUT, WORLD_PARENT, PodmanWorld
from ficc_testkit.waits import wait_for
from podman_support import BACKENDS, NEEDS_PODMAN, SOURCES, each_test

pytestmark = NEEDS_PODMAN
LIBRARIES = f"{gpus.LIBRARY_FOLDER}/{gpus.LIBRARY} {gpus.LIBRARY_FOLDER}/{gpus.SONAME}"
EPERM = "1"


@pytest.fixture(scope="module")
def stand_ins() -> Iterator[gpus.SyntheticGpus]:
    with gpus.synthetic_gpus(WORLD_PARENT) as made:
        yield made


@pytest.fixture(scope="module", params=BACKENDS)
def world(request: pytest.FixtureRequest, stand_ins: gpus.SyntheticGpus) -> Iterator[PodmanWorld]:
    with podman.podman_world(
        SOURCES, request.param, name="ficc-gpu", offer_per_slot=True,
        devices=stand_ins.devices(),
    ) as built:  # fmt: skip
        yield built


@pytest.fixture
def e2e(request: pytest.FixtureRequest, world: PodmanWorld) -> Iterator[PodmanWorld]:
    yield from each_test(request, world)


def _report_script(made: gpus.SyntheticGpus) -> str:
    """The payload: the runner's results, its own opens, what it sees of the driver,
    then it waits until the test lets it end (so jobs overlap)."""
    nodes = " ".join([*map(str, made.gpus), str(made.control), made.alias(0), made.alias(1)])
    return (
        "{ echo '== runner'; cat /run/.ficc-devices; echo '== opens'; "
        f'for d in {nodes}; do if (exec 3<>$d) 2>/dev/null; then echo "opened $d"; '
        'else echo "refused $d"; fi; done; '
        f"echo '== smi'; {gpus.TOOL_TARGET} -L; echo '== files'; "
        f"for f in {LIBRARIES} {gpus.LIBRARY_FOLDER}/libcuda.so; do "
        'if [ -f "$f" ]; then echo "$f $(head -c 64 "$f" | sha256sum)"; else echo "$f absent"; fi; '
        "done; echo '== env'; "
        'echo "visible=${NVIDIA_VISIBLE_DEVICES:-unset} libraries=${LD_LIBRARY_PATH:-unset}"; '
        f"echo '== nodes'; ls {made.nodes} 2>&1; "
        "} > /work/report.txt; while [ ! -e /work/go ]; do sleep 0.05; done"
    )


def _report(world: PodmanWorld, plan: Plan) -> dict[str, list[str]]:
    return gpus.report_sections(world.collect(plan, "output:report").data.decode())


def _let_go(world: PodmanWorld, plan: Plan) -> None:
    (world.attempt_dir(world.observe(plan)) / "storage" / "go").touch()


def _reported(world: PodmanWorld, plan: Plan) -> None:
    """Until the running payload wrote its report (its last line: the nodes)."""
    report = world.attempt_dir(world.observe(plan)) / "storage" / "report.txt"
    wait_for(
        lambda: report.exists() and "== nodes" in report.read_text(),
        "the payload's report",
        WAIT_TIMEOUT,
    )


def _granted(evidence: dict[str, object]) -> list[set[tuple[int, int]]]:
    """The (major, minor) each device policy the payload ran under lets it read or write."""
    if evidence["devices"] is not None:
        policies = [evidence["devices"]]
    else:
        programs = evidence["device_programs"]
        assert isinstance(programs, list)
        policies = [program["rules"] for program in programs]
    return [
        {(d["major"], d["minor"]) for d in rules if set(d["access"]) & {"r", "w"}}
        for rules in policies  # type: ignore[union-attr]
    ]


def test_two_jobs_on_two_gpus_each_open_their_own_and_the_shared_node_only(
    e2e: PodmanWorld, stand_ins: gpus.SyntheticGpus
) -> None:
    """gpu0 and gpu1 run at the same time in two slots. Each job's runner opened its own
    GPU and the shared control node and was refused (EPERM, the service's closed device
    policy) the other GPU, which its container shows at its node and at its by-path
    link; the payload's own opens agree; `nvidia-smi -L` lists its own GPU only; the
    library is mounted at its name, at the SONAME `ldconfig` would link and at the
    spec's `libcuda.so` link, the same file each time; the spec's environment and the
    library folder are set; the gate's evidence shows a policy that lets it reach its
    GPU and the control node, never the other GPU."""
    script = _report_script(stand_ins)
    plans = [
        e2e.plan(script, devices=[name], outputs=[("report", "report.txt")])
        for name in ("gpu0", "gpu1")
    ]
    for plan in plans:
        e2e.prepare(plan)
    for plan in plans:
        e2e.wait_ready(plan)
        e2e.start(plan)
    for plan in plans:
        e2e.wait_running(plan)
        _reported(e2e, plan)
    assert {e2e.observe(plan).state for plan in plans} == {"running"}  # both at once
    reports = [_report(e2e, plan) for plan in plans]
    for plan in plans:
        _let_go(e2e, plan)
    numbers = [os.stat(gpu).st_rdev for gpu in stand_ins.gpus]
    for index, (plan, report) in enumerate(zip(plans, reports, strict=True)):
        mine, other = stand_ins.gpus[index], stand_ins.gpus[1 - index]
        runner = dict(reversed(line.split(" ", 1)) for line in report["runner"])
        assert runner[str(mine)] == "0", report["runner"]
        assert runner[str(stand_ins.control)] == "0", report["runner"]
        assert runner[str(other)] == EPERM, report["runner"]
        assert runner[stand_ins.alias(1 - index)] == EPERM, report["runner"]
        assert stand_ins.alias(index) not in runner  # shown, not a prepared node's path
        assert f"opened {mine}" in report["opens"]
        assert f"opened {stand_ins.control}" in report["opens"]
        assert f"opened {stand_ins.alias(index)}" in report["opens"]
        assert f"refused {other}" in report["opens"]
        assert f"refused {stand_ins.alias(1 - index)}" in report["opens"]
        assert report["smi"] == [f"GPU {index}: ficc synthetic GPU (UUID: GPU-ficc-0000-{index})"]
        digests = {line.split(" ", 1)[1] for line in report["files"]}
        assert len(digests) == 1, report["files"]  # one file at all three names
        assert "absent" not in next(iter(digests))
        assert report["env"] == [f"visible=void libraries={gpus.LIBRARY_FOLDER}"]
        done = e2e.wait_settled(plan)
        assert (done.state, done.exit_code) == ("succeeded", 0), done
        evidence = json.loads(
            (e2e.attempt_dir(done) / "evidence" / "gate-evidence.json").read_text()
        )
        granted = _granted(evidence)
        control = os.stat(stand_ins.control).st_rdev
        mine_numbers = (os.major(numbers[index]), os.minor(numbers[index]))
        other_numbers = (os.major(numbers[1 - index]), os.minor(numbers[1 - index]))
        assert all(mine_numbers in g for g in granted), granted
        assert all((os.major(control), os.minor(control)) in g for g in granted), granted
        assert any(other_numbers not in g for g in granted), granted


def test_a_job_without_devices_sees_no_accelerator_while_one_holds_a_gpu(
    e2e: PodmanWorld, stand_ins: gpus.SyntheticGpus
) -> None:
    """While a job holds gpu0, a job that asks for no device runs beside it: its
    container has no node of the kind (not its own, not the shared one, no link), no
    driver file, no device variable, and its runner opened only the runtime's nodes."""
    script = _report_script(stand_ins)
    holder = e2e.plan(script, devices=["gpu0"], outputs=[("report", "report.txt")])
    bare = e2e.plan(script, outputs=[("report", "report.txt")])
    for plan in (holder, bare):
        e2e.prepare(plan)
    for plan in (holder, bare):
        e2e.wait_ready(plan)
        e2e.start(plan)
    for plan in (holder, bare):
        e2e.wait_running(plan)
        _reported(e2e, plan)
    report = _report(e2e, bare)
    for plan in (holder, bare):
        _let_go(e2e, plan)
    runner = [line.split(" ", 1)[1] for line in report["runner"]]
    assert all(path.startswith("/dev/") and "ficc-gpu" not in path for path in runner), runner
    assert all(line.startswith("refused ") for line in report["opens"]), report["opens"]
    assert report["smi"] == []
    assert all(line.endswith(" absent") for line in report["files"]), report["files"]
    assert report["env"] == ["visible=unset libraries=unset"]
    assert "No such file or directory" in " ".join(report["nodes"]), report["nodes"]
    for plan in (holder, bare):
        done = e2e.wait_settled(plan)
        assert (done.state, done.exit_code) == ("succeeded", 0), done


def test_a_gpu_held_by_one_job_is_refused_to_another(e2e: PodmanWorld) -> None:
    """One GPU, one job: while gpu0 is held, a plan asking for it is refused at
    admission (`admission_rejected`, the device is in use); gpu1 is still granted."""
    holder = e2e.plan("sleep 1000", devices=["gpu0"])
    e2e.prepare(holder)
    second = e2e.plan("true", devices=["gpu0"])
    (refused,) = rows(e2e.driver.prepare([second]))
    assert row_code(refused) == "admission_rejected", refused
    assert "'gpu0' is not configured or is in use" in refused.error.message
    other = e2e.plan("true", devices=["gpu1"])
    assert e2e.prepare(other).state == "prepared"


# --- the single-node form -----------------------------------------------------------------


@pytest.fixture(scope="module")
def node_world(stand_ins: gpus.SyntheticGpus) -> Iterator[PodmanWorld]:
    """The same stand-ins configured in the single-node form `{name, path}`."""
    devices = [{"name": f"gpu{i}", "path": str(gpu)} for i, gpu in enumerate(stand_ins.gpus)]
    with podman.podman_world(
        SOURCES, BACKENDS[0], name="ficc-node", offer_per_slot=True, devices=devices
    ) as built:
        yield built


@pytest.fixture
def node_e2e(request: pytest.FixtureRequest, node_world: PodmanWorld) -> Iterator[PodmanWorld]:
    yield from each_test(request, node_world)


def test_a_single_node_device_is_granted_and_shown_to_no_other_job(
    node_e2e: PodmanWorld, stand_ins: gpus.SyntheticGpus
) -> None:
    """`{name, path}` is a bundle of one own node of a kind of its own: a job holding
    gpu0 opens it and is shown nothing of gpu1 (another kind); a job holding nothing is
    shown neither (before bundles, every configured node was shown to every job)."""
    script = f"ls {stand_ins.nodes} > /work/seen.txt 2>&1; cat /run/.ficc-devices >> /work/seen.txt"
    holder = node_e2e.plan(script, devices=["gpu0"], outputs=[("seen", "seen.txt")])
    bare = node_e2e.plan(script, outputs=[("seen", "seen.txt")])
    seen = {}
    for plan in (holder, bare):
        node_e2e.prepare(plan)
        node_e2e.wait_ready(plan)
        node_e2e.start(plan)
        done = node_e2e.wait_settled(plan)
        assert (done.state, done.exit_code) == ("succeeded", 0), done
        seen[plan.attempt_id] = node_e2e.collect(plan, "output:seen").data.decode().splitlines()
    assert seen[holder.attempt_id][0] == "nvidia0", seen
    assert f"0 {stand_ins.gpus[0]}" in seen[holder.attempt_id]
    assert not any("nvidia1" in line for line in seen[holder.attempt_id]), seen
    assert "No such file or directory" in seen[bare.attempt_id][0], seen
    assert not any("ficc-gpu" in line for line in seen[bare.attempt_id][1:]), seen


# --- the policy widened behind the host's back ---------------------------------------------


@contextlib.contextmanager
def _podman_held(world: PodmanWorld, plan: Plan) -> Iterator[None]:
    """Hold the slot's containers-storage lock as root: a `podman run` started now
    waits there, before any container process exists (containers-storage takes it,
    blocking, to create the container)."""
    slot = world.slot_path(world.observe(plan).slot)
    lock = slot / "ficc-podman" / "storage" / "overlay-containers" / "containers.lock"
    assert lock.exists(), f"{lock}: the slot's storage has no container lock yet"
    fd = os.open(lock, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX)
        yield
    finally:
        fcntl.lockf(fd, fcntl.LOCK_UN)
        os.close(fd)


def _devices_cgroups_of(uid: int, attempt_id: str) -> list[Path] | None:
    """The v1 devices cgroups from the attempt's service down to the one holding a
    process of `uid` (a v1 device cgroup never allows more than its parent)."""
    for entry in Path("/proc").iterdir():
        try:
            if not entry.name.isdigit() or entry.stat().st_uid != uid:
                continue
            lines = (entry / "cgroup").read_text().splitlines()
        except FileNotFoundError:
            continue
        for line in lines:
            _, controllers, path = line.split(":", 2)
            if "devices" in controllers.split(",") and attempt_id in path:
                parts = path.strip("/").split("/")
                top = next(i for i, part in enumerate(parts) if attempt_id in part)
                tree = Path("/sys/fs/cgroup/devices")
                return [tree.joinpath(*parts[:end]) for end in range(top + 1, len(parts) + 1)]
    return None


@pytest.mark.skipif(UNIFIED, reason="widens a v1 devices.allow; security.md row 16a covers v2")
def test_a_device_policy_widened_behind_the_hosts_back_never_releases_the_payload(
    e2e: PodmanWorld, stand_ins: gpus.SyntheticGpus
) -> None:
    """The host made gpu0's service with a closed policy; while Podman waits on the
    slot's storage lock (no container yet), root allows gpu1's numbers in the
    service's devices cgroup. The container then starts under the wider policy: the
    runner opens gpu1, its results contradict the prepared policy, the attempt fails
    `gate_device` naming gpu1's node, the release marker is never written and the
    payload never ran."""
    plan = e2e.plan("echo ran > /work/ran.txt", devices=["gpu0"], outputs=[("ran", "ran.txt")])
    row = e2e.prepare(plan)
    e2e.wait_ready(plan)
    uid = e2e.slot_account(row.slot).uid
    other = os.stat(stand_ins.gpus[1]).st_rdev
    with _podman_held(e2e, plan):
        e2e.start(plan)
        cgroups = wait_for(
            lambda: _devices_cgroups_of(uid, plan.attempt_id), "Podman in the service", WAIT_TIMEOUT
        )
        rule = f"c {os.major(other)}:{os.minor(other)}"
        assert f"{rule} " not in cgroups[-1].joinpath("devices.list").read_text()
        for cgroup in cgroups:
            (cgroup / "devices.allow").write_text(f"{rule} rwm")
    ended = e2e.wait(plan, lambda r: r.state not in ("prepared", "starting"), "the start's end")
    assert (ended.state, ended.reason) == ("failed", "gate_device"), ended
    (said,) = [
        line
        for line in e2e.process.log(100_000).splitlines()
        if f"attempt {plan.attempt_id}: start_failed: gate_device" in line
    ]
    assert "device-open results contradict the prepared policy" in said, said
    assert str(stand_ins.gpus[1]) in said, said
    assert stand_ins.alias(1) in said, said
    directory = e2e.attempt_dir(ended)
    assert list((directory / "control").iterdir()) == []
    assert not (directory / "storage" / "ran.txt").exists()
