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

It trusts nothing it reads, because the image ID it prints is pinned on every host and
an archive that does not hold what it claims would only fail later, at `podman load`
in a job's prepare. Each of those files must be a regular member of at most 1 MiB,
each blob is named by a `sha256:` digest of 64 lowercase hex digits and its bytes must
hash to that digest (so the printed image ID is the SHA-256 of the config actually in
the archive), and each JSON document is decoded into a typed structure after a scan
that bounds its nesting. Whatever is wrong, the command prints one `image_archive:`
line saying what and what to do, and exits with status 1.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import posixpath
import re
import sys
import tarfile
from pathlib import Path
from typing import TypeVar

import msgspec

from ficc_provider_podman.config import Config

MEDIA_INDEX = "application/vnd.oci.image.index.v1+json"
_MEDIA_LISTS = frozenset({MEDIA_INDEX, "application/vnd.docker.distribution.manifest.list.v2+json"})
_READ = 1 << 20
_JSON_LIMIT = 1 << 20
_DEPTH_LIMIT = 64
_DIGEST = re.compile(r"sha256:[0-9a-f]{64}")
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_NOT_BRACKETS = bytes(byte for byte in range(256) if byte not in b"[]{}")
_RESAVE = "re-save the image with `podman save --format oci-archive -o FILE IMAGE`"

_T = TypeVar("_T")


class ArchiveRefused(Exception):
    """The file is not a single-image OCI archive; the message says what to do."""


class Descriptor(msgspec.Struct):
    """An OCI descriptor, reduced to what names the blob and says what it is."""

    digest: str
    media_type: str | None = msgspec.field(default=None, name="mediaType")


class Index(msgspec.Struct):
    """`index.json`: the manifests the archive holds (one, for an entry)."""

    manifests: list[Descriptor]


class Manifest(msgspec.Struct):
    """An image manifest, reduced to its config; optional fields so that an index
    saved in its place is refused for what it is rather than for a missing config."""

    media_type: str | None = msgspec.field(default=None, name="mediaType")
    config: Descriptor | None = None


class ImageConfig(msgspec.Struct):
    """An image config: only its digest matters here, so any JSON object will do."""


_WHAT: dict[type, str] = {
    Index: "image index",
    Manifest: "image manifest",
    ImageConfig: "image config",
}


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as file:
        while chunk := file.read(_READ):
            digest.update(chunk)
    return f"sha256:{digest.hexdigest()}"


def _shown(value: str) -> str:
    """A hostile digest may be a megabyte of anything: show its start, escaped."""
    return repr(value[:80]) + ("..." if len(value) > 80 else "")


def _too_deep(data: bytes) -> bool:
    """Whether `data` nests `[`/`{` deeper than the limit outside strings; checked before
    decoding, since the decoder recurses (even over fields it skips)."""
    depth = 0
    for byte in _STRING.sub(b"", data).translate(None, _NOT_BRACKETS):
        depth += 1 if byte in b"[{" else -1
        if depth > _DEPTH_LIMIT:
            return True
    return False


def _kind(member: tarfile.TarInfo) -> str:
    """What a member that is not a regular file is, for the message."""
    if member.issym():
        return "symbolic link"
    if member.islnk():
        return "hard link"
    if member.isdir():
        return "directory"
    if member.isdev():
        return "device or FIFO"
    return "special member"


class _Reader:
    """Reads members of one open archive, refusing any it cannot vouch for."""

    def __init__(self, tar: tarfile.TarFile, archive: Path) -> None:
        self.tar = tar
        self.archive = archive

    def refuse(self, name: str, problem: str) -> ArchiveRefused:
        return ArchiveRefused(f"{name} in {self.archive} {problem}; {_RESAVE}")

    def member(self, name: str) -> bytes:
        """The bytes of the one regular, small member called `name`."""
        try:
            member = self.tar.getmember(name)
        except KeyError:
            raise ArchiveRefused(f"{self.archive} has no {name}; {_RESAVE}") from None
        copies = sum(posixpath.normpath(m.name) == name for m in self.tar.getmembers())
        if copies > 1:
            raise self.refuse(name, f"appears {copies} times, and a load may take another")
        if not member.isfile():
            raise self.refuse(name, f"is a {_kind(member)}, not a regular file")
        if member.size > _JSON_LIMIT:
            raise self.refuse(name, f"is {member.size} bytes, more than {_JSON_LIMIT}")
        extracted = self.tar.extractfile(member)
        assert extracted is not None  # a regular member always has a file object
        with extracted:
            return extracted.read()

    def document(self, name: str, data: bytes, kind: type[_T]) -> _T:
        """`data` decoded as `kind`, its nesting bounded first."""
        what = _WHAT.get(kind, "document")
        if _too_deep(data):
            raise self.refuse(name, f"nests deeper than {_DEPTH_LIMIT} levels, as no {what} does")
        try:
            return msgspec.json.decode(data, type=kind)
        except msgspec.ValidationError as error:
            raise self.refuse(name, f"is not a valid OCI {what} ({error})") from None
        except (msgspec.DecodeError, RecursionError) as error:
            raise self.refuse(name, f"is not JSON ({error})") from None

    def blob(self, descriptor: Descriptor, named_by: str, kind: type[_T]) -> _T:
        """The blob `descriptor` names, once its bytes hash to the digest it is named by."""
        if not _DIGEST.fullmatch(descriptor.digest):
            raise ArchiveRefused(
                f"{named_by} in {self.archive} names the blob {_shown(descriptor.digest)},"
                f" not a `sha256:` digest of 64 lowercase hex digits; {_RESAVE}"
            )
        name = f"blobs/sha256/{descriptor.digest.removeprefix('sha256:')}"
        data = self.member(name)
        actual = f"sha256:{hashlib.sha256(data).hexdigest()}"
        if actual != descriptor.digest:
            raise ArchiveRefused(
                f"{name} in {self.archive} hashes to {actual}, not the digest {named_by}"
                " names: the archive is damaged or was altered; copy it again from where"
                f" it was saved, or {_RESAVE}"
            )
        return self.document(name, data, kind)


def _multi_platform(archive: Path) -> ArchiveRefused:
    return ArchiveRefused(
        f"{archive} holds a multi-platform index; save one platform's image"
        " (`podman save` of a pulled image does)"
    )


def _config_digest(reader: _Reader) -> str:
    """The verified digest of the config of the one image `reader`'s archive holds."""
    archive = reader.archive
    if "oci-layout" not in reader.tar.getnames():
        raise ArchiveRefused(
            f"{archive} is not an OCI archive (no oci-layout); make one with"
            " `podman save --format oci-archive -o FILE IMAGE`"
        )
    index = reader.document("index.json", reader.member("index.json"), Index)
    if len(index.manifests) != 1:
        raise ArchiveRefused(
            f"{archive} holds {len(index.manifests)} images; save exactly one image per archive"
        )
    if index.manifests[0].media_type in _MEDIA_LISTS:
        raise _multi_platform(archive)
    manifest = reader.blob(index.manifests[0], "index.json", Manifest)
    if manifest.media_type in _MEDIA_LISTS:
        raise _multi_platform(archive)
    if manifest.config is None:
        raise ArchiveRefused(f"the manifest in {archive} names no config; {_RESAVE}")
    reader.blob(manifest.config, "the manifest", ImageConfig)
    return manifest.config.digest


def image_id(archive: Path) -> str:
    """The image ID of the one image in the OCI archive at `archive`, verified against
    the bytes in the archive."""
    try:
        tar = tarfile.open(archive, "r:")  # noqa: SIM115 - closed below
    except OSError as error:
        raise ArchiveRefused(f"{archive} cannot be read ({error}); name the archive file") from None
    except tarfile.TarError as error:
        raise ArchiveRefused(
            f"{archive} is not a tar archive ({error}); make one with"
            " `podman save --format oci-archive -o FILE IMAGE`"
        ) from None
    with tar:
        try:
            return _config_digest(_Reader(tar, archive))
        except (tarfile.TarError, OSError) as error:
            raise ArchiveRefused(
                f"{archive} is a damaged tar archive ({error}); copy it again, or {_RESAVE}"
            ) from None


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
    try:
        msgspec.convert({"images": [made]}, Config)
    except msgspec.ValidationError as error:
        raise ArchiveRefused(
            f"the configuration cannot name {path} ({error}); move the archive to a path of"
            " at most 4096 characters without a newline"
        ) from None
    return made


def _refuse(message: str) -> int:
    """Print `message` as the one `image_archive:` line a refusal gets."""
    print("image_archive: " + " ".join(message.splitlines()), file=sys.stderr)
    return 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="ficc-podman-image",
        description=__doc__.split("\n\n")[1] if __doc__ else None,
    )
    parser.add_argument("archive", type=Path, help="an OCI archive file (one image)")
    parser.add_argument(
        "--format", choices=("toml", "json"), default="toml",
        help="print the entry for a TOML (default) or a JSON configuration file",
    )  # fmt: skip
    args = parser.parse_args(argv)
    try:
        made = entry(args.archive)
    except ArchiveRefused as error:
        return _refuse(str(error))
    except Exception as error:  # a hostile archive may make tarfile raise anything
        return _refuse(
            f"{args.archive} cannot be read as an OCI archive ({type(error).__name__}:"
            f" {error}); copy it again, or {_RESAVE}"
        )
    print(shown_entry(made, args.format))
    return 0


def shown_entry(made: dict[str, str], form: str) -> str:
    """The entry as the configuration file writes it: in TOML, a table of the provider's
    `images` array, to paste below the provider's `[[providers]]` table (as
    docs/configuration.md shows); in JSON, an object for its `images` list."""
    if form == "json":
        return json.dumps(made, indent=2)
    # JSON's string escapes are TOML's too, except that TOML also wants DEL escaped
    values = [f"{k} = {json.dumps(v, ensure_ascii=False)}" for k, v in made.items()]
    return "\n".join(["[[providers.configuration.images]]", *values]).replace("\x7f", "\\u007f")


if __name__ == "__main__":
    raise SystemExit(main())
