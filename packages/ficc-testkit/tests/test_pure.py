"""The kit's pure helpers: digests, waits, plans."""

from __future__ import annotations

import hashlib
import itertools

import pytest

from ficc.execution.plan import digest_of, encode_plan, plan_digest
from ficc.execution.wire import AttemptsReply, Error, ErrorReply, InputsReply, ReadsReply
from ficc_testkit import digests, plans, waits
from ficc_testkit.driver import chunks, fence, fence_fields, frame, rows
from ficc_testkit.plans import new_id


def test_digest_of_is_the_protocols_own() -> None:
    assert digests.digest_of is digest_of
    assert digest_of(b"abc") == "sha256:" + hashlib.sha256(b"abc").hexdigest()


def test_a_digest_computed_in_pieces_is_the_digest_of_the_whole() -> None:
    hasher = hashlib.sha256()
    for piece in (b"a", b"b", b"c"):
        hasher.update(piece)
    assert digests.of_hasher(hasher) == digest_of(b"abc")


@pytest.mark.parametrize("fill", ["0", "ab", "e"])
def test_a_fake_digest_is_well_formed(fill: str) -> None:
    text = digests.fake(fill)
    assert text.startswith("sha256:")
    assert len(text) == len("sha256:") + 64
    assert set(text.removeprefix("sha256:")) == set(fill)


def test_a_fake_digest_of_no_hex_is_refused() -> None:
    with pytest.raises(AssertionError):
        digests.fake("xy")


def test_wait_for_returns_the_first_truthy_value() -> None:
    polls = itertools.count()
    assert waits.wait_for(lambda: next(polls) >= 3 and "done", "three polls", 5, 0) == "done"


def test_wait_for_fails_after_its_bound_naming_what_it_waited_for() -> None:
    with pytest.raises(AssertionError, match="waiting for the impossible"):
        waits.wait_for(lambda: None, "the impossible", 0.01, 0)


def test_a_plan_is_valid_and_fresh() -> None:
    first, second = plans.make_plan(), plans.make_plan()
    encode_plan(first)  # refuses an invalid plan
    assert first.attempt_id != second.attempt_id
    assert first.job_id != second.job_id


def test_a_fence_binds_attempt_generation_and_plan_digest() -> None:
    plan = plans.make_plan(generation=3)
    assert fence_fields(plan) == {
        "attempt_id": plan.attempt_id,
        "generation": 3,
        "plan_digest": plan_digest(plan),
    }
    assert fence(plan).plan_digest == plan_digest(plan)


def test_chunks_cover_the_data_in_order() -> None:
    data = bytes(range(10))
    pieces = list(chunks(data, 4))
    assert [offset for offset, _ in pieces] == [0, 4, 8]
    assert b"".join(piece for _, piece in pieces) == data


def test_a_frame_is_its_length_then_its_payload() -> None:
    assert frame(b"{}") == (2).to_bytes(4, "big") + b"{}"


def test_rows_are_those_of_every_batch_reply_and_a_refusal_fails() -> None:
    for kind in (AttemptsReply, InputsReply, ReadsReply):
        assert rows(kind(version=1, id=new_id(), results=[])) == []
    refused = ErrorReply(version=1, id=new_id(), error=Error(code="busy", message="later"))
    with pytest.raises(AssertionError, match="refused: busy"):
        rows(refused)
