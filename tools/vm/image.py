"""Build (once) what the VM lane boots: a Debian 12 disk image, its kernel and initramfs.

    python tools/vm/image.py            # prints the cache directory

The guest is a production host in miniature: Debian 12 with systemd as PID 1 and
Debian's own kernel, which mounts one unified cgroup v2 tree with every controller.
Its root filesystem comes from the same debootstrap recipe as the systemd container
suite (tools/systemd/rootfs.py) plus what a real machine has and a container lacks:
the kernel and its modules (`linux-image-amd64`, whose initramfs is generated inside
the rootfs), `kmod` and `udev` (so loop, overlay and the virtio drivers load on
demand, as on any host).

Everything is cached under CACHE/<key>/, where <key> digests the recipe and the few
files written here: `root.img` (raw ext4, never booted itself: each run boots a copy),
`vmlinuz` and `initrd.img`. Delete the directory to force a rebuild.

The image carries one unit of its own, `ficc-vm-driver.service`: at each boot it
unpacks the run's inputs from the third disk (a tar archive written by the host on
/dev/vdb) and runs the phase named on the kernel command line (`ficc.phase=NAME`),
its output on the serial console. Everything else a run needs comes with that
archive, so changing the project never rebuilds the image.
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
import tarfile
import tempfile

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "systemd"))
import rootfs

CACHE = pathlib.Path(os.environ.get("FICC_VM_CACHE", "/var/cache/ficc-vm"))
IMAGE_BYTES = 6 * 1024**3
GUEST_DIR = "/run/ficc-vm"
"""Where the guest unpacks the run's inputs at each boot."""
UNPACK_AND_RUN = (
    f"/bin/sh -c 'rm -rf {GUEST_DIR} && mkdir -p {GUEST_DIR}"
    f" && tar -xf /dev/vdb -C {GUEST_DIR}"
    f" && exec /bin/sh {GUEST_DIR}/tools/vm/guest/driver.sh; systemctl poweroff'"
)
"""The lane's inputs are a tar archive written raw on the second disk."""
DRIVER_UNIT = f"""\
[Unit]
Description=ficc VM lane: run the phase the host asked for
After=multi-user.target
ConditionKernelCommandLine=ficc.phase

[Service]
Type=oneshot
ExecStart={UNPACK_AND_RUN}
StandardOutput=tty
StandardError=tty
TTYPath=/dev/ttyS0
TimeoutStartSec=infinity

[Install]
WantedBy=multi-user.target
"""
VM_FILES = {
    "etc/hostname": "ficc-vm\n",
    "etc/fstab": "/dev/vda / ext4 defaults,errors=remount-ro 0 1\n",
    "etc/machine-id": "",
    "etc/systemd/system/ficc-vm-driver.service": DRIVER_UNIT,
    "etc/systemd/system/multi-user.target.wants/ficc-vm-driver.service": "",
}
VM_RECIPE: rootfs.Recipe = {
    **rootfs.CONTAINER,
    "packages": sorted({*rootfs.PACKAGES, "linux-image-amd64", "kmod", "udev", "e2fsprogs"}),
    # The serial console carries the lane's own output: no login prompt on it.
    "masked": sorted({*rootfs.MASKED, "serial-getty@ttyS0.service", "getty.target"}),
    "files": {
        # The container recipe's containers.conf is for nested Podman on a hybrid
        # host; a real host keeps Debian's defaults.
        name: text
        for name, text in rootfs.FILES.items()
        if name != "etc/containers/containers.conf"
    },
}


def _log(message: str) -> None:
    print(f"vm-image: {message}", file=sys.stderr, flush=True)


def cache_key() -> str:
    recipe = {"rootfs": rootfs.cache_key(VM_RECIPE), "files": VM_FILES, "bytes": IMAGE_BYTES}
    return hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:16]


def _write_files(root: pathlib.Path) -> None:
    for name, text in VM_FILES.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.is_symlink() or path.exists():
            path.unlink()
        if name.endswith(".wants/ficc-vm-driver.service"):
            path.symlink_to("/etc/systemd/system/ficc-vm-driver.service")
        else:
            path.write_text(text)


def _kernel_files(root: pathlib.Path, target: pathlib.Path) -> None:
    """The newest kernel and initramfs in the rootfs's /boot, as vmlinuz / initrd.img."""
    kernels = sorted((root / "boot").glob("vmlinuz-*"))
    if not kernels:
        raise SystemExit("the VM rootfs has no kernel in /boot (linux-image-amd64 missing?)")
    version = kernels[-1].name.removeprefix("vmlinuz-")
    initrd = root / "boot" / f"initrd.img-{version}"
    if not initrd.exists():
        raise SystemExit(f"the VM rootfs has no initramfs for {version}")
    shutil.copyfile(kernels[-1], target / "vmlinuz")
    shutil.copyfile(initrd, target / "initrd.img")
    (target / "kernel-version").write_text(version + "\n")


def ensure() -> pathlib.Path:
    """CACHE/<key>/ with root.img, vmlinuz and initrd.img, building what is missing."""
    key = cache_key()
    directory = CACHE / key
    if (directory / "root.img").exists():
        return directory
    tarball = rootfs.build_tarball(rootfs.cache_key(VM_RECIPE), VM_RECIPE)
    directory.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="ficc-vm-rootfs-", dir=directory) as scratch:
        root = pathlib.Path(scratch) / "root"
        root.mkdir()
        _log(f"unpacking {tarball}")
        with tarfile.open(tarball) as archive:
            archive.extractall(root, numeric_owner=True, filter="fully_trusted")
        _write_files(root)
        _kernel_files(root, directory)
        partial = directory / "root.img.part"
        partial.unlink(missing_ok=True)
        _log(f"mkfs.ext4 -d (a {IMAGE_BYTES >> 30} GiB image)")
        size = f"{IMAGE_BYTES // 1024}k"
        subprocess.run(
            ["mkfs.ext4", "-q", "-F", "-L", "ficc-vm-root", "-d", str(root), str(partial), size],
            check=True,
        )
        os.replace(partial, directory / "root.img")
    return directory


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.parse_args()
    print(ensure())
    return 0


if __name__ == "__main__":
    sys.exit(main())
