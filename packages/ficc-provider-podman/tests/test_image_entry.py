"""`ficc-podman-image ARCHIVE`: the configuration entry of a real OCI archive."""

from __future__ import annotations

import hashlib
import io
import json
import secrets
import subprocess
import sys
import tarfile
import tomllib
from collections.abc import Callable
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
    (printed,) = tomllib.loads(shown.stdout)["providers"]["configuration"]["images"]
    assert printed["image_id"] == built["image_id"]


def _tar(path: Path, members: dict[str, bytes | tarfile.TarInfo]) -> Path:
    """A tar of `members`: bytes are regular files, a TarInfo is added as it is."""
    with tarfile.open(path, "w") as tar:
        for name, data in members.items():
            if isinstance(data, tarfile.TarInfo):
                data.name = name
                tar.addfile(data)
                continue
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


LAYOUT = b'{"imageLayoutVersion":"1.0.0"}'
MEDIA_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
CONFIG = json.dumps(
    {"architecture": "amd64", "os": "linux", "rootfs": {"type": "layers", "diff_ids": []}}
).encode()
DEEP = b"[" * 400_000 + b"]" * 400_000


def _digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def _blob(digest: str) -> str:
    return "blobs/" + digest.replace(":", "/")


def _manifest(config_digest: str, **extra: object) -> bytes:
    config = {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": config_digest}
    manifest = {"schemaVersion": 2, "mediaType": MEDIA_MANIFEST, "config": config}
    return json.dumps(manifest | extra).encode()


def _index(manifest_digest: str) -> bytes:
    entry = {"mediaType": MEDIA_MANIFEST, "digest": manifest_digest, "size": 1}
    return json.dumps({"schemaVersion": 2, "manifests": [entry]}).encode()


MANIFEST = _manifest(_digest(CONFIG))


def _archive(
    path: Path,
    *,
    index: bytes | None = None,
    manifest: bytes = MANIFEST,
    members: dict[str, bytes | tarfile.TarInfo] | None = None,
) -> Path:
    """A one-image OCI archive, consistent except for what the arguments replace: the
    index names `manifest` by its true digest unless `index` is given, and `members`
    override or add members last."""
    files: dict[str, bytes | tarfile.TarInfo] = {
        "oci-layout": LAYOUT,
        "index.json": _index(_digest(manifest)) if index is None else index,
        _blob(_digest(manifest)): manifest,
        _blob(_digest(CONFIG)): CONFIG,
    }
    return _tar(path, files | (members or {}))


def _special(kind: bytes, target: str = "") -> tarfile.TarInfo:
    info = tarfile.TarInfo()
    info.type = kind
    info.linkname = target
    return info


def _refusal(archive: Path) -> str:
    """Run the command on `archive` as an administrator does; it must refuse with one
    `image_archive:` line and no traceback. The line, for the reason it gives."""
    shown = subprocess.run(
        [sys.executable, "-m", "ficc_provider_podman.image_entry", str(archive)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert shown.returncode == 1, (shown.returncode, shown.stdout, shown.stderr)
    assert "Traceback" not in shown.stderr
    assert shown.stdout == ""
    lines = shown.stderr.splitlines()
    assert len(lines) == 1, shown.stderr
    assert lines[0].startswith("image_archive: "), shown.stderr
    return lines[0]


def test_a_consistent_archive_gives_the_digest_of_its_config(tmp_path: Path) -> None:
    """The good case, built without Podman: the image ID is the SHA-256 of the config."""
    archive = _archive(tmp_path / "good.tar")
    assert image_entry.image_id(archive) == _digest(CONFIG)
    shown = subprocess.run(
        [sys.executable, "-m", "ficc_provider_podman.image_entry", str(archive)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert shown.returncode == 0, shown.stderr
    (printed,) = tomllib.loads(shown.stdout)["providers"]["configuration"]["images"]
    assert printed == image_entry.entry(archive)
    assert printed["image_id"] == _digest(CONFIG)
    assert shown.stderr == ""


def test_a_config_blob_that_does_not_match_its_digest_is_refused(tmp_path: Path) -> None:
    """The claimed image ID is not printed: the config's bytes must hash to it."""
    other = CONFIG.replace(b"amd64", b"arm64")
    archive = _archive(tmp_path / "config.tar", members={_blob(_digest(CONFIG)): other})
    line = _refusal(archive)
    assert f"hashes to {_digest(other)}, not the digest the manifest names" in line
    assert "copy it again" in line


def test_a_manifest_blob_that_does_not_match_its_digest_is_refused(tmp_path: Path) -> None:
    altered = _manifest(_digest(CONFIG), annotations={"altered": "yes"})
    archive = _archive(tmp_path / "manifest.tar", members={_blob(_digest(MANIFEST)): altered})
    line = _refusal(archive)
    assert "not the digest index.json names" in line


def test_an_index_that_is_a_json_list_is_refused(tmp_path: Path) -> None:
    line = _refusal(_archive(tmp_path / "list.tar", index=b"[]"))
    assert "index.json" in line
    assert "not a valid OCI image index" in line
    assert "podman save --format oci-archive" in line


def test_a_manifest_entry_that_is_a_string_is_refused(tmp_path: Path) -> None:
    index = json.dumps({"manifests": [_digest(MANIFEST)]}).encode()
    line = _refusal(_archive(tmp_path / "string.tar", index=index))
    assert "Expected `object`, got `str`" in line


@pytest.mark.parametrize("where", ["index", "manifest"])
def test_deep_nesting_is_refused_before_it_is_decoded(tmp_path: Path, where: str) -> None:
    """400,000 nested brackets, in a field no structure names (the decoder recurses over
    fields it skips too); the manifest is named by its true digest, so only its depth is
    wrong."""
    if where == "index":
        index = b'{"manifests":[],"annotations":' + DEEP + b"}"
        archive = _archive(tmp_path / "deep.tar", index=index)
        name = "index.json"
    else:
        manifest = _manifest(_digest(CONFIG))[:-1] + b',"annotations":' + DEEP + b"}"
        archive = _archive(tmp_path / "deep.tar", manifest=manifest)
        name = _blob(_digest(manifest))
    line = _refusal(archive)
    assert f"{name} in " in line
    assert "nests deeper than 64 levels" in line


@pytest.mark.parametrize(
    ("member", "kind"),
    [
        ("index.json", "symbolic link"),
        (_blob(_digest(CONFIG)), "symbolic link"),
        (_blob(_digest(MANIFEST)), "hard link"),
        (_blob(_digest(CONFIG)), "directory"),
        ("index.json", "device or FIFO"),
    ],
)
def test_a_member_that_is_not_a_regular_file_is_refused(
    tmp_path: Path, member: str, kind: str
) -> None:
    special = {
        "symbolic link": _special(tarfile.SYMTYPE, "oci-layout"),
        "hard link": _special(tarfile.LNKTYPE, "oci-layout"),
        "directory": _special(tarfile.DIRTYPE),
        "device or FIFO": _special(tarfile.CHRTYPE),
    }[kind]
    line = _refusal(_archive(tmp_path / "special.tar", members={member: special}))
    assert f"{member} in " in line
    assert f"is a {kind}, not a regular file" in line


@pytest.mark.parametrize(
    "digest",
    [
        "sha512:" + hashlib.sha512(CONFIG).hexdigest(),
        _digest(CONFIG).upper().replace("SHA256", "sha256"),
        _digest(CONFIG)[:-1],
        "sha256:../../oci-layout",
    ],
)
def test_a_blob_named_by_anything_but_a_sha256_digest_is_refused(
    tmp_path: Path, digest: str
) -> None:
    manifest = _manifest(digest)
    blob = "blobs/" + digest.replace(":", "/")
    line = _refusal(_archive(tmp_path / "digest.tar", manifest=manifest, members={blob: CONFIG}))
    assert "the manifest in " in line
    assert "not a `sha256:` digest of 64 lowercase hex digits" in line


def _truncated(path: Path) -> Path:
    """A consistent archive cut in the middle of its last member's data."""
    _archive(path)
    with tarfile.open(path) as tar:
        cut = tar.getmembers()[-1].offset_data + 10
    with path.open("r+b") as file:
        file.truncate(cut)
    return path


def _index_archive(index: bytes) -> Callable[[Path], object]:
    return lambda path: _archive(path, index=index)


_PLATFORMS = {"mediaType": image_entry.MEDIA_INDEX, "digest": _digest(MANIFEST)}
HOSTILE: dict[str, tuple[Callable[[Path], object], str]] = {
    "not a tar": (lambda path: path.write_bytes(b"\x00" * 100 + b"text"), "is not a tar archive"),
    "truncated": (_truncated, "is a damaged tar archive"),
    "a directory": (Path.mkdir, "cannot be read"),
    "null index": (_index_archive(b"null"), "Expected `object`, got `null`"),
    "no manifests": (_index_archive(b"{}"), "missing required field `manifests`"),
    "digest a number": (_index_archive(b'{"manifests":[{"digest":7}]}'), "got `int`"),
    "huge number": (
        _index_archive(b'{"manifests":[{"digest":1' + b"9" * 500_000 + b"}]}"),
        "out of range",
    ),
    "huge unknown number": (
        _index_archive(b'{"manifests":[],"size":1' + b"9" * 500_000 + b"}"),
        "holds 0 images",
    ),
    "not UTF-8": (_index_archive(b'{"manifests":[{"digest":"\xff\xfe"}]}'), "is not JSON"),
    "not JSON": (_index_archive(b'{"manifests":'), "is not JSON"),
    "too large": (_index_archive(b" " * ((1 << 20) + 1)), f"is {(1 << 20) + 1} bytes, more than"),
    "index of platforms": (
        _index_archive(json.dumps({"manifests": [_PLATFORMS]}).encode()),
        "multi-platform index",
    ),
    "no config blob": (
        lambda path: _tar(
            path,
            {
                "oci-layout": LAYOUT,
                "index.json": _index(_digest(MANIFEST)),
                _blob(_digest(MANIFEST)): MANIFEST,
            },
        ),
        "has no blobs/sha256/",
    ),
    "no config": (
        lambda path: _archive(path, manifest=b'{"schemaVersion":2,"layers":[]}'),
        "names no config",
    ),
    "config a list": (
        lambda path: _archive(
            path, manifest=_manifest(_digest(b"[]")), members={_blob(_digest(b"[]")): b"[]"}
        ),
        "not a valid OCI image config",
    ),
    "index.json twice": (
        lambda path: _archive(path, members={"./index.json": _index(_digest(MANIFEST))}),
        "appears 2 times",
    ),
}


@pytest.mark.parametrize("case", HOSTILE)
def test_every_hostile_archive_ends_in_one_line_saying_what_to_do(
    tmp_path: Path, case: str
) -> None:
    make, expected = HOSTILE[case]
    make(tmp_path / "hostile.tar")
    assert expected in _refusal(tmp_path / "hostile.tar")


def test_the_entry_is_printed_for_a_toml_or_a_json_configuration(tmp_path: Path) -> None:
    """TOML by default, as the guide's configuration (a table to paste below the
    provider's `[[providers]]`); `--format json` for a JSON file or a script."""
    archive = _archive(tmp_path / "good.tar")
    entry = image_entry.entry(archive)

    def shown(*options: str) -> str:
        done = subprocess.run(
            [sys.executable, "-m", "ficc_provider_podman.image_entry", str(archive), *options],
            capture_output=True, text=True, check=False,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        return done.stdout

    toml_text = shown()
    assert toml_text.startswith("[[providers.configuration.images]]\n")
    pasted = f'[[providers]]\nid = "podman"\n\n{toml_text}'
    pasted_entry = {"id": "podman", "configuration": {"images": [entry]}}
    assert tomllib.loads(pasted)["providers"] == [pasted_entry]
    assert tomllib.loads(shown("--format", "toml")) == tomllib.loads(toml_text)
    assert json.loads(shown("--format", "json")) == entry
