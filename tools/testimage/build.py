"""Build the test image without a registry: static busybox -> rootfs -> podman.

    python tools/testimage/build.py --out DIR [--tag localhost/ficc-test:1]

Writes DIR/ficc-test.oci.tar (an OCI archive) and prints a JSON line with the
archive's SHA-256 and the image ID, the two values an administrator pins in the
Podman provider's configuration. The rootfs holds only /bin/busybox (static, from
Debian's busybox-static) and its applet links, so the image is small, needs no
dynamic loader. The rootfs layer is byte-identical for the same busybox (fixed
mtimes and owners), but `podman import` stamps the image config with the time of
the build, so the image ID and the archive's SHA-256 change with every build: pin
the values this command prints for the archive you actually ship. The image is removed
from root's Podman store again once the archive is written.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import pathlib
import shutil
import subprocess
import sys
import tarfile
from collections.abc import Sequence

BUSYBOX = pathlib.Path("/bin/busybox")
APPLETS = [
    "sh",
    "cat",
    "echo",
    "sleep",
    "ls",
    "head",
    "true",
    "false",
    "id",
    "wc",
    "sha256sum",
    "dd",
    "tr",
    "env",
    "kill",
    "yes",
    "seq",
    "printf",
    "test",
    "mkdir",
    "cp",
    "rm",
]
PODMAN = ["podman", "--runtime", "runc", "--cgroup-manager=cgroupfs"]
# A fixed mtime keeps the layer bytes, and so the image ID, stable across builds.
EPOCH = 0


def _add(
    tar: tarfile.TarFile, name: str, *, kind: bytes, mode: int, data: bytes = b"", link: str = ""
) -> None:
    info = tarfile.TarInfo(name)
    info.type = kind
    info.mode = mode
    info.mtime = EPOCH
    info.uid = info.gid = 0
    info.linkname = link
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data) if data else None)


def rootfs_tar(extra: Sequence[pathlib.Path] = ()) -> bytes:
    """The rootfs as deterministic tar bytes; `extra`: host files copied in at their own
    paths (their content, links followed), such as the C library a host program needs."""
    if not BUSYBOX.is_file():
        raise SystemExit("needs /bin/busybox: apt-get install busybox-static")
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as tar:
        top = ["bin", "dev", "etc", "proc", "sys", "tmp", "work", "inputs", "outputs"]
        relative = [pathlib.PurePath(path).relative_to("/") for path in extra]
        parents = {str(parent) for path in relative for parent in path.parents} - {".", *top}
        for d in [*top, *sorted(parents)]:  # the same bytes as before when nothing is added
            _add(tar, d, kind=tarfile.DIRTYPE, mode=0o755)
        for path in extra:
            data = pathlib.Path(path).read_bytes()
            _add(tar, str(pathlib.PurePath(path).relative_to("/")), kind=tarfile.REGTYPE,
                 mode=0o755, data=data)  # fmt: skip
        _add(tar, "bin/busybox", kind=tarfile.REGTYPE, mode=0o755, data=BUSYBOX.read_bytes())
        for applet in APPLETS:
            _add(tar, f"bin/{applet}", kind=tarfile.SYMTYPE, mode=0o777, link="busybox")
        _add(
            tar, "etc/passwd", kind=tarfile.REGTYPE, mode=0o644, data=b"root:x:0:0:root:/:/bin/sh\n"
        )
        _add(tar, "etc/group", kind=tarfile.REGTYPE, mode=0o644, data=b"root:x:0:\n")
    return out.getvalue()


def build(out_dir: pathlib.Path, tag: str, extra: Sequence[pathlib.Path] = ()) -> dict[str, str]:
    out_dir.mkdir(parents=True, exist_ok=True)
    rootfs = out_dir / "rootfs.tar"
    rootfs.write_bytes(rootfs_tar(extra))
    subprocess.run(
        [*PODMAN, "import", "--change", 'CMD ["/bin/sh"]', str(rootfs), tag],
        check=True,
        stdout=subprocess.DEVNULL,
    )
    archive = out_dir / "ficc-test.oci.tar"
    archive.unlink(missing_ok=True)
    subprocess.run(
        [*PODMAN, "save", "--format", "oci-archive", "-o", str(archive), tag], check=True
    )
    try:
        image_id = subprocess.run(
            [*PODMAN, "image", "inspect", "--format", "{{.Id}}", tag],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()
    finally:
        # The archive is the product: leave nothing in root's own Podman store.
        subprocess.run([*PODMAN, "rmi", "--force", tag], check=False, capture_output=True)
    digest = hashlib.sha256(archive.read_bytes()).hexdigest()
    rootfs.unlink()
    return {
        "archive": str(archive),
        "archive_sha256": f"sha256:{digest}",
        "image_id": f"sha256:{image_id}",
        "tag": tag,
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=pathlib.Path, required=True)
    parser.add_argument("--tag", default="localhost/ficc-test:1")
    args = parser.parse_args()
    if shutil.which("podman") is None:
        print("needs podman: apt-get install podman runc", file=sys.stderr)
        return 2
    print(json.dumps(build(args.out, args.tag)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
