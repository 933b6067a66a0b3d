"""`receive_request` (the executor's decoding call) answers exactly as `decode_request`.

The executor decodes `input_write` data from the raw JSON in the frame instead of from
a base64 `str`. These tests hold the two decoders to the same answers: the same
documents accepted with the same chunks, and every refusal with the same code,
message, path and request ID. The server-side model alone (`ReceivedInputWriteRequest`,
without the fallback to `decode_request`) is held to the same acceptance, and to the
same code and path for every fault in `data`.
"""

from __future__ import annotations

import base64
import hashlib
import json
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ficc_protocol_examples as ex
from conftest import SOAK
from ficc.execution import _executor
from ficc.execution._executor import (
    _PIECE_BYTES,
    ReceivedInputWrite,
    ReceivedInputWriteRequest,
    _plain_pieces,
    receive_request,
)
from ficc.execution.errors import ErrorCode, ProtocolError
from ficc.execution.protocol import (
    INPUT_CHUNK_MAX_BYTES,
    InputWrite,
    InputWriteRequest,
    decode_request,
    encode_request,
    explain,
)

DOCUMENTS = 20_000 if SOAK else 1_000
MUTATIONS = 100_000 if SOAK else 3_000
U63 = 2**63 - 1
B64 = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"


@pytest.fixture(autouse=True, params=["pybase64", "msgspec"])
def piece_decoder(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Every test with each of the fast path's base64 decoders: pybase64 where it is
    installed (the executor host's), msgspec alone (a controller's install)."""
    if request.param == "pybase64":
        if _executor.SIMD_B64DECODE is None:
            pytest.skip("pybase64 is not installed here; the executor host depends on it")
        monkeypatch.setattr(_executor, "_decode_piece", _executor._pybase64_piece)
    else:
        monkeypatch.setattr(_executor, "_decode_piece", _executor._msgspec_piece)
    return str(request.param)


def sized(n: int) -> settings:
    return settings(
        max_examples=n, deadline=None, suppress_health_check=list(HealthCheck), database=None
    )


# --- comparing answers ---------------------------------------------------------------


def _answer(decode: Any, frame: bytes, **bound: int) -> tuple[Any, ...]:
    """What a decoding call says about `frame`, in a form both decoders can match."""
    try:
        request = decode(frame, **bound)
    except ProtocolError as exc:
        return ("refused", exc.code, exc.message, exc.path, exc.request_id)
    if isinstance(request, InputWriteRequest | ReceivedInputWriteRequest):
        rows = [
            (w.attempt_id, w.generation, w.plan_digest, w.object, w.offset, _chunk(w), w.digest)
            for w in request.writes
        ]
        return ("input_write", request.id, rows)
    return ("other", request)


def _chunk(write: InputWrite | ReceivedInputWrite) -> bytes:
    """The chunk as the executor reads it: from its pieces, checked against `chunk`."""
    pieces = b"".join(write.chunk_pieces())
    assert write.chunk_size == len(pieces)
    return pieces


def _same_answer(frame: bytes, **bound: int) -> tuple[Any, ...]:
    expected = _answer(decode_request, frame, **bound)
    assert _answer(receive_request, frame, **bound) == expected
    return expected


def _server_model(frame: bytes) -> tuple[Any, ...]:
    """The server-side model alone: accepted, or the refusal's (code, path)."""
    try:
        msgspec.json.decode(frame, type=ReceivedInputWriteRequest)
    except ProtocolError as exc:
        return ("refused", exc.code, exc.path)
    except msgspec.ValidationError as exc:
        return ("refused", ErrorCode.INVALID_REQUEST, explain(exc)[1])
    return ("accepted",)


def _reference(frame: bytes) -> tuple[Any, ...]:
    try:
        decode_request(frame)
    except ProtocolError as exc:
        return ("refused", exc.code, exc.path)
    return ("accepted",)


# --- generated input_write documents ------------------------------------------------

_chunks = st.binary(max_size=96)


@st.composite
def _data(draw: st.DrawFn, chunk: bytes) -> Any:
    """The `data` of a row: mostly the chunk's canonical base64, else one kind of fault."""
    text = base64.b64encode(chunk).decode()
    kind = draw(st.integers(0, 11))
    if kind <= 5 or not text:
        return text
    body = text.rstrip("=")
    padding = len(text) - len(body)
    if kind == 6 and padding:  # the same bytes spelled with nonzero unused bits
        unused = draw(st.integers(1, (1 << 2 * padding) - 1))
        return body[:-1] + B64[B64.index(body[-1]) | unused] + "=" * padding
    if kind == 6:  # another last character
        return body[:-1] + draw(st.sampled_from(B64 + "="))
    if kind == 7:  # padding dropped, doubled, or moved
        return draw(st.sampled_from([text.rstrip("="), text + "=", "=" + text[1:], text + "AAAA"]))
    if kind == 8:  # a foreign character somewhere
        at = draw(st.integers(0, len(text)))
        bad = draw(st.sampled_from([" ", "\n", "-", "_", "é", "\\", '"', "\x00", "\x7f"]))
        return text[:at] + bad + text[at:]
    if kind == 9:  # not a string at all
        return draw(st.sampled_from([0, None, True, [], {}, [text], 1.5, {"data": text}]))
    if kind == 10:  # a random string over the alphabet and padding
        return draw(st.text(B64 + "=", max_size=24))
    return text[: draw(st.integers(0, len(text)))]  # cut short


@st.composite
def _row(draw: st.DrawFn, attempt: str, obj: str) -> dict[str, Any]:
    chunk = draw(_chunks)
    right = "sha256:" + hashlib.sha256(chunk).hexdigest()
    return {
        "attempt_id": attempt,
        "generation": draw(st.sampled_from([1, 7])),
        "plan_digest": "sha256:" + "c" * 64,
        "object": obj,
        "offset": draw(st.sampled_from([0, 5, 0, 5, U63 - 200, U63 - 1, U63])),
        "data": draw(_data(chunk)),
        "digest": draw(st.sampled_from([right] * 5 + ["sha256:" + "0" * 64])),
    }


@st.composite
def _document(draw: st.DrawFn) -> dict[str, Any]:
    ids = [ex.hexid(1), ex.hexid(2), ex.hexid(3)]
    keys = draw(st.lists(st.tuples(st.sampled_from(ids), st.sampled_from(ids)), max_size=3))
    writes = [draw(_row(attempt, obj)) for attempt, obj in keys]
    document = {"version": 1, "id": ex.REQUEST_ID, "action": "input_write", "writes": writes}
    if draw(st.integers(0, 9)) == 0 and writes:
        writes[0][draw(st.sampled_from(["extra", "data", "offset"]))] = 1  # 'data': 1 replaces
    return document


def _spell(document: dict[str, Any], escape: int) -> bytes:
    """JSON for `document`, with `/` or `A` (base64-only characters) as JSON escapes."""
    text = json.dumps(document)
    if escape == 1:
        text = text.replace("/", "\\/")
    elif escape == 2:
        text = text.replace("A", "\\u0041")
    return text.encode()


@pytest.mark.soak
@sized(DOCUMENTS)
@given(
    _document(),
    st.sampled_from([0, 0, 1, 2]),
    st.sampled_from([INPUT_CHUNK_MAX_BYTES] * 3 + [64, 1]),
)
def test_receive_answers_every_document_as_decode_request(
    document: dict[str, Any], escape: int, bound: int
) -> None:
    frame = _spell(document, escape)
    answer = _same_answer(frame, input_chunk_bytes=bound)
    if answer[0] == "input_write" and not escape:  # the plain spelling takes the fast path
        assert isinstance(
            receive_request(frame, input_chunk_bytes=bound), ReceivedInputWriteRequest
        )


@pytest.mark.soak
@sized(DOCUMENTS)
@given(_document())
def test_the_server_model_accepts_and_refuses_what_decode_request_does(
    document: dict[str, Any],
) -> None:
    """Without escapes (which it leaves to `decode_request`), the model itself agrees.

    Same acceptance always; with a single row, the same code and path for every fault
    (msgspec names the first fault in document order, and a raw `data` is checked only
    after the rest of its row, so with several faulty rows the first named may differ).
    """
    frame = _spell(document, escape=0)
    mine, reference = _server_model(frame), _reference(frame)
    assert mine[0] == reference[0]
    if len(document["writes"]) == 1 and "extra" not in document["writes"][0]:
        assert mine == reference


# --- mutated frames of every action -------------------------------------------------

SEEDS = [encode_request(r) for r in ex.requests().values()]


@st.composite
def _mutated(draw: st.DrawFn) -> bytes:
    data = bytearray(draw(st.sampled_from(SEEDS)))
    for _ in range(draw(st.integers(1, 4))):
        at = draw(st.integers(0, len(data)))
        kind = draw(st.integers(0, 2))
        if kind == 0 and at < len(data):
            data[at] = draw(st.integers(0, 255))
        elif kind == 1:
            data[at:at] = draw(st.sampled_from([b'"', b"=", b"\\", b"\\/", b"A", b"0", b"[",
                                                b"}", b",", b"null", b"\xff", b" "]))  # fmt: skip
        else:
            del data[at : at + draw(st.integers(1, 8))]
    return bytes(data)


@pytest.mark.soak
@sized(MUTATIONS)
@given(st.one_of(_mutated(), st.sampled_from(SEEDS)))
def test_receive_answers_every_mutated_frame_as_decode_request(frame: bytes) -> None:
    _same_answer(frame)


# --- the fast path ------------------------------------------------------------------


def _frame(chunks: list[bytes]) -> bytearray:
    rows = [
        ex.chunk_write(ex.plan(1), chunk, obj=ex.hexid(10 + i)) for i, chunk in enumerate(chunks)
    ]
    return bytearray(encode_request(InputWriteRequest(version=1, id=ex.REQUEST_ID, writes=rows)))


def test_fast_path_reads_the_chunk_from_the_frame_until_released() -> None:
    """Chunks come out intact, piece by piece; no row keeps a view once released.

    A bytearray with a live view cannot be resized: the frame could not be freed
    while the chunk is written.
    """
    chunks = [bytes(range(256)) * 40, b"", b"x"]
    frame = _frame(chunks)
    request = receive_request(frame)  # type: ignore[arg-type]  # any buffer decodes
    assert isinstance(request, ReceivedInputWriteRequest)
    assert [b"".join(w.chunk_pieces()) for w in request.writes] == chunks
    assert request.chunk_bytes == sum(map(len, chunks))
    with pytest.raises(BufferError):  # the rows still read the frame
        frame.extend(b" ")
    request.release()
    assert all(bytes(w.data) == b"" for w in request.writes)
    frame.extend(b" ")  # raises BufferError while any view of the frame is alive


def test_checks_never_hold_the_whole_chunk() -> None:
    """A chunk of several pieces: checked and read piece by piece, never decoded whole."""
    chunk = bytes(range(256)) * (_PIECE_BYTES * 5 // 2 // 256) + b"xy"
    request = receive_request(bytes(_frame([chunk])))
    assert isinstance(request, ReceivedInputWriteRequest)
    write = request.writes[0]
    assert "_chunk" not in write.__dict__
    pieces = list(write.chunk_pieces())
    assert [len(p) for p in pieces] == [_PIECE_BYTES, _PIECE_BYTES, len(chunk) - 2 * _PIECE_BYTES]
    assert b"".join(pieces) == chunk
    assert write.chunk_size == len(chunk)
    assert "_chunk" not in write.__dict__


def test_escaped_base64_is_decided_by_decode_request() -> None:
    frame = bytes(_frame([b"\xff" * 30])).replace(b"/", b"\\/")
    assert b"\\/" in frame
    request = receive_request(frame)
    assert isinstance(request, InputWriteRequest)
    assert request.writes[0].chunk == b"\xff" * 30


@pytest.mark.parametrize("data", ["aGVsbG8", "aGVsbG9=", "aGVsbG8=\n", "aGVs_G8=", "=aGVsbG8", 5])
def test_bad_base64_has_decode_requests_error(data: Any) -> None:
    document = json.loads(bytes(_frame([b"hello"])))
    document["writes"][0]["data"] = data
    frame = json.dumps(document).encode()
    answer = _same_answer(frame)
    assert answer[:2] == ("refused", ErrorCode.INVALID_REQUEST)
    assert answer[3] == "$.writes[0].data"
    assert _server_model(frame) == ("refused", ErrorCode.INVALID_REQUEST, "$.writes[0].data")


def test_the_callers_bound_is_decode_requests() -> None:
    frame = bytes(_frame([b"x" * 100]))
    assert _same_answer(frame, input_chunk_bytes=100)[0] == "input_write"
    refused = _same_answer(frame, input_chunk_bytes=99)
    assert refused[:2] == ("refused", ErrorCode.INVALID_REQUEST)
    assert refused[3] == "$.writes"


def test_a_full_chunk_is_received() -> None:
    chunk = bytes(range(256)) * (INPUT_CHUNK_MAX_BYTES // 256)
    request = receive_request(bytes(_frame([chunk])))
    assert isinstance(request, ReceivedInputWriteRequest)
    assert request.writes[0].chunk == chunk


@pytest.mark.parametrize("action", sorted(ex.requests()))
def test_every_example_is_received_as_decoded(action: str) -> None:
    _same_answer(encode_request(ex.requests()[action]))


@pytest.mark.parametrize(
    ("bad", "path"),
    [(b"-", "data"), (b"=", "data"), (b"\\n", "data"), (b"+", "digest")],
)
def test_a_fault_in_a_later_piece_has_decode_requests_error(bad: bytes, path: str) -> None:
    """A wrong character past the first piece; `+` is base64 that decodes to other bytes."""
    chunk = b"\xff" * (_PIECE_BYTES * 2)  # base64 all `/`
    frame = bytes(_frame([chunk]))
    at = frame.index(b'"data":"') + len(b'"data":"') + _PIECE_BYTES * 4 // 3 + 8
    answer = _same_answer(frame[:at] + bad + frame[at + 1 :])
    assert answer[:2] == ("refused", ErrorCode.INVALID_REQUEST)
    assert answer[3] == f"$.writes[0].{path}"


@pytest.mark.parametrize("bad", [b"=", b"==", b"A="])
def test_padding_at_a_piece_boundary_has_decode_requests_error(bad: bytes) -> None:
    """The fast path decodes slices of `_PIECE_BYTES`: a slice may not end in padding."""
    frame, end = _two_piece_frame()
    answer = _same_answer(frame[: end - len(bad)] + bad + frame[end:])
    assert answer[:2] == ("refused", ErrorCode.INVALID_REQUEST)
    assert answer[3] == "$.writes[0].data"


def test_an_escape_at_a_piece_boundary_is_decided_by_decode_request() -> None:
    frame, end = _two_piece_frame()
    answer = _same_answer(frame[: end - 1] + b"\\/" + frame[end:])  # the same chunk
    assert answer[0] == "input_write"


def test_the_fast_path_refuses_a_piece_that_ends_in_padding() -> None:
    """Its own refusal, not the chunk digest's: two padded pieces are no one spelling."""
    first = base64.b64encode(b"\xff" * (_PIECE_BYTES - 1))  # ends in `=`
    assert first.endswith(b"=")
    body = memoryview(first + base64.b64encode(b"\xff" * 3))
    with pytest.raises(ValueError, match="not plainly canonical"):
        list(_plain_pieces(body))


def _two_piece_frame() -> tuple[bytes, int]:
    """A frame whose chunk is two pieces of base64 `/`, and where the first one ends."""
    frame = bytes(_frame([b"\xff" * (_PIECE_BYTES * 2)]))
    return frame, frame.index(b'"data":"') + len(b'"data":"') + _PIECE_BYTES * 4 // 3


@pytest.mark.parametrize("spelled", ["QUJDREVG", "QUJDREU=", "QUJDRA==", "QQ==", "AAAAAAAA"])
def test_every_byte_in_every_place_has_decode_requests_answer(spelled: str) -> None:
    """Each position of a few short chunks' base64 replaced by each of the 256 bytes.

    pybase64 decides the fast path: this holds it to the reference's alphabet and
    padding, character by character.
    """
    document = json.loads(bytes(_frame([b"x"])))
    document["writes"][0]["data"] = "@"
    template = json.dumps(document).encode()
    for at in range(len(spelled)):
        for byte in range(256):
            data = spelled[:at].encode() + bytes([byte]) + spelled[at + 1 :].encode()
            _same_answer(template.replace(b"@", data))
