"""ficc-hoststate under power loss: a mutation loop that prints every acknowledged
transition, and the check after the next boot.

    hoststate_loop.py churn DIR        # begin -> running -> succeeded, forever
    hoststate_loop.py verify DIR ACKS  # acquire; every acknowledged transition is there

Each call that returned is printed as `FICC-ACK {"kind": "hoststate", ...}` at once,
so the host knows what the store acknowledged before the power went. After the boot,
`acquire` must succeed (the snapshot verifies whole: nothing half-applied) and each
acknowledged operation must be at least at its acknowledged revision, with the
acknowledged status when the revision is the same.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys

import console

from ficc.hoststate import CapacityExceeded, NotFound, Status, acquire

HOST = "ficc-vm"
HASH = "sha256:" + "ab" * 32


def churn(directory: str) -> None:
    os.makedirs(directory, mode=0o700, exist_ok=True)
    with open("/proc/sys/kernel/random/boot_id") as file:
        boot = file.read().strip()[:8]
    with acquire(directory, HOST) as session:
        index = 0
        while True:
            op_id = f"op-{boot}-{index}"
            try:
                op, _ = session.begin(op_id, HASH)
            except CapacityExceeded:
                console.line("hoststate:", "the store is full; the loop stops")
                return
            ack(op)
            op = session.advance(op.id, op.revision, Status.RUNNING)
            ack(op)
            op = session.advance(op.id, op.revision, Status.SUCCEEDED)
            ack(op)
            index += 1


def ack(op: object) -> None:
    console.ack("hoststate", op=op.id, revision=op.revision,  # type: ignore[attr-defined]
                status=str(op.status.value))  # type: ignore[attr-defined]  # fmt: skip


def verify(directory: str, acks_path: str) -> int:
    if not os.path.isdir(directory):
        console.figure({"hoststate": {"acknowledged": 0}})
        return 0
    latest: dict[str, dict[str, object]] = {}
    with open(acks_path) as file:
        for line in file:
            ack_ = json.loads(line)
            if ack_.get("kind") == "hoststate":
                latest[ack_["op"]] = ack_
    failures = []
    with acquire(directory, HOST) as session:
        for op_id, want in latest.items():
            try:
                got = session.get(op_id)
            except NotFound:
                failures.append(f"hoststate {op_id}: acknowledged, now missing")
                continue
            if got.revision < want["revision"]:  # type: ignore[operator]
                failures.append(
                    f"hoststate {op_id}: acknowledged r{want['revision']}, now r{got.revision}"
                )
            elif got.revision == want["revision"] and got.status.value != want["status"]:
                failures.append(
                    f"hoststate {op_id}: r{got.revision} is {got.status.value},"
                    f" acknowledged {want['status']}"
                )
        # The one operation the loop may have begun without its ack reaching the host.
        for op_id in _next_ids(latest):
            with contextlib.suppress(NotFound):
                settle(session, session.get(op_id))
        for op_id in latest:
            settle(session, session.get(op_id))
    for failure in failures:
        console.fail(failure)
    console.figure({"hoststate": {"acknowledged": len(latest), "lost": len(failures)}})
    return 1 if failures else 0


def _next_ids(latest: dict[str, dict[str, object]]) -> list[str]:
    """op-<boot>-<last+1> for each boot prefix among the acknowledged operations."""
    last: dict[str, int] = {}
    for op_id in latest:
        prefix, _, index = op_id.rpartition("-")
        last[prefix] = max(last.get(prefix, -1), int(index))
    return [f"{prefix}-{index + 1}" for prefix, index in last.items()]


def settle(session: object, op: object) -> None:
    """Resolve what the cut left unresolved, as its owner would (an operation whose
    outcome is unknown is never claimed to have succeeded), so the next loop can begin."""
    steps = {Status.QUEUED: [Status.CANCELLED],
             Status.RUNNING: [Status.UNKNOWN, Status.FAILED_RECOVERED],
             Status.UNKNOWN: [Status.FAILED_RECOVERED],
             Status.NEEDS_ATTENTION: [Status.FAILED_RECOVERED]}  # fmt: skip
    for status in steps.get(op.status, []):  # type: ignore[attr-defined]
        op = session.advance(op.id, op.revision, status)  # type: ignore[attr-defined]


def main() -> int:
    if sys.argv[1] == "churn":
        churn(sys.argv[2])
        return 0
    return verify(sys.argv[2], sys.argv[3])


if __name__ == "__main__":
    sys.exit(main())
