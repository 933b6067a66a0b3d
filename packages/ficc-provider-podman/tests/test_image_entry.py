"""`ficc-podman-image ARCHIVE`: the configuration entry of a real OCI archive."""

from __future__ import annotations

import io
import json
import secrets
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from ficc_provider_podman import image_entry
from harness import build_image


@pytest.mark.podman("builds the test image with podman")
def test_the_entry_of_a_saved_image_is_what_podman_loads(tmp_path: Path) -> None:
    """The archive's SHA-256 and the image ID computed from the archive alone are the
    ones Podman reports for the image it saved; the builder leaves nothing in root's
    Podman store."""
    tag = f"localhost/ficc-entry-{secrets.token_hex(4)}:1"
    built = build_image(tmp_path / "image", tag)
    archive = Path(built["archive"])
    assert image_entry.entry(archive) == {
        "digest": built["image_id"],
        "archive": str(archive),
        "archive_sha256": built["archive_sha256"],
        "image_id": built["image_id"],
    }
    left = subprocess.run(["podman", "image", "exists", tag], check=False)
    assert left.returncode == 1, f"{tag} was left in root's Podman store"
    shown = subprocess.run(
        [str(Path(sys.executable).parent / "ficc-podman-image"), str(archive)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert shown.returncode == 0, shown.stderr
    assert json.loads(shown.stdout)["image_id"] == built["image_id"]


def _tar(path: Path, members: dict[str, bytes]) -> Path:
    with tarfile.open(path, "w") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def test_a_file_that_is_not_an_oci_archive_is_refused_with_what_to_do(tmp_path: Path) -> None:
    plain = tmp_path / "plain.txt"
    plain.write_text("not a tar")
    with pytest.raises(image_entry.ArchiveRefused, match="not a tar archive"):
        image_entry.image_id(plain)
    docker = _tar(tmp_path / "docker.tar", {"manifest.json": b"[]"})
    with pytest.raises(image_entry.ArchiveRefused, match="podman save --format oci-archive"):
        image_entry.image_id(docker)


def test_an_archive_of_two_images_is_refused(tmp_path: Path) -> None:
    index = {"manifests": [{"digest": "sha256:" + "a" * 64}, {"digest": "sha256:" + "b" * 64}]}
    two = _tar(
        tmp_path / "two.tar",
        {"oci-layout": b'{"imageLayoutVersion":"1.0.0"}', "index.json": json.dumps(index).encode()},
    )
    with pytest.raises(image_entry.ArchiveRefused, match="holds 2 images"):
        image_entry.image_id(two)
    assert image_entry.main([str(two)]) == 1
