"""The machine side of the demo: accounts, directories, wheels, the pinned provider,
the test image, the configuration file, and cleaning up after a previous run.

Everything here runs as root, creates only what the demo owns (two `ficc-demo-*`
system accounts, one directory under /run/ficc-demo) and refuses to go on with a
message saying what to install or fix when something is missing.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil

from demo.config import SLOT_STORAGE_BYTES, SLOT_STORAGE_INODES, Image
from demo.layout import DISK_BASE, IMAGE_TAG, PROVIDER, RunLayout
from ficc.execution.host.cli import provision
from ficc.execution.host.service.cgroupfs import CgroupfsService
from ficc_testkit.accounts import Account, create_account, lookup

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ["ficc-protocol", "ficc-provider-sdk", "ficc-executor-host", "ficc-provider-podman"]
PROVIDER_PACKAGE = "ficc-provider-podman"
SERVICE_BASE = "ficc"
"""The cgroupfs service backend's directory in each hierarchy (CgroupfsService default)."""


class SetupFailed(Exception):
    """A precondition or a set-up step failed; the message says what to do."""


def run(command: list[str], what: str, **kwargs: Any) -> subprocess.CompletedProcess[str]:
    """Run a command; on failure raise SetupFailed with its output."""
    result = subprocess.run(command, capture_output=True, text=True, check=False, **kwargs)
    if result.returncode != 0:
        output = (result.stdout + result.stderr).strip()[-4000:]
        raise SetupFailed(f"{what} failed ({' '.join(command)}):\n{output}")
    return result


# --- preconditions --------------------------------------------------------------------------


def check_machine() -> list[str]:
    """What the demo needs on this machine; returns the tools found, raises otherwise."""
    if os.geteuid() != 0:
        raise SetupFailed(
            "run the demo as root (`tools/dev demo`): it creates system accounts, cgroups "
            "and a root-owned directory under /run, and starts the daemon as root"
        )
    needs = {
        "podman": "apt-get install podman",
        "runc": "apt-get install runc",
        "cc": "apt-get install gcc libc6-dev (the provider's barrier is compiled at build)",
        "useradd": "apt-get install passwd",
    }
    missing = [f"{tool}: {fix}" for tool, fix in needs.items() if shutil.which(tool) is None]
    if not Path("/bin/busybox").is_file():
        missing.append("/bin/busybox: apt-get install busybox-static (the test image)")
    if missing:
        raise SetupFailed("missing on this machine:\n  " + "\n  ".join(missing))
    return [*needs, "busybox"]


# --- accounts -------------------------------------------------------------------------------


def ensure_account(name: str) -> tuple[Account, bool]:
    """The system account `name`, created (no home, no login shell) if missing."""
    account, created = lookup(name), False
    if account is None:
        try:
            account, created = create_account(name), True
        except AssertionError as exc:  # useradd failed for 30 s (the passwd lock is held)
            raise SetupFailed(f"useradd {name} failed: {exc}") from None
    if account.uid == 0 or account.gid == 0:
        raise SetupFailed(f"account {name} has UID or GID 0; remove it and run again")
    return account, created


# --- a previous run ---------------------------------------------------------------------------


def clean_previous_runs(base: Path, slot: Account) -> list[str]:
    """Stop what a previous run may have left and remove its directory; say what was done.

    A finished run leaves no process behind; this handles an interrupted one: its
    daemon (from the pid file, only if its command line names that run's config), any
    process of the demo's slot account, and the cgroups of its attempts.
    """
    done: list[str] = []
    for old in _run_directories(base):
        layout = RunLayout(old)
        pid = _previous_daemon(layout)
        if pid is not None:
            os.kill(pid, signal.SIGTERM)
            if not _wait_gone(pid, 30):
                os.kill(pid, signal.SIGKILL)
            done.append(f"stopped the daemon of {old} (pid {pid})")
        killed = kill_processes_of(slot.uid)
        if killed:
            done.append(f"killed {killed} leftover process(es) of {slot.name}")
        removed = remove_services(_installation_id(layout))
        if removed:
            done.append(f"removed {removed} leftover attempt service(s)")
        if os.path.ismount(layout.slot_dir):
            provision.remove_slot(str(layout.slot_dir))
            done.append(f"unmounted the slot filesystem {layout.slot_dir}")
        _remove(old)
        done.append(f"removed {old}")
    for old in _run_directories(DISK_BASE):  # slot images (see RunLayout.slot_image)
        _remove(old)
        done.append(f"removed {old}")
    return done


def _run_directories(base: Path) -> list[Path]:
    if not base.is_dir():
        return []
    return sorted(p for p in base.iterdir() if p.is_dir() and not p.is_symlink())


def _remove(path: Path) -> None:
    # Podman's overlay storage has directories without permissions: rm as root.
    run(["rm", "-rf", "--one-file-system", str(path)], f"removing {path}")


def _previous_daemon(layout: RunLayout) -> int | None:
    try:
        pid = int(layout.daemon_pid.read_text().strip())
        process = psutil.Process(pid)
        if str(layout.config_file) in process.cmdline():
            return pid
    except (OSError, ValueError, psutil.Error):
        pass
    return None


def _wait_gone(pid: int, timeout: float) -> bool:
    with contextlib.suppress(psutil.Error):
        psutil.Process(pid).wait(timeout)
        return True
    return not psutil.pid_exists(pid)


def _installation_id(layout: RunLayout) -> str | None:
    try:
        return str(json.loads(layout.config_file.read_text())["installation_id"])
    except (OSError, ValueError, KeyError):
        return None


def processes_of(uid: int) -> list[psutil.Process]:
    """Live processes whose real UID is `uid` (zombies excluded)."""
    found = []
    for process in psutil.process_iter(["uids", "status"]):
        with contextlib.suppress(psutil.Error, TypeError, AttributeError):
            if process.info["uids"].real == uid and process.info["status"] != "zombie":
                found.append(process)
    return found


def kill_processes_of(uid: int) -> int:
    """SIGKILL every process of the demo's slot account (only the demo uses it)."""
    victims = processes_of(uid)
    for process in victims:
        with contextlib.suppress(psutil.Error):
            process.kill()
    psutil.wait_procs(victims, timeout=10)
    return len(victims)


def services_of(installation_id: str, service: CgroupfsService | None = None) -> list[str]:
    """Names of the attempt services (cgroups) of an installation that exist now."""
    service = service or CgroupfsService(SERVICE_BASE)
    prefix = f"ficc-work-{installation_id}-"
    names: set[str] = set()
    for hierarchy in service.layout.hierarchies:
        top = Path(hierarchy.mount, SERVICE_BASE)
        if top.is_dir():
            names |= {p.name for p in top.iterdir() if p.name.startswith(prefix)}
    return sorted(names)


def remove_services(installation_id: str | None) -> int:
    """Stop and remove attempt services (cgroups) an interrupted run left behind."""
    if installation_id is None:
        return 0
    service = CgroupfsService(SERVICE_BASE)
    names = services_of(installation_id, service)
    for name in names:
        handle = service.adopt(name)
        if handle is not None:
            service.stop(handle)
            service.remove(handle)
    return len(names)


# --- this run's directories -------------------------------------------------------------------


def make_directories(layout: RunLayout, transport: Account) -> None:
    """Every directory of the run with the owner and mode the daemon checks."""
    os.umask(0o022)
    for path in (layout.root.parent, layout.root):
        path.mkdir(mode=0o755, exist_ok=True)
        os.chown(path, 0, 0)
        os.chmod(path, 0o755)
    modes = {
        layout.config_dir: 0o755,
        layout.state_dir: 0o700,
        layout.socket_dir: 0o711,
        layout.slot_dir.parent: 0o755,
        layout.wheel_dir: 0o755,
        layout.image_dir: 0o755,
        layout.controller_dir: 0o700,
    }
    for path, mode in modes.items():
        path.mkdir(mode=mode)
        os.chmod(path, mode)
    os.chown(layout.controller_dir, transport.uid, transport.gid)


def make_slot(layout: RunLayout) -> provision.Provisioned:
    """The slot's own filesystem: an image under DISK_BASE, loop-mounted on slot_dir by
    the same code as `ficc-executor provision-slot`."""
    layout.slot_image.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    return provision.create_image_slot(
        str(layout.slot_image),
        str(layout.slot_dir),
        SLOT_STORAGE_BYTES,
        SLOT_STORAGE_INODES,
    )


# --- wheels and the pinned provider -----------------------------------------------------------


def build_wheels(layout: RunLayout) -> dict[str, Path]:
    """Wheels of the four distributions, built by hatchling from copies of the sources.

    Copies, so that compiling the provider's barrier never rewrites a file in the
    repository that a running test may be using.
    """
    wheels: dict[str, Path] = {}
    sources = layout.root / "sources"
    for name in PACKAGES:
        source = sources / name
        shutil.copytree(
            REPO / "packages" / name,
            source,
            ignore=shutil.ignore_patterns("__pycache__", "_bin", ".pytest_cache", "*.egg-info"),
        )
        before = set(layout.wheel_dir.glob("*.whl"))
        command = [sys.executable, "-m", "hatchling", "build", "-t", "wheel"]
        run([*command, "-d", str(layout.wheel_dir)], f"building the {name} wheel", cwd=source)
        (wheel,) = set(layout.wheel_dir.glob("*.whl")) - before
        wheels[name] = wheel
    return wheels


def install_provider(layout: RunLayout, wheel: Path) -> Path:
    """pip install the provider wheel into the run's root-owned prefix; its site dir.

    Never editable (the daemon refuses that), never `pip --target`; `--ignore-installed`
    because the demo's own environment has an editable copy that pip must not touch.
    """
    command = [sys.executable, "-m", "pip", "--disable-pip-version-check", "install", "-q"]
    command += ["--no-deps", "--no-index", "--ignore-installed"]
    command += ["--prefix", str(layout.provider_prefix), str(wheel)]
    run(command, "installing the provider wheel", umask=0o022)
    sites = [
        p.parent
        for p in layout.provider_prefix.glob("**/ficc_provider_podman")
        if p.parent.name in {"site-packages", "dist-packages"}
    ]
    if len(sites) != 1:
        raise SetupFailed(f"cannot find the provider in {layout.provider_prefix}: {sites}")
    return sites[0]


def provider_digest(site: Path) -> str:
    """The digest to pin, as an administrator gets it: `provider-digest podman`."""
    command = [sys.executable, "-m", "ficc.execution", "provider-digest", PROVIDER]
    result = run([*command, "--path", str(site), "--quiet"], "computing the provider pin")
    return result.stdout.strip()


# --- the test image ---------------------------------------------------------------------------


def build_image(layout: RunLayout) -> Image:
    """tools/testimage/build.py: static busybox -> OCI archive, no registry involved."""
    spec = importlib.util.spec_from_file_location(
        "ficc_testimage", REPO / "tools" / "testimage" / "build.py"
    )
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    log = layout.image_dir / "build.log"
    try:
        with _output_to(log):  # Podman's progress lines go to the log, not the screen
            built = module.build(layout.image_dir, IMAGE_TAG)
    except subprocess.CalledProcessError as exc:
        raise SetupFailed(f"building the test image failed: {exc}; see {log}") from None
    finally:
        # root's copy is not needed: the provider loads the archive as the slot account
        subprocess.run(["podman", "rmi", "-f", IMAGE_TAG], capture_output=True, check=False)
    archive = Path(built["archive"])
    os.chmod(archive, 0o644)
    return Image(str(archive), built["archive_sha256"], built["image_id"])


@contextlib.contextmanager
def _output_to(path: Path) -> Iterator[None]:
    """Send this process's stdout and stderr (so its children's too) to a file."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for descriptor in (fd, *saved):
            os.close(descriptor)


# --- the configuration file -------------------------------------------------------------------


def write_config(layout: RunLayout, document: dict[str, Any]) -> None:
    """The administrator's file: root-owned, mode 0600, one link, JSON."""
    fd = os.open(layout.config_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as out:
        json.dump(document, out, indent=2)
        out.write("\n")
