"""The BoltDB reader against a state database written by real Podman, and against
every kind of damage a slot account could do to that file."""

from __future__ import annotations

import contextlib
import random
import struct
import subprocess

import pytest

from ficc_provider_podman import boltdb

pytestmark = pytest.mark.podman("Podman writes the database read here")

VOLUMES = 40
"""Long volume names: enough of them that Podman's tree needs branch pages."""
_HEADER = struct.Struct("<QHHI")


class Database:
    def __init__(self, data: bytes, containers: dict[str, str], volumes: list[str]) -> None:
        self.data = data
        self.containers = containers
        self.volumes = volumes


@pytest.fixture(scope="module")
def db(tmp_path_factory: pytest.TempPathFactory) -> Database:
    """Three containers (one of them removed again) and many volumes, made by Podman
    with a root of its own; `--rootfs` needs no image."""
    base = tmp_path_factory.mktemp("bolt")
    (base / "rootfs").mkdir()
    podman = [
        "podman",
        "--root", str(base / "root"),
        "--runroot", str(base / "run"),
        "--tmpdir", str(base / "tmp"),
        "--storage-driver", "vfs",
        "--events-backend=none",
        "--cgroup-manager=cgroupfs",
    ]  # fmt: skip

    def run(*arguments: str) -> str:
        done = subprocess.run([*podman, *arguments], capture_output=True, check=True, timeout=120)
        return done.stdout.decode().strip()

    containers = {
        name: run("create", "--name", name, "--rootfs", str(base / "rootfs"), "/bin/true")
        for name in ("one", "two", "three")
    }
    run("rm", "two")
    del containers["two"]
    volumes = [f"v{i:02d}-" + "x" * 180 for i in range(VOLUMES)]
    for name in volumes:
        run("volume", "create", name)
    data = (base / "root" / "libpod" / "bolt_state.db").read_bytes()
    return Database(data, containers, volumes)


def _page_flags(data: bytes, page_size: int = 4096) -> list[int]:
    return [_HEADER.unpack_from(data, at)[1] for at in range(0, len(data), page_size)]


def test_podmans_own_database_reads_as_podman_wrote_it(db: Database) -> None:
    assert boltdb.BRANCH in _page_flags(db.data)  # the tree is more than one leaf
    buckets = boltdb.read_buckets(db.data)
    assert set(buckets[b"all-ctrs"]) == {c.encode() for c in db.containers.values()}
    assert set(buckets[b"name-registry"]) == {n.encode() for n in db.containers}
    # Each container of `ctr` is a nested bucket (its value is not opened).
    assert buckets[b"ctr"] == {c.encode(): None for c in db.containers.values()}
    assert sorted(buckets[b"allVolumes"]) == [v.encode() for v in sorted(db.volumes)]
    assert buckets[b"runtime-config"][b"os"] == b"linux"


def test_a_damaged_meta_page_leaves_the_other_one(db: Database) -> None:
    """The reader takes the valid meta with the highest transaction: breaking the
    checksum of one leaves the other; breaking both refuses the file."""
    damaged = bytearray(db.data)
    damaged[16 + 60] ^= 0xFF  # the checksum of meta page 0
    boltdb.read_buckets(bytes(damaged))  # page 1 answers (or says what is wrong)
    damaged[4096 + 16 + 60] ^= 0xFF
    with pytest.raises(boltdb.BoltError, match="no valid meta page"):
        boltdb.read_buckets(bytes(damaged))


def test_a_page_that_points_back_at_itself_is_refused(db: Database) -> None:
    """Each branch page in turn made its own first child: the ones in the current tree
    are refused (a page freed by an older transaction is not read at all)."""
    refused: list[str] = []
    for page, flags in enumerate(_page_flags(db.data)):
        if flags != boltdb.BRANCH:
            continue
        data = bytearray(db.data)
        struct.pack_into("<Q", data, page * 4096 + 16 + 8, page)
        try:
            boltdb.read_buckets(bytes(data))
        except boltdb.BoltError as error:
            refused.append(str(error))
    assert refused
    assert all("visited twice" in reason for reason in refused), refused


@pytest.mark.parametrize("seed", range(4))
def test_any_damage_reads_or_is_refused_never_anything_else(db: Database, seed: int) -> None:
    """Random bytes changed, runs of bytes zeroed and the file cut short: every result
    is buckets or `BoltError`, never another exception or a hang."""
    rng = random.Random(seed)
    for _ in range(150):
        data = bytearray(db.data)
        kind = rng.randrange(3)
        if kind == 0:
            for _ in range(rng.randint(1, 8)):
                data[rng.randrange(len(data))] = rng.randrange(256)
        elif kind == 1:
            start = rng.randrange(len(data))
            end = min(len(data), start + rng.randint(1, 64))
            data[start:end] = bytes(end - start)
        else:
            del data[rng.randrange(len(data)) :]
        with contextlib.suppress(boltdb.BoltError):
            boltdb.read_buckets(bytes(data))
