"""A read-only reader of a BoltDB file: Podman 4's state database (`libpod/bolt_state.db`).

Pure: bytes in, buckets out. The release reads the slot's database to prove that
`podman run --rm` removed its container, without starting Podman again (see
removal.py). The file is written by the slot account, so every offset, length and
page number is checked against the file before it is used, every page of an overflow
run is visited at most once, the keys of a page must be short and strictly ascending,
one read visits at most `MAX_ELEMENTS` elements (inline buckets, which can be reached
from many elements, included) and copies only the short values asked for; anything
else raises `BoltError`, and the caller then falls back to asking Podman.

The format, as this reader relies on it (little-endian throughout):
- the file is a sequence of pages of `page_size` bytes; every page starts with a
  16-byte header: id u64, flags u16, count u16, overflow u32 (the page spans
  `overflow + 1` pages);
- pages 0 and 1 hold the two meta records; a meta is valid when its magic, version
  and FNV-1a 64 checksum (over the 56 bytes before it) agree; the valid one with the
  highest transaction id is the current state;
- a meta names the root bucket's page; a branch page (flag 0x01) holds `count`
  elements of (pos u32, ksize u32, child page u64); a leaf page (flag 0x02) holds
  `count` elements of (flags u32, pos u32, ksize u32, vsize u32); `pos` counts from
  the element itself, the value follows the key;
- a leaf element with flag 0x01 is a nested bucket: its value is (root page u64,
  sequence u64), and a root page of 0 means the bucket's own leaf page follows inline.
"""

from __future__ import annotations

import struct
from collections.abc import Collection, Iterator

MAGIC = 0xED0CDAED
VERSION = 2
META_CHECKED_BYTES = 56
BRANCH, LEAF, META = 0x01, 0x02, 0x04
BUCKET_LEAF = 0x01
MAX_DEPTH = 32
"""No B+tree of a state database this size is near this deep; a cycle would be."""
MAX_ELEMENTS = 100_000
"""Elements visited in one read, inline buckets included (each can be reached from
many elements, which no page rule stops): a slot's state holds a few hundred."""
MAX_KEY_BYTES = 1024
MAX_VALUE_BYTES = 4096
"""Of a value the caller asked for (Podman's IDs, names and exit codes are short)."""

_HEADER = struct.Struct("<QHHI")
_META = struct.Struct("<IIIIQQQQQQ")
_BRANCH_ELEMENT = struct.Struct("<IIQ")
_LEAF_ELEMENT = struct.Struct("<IIII")
_BUCKET = struct.Struct("<QQ")


class BoltError(ValueError):
    """The bytes are not a BoltDB file this reader understands."""


Bucket = dict[bytes, bytes | None]
"""A bucket's keys, each with its value where asked for, else None (a nested bucket's
value is never opened)."""


def read_buckets(data: bytes, values_of: Collection[bytes] = ()) -> dict[bytes, Bucket]:
    """Every top-level bucket of the database with its keys one level deep, and the
    values of the buckets named in `values_of` (each at most `MAX_VALUE_BYTES`)."""
    view = memoryview(data)
    root, page_size, high_water = _current_meta(view)
    reader = _Reader(view, page_size, high_water)
    buckets: dict[bytes, Bucket] = {}
    for flags, key, value in reader.entries(root):
        name = bytes(key)
        if not flags & BUCKET_LEAF or name in buckets:
            raise BoltError(f"top-level key {name!r} is not a bucket, or is there twice")
        keep = name in values_of
        buckets[name] = {
            bytes(k): _value(v) if keep and not f & BUCKET_LEAF else None
            for f, k, v in reader.bucket(value)
        }
    return buckets


def _value(value: memoryview) -> bytes:
    if len(value) > MAX_VALUE_BYTES:
        raise BoltError(f"a value of {len(value)} bytes where a short one was expected")
    return bytes(value)


def _fnv1a64(data: memoryview) -> int:
    value = 0xCBF29CE484222325
    for byte in data:
        value = ((value ^ byte) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return value


def _meta_at(view: memoryview, offset: int) -> tuple[int, int, int, int] | None:
    """(txid, root page, page size, high water page) of a valid meta, else None."""
    end = offset + _HEADER.size + _META.size
    if end > len(view) or _HEADER.unpack_from(view, offset)[1] != META:
        return None
    fields = _META.unpack_from(view, offset + _HEADER.size)
    magic, version, page_size, _, root, _, _, high_water, txid, checksum = fields
    body = view[offset + _HEADER.size : offset + _HEADER.size + META_CHECKED_BYTES]
    if magic != MAGIC or version != VERSION or _fnv1a64(body) != checksum:
        return None
    if page_size < 512 or page_size & (page_size - 1):
        return None
    return txid, root, page_size, high_water


def _current_meta(view: memoryview) -> tuple[int, int, int]:
    first = _meta_at(view, 0)
    metas = [first] if first is not None else []
    second_at = first[2] if first is not None else 4096
    second = _meta_at(view, second_at)
    if second is not None:
        metas.append(second)
    if not metas:
        raise BoltError("no valid meta page")
    _, root, page_size, high_water = max(metas)
    return root, page_size, high_water


class _Reader:
    def __init__(self, view: memoryview, page_size: int, high_water: int) -> None:
        self._view = view
        self._page_size = page_size
        self._pages = min(high_water, len(view) // page_size)
        self._seen: set[int] = set()
        self._left = MAX_ELEMENTS

    def entries(self, page_id: int, depth: int = 0) -> Iterator[tuple[int, memoryview, memoryview]]:
        """(flags, key, value) of every leaf element under the page, in key order."""
        if not 2 <= page_id < self._pages:
            raise BoltError(f"page {page_id} is out of the file")
        start = page_id * self._page_size
        _, _, _, overflow = _HEADER.unpack_from(self._view, start)
        run = range(page_id, page_id + overflow + 1)
        if run.stop > self._pages or not self._seen.isdisjoint(run):
            raise BoltError(f"page {page_id} runs past the file or is visited twice")
        self._seen.update(run)
        end = start + len(run) * self._page_size
        yield from self._walk(self._view[start:end], depth)

    def bucket(self, value: memoryview) -> Iterator[tuple[int, memoryview, memoryview]]:
        """The elements of a nested bucket, whose value is given."""
        if len(value) < _BUCKET.size:
            raise BoltError("a bucket value is too short")
        root, _ = _BUCKET.unpack_from(value, 0)
        if root:
            yield from self.entries(root)
        else:
            yield from self._walk(value[_BUCKET.size :], depth=0)

    def _walk(self, page: memoryview, depth: int) -> Iterator[tuple[int, memoryview, memoryview]]:
        if depth > MAX_DEPTH or len(page) < _HEADER.size:
            raise BoltError("a page is too short or the tree is too deep")
        _, flags, count, _ = _HEADER.unpack_from(page, 0)
        if count > self._left:
            raise BoltError(f"more than {MAX_ELEMENTS} elements")
        self._left -= count
        previous: memoryview | None = None
        if flags == LEAF:
            for at in _elements(page, count, _LEAF_ELEMENT.size):
                element_flags, pos, ksize, vsize = _LEAF_ELEMENT.unpack_from(page, at)
                key = _key(page, at + pos, ksize, previous)
                previous = key
                yield element_flags, key, _slice(page, at + pos + ksize, vsize)
        elif flags == BRANCH:
            for at in _elements(page, count, _BRANCH_ELEMENT.size):
                pos, ksize, child = _BRANCH_ELEMENT.unpack_from(page, at)
                previous = _key(page, at + pos, ksize, previous)
                yield from self.entries(child, depth + 1)
        else:
            raise BoltError(f"page flags {flags:#x} where a branch or leaf was expected")


def _elements(page: memoryview, count: int, size: int) -> range:
    first = _HEADER.size
    if first + count * size > len(page):
        raise BoltError("the elements run past their page")
    return range(first, first + count * size, size)


def _key(page: memoryview, start: int, length: int, previous: memoryview | None) -> memoryview:
    """A key of a page: short, and after the page's key before it (a B+tree's order)."""
    key = _slice(page, start, length)
    if length > MAX_KEY_BYTES or (previous is not None and bytes(key) <= bytes(previous)):
        raise BoltError("a key is too long or out of order")
    return key


def _slice(page: memoryview, start: int, length: int) -> memoryview:
    if start + length > len(page):
        raise BoltError("a key or value runs past its page")
    return page[start : start + length]
