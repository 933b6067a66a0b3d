"""The daemon's slot health checks on the test kit's fake slot files: what a check finds
is recorded, each transition is logged once as a JSON event, and an attempt's own check
marks the slot only when the refusal is about the slot."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from ficc.execution.errors import ErrorCode
from ficc.execution.host.context.parts import Workers
from ficc.execution.host.context.slot_health import SlotHealth
from ficc.execution.host.core.codes import HostCode
from ficc.execution.host.core.errors import HostError
from ficc_testkit.fakes import FakeSlotFiles

UNMOUNTED = HostError(HostCode.SLOT_FILESYSTEM, "slot s0: not the root of its own filesystem")


@dataclass(frozen=True)
class Slot:
    id: str
    slot_class: str
    files: FakeSlotFiles


@pytest.fixture
def workers() -> Iterator[Workers]:
    pool = Workers(io_threads=1, provider_threads=1)
    yield pool
    pool.shutdown()


def events(caplog: pytest.LogCaptureFixture) -> list[dict[str, object]]:
    return [r.fields for r in caplog.records if hasattr(r, "fields")]  # type: ignore[attr-defined]


def test_a_failed_check_takes_the_slot_out_once_and_a_passing_one_brings_it_back(
    tmp_path: Path, workers: Workers, caplog: pytest.LogCaptureFixture
) -> None:
    slots = [Slot("s0", "small", FakeSlotFiles(tmp_path / "s0")),
             Slot("s1", "small", FakeSlotFiles(tmp_path / "s1"))]  # fmt: skip
    health = SlotHealth()
    caplog.set_level(logging.INFO)

    async def scenario() -> None:
        await health.check(workers, slots)
        assert health.broken() == {}
        slots[0].files.refusals["check"] = UNMOUNTED
        await health.check(workers, slots)
        await health.check(workers, slots)  # the same again: no second line
        assert health.broken() == {"s0": "slot_filesystem"}
        del slots[0].files.refusals["check"]
        await health.check(workers, slots)

    asyncio.run(scenario())
    assert health.broken() == {}
    assert events(caplog) == [
        {"event": "slot_out_of_service", "slot": "s0", "class": "small",
         "code": "slot_filesystem", "message": UNMOUNTED.message},
        {"event": "slot_in_service", "slot": "s0", "class": "small"},
    ]  # fmt: skip
    assert [c for c in slots[1].files.calls if c[0] == "check"] == [("check", "")] * 4


def test_an_attempts_own_check_marks_the_slot_only_for_a_slot_refusal(tmp_path: Path) -> None:
    slot = Slot("s0", "small", FakeSlotFiles(tmp_path))
    health = SlotHealth()
    health.attempt_found(slot, HostError(ErrorCode.SLOT_FULL, "the slot is full"))
    assert health.broken() == {}
    health.attempt_found(slot, HostError(HostCode.SLOT_IDENTITY, "another filesystem"))
    assert health.broken() == {"s0": "slot_identity"}
    assert health.states(["s0"])["s0"].message == "another filesystem"
