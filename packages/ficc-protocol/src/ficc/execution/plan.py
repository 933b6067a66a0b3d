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
from collections.abc import Sequence
from operator import methodcaller
from typing import Annotated, Literal

import msgspec

from ficc.execution import _rules
from ficc.execution._rules import EMPTY_DIGEST

# --- common value types -------------------------------------------------------------

U63_MAX = 2**63 - 1
"""Largest offset, size or count: a signed 64-bit integer every language can hold."""

Identity = Annotated[str, msgspec.Meta(pattern=_rules.IDENTITY.pattern)]
"""32 lowercase hex characters: attempt, job, request, installation, ledger, ... IDs."""

Digest = Annotated[str, msgspec.Meta(pattern=_rules.DIGEST.pattern)]
"""`sha256:` and 64 lowercase hex characters."""

Name = Annotated[str, msgspec.Meta(pattern=_rules.NAME.pattern)]
"""Error codes, provider IDs, slot classes, output names, reasons."""

Count = Annotated[int, msgspec.Meta(ge=0, le=U63_MAX)]
"""An exact nonnegative 64-bit integer (offsets, sizes, counts). Never a float."""

Positive = Annotated[int, msgspec.Meta(ge=1, le=U63_MAX)]
"""A `Count` of at least one (generations, revisions, sequences)."""

PLAN_MAX_BYTES = 128 * 1024
"""Largest canonical encoding of one plan."""

MAX_ROWS = 64
"""Most inputs, outputs, devices and environment entries in a plan (and batch rows)."""

# The same rules inside a plan: lengths checked by msgspec, the rule by `check_plans`.
_Identity = _rules.CheckedIdentity
_Digest = _rules.CheckedDigest
_Name = Annotated[str, _rules.lengths(_rules.NAME, 1, 80), _rules.NAME]
# A string that can reach execve(2): no NUL anywhere.
_ExecString = Annotated[str, _rules.lengths(_rules.EXEC_STRING, 0), _rules.EXEC_STRING]
_EnvName = Annotated[str, _rules.lengths(_rules.ENV_NAME, 1, 128), _rules.ENV_NAME]
_InputName = Annotated[str, _rules.lengths(_rules.INPUT_NAME, 1, 128), _rules.INPUT_NAME]
_OutputPath = Annotated[str, _rules.lengths(_rules.OUTPUT_PATH, 1, 1024), _rules.OUTPUT_PATH]


class PlanTooLarge(ValueError):
    """The canonical encoding exceeds PLAN_MAX_BYTES. `index`: its place in a batch."""

    def __init__(self, message: str, index: int = 0) -> None:
        super().__init__(message)
        self.index = index


# --- the plan -----------------------------------------------------------------------
# The rules that span fields (argv[0] absolute, distinct names, empty objects) are checked
# by `check_plans` too, from `Plan.__post_init__`: a plan decoded or converted on its own
# is checked whole, and a request checks all its plans at once (see `deferred_checks`).
# `gc=False`: these frozen records never form reference cycles, and untracked objects
# make decoding a large batch markedly cheaper.


class Runtime(msgspec.Struct, frozen=True, forbid_unknown_fields=True, gc=False):
    """Which pinned provider runs the job, in which image, with which isolation."""

    provider: _Name
    package_digest: _Digest
    image_digest: _Digest
    isolation: _Name
    network: _Name


class Payload(msgspec.Struct, frozen=True, forbid_unknown_fields=True, gc=False):
    """The command the workload runs once the payload gate releases it.

    `argv[0]` must be an absolute path (checked with the whole plan).
    """

    argv: Annotated[
        list[_ExecString],
        msgspec.Meta(
            min_length=1,
            max_length=256,
            extra_json_schema={"prefixItems": [{"type": "string", "pattern": r"\A/[^\x00]*\Z"}]},
        ),
    ]
    environment: Annotated[dict[_EnvName, _ExecString], msgspec.Meta(max_length=MAX_ROWS)]


class Limits(msgspec.Struct, frozen=True, forbid_unknown_fields=True, gc=False):
    """Resource limits the host's system service enforces (never the provider's).

    `devices` are distinct (checked with the whole plan).
    """

    cpu_millis: Positive
    memory_bytes: Positive
    swap_bytes: Count
    processes: Positive
    storage_bytes: Positive
    storage_inodes: Positive
    devices: Annotated[
        list[_Name], msgspec.Meta(max_length=MAX_ROWS, extra_json_schema={"uniqueItems": True})
    ]


class InputObject(
    msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True, gc=False
):
    """An immutable input object, bound by ID, name, size and full digest.

    `omit_defaults` is deliberate and applies to `delivery` only (the one field with a
    default): a `local` object encodes exactly as it did before streaming existed. An
    object has 0 bytes exactly when its digest is EMPTY_DIGEST (checked with the whole plan).
    """

    id: _Identity
    name: _InputName
    bytes: Count
    digest: _Digest
    delivery: Literal["local", "stream"] = "local"


class Output(msgspec.Struct, frozen=True, forbid_unknown_fields=True, gc=False):
    """A declared output file, readable through `collect` as `output:<name>`."""

    name: _Name
    path: _OutputPath


class Job(msgspec.Struct, frozen=True, forbid_unknown_fields=True, gc=False):
    """What to run and within which bounds.

    Input IDs, input names, output names and output paths are each distinct (checked
    with the whole plan).
    """

    name: _Name
    slot_class: _Name
    runtime: Runtime
    payload: Payload
    limits: Limits
    inputs: Annotated[list[InputObject], msgspec.Meta(max_length=MAX_ROWS)]
    outputs: Annotated[list[Output], msgspec.Meta(max_length=MAX_ROWS)]
    sensitive: bool


class Plan(msgspec.Struct, frozen=True, forbid_unknown_fields=True, gc=False):
    """The immutable plan of one attempt. Its digest binds every later message.

    Every way of decoding a plan refuses exactly what the host refuses: `decode_plan`,
    `msgspec.json.decode(data, type=Plan)`, `msgspec.convert(obj, Plan)` and a request
    that carries plans. msgspec checks types and lengths; `__post_init__` adds the
    character rules, the rules across fields and the 128 KiB bound. A plan built in
    Python is checked by `encode_plan` (msgspec checks no types in a constructor).

    The digest is recomputed on every call rather than cached: frozen structs still
    hold lists and dicts, and a cache would hide a mutation bug behind a stale digest.
    """

    version: Literal[1]
    deployment_id: _Identity
    node_id: _Identity
    project_id: _Identity
    job_id: _Identity
    attempt_id: _Identity
    generation: Positive
    offer_revision: Positive
    job: Job

    @property
    def streamed_inputs(self) -> list[InputObject]:
        """The inputs the host stages through `input_write`."""
        return [i for i in self.job.inputs if i.delivery == "stream"]

    def __post_init__(self) -> None:
        """Check the whole plan, unless a request is decoding and checks its batch."""
        if not _rules.checks_deferred():
            _rules.check_plans([self])
            _canonical(self)


# --- canonical bytes and digest -----------------------------------------------------

_encoder = msgspec.json.Encoder(order="sorted")
_decoder = msgspec.json.Decoder(Plan)


def _canonical(plan: Plan) -> bytes:
    """The canonical bytes of a plan already known to be valid; checks only the size."""
    data = _encoder.encode(plan)
    if len(data) > PLAN_MAX_BYTES:
        raise PlanTooLarge(f"plan encodes to {len(data)} bytes, more than {PLAN_MAX_BYTES}")
    return data


def encode_plan(plan: Plan) -> bytes:
    """The canonical bytes: sorted keys, compact, UTF-8, `delivery: local` omitted.

    The bytes are decoded again exactly as a host decodes them, so a plan the host
    would refuse (a bad ID, a relative `argv[0]`, more than 128 KiB, ...) never gets
    canonical bytes or a digest. Raises msgspec.ValidationError or PlanTooLarge.
    """
    data = _encoder.encode(plan)
    decode_plan(data)
    return data


def digest_of(data: bytes) -> str:
    """`sha256:` and the hex SHA-256 of `data`."""
    return "sha256:" + hashlib.sha256(data).hexdigest()


def plan_digest(plan: Plan) -> str:
    """`sha256:` over the canonical encoding; the `plan_digest` of every fence.

    Refuses what `encode_plan` refuses.
    """
    return digest_of(encode_plan(plan))


def _digests(plans: Sequence[Plan]) -> list[str]:
    """The digests of plans already checked (a decoded request's), in one pass.

    Encodes each plan once, with no Python loop per plan. Raises PlanTooLarge for the
    first oversized plan, with its position as `index`.
    """
    encoded = list(map(_encoder.encode, plans))
    sizes = list(map(len, encoded))
    if sizes and max(sizes) > PLAN_MAX_BYTES:
        index = next(i for i, size in enumerate(sizes) if size > PLAN_MAX_BYTES)
        message = f"plan encodes to {sizes[index]} bytes, more than {PLAN_MAX_BYTES}"
        raise PlanTooLarge(message, index)
    hexdigests = map(methodcaller("hexdigest"), map(hashlib.sha256, encoded))
    return list(map("sha256:".__add__, hexdigests))


def decode_plan(data: bytes) -> Plan:
    """Strictly decode one plan (any key order or spacing) and check its size bound.

    Raises msgspec.ValidationError / msgspec.DecodeError or PlanTooLarge.
    """
    with _rules.deferred_checks():
        plan = _decoder.decode(data)
    try:
        _rules.check_plans([plan])
    except _rules.PlanFault as fault:
        raise msgspec.ValidationError(fault.error) from None
    _canonical(plan)
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
