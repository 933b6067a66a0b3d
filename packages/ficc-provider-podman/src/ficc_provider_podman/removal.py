"""Whether `podman run --rm` removed the attempt's container, proven from the slot's files.

A release must leave nothing of the attempt. The container is run with `--rm`, so
the `podman run` inside the service removes it before it returns; a second rootless
Podman start at release (`podman rm`, about half a bare run's cost) is then needed
only when that removal cannot be shown. It is shown when all of this holds, read
without starting Podman and without following a link:

1. no process of the slot account is left (nothing can be writing Podman's files);
2. the wrapper recorded `podman run`'s exit status: it returned by itself, after
   its removal, and was not killed by a stop;
3. the container ID Podman wrote to the `--cidfile` is there;
4. Podman's state database (BoltDB, `libpod/bolt_state.db` under the slot's storage)
   lists no container, and records for that ID the exit code conmon reported, equal
   to the wrapper's status and to the one the provider read from conmon's own file
   while observing (when it did);
5. containers-storage lists no container (`overlay-containers/containers.json` is
   `[]`), and neither the storage nor the run root has a directory for that ID
   (containers-storage deletes the container's layer before its record).

Anything else (a stop killed `podman run`, a removal that failed, a database this
reader does not know, Podman's SQLite state) names what was not shown, and the release
runs `podman rm` as before.
"""

from __future__ import annotations

import json
import os

from ficc_provider_podman import boltdb, observe
from ficc_provider_podman.account import SlotAccount, live_processes_of
from ficc_provider_podman.container import EXIT_STATUS, AttemptPaths
from ficc_provider_podman.errors import ProviderError

STATE_DATABASE = ("libpod", "bolt_state.db")
"""Podman 4's state, under the storage root (its default static directory)."""
CONTAINER_RECORDS = ("overlay-containers", "containers.json")
MAX_DATABASE_BYTES = 64 << 20
MAX_RECORDS_BYTES = 1 << 20


def not_shown(slot: SlotAccount, paths: AttemptPaths, conmon_status: int | None) -> str | None:
    """None when the container is proven removed; otherwise what could not be shown."""
    try:
        return _check(slot, paths, conmon_status)
    except (ProviderError, boltdb.BoltError, OSError, ValueError) as error:
        return f"the slot's files could not be read: {error}"


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
    buckets = boltdb.read_buckets(database)
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
    records = _read(slot.storage, CONTAINER_RECORDS, MAX_RECORDS_BYTES)
    if records is None or json.loads(records) != []:
        return "containers-storage still lists a container"
    for root in (slot.storage, f"{slot.runtime_dir}/containers"):
        if os.path.lexists(f"{root}/overlay-containers/{container_id}"):
            return f"{root} still holds the container's directory"
    return None


def _read(root: str, below: tuple[str, str], limit: int) -> bytes | None:
    base = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        return observe.read_below(base, [below[0]], below[1], limit)
    finally:
        os.close(base)
