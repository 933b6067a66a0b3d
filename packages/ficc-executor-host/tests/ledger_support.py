"""The real ledger, owned by whoever runs the tests, and the builders its tests share.

The daemon's ledger must be root's (`Ledger.create`/`open` check it); these tests of the
ledger's own logic name this process's UID as the owner instead, so they run in the
fast lane without root. Tests of what the daemon refuses about ownership pass root
explicitly and keep the `root` marker.
"""

from __future__ import annotations

import os
import sqlite3
from pathlib import Path
from typing import Any, NamedTuple

from ficc.execution import plan as planlib
from ficc.execution.host.core import lifecycle as lc
from ficc.execution.host.core.errors import HostError
from ficc.execution.host.ledger.store import (
    LEDGER_FILE,
    Admitted,
    Applied,
    HostFacts,
    Lease,
    Ledger,
    Now,
    PrepareRow,
    SlotSpec,
)
from ficc.execution.protocol import Fence, OfferLimits, Resources
from ficc_testkit import plans
from ficc_testkit.plans import new_id

OWNER = os.geteuid()


def create_ledger(state_dir: str | Path, *args: Any, **kwargs: Any) -> Ledger:
    return Ledger.create(str(state_dir), *args, **{"owner": OWNER, **kwargs})


def open_ledger(state_dir: str | Path, *args: Any, **kwargs: Any) -> Ledger:
    return Ledger.open(str(state_dir), *args, **{"owner": OWNER, **kwargs})


INSTALLATION = "1" * 32
BOOT = "8d7c2e55-0000-4000-8000-000000000001"
OTHER_BOOT = "8d7c2e55-0000-4000-8000-000000000002"
WALL = 0
NOW = Now(BOOT, 1_000_000_000, WALL)
MAX_LEASE = 10**6
DEADLINE = 10**15
BIG = 2**40
SHA = "sha256:" + "a" * 64


def limits(**resources: int) -> OfferLimits:
    base = dict.fromkeys(Resources.__struct_fields__, BIG)
    return OfferLimits(Resources(**(base | resources)), projects=None, runtimes=None)


CEILING = limits()


def make_plan(
    *,
    attempt_id: str | None = None,
    job_id: str | None = None,
    generation: int = 1,
    slot_class: str = "cpu",
    cpu_millis: int = 1000,
    devices: tuple[str, ...] = (),
    inputs: tuple[planlib.InputObject, ...] = (),
    offer_revision: int = 1,
    project_id: str = "2" * 32,
    provider: str = "podman",
    name: str = "job",
) -> planlib.Plan:
    return plans.make_plan(
        attempt_id=attempt_id, job_id=job_id, generation=generation, slot_class=slot_class,
        cpu_millis=cpu_millis, devices=devices, inputs=inputs, offer_revision=offer_revision,
        project_id=project_id, provider=provider, name=name, package_digest=SHA,
        image_digest=SHA, deployment_id="3" * 32, node_id="4" * 32, memory_bytes=1 << 30,
        storage_bytes=1 << 30,
    )  # fmt: skip


def stream(size: int = 10) -> planlib.InputObject:
    """A streamed input with a name of its own (a plan's input names are distinct)."""
    digest = planlib.digest_of(b"x" * size) if size < 4096 else SHA
    object_id = new_id()
    return planlib.InputObject(id=object_id, name=f"data-{object_id[:8]}.bin", bytes=size,
                               digest=digest, delivery="stream")  # fmt: skip


def lease(sequence: int = 1, deadline_ns: int = DEADLINE, expires_at_ms: int = 5000) -> Lease:
    return Lease(BOOT, sequence, expires_at_ms, deadline_ns, expires_at_ms)


def facts(slots: int = 4, devices: frozenset[str] = frozenset({"gpu0"})) -> HostFacts:
    specs = [SlotSpec(f"slot{i}", "cpu", 1 << 34, 10**6) for i in range(slots)]
    return HostFacts(slots=specs, devices=devices, ceiling=CEILING, now=NOW)


def fence(plan: planlib.Plan) -> Fence:
    return Fence(plan.attempt_id, plan.generation, planlib.plan_digest(plan))


def admit(led: Ledger, *plans: planlib.Plan, f: HostFacts | None = None) -> list[object]:
    rows = [PrepareRow(p, lease()) for p in plans]
    return list(led.admit_batch(led.bindings(), rows, f or facts()))


def admitted(led: Ledger, plan: planlib.Plan, f: HostFacts | None = None) -> Admitted:
    (result,) = admit(led, plan, f=f)
    assert isinstance(result, Admitted), result
    return result


def refused(result: object, code: str) -> None:
    assert isinstance(result, HostError), result
    assert result.code == code, result
    assert result.message


def count(led: Ledger) -> int:
    return len(raw(led).execute("SELECT attempt_id FROM attempts").fetchall())


def raw(led: Ledger) -> sqlite3.Connection:
    return sqlite3.connect(led.path)


def raw_path(state_dir: Path) -> sqlite3.Connection:
    return sqlite3.connect(state_dir / LEDGER_FILE)


def to_ready(led: Ledger, plan: planlib.Plan) -> None:
    for event in (lc.PrepareBegun(), lc.PrepareOk(result=b'{"argv":["/bin/true"]}')):
        led.apply(fence(plan), event)


def to_released(led: Ledger, plan: planlib.Plan) -> None:
    to_ready(led, plan)
    (start,) = led.start_batch([fence(plan)], NOW)
    assert isinstance(start, Applied)
    assert start.changed
    for event in (lc.Started(), lc.Finished(exit_code=0), lc.CleanupConfirmed(), lc.Release()):
        led.apply(fence(plan), event)


class Renew(NamedTuple):
    """A renewal row's terms, as the ledger's `renew_batch` reads them."""

    sequence: int
    expires_at_ms: int
