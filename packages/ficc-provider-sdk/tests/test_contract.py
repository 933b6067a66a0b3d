"""The provider contract: the Structs both sides use, and docs/providers.md staying true to them."""

from __future__ import annotations

import pathlib
import re

import msgspec
import pytest

from ficc.execution import provider as sdk
from ficc_testkit.contexts import sample_context, with_check

DOC = pathlib.Path(__file__).parents[3] / "docs" / "providers.md"


@pytest.fixture(scope="module")
def doc() -> str:
    if not DOC.exists():
        pytest.skip(f"{DOC} is not part of this tree (an sdist has no docs/)")
    return DOC.read_text()


def _table(doc: str, marker: str) -> list[list[str]]:
    """The rows of the table between `<!-- marker -->` and `<!-- /marker -->`."""
    body = doc.split(f"<!-- {marker} -->", 1)[1].split(f"<!-- /{marker} -->", 1)[0]
    lines = [line for line in body.strip().splitlines() if line.startswith("|")]
    return [[cell.strip() for cell in line.strip("|").split("|")] for line in lines[2:]]


def _name(cell: str) -> str:
    found = re.fullmatch(r"`([a-z_]+)`", cell)
    assert found, f"{cell!r} is not a `name`"
    return found.group(1)


def test_the_context_table_lists_exactly_the_context_fields(doc: str) -> None:
    documented = [_name(row[0]) for row in _table(doc, "context-fields")]
    fields = [*sdk.Context.__struct_fields__, "check"]
    assert documented == fields
    assert set(sdk.PrepareContext.__struct_fields__) == set(fields)


def test_the_reply_table_names_each_method_its_struct_and_every_field(doc: str) -> None:
    rows = _table(doc, "reply-fields")
    assert [_name(row[0]) for row in rows] == list(sdk.METHODS)
    for method, struct, fields in rows:
        kind = getattr(sdk, struct.strip("`"))
        assert sdk._REPLIES[_name(method)] is kind
        missing = [f for f in kind.__struct_fields__ if f"`{f}`" not in fields]
        assert missing == [], f"{method}: {missing} not documented"


def test_slot_and_storage_parts_are_documented(doc: str) -> None:
    (slot,) = [r for r in _table(doc, "context-fields") if r[0] == "`slot`"]
    (storage,) = [r for r in _table(doc, "context-fields") if r[0] == "`storage`"]
    assert [f for f in sdk.Slot.__struct_fields__ if f"`{f}`" not in slot[2]] == []
    assert [f for f in sdk.StorageBinding.__struct_fields__ if f"`{f}`" not in storage[2]] == []


def test_replies_are_plain_data_and_decode_back() -> None:
    observed = sdk.reply(sdk.Observation(phase="payload", pid=42))
    assert observed == {"phase": "payload", "pid": 42}
    assert sdk.decode_reply("observe", observed, sdk.Observation).pid == 42
    assert sdk.reply(sdk.ReleaseReply(released=True)) == {"released": True}


@pytest.mark.parametrize(
    ("method", "data", "kind"),
    [
        ("observe", {"phase": "payload"}, sdk.Observation),  # no PID
        ("observe", {"phase": "finished", "exit_code": 256}, sdk.Observation),
        ("observe", {"phase": "running"}, sdk.Observation),
        ("start", {}, sdk.StartReply),
        ("start", {"started": False}, sdk.StartReply),
        ("release", {"released": "yes"}, sdk.ReleaseReply),
        ("prepare", {"argv": []}, sdk.PrepareResult),
        ("probe", {"ok": "true"}, sdk.ProbeReply),  # strict: no coercion
    ],
)
def test_a_malformed_reply_is_refused(method: str, data: object, kind: type) -> None:
    with pytest.raises((msgspec.ValidationError, ValueError)):
        sdk.decode_reply(method, data, kind)


def test_a_minimum_limits_statement_is_plain_data_and_figures_left_out_state_nothing() -> None:
    stated = sdk.reply(sdk.MinimumLimits(memory_bytes=64 << 20))
    assert stated == {"memory_bytes": 64 << 20}
    assert sdk.decode_minimum_limits(stated) == sdk.MinimumLimits(memory_bytes=64 << 20)
    assert sdk.decode_minimum_limits({}) == sdk.MinimumLimits()


@pytest.mark.parametrize(
    "data",
    [{"memory_bytes": "64M"}, {"processes": 0}, {"cpu_millis": 10}, {"processes": True}, []],
)
def test_a_malformed_minimum_limits_statement_is_refused(data: object) -> None:
    with pytest.raises(msgspec.ValidationError):
        sdk.decode_minimum_limits(data)


def test_the_minimum_limits_table_lists_exactly_its_fields(doc: str) -> None:
    documented = [_name(row[0]) for row in _table(doc, "minimum-limits-fields")]
    assert documented == list(sdk.MinimumLimits.__struct_fields__)


def test_a_struct_of_another_method_is_refused() -> None:
    with pytest.raises(ValueError, match="not the reply of 'start'"):
        sdk.decode_reply("start", {"ok": True}, sdk.ProbeReply)


def test_a_refusal_needs_a_name_code() -> None:
    assert sdk.refusal("image_unknown", "no") == {"error": "image_unknown", "message": "no"}
    with pytest.raises(msgspec.ValidationError):
        sdk.refusal("Not A Name", "no")


def test_contexts_are_frozen_and_prepare_adds_check() -> None:
    context = sample_context()
    with pytest.raises(AttributeError):
        context.attempt_id = "0" * 32  # type: ignore[misc]
    calls: list[int] = []
    prepared = with_check(context, lambda: calls.append(1))
    prepared.check()
    assert calls == [1]
    assert isinstance(prepared, sdk.Context)
    assert prepared.plan is context.plan


def test_storage_binding_says_whether_it_was_verified() -> None:
    assert not sdk.StorageBinding(path="/s").verified
    assert sdk.StorageBinding(path="/s", device=1, inode=2, bytes=3, inodes=4).verified
