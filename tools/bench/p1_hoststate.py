"""P1: hoststate `begin` + `advance` latency vs a bare durable replace of the same bytes.

Each sample is one `begin` of a new operation plus one `advance` (queued -> cancelled,
so the next `begin` is not blocked): two durable saves. Its baseline, measured in the
same loop right after it, is two bare durable replaces (write, fsync, close, rename,
directory fsync) of the snapshot bytes that `advance` just wrote. Sizes: 100 records,
and about 8 MiB of state (built directly with the codec, then acquired). New IDs are
random, so they land anywhere in the sorted snapshot, not just at its end.
"""

from __future__ import annotations

import os
import random
import statistics
import tempfile
import time

from figures import Figure

from ficc.hoststate import Operation, Status, acquire, snapshot
from ficc.hoststate import marker as marker_codec

HOST = "bench-host"
TARGET = 1.25


def _hash(rng: random.Random) -> str:
    return "sha256:" + rng.randbytes(32).hex()


def _resolved(count: int, rng: random.Random) -> list[Operation]:
    return [
        Operation(
            id=f"op-{rng.randbytes(12).hex()}",
            plan_hash=_hash(rng),
            status=Status.SUCCEEDED,
            revision=3,
        )
        for _ in range(count)
    ]


def _seed_store(directory: str, operations: list[Operation]) -> int:
    data = snapshot.encode(HOST, operations)
    with open(os.path.join(directory, "state.json"), "wb", opener=_opener) as f:
        f.write(data)
    with open(os.path.join(directory, "host.lock"), "wb", opener=_opener) as f:
        f.write(marker_codec.encode(HOST))
    return len(data)


def _opener(path: str, flags: int) -> int:
    return os.open(path, flags, 0o600)


def _durable_replace(dir_fd: int, data: bytes) -> None:
    """The baseline: exactly the save sequence, with nothing else around it."""
    fd = os.open("base.tmp", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600, dir_fd=dir_fd)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace("base.tmp", "state.json", src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    os.fsync(dir_fd)


def _measure(records: int, samples: int, label: str) -> list[Figure]:
    rng = random.Random(records)
    with tempfile.TemporaryDirectory(prefix="ficc-p1-") as tmp:
        store, base = os.path.join(tmp, "store"), os.path.join(tmp, "base")
        os.mkdir(store, 0o700)
        os.mkdir(base, 0o700)
        size = _seed_store(store, _resolved(records, rng))
        base_fd = os.open(base, os.O_RDONLY | os.O_DIRECTORY)
        ours, theirs = [], []
        try:
            with acquire(store, HOST) as session:
                for _ in range(samples):
                    op_id, plan = f"op-{rng.randbytes(12).hex()}", _hash(rng)
                    start = time.perf_counter()
                    op, _ = session.begin(op_id, plan)
                    session.advance(op.id, op.revision, Status.CANCELLED)
                    ours.append(time.perf_counter() - start)
                    with open(os.path.join(store, "state.json"), "rb") as f:
                        data = f.read()
                    start = time.perf_counter()
                    _durable_replace(base_fd, data)
                    _durable_replace(base_fd, data)
                    theirs.append(time.perf_counter() - start)
        finally:
            os.close(base_fd)
    value, baseline = statistics.median(ours), statistics.median(theirs)
    name = f"begin+advance, {label} ({size / 2**20:.2f} MiB)"
    return [Figure("P1", name, value * 1e3, "ms", baseline * 1e3, value / baseline, TARGET)]


def run(quick: bool) -> list[Figure]:
    samples = 20 if quick else 80
    big = 8 * 2**20 // 150  # about 150 bytes per record with these IDs
    return [*_measure(100, samples, "100 records"), *_measure(big, samples, "~8 MiB")]


if __name__ == "__main__":
    for figure in run(quick=False):
        print(figure.line())
