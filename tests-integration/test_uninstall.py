"""docs/operations.md, "Uninstalling": the loop that removes the cgroups the cgroupfs
backend made, run as the guide writes it on real cgroups.

The lease reaper is started and moved into its own cgroup exactly as the daemon does
it (`reaper.Keeper` with the backend's `place_reaper`), under a base of this test's
own so that no other daemon on the machine is touched; an attempt's cgroup is left
behind as an unreleased one would be. Then `state_dir` is removed, as the guide's
uninstall does, and the guide's loop must leave no directory of the base behind.
"""

from __future__ import annotations

import re
import secrets
import shutil
import subprocess
import time
from pathlib import Path

from ficc.execution.host.service import reaper
from ficc.execution.host.service.cgroupfs import REAPER_CGROUP, CgroupfsService

ROOT = Path(__file__).resolve().parents[1]


def the_guides_cgroup_loop(base: str) -> str:
    """The `for top in /sys/fs/cgroup/ficc ...; done` loop of the uninstall, with the
    daemon's cgroup base `ficc` replaced by `base`."""
    guide = (ROOT / "docs" / "operations.md").read_text()
    section = guide.split("## 11. Uninstalling", 1)[1].split("\n## ", 1)[0]
    found = re.search(r"^for top in /sys/fs/cgroup/ficc .*?^done$", section, re.M | re.S)
    assert found is not None, "the uninstall has no loop over the daemon's cgroups"
    loop = found.group(0)
    tops = "/sys/fs/cgroup/ficc /sys/fs/cgroup/*/ficc;"
    assert tops in loop
    return loop.replace(tops, f"/sys/fs/cgroup/{base} /sys/fs/cgroup/*/{base};")


def test_the_guides_uninstall_removes_the_lease_reapers_cgroups(tmp_path: Path) -> None:
    base = f"ficc-t-uninstall-{secrets.token_hex(3)}"
    service = CgroupfsService(base)
    state_dir = tmp_path / "state"
    deadlines = state_dir / "deadlines"
    state_dir.mkdir(mode=0o700)
    keeper = reaper.Keeper(str(deadlines), place=service.place_reaper)
    name = f"ficc-work-{secrets.token_hex(8)}"
    boot_id = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    far = time.clock_gettime_ns(time.CLOCK_BOOTTIME) + 600 * 10**9
    leftovers = [Path(node) for node in service.planned_cgroups(name)]
    keeper.set(name, boot_id, far, [str(node) for node in leftovers])
    tops = [node.parent for node in leftovers]
    try:
        for node in leftovers:  # an attempt's cgroup the daemon did not release
            (node / "supervisor").mkdir(parents=True)
        running = keeper._child
        assert running is not None
        assert running.poll() is None
        for top in tops:  # the reaper runs in its own cgroup in every hierarchy
            assert str(running.pid) in (top / REAPER_CGROUP / "cgroup.procs").read_text()
        shutil.rmtree(state_dir)  # the uninstall's `rm -rf ... /var/lib/ficc-executor`
        done = subprocess.run(
            ["sh", "-c", the_guides_cgroup_loop(base)], capture_output=True, text=True,
            check=False, timeout=120,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        assert done.stderr == ""
        assert [str(top) for top in tops if top.exists()] == []
        assert running.wait(timeout=10) == 0  # it ended by itself, as the guide says
    finally:
        for top in tops:
            subprocess.run(["sh", "-c", f"find {top} -depth -type d -exec rmdir {{}} +"],
                           capture_output=True, check=False)  # fmt: skip
