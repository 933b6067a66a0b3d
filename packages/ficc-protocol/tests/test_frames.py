"""The frame codec: exact framing, bounded errors, and never buffering past the bound."""

from __future__ import annotations

import struct

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import SOAK
from ficc.execution._executor import encode_frame_into
from ficc.execution.errors import ErrorCode
from ficc.execution.frames import (
    REPLY_MAX,
    REQUEST_MAX,
    FrameDecoder,
    FrameError,
    encode_frame,
)

CASES = 100_000 if SOAK else 5_000


def test_bounds() -> None:
    assert REQUEST_MAX == 12 * 1024 * 1024
    assert REPLY_MAX == 2 * 1024 * 1024


def test_encode_is_big_endian_length_then_payload() -> None:
    assert encode_frame(b"{}", 10) == b"\x00\x00\x00\x02{}"
    assert encode_frame(b"x" * 258, 1000)[:4] == b"\x00\x00\x01\x02"


def test_encode_refuses_empty_and_oversized() -> None:
    with pytest.raises(FrameError) as info:
        encode_frame(b"", 10)
    assert info.value.code == ErrorCode.BAD_FRAME
    with pytest.raises(FrameError) as info:
        encode_frame(b"x" * 11, 10)
    assert info.value.code == ErrorCode.FRAME_TOO_LARGE
    assert encode_frame(b"x" * 10, 10)[4:] == b"x" * 10


def test_encode_into_writes_the_same_frame_as_encode_and_reuses_the_buffer() -> None:
    encoder = msgspec.json.Encoder(order="sorted")
    buffer = bytearray()
    allocations = set()
    for value in [{"b": b"x" * 300_000, "a": 1}, {"a": 2}, [b"\x00" * 70_000], "short"] * 2:
        size = encode_frame_into(encoder, value, buffer, REPLY_MAX)
        assert bytes(buffer) == encode_frame(encoder.encode(value), REPLY_MAX)
        assert size == len(buffer)
        allocations.add(buffer.__alloc__())
    assert len(allocations) == 1  # a small frame does not give the memory of a large one back


def test_encode_into_refuses_an_oversized_payload() -> None:
    encoder = msgspec.json.Encoder()
    buffer = bytearray()
    with pytest.raises(FrameError) as info:
        encode_frame_into(encoder, "x" * 9, buffer, 10)  # 11 bytes with the quotes
    assert info.value.code == ErrorCode.FRAME_TOO_LARGE
    assert encode_frame_into(encoder, "x" * 8, buffer, 10) == 14
    assert bytes(buffer) == b"\x00\x00\x00\x0a" + b'"' + b"x" * 8 + b'"'


def test_decoder_yields_frames_across_any_split() -> None:
    stream = encode_frame(b"one", 100) + encode_frame(b"two!", 100) + encode_frame(b"3", 100)
    for cut in range(len(stream) + 1):
        decoder = FrameDecoder(100)
        frames = decoder.feed(stream[:cut]) + decoder.feed(stream[cut:])
        assert frames == [b"one", b"two!", b"3"]
        assert decoder.idle


def test_decoder_byte_at_a_time() -> None:
    decoder = FrameDecoder(100)
    out = []
    for byte in encode_frame(b"hello", 100):
        assert not out
        out += decoder.feed(bytes([byte]))
    assert out == [b"hello"]


def test_zero_length_is_a_bad_frame() -> None:
    decoder = FrameDecoder(100)
    with pytest.raises(FrameError) as info:
        decoder.feed(b"\x00\x00\x00\x00{}")
    assert info.value.code == ErrorCode.BAD_FRAME


def test_oversized_length_refused_before_any_payload_is_buffered() -> None:
    decoder = FrameDecoder(REQUEST_MAX)
    header = struct.pack(">I", REQUEST_MAX + 1)
    with pytest.raises(FrameError) as info:
        decoder.feed(header + b"x" * 1000)
    assert info.value.code == ErrorCode.FRAME_TOO_LARGE
    assert decoder.buffered == 0
    with pytest.raises(FrameError):  # and it stays failed
        decoder.feed(b"\x00\x00\x00\x01x")


def test_largest_request_frame_passes() -> None:
    payload = b"x" * REQUEST_MAX
    decoder = FrameDecoder(REQUEST_MAX)
    frame = encode_frame(payload, REQUEST_MAX)
    assert decoder.feed(frame[: REQUEST_MAX // 2]) == []
    assert decoder.buffered == REQUEST_MAX // 2 - 4
    assert decoder.feed(frame[REQUEST_MAX // 2 :]) == [payload]


def test_frames_before_an_error_are_delivered_first() -> None:
    decoder = FrameDecoder(10)
    assert decoder.feed(b"\x00\x00\x00\x01a\x00\x00\x00\x00") == [b"a"]
    with pytest.raises(FrameError):
        decoder.feed(b"")


def test_idle_tells_clean_eof_from_truncation() -> None:
    decoder = FrameDecoder(100)
    assert decoder.idle
    decoder.feed(b"\x00\x00")
    assert not decoder.idle
    decoder.feed(b"\x00\x02{")
    assert not decoder.idle
    assert decoder.feed(b"}") == [b"{}"]
    assert decoder.idle


def test_max_length_must_fit_the_header() -> None:
    with pytest.raises(ValueError, match="max_length"):
        FrameDecoder(0)
    with pytest.raises(ValueError, match="max_length"):
        FrameDecoder(2**32)


def _reference(stream: bytes, max_length: int) -> tuple[list[bytes], str | None]:
    """What a whole-buffer parser sees: complete frames, then an error code or None."""
    frames, i = [], 0
    while len(stream) - i >= 4:
        (length,) = struct.unpack(">I", stream[i : i + 4])
        if length == 0:
            return frames, "bad_frame"
        if length > max_length:
            return frames, "frame_too_large"
        if len(stream) - i - 4 < length:
            break
        frames.append(stream[i + 4 : i + 4 + length])
        i += 4 + length
    return frames, None


@st.composite
def _streams(draw: st.DrawFn) -> tuple[bytes, list[int], int]:
    max_length = draw(st.integers(1, 64))
    if draw(st.booleans()):  # mostly well-formed: frames, maybe then junk
        payloads = draw(st.lists(st.binary(min_size=1, max_size=max_length), max_size=5))
        stream = b"".join(struct.pack(">I", len(p)) + p for p in payloads)
        stream += draw(st.binary(max_size=12))
    else:
        stream = draw(st.binary(max_size=200))
    cuts = sorted(draw(st.lists(st.integers(0, len(stream)), max_size=8)))
    return stream, cuts, max_length


@pytest.mark.soak
@settings(max_examples=CASES, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(_streams())
def test_any_bytes_any_split_frames_or_bounded_error(case: tuple[bytes, list[int], int]) -> None:
    stream, cuts, max_length = case
    decoder = FrameDecoder(max_length)
    frames: list[bytes] = []
    error: str | None = None
    for start, end in [*zip([0, *cuts], [*cuts, len(stream)], strict=True), (0, 0)]:
        try:
            frames += decoder.feed(stream[start:end])
        except FrameError as exc:
            error = exc.code
            break
        finally:
            assert decoder.buffered <= 4 + max_length
    assert (frames, error) == _reference(stream, max_length)


def test_eof_between_frames_is_clean() -> None:
    decoder = FrameDecoder(16)
    assert decoder.feed(b"\x00\x00\x00\x02hi") == [b"hi"]
    decoder.eof()


def test_eof_inside_a_header_is_bad_frame() -> None:
    decoder = FrameDecoder(16)
    decoder.feed(b"\x00\x00")
    with pytest.raises(FrameError, match="inside a frame header") as caught:
        decoder.eof()
    assert caught.value.code == "bad_frame"


def test_eof_inside_a_payload_names_how_much_arrived() -> None:
    decoder = FrameDecoder(16)
    decoder.feed(b"\x00\x00\x00\x0aabc")
    with pytest.raises(FrameError, match="after 3 of 10 frame bytes"):
        decoder.eof()


def test_receiving_into_the_decoder_gives_the_payload_buffer_itself() -> None:
    """The zero-copy way in: header first, then one buffer of the declared length."""
    decoder = FrameDecoder(16)
    stream = memoryview(encode_frame(b"hello", 16) + encode_frame(b"!", 16))
    frames = []
    while stream:
        target = decoder.want()
        count = min(len(target), len(stream), 2)  # a peer that sends two bytes at a time
        target[:count] = stream[:count]
        stream = stream[count:]
        payload = decoder.received(count)
        if payload is not None:
            frames.append(payload)
    assert frames == [bytearray(b"hello"), bytearray(b"!")]
    assert decoder.idle


def test_a_reader_may_give_the_payload_buffer_of_the_declared_length() -> None:
    """`allocate` is asked once per frame, after the length is checked; stale bytes in
    a reused buffer are all overwritten before the frame is handed back."""
    reused = bytearray(b"stale stale")
    asked: list[int] = []

    def allocate(length: int) -> bytearray:
        asked.append(length)
        del reused[length:]
        return reused

    decoder = FrameDecoder(16, allocate)
    target = decoder.want()
    target[:4] = struct.pack(">I", 5)
    assert decoder.received(4) is None
    assert asked == []
    decoder.want()[:5] = b"hello"
    assert decoder.received(5) is reused
    assert reused == b"hello"
    assert asked == [5]


def test_a_payload_buffer_of_another_length_is_refused() -> None:
    decoder = FrameDecoder(16, lambda length: bytearray(length + 1))
    decoder.want()[:4] = struct.pack(">I", 5)
    decoder.received(4)
    with pytest.raises(ValueError, match="allocate gave 6 bytes, not 5"):
        decoder.want()


def test_the_length_is_known_before_payload_memory_is_taken() -> None:
    decoder = FrameDecoder(REQUEST_MAX)
    decoder.want()[:4] = struct.pack(">I", REQUEST_MAX)
    assert decoder.received(4) is None
    assert decoder.expected == REQUEST_MAX
    assert decoder.buffered == 0
    decoder.want()[:4] = b"abcd"
    assert decoder.received(4) is None
    assert decoder.buffered == 4


def test_receiving_into_refuses_a_bad_length_at_once() -> None:
    decoder = FrameDecoder(10)
    decoder.want()[:4] = struct.pack(">I", 11)
    with pytest.raises(FrameError) as info:
        decoder.received(4)
    assert info.value.code == ErrorCode.FRAME_TOO_LARGE
    with pytest.raises(FrameError):  # and it stays failed
        decoder.want()
