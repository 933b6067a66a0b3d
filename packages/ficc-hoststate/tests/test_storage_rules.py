"""Storage the contract excludes: network filesystems, and any group/other access.

The filesystem magic is read for real and checked against coreutils `stat -f`, which
reads it independently. No network filesystem can be mounted on the test machine
(no NFS, SMB or FUSE server is installed), so the refusal of each network magic is
tested by standing in the magic the kernel would report; the refusal path from
`acquire` down is the real one.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

import ficc.hoststate as hs
from ficc.hoststate import acquire, fstype

HOST = "host-1"

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="statfs magic and modes are Linux rules"
)


def test_the_magic_is_the_one_stat_reports(store: pathlib.Path) -> None:
    fd = os.open(store, os.O_RDONLY | os.O_DIRECTORY)
    try:
        magic = fstype.filesystem_magic(fd)
    finally:
        os.close(fd)
    reported = subprocess.run(
        ["stat", "-f", "-c", "%t", str(store)], capture_output=True, text=True, check=True
    ).stdout.strip()
    assert magic == int(reported, 16)
    assert magic not in fstype.NETWORK_FILESYSTEMS  # the test directory is local


def test_a_local_store_is_accepted(store: pathlib.Path) -> None:
    with acquire(store, HOST) as session:
        session.begin("op-1", "sha256:" + "0" * 64)


@pytest.mark.parametrize(
    "magic",
    sorted(fstype.NETWORK_FILESYSTEMS),
    ids=[f"{m:#x}" for m in sorted(fstype.NETWORK_FILESYSTEMS)],
)
def test_a_network_filesystem_is_refused(
    store: pathlib.Path, monkeypatch: pytest.MonkeyPatch, magic: int
) -> None:
    monkeypatch.setattr(fstype, "filesystem_magic", lambda fd: magic)
    with pytest.raises(hs.UnsupportedFilesystem) as info:
        acquire(store, HOST)
    assert info.value.code == "unsupported_filesystem"
    assert isinstance(info.value, hs.Unsupported)
    assert fstype.NETWORK_FILESYSTEMS[magic].split(" ")[0] in info.value.message
    assert "local filesystem" in info.value.message
    assert not (store / "host.lock").exists()  # refused before anything was created


def test_nfs_and_smb_are_named(store: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for magic, name in ((0x6969, "NFS"), (0xFE534D42, "SMB2/SMB3"), (0xFF534D42, "CIFS")):
        monkeypatch.setattr(fstype, "filesystem_magic", lambda fd, m=magic: m)
        with pytest.raises(hs.UnsupportedFilesystem, match=name):
            acquire(store, HOST)


def test_an_unreadable_filesystem_type_is_refused(
    store: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def failing(fd: int) -> int:
        raise OSError(38, "Function not implemented")

    monkeypatch.setattr(fstype, "filesystem_magic", failing)
    with pytest.raises(hs.UnsupportedFilesystem, match="cannot tell which filesystem"):
        acquire(store, HOST)


@pytest.fixture
def initialized(store: pathlib.Path) -> pathlib.Path:
    with acquire(store, HOST) as session:
        session.begin("op-1", "sha256:" + "0" * 64)
    return store


@pytest.mark.parametrize("mode", [0o740, 0o704, 0o710, 0o701])
def test_a_directory_readable_or_searchable_by_others_is_refused(
    initialized: pathlib.Path, mode: int
) -> None:
    os.chmod(initialized, mode)
    with pytest.raises(hs.Unsafe) as info:
        acquire(initialized, HOST)
    assert "readable by group or others" in info.value.message
    assert f"`chmod 700 {initialized}`" in info.value.message
    os.chmod(initialized, 0o700)
    acquire(initialized, HOST).close()  # the advice works


@pytest.mark.parametrize("name", ["state.json", "host.lock"])
@pytest.mark.parametrize("mode", [0o640, 0o604])
def test_a_metadata_file_readable_by_others_is_refused(
    initialized: pathlib.Path, name: str, mode: int
) -> None:
    os.chmod(initialized / name, mode)
    with pytest.raises(hs.Unsafe) as info:
        acquire(initialized, HOST)
    assert "readable by group or others" in info.value.message
    assert f"`chmod 600 {initialized}/{name}`" in info.value.message
    os.chmod(initialized / name, 0o600)
    acquire(initialized, HOST).close()


def test_a_writable_file_names_the_chmod_too(initialized: pathlib.Path) -> None:
    os.chmod(initialized / "state.json", 0o660)
    with pytest.raises(hs.Unsafe) as info:
        acquire(initialized, HOST)
    assert "writable by group or others" in info.value.message
    assert f"`chmod 600 {initialized}/state.json`" in info.value.message
