"""The plan of one `ficc-executor run` (and `smoke-test`) job, filled in from the host.

A plan binds every later message through its digest, so what the user pinned must
never change on its way to the host. The command fills only the fields of `FILLED`,
and only where the plan leaves them open: the key is absent, or its value is a
placeholder string `"<...>"` (the form docs/examples/ uses). Every value the plan
pins is kept as written, and checked against the host where the host knows better
(deployment, node, offer revision, the provider's pin, the slot class), so a plan
the host would refuse is refused here, before anything is reserved, with what to do.

A job given as an image and a command line is the same thing: `template` writes a
plan that leaves every fillable field open, and `fill_plan` fills it.

Pure: a JSON document, a snapshot and the command line in, a `Plan` or a `HostError`
out. Random IDs come from the caller (`new_id`), so the tests choose them.
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec

from ficc.execution import plan as planlib
from ficc.execution.host.config.model import Config
from ficc.execution.host.core.codes import HostCode
from ficc.execution.host.core.errors import HostError
from ficc.execution.host.core.records import OFFER_ALLOWS
from ficc.execution.wire import ProviderInfo, SlotClass, SnapshotReply

PLACEHOLDER = re.compile(r"\A<[^<>]*>\Z")
"""A string value that marks a field for the command to fill."""

FILLED: dict[str, str] = {
    "version": "1",
    "deployment_id": "the host's (`--config`, or `--deployment`)",
    "node_id": "the host's (`--config`, or `--node`)",
    "project_id": "`--project`, else the offer's first project, else a new random ID",
    "job_id": "a new random ID",
    "attempt_id": "a new random ID",
    "generation": "1",
    "offer_revision": "the snapshot's offer revision",
    "job.name": "`run` (`--name` in the image form)",
    "job.slot_class": "`--class`, else the first class with a free slot",
    "job.runtime.provider": "`--provider`, else the first available provider the offer allows",
    "job.runtime.package_digest": "the provider's pin, from the snapshot",
    "job.runtime.image_digest": "`--image`, else (`--config`) the provider's first image",
    "job.runtime.isolation": "`--isolation`, else `shared-kernel`",
    "job.runtime.network": "`--network`, else `none`",
    "job.limits.cpu_millis, .memory_bytes, .processes": "`--cpu-millis`, `--memory`,"
    " `--processes`, else one attempt's share of the offer",
    "job.limits.storage_bytes, .storage_inodes": "`--storage`, `--inodes`, else the size"
    " of the slot class",
    "job.limits.swap_bytes, .devices": "`--swap`, `--device`, else 0 and none",
    "job.inputs[].id": "a new random ID",
    "job.inputs[].bytes, .digest": "the size and SHA-256 of its `--input` file",
}
"""Every field the command may fill, and from what (docs/operations.md prints this)."""

SHARED = ("cpu_millis", "memory_bytes", "processes")
"""Limits whose default is one attempt's share of the offer."""
STORAGE = {"storage_bytes": "bytes", "storage_inodes": "inodes"}
"""Limits whose default is the slot class's size (the class's SlotClass field)."""


@dataclass(frozen=True)
class Host:
    """What the command knows of the host: the snapshot, and what only the
    configuration says (read with --config, or given on the command line)."""

    snapshot: SnapshotReply
    deployment_id: str | None = None
    node_id: str | None = None
    images: Mapping[str, Sequence[str]] = field(default_factory=dict)
    """provider ID -> its configured image digests (known only with --config)."""
    projects: Sequence[str] = ()
    """The ceiling's projects (known only with --config)."""


@dataclass(frozen=True)
class LocalInput:
    """A local file for one streamed input: `name` (or ID) and what the file holds."""

    name: str
    path: str
    bytes: int
    digest: str


@dataclass(frozen=True)
class Choices:
    """What the command line says about the fields a plan may leave open."""

    slot_class: str | None = None
    provider: str | None = None
    image: str | None = None
    isolation: str | None = None
    network: str | None = None
    project: str | None = None
    limits: Mapping[str, Any] = field(default_factory=dict)
    at_most: Mapping[str, int] = field(default_factory=dict)
    """Caps of the default limits (the smoke test's small job)."""
    inputs: Sequence[LocalInput] = ()


@dataclass(frozen=True)
class Filled:
    """The plan, and the JSON paths the command filled (printed, so nothing is hidden)."""

    plan: planlib.Plan
    filled: tuple[str, ...]


def host_of(config: Config, snapshot: SnapshotReply) -> Host:
    """The host as its administrator sees it: the snapshot and the configuration."""
    images = {
        provider.id: tuple(
            entry["digest"]
            for entry in provider.configuration.get("images") or ()
            if isinstance(entry, dict) and isinstance(entry.get("digest"), str)
        )
        for provider in config.providers
    }
    projects = config.ceiling.projects
    return Host(snapshot, config.deployment_id, config.node_id, images, projects)


def refuse(code: HostCode, message: str) -> HostError:
    """The one shape of every refusal here (kept short at the call sites)."""
    return HostError(code, message)


# --- reading the document --------------------------------------------------------------


def read_document(data: bytes, source: str) -> dict[str, Any]:
    """The plan file as a JSON object; duplicate keys refused (what was reviewed is
    what is sent, as the `request` command does)."""

    def no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        keys = [k for k, _ in pairs]
        for key in keys:
            if keys.count(key) > 1:
                raise ValueError(f"key {key!r} appears twice in one object")
        return dict(pairs)

    try:
        document = json.loads(data, object_pairs_hook=no_duplicates)
    except (ValueError, RecursionError) as error:
        raise refuse(
            HostCode.RUN_PLAN_INVALID, f"{source} is not a JSON plan: {error}; fix the file"
        ) from None
    if not isinstance(document, dict):
        raise refuse(HostCode.RUN_PLAN_INVALID, f"{source} is not a JSON object; fix the file")
    return document


def is_open(holder: Mapping[str, Any], key: str) -> bool:
    """Whether the plan leaves `key` to be filled: absent, or a `"<...>"` placeholder."""
    value = holder.get(key)
    return key not in holder or (isinstance(value, str) and PLACEHOLDER.match(value) is not None)


def _object(holder: dict[str, Any], key: str, path: str) -> dict[str, Any]:
    """The nested object at `key` (made empty when absent)."""
    value = holder.setdefault(key, {})
    if not isinstance(value, dict):
        raise refuse(HostCode.RUN_PLAN_INVALID, f"{path} is not a JSON object; fix the plan")
    return value


def _inputs(document: Mapping[str, Any]) -> list[dict[str, Any]]:
    job = document.get("job")
    inputs = job.get("inputs", []) if isinstance(job, dict) else []
    if not isinstance(inputs, list) or not all(isinstance(i, dict) for i in inputs):
        raise refuse(HostCode.RUN_PLAN_INVALID, "$.job.inputs is not a list of objects")
    return inputs


def _streamed(entry: Mapping[str, Any]) -> bool:
    return entry.get("delivery") == "stream"


def _entry_for(entries: list[dict[str, Any]], wanted: str) -> dict[str, Any] | None:
    for entry in entries:
        if wanted in (entry.get("name"), entry.get("id")):
            return entry
    return None


def match_inputs(document: Mapping[str, Any], names: Sequence[str]) -> None:
    """Each `--input` names a streamed input of the plan, and each streamed input has
    one: checked before any file is read or anything is sent."""
    entries = _inputs(document)
    streamed = [e for e in entries if _streamed(e)]
    listed = ", ".join(str(e.get("name")) for e in streamed) or "none"
    for name in names:
        entry = _entry_for(entries, name)
        if entry is None:
            raise refuse(
                HostCode.RUN_INPUT_UNDECLARED,
                f"--input {name}: the plan declares no input {name!r} (its streamed inputs:"
                f" {listed}); name one of them, or declare it in job.inputs",
            )
        if not _streamed(entry):
            raise refuse(
                HostCode.RUN_INPUT_UNDECLARED,
                f"--input {name}: the plan's input {name!r} is delivered locally; `run` sends"
                ' only streamed inputs: write "delivery": "stream" in it',
            )
    for entry in streamed:
        if not {entry.get("name"), entry.get("id")} & set(names):
            raise refuse(
                HostCode.RUN_INPUT_NOT_GIVEN,
                f"the plan streams input {entry.get('name')!r}, and no --input gives its"
                f" file: add --input {entry.get('name')}=FILE",
            )


# --- the image and command line form ----------------------------------------------------


def template(
    argv: Sequence[str],
    environment: Mapping[str, str],
    inputs: Sequence[str],
    outputs: Mapping[str, str],
    *,
    name: str | None = None,
) -> dict[str, Any]:
    """A plan document that leaves every fillable field open: the job given as an
    image and a command line (`--image ... -- ARGV`)."""
    job: dict[str, Any] = {
        "runtime": {},
        "payload": {"argv": list(argv), "environment": dict(environment)},
        "limits": {},
        "inputs": [{"name": n, "delivery": "stream"} for n in inputs],
        "outputs": [{"name": n, "path": p} for n, p in outputs.items()],
        "sensitive": False,
    }
    if name is not None:
        job["name"] = name
    return {"job": job}


# --- filling ------------------------------------------------------------------------------


def check_offer(snapshot: SnapshotReply) -> None:
    """The offer must admit and start jobs, or nothing the command sends can run."""
    offer = snapshot.offer
    if not {"admit", "start"} <= OFFER_ALLOWS[offer.control]:
        raise refuse(
            HostCode.RUN_OFFER_CLOSED,
            f"the offer is {offer.control}, so no job is admitted or started: the"
            f" administrator sets it to active (a `set_offer` with expected_revision"
            f' {offer.revision} and control "active" through `ficc-executor request'
            " --socket .../admin.sock`)",
        )


class _Filler:
    """Fills the open fields of one document and remembers which (`filled`)."""

    def __init__(self, host: Host, choices: Choices, new_id: Callable[[], str]) -> None:
        self.host = host
        self.choices = choices
        self.new_id = new_id
        self.filled: list[str] = []

    def fill(
        self, holder: dict[str, Any], key: str, path: str, value: Callable[[], Any], flag: Any
    ) -> None:
        """Fill `key` when open (from `flag` if given, else `value()`); when pinned, a
        flag that says otherwise is refused rather than silently ignored."""
        if is_open(holder, key):
            holder[key] = flag if flag is not None else value()
            self.filled.append(path)
        elif flag is not None and holder[key] != flag:
            raise refuse(
                HostCode.RUN_PLAN_MISMATCH,
                f"{path} is {holder[key]!r} in the plan and {flag!r} on the command line;"
                " drop the flag, or leave the field open in the plan",
            )

    def top(self, document: dict[str, Any]) -> None:
        revision = self.host.snapshot.offer.revision
        self.fill(document, "version", "$.version", lambda: 1, None)
        self.fill(document, "deployment_id", "$.deployment_id", self._deployment, None)
        self.fill(document, "node_id", "$.node_id", self._node, None)
        self.fill(document, "project_id", "$.project_id", self._project, self.choices.project)
        self.fill(document, "job_id", "$.job_id", self.new_id, None)
        self.fill(document, "attempt_id", "$.attempt_id", self.new_id, None)
        self.fill(document, "generation", "$.generation", lambda: 1, None)
        self.fill(document, "offer_revision", "$.offer_revision", lambda: revision, None)

    def _deployment(self) -> str:
        return _known(self.host.deployment_id, "deployment_id", "--deployment")

    def _node(self) -> str:
        return _known(self.host.node_id, "node_id", "--node")

    def _project(self) -> str:
        offered = self.host.snapshot.offer.limits.projects or list(self.host.projects)
        return offered[0] if offered else self.new_id()

    def job(self, job: dict[str, Any]) -> None:
        choices = self.choices
        self.fill(job, "name", "$.job.name", lambda: "run", None)
        self.fill(job, "slot_class", "$.job.slot_class", self._slot_class, choices.slot_class)
        runtime = _object(job, "runtime", "$.job.runtime")
        self.runtime(runtime)
        self.limits(_object(job, "limits", "$.job.limits"), job["slot_class"])
        for index, entry in enumerate(_inputs({"job": job})):
            self.input(entry, f"$.job.inputs[{index}]")

    def _slot_class(self) -> str:
        classes = self.host.snapshot.capacity.slot_classes
        for offered in classes:
            if offered.free:
                return offered.class_
        raise refuse(
            HostCode.RUN_NO_FREE_SLOT,
            f"every slot is in use ({_classes(classes)}); run the job when one is free",
        )

    def runtime(self, runtime: dict[str, Any]) -> None:
        choices, at = self.choices, "$.job.runtime."
        self.fill(runtime, "provider", at + "provider", self._provider, choices.provider)
        provider = str(runtime["provider"])
        pin = pin_of(self.host.snapshot, provider)
        self.fill(runtime, "package_digest", at + "package_digest", lambda: pin, None)
        image = self._image(provider)
        self.fill(runtime, "image_digest", at + "image_digest", image, choices.image)
        isolation = _default("shared-kernel")
        self.fill(runtime, "isolation", at + "isolation", isolation, choices.isolation)
        self.fill(runtime, "network", at + "network", _default("none"), choices.network)

    def _provider(self) -> str:
        snapshot = self.host.snapshot
        for provider in snapshot.capacity.providers:
            if self._fits(provider):
                return provider.id
        raise refuse(
            HostCode.RUN_PROVIDER_UNAVAILABLE,
            f"no provider of this host is available and offered ({_providers(snapshot)});"
            " `ficc-executor check-config --config PATH` says why a provider is unavailable",
        )

    def _fits(self, provider: ProviderInfo) -> bool:
        """Available, in the offer, and (when the configuration is known and no image
        is named) with an image to run."""
        allowed = self.host.snapshot.offer.limits.runtimes
        if not provider.available or (allowed is not None and provider.id not in allowed):
            return False
        images = self.host.images
        return self.choices.image is not None or not images or bool(images.get(provider.id))

    def _image(self, provider: str) -> Callable[[], str]:
        def first() -> str:
            images = self.host.images.get(provider) or ()
            if images:
                return images[0]
            where = "of the configuration " if self.host.images else ""
            raise refuse(
                HostCode.RUN_NO_IMAGE,
                f"no image named and provider {provider!r} {where}offers none to choose:"
                " give --image DIGEST (an images[].digest of the provider's configuration;"
                ' docs/operations.md, "Adding an image")',
            )

        return first

    def limits(self, limits: dict[str, Any], slot_class: Any) -> None:
        flags = self.choices.limits
        for name in (*SHARED, *STORAGE):
            path = f"$.job.limits.{name}"
            self.fill(limits, name, path, self._share(name, slot_class), flags.get(name))
        swap, devices = flags.get("swap_bytes"), flags.get("devices")
        self.fill(limits, "swap_bytes", "$.job.limits.swap_bytes", lambda: 0, swap)
        self.fill(limits, "devices", "$.job.limits.devices", lambda: [], devices)

    def _share(self, name: str, slot_class: Any) -> Callable[[], int]:
        def share() -> int:
            snapshot = self.host.snapshot
            available: int = getattr(snapshot.capacity.available, name)
            amount: int
            if name in STORAGE:
                offered = _class(snapshot, slot_class)
                amount = min(getattr(offered, STORAGE[name]), available)
            else:
                resources = snapshot.offer.limits.resources
                amount = min(getattr(resources, name) // max(1, resources.attempts), available)
            amount = min(amount, self.choices.at_most.get(name, amount))
            if amount < 1:
                raise refuse(
                    HostCode.RUN_NO_CAPACITY,
                    f"the offer has no {name} left for another attempt ({available}"
                    " available): wait for a release, or give the limit as a flag",
                )
            return amount

        return share

    def input(self, entry: dict[str, Any], path: str) -> None:
        local = _local_for(entry, self.choices.inputs)
        if local is None:  # a local input: the plan's own business
            return
        self.fill(entry, "id", f"{path}.id", self.new_id, None)
        for key, value in (("bytes", local.bytes), ("digest", local.digest)):
            if is_open(entry, key):
                entry[key] = value
                self.filled.append(f"{path}.{key}")
            elif entry[key] != value:
                raise refuse(
                    HostCode.RUN_INPUT_MISMATCH,
                    f"--input {local.name}={local.path}: the file's {key} is {value!r}, the"
                    f" plan declares {entry[key]!r}; give the file the plan was made for, or"
                    f' leave {key} open ("<...>") to have it filled from the file',
                )


def pin_of(snapshot: SnapshotReply, provider: str) -> str:
    """The provider's pinned package digest, as the host reports it; refused when the
    host has no such provider or it is unavailable (admission would refuse it)."""
    for info in snapshot.capacity.providers:
        if info.id == provider:
            if not info.available:
                raise refuse(
                    HostCode.RUN_PROVIDER_UNAVAILABLE,
                    f"provider {provider!r} is not available on this host (it failed its pin"
                    " or its configuration check): `ficc-executor check-config --config PATH`"
                    " says why",
                )
            return info.package_digest
    raise refuse(
        HostCode.RUN_PROVIDER_UNAVAILABLE,
        f"this host has no provider {provider!r} ({_providers(snapshot)})",
    )


def _default(value: str) -> Callable[[], str]:
    return lambda: value


def _known(value: str | None, key: str, flag: str) -> str:
    if value is None:
        raise refuse(
            HostCode.RUN_PLAN_INCOMPLETE,
            f"the plan leaves {key} to be filled, and only the host's configuration knows"
            f" it: give {flag} ID ({key} of the configuration; the administrator has it),"
            " write it in the plan, or run as root with --config",
        )
    return value


def _local_for(entry: Mapping[str, Any], inputs: Sequence[LocalInput]) -> LocalInput | None:
    for local in inputs:
        if local.name in (entry.get("name"), entry.get("id")):
            return local
    return None


def _classes(classes: Sequence[SlotClass]) -> str:
    return ", ".join(f"{c.class_}: {c.free} of {c.total} free" for c in classes) or "no slots"


def _providers(snapshot: SnapshotReply) -> str:
    shown = [
        f"{p.id}: {'available' if p.available else 'unavailable'}"
        for p in snapshot.capacity.providers
    ]
    allowed = snapshot.offer.limits.runtimes
    offered = "any" if allowed is None else ", ".join(allowed) or "none"
    return f"{', '.join(shown) or 'none configured'}; the offer allows {offered}"


def _class(snapshot: SnapshotReply, slot_class: Any) -> SlotClass:
    for offered in snapshot.capacity.slot_classes:
        if offered.class_ == slot_class:
            return offered
    raise refuse(
        HostCode.RUN_SLOT_CLASS,
        f"no slot of class {slot_class!r} is configured on this host"
        f" ({_classes(snapshot.capacity.slot_classes)}); name one of those",
    )


# --- the whole -------------------------------------------------------------------------


def fill_plan(
    document: Mapping[str, Any], host: Host, choices: Choices, new_id: Callable[[], str]
) -> Filled:
    """The plan: the document's open fields filled, its pinned ones checked."""
    match_inputs(document, [i.name for i in choices.inputs])
    check_offer(host.snapshot)
    working = copy.deepcopy(dict(document))
    filler = _Filler(host, choices, new_id)
    filler.top(working)
    filler.job(_object(working, "job", "$.job"))
    plan = decode(working)
    check_pinned(plan, host)
    return Filled(plan, tuple(filler.filled))


def decode(document: Mapping[str, Any]) -> planlib.Plan:
    """Decode exactly as the host does; a refusal names the JSON path."""
    try:
        return planlib.decode_plan(json.dumps(document).encode())
    except (msgspec.MsgspecError, ValueError) as error:
        raise refuse(
            HostCode.RUN_PLAN_INVALID,
            f"the plan is not one the host accepts: {error}; fix that field (docs/protocol.md,"
            ' "The immutable plan")',
        ) from None


def check_pinned(plan: planlib.Plan, host: Host) -> None:
    """What the plan pins and the host contradicts: refused now, not by admission."""
    expected = (host.deployment_id, host.node_id)
    if None not in expected and (plan.deployment_id, plan.node_id) != expected:
        raise refuse(
            HostCode.RUN_PLAN_MISMATCH,
            f"the plan is for deployment {plan.deployment_id}, node {plan.node_id}; this host"
            f" serves deployment {expected[0]}, node {expected[1]}: send it to its own node,"
            " or leave deployment_id and node_id open",
        )
    revision = host.snapshot.offer.revision
    if plan.offer_revision != revision:
        raise refuse(
            HostCode.RUN_PLAN_MISMATCH,
            f"the plan pins offer_revision {plan.offer_revision}; the host's offer is at"
            f' revision {revision}: write {revision}, or "<offer_revision>" to have it filled',
        )
    runtime = plan.job.runtime
    pinned = pin_of(host.snapshot, runtime.provider)
    if pinned != runtime.package_digest:
        raise refuse(
            HostCode.RUN_PLAN_MISMATCH,
            f"the plan pins package_digest {runtime.package_digest} for provider"
            f" {runtime.provider!r}; the host pins {pinned}: use that, or leave"
            " package_digest open",
        )
    if _class(host.snapshot, plan.job.slot_class).free == 0:
        raise refuse(
            HostCode.RUN_NO_FREE_SLOT,
            f"every {plan.job.slot_class!r} slot is in use; run the job when one is free",
        )


__all__ = [
    "FILLED",
    "PLACEHOLDER",
    "Choices",
    "Filled",
    "Host",
    "LocalInput",
    "check_offer",
    "decode",
    "fill_plan",
    "host_of",
    "is_open",
    "match_inputs",
    "pin_of",
    "read_document",
    "refuse",
    "template",
]
