"""The initialization marker kept inside `host.lock`. Pure bytes in, bytes out.

Once the first snapshot is saved, `host.lock` receives this one line (canonical JSON
plus a newline) and is synced. From then on a missing `state.json` is an integrity
failure instead of "a fresh store", so deleting the snapshot cannot silently reset
the host's history. `host.lock` itself is never removed or replaced: its inode is the
lock's identity.
"""

from __future__ import annotations

import msgspec

from .errors import Corrupt
from .model import HostId

FORMAT = "ficc-hoststate-marker"
VERSION = 1
MAX_BYTES = 4096


class Marker(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The ownership marker: which host a state directory belongs to, in which format."""

    format: str
    host_id: HostId
    version: int


_ENCODER = msgspec.json.Encoder(order="sorted")
_DECODER = msgspec.json.Decoder(Marker)


def encode(host_id: str) -> bytes:
    """The marker bytes for `host_id`, one JSON line with sorted keys."""
    return _ENCODER.encode(Marker(FORMAT, host_id, VERSION)) + b"\n"


def decode(data: bytes) -> str | None:
    """The host ID the marker names, or None when `host.lock` is still empty."""
    if not data:
        return None
    try:
        marker = _DECODER.decode(data[:-1]) if data.endswith(b"\n") else None
    except (msgspec.DecodeError, msgspec.ValidationError):
        marker = None
    if marker is None or marker.format != FORMAT or marker.version != VERSION:
        raise Corrupt(_GARBAGE)
    if encode(marker.host_id) != data:
        raise Corrupt(_GARBAGE)
    return marker.host_id


_GARBAGE = (
    "host.lock does not hold a valid initialization marker; do not delete or replace"
    " host.lock. If state.json is valid, truncate host.lock to zero bytes in place"
    " (`truncate -s 0 host.lock`) and acquire again to rewrite the marker from it"
)
