"""Build (once) the Debian image that boots real systemd as PID 1 inside Podman.

    python tools/systemd/rootfs.py            # prints the image name

debootstrap takes about a minute, so its result is cached: the tarball lives in
CACHE/<key>/rootfs.tar, where <key> is a digest of everything that decides its
content (suite, variant, mirror, package list, the files written below). A cache
hit only re-imports the tarball into Podman if the image is missing. Delete the
directory to force a rebuild. Why each package is here:
systemd (PID 1), dbus (systemctl talks to it), python3 (the tests and the start
shim), podman + runc (a provider's runtime nested under the attempt's unit),
busybox-static (test images).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import pathlib
import shutil
import subprocess
import sys

CACHE = pathlib.Path(os.environ.get("FICC_SYSTEMD_CACHE", "/var/cache/ficc-systemd-rootfs"))
SUITE = "bookworm"
VARIANT = "minbase"
MIRROR = "http://deb.debian.org/debian"
PACKAGES = sorted(
    [
        "systemd",
        "systemd-sysv",
        "dbus",
        "podman",
        "runc",
        "busybox-static",
        "python3",
        "python3-venv",
        # podman needs a container-network-stack; debootstrap cannot pick a virtual one.
        "containernetworking-plugins",
    ]
)
# Files written into the rootfs after debootstrap (part of the cache key).
FILES = {
    # Podman nested under systemd: crun refuses hybrid cgroups, systemd owns the tree.
    "etc/containers/containers.conf": (
        '[engine]\nruntime = "runc"\ncgroup_manager = "systemd"\nevents_logger = "file"\n'
    ),
    "etc/hostname": "ficc-systemd\n",
    # Empty: systemd generates a fresh machine ID at every boot of the container.
    "etc/machine-id": "",
}
# Units that only slow the boot of a network-less test container, or fail in it.
MASKED = [
    "systemd-networkd-wait-online.service",
    "systemd-timesyncd.service",
    "apt-daily.timer",
    "apt-daily-upgrade.timer",
    "e2scrub_all.timer",
    "fstrim.timer",
    "getty@tty1.service",
    "console-getty.service",
    # Podman's own units fail without containers to manage and mark the boot degraded.
    "podman-auto-update.service",
    "podman-auto-update.timer",
    "podman-restart.service",
]
HOST_PODMAN = ["podman", "--runtime", "runc", "--cgroup-manager=cgroupfs"]


Recipe = dict[str, object]
"""What decides a rootfs: suite, variant, mirror, packages, files, masked units."""
CONTAINER: Recipe = {
    "suite": SUITE,
    "variant": VARIANT,
    "mirror": MIRROR,
    "packages": PACKAGES,
    "files": FILES,
    "masked": MASKED,
}


def cache_key(recipe: Recipe = CONTAINER) -> str:
    return hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:16]


def image_name(key: str) -> str:
    return f"localhost/ficc-systemd:{key}"


def _log(message: str) -> None:
    print(f"rootfs: {message}", file=sys.stderr, flush=True)


def _ensure_debootstrap() -> None:
    if shutil.which("debootstrap"):
        return
    _log("installing debootstrap")
    subprocess.run(["apt-get", "install", "-y", "-q", "debootstrap"], check=True)


def _debootstrap(target: pathlib.Path, recipe: Recipe) -> None:
    _ensure_debootstrap()
    packages = ",".join(recipe["packages"])  # type: ignore[arg-type]
    command = ["debootstrap", f"--variant={recipe['variant']}", f"--include={packages}"]
    subprocess.run([*command, str(recipe["suite"]), str(target), str(recipe["mirror"])], check=True)
    files: dict[str, str] = recipe["files"]  # type: ignore[assignment]
    for name, text in files.items():
        path = target / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    for unit in recipe["masked"]:  # type: ignore[attr-defined]
        link = target / "etc/systemd/system" / unit
        link.unlink(missing_ok=True)
        link.symlink_to("/dev/null")
    subprocess.run(["chroot", str(target), "apt-get", "clean"], check=True)


def build_tarball(key: str, recipe: Recipe = CONTAINER) -> pathlib.Path:
    """CACHE/<key>/rootfs.tar, built atomically (a crash leaves no half tarball)."""
    directory = CACHE / key
    tarball = directory / "rootfs.tar"
    if tarball.exists():
        _log(f"cache hit {tarball}")
        return tarball
    directory.mkdir(parents=True, exist_ok=True)
    work = directory / "rootfs.tmp"
    if work.exists():
        shutil.rmtree(work)
    _log(f"debootstrap {recipe['suite']} into {work} (a minute or more)")
    partial = directory / "rootfs.tar.part"
    try:
        _debootstrap(work, recipe)
        subprocess.run(
            ["tar", "--numeric-owner", "--xattrs", "-C", str(work), "-cf", str(partial), "."],
            check=True,
        )
        os.replace(partial, tarball)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        partial.unlink(missing_ok=True)
    return tarball


def _image_exists(name: str) -> bool:
    result = subprocess.run([*HOST_PODMAN, "image", "exists", name], check=False)
    return result.returncode == 0


def ensure_image() -> str:
    """The Podman image name for the current recipe, building what is missing."""
    key = cache_key()
    name = image_name(key)
    if _image_exists(name):
        return name
    tarball = build_tarball(key)
    _log(f"podman import {tarball} as {name}")
    subprocess.run(
        [
            *HOST_PODMAN,
            "import",
            "--quiet",
            "--change",
            'CMD ["/sbin/init"]',
            "--change",
            "STOPSIGNAL SIGRTMIN+3",
            str(tarball),
            name,
        ],
        check=True,
        stdout=subprocess.DEVNULL,
    )
    return name


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.parse_args()
    print(ensure_image())
    return 0


if __name__ == "__main__":
    sys.exit(main())
