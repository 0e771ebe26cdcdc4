"""Comparing presented keys with configured ones without a timing side channel (issue 20).

A client key is looked up by the SHA-256 digest of the presented bearer token, never by the
token itself: a ``dict`` lookup hashes its key and then compares candidates with ``==``,
which stops at the first differing byte, so a lookup by the raw token would in principle
tell an attacker, through the time taken, how much of a guess matched a real key. Over
digests that comparison learns at most a prefix of a SHA-256 digest, which says nothing of
the key (a preimage). A single key (the admin key) is compared with
:func:`hmac.compare_digest` over both digests (Python's docs: "a constant-time compare to
reduce the risk of timing attacks"), so its length does not show either.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable
from typing import TypeVar

T = TypeVar("T")


def key_digest(secret: str | bytes) -> bytes:
    """SHA-256 of ``secret`` (a ``str`` as UTF-8): 32 bytes."""
    return hashlib.sha256(secret.encode() if isinstance(secret, str) else secret).digest()


def key_matches(presented: bytes | None, key: str) -> bool:
    """Whether ``presented`` (a bearer token's bytes) is ``key``, in constant time."""
    if presented is None:
        return False
    return hmac.compare_digest(key_digest(presented), key_digest(key))


def key_table(entries: Iterable[tuple[str, T]]) -> dict[bytes, T]:
    """``(secret, value)`` pairs as a table by :func:`key_digest`. Raises ``ValueError``
    naming nothing secret when two secrets are the same (one entry would silently win)."""
    out: dict[bytes, T] = {}
    for secret, value in entries:
        d = key_digest(secret)
        if d in out:
            raise ValueError("two client keys resolve to the same secret")
        out[d] = value
    return out
