"""Whether `podman run --rm` removed the attempt's container, proven from the slot's files.

A release must leave nothing of the attempt. The container is run with `--rm`, so
the `podman run` inside the service removes it before it returns; a second rootless
Podman start at release (`podman rm`, about half a bare run's cost) is then needed
only when that removal cannot be shown. It is shown when all of this holds, read
without starting Podman and without following a link:

1. no process of the slot account is left (nothing can be writing Podman's files);
2. the wrapper recorded `podman run`'s exit status: `podman run` returned by itself,
   after its removal (a stop that killed it leaves no status);
3. the container ID Podman wrote to the `--cidfile` is there;
4. Podman's state database (BoltDB, `libpod/bolt_state.db` under the slot's storage)
   lists no container, and records for that ID the exit code conmon reported, equal
   to the wrapper's status and to the one the provider read from conmon's own file
   while observing (when it did);
5. containers-storage lists no container (`overlay-containers/containers.json`, and
   `volatile-containers.json` where a newer one keeps `--rm` containers), every layer
   it lists belongs to an image (a container's layer is deleted apart from its
   record, and a failure there does not stop Podman removing the record), and
   neither the storage nor the run root has a directory for that ID.

Anything else (a stop killed `podman run`, a removal that failed, a database this
reader does not know, a file it cannot read) names what was not shown, and the
release runs `podman rm` as before. Verified with Podman 4.3 (Debian 12): Podman 4.4
and later delete the `--cidfile` with the container and Podman 5 keeps its state in
SQLite, so there every release runs `podman rm`.

Root reads these files although the slot account writes them: each is opened without
following a link and read up to a bound, the BoltDB reader bounds its work
(boltdb.py), and any error is a reason to run `podman rm`, never a failed release.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Callable
from typing import Any, TypeVar

import msgspec

from ficc_provider_podman import boltdb, observe
from ficc_provider_podman.account import SlotAccount, live_processes_of
from ficc_provider_podman.container import EXIT_STATUS, AttemptPaths

STATE_DATABASE = ("libpod", "bolt_state.db")
"""Podman 4's state, under the storage root (its default static directory)."""
CONTAINER_RECORDS = ("overlay-containers", "containers.json")
VOLATILE_CONTAINER_RECORDS = ("overlay-containers", "volatile-containers.json")
LAYER_RECORDS = ("overlay-layers", "layers.json")
VOLATILE_LAYER_RECORDS = ("overlay-layers", "volatile-layers.json")
IMAGE_RECORDS = ("overlay-images", "images.json")
"""Where containers-storage (the overlay driver, storage.conf) lists its images."""
MAX_DATABASE_BYTES = 16 << 20
MAX_RECORDS_BYTES = 4 << 20
_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_T = TypeVar("_T")


class _Layer(msgspec.Struct):
    id: str
    parent: str = ""


class _Image(msgspec.Struct):
    layer: str = ""


class _Container(msgspec.Struct):
    id: str


def not_shown(slot: SlotAccount, paths: AttemptPaths, conmon_status: int | None) -> str | None:
    """None when the container is proven removed; otherwise what could not be shown."""
    return _guarded(_check, slot, paths, conmon_status)


def storage_not_clean(slot: SlotAccount, container_id: str) -> str | None:
    """Step 5 alone: None when containers-storage holds nothing of the container."""
    return _guarded(_storage_clean, slot, container_id)


def _guarded(check: Callable[..., str | None], *args: Any) -> str | None:
    try:
        return check(*args)
    except Exception as error:  # anything unreadable: `podman rm` decides
        return f"the slot's files could not be read: {type(error).__name__}: {error}"


def _check(slot: SlotAccount, paths: AttemptPaths, conmon_status: int | None) -> str | None:
    if live_processes_of(slot.uid):
        return "processes of the slot account are still running"
    status = observe.exit_status(paths.run, EXIT_STATUS)
    if status is None:
        return "podman run did not return by itself"
    container_id = observe.container_id(paths.run)
    if container_id is None:
        return "no container ID was recorded"
    database = _read(slot.storage, STATE_DATABASE, MAX_DATABASE_BYTES)
    if database is None:
        return "Podman's state database is not a BoltDB file here"
    buckets = boltdb.read_buckets(database, values_of={b"exit-code"})
    if buckets.get(b"all-ctrs") or buckets.get(b"ctr"):
        return "Podman's state database still lists a container"
    recorded = buckets.get(b"exit-code", {}).get(container_id.encode())
    agreed = {str(status).encode()}
    if conmon_status is not None:
        agreed.add(str(conmon_status).encode())
    if recorded is None or {recorded} != agreed:
        return (
            f"exit statuses disagree: podman run {status}, conmon {conmon_status},"
            f" Podman's state {recorded!r}"
        )
    return _storage_clean(slot, container_id)


def _storage_clean(slot: SlotAccount, container_id: str) -> str | None:
    for below in (CONTAINER_RECORDS, VOLATILE_CONTAINER_RECORDS):
        containers = _records(slot.storage, below, list[_Container])
        if containers:
            return f"containers-storage still lists a container ({'/'.join(below)})"
    layers = _records(slot.storage, LAYER_RECORDS, list[_Layer]) or []
    layers += _records(slot.storage, VOLATILE_LAYER_RECORDS, list[_Layer]) or []
    images = _records(slot.storage, IMAGE_RECORDS, list[_Image]) or []
    if stray := _layers_of_no_image(layers, images):
        return f"containers-storage still holds layers of no image: {sorted(stray)[:3]}"
    for root in (slot.storage, f"{slot.runtime_dir}/containers"):
        if not _absent(root, ["overlay-containers", container_id]):
            return f"{root} still holds the container's directory"
    return None


def _layers_of_no_image(layers: list[_Layer], images: list[_Image]) -> set[str]:
    parent = {layer.id: layer.parent for layer in layers}
    kept: set[str] = set()
    for image in images:
        layer = image.layer
        while layer and layer in parent and layer not in kept:
            kept.add(layer)
            layer = parent[layer]
    return set(parent) - kept


def _records(storage: str, below: tuple[str, str], kind: type[list[_T]]) -> list[_T] | None:
    """A containers-storage JSON list (None when the file does not exist)."""
    data = _read(storage, below, MAX_RECORDS_BYTES)
    return None if data is None else msgspec.json.decode(data, type=kind)


def _read(root: str, below: tuple[str, str], limit: int) -> bytes | None:
    base = os.open(root, _DIR)
    try:
        return observe.read_below(base, [below[0]], below[1], limit)
    finally:
        os.close(base)


def _absent(root: str, components: list[str]) -> bool:
    """Whether `root/components...` does not exist; every directory on the way is
    opened without following a link, and any answer but "no such file" is a no."""
    try:
        fd = os.open(root, _DIR)
    except FileNotFoundError:
        return True
    try:
        for directory in components[:-1]:
            try:
                below = os.open(directory, _DIR, dir_fd=fd)
            except FileNotFoundError:
                return True
            os.close(fd)
            fd = below
        try:
            os.stat(components[-1], dir_fd=fd, follow_symlinks=False)
        except OSError as error:
            return error.errno == errno.ENOENT
        return False
    finally:
        os.close(fd)
