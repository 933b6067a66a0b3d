"""The state.json codec: every rejection class, on the pure codec and through acquire."""

from __future__ import annotations

import hashlib
import os
import pathlib

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, given, settings

import ficc.hoststate as hs
from ficc.hoststate import Operation, Status, acquire, marker, snapshot
from hs_support import HOST, plan

S = Status


def op(op_id: str, status: Status = S.SUCCEEDED, revision: int = 3) -> Operation:
    return Operation(id=op_id, plan_hash=plan(op_id), status=status, revision=revision)


GOOD_OPS = [op("a", S.CANCELLED, 2), op("b"), op("c", S.RUNNING, 2)]
GOOD = snapshot.encode(HOST, GOOD_OPS)


def body_of(data: bytes) -> bytes:
    return b"{" + data[snapshot.HEADER_LEN :]


def reseal(body: bytes) -> bytes:
    """A file whose checksum matches `body`, so the check under test is the one that fires."""
    return b'{"checksum":"sha256:' + hashlib.sha256(body).hexdigest().encode() + b'",' + body[1:]


def put_store(store: pathlib.Path, data: bytes, *, marked: bool = True) -> None:
    fd = os.open(store / "state.json", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.write(fd, data)
    os.close(fd)
    if marked:
        fd = os.open(store / "host.lock", os.O_WRONLY | os.O_CREAT, 0o600)
        os.write(fd, marker.encode(HOST))
        os.close(fd)


def refused(store: pathlib.Path, data: bytes, error: type[hs.HostStateError], text: str) -> None:
    """The codec and acquire both refuse `data` with `error`, naming the defect."""
    with pytest.raises(error) as info:
        snapshot.decode(data, HOST)
    assert text in str(info.value)
    put_store(store, data)
    with pytest.raises(error) as info:
        acquire(store, HOST)
    assert text in str(info.value)
    with acquire_after_restore(store):  # and the refusal left nothing locked or changed
        pass


class acquire_after_restore:
    def __init__(self, store: pathlib.Path) -> None:
        put_store(store, GOOD)
        self.session = acquire(store, HOST)

    def __enter__(self) -> hs.Session:
        return self.session

    def __exit__(self, *exc: object) -> None:
        self.session.close()


def test_canonical_bytes() -> None:
    assert GOOD.startswith(b'{"checksum":"sha256:')
    assert b" " not in GOOD
    assert b"\n" not in GOOD
    assert body_of(GOOD).startswith(b'{"format":"ficc-hoststate","host_id":"host-a",')
    assert GOOD.endswith(b'],"version":1}')
    assert snapshot.decode(GOOD, HOST) == GOOD_OPS
    assert snapshot.encode(HOST, list(reversed(GOOD_OPS))) == GOOD  # order is by ID


def test_good_file_is_accepted(store: pathlib.Path) -> None:
    put_store(store, GOOD)
    with acquire(store, HOST) as s:
        assert s.get("c").status is S.RUNNING


@pytest.mark.parametrize("where", [0, 1, 25, 84, 85, 86, 120, -40, -1])
def test_flipped_byte(store: pathlib.Path, where: int) -> None:
    data = bytearray(GOOD)
    data[where] ^= 0x01
    with pytest.raises(hs.Corrupt):
        snapshot.decode(bytes(data), HOST)
    refused(store, bytes(data), hs.Corrupt, "state.json")


@pytest.mark.parametrize("keep", [0, 1, 20, 85, 86, 87, 200, len(GOOD) // 2, len(GOOD) - 1])
def test_truncation(store: pathlib.Path, keep: int) -> None:
    refused(store, GOOD[:keep], hs.Corrupt, "state.json")


def test_truncation_with_recomputed_checksum(store: pathlib.Path) -> None:
    refused(store, reseal(body_of(GOOD)[:-1]), hs.Corrupt, "not a valid snapshot")


def test_checksum_mismatch_is_named(store: pathlib.Path) -> None:
    data = GOOD.replace(b'"status":"running"', b'"status":"unknown"')
    refused(store, data, hs.Corrupt, "checksum mismatch")


def test_unknown_top_level_field(store: pathlib.Path) -> None:
    body = body_of(GOOD).replace(b'"format"', b'"extra":1,"format"')
    refused(store, reseal(body), hs.Corrupt, "unknown field")


def test_a_deeply_nested_field_is_corrupt_not_a_crash(store: pathlib.Path) -> None:
    """An unknown field nested 5,000 levels deep (10 KB, a valid checksum) exhausts the
    decoder's recursion: it is `Corrupt` like any other bad snapshot."""
    deep = b"[" * 5000 + b"]" * 5000
    body = body_of(GOOD).replace(b'"format"', b'"extra":' + deep + b',"format"')
    refused(store, reseal(body), hs.Corrupt, "not a valid snapshot")


def test_unknown_record_field(store: pathlib.Path) -> None:
    body = body_of(GOOD).replace(b'{"id":"b",', b'{"comment":"x","id":"b",')
    refused(store, reseal(body), hs.Corrupt, "unknown field")


def test_duplicate_top_level_key(store: pathlib.Path) -> None:
    body = body_of(GOOD).replace(b'"host_id":"host-a",', b'"host_id":"host-a","host_id":"host-a",')
    refused(store, reseal(body), hs.Corrupt, "not canonical")


def test_duplicate_record_key(store: pathlib.Path) -> None:
    body = body_of(GOOD).replace(b'"status":"running"', b'"status":"queued","status":"running"')
    refused(store, reseal(body), hs.Corrupt, "not canonical")


def test_duplicate_checksum_key(store: pathlib.Path) -> None:
    data = GOOD.replace(b'",', b'","checksum":"x",', 1)
    refused(store, data, hs.Corrupt, "state.json")


def test_duplicate_operation_id(store: pathlib.Path) -> None:
    ops = snapshot._encode_body(HOST, [op("a"), op("a")])
    refused(store, reseal(ops), hs.Corrupt, "not strictly sorted")


def test_unsorted_operations(store: pathlib.Path) -> None:
    ops = snapshot._encode_body(HOST, [op("b"), op("a")])
    refused(store, reseal(ops), hs.Corrupt, "not strictly sorted")


@pytest.mark.parametrize(
    ("old", "new"),
    [
        (b'":"', b'": "'),  # a space after a colon
        (b",", b", "),
        (b"{", b"{\n  "),
        (b'],"version":1}', b'],"version":1}\n'),
        (b'"revision":3', b'"revision":3.0'),
        (b'"revision":3', b'"revision":03'),
        (b'"id":"a"', b'"id":"\\u0061"'),  # an escaped but equal string
    ],
)
def test_non_canonical_bytes(store: pathlib.Path, old: bytes, new: bytes) -> None:
    body = body_of(GOOD).replace(old, new, 1)
    assert body != body_of(GOOD)
    refused(store, reseal(body), hs.Corrupt, "state.json")


def test_reordered_keys(store: pathlib.Path) -> None:
    body = body_of(GOOD).replace(b'{"id":"b","plan_hash":', b'{"plan_hash":', 1)
    body = body.replace(b'","revision":3,"status":"succeeded"}', b'","id":"b","revision":3,'
                        b'"status":"succeeded"}', 1)  # fmt: skip
    refused(store, reseal(body), hs.Corrupt, "not canonical")


@pytest.mark.parametrize("version", [0, 2, 99])
def test_wrong_version(store: pathlib.Path, version: int) -> None:
    body = body_of(GOOD).replace(b'"version":1}', b'"version":%d}' % version)
    refused(store, reseal(body), hs.Corrupt, f"version {version}")


def test_wrong_format(store: pathlib.Path) -> None:
    body = body_of(GOOD).replace(b'"ficc-hoststate"', b'"something-else"')
    refused(store, reseal(body), hs.Corrupt, "format 'something-else'")


def test_host_mismatch(store: pathlib.Path) -> None:
    other = snapshot.encode("host-b", GOOD_OPS)
    with pytest.raises(hs.HostMismatch):
        snapshot.decode(other, HOST)
    put_store(store, other, marked=False)
    with pytest.raises(hs.HostMismatch) as info:
        acquire(store, HOST)
    assert info.value.code == "host_mismatch"
    assert "host-b" in str(info.value)
    with acquire(store, "host-b") as s:
        assert s.get("b").revision == 3


def test_over_16_mib_refused_before_reading(
    store: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = store / "state.json"
    put_store(store, GOOD)
    os.truncate(path, snapshot.MAX_BYTES + 1)  # sparse: no 16 MiB of writes needed
    requested: list[int] = []
    real_read = os.read

    def spy(fd: int, n: int) -> bytes:
        requested.append(n)
        return real_read(fd, n)

    with monkeypatch.context() as m:
        m.setattr(os, "read", spy)
        with pytest.raises(hs.Corrupt) as info:
            acquire(store, HOST)
    assert max(requested) <= marker.MAX_BYTES + 1  # host.lock only: state.json never read
    assert f"over the {snapshot.MAX_BYTES}-byte limit" in str(info.value)
    with pytest.raises(hs.Corrupt):
        snapshot.decode(b"x" * (snapshot.MAX_BYTES + 1), HOST)


@pytest.mark.parametrize(
    ("record", "text"),
    [
        (op("b", S.SUCCEEDED, 1), "no sequence of transitions"),
        (op("b", S.QUEUED, 2), "no sequence of transitions"),
        (op("b", S.CANCELLED, 3), "no sequence of transitions"),
    ],
)
def test_forged_records(store: pathlib.Path, record: Operation, text: str) -> None:
    data = snapshot.encode(HOST, [op("a"), record])
    refused(store, data, hs.Corrupt, text)


def test_revision_out_of_range(store: pathlib.Path) -> None:
    body = body_of(GOOD).replace(b'"revision":3', b'"revision":5', 1)
    refused(store, reseal(body), hs.Corrupt, "not a valid snapshot")


def test_bad_id_in_file(store: pathlib.Path) -> None:
    body = body_of(GOOD).replace(b'"id":"a"', b'"id":"a b"', 1)
    refused(store, reseal(body), hs.Corrupt, "not a valid snapshot")


def test_two_unresolved_records(store: pathlib.Path) -> None:
    data = snapshot.encode(HOST, [op("a", S.QUEUED, 1), op("b", S.UNKNOWN, 3)])
    refused(store, data, hs.Corrupt, "2 unresolved")


def test_not_utf8(store: pathlib.Path) -> None:
    body = body_of(GOOD).replace(b'"host-a"', b'"host-\xff"', 1)
    refused(store, reseal(body), hs.Corrupt, "not a valid snapshot")


def test_uppercase_checksum(store: pathlib.Path) -> None:
    header_end = snapshot.HEADER_LEN - 2
    data = GOOD[:20] + GOOD[20:header_end].upper() + GOOD[header_end:]
    refused(store, data, hs.Corrupt, "no checksum")


# --- the in-place image equals the reference encoder after any sequence of edits ---

ids = st.text(alphabet="abcXYZ019.:_-", min_size=1, max_size=12).filter(lambda s: s[0].isalnum())


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(ids, st.sampled_from(list(S))), max_size=80))
def test_image_matches_reference_encoding(edits: list[tuple[str, Status]]) -> None:
    saved_block = snapshot._BLOCK
    snapshot._BLOCK = 300  # tiny blocks, so splits happen within a small example
    try:
        image = snapshot.Image(HOST, [])
        current: dict[str, Operation] = {}
        for op_id, status in edits:
            new = Operation(id=op_id, plan_hash=plan(op_id), status=status, revision=1)
            old = current.get(op_id)
            assert image.size_after(old, new) == len(
                snapshot.encode(HOST, [*(v for k, v in current.items() if k != op_id), new])
            )
            image.put(old, new)
            current[op_id] = new
            if len(current) % 7 == 0:
                image.checksum()  # cache partial hashes mid-way, then keep editing
        expected = snapshot.encode(HOST, list(current.values()))
        assert image.to_bytes() == expected
        assert image.size == len(expected)
    finally:
        snapshot._BLOCK = saved_block


def test_image_load_round_trip() -> None:
    image, ops = snapshot.Image.load(GOOD, HOST)
    assert ops == GOOD_OPS
    assert image.to_bytes() == GOOD
