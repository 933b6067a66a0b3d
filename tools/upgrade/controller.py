"""A controller built on an older ficc-protocol: one job through a (newer) host.

    python controller.py SOCKET PLAN_FILE

Runs with the *old* ficc-protocol only (nothing from this repository's current
tree), as the transport account: snapshot for the bindings, prepare the plan from
PLAN_FILE (its canonical bytes), wait until it is ready, start it, wait for its
outcome and confirmed cleanup, release it. Prints one JSON object with every state
it saw; exits non-zero on anything unexpected (a refusal, a reply it cannot decode).
"""

from __future__ import annotations

import asyncio
import json
import secrets
import sys
import time
from typing import Any

from ficc.execution.client import Client
from ficc.execution.plan import decode_plan, plan_digest
from ficc.execution.protocol import (
    Fence,
    ObserveRequest,
    PrepareAttempt,
    PrepareRequest,
    ReleaseRequest,
    Renewal,
    SnapshotRequest,
    StartRequest,
)
from ficc.execution.wire import AttemptRow, SnapshotReply

DEADLINE_SECONDS = 120


def new_id() -> str:
    return secrets.token_hex(16)


async def one_row(client: Client, request: Any) -> AttemptRow:
    reply = await client.request(request)
    (row,) = reply.results
    if not isinstance(row, AttemptRow):
        raise SystemExit(f"{request.action} refused: {row}")
    return row


async def wait(client: Client, fence: Fence, accept: Any, what: str) -> AttemptRow:
    deadline = time.monotonic() + DEADLINE_SECONDS
    while True:
        row = await one_row(client, ObserveRequest(version=1, id=new_id(), attempts=[fence]))
        if accept(row):
            return row
        if time.monotonic() > deadline:
            raise SystemExit(f"no {what} within {DEADLINE_SECONDS} s: {row}")
        await asyncio.sleep(0.05)


async def main(socket: str, plan_file: str) -> dict[str, Any]:
    client = Client(socket)
    with open(plan_file, "rb") as file:
        plan = decode_plan(file.read())
    snapshot = await client.request(SnapshotRequest(version=1, id=new_id()))
    assert isinstance(snapshot, SnapshotReply), snapshot
    fence = Fence(attempt_id=plan.attempt_id, generation=plan.generation,
                  plan_digest=plan_digest(plan))  # fmt: skip
    lease = Renewal(**{f: getattr(fence, f) for f in fence.__struct_fields__}, sequence=1,
                    expires_at_ms=int(time.time() * 1000) + 600_000)  # fmt: skip
    prepared = await one_row(
        client,
        PrepareRequest(
            version=1,
            id=new_id(),
            **snapshot.bindings(),
            attempts=[PrepareAttempt(plan=plan, lease=lease)],
        ),
    )
    ready = await wait(client, fence, lambda r: r.ready or r.state != "prepared", "readiness")
    started = await one_row(client, StartRequest(version=1, id=new_id(), attempts=[fence]))
    ended = await wait(client, fence, lambda r: r.outcome is not None, "outcome")
    await wait(client, fence, lambda r: r.cleanup_confirmed, "confirmed cleanup")
    released = await one_row(client, ReleaseRequest(version=1, id=new_id(), attempts=[fence]))
    return {
        "bindings": snapshot.bindings(),
        "states": [r.state for r in (prepared, ready, started, ended, released)],
        "ready": ready.ready,
        "outcome": ended.outcome,
        "reason": ended.reason,
    }


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main(sys.argv[1], sys.argv[2]))))
