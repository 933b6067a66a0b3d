"""The immutable job plan, its canonical bytes and its digest.

A plan is what a controller asks a host to run, bound by every later message through
its digest. Two parties that hold the same plan must compute the same digest, today
and after any upgrade, so the canonical encoding is part of the wire contract: sorted
keys, no whitespace, UTF-8, and `delivery` left out when it is the default `local`
(plans made before streamed inputs existed keep their bytes and digest). The golden
vectors in `tests/vectors/` pin it; any change to them is a wire break.

The common value types (`Identity`, `Digest`, `Name`, `Count`, ...) live here because
the plan is the root of the contract: requests and replies import them from here.
"""

from __future__ import annotations

import hashlib
from typing import Annotated, Literal

import msgspec

# --- common value types -------------------------------------------------------------
# msgspec matches patterns with `re.search`, so every pattern is anchored with \A and
# \Z (not ^ and $: `$` also matches before a trailing newline).

U63_MAX = 2**63 - 1
"""Largest offset, size or count: a signed 64-bit integer every language can hold."""

Identity = Annotated[str, msgspec.Meta(pattern=r"\A[0-9a-f]{32}\Z")]
"""32 lowercase hex characters: attempt, job, request, installation, ledger, ... IDs."""

Digest = Annotated[str, msgspec.Meta(pattern=r"\Asha256:[0-9a-f]{64}\Z")]
"""`sha256:` and 64 lowercase hex characters."""

Name = Annotated[str, msgspec.Meta(pattern=r"\A[a-z][a-z0-9_.-]{0,79}\Z")]
"""Error codes, provider IDs, slot classes, output names, reasons."""

Count = Annotated[int, msgspec.Meta(ge=0, le=U63_MAX)]
"""An exact nonnegative 64-bit integer (offsets, sizes, counts). Never a float."""

Positive = Annotated[int, msgspec.Meta(ge=1, le=U63_MAX)]
"""A `Count` of at least one (generations, revisions, sequences)."""

EMPTY_DIGEST = "sha256:" + hashlib.sha256(b"").hexdigest()
"""The digest of zero bytes: the only digest an empty object may declare."""

PLAN_MAX_BYTES = 128 * 1024
"""Largest canonical encoding of one plan."""

MAX_ROWS = 64
"""Most inputs, outputs, devices and environment entries in a plan (and batch rows)."""

# A string that can reach execve(2): no NUL anywhere.
_ExecString = Annotated[str, msgspec.Meta(pattern=r"\A[^\x00]*\Z")]
_EnvName = Annotated[str, msgspec.Meta(pattern=r"\A[A-Za-z_][A-Za-z0-9_]{0,127}\Z")]
_InputName = Annotated[str, msgspec.Meta(pattern=r"\A[A-Za-z0-9][A-Za-z0-9_.-]{0,127}\Z")]
# Relative, normalized (no empty, `.` or `..` component, no leading or trailing `/`),
# no C0/C1 control characters, at most 1024 characters.
_COMPONENT = r"(?!\.\.?(?:/|\Z))[^/\x00-\x1f\x7f-\x9f]+"
_OutputPath = Annotated[
    str,
    msgspec.Meta(pattern=rf"\A{_COMPONENT}(?:/{_COMPONENT})*\Z", max_length=1024),
]

def _distinct(values: list[str], what: str) -> None:
    """Refuse a repeated value; msgspec turns the ValueError into a located error."""
    if len(set(values)) != len(values):
        seen: set[str] = set()
        for value in values:
            if value in seen:
                raise ValueError(f"{what} {value!r} appears more than once")
            seen.add(value)


# --- the plan -----------------------------------------------------------------------


class Runtime(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Which pinned provider runs the job, in which image, with which isolation."""

    provider: Name
    package_digest: Digest
    image_digest: Digest
    isolation: Name
    network: Name


class Payload(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The command the workload runs once the payload gate releases it."""

    argv: Annotated[list[_ExecString], msgspec.Meta(min_length=1, max_length=256)]
    environment: Annotated[dict[_EnvName, _ExecString], msgspec.Meta(max_length=MAX_ROWS)]

    def __post_init__(self) -> None:
        if not self.argv[0].startswith("/"):
            raise ValueError("argv[0] must be an absolute path")


class Limits(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Resource limits the host's system service enforces (never the provider's)."""

    cpu_millis: Positive
    memory_bytes: Positive
    swap_bytes: Count
    processes: Positive
    storage_bytes: Positive
    storage_inodes: Positive
    devices: Annotated[list[Name], msgspec.Meta(max_length=MAX_ROWS)]

    def __post_init__(self) -> None:
        _distinct(self.devices, "device")


class InputObject(msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    """An immutable input object, bound by ID, name, size and full digest.

    `omit_defaults` is deliberate and applies to `delivery` only (the one field with a
    default): a `local` object encodes exactly as it did before streaming existed.
    """

    id: Identity
    name: _InputName
    bytes: Count
    digest: Digest
    delivery: Literal["local", "stream"] = "local"

    def __post_init__(self) -> None:
        if (self.bytes == 0) != (self.digest == EMPTY_DIGEST):
            raise ValueError("an object has 0 bytes exactly when its digest is SHA-256 of nothing")


class Output(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A declared output file, readable through `collect` as `output:<name>`."""

    name: Name
    path: _OutputPath


class Job(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What to run and within which bounds."""

    name: Name
    slot_class: Name
    runtime: Runtime
    payload: Payload
    limits: Limits
    inputs: Annotated[list[InputObject], msgspec.Meta(max_length=MAX_ROWS)]
    outputs: Annotated[list[Output], msgspec.Meta(max_length=MAX_ROWS)]
    sensitive: bool

    def __post_init__(self) -> None:
        _distinct([i.id for i in self.inputs], "input id")
        _distinct([i.name for i in self.inputs], "input name")
        _distinct([o.name for o in self.outputs], "output name")
        _distinct([o.path for o in self.outputs], "output path")


class Plan(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The immutable plan of one attempt. Its digest binds every later message."""

    version: Literal[1]
    deployment_id: Identity
    node_id: Identity
    project_id: Identity
    job_id: Identity
    attempt_id: Identity
    generation: Positive
    offer_revision: Positive
    job: Job

    @property
    def streamed_inputs(self) -> list[InputObject]:
        """The inputs the host stages through `input_write`."""
        return [i for i in self.job.inputs if i.delivery == "stream"]


_encoder = msgspec.json.Encoder(order="sorted")
_decoder = msgspec.json.Decoder(Plan)


class PlanTooLarge(ValueError):
    """The canonical encoding exceeds PLAN_MAX_BYTES."""


def encode_plan(plan: Plan) -> bytes:
    """The canonical bytes: sorted keys, compact, UTF-8, `delivery: local` omitted.

    Raises PlanTooLarge past 128 KiB so an oversized plan can never get a digest.
    """
    data = _encoder.encode(plan)
    if len(data) > PLAN_MAX_BYTES:
        raise PlanTooLarge(f"plan encodes to {len(data)} bytes, more than {PLAN_MAX_BYTES}")
    return data


def digest_of(data: bytes) -> str:
    """`sha256:` and the hex SHA-256 of `data`."""
    return "sha256:" + hashlib.sha256(data).hexdigest()


def plan_digest(plan: Plan) -> str:
    """`sha256:` over the canonical encoding; the `plan_digest` of every fence."""
    return digest_of(encode_plan(plan))


def decode_plan(data: bytes) -> Plan:
    """Strictly decode one plan (any key order or spacing) and check its size bound.

    Raises msgspec.ValidationError / msgspec.DecodeError or PlanTooLarge.
    """
    plan = _decoder.decode(data)
    encode_plan(plan)
    return plan


__all__ = [
    "EMPTY_DIGEST",
    "MAX_ROWS",
    "PLAN_MAX_BYTES",
    "U63_MAX",
    "Count",
    "Digest",
    "Identity",
    "InputObject",
    "Job",
    "Limits",
    "Name",
    "Output",
    "Payload",
    "Plan",
    "PlanTooLarge",
    "Positive",
    "Runtime",
    "decode_plan",
    "digest_of",
    "encode_plan",
    "plan_digest",
]
