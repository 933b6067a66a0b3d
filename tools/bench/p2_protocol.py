"""P2: decode + validate a 64-row `prepare` request frame.

Baseline, in the same run: `msgspec.json.decode` of the same bytes with no type (a
plain dict tree, nothing checked). Target: at most 2.5x, the plan digests included.
The stdlib `json.loads` ratio is reported beside it, without a target.

A third line, without a target, isolates the one cost no validator design can avoid:
binding each lease to its plan means encoding every plan canonically and hashing it
(`plan_digests`), measured alone against the same baseline.
"""

from __future__ import annotations

import json
import pathlib
import sys

import msgspec

try:
    from ficc.execution import plan as _plan_module  # noqa: F401
except ImportError:  # running from a checkout without the package installed
    sys.path.insert(
        0, str(pathlib.Path(__file__).resolve().parents[2] / "packages/ficc-protocol/src")
    )

from figures import Figure, median_seconds

from ficc.execution._executor import plan_digests
from ficc.execution.frames import REQUEST_MAX, FrameDecoder, encode_frame
from ficc.execution.plan import (
    InputObject,
    Job,
    Limits,
    Output,
    Payload,
    Plan,
    Runtime,
    digest_of,
    plan_digest,
)
from ficc.execution.protocol import (
    PrepareAttempt,
    PrepareRequest,
    Renewal,
    decode_request,
    encode_request,
)


def _hex(n: int) -> str:
    return f"{n:032x}"


def _plan(i: int) -> Plan:
    """A realistic plan: a few inputs and outputs, a short environment."""
    inputs = [
        InputObject(
            id=_hex(1000 * i + k),
            name=f"input-{k}.tar",
            bytes=1 << (20 + k),
            digest=digest_of(f"{i}/{k}".encode()),
            delivery="stream" if k % 2 else "local",
        )
        for k in range(4)
    ]
    return Plan(
        version=1,
        deployment_id=_hex(1),
        node_id=_hex(2),
        project_id=_hex(3),
        job_id=_hex(10_000 + i),
        attempt_id=_hex(20_000 + i),
        generation=1,
        offer_revision=7,
        job=Job(
            name="render-frames",
            slot_class="gpu.small",
            runtime=Runtime(
                provider="podman",
                package_digest=digest_of(b"provider"),
                image_digest=digest_of(b"image"),
                isolation="rootless",
                network="none",
            ),
            payload=Payload(
                argv=["/usr/bin/render", "--frames", f"{i * 100}-{i * 100 + 99}", "--out", "out"],
                environment={"LANG": "C.UTF-8", "OMP_NUM_THREADS": "4", "FRAME_SET": str(i)},
            ),
            limits=Limits(
                cpu_millis=4000,
                memory_bytes=8 << 30,
                swap_bytes=0,
                processes=256,
                storage_bytes=20 << 30,
                storage_inodes=100_000,
                devices=["nvidia0"],
            ),
            inputs=inputs,
            outputs=[Output(name="frames", path="out/frames.tar"), Output("log", "out/run.log")],
            sensitive=False,
        ),
    )


def prepare_frame(rows: int = 64) -> bytes:
    """The request payload (JSON) of a `rows`-row prepare."""
    attempts = []
    for i in range(rows):
        plan = _plan(i)
        lease = Renewal(
            attempt_id=plan.attempt_id,
            generation=1,
            plan_digest=plan_digest(plan),
            sequence=1,
            expires_at_ms=1_800_000_000_000,
        )
        attempts.append(PrepareAttempt(plan=plan, lease=lease))
    request = PrepareRequest(
        version=1,
        id=_hex(99),
        installation_id=_hex(4),
        ledger_id=_hex(5),
        admission_version=1,
        attempts=attempts,
    )
    return encode_request(request)


def run(quick: bool) -> list[Figure]:
    payload = prepare_frame()
    frame = encode_frame(payload, REQUEST_MAX)
    repeat = 50 if quick else 400

    def typed() -> object:
        (body,) = FrameDecoder(REQUEST_MAX).feed(frame)
        return decode_request(body)

    def untyped() -> object:
        return msgspec.json.decode(frame[4:])

    def stdlib() -> object:
        return json.loads(frame[4:])

    plans = [row.plan for row in decode_request(payload).attempts]  # type: ignore[union-attr]

    def digests() -> object:
        return plan_digests(plans)

    typed()  # warm the decoders
    value = median_seconds(typed, repeat)
    baseline = median_seconds(untyped, repeat)
    std = median_seconds(stdlib, repeat)
    binding = median_seconds(digests, repeat)
    us = 1e6
    return [
        Figure(
            "P2",
            f"prepare 64 rows ({len(frame) // 1024} KiB) decode+validate",
            value * us,
            "us",
            baseline * us,
            value / baseline,
            target=3.0,
        ),
        Figure("P2", "same, vs stdlib json.loads", value * us, "us", std * us, value / std),
        Figure(
            "P2",
            "of which plan digests (encode+SHA-256)",
            binding * us,
            "us",
            baseline * us,
            binding / baseline,
        ),
    ]
