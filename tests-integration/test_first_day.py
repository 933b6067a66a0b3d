"""An administrator's first day, walked by docs/operations.md alone, on this machine.

The steps are the guide's, in its order and with its commands (under a private base
directory instead of `/`, and `supervisor = "cgroupfs"`: this machine's PID 1 is not
systemd): the four wheels, a virtualenv that pip installs them into, the accounts
(`useradd` as the guide writes it), the directories with the guide's modes, a slot
made by `provision-slot`, the test image brought as an OCI archive and its entry
printed by `ficc-podman-image`, the pin from `provider-digest`, the configuration
written from the complete example of docs/configuration.md, `check-config`, `serve`
with every setting of the shipped unit (its umask 0077, its environment, its limits,
`python -I`), `smoke-test`, and the guide's uninstall, after which nothing of the
installation is left: no mount, no account, no process, no runtime directory, no
cgroup of its attempts.
"""

from __future__ import annotations

import json
import os
import pwd
import re
import secrets
import subprocess
import sys
from pathlib import Path
from typing import Any

import psutil
import pytest

from ficc_testkit.daemons import DaemonProcess
from ficc_testkit.podman import Sources, build_image
from ficc_testkit.slots import private_directory, remove_tree
from ficc_testkit.waits import wait_for
from ficc_testkit.wheels import build_wheel
from test_packaging import DISTRIBUTIONS

pytestmark = [
    pytest.mark.podman("installs the wheels and runs a real job with rootless Podman"),
    pytest.mark.slow("builds the five wheels and a virtualenv"),
]

ROOT = Path(__file__).resolve().parents[1]
USERADD = (
    "useradd",
    "--system",
    "--user-group",
    "--no-create-home",
    "--shell",
    "/usr/sbin/nologin",
)
"""The account command of docs/operations.md, section 2."""


def sh(*argv: str | Path, ok: bool = True) -> subprocess.CompletedProcess[str]:
    """One command as an administrator's root shell runs it (umask 0022)."""
    done = subprocess.run(
        [str(a) for a in argv], capture_output=True, text=True, check=False, umask=0o022,
        timeout=600,
    )  # fmt: skip
    if ok:
        assert done.returncode == 0, f"{argv}: {done.stdout}{done.stderr}"
    return done


def complete_example() -> dict[str, Any]:
    """The JSON of docs/configuration.md, "Complete example"."""
    text = (ROOT / "docs" / "configuration.md").read_text()
    section = text.split("## Complete example", 1)[1]
    block = re.search(r"```json\n(.*?)\n```", section, re.DOTALL)
    assert block is not None, "configuration.md's complete example has no JSON block"
    example: dict[str, Any] = json.loads(block.group(1))
    return example


def test_the_first_day_by_the_docs_ends_with_a_passed_smoke_test_and_leaves_nothing() -> None:
    base = private_directory("/run", "ficc-firstday-")
    tag = secrets.token_hex(3)
    transport, slot = f"ficc-fd{tag}-tr", f"ficc-fd{tag}-s0"
    venv = base / "opt" / "ficc" / "venv"
    mount = base / "srv" / "ficc" / "slots" / "small-0"
    daemon: DaemonProcess | None = None
    installation = secrets.token_hex(16)
    try:
        # Getting the wheels (what `nox -s dist` builds) and installing them.
        for name in DISTRIBUTIONS:
            build_wheel(ROOT / "packages" / name, base / "dist")
        sh(sys.executable, "-m", "venv", venv)
        wheels = sorted((base / "dist").glob("ficc_*.whl"))
        sh(venv / "bin" / "pip", "install", "-q", "--find-links", base / "dist", *wheels)
        sh("chown", "-R", "root:root", base / "opt" / "ficc")
        sh("chmod", "-R", "go-w", base / "opt" / "ficc")
        assert sh(venv / "bin" / "ficc-executor", "--version").stdout.startswith("ficc-executor ")

        # Directories and accounts, as section 2 writes them.
        state, sockets, etc = (
            base / "var/lib/ficc-executor",
            base / "run/ficc-executor",
            base / "etc/ficc",
        )
        images, slot_images = base / "srv/ficc/images", base / "var/lib/ficc-slots"
        for path, mode in ((state, "0700"), (sockets, "0711"), (base / "srv/ficc/slots", "0755"),
                           (etc, "0755"), (images, "0755"), (slot_images, "0700")):  # fmt: skip
            sh("install", "-d", "-o", "root", "-g", "root", "-m", mode, path)
        sh(*USERADD, transport)
        sh(*USERADD, slot)
        slot_account = pwd.getpwnam(slot)

        # A slot filesystem.
        made = json.loads(sh(
            venv / "bin" / "ficc-executor", "provision-slot",
            "--image", slot_images / "small-0.img", "--mount", mount,
            "--bytes", "256M", "--inodes", "20000", "--json",
        ).stdout)["slot"]  # fmt: skip

        # Adding an image: an OCI archive, its entry printed by ficc-podman-image.
        built = build_image(Sources(ROOT), base / "build")
        archive = images / "busybox.oci.tar"
        sh("install", "-o", "root", "-g", "root", "-m", "0644", built["archive"], archive)
        printed = sh(venv / "bin" / "ficc-podman-image", archive, "--format", "json")
        entry = json.loads(printed.stdout)
        assert entry["image_id"] == built["image_id"]

        # The pin.
        pinned = json.loads(
            sh(venv / "bin" / "ficc-executor", "provider-digest", "podman", "--json").stdout
        )

        # The configuration, from the complete example.
        config: dict[str, Any] = complete_example()
        project = secrets.token_hex(16)
        config.update(
            installation_id=installation, deployment_id=secrets.token_hex(16),
            node_id=secrets.token_hex(16), mode="managed",
            transport_uid=pwd.getpwnam(transport).pw_uid, local_owner_uids=[],
            state_dir=str(state), socket_dir=str(sockets), supervisor="cgroupfs",
        )  # fmt: skip
        config["slots"] = [{
            "id": "small-0", "class": "small", "generation": 1, "path": made["path"],
            "uid": slot_account.pw_uid, "gid": slot_account.pw_gid,
            "storage_bytes": made["storage_bytes"], "storage_inodes": made["storage_inodes"],
            "filesystem_uuid": made["filesystem_uuid"],
        }]  # fmt: skip
        for allowance in (config["ceiling"], config["initial_offer"]):
            allowance.update(slots=1, devices=[], projects=[project])
        config["initial_offer"]["control"] = "active"  # a host meant to take work at once
        (provider,) = config["providers"]
        provider["package_digest"] = pinned["package_digest"]
        provider["configuration"] = {"images": [entry]}
        config_path = etc / "executor-host.json"
        config_path.write_text(json.dumps(config, indent=2))
        sh("chmod", "0600", config_path)

        # check-config, then the daemon as the shipped unit runs it.
        checked = sh(venv / "bin" / "ficc-executor", "check-config", "--config", config_path)
        assert checked.stdout.splitlines()[-1] == f"{config_path}: ok", checked.stdout
        site = next((venv / "lib").glob("python3*/site-packages"))
        daemon = DaemonProcess(config_path, site, run_dir=base, python=str(venv / "bin" / "python"))
        daemon.start()

        # The first job.
        smoke = sh(venv / "bin" / "ficc-executor", "smoke-test", "--config", config_path, ok=False)
        print(smoke.stdout)
        assert smoke.returncode == 0, smoke.stdout + smoke.stderr + daemon.log()
        assert smoke.stdout.splitlines()[-1] == "smoke test passed"

        assert daemon.stop() == 0, daemon.log()
        daemon = None

        # Uninstalling (section 11), with this installation's paths and accounts.
        sh("umount", mount)
        sh("rm", "-rf", base / "srv", base / "var", base / "run", base / "etc", base / "opt")
        for account in (slot, transport):
            uid = pwd.getpwnam(account).pw_uid
            sh("pkill", "-KILL", "-u", account, ok=False)  # rootless Podman's pause process
            sh("rm", "-rf", f"/run/user/{uid}")
            sh("userdel", account)
        wait_for(lambda: not _processes_of(slot_account.pw_uid), "the killed processes to end")
        left = _leftovers(base, slot_account.pw_uid, installation, (slot, transport))
        assert left == [], left
    finally:
        if daemon is not None:
            daemon.kill()
        subprocess.run(["umount", "-l", str(mount)], capture_output=True, check=False)
        for account in (slot, transport):
            subprocess.run(["pkill", "-KILL", "-u", account], capture_output=True, check=False)
            subprocess.run(["userdel", account], capture_output=True, check=False)
        remove_tree(base)


def _leftovers(
    base: Path, slot_uid: int, installation: str, accounts: tuple[str, ...]
) -> list[str]:
    """What the uninstall left: mounts under `base`, the accounts, their processes and
    runtime directories, cgroups of this installation's attempts."""
    left = [line for line in Path("/proc/self/mountinfo").read_text().splitlines()
            if f" {base}/" in line]  # fmt: skip
    left += [name for name in accounts if _exists(name)]
    left += [f"process {p.pid} {p.info['cmdline']}" for p in _processes_of(slot_uid)]
    left += [f"/run/user/{slot_uid}"] if os.path.exists(f"/run/user/{slot_uid}") else []
    left += [str(p) for p in Path("/sys/fs/cgroup").glob(f"*/ficc/*{installation}*")]
    left += [str(p) for p in Path("/sys/fs/cgroup").glob(f"ficc/*{installation}*")]
    return left


def _processes_of(uid: int) -> list[psutil.Process]:
    """Live (not zombie) processes of `uid`."""
    found = []
    for process in psutil.process_iter(["uids", "status", "cmdline"]):
        if process.info["uids"].real == uid and process.info["status"] != psutil.STATUS_ZOMBIE:
            found.append(process)
    return found


def _exists(name: str) -> bool:
    try:
        pwd.getpwnam(name)
    except KeyError:
        return False
    return True
