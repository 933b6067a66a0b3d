"""The BoltDB reader against a state database written by real Podman, and against
every kind of damage a slot account could do to that file."""

from __future__ import annotations

import contextlib
import pathlib
import random
import shutil
import struct
import subprocess
import tempfile
from collections.abc import Iterator

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
def db() -> Iterator[Database]:
    """Three containers (one of them removed again) and many volumes, made by Podman
    with a root of its own; `--rootfs` needs no image. The root lives right under
    /tmp, not under pytest's temporary directory: Podman refuses a runroot path of
    more than 50 characters, and a CI checkout's temporary directory is longer."""
    base = pathlib.Path(tempfile.mkdtemp(prefix="ficc-bolt-", dir="/tmp"))
    try:
        yield _made_by_podman(base)
    finally:
        shutil.rmtree(base, ignore_errors=True)


def _made_by_podman(base: pathlib.Path) -> Database:
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
        done = subprocess.run([*podman, *arguments], check=False, capture_output=True, timeout=120)
        assert done.returncode == 0, f"podman {arguments[0]}: {done.stderr.decode()}"
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
    assert buckets[b"runtime-config"][b"os"] is None  # values only where asked for
    asked = boltdb.read_buckets(db.data, values_of={b"runtime-config"})
    assert asked[b"runtime-config"][b"os"] == b"linux"


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


# --- files made by hand: the bounds that keep a hostile file cheap -------------------

PAGE = 4096


def _fnv1a64(data: bytes) -> int:
    value = 0xCBF29CE484222325
    for byte in data:
        value = ((value ^ byte) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return value


def _meta(page_id: int, root: int, pages: int, txid: int) -> bytes:
    body = struct.pack("<IIIIQQQQQ", boltdb.MAGIC, 2, PAGE, 0, root, 0, 0, pages, txid)
    meta = _HEADER.pack(page_id, boltdb.META, 0, 0) + body + struct.pack("<Q", _fnv1a64(body))
    return meta.ljust(PAGE, b"\0")


def _leaf(elements: list[tuple[int, bytes, bytes]], page_id: int = 0) -> bytes:
    """A leaf page (or an inline bucket's page): (flags, key, value) in the given order."""
    head = _HEADER.pack(page_id, boltdb.LEAF, len(elements), 0)
    table, data = b"", b""
    for index, (flags, key, value) in enumerate(elements):
        pos = (len(elements) - index) * 16 + len(data)
        table += struct.pack("<IIII", flags, pos, len(key), len(value))
        data += key + value
    return head + table + data


def _file(root_page: bytes) -> bytes:
    """Meta pages 0 and 1, then the root leaf at page 2 (with overflow pages as needed)."""
    overflow = (len(root_page) - 1) // PAGE
    page = bytearray(root_page.ljust((overflow + 1) * PAGE, b"\0"))
    _, flags, count, _ = _HEADER.unpack_from(page, 0)
    _HEADER.pack_into(page, 0, 2, flags, count, overflow)
    pages = 3 + overflow
    return _meta(0, 2, pages, 1) + _meta(1, 2, pages, 0) + bytes(page)


def _inline(elements: list[tuple[int, bytes, bytes]]) -> bytes:
    return struct.pack("<QQ", 0, 0) + _leaf(elements)


def test_a_file_made_by_hand_reads_as_written() -> None:
    bucket = _inline([(0, b"a", b"1"), (0, b"b", b"22")])
    data = _file(_leaf([(boltdb.BUCKET_LEAF, b"exit-code", bucket)], page_id=2))
    assert boltdb.read_buckets(data) == {b"exit-code": {b"a": None, b"b": None}}
    assert boltdb.read_buckets(data, values_of={b"exit-code"}) == {
        b"exit-code": {b"a": b"1", b"b": b"22"}
    }


def test_one_inline_bucket_named_by_many_elements_stops_at_the_element_bound() -> None:
    """An inline bucket has no page of its own, so no page rule stops many elements from
    sharing one: keys "a", "aa", "aaa", ... all end where the same inline bucket starts.
    A file of a few pages would make the reader walk 1,000 x 200 elements; the element
    bound stops it long before."""
    fans, entries = 1000, 200
    inline = _inline([(0, f"k{i:05d}".encode(), b"") for i in range(entries)])
    table_end = 16 + fans * 16
    shared_at = table_end + fans  # the keys' "a"s, then the bucket
    body = bytearray(_HEADER.pack(2, boltdb.LEAF, fans, 0))
    for index in range(fans):
        at = 16 + index * 16
        key_length = index + 1
        body += struct.pack("<IIII", boltdb.BUCKET_LEAF, shared_at - key_length - at,
                            key_length, len(inline))  # fmt: skip
    body += b"a" * fans + inline
    data = _file(bytes(body))
    assert len(data) <= 8 * PAGE
    with pytest.raises(boltdb.BoltError, match="more than"):
        boltdb.read_buckets(data)


def test_keys_out_of_order_or_a_bucket_twice_are_refused() -> None:
    unordered = _inline([(0, b"b", b""), (0, b"a", b"")])
    data = _file(_leaf([(boltdb.BUCKET_LEAF, b"x", unordered)], page_id=2))
    with pytest.raises(boltdb.BoltError, match="out of order"):
        boltdb.read_buckets(data)
    twice = _leaf([(boltdb.BUCKET_LEAF, b"x", _inline([])), (boltdb.BUCKET_LEAF, b"x", b"")], 2)
    with pytest.raises(boltdb.BoltError):
        boltdb.read_buckets(_file(twice))


def test_a_long_value_is_copied_only_when_asked_for_and_only_when_short() -> None:
    long = _inline([(0, b"k", b"v" * (boltdb.MAX_VALUE_BYTES + 1))])
    data = _file(_leaf([(boltdb.BUCKET_LEAF, b"exit-code", long)], page_id=2))
    assert boltdb.read_buckets(data) == {b"exit-code": {b"k": None}}
    with pytest.raises(boltdb.BoltError, match="short one"):
        boltdb.read_buckets(data, values_of={b"exit-code"})
