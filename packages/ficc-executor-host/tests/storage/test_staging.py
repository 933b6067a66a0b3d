"""Streamed input staging against real files, real fsync, real ownership and a real tmpfs."""

from __future__ import annotations

import errno
import hashlib
import os
import shutil
import stat
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from ficc.execution.host.core.errors import HostError
from ficc.execution.host.linux.fsutil import identity_of
from ficc.execution.host.storage import staging
from ficc.execution.host.storage.staging import STAGING_DIRECTORY, Stager, StreamState
from ficc.execution.host.storage.streams import (
    check_capacity,
    identity_refusal,
    plan_write,
    streams_of,
)
from ficc.execution.plan import InputObject
from ficc.execution.provider import FileIdentity, InputCapability
from ficc_testkit.accounts import temporary_account
from ficc_testkit.plans import new_id

EMPTY = "sha256:" + hashlib.sha256(b"").hexdigest()

pytestmark = pytest.mark.root("staging creates root-owned files and chowns to a real group")


def sha(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


@pytest.fixture(scope="module")
def slot_gid() -> Iterator[int]:
    """A real non-root system group for the reserved workload (created if absent)."""
    with temporary_account("ficc-t-stage-") as account:
        yield account.gid


@pytest.fixture
def slot(tmp_path: Path) -> Path:
    path = tmp_path / "slot"
    path.mkdir()
    return path


class Ledger:
    """Stands in for the ledger's commit: records every committed state in order."""

    def __init__(self) -> None:
        self.commits: list[StreamState] = []

    def __call__(self, state: StreamState) -> None:
        self.commits.append(state)


def admit(stager: Stager, *payloads: bytes) -> tuple[str, list[StreamState]]:
    attempt = new_id()
    states = [
        StreamState(id=new_id(), name=f"in{i}.bin", bytes=len(p), digest=sha(p))
        for i, p in enumerate(payloads)
    ]
    stager.register_attempt(attempt, states)
    return attempt, stager.prepare_attempt(attempt)


def upload(
    stager: Stager, attempt: str, state: StreamState, data: bytes, chunk: int, ledger: Ledger
) -> StreamState:
    offset = stager.status(attempt, state.id).offset
    while True:
        part = data[offset : offset + chunk]
        state = stager.write(attempt, state.id, offset, part, sha(part), commit=ledger)
        offset = state.offset
        if state.complete or offset >= len(data):
            return state


def object_path(slot: Path, attempt: str, object_id: str) -> Path:
    return slot / STAGING_DIRECTORY / attempt / object_id


def code_of(call: Any, *args: Any, **kwargs: Any) -> str:
    with pytest.raises(HostError) as excinfo:
        call(*args, **kwargs)
    return excinfo.value.code


# -- complete uploads ------------------------------------------------------------


def test_chunked_upload_completes_with_a_sealed_capability(slot: Path, slot_gid: int) -> None:
    data = os.urandom(300_000)
    stager = Stager(str(slot), slot_gid)
    attempt, [state] = admit(stager, data)
    path = object_path(slot, attempt, state.id)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600

    seen: list[int] = []

    def commit(new: StreamState) -> None:
        # Bytes are on disk (and were fsynced) before the offset reaches the ledger.
        assert path.read_bytes()[: new.offset] == data[: new.offset]
        seen.append(new.offset)

    for offset in range(0, len(data), 65_536):
        part = data[offset : offset + 65_536]
        done = stager.write(attempt, state.id, offset, part, sha(part), commit=commit)
    assert seen == [65_536, 131_072, 196_608, 262_144, 300_000]
    assert done.complete
    assert done.offset == len(data)

    st_file = os.stat(path, follow_symlinks=False)
    assert stat.S_ISREG(st_file.st_mode)
    assert stat.S_IMODE(st_file.st_mode) == 0o440
    assert (st_file.st_uid, st_file.st_gid) == (0, slot_gid)
    assert path.read_bytes() == data
    for directory in (slot / STAGING_DIRECTORY, path.parent):
        st_dir = os.stat(directory)
        assert (stat.S_IMODE(st_dir.st_mode), st_dir.st_uid) == (0o700, 0)

    [capability] = stager.capabilities(attempt)
    assert capability == InputCapability(
        id=state.id,
        name="in0.bin",
        bytes=len(data),
        digest=sha(data),
        delivery="stream",
        path=str(path),
        identity=FileIdentity(
            device=st_file.st_dev,
            inode=st_file.st_ino,
            mode=st_file.st_mode,
            bytes=len(data),
            mtime_ns=st_file.st_mtime_ns,
        ),
    )
    assert stager.all_complete(attempt)
    stager.verify_identity(attempt, capability)


def test_several_streams_are_independent_and_all_must_complete(slot: Path, slot_gid: int) -> None:
    a, b = os.urandom(10_000), os.urandom(5)
    stager = Stager(str(slot), slot_gid)
    attempt, [sa, sb] = admit(stager, a, b)
    upload(stager, attempt, sa, a, 4096, Ledger())
    assert not stager.all_complete(attempt)
    assert code_of(stager.capabilities, attempt) == "inputs_incomplete"
    upload(stager, attempt, sb, b, 4096, Ledger())
    assert stager.all_complete(attempt)
    assert [c.id for c in stager.capabilities(attempt)] == [sa.id, sb.id]


def test_an_empty_object_completes_with_one_empty_chunk(slot: Path, slot_gid: int) -> None:
    stager = Stager(str(slot), slot_gid)
    attempt, [state] = admit(stager, b"")
    assert state.digest == EMPTY
    done = stager.write(attempt, state.id, 0, b"", EMPTY)
    assert done.complete
    assert os.stat(object_path(slot, attempt, state.id)).st_size == 0


# -- refusals of one write -------------------------------------------------------


def test_a_write_at_another_offset_is_refused(slot: Path, slot_gid: int) -> None:
    data = os.urandom(8192)
    stager = Stager(str(slot), slot_gid)
    attempt, [state] = admit(stager, data)
    stager.write(attempt, state.id, 0, data[:4096], sha(data[:4096]))
    for offset in (0, 4095, 4097):  # an old offset (a resend) or a gap
        part = data[offset : offset + 100]
        assert code_of(stager.write, attempt, state.id, offset, part, sha(part)) == (
            "input_offset_changed"
        )
    assert stager.status(attempt, state.id).offset == 4096


def test_a_chunk_with_the_wrong_digest_is_refused_and_not_written(
    slot: Path, slot_gid: int
) -> None:
    data = os.urandom(4096)
    stager = Stager(str(slot), slot_gid)
    attempt, [state] = admit(stager, data)
    wrong = sha(data[:100] + b"x")
    assert code_of(stager.write, attempt, state.id, 0, data[:100], wrong) == (
        "input_digest_mismatch"
    )
    assert os.stat(object_path(slot, attempt, state.id)).st_size == 0
    assert stager.write(attempt, state.id, 0, data[:100], sha(data[:100])).offset == 100


class Pieces:
    """A chunk offered in pieces, as an `input_write` row offers it; counts the reads.

    `declared` is the `chunk_size` it claims (a broken row would claim more)."""

    def __init__(self, data: bytes, size: int, declared: int | None = None) -> None:
        self.data, self.size, self.reads = data, size, 0
        self.declared = len(data) if declared is None else declared

    @property
    def chunk_size(self) -> int:
        return self.declared

    def chunk_pieces(self) -> Iterator[bytes]:
        self.reads += 1
        for start in range(0, len(self.data), self.size):
            yield self.data[start : start + self.size]


def test_a_chunk_in_pieces_that_falls_short_of_its_size_is_cut_off_and_refused(
    slot: Path, slot_gid: int
) -> None:
    """The pieces reach the file before their length is known: they are cut off again,
    nothing is committed, and the stream's hash still ends at the durable offset."""
    data = os.urandom(5000)
    stager = Stager(str(slot), slot_gid)
    attempt, [state] = admit(stager, data)
    ledger = Ledger()
    stager.write(attempt, state.id, 0, data[:1000], sha(data[:1000]), commit=ledger)
    sent = Pieces(data[1000:2500], 300, declared=2000)
    assert (
        code_of(stager.write, attempt, state.id, 1000, sent, sha(data[1000:3000]), commit=ledger)
        == "input_digest_mismatch"
    )
    assert sent.reads == 1
    assert len(ledger.commits) == 1
    assert stager.status(attempt, state.id).offset == 1000
    assert os.stat(object_path(slot, attempt, state.id)).st_size == 1000
    rest = Pieces(data[1000:], 300)
    done = stager.write(attempt, state.id, 1000, rest, sha(data[1000:]), commit=ledger)
    assert done.complete  # the declared whole digest: the cut pieces were never hashed in
    assert object_path(slot, attempt, state.id).read_bytes() == data


def test_pieces_are_hashed_once_into_the_stream_not_again_as_a_chunk(
    slot: Path, slot_gid: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A received row's chunk was measured by the request decoder; staging trusts it and
    hashes each byte only into the object's running SHA-256 (bytes it checks itself)."""
    data = os.urandom(64 * 1024)
    stager = Stager(str(slot), slot_gid)
    attempt, [state] = admit(stager, data)
    hashed: list[int] = []
    real = hashlib.sha256

    class Counting:
        def __init__(self, first: bytes = b"") -> None:
            self._inner = real(first)
            hashed.append(len(first))

        def update(self, piece: bytes) -> None:
            hashed.append(len(piece))
            self._inner.update(piece)

        def copy(self) -> Counting:
            twin = Counting.__new__(Counting)
            twin._inner = self._inner.copy()
            return twin

        def hexdigest(self) -> str:
            return self._inner.hexdigest()

    digest = sha(data)
    monkeypatch.setattr(staging, "hashlib", SimpleNamespace(sha256=Counting))
    done = stager.write(attempt, state.id, 0, Pieces(data, 4096), digest)
    assert done.complete
    assert sum(hashed) == len(data)


def test_a_chunk_in_pieces_is_written_as_the_same_chunk_whole(slot: Path, slot_gid: int) -> None:
    data = os.urandom(70_000)
    stager = Stager(str(slot), slot_gid)
    attempt, [whole, pieces] = admit(stager, data, data)
    for offset, end in ((0, 30_000), (30_000, 70_000)):
        part = data[offset:end]
        one = stager.write(attempt, whole.id, offset, part, sha(part))
        many = stager.write(attempt, pieces.id, offset, Pieces(part, 4096), sha(part))
        assert msgspec.structs.replace(many, id=one.id, name=one.name) == msgspec.structs.replace(
            one, identity=many.identity
        )
    assert many.complete
    assert object_path(slot, attempt, pieces.id).read_bytes() == data
    assert object_path(slot, attempt, whole.id).read_bytes() == data


def test_a_refused_chunk_is_not_read(slot: Path, slot_gid: int) -> None:
    """Offset, size and in-flight refusals come before the first piece is read."""
    data = os.urandom(200)
    stager = Stager(str(slot), slot_gid)
    attempt, [first, second] = admit(stager, data, data)
    for offset, chunk in ((5, data[5:10]), (0, data + b"!")):
        sent = Pieces(chunk, 3)
        assert code_of(stager.write, attempt, first.id, offset, sent, sha(chunk)) in {
            "input_offset_changed",
            "input_size_mismatch",
        }
        assert sent.reads == 0
    inside, go = threading.Event(), threading.Event()

    def slow_commit(new: StreamState) -> None:
        inside.set()
        assert go.wait(timeout=60)

    thread = threading.Thread(
        target=stager.write,
        args=(attempt, first.id, 0, data[:100], sha(data[:100])),
        kwargs={"commit": slow_commit},
        daemon=True,
    )
    thread.start()
    try:
        assert inside.wait(timeout=60)
        sent = Pieces(data[:10], 3)
        assert code_of(stager.write, attempt, second.id, 0, sent, sha(data[:10])) == "input_busy"
        assert sent.reads == 0
    finally:
        go.set()
        thread.join(timeout=60)
    assert stager.status(attempt, first.id).offset == 100


def test_a_chunk_past_the_declared_size_is_refused(slot: Path, slot_gid: int) -> None:
    data = os.urandom(1000)
    stager = Stager(str(slot), slot_gid)
    attempt, [state] = admit(stager, data)
    longer = data + b"!"
    assert code_of(stager.write, attempt, state.id, 0, longer, sha(longer)) == (
        "input_size_mismatch"
    )
    assert code_of(stager.write, attempt, state.id, 0, b"", EMPTY) == "input_size_mismatch"
    assert stager.status(attempt, state.id).offset == 0


def test_a_full_digest_mismatch_fails_the_object(slot: Path, slot_gid: int) -> None:
    declared = os.urandom(2000)
    sent = bytearray(declared)
    sent[1500] ^= 0xFF  # every chunk matches its own digest; the whole does not
    stager = Stager(str(slot), slot_gid)
    attempt, [state] = admit(stager, declared)
    ledger = Ledger()
    stager.write(attempt, state.id, 0, bytes(sent[:1000]), sha(bytes(sent[:1000])), commit=ledger)
    tail = bytes(sent[1000:])
    assert (
        code_of(stager.write, attempt, state.id, 1000, tail, sha(tail), commit=ledger)
        == "input_digest_mismatch"
    )
    assert ledger.commits[-1].failed == "input_digest_mismatch"
    assert not ledger.commits[-1].complete
    assert code_of(stager.status, attempt, state.id) == "input_failed"
    assert code_of(stager.write, attempt, state.id, 2000, b"", EMPTY) == "input_failed"
    assert not stager.all_complete(attempt)
    assert code_of(stager.capabilities, attempt) == "inputs_incomplete"
    assert stat.S_IMODE(os.stat(object_path(slot, attempt, state.id)).st_mode) == 0o600


def test_a_completed_object_stays_read_only(slot: Path, slot_gid: int) -> None:
    data = os.urandom(100)
    stager = Stager(str(slot), slot_gid)
    attempt, [state] = admit(stager, data)
    stager.write(attempt, state.id, 0, data, sha(data))
    assert stager.status(attempt, state.id).complete
    assert code_of(stager.write, attempt, state.id, 100, b"", EMPTY) == "input_complete"
    assert code_of(stager.write, attempt, state.id, 0, data, sha(data)) == "input_complete"
    assert object_path(slot, attempt, state.id).read_bytes() == data


def test_unknown_attempts_and_undeclared_objects_are_refused(slot: Path, slot_gid: int) -> None:
    stager = Stager(str(slot), slot_gid)
    attempt, _ = admit(stager, b"x")
    assert code_of(stager.status, new_id(), new_id()) == "attempt_not_staged"
    assert code_of(stager.write, attempt, new_id(), 0, b"x", sha(b"x")) == "input_not_declared"
    assert code_of(stager.status, attempt, "../../etc/passwd") == "input_not_declared"
    assert code_of(stager.register_attempt, "../x", []) == "unsafe_path"
    bad = StreamState(id="../../etc/passwd", name="x", bytes=1, digest=sha(b"x"))
    assert code_of(stager.register_attempt, new_id(), [bad]) == "unsafe_path"


def test_writes_wait_for_preparation(slot: Path, slot_gid: int) -> None:
    stager = Stager(str(slot), slot_gid)
    attempt = new_id()
    state = StreamState(id=new_id(), name="a", bytes=1, digest=sha(b"x"))
    stager.register_attempt(attempt, [state])
    assert code_of(stager.status, attempt, state.id) == "inputs_preparing"
    assert code_of(stager.write, attempt, state.id, 0, b"x", sha(b"x")) == "inputs_preparing"
    assert not (slot / STAGING_DIRECTORY).exists()
    stager.prepare_attempt(attempt)
    assert stager.write(attempt, state.id, 0, b"x", sha(b"x")).complete


# -- concurrency -----------------------------------------------------------------


def test_a_second_write_while_one_is_in_flight_is_refused(slot: Path, slot_gid: int) -> None:
    data = os.urandom(200)
    stager = Stager(str(slot), slot_gid)
    attempt, [first, second] = admit(stager, data, data)
    inside, go = threading.Event(), threading.Event()
    results: list[StreamState] = []

    def slow_commit(new: StreamState) -> None:
        inside.set()
        assert go.wait(timeout=60)

    def writer() -> None:
        results.append(
            stager.write(attempt, first.id, 0, data[:100], sha(data[:100]), commit=slow_commit)
        )

    thread = threading.Thread(target=writer)
    thread.start()
    try:
        assert inside.wait(timeout=60)
        # The guard is per attempt: another object of the same attempt is refused too.
        for obj in (first.id, second.id):
            assert code_of(stager.write, attempt, obj, 0, data[:10], sha(data[:10])) == (
                "input_busy"
            )
        assert code_of(stager.remove_attempt, attempt) == "input_busy"
        # Status stays readable and still shows the committed offset, not the pending one.
        assert stager.status(attempt, first.id).offset == 0
    finally:
        go.set()
        thread.join()
    assert results[0].offset == 100
    assert stager.write(attempt, first.id, 100, data[100:], sha(data[100:])).complete


def test_another_attempt_is_not_blocked(slot: Path, slot_gid: int) -> None:
    stager = Stager(str(slot), slot_gid)
    busy_attempt, [busy] = admit(stager, b"ab")
    free_attempt, [free] = admit(stager, b"cd")
    inside, go = threading.Event(), threading.Event()

    def hold(_: StreamState) -> None:
        inside.set()
        assert go.wait(timeout=60)

    thread = threading.Thread(
        target=stager.write,
        args=(busy_attempt, busy.id, 0, b"a", sha(b"a")),
        kwargs={"commit": hold},
    )
    thread.start()
    try:
        assert inside.wait(timeout=60)
        assert stager.write(free_attempt, free.id, 0, b"cd", sha(b"cd")).complete
    finally:
        go.set()
        thread.join()


# -- durability and restart ------------------------------------------------------


def test_a_restart_resumes_at_the_durable_offset_and_rehashes_the_prefix(
    slot: Path, slot_gid: int
) -> None:
    data = os.urandom(50_000)
    first = Stager(str(slot), slot_gid)
    attempt, [state] = admit(first, data)
    ledger = Ledger()
    for offset in range(0, 30_000, 10_000):
        part = data[offset : offset + 10_000]
        first.write(attempt, state.id, offset, part, sha(part), commit=ledger)
    recorded = ledger.commits[-1]
    assert recorded.offset == 30_000

    restarted = Stager(str(slot), slot_gid)  # no in-memory hasher survives
    restarted.register_attempt(attempt, [recorded])
    assert restarted.prepare_attempt(attempt) == [recorded]
    assert restarted.status(attempt, state.id).offset == 30_000
    done = upload(restarted, attempt, recorded, data, 10_000, ledger)
    assert done.complete
    assert object_path(slot, attempt, state.id).read_bytes() == data


def test_after_a_restart_the_final_digest_covers_the_bytes_on_disk(
    slot: Path, slot_gid: int
) -> None:
    data = os.urandom(20_000)
    first = Stager(str(slot), slot_gid)
    attempt, [state] = admit(first, data)
    ledger = Ledger()
    first.write(attempt, state.id, 0, data[:10_000], sha(data[:10_000]), commit=ledger)
    with open(object_path(slot, attempt, state.id), "r+b") as f:  # corrupt the durable prefix
        f.seek(5)
        f.write(bytes([data[5] ^ 1]))

    restarted = Stager(str(slot), slot_gid)
    restarted.register_attempt(attempt, [ledger.commits[-1]])
    restarted.prepare_attempt(attempt)
    tail = data[10_000:]
    assert (
        code_of(restarted.write, attempt, state.id, 10_000, tail, sha(tail), commit=ledger)
        == "input_digest_mismatch"
    )
    assert ledger.commits[-1].failed == "input_digest_mismatch"


def test_a_failed_commit_keeps_the_old_offset_and_the_chunk_can_be_resent(
    slot: Path, slot_gid: int
) -> None:
    data = os.urandom(3000)
    stager = Stager(str(slot), slot_gid)
    attempt, [state] = admit(stager, data)
    stager.write(attempt, state.id, 0, data[:1000], sha(data[:1000]))

    def broken(_: StreamState) -> None:
        raise OSError(errno.EIO, "ledger unavailable")

    with pytest.raises(OSError, match="ledger unavailable"):
        stager.write(attempt, state.id, 1000, data[1000:2000], sha(data[1000:2000]), commit=broken)
    assert stager.status(attempt, state.id).offset == 1000
    # A client that lost the reply resends from the durable offset (even a shorter chunk).
    stager.write(attempt, state.id, 1000, data[1000:1500], sha(data[1000:1500]))
    done = stager.write(attempt, state.id, 1500, data[1500:], sha(data[1500:]))
    assert done.complete
    assert object_path(slot, attempt, state.id).read_bytes() == data


def test_a_restart_drops_synced_bytes_that_were_never_committed(slot: Path, slot_gid: int) -> None:
    data = os.urandom(3000)
    stager = Stager(str(slot), slot_gid)
    attempt, [state] = admit(stager, data)
    ledger = Ledger()
    stager.write(attempt, state.id, 0, data[:1000], sha(data[:1000]), commit=ledger)
    garbage = os.urandom(1500)  # synced, then the daemon died before the commit

    def die(_: StreamState) -> None:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        stager.write(attempt, state.id, 1000, garbage, sha(garbage), commit=die)
    restarted = Stager(str(slot), slot_gid)
    restarted.register_attempt(attempt, [ledger.commits[-1]])
    restarted.prepare_attempt(attempt)
    done = upload(restarted, attempt, ledger.commits[-1], data, 700, ledger)
    assert done.complete
    assert object_path(slot, attempt, state.id).read_bytes() == data


def test_a_restart_of_a_completed_attempt_checks_its_identity(slot: Path, slot_gid: int) -> None:
    stager = Stager(str(slot), slot_gid)
    attempt, [state] = admit(stager, b"abc")
    done = stager.write(attempt, state.id, 0, b"abc", sha(b"abc"))

    assert done.identity == identity_of(os.stat(object_path(slot, attempt, state.id)))
    again = Stager(str(slot), slot_gid)
    again.register_attempt(attempt, [done])
    assert again.prepare_attempt(attempt) == [done]
    assert again.status(attempt, state.id).complete

    os.utime(object_path(slot, attempt, state.id), ns=(0, 12345))
    changed = Stager(str(slot), slot_gid)
    changed.register_attempt(attempt, [done])
    [state_after] = changed.prepare_attempt(attempt)
    assert state_after.failed == "input_changed"


def test_a_restart_with_a_missing_partial_fails_the_object(slot: Path, slot_gid: int) -> None:
    stager = Stager(str(slot), slot_gid)
    attempt, [state] = admit(stager, b"abcdef")
    done = stager.write(attempt, state.id, 0, b"abc", sha(b"abc"))
    object_path(slot, attempt, state.id).unlink()
    again = Stager(str(slot), slot_gid)
    again.register_attempt(attempt, [done])
    [after] = again.prepare_attempt(attempt)
    assert after.failed == "not_found"
    assert code_of(again.status, attempt, state.id) == "input_failed"


# -- hostile filesystem ----------------------------------------------------------


def test_a_symlinked_staging_directory_is_refused(
    slot: Path, slot_gid: int, tmp_path: Path
) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    (slot / STAGING_DIRECTORY).symlink_to(elsewhere)
    stager = Stager(str(slot), slot_gid)
    attempt = new_id()
    stager.register_attempt(
        attempt, [StreamState(id=new_id(), name="a", bytes=1, digest=sha(b"x"))]
    )
    assert code_of(stager.prepare_attempt, attempt) == "unsafe_path"
    assert list(elsewhere.iterdir()) == []


def test_a_symlinked_attempt_directory_is_refused(
    slot: Path, slot_gid: int, tmp_path: Path
) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    (slot / STAGING_DIRECTORY).mkdir(mode=0o700)
    attempt = new_id()
    (slot / STAGING_DIRECTORY / attempt).symlink_to(elsewhere)
    stager = Stager(str(slot), slot_gid)
    stager.register_attempt(
        attempt, [StreamState(id=new_id(), name="a", bytes=1, digest=sha(b"x"))]
    )
    assert code_of(stager.prepare_attempt, attempt) == "unsafe_path"
    assert list(elsewhere.iterdir()) == []


def test_a_staging_directory_open_to_others_is_refused(slot: Path, slot_gid: int) -> None:
    (slot / STAGING_DIRECTORY).mkdir()
    os.chmod(slot / STAGING_DIRECTORY, 0o755)
    stager = Stager(str(slot), slot_gid)
    attempt = new_id()
    stager.register_attempt(attempt, [])
    assert code_of(stager.prepare_attempt, attempt) == "unsafe_path"


def test_a_symlink_planted_at_the_object_path_fails_the_object(
    slot: Path, slot_gid: int, tmp_path: Path
) -> None:
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    stager = Stager(str(slot), slot_gid)
    attempt, [state] = admit(stager, b"payload!")
    path = object_path(slot, attempt, state.id)
    path.unlink()
    path.symlink_to(victim)
    ledger = Ledger()
    assert code_of(stager.write, attempt, state.id, 0, b"pay", sha(b"pay"), commit=ledger) == (
        "unsafe_path"
    )
    assert ledger.commits[-1].failed == "unsafe_path"
    assert victim.read_bytes() == b"precious"
    assert code_of(stager.write, attempt, state.id, 0, b"pay", sha(b"pay")) == "input_failed"


def test_a_symlink_planted_before_preparation_fails_the_object(
    slot: Path, slot_gid: int, tmp_path: Path
) -> None:
    victim = tmp_path / "victim"
    (slot / STAGING_DIRECTORY).mkdir(mode=0o700)
    attempt, object_id = new_id(), new_id()
    (slot / STAGING_DIRECTORY / attempt).mkdir(mode=0o700)
    (slot / STAGING_DIRECTORY / attempt / object_id).symlink_to(victim)
    stager = Stager(str(slot), slot_gid)
    stager.register_attempt(
        attempt, [StreamState(id=object_id, name="a", bytes=1, digest=sha(b"x"))]
    )
    [state] = stager.prepare_attempt(attempt)
    assert state.failed == "unsafe_path"
    assert not victim.exists()


def test_a_hard_link_planted_at_the_object_fails_it(
    slot: Path, slot_gid: int, tmp_path: Path
) -> None:
    stager = Stager(str(slot), slot_gid)
    attempt, [state] = admit(stager, b"payload!")
    os.link(object_path(slot, attempt, state.id), tmp_path / "alias")
    assert code_of(stager.write, attempt, state.id, 0, b"pay", sha(b"pay")) == ("hard_link_refused")
    assert (tmp_path / "alias").read_bytes() == b""


# -- identity before start -------------------------------------------------------


@pytest.fixture
def completed(slot: Path, slot_gid: int) -> tuple[Stager, str, InputCapability, Path]:
    stager = Stager(str(slot), slot_gid)
    attempt, [state] = admit(stager, b"the input")
    stager.write(attempt, state.id, 0, b"the input", sha(b"the input"))
    [capability] = stager.capabilities(attempt)
    return stager, attempt, capability, Path(capability.path)


def test_a_provider_hard_link_keeps_the_identity(
    completed: tuple[Stager, str, InputCapability, Path], tmp_path: Path
) -> None:
    stager, attempt, capability, path = completed
    ctime = os.stat(path).st_ctime_ns
    os.link(path, tmp_path / "runtime-layout-link")
    assert os.stat(path).st_nlink == 2
    assert os.stat(path).st_ctime_ns >= ctime
    stager.verify_identity(attempt, capability)


def test_a_touched_input_refuses_start(
    completed: tuple[Stager, str, InputCapability, Path],
) -> None:
    stager, attempt, capability, path = completed
    os.utime(path, ns=(0, capability.identity.mtime_ns + 1))
    assert code_of(stager.verify_identity, attempt, capability) == "input_changed"


def test_a_replaced_input_refuses_start(
    completed: tuple[Stager, str, InputCapability, Path], slot_gid: int
) -> None:
    stager, attempt, capability, path = completed
    replacement = path.with_name("replacement")
    shutil.copy2(path, replacement)  # same bytes, mode and mtime; a new inode
    os.chown(replacement, 0, slot_gid)
    os.rename(replacement, path)
    assert code_of(stager.verify_identity, attempt, capability) == "input_changed"


def test_changed_mode_or_group_refuses_start(
    completed: tuple[Stager, str, InputCapability, Path],
) -> None:
    stager, attempt, capability, path = completed
    os.chmod(path, 0o640)
    assert code_of(stager.verify_identity, attempt, capability) == "input_changed"
    os.chmod(path, 0o440)
    stager.verify_identity(attempt, capability)
    os.chown(path, 0, 0)
    assert code_of(stager.verify_identity, attempt, capability) == "input_changed"


def _stat(**fields: int) -> os.stat_result:
    """A stat result as `os.stat` gives it (only the fields the identity reads vary)."""
    values = {"mode": stat.S_IFREG | 0o440, "ino": 7, "dev": 3, "nlink": 2, "uid": 0}
    values |= {"gid": 900, "size": 9, "mtime_ns": 5_000_000_000} | fields
    order = ("mode", "ino", "dev", "nlink", "uid", "gid", "size")
    seconds = values["mtime_ns"] // 1_000_000_000
    head = [values[name] for name in order] + [0, seconds, 0]
    return os.stat_result((*head, 0.0, float(seconds), 0.0, 0, values["mtime_ns"], 0))


@pytest.mark.parametrize(
    "seen",
    [
        None,  # gone
        {"ino": 8},  # replaced by another file, bytes and all the same
        {"dev": 4},
        {"mode": stat.S_IFREG | 0o640},
        {"size": 10},
        {"mtime_ns": 5_000_000_001},
        {"uid": 1000},
        {"gid": 0},
    ],
    ids=["gone", "inode", "device", "mode", "size", "mtime", "owner", "group"],
)
def test_the_identity_rule_refuses_any_difference_and_names_the_input(
    seen: dict[str, int] | None,
) -> None:
    recorded = identity_of(_stat())
    capability = InputCapability(
        id="a" * 32, name="data.bin", bytes=9, digest=EMPTY, delivery="stream",
        path="/slot/ficc-staging/x/" + "a" * 32, identity=recorded,
    )  # fmt: skip
    assert identity_refusal(capability, _stat(), 900) is None
    assert identity_refusal(capability, _stat(nlink=1), 900) is None  # links are not identity
    refusal = identity_refusal(capability, None if seen is None else _stat(**seen), 900)
    assert refusal is not None
    assert refusal.code == "input_changed"
    assert "'data.bin'" in refusal.message
    assert "a" * 32 in refusal.message
    assert "release the attempt and retry the job as a new attempt" in refusal.message


def test_changed_input_names_the_first_changed_stream_of_an_attempt(
    slot: Path, slot_gid: int
) -> None:
    stager = Stager(str(slot), slot_gid)
    attempt, states = admit(stager, b"first", b"second")
    for state, data in zip(states, (b"first", b"second"), strict=True):
        stager.write(attempt, state.id, 0, data, sha(data))
    assert stager.changed_input(attempt) is None
    path = slot / STAGING_DIRECTORY / attempt / states[1].id
    replacement = path.with_name("replacement")
    shutil.copy2(path, replacement)  # same bytes, mode and mtime; a new inode
    os.chown(replacement, 0, slot_gid)
    os.replace(replacement, path)
    refusal = stager.changed_input(attempt)
    assert refusal is not None
    assert refusal.code == "input_changed"
    assert "in1.bin" in refusal.message
    assert code_of(stager.changed_input, new_id()) == "attempt_not_staged"  # not decided here


def test_a_capability_with_a_foreign_path_is_refused(
    completed: tuple[Stager, str, InputCapability, Path],
) -> None:
    stager, attempt, capability, _ = completed
    forged = msgspec.structs.replace(capability, path="/etc/shadow")
    assert code_of(stager.verify_identity, attempt, forged) == "input_changed"


# -- storage faults --------------------------------------------------------------


@pytest.fixture
def tiny_slot(tmp_path: Path) -> Iterator[Path]:
    """A 128 KiB tmpfs as the slot's reserved filesystem."""
    path = tmp_path / "tiny-slot"
    path.mkdir()
    subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=128k,mode=0755", "tmpfs", str(path)], check=True
    )
    yield path
    subprocess.run(["umount", str(path)], check=True)


def test_a_full_filesystem_fails_closed(tiny_slot: Path, slot_gid: int) -> None:
    data = os.urandom(256 * 1024)
    check_capacity(
        [
            InputObject(
                id=new_id(), name="big", bytes=len(data), digest=sha(data), delivery="stream"
            )
        ],
        slot_storage_bytes=1 << 20,  # the configured reservation is larger than the real disk
    )
    stager = Stager(str(tiny_slot), slot_gid)
    attempt, [state] = admit(stager, data)
    ledger = Ledger()
    with pytest.raises(HostError) as excinfo:
        upload(stager, attempt, state, data, 24 * 1024, ledger)
    assert excinfo.value.code == "slot_full"
    good = [c for c in ledger.commits if c.failed is None]
    failed = ledger.commits[-1]
    assert good
    assert failed.failed == "slot_full"
    assert failed.offset == good[-1].offset  # nothing beyond the synced offset is reported
    assert (
        object_path(tiny_slot, attempt, state.id).read_bytes()[: failed.offset]
        == (data[: failed.offset])
    )
    assert code_of(stager.status, attempt, state.id) == "input_failed"
    stager.remove_attempt(attempt)
    assert os.listdir(tiny_slot / STAGING_DIRECTORY) == []


def test_space_is_checked_before_the_first_piece(tiny_slot: Path, slot_gid: int) -> None:
    data = os.urandom(256 * 1024)
    stager = Stager(str(tiny_slot), slot_gid)
    attempt, [state] = admit(stager, data)
    sent = Pieces(data, 4096)
    assert code_of(stager.write, attempt, state.id, 0, sent, sha(data)) == "slot_full"
    assert sent.reads == 0
    assert os.stat(object_path(tiny_slot, attempt, state.id)).st_size == 0
    stager.remove_attempt(attempt)


def test_a_chunk_whose_commit_was_lost_fits_again_on_a_nearly_full_slot(
    tiny_slot: Path, slot_gid: int
) -> None:
    """The last chunk was written and synced but its commit failed (the ledger was
    full, or the daemon died): its bytes must not count against the resend, which
    the client sends at the durable offset as the protocol says."""
    data = os.urandom(96 * 1024)  # fits the 128 KiB slot, but not twice its last chunk
    stager = Stager(str(tiny_slot), slot_gid)
    attempt, [state] = admit(stager, data)
    half = len(data) // 2
    stager.write(attempt, state.id, 0, data[:half], sha(data[:half]))

    def ledger_full(_: StreamState) -> None:
        raise HostError("ledger_full", "the state directory is full")

    last = data[half:]
    try:
        lost = code_of(stager.write, attempt, state.id, half, last, sha(last), commit=ledger_full)
        assert lost == "ledger_full"
        assert stager.status(attempt, state.id).offset == half
        done = stager.write(attempt, state.id, half, last, sha(last))
        assert done.complete
        assert object_path(tiny_slot, attempt, state.id).read_bytes() == data
    finally:
        stager.remove_attempt(attempt)


def test_enospc_during_the_write_fails_closed(
    slot: Path, slot_gid: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    stager = Stager(str(slot), slot_gid)
    attempt, [state] = admit(stager, b"abcdef")
    stager.write(attempt, state.id, 0, b"ab", sha(b"ab"))

    def no_space(fd: int, data: Any, offset: int) -> int:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "pwrite", no_space)
    ledger = Ledger()
    assert code_of(stager.write, attempt, state.id, 2, b"cd", sha(b"cd"), commit=ledger) == (
        "slot_full"
    )
    assert ledger.commits == [StreamState(**{**_fields(state), "offset": 2, "failed": "slot_full"})]


def test_an_fsync_failure_fails_closed(
    slot: Path, slot_gid: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    stager = Stager(str(slot), slot_gid)
    attempt, [state] = admit(stager, b"abcdef")

    def broken_fsync(fd: int) -> None:
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(os, "fsync", broken_fsync)
    ledger = Ledger()
    assert code_of(stager.write, attempt, state.id, 0, b"ab", sha(b"ab"), commit=ledger) == (
        "input_storage_failed"
    )
    monkeypatch.undo()
    assert ledger.commits[-1].offset == 0
    assert ledger.commits[-1].failed == "input_storage_failed"
    assert code_of(stager.write, attempt, state.id, 0, b"ab", sha(b"ab")) == "input_failed"


def _fields(state: StreamState) -> dict[str, Any]:
    return {f: getattr(state, f) for f in state.__struct_fields__}


# -- removal ---------------------------------------------------------------------


def test_remove_attempt_deletes_the_staged_files(slot: Path, slot_gid: int, tmp_path: Path) -> None:
    stager = Stager(str(slot), slot_gid)
    attempt, [a, b] = admit(stager, b"abc", b"de")
    stager.write(attempt, a.id, 0, b"abc", sha(b"abc"))
    os.link(object_path(slot, attempt, a.id), tmp_path / "provider-link")
    assert object_path(slot, attempt, b.id).exists()
    stager.remove_attempt(attempt)
    assert not (slot / STAGING_DIRECTORY / attempt).exists()
    assert (tmp_path / "provider-link").read_bytes() == b"abc"  # the provider's link is its own
    assert code_of(stager.status, attempt, a.id) == "attempt_not_staged"
    stager.remove_attempt(attempt)  # idempotent


def test_remove_attempt_refuses_unexpected_entries(slot: Path, slot_gid: int) -> None:
    stager = Stager(str(slot), slot_gid)
    attempt, [state] = admit(stager, b"abc")
    directory = slot / STAGING_DIRECTORY / attempt
    for plant in ("fifo", "dir", "symlink", "name"):
        if plant == "fifo":
            os.mkfifo(directory / new_id())
        elif plant == "dir":
            (directory / new_id()).mkdir()
        elif plant == "symlink":
            (directory / new_id()).symlink_to("/etc/passwd")
        else:
            (directory / "notes.txt").write_bytes(b"x")
        assert code_of(stager.remove_attempt, attempt) == "unexpected_entry"
        assert object_path(slot, attempt, state.id).exists()  # nothing was removed
        for entry in directory.iterdir():
            if entry.name == state.id:
                continue
            if entry.is_dir() and not entry.is_symlink():
                entry.rmdir()
            else:
                entry.unlink()
    stager.remove_attempt(attempt)
    assert not directory.exists()


def test_a_removed_attempt_takes_no_more_writes_and_fails_identity(
    completed: tuple[Stager, str, InputCapability, Path],
) -> None:
    stager, attempt, capability, _ = completed
    stager.remove_attempt(attempt)
    assert code_of(stager.write, attempt, capability.id, 0, b"", EMPTY) == "attempt_not_staged"
    assert code_of(stager.prepare_attempt, attempt) == "attempt_not_staged"
    assert code_of(stager.verify_identity, attempt, capability) == "input_changed"


def test_remove_attempt_without_a_directory_succeeds(slot: Path, slot_gid: int) -> None:
    Stager(str(slot), slot_gid).remove_attempt(new_id())


# -- pure rules ------------------------------------------------------------------


def test_check_capacity_counts_only_streamed_inputs() -> None:
    def obj(size: int, delivery: str) -> InputObject:
        data = b"x" * size
        return InputObject(id=new_id(), name="n", bytes=size, digest=sha(data), delivery=delivery)

    inputs = [obj(600, "stream"), obj(400, "stream"), obj(10_000, "local")]
    check_capacity(inputs, 1000)
    assert code_of(check_capacity, inputs, 999) == "slot_capacity"
    assert [s.bytes for s in streams_of(inputs)] == [600, 400]


STATE = StreamState(id="0" * 32, name="n", bytes=100, digest=sha(b"x"), offset=40)


@given(
    offset=st.integers(0, 200),
    length=st.integers(0, 200),
    digest_ok=st.booleans(),
    in_flight=st.booleans(),
    complete=st.booleans(),
    failed=st.booleans(),
)
def test_plan_write_accepts_exactly_the_valid_chunks(
    offset: int, length: int, digest_ok: bool, in_flight: bool, complete: bool, failed: bool
) -> None:
    state = StreamState(
        **{**_fields(STATE), "complete": complete, "failed": "slot_full" if failed else None}
    )
    refusal = plan_write(state, offset, length, chunk_digest_ok=digest_ok, in_flight=in_flight)
    valid = (
        not in_flight
        and not failed
        and not complete
        and offset == 40
        and 0 < length <= 60
        and digest_ok
    )
    assert (refusal is None) == valid
    if in_flight:
        assert refusal is not None
        assert refusal.code == "input_busy"


def test_plan_write_codes() -> None:
    def code(state: StreamState, offset: int, length: int, ok: bool = True) -> str | None:
        refusal = plan_write(state, offset, length, chunk_digest_ok=ok, in_flight=False)
        return None if refusal is None else refusal.code

    assert code(STATE, 40, 60) is None
    assert code(STATE, 41, 10) == "input_offset_changed"
    assert code(STATE, 40, 61) == "input_size_mismatch"
    assert code(STATE, 40, 0) == "input_size_mismatch"
    assert code(STATE, 40, 10, ok=False) == "input_digest_mismatch"
    done = StreamState(**{**_fields(STATE), "offset": 100, "complete": True})
    assert code(done, 100, 0) == "input_complete"
    empty = StreamState(id="0" * 32, name="n", bytes=0, digest=EMPTY)
    assert code(empty, 0, 0) is None
