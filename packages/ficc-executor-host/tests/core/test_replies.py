"""The daemon's reply encoding: the wire's bytes, with collect data written by pybase64."""

from __future__ import annotations

import os
import threading

import pytest

from ficc.execution.host.core import replies
from ficc.execution.host.core.replies import Base64Data, encode_reply
from ficc.execution.protocol import COLLECT_MAX_BYTES
from ficc.execution.wire import ReadRow, ReadsReply
from ficc.execution.wire import encode_reply as wire_encode_reply
from ficc_testkit.plans import new_id

PIECE = replies._PIECE_BYTES
SIZES = [0, 1, 2, 3, 4, 5, PIECE - 1, PIECE, PIECE + 1, 2 * PIECE + 2,
         COLLECT_MAX_BYTES - 1, COLLECT_MAX_BYTES]  # fmt: skip


def _row(data: object, offset: int = 0) -> ReadRow:
    size = len(data)  # type: ignore[arg-type]
    return ReadRow(
        attempt_id="c" * 32,
        generation=1,
        plan_digest="sha256:" + "0" * 64,
        object="output:result",
        offset=offset,
        data=data,  # type: ignore[arg-type]
        next_offset=offset + size,
        eof=True,
        complete=False,
        identity="sha256:" + "1" * 64,
    )


def _as_sent(rows: list[ReadRow]) -> list[ReadRow]:
    """The same rows as collect hands them to the server: data as `Base64Data` views."""
    return [
        _row(Base64Data(memoryview(bytearray(row.data))), row.offset) for row in rows
    ]  # fmt: skip


@pytest.mark.parametrize("size", SIZES)
def test_a_read_is_sent_as_the_wire_encodes_it(size: int) -> None:
    data = os.urandom(size)
    rows = [_row(data), _row(data[: size // 2], offset=7)]  # two rows share the text buffer
    reply = ReadsReply(version=1, id=new_id(), results=rows)
    sent = ReadsReply(version=1, id=reply.id, results=_as_sent(rows))
    assert encode_reply(sent) == wire_encode_reply(reply)


def test_a_view_of_wider_items_is_sent_as_its_bytes() -> None:
    data = os.urandom(4 * 1001)
    view = memoryview(bytearray(data)).cast("I")  # 1001 items of 4 bytes
    assert len(Base64Data(view)) == len(data)
    reply = ReadsReply(version=1, id=new_id(), results=[_row(data)])
    sent = ReadsReply(version=1, id=reply.id, results=[_row(Base64Data(view))])
    assert encode_reply(sent) == wire_encode_reply(reply)


def test_data_larger_than_a_collect_read_is_still_encoded_whole() -> None:
    data = os.urandom(COLLECT_MAX_BYTES * 2 + 1)
    reply = ReadsReply(version=1, id=new_id(), results=[_row(data)])
    sent = ReadsReply(version=1, id=reply.id, results=_as_sent([_row(data)]))
    assert encode_reply(sent) == wire_encode_reply(reply)


def test_threads_encoding_at_once_each_get_their_own_bytes() -> None:
    datas = [os.urandom(COLLECT_MAX_BYTES - n) for n in range(4)]
    expected = [wire_encode_reply(ReadsReply(version=1, id="a" * 32, results=[_row(d)]))
                for d in datas]  # fmt: skip
    got: list[list[bytes]] = [[] for _ in datas]
    start = threading.Barrier(len(datas))

    def encode(index: int) -> None:
        start.wait()
        for _ in range(20):
            sent = ReadsReply(version=1, id="a" * 32, results=_as_sent([_row(datas[index])]))
            got[index].append(encode_reply(sent))

    threads = [threading.Thread(target=encode, args=(i,)) for i in range(len(datas))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert all(encoded == [expected[i]] * 20 for i, encoded in enumerate(got))


def test_a_reply_holding_anything_else_is_refused() -> None:
    bad = ReadsReply(version=1, id=new_id(), results=[_row(_Sized())])
    with pytest.raises(TypeError, match="cannot carry _Sized"):
        encode_reply(bad)


class _Sized:
    """Has a length (a row counts its data) but is no buffer."""

    def __len__(self) -> int:
        return 1
