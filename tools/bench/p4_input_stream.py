"""P4: streamed input throughput over the socket vs the bare work of storing the chunks.

Value: one 256 MiB streamed input (32 MiB with --quick) sent to the real daemon as
`input_write` requests of `input_chunk_bytes` (8 MiB), one after another, by a client
forked as the transport account over transport.sock. Per chunk the daemon reads the
frame, decodes and validates it (base64, the chunk's SHA-256), checks fence, lease and
offer, pwrites and fsyncs the chunk into the slot's staging file, updates the object's
running SHA-256, commits the new offset in the ledger (SQLite, synchronous), replies.
The client's requests are encoded before the clock starts (the baseline encodes
nothing either), so the figure is what the daemon and the socket cost.

Baseline: the same base64 chunks, in one process: base64-decode, SHA-256 of the chunk,
pwrite, fsync, into a file on a slot filesystem of its own (a configured slot of a
class no plan asks for): the same kind of loop-mounted filesystem, of the same size,
on the same disk as the daemon's staging. (A daemon round leaves its 256 MiB staged in
its slot, so the baseline cannot share that slot's filesystem.)

Ratio = value rate / baseline rate (higher is better); the target is >= 0.7x, in every run.
Rounds alternate daemon and baseline; each daemon round streams a new attempt (a
stream is written once), and the figure is the median round.
"""

from __future__ import annotations

import base64
import hashlib
import os
import statistics
import time

from daemon_support import MIB, BenchHost, SlotPlan, bench_host, decode, timed_exchanges
from figures import Figure

from ficc.execution.plan import InputObject
from ficc.execution.protocol import InputWrite, InputWriteRequest, encode_request
from ficc_testkit.digests import digest_of, of_hasher
from ficc_testkit.driver import fence_fields, row_code, rows
from ficc_testkit.plans import new_id
from ficc_testkit.waits import wait_for

CHUNK = 8 * MIB


def _chunks(size: int) -> list[bytes]:
    return [os.urandom(min(CHUNK, size - offset)) for offset in range(0, size, CHUNK)]


def _wait_staged(host: BenchHost, plan: object, object_id: str) -> None:
    """Until staging is initialised (input_status stops answering inputs_preparing)."""
    from ficc.execution.protocol import InputStatusRequest, ObjectRef  # noqa: PLC0415

    ref = ObjectRef(**fence_fields(plan), object=object_id)  # type: ignore[arg-type]

    def staged() -> bool:
        request = InputStatusRequest(version=1, id=new_id(), objects=[ref])
        (row,) = rows(host.send(request))
        return row_code(row) != "inputs_preparing"

    wait_for(staged, "staging to be initialised")


def _daemon_round(host: BenchHost, chunks: list[bytes], encoded: list[str]) -> float:
    """Seconds to stream every chunk of a fresh attempt through the daemon."""

    size = sum(len(c) for c in chunks)
    whole = hashlib.sha256()
    for chunk in chunks:
        whole.update(chunk)
    item = InputObject(
        id=new_id(),
        name="input.bin",
        bytes=size,
        digest=of_hasher(whole),
        delivery="stream",
    )
    plan = host.plan(slot_class="big", inputs=[item], storage_bytes=size + 16 * MIB)
    host.prepare([plan])
    _wait_staged(host, plan, item.id)
    fence = fence_fields(plan)
    frames = []
    offset = 0
    for chunk, data in zip(chunks, encoded, strict=True):
        write = InputWrite(
            **fence,
            object=item.id,
            offset=offset,
            data=data,
            digest=digest_of(chunk),
        )
        frames.append(encode_request(InputWriteRequest(version=1, id=new_id(), writes=[write])))
        offset += len(chunk)
    path = host.transport

    def client() -> bytes:
        elapsed, _, replies = timed_exchanges(path, frames)
        last = decode(replies[-1])["results"][0]
        assert last.get("complete") is True, last
        return repr(elapsed).encode()

    return float(host.as_transport(client))


def _baseline_round(directory: str, encoded: list[str]) -> float:
    """Seconds to decode, hash, pwrite and fsync every chunk in this process."""
    path = os.path.join(directory, f"p4-baseline-{os.getpid()}")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        start = time.perf_counter()
        offset = 0
        for data in encoded:
            chunk = base64.b64decode(data, validate=True)
            hashlib.sha256(chunk).hexdigest()
            os.pwrite(fd, chunk, offset)
            os.fsync(fd)
            offset += len(chunk)
        return time.perf_counter() - start
    finally:
        os.close(fd)
        os.unlink(path)


def run(quick: bool) -> list[Figure]:
    size = 32 * MIB if quick else 256 * MIB
    rounds = 1 if quick else 3
    chunks = _chunks(size)
    encoded = [base64.b64encode(c).decode("ascii") for c in chunks]
    slots = [SlotPlan("big", size + 64 * MIB) for _ in range(rounds)]
    slots.append(SlotPlan("baseline", size + 64 * MIB))  # never admitted: the baseline's
    daemon_s, baseline_s = [], []
    with bench_host(slots) as host:
        for _ in range(rounds):
            daemon_s.append(_daemon_round(host, chunks, encoded))
            baseline_s.append(_baseline_round(str(host.slot_paths[-1]), encoded))
    mib = size / MIB
    rate = mib / statistics.median(daemon_s)
    base = mib / statistics.median(baseline_s)
    return [
        Figure(
            "P4",
            f"input_write {mib:.0f} MiB in 8 MiB chunks (MiB/s)",
            rate,
            "MiB/s",
            base,
            rate / base,
            target=0.7,
            higher_is_better=True,
        )
    ]
