"""What only the cgroupfs system service has, on this machine's real cgroups, as root.

The behaviour both backends share (members, limits, devices, stop, adopt, refusals,
what the program gets) is tested once, for both, in test_service_behaviour.py. Here:
the runtime's cgroups under the supervisor path, the v1 freezer paths of stop, the
v2 device filter (an eBPF program) and v2 delegation, and the pure layout, write and
parse logic. Each test uses its own base cgroup name, and teardown removes every
cgroup it made even on failure.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import service_support
from ficc.execution.host.core.errors import HostError
from ficc.execution.host.service import (
    CgroupfsService,
    DeviceRule,
    ServiceLimits,
    bpfdevices,
    cgroupfs,
    cgroups,
)
from ficc.execution.host.service.cgroups import Hierarchy, Layout
from ficc.execution.provider import tasks
from ficc_testkit.waits import wait_for
from service_support import (
    NULL,
    OPENER,
    SLEEPERS,
    all_nodes_gone,
    cgroupfs_backend,
    make_spec,
    node,
    py,
)

# The shared fixtures, defined once in service_support.
slot = service_support.slot

pytestmark = pytest.mark.root("the cgroupfs service tests need root (real cgroups)")


@pytest.fixture
def service() -> Iterator[CgroupfsService]:
    with cgroupfs_backend() as backend:
        yield backend


# --- behaviour on real cgroups --------------------------------------------------------


def test_stop_and_remove_cover_the_runtime_cgroups_under_the_supervisor_path(
    service: CgroupfsService, slot: tuple[int, int], tmp_path: Path
) -> None:
    """What Podman does with --cgroup-parent: nested cgroups holding the payload."""
    handle = service.create(make_spec(tmp_path, slot, SLEEPERS))
    parent = service.supervisor_cgroup(handle)
    assert parent == f"/{Path(handle.cgroups['memory']).parent.name}/{handle.name}/payload"
    wait_for(lambda: len(service.members(handle)) == 3)
    payload = max(service.members(handle) - {handle.main_pid})
    for hierarchy in service.layout.hierarchies:
        container = Path(hierarchy.mount + parent) / "libpod-test"
        container.mkdir(parents=True)
        if "cpuset" in hierarchy.controllers:
            for name in ("cpuset.cpus", "cpuset.mems"):
                value = (container.parent.parent / name).read_text()
                (container.parent / name).write_text(value)
                (container / name).write_text(value)
        (container / "cgroup.procs").write_text(str(payload))
    assert payload in service.members(handle)
    assert f"{parent}/libpod-test" in Path(f"/proc/{payload}/cgroup").read_text()
    service.stop(handle)
    assert service.members(handle) == set()
    service.remove(handle)
    assert all_nodes_gone(handle)


def test_a_member_outside_the_unified_subtree_still_occupies_the_service(
    service: CgroupfsService, slot: tuple[int, int], tmp_path: Path
) -> None:
    """`occupied` answers yes from the unified node's `populated` alone; its "no" is the
    walk of every hierarchy's tree, which still finds a process that root moved out of
    the unified subtree but that stays in the v1 nodes."""
    if service.layout.version == 2:
        pytest.skip("a unified-only tree has no v1 node for a process to stay in")
    spec = make_spec(tmp_path, slot, ["/bin/sleep", "1000"])
    handle = service.create(spec)
    assert service.occupied(handle)
    assert cgroups.populated(handle.cgroups["unified"])
    unified = next(h.mount for h in service.layout.hierarchies if h.key == "unified")
    Path(unified, "cgroup.procs").write_text(str(handle.main_pid))  # out of the subtree
    assert not cgroups.populated(handle.cgroups["unified"])
    assert service.members(handle) == {handle.main_pid}
    assert service.occupied(handle)
    service.stop(handle)
    assert not service.occupied(handle)
    service.remove(handle)
    assert not cgroups.populated(handle.cgroups["unified"])  # gone: nothing there


FORK_STORM = """
import os
while True:
    try:
        if os.fork() == 0:
            os._exit(0)
        os.wait()
    except OSError:
        pass
"""


def test_stop_without_cgroup_kill_freezes_and_kills_a_fork_storm(
    service: CgroupfsService, slot: tuple[int, int], tmp_path: Path
) -> None:
    """Members outside the unified subtree are out of cgroup.kill's reach: the v1
    freezer path must still empty the tree while its members keep forking."""
    handle = service.create(make_spec(tmp_path, slot, py(FORK_STORM), processes=64))
    unified = Path(next(h.mount for h in service.layout.hierarchies if h.key == "unified"))
    assert handle.cgroups["unified"].startswith(str(unified))
    (unified / "cgroup.procs").write_text(str(handle.main_pid))  # out of the subtree
    wait_for(lambda: service.members(handle) - {handle.main_pid})  # it is forking
    assert Path(handle.cgroups["unified"], "supervisor", "cgroup.procs").read_text() == ""
    service.stop(handle)
    assert service.members(handle) == set()
    assert service.exit_status(handle) == -signal.SIGKILL
    service.remove(handle)


def test_adopted_service_left_frozen_by_a_crashed_daemon_is_stopped(
    service: CgroupfsService, slot: tuple[int, int], tmp_path: Path
) -> None:
    handle = service.create(make_spec(tmp_path, slot, SLEEPERS))
    wait_for(lambda: len(service.members(handle)) == 3)
    freezer = node(handle, "freezer") / "freezer.state"
    freezer.write_text("FROZEN")
    wait_for(lambda: freezer.read_text().strip() == "FROZEN")
    base = Path(handle.cgroups["memory"]).parent.name
    restarted = CgroupfsService(base)
    adopted = restarted.adopt(handle.name)
    assert adopted is not None
    restarted.stop(adopted)
    assert restarted.members(adopted) == set()
    assert freezer.read_text().strip() == "THAWED"
    restarted.remove(adopted)
    service.stop(handle)  # reaps the old main process


BPF_OPENER = "import sys; sys.stdin.read(1)\n" + OPENER


def test_v2_device_filter_allows_exactly_the_prepared_devices(
    slot: tuple[int, int], tmp_path: Path
) -> None:
    """The cgroup v2 policy (an eBPF program) on this machine's unified tree, where
    the v1 device cgroup of the process allows everything: only the filter denies."""
    unified = next(h.mount for h in cgroups.discover().hierarchies if h.key == "unified")
    group = Path(unified) / f"ficc-t-bpf-{os.getpid()}-{secrets.token_hex(3)}"
    group.mkdir()
    child = None
    try:
        bpfdevices.attach(str(group), [NULL])
        assert bpfdevices.attached(str(group)) == [cgroups.expected_devices([NULL])]
        child = subprocess.Popen(
            py(BPF_OPENER),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env={},
            user=slot[0],
            group=slot[1],
            extra_groups=[],
        )
        (group / "cgroup.procs").write_text(str(child.pid))
        v1_devices = _proc_line(child.pid, "devices")
        assert "a *:* rwm" in Path(f"/sys/fs/cgroup/devices{v1_devices}/devices.list").read_text()
        out, _ = child.communicate(b"g", timeout=60)
        assert json.loads(out) == {"null": "ok", "zero": "EPERM"}
    finally:
        if child is not None and child.poll() is None:
            child.kill()
            child.wait()
        group.rmdir()


def _proc_line(pid: int, controller: str) -> str:
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if controller in controllers.split(","):
            return path
    raise AssertionError(f"{controller} missing from /proc/{pid}/cgroup")


def test_v2_without_usable_controllers_refuses_and_leaves_nothing(
    slot: tuple[int, int], tmp_path: Path
) -> None:
    """Pretend this machine's controller-less unified tree had controllers: the kernel
    refuses to delegate them, and create must clean up its nodes."""
    unified = next(h.mount for h in cgroups.discover().hierarchies if h.key == "unified")
    root = Path(unified) / f"ficc-t-v2-{os.getpid()}-{secrets.token_hex(3)}"
    root.mkdir()
    try:
        claimed = frozenset({"memory", "pids", "cpu"})
        layout = Layout(2, (Hierarchy("unified", str(root), 2, claimed),))
        backend = CgroupfsService("ficc-t-v2", layout=layout)
        with pytest.raises(HostError) as refused:
            backend.create(make_spec(tmp_path, slot, SLEEPERS))
        assert refused.value.code == "service_create"
        assert backend.adopt("attempt-1") is None
    finally:
        for leftover in sorted(root.rglob("*"), reverse=True):
            if leftover.is_dir():
                leftover.rmdir()
        root.rmdir()


# --- pure logic -----------------------------------------------------------------------

MOUNTINFO = """\
31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
32 31 0:29 / /sys/fs/cgroup/cpu,cpuacct rw,relatime - cgroup cgroup rw,cpuacct,cpu
35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory
36 31 0:33 / /sys/fs/cgroup/devices rw,relatime - cgroup cgroup rw,devices
37 31 0:34 / /sys/fs/cgroup/freezer rw,relatime - cgroup cgroup rw,freezer
39 31 0:36 / /sys/fs/cgroup/pids rw,relatime - cgroup cgroup rw,pids
40 31 0:37 / /sys/fs/cgroup/systemd rw,relatime - cgroup cgroup rw,xattr,name=systemd
41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw
42 23 0:39 / /mnt/odd\\040dir rw - cgroup cgroup rw,blkio
"""


def test_mountinfo_names_each_hierarchy_by_its_controllers() -> None:
    found = {h.key: h for h in cgroups.parse_mountinfo(MOUNTINFO)}
    assert set(found) == {
        "cpu,cpuacct",
        "memory",
        "devices",
        "freezer",
        "pids",
        "name=systemd",
        "unified",
        "blkio",
    }
    assert found["cpu,cpuacct"].controllers == {"cpu", "cpuacct"}
    assert found["blkio"].mount == "/mnt/odd dir"
    assert found["unified"].version == 2


def test_layout_prefers_v2_only_with_its_controllers() -> None:
    hierarchies = cgroups.parse_mountinfo(MOUNTINFO)
    assert cgroups.choose_layout(hierarchies, frozenset()).version == 1
    v1 = cgroups.choose_layout(hierarchies, frozenset({"memory", "pids"}))
    assert v1.version == 1
    assert v1.hierarchies[-1].key == "unified"
    v2 = cgroups.choose_layout(hierarchies, frozenset({"memory", "pids", "cpu", "io"}))
    assert v2.version == 2
    assert [h.key for h in v2.hierarchies] == ["unified"]
    no_freezer = [h for h in hierarchies if h.key != "freezer"]
    with pytest.raises(HostError) as refused:
        cgroups.choose_layout(no_freezer, frozenset())
    assert refused.value.code == "service_unsupported"
    assert "freezer" in refused.value.message


LIMITS = ServiceLimits(
    cpu_millis=1500, memory_bytes=(1 << 30) + 123, swap_bytes=1 << 20, processes=64, nofile=64
)


def test_v1_writes_memory_before_memsw_and_rounds_to_pages() -> None:
    writes = cgroups.v1_writes(LIMITS, memsw=True)
    assert writes[:2] == [
        ("memory", "memory.limit_in_bytes", str(1 << 30)),
        ("memory", "memory.memsw.limit_in_bytes", str((1 << 30) + (1 << 20))),
    ]
    assert ("cpu", "cpu.cfs_quota_us", "150000") in writes
    assert [w for w in cgroups.v1_writes(LIMITS, memsw=False) if "memsw" in w[1]] == []
    devices = [DeviceRule("/dev/null", 1, 3), DeviceRule("/dev/pts", 136, None)]
    assert cgroups.v1_device_writes(devices) == [
        ("devices.deny", "a"),
        ("devices.allow", "c *:* m"),
        ("devices.allow", "b *:* m"),
        ("devices.allow", "c 1:3 rwm"),
        ("devices.allow", "c 136:* rwm"),
    ]


def test_v2_writes_and_readback_parsers() -> None:
    assert cgroups.v2_writes(LIMITS) == [
        ("memory.max", str(1 << 30)),
        ("memory.swap.max", str(1 << 20)),
        ("pids.max", "64"),
        ("cpu.max", "150000 100000"),
    ]
    assert cgroups.parse_limit("max\n") is None
    assert cgroups.parse_limit("9223372036854771712\n") is None
    assert cgroups.parse_limit("4096\n") == 4096
    assert cgroups.parse_cpu("max", "100000") is None
    assert cgroups.parse_cpu("-1", "100000") is None
    assert cgroups.parse_cpu("150000", "100000") == 1500
    parsed = cgroups.parse_devices("c 1:3 rwm\na *:* rwm\n")
    assert [(d.kind, d.major, d.minor, d.access) for d in parsed] == [
        ("c", 1, 3, "rwm"),
        ("a", None, None, "rwm"),
    ]


def test_device_filter_program_round_trips_and_refuses_foreign_code() -> None:
    rules = [NULL, DeviceRule("/dev/pts", 136, None), DeviceRule("/dev/nvidia0", 195, 0)]
    raw = bpfdevices.encode(bpfdevices.program(rules))
    assert bpfdevices.decode(raw) == cgroups.expected_devices(rules)
    assert bpfdevices.decode(bpfdevices.encode(bpfdevices.program([]))) == (
        cgroups.expected_devices([])
    )
    tampered = bytearray(raw)
    tampered[-12] ^= 1  # the last rule's allow becomes something else
    assert bpfdevices.decode(bytes(tampered)) is None
    assert bpfdevices.decode(raw[:-1]) is None


def test_membership_check_names_v2_by_its_empty_controller_field() -> None:
    text = "2:cpu,cpuacct:/b/a/supervisor\n1:memory:/b/a/supervisor\n0::/b/a/supervisor\n"
    memberships = cgroups.parse_proc_cgroup(text)
    v2 = Layout(2, (Hierarchy("unified", "/sys/fs/cgroup", 2, frozenset({"memory", "cpu"})),))
    assert cgroups.hierarchies_not_at(v2, memberships, "/b/a/supervisor") == []
    v1 = cgroups.choose_layout(cgroups.parse_mountinfo(MOUNTINFO), frozenset())
    assert cgroups.hierarchies_not_at(v1, memberships, "/b/a/supervisor") == [
        "devices",
        "freezer",
        "pids",
        "name=systemd",
        "blkio",
    ]


def test_a_device_filter_that_cannot_be_read_back_is_a_refusal(tmp_path: Path) -> None:
    """bpf() or the cgroup failing while the policy is read back is `service_devices`
    (the payload is not released), never a raw OSError."""
    with pytest.raises(HostError, match=r"^service_devices: the device filter of .* cannot"):
        cgroupfs._single_filter(str(tmp_path / "gone"))


def test_the_idle_check_reads_state_and_uids_and_fails_closed() -> None:
    """The idle check parses only State and Uid of each task's status; a status
    without them is not judged idle (it counts as a live task of every account)."""
    sample = (
        b"Name:\tsleep\nUmask:\t0022\nState:\tS (sleeping)\nTgid:\t7\n"
        b"Uid:\t1001\t1002\t1003\t1004\nGid:\t5\t5\t5\t5\n"
    )
    assert tasks.state_and_uids(sample) == (b"S", (1001, 1002, 1003, 1004))
    assert tasks.state_and_uids(b"Name:\tsleep\nGid:\t5\t5\t5\t5\n") is None


def test_a_cgroup_is_made_0755_under_the_units_umask(tmp_path: Path) -> None:
    """The shipped unit's UMask=0077 must not leave an attempt's cgroup 0700: the slot
    account's rootless runtime has to traverse it. A parent an earlier daemon left 0700
    is repaired too."""
    fresh, old = tmp_path / "fresh", tmp_path / "old"
    old.mkdir(mode=0o700)
    previous = os.umask(0o077)
    try:
        assert cgroups.make_dir(str(fresh), exclusive=True)
        assert not cgroups.make_dir(str(old), exclusive=False)
    finally:
        os.umask(previous)
    assert stat.S_IMODE(fresh.stat().st_mode) == 0o755
    assert stat.S_IMODE(old.stat().st_mode) == 0o755


# --- the lease reaper's own cgroup ------------------------------------------------------

_DAEMON = """
import sys, time
from ficc.execution.host.service import reaper
from ficc.execution.host.service.cgroupfs import CgroupfsService
base, directory, name, boot_id, deadline = sys.argv[1:6]
sys.stdin.readline()  # the test has moved this process into the daemon's cgroup
service = CgroupfsService(base)
keeper = reaper.Keeper(directory, place=service.place_reaper)
keeper.set(name, boot_id, int(deadline), service.planned_cgroups(name))
print(keeper._child.pid, flush=True)
time.sleep(1000)
"""


def _freezer(service: CgroupfsService) -> tuple[str, str, str, str]:
    """(mount, freeze file, frozen value, thawed value) of this machine's freezer."""
    for hierarchy in service.layout.hierarchies:
        if hierarchy.key == cgroups.UNIFIED:
            return hierarchy.mount, "cgroup.freeze", "1", "0"
        if "freezer" in hierarchy.controllers:
            return hierarchy.mount, "freezer.state", "FROZEN", "THAWED"
    pytest.skip("no freezer on this machine")


def test_a_frozen_daemon_cgroup_leaves_the_lease_reaper_enforcing(
    service: CgroupfsService, slot: tuple[int, int], tmp_path: Path
) -> None:
    """A stand-in daemon in a cgroup of its own hands a deadline 2 s away to the reaper
    it starts; then its cgroup is frozen. The reaper was moved into the base's
    `lease-reaper` cgroup, so it still stops the service at the deadline."""
    name = f"ficc-work-frozen-{secrets.token_hex(3)}"
    handle = service.create(make_spec(tmp_path, slot, SLEEPERS, name=name))
    wait_for(lambda: len(service.members(handle)) == 3)
    mount, freeze, frozen, thawed = _freezer(service)
    daemon_cgroup = Path(mount) / f"ficc-t-daemon-{os.getpid()}-{secrets.token_hex(3)}"
    daemon_cgroup.mkdir()
    directory = tmp_path / "deadlines"
    base = service.planned_supervisor_cgroup("x").split("/")[1]
    boot_id = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    deadline = time.clock_gettime_ns(time.CLOCK_BOOTTIME) + 2 * 10**9
    arguments = [base, str(directory), name, boot_id, str(deadline)]
    daemon = subprocess.Popen(
        [sys.executable, "-c", _DAEMON, *arguments],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    reaper_pid = 0
    try:
        (daemon_cgroup / "cgroup.procs").write_text(str(daemon.pid))
        assert daemon.stdin is not None
        assert daemon.stdout is not None
        daemon.stdin.write("go\n")
        daemon.stdin.flush()
        reaper_pid = int(daemon.stdout.readline())
        (daemon_cgroup / freeze).write_text(frozen)
        wait_for(lambda: (daemon_cgroup / freeze).read_text().strip() == frozen)
        wait_for(lambda: not service.members(handle), "the reaper's stop", timeout=10)
        placed = Path(f"/proc/{reaper_pid}/cgroup").read_text()
        assert f"/{base}/{cgroupfs.REAPER_CGROUP}" in placed, placed
        assert daemon_cgroup.name not in placed, placed
    finally:
        (daemon_cgroup / freeze).write_text(thawed)
        daemon.kill()
        daemon.wait()
        if reaper_pid:
            with contextlib.suppress(ProcessLookupError):
                os.kill(reaper_pid, signal.SIGKILL)
        wait_for(lambda: not (daemon_cgroup / "cgroup.procs").read_text().strip())
        daemon_cgroup.rmdir()
