"""`tools/gpu/check`, run as a person runs it: its no-GPU answer and its dry run.

This machine has no GPU: the check must say so and exit 2. Its dry run lends the
synthetic stand-ins of ficc_testkit.gpus (real nodes, real files, a vendor-shaped CDI
spec) to one job through a real daemon and real Podman and must pass; with the test
provider instead of Podman it shows the device policy alone and says `partial` (3).
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from ficc_testkit.podman import WORLD_PARENT
from ficc_testkit.slots import private_directory, remove_tree
from podman_support import NEEDS_PODMAN

ROOT = Path(__file__).resolve().parent.parent
CHECK = ROOT / "tools" / "gpu" / "check"
sys.path.insert(0, str(CHECK.parent))
from gpucheck import discover  # noqa: E402 (tools/gpu, as the check itself imports it)


@pytest.fixture
def base() -> Iterator[Path]:
    path = private_directory(WORLD_PARENT, "ficc-gpucheck-test-")
    try:
        yield path
    finally:
        remove_tree(path)


def _check(base: Path, *arguments: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(CHECK), "--base", str(base), *arguments],
        capture_output=True, text=True, check=False, timeout=600,
        env={**os.environ, "FICC_TEST_WORLD_PARENT": str(base)},
    )  # fmt: skip


def _verdict(done: subprocess.CompletedProcess[str]) -> str:
    (line,) = [line for line in done.stdout.splitlines() if line.startswith("VERDICT ")]
    return line


def test_without_a_gpu_the_check_says_so_and_exits_2(base: Path) -> None:
    if discover.nvidia_nodes() or discover.render_nodes() is not None:
        pytest.skip("this host has a GPU: run tools/gpu/check itself")
    done = _check(base)
    assert done.returncode == 2, done.stdout + done.stderr
    assert _verdict(done).startswith("VERDICT no-gpu: no GPU is present on this host (no ")
    plain = subprocess.run(  # without the wheels: the same answer, from the standard library
        ["/usr/bin/env", "-i", "/usr/bin/python3", "-I", str(CHECK)],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert (plain.returncode, plain.stdout.split(" (")[0]) == (2, _verdict(done).split(" (")[0])


@NEEDS_PODMAN
def test_the_dry_run_lends_one_stand_in_gpu_to_a_podman_job_and_passes(base: Path) -> None:
    done = _check(base, "--dry-run")
    assert done.returncode == 0, done.stdout + done.stderr
    verdict = _verdict(done)
    assert verdict.startswith("VERDICT pass: the job holding gpu0 opened /dev/ficc-gpu-"), verdict
    assert "/nvidia1; nvidia-smi -L: GPU 0: ficc synthetic GPU" in verdict, verdict
    assert "   mount    /usr/lib/x86_64-linux-gnu/libcuda.so.1 <- " in done.stdout
    assert list(base.iterdir()) == []  # every stand-in, account and slot removed


def test_the_dry_run_without_podman_shows_the_device_policy_and_is_partial(base: Path) -> None:
    done = _check(base, "--dry-run", "--without-podman", "--gpu", "1")
    assert done.returncode == 3, done.stdout + done.stderr
    verdict = _verdict(done)
    assert verdict.startswith("VERDICT partial: the job holding gpu1 opened "), verdict
    assert "nvidia1" in verdict.split(" and was refused ")[0], verdict
    assert verdict.split(" and was refused ")[1].split(" (")[0].endswith("/nvidia0"), verdict
    assert "(device policy only: no container ran)" in verdict
