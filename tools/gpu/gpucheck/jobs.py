"""One job holding one GPU, run through a real daemon: what its runner opened.

With Podman (and root, loop devices, a compiler): the test kit's Podman world
(ficc_testkit.podman: the provider's wheel built and pinned, a slot account and slot
filesystem, the daemon from this environment's wheels) with the GPUs as the
provider's `devices`; the job copies the barrier's device-open results (the file the
provider's `ready` observation reads) and runs `nvidia-smi -L` and a CUDA device query
where the bundle and the host have them.

Without Podman: the same daemon with the test provider (tests-integration/providers)
in its `service` runtime. The host still makes the job's service with the closed
device policy of exactly the job's nodes, and the test provider's shell barrier opens
every node in it; the payload gate then refuses that unconfined runtime, so no
program of the job runs. The device opens are read from the attempt's storage.
"""

from __future__ import annotations

import contextlib
import subprocess
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ficc.execution.plan import Plan
from ficc_testkit import configs, gpus, podman
from ficc_testkit.accounts import Account, create_account
from ficc_testkit.daemons import DaemonProcess
from ficc_testkit.driver import TERMINAL, Driver, attempt
from ficc_testkit.slots import private_directory, remove_slots, remove_tree, slot_filesystems
from ficc_testkit.units import GIB, MIB
from ficc_testkit.wheels import build_wheel, install_provider

ROOT = Path(__file__).resolve().parents[3]
TEST_PROVIDER = ROOT / "tests-integration" / "providers" / "ficc-test-provider"
REPORT = "report.txt"
TIMEOUT = 300.0
SMI = "/usr/bin/nvidia-smi"
TEST_PROVIDER_RESULTS = ".ficc-test-provider/devices"


@dataclass
class Observed:
    """What the job's runner opened (path -> opened) and what its programs printed."""

    runner: str
    opened: dict[str, bool]
    state: str
    reason: str | None
    smi: list[str] = field(default_factory=list)
    query: list[str] = field(default_factory=list)


def _report_script(query: Path | None) -> str:
    ran = f"if [ -x {query} ]; then echo '== query'; {query} 2>&1 | tail -n 40; fi; "
    return (
        "{ echo '== runner'; cat /run/.ficc-devices; echo '== smi'; "
        f"if [ -x {SMI} ]; then {SMI} -L 2>&1; fi; {ran if query else ''}"
        f"}} > /work/{REPORT} 2>&1"
    )


def _opened(lines: Sequence[str], errno_first: bool) -> dict[str, bool]:
    """`ERRNO PATH` lines of the barrier (0: opened), or the test provider's `1 PATH`."""
    opened = {}
    for line in lines:
        code, _, path = line.partition(" ")
        if path:
            opened[path] = code == "0" if errno_first else code == "1"
    return opened


def host_libraries(programs: Sequence[Path], driver_files: set[str]) -> list[Path]:
    """The C libraries (and loader) `ldd` lists for `programs`, without the driver's own
    files (those come from the bundle, matching the kernel module), plus the programs the
    bundle does not mount: what the job's image needs to run them."""
    found: list[Path] = []
    for program in programs:
        listed = subprocess.run(["ldd", str(program)], capture_output=True, text=True, check=False)
        for line in listed.stdout.splitlines():
            path = line.split(" => ")[-1].split(" (")[0].strip()
            driver = Path(path).name.startswith(("libcuda", "libnvidia"))
            if (
                path.startswith("/")
                and not driver
                and str(Path(path).resolve()) not in driver_files
            ):
                found.append(Path(path))
        if str(program.resolve()) not in driver_files:
            found.append(program)
    return list(dict.fromkeys(found))


def with_podman(
    devices: list[dict[str, Any]], name: str, image_files: Sequence[Path], query: Path | None
) -> Observed:
    """Run the job holding `name` in a Podman world (see the module docstring)."""
    sources = podman.Sources(ROOT)
    with podman.podman_world(
        sources, "cgroupfs", slots=1, name="ficc-gpucheck", devices=devices,
        image_files=image_files,
    ) as world:  # fmt: skip
        plan = world.plan(_report_script(query), devices=[name], outputs=[("report", REPORT)])
        world.prepare(plan)
        world.wait_ready(plan)
        world.start(plan)
        done = world.wait_settled(plan, TIMEOUT)
        text = ""
        if done.state == "succeeded":
            text = world.collect(plan, "output:report").data.decode(errors="replace")
        world.release(plan)
    sections = gpus.report_sections(text)
    return Observed(
        runner="the container's barrier (ficc-provider-podman)",
        opened=_opened(sections.get("runner", []), errno_first=True),
        state=done.state,
        reason=done.reason,
        smi=sections.get("smi", []),
        query=sections.get("query", []),
    )


@contextlib.contextmanager
def _test_provider_daemon(
    base: Path, devices: dict[str, list[str]], negative: list[str]
) -> Iterator[tuple[Driver, configs.Layout, Account]]:
    """A daemon with one slot and the test provider in its `service` runtime."""
    accounts = [create_account(f"ficc-gpucheck-{role}-{base.name[-6:]}") for role in ("s", "t")]
    filesystems = []
    try:
        slot_account, transport = accounts
        provider = install_provider(build_wheel(TEST_PROVIDER, base / "wheel"), base / "prefix")
        filesystems = slot_filesystems(base, [64 * MIB], 4000)
        resources = configs.allowance(
            cpu_millis=1000, memory_bytes=GIB, processes=256, slots=1,
            devices=list(devices), projects=[podman.PROJECT], runtimes=["test"],
        )  # fmt: skip
        entry = {"runtime": "service", "devices": devices, "negative_devices": negative}
        config = configs.host_config(
            base, transport=transport, resources=resources,
            slots=[configs.slot(0, filesystems[0], slot_account, slot_class="gpu",
                                storage_inodes=4000)],
            providers=[configs.provider("test", provider.digest, entry)],
        )  # fmt: skip
        layout = configs.Layout.write(base, config, filesystems)
        daemon = DaemonProcess.of(layout, provider)
        daemon.start()
        try:
            yield Driver(layout, transport), layout, slot_account
        finally:
            daemon.stop()
    finally:
        remove_slots(filesystems)
        for account in accounts:
            podman.remove_account(account)


def with_test_provider(
    parent: str, devices: dict[str, list[str]], negative: list[str], name: str
) -> Observed:
    """Run the job holding `name` with the test provider (see the module docstring)."""
    base = private_directory(parent, "ficc-gpucheck-")
    try:
        with _test_provider_daemon(base, devices, negative) as (driver, layout, _):
            plan: Plan = driver.make_plan(
                name="gpu-check", slot_class="gpu", isolation="process", devices=[name],
                storage_bytes=16 * MIB, storage_inodes=100, memory_bytes=128 * MIB,
            )  # fmt: skip
            driver.prepare([plan])
            driver.wait_state(plan, lambda r: r.ready or r.state != "prepared", "ready", TIMEOUT)
            driver.start_attempt(plan)
            done = driver.wait_state(plan, lambda r: r.state in TERMINAL, "the end", TIMEOUT)
            storage = Path(layout.config.slots[0].path, "ficc", plan.attempt_id, "storage")
            results = storage / TEST_PROVIDER_RESULTS
            lines = results.read_text().splitlines() if results.is_file() else []
            driver.wait_state(plan, lambda r: r.cleanup_confirmed, "cleanup", TIMEOUT)
            attempt(driver.release(plan))
    finally:
        remove_tree(base)
    return Observed(
        runner="the test provider's shell barrier, in the job's service",
        opened=_opened(lines, errno_first=False),
        state=done.state,
        reason=done.reason,
    )
