"""Content digests as the protocol writes them: `sha256:` and 64 lower-case hex digits.

`digest_of` is the protocol's own function (re-exported, so a test computes a digest
exactly as the daemon does); `of_hasher` finishes one computed in pieces; `fake` is a
well-formed digest of no content, for fields whose value a test never checks against
bytes.
"""

from __future__ import annotations

import hashlib

from ficc.execution.plan import digest_of

PREFIX = "sha256:"


def of_hasher(hasher: hashlib._Hash) -> str:
    """The digest of what a `hashlib.sha256()` object has been fed."""
    return PREFIX + hasher.hexdigest()


def fake(fill: str = "ab") -> str:
    """A well-formed digest made of `fill` repeated (one or two hex digits)."""
    text = fill * (64 // len(fill))
    assert len(text) == 64, fill
    assert all(c in "0123456789abcdef" for c in text), fill
    return PREFIX + text


__all__ = ["PREFIX", "digest_of", "fake", "of_hasher"]
