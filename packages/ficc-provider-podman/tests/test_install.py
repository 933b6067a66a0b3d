"""The provider as an administrator installs it: a wheel in a root-owned prefix,
pinned by digest and loaded through the host's own loader (never editable)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from collections.abc import Iterator
from pathlib import Path

import pytest

from ficc_provider_podman.barrier import has_dynamic_loader

PACKAGE = Path(__file__).resolve().parents[1]

pytestmark = [
    pytest.mark.root("the install goes into a root-owned prefix"),
    pytest.mark.skipif(
        shutil.which("cc") is None,
        reason="needs a C compiler, the wheel builds the barrier (tools/dev setup installs gcc)",
    ),
]

LOAD = """
import json, sys
from ficc.execution.host.providers.digest import compute_digest
from ficc.execution.host.providers.loader import load_provider
site, archive = sys.argv[1], sys.argv[2]
sha = "sha256:" + "a" * 64
digest = compute_digest("podman", [site]).digest
config = {"images": [{"digest": sha, "archive": archive, "archive_sha256": sha, "image_id": sha}]}
loaded = load_provider("podman", digest, config, [site])
from ficc.execution import plan as planlib
from ficc.execution import provider as sdk
limits = planlib.Limits(1000, 64 << 20, 0, 8, 1 << 20, 100, [])
job = planlib.Job("job", "cpu", planlib.Runtime("podman", sha, sha, "vm", "none"),
                  planlib.Payload(["/bin/true"], {}), limits, [], [], False)
plan = planlib.Plan(1, "1" * 32, "2" * 32, "3" * 32, "4" * 32, "0" * 32, 1, 1, job)
d = "/nonexistent/" + "0" * 32
context = sdk.Context(
    "0" * 32, plan, planlib.plan_digest(plan),
    sdk.Slot("slot0", "cpu", "/nonexistent", 65534, 65534, 1 << 30, 1000),
    sdk.StorageBinding(d + "/storage"), d, d + "/provider", d + "/control",
    d + "/control/release", sdk.Logs(d + "/logs/stdout", d + "/logs/stderr"), "svc",
    "/ficc/svc/supervisor", sdk.Supervisor("cgroupfs", "svc"))
from ficc_provider_podman.barrier import barrier_path
print(json.dumps({"digest": digest, "file": loaded.module.__file__,
                  "barrier": str(barrier_path()), "probe": loaded.driver.probe([context])}))
"""


@pytest.fixture(scope="module")
def prefix(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    base = Path(f"/tmp/ficc-pp-install-{os.getpid()}")
    base.mkdir(mode=0o755)
    try:
        wheels = tmp_path_factory.mktemp("wheels")
        pip = [sys.executable, "-m", "pip"]
        subprocess.run(
            [*pip, "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", wheels, PACKAGE],
            check=True,
        )
        (wheel,) = wheels.glob("*.whl")
        # --ignore-installed: never uninstall the copy of the running environment.
        install = ["install", "-q", "--no-deps", "--no-index", "--ignore-installed"]
        subprocess.run([*pip, *install, "--prefix", base / "p", wheel], check=True)
        yield base
    finally:
        shutil.rmtree(base)


def test_the_installed_wheel_is_pinned_loaded_and_configured(prefix: Path) -> None:
    site = sysconfig.get_path("purelib", vars={"base": str(prefix / "p")})
    archive = prefix / "image.tar"
    archive.write_bytes(b"x")
    archive.chmod(0o644)
    out = subprocess.run(
        [sys.executable, "-c", LOAD, site, str(archive)], check=True, capture_output=True
    ).stdout
    loaded = json.loads(out)
    assert loaded["digest"].startswith("sha256:")
    assert loaded["file"].startswith(site)
    # The barrier was compiled when the wheel was built: static, in the prefix.
    barrier = Path(loaded["barrier"])
    assert str(barrier).startswith(site)
    assert os.access(barrier, os.X_OK)
    assert not has_dynamic_loader(barrier)
    assert loaded["probe"] == [
        {
            "error": "isolation_unsupported",
            "message": "isolation 'vm' is not offered; this provider runs 'shared-kernel' only",
        }
    ]
