"""`ficc-podman-image ARCHIVE`: the `images[]` entry to pin for an OCI archive.

An administrator brings a real image as an OCI archive (`podman save --format
oci-archive -o IMAGE.oci.tar NAME`, or `skopeo copy docker://... oci-archive:...`
where a registry is reachable), copies it to a root-owned directory on each host and
pins it in the provider's configuration. This prints that entry: the archive's
SHA-256 (checked when the image is loaded into a slot), the image ID (the digest of
the image's config blob, which is the ID Podman gives the loaded image and which
prepare checks after the load), and `digest`, the name plans use in
`job.runtime.image_digest` (the image ID, as everywhere in this project).

It reads the archive's `index.json`, the one manifest it names and that manifest's
config, and nothing else; it needs neither Podman nor root, and loads nothing.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import tarfile
from pathlib import Path
from typing import Any

import msgspec

from ficc_provider_podman.config import Config

MEDIA_INDEX = "application/vnd.oci.image.index.v1+json"
_READ = 1 << 20
_JSON_LIMIT = 1 << 20


class ArchiveRefused(Exception):
    """The file is not a single-image OCI archive; the message says what to do."""


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as file:
        while chunk := file.read(_READ):
            digest.update(chunk)
    return f"sha256:{digest.hexdigest()}"


def _json_member(tar: tarfile.TarFile, name: str) -> Any:
    try:
        member = tar.getmember(name)
    except KeyError:
        raise ArchiveRefused(f"the archive has no {name}") from None
    if not member.isfile() or member.size > _JSON_LIMIT:
        raise ArchiveRefused(f"{name} in the archive is not a small regular file")
    extracted = tar.extractfile(member)
    assert extracted is not None  # a regular member always has a file object
    return json.loads(extracted.read())


def _blob(tar: tarfile.TarFile, digest: str) -> Any:
    algorithm, _, hexdigest = digest.partition(":")
    if algorithm != "sha256" or len(hexdigest) != 64:
        raise ArchiveRefused(f"{digest!r} is not a sha256 digest")
    return _json_member(tar, f"blobs/sha256/{hexdigest}")


def image_id(archive: Path) -> str:
    """The image ID of the one image in the OCI archive at `archive`."""
    try:
        tar = tarfile.open(archive, "r:")  # noqa: SIM115 - closed below
    except (tarfile.TarError, OSError) as error:
        raise ArchiveRefused(f"{archive} is not a tar archive ({error})") from None
    with tar:
        if "oci-layout" not in tar.getnames():
            raise ArchiveRefused(
                f"{archive} is not an OCI archive (no oci-layout); make one with"
                " `podman save --format oci-archive -o FILE IMAGE`"
            )
        manifests = _json_member(tar, "index.json").get("manifests") or []
        if len(manifests) != 1:
            raise ArchiveRefused(
                f"{archive} holds {len(manifests)} images; save exactly one image per archive"
            )
        manifest = _blob(tar, manifests[0]["digest"])
        if manifest.get("mediaType") == MEDIA_INDEX:
            raise ArchiveRefused(
                f"{archive} holds a multi-platform index; save one platform's image"
                " (`podman save` of a pulled image does)"
            )
        config = manifest.get("config", {}).get("digest")
        if not isinstance(config, str):
            raise ArchiveRefused(f"the manifest in {archive} names no config")
        _blob(tar, config)  # present, and a small JSON document
        return config


def entry(archive: Path) -> dict[str, str]:
    """The `images[]` entry for `archive` (an absolute path, as the configuration needs),
    checked against the provider's own configuration rules."""
    path = archive.absolute()
    found = image_id(path)
    made = {
        "digest": found,
        "archive": str(path),
        "archive_sha256": sha256_file(path),
        "image_id": found,
    }
    msgspec.convert({"images": [made]}, Config)
    return made


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="ficc-podman-image",
        description=__doc__.split("\n\n")[1] if __doc__ else None,
    )
    parser.add_argument("archive", type=Path, help="an OCI archive file (one image)")
    args = parser.parse_args(argv)
    try:
        print(json.dumps(entry(args.archive), indent=2))
    except (ArchiveRefused, OSError, ValueError) as error:
        print(f"image_archive: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
