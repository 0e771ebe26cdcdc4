"""Rendezvous (highest-random-weight) hashing of session ids over backends (pure).

Thaler and Ravishankar, "Using name-based mappings to increase hit rates" (IEEE/ACM ToN,
1998): each (key, backend) pair gets a pseudo-random weight from a hash, and a key goes to
the backend of highest weight among those available. Every process computes the same
answer from the same inputs with no shared table, and when a backend leaves only the keys
it held move, each to its own second choice (the same one on every process); the others stay.

Fleet mode uses it for session affinity (``routing.session_header``): every replica sends a
session to the same backend without asking the shared store
(:class:`gateway.routing.policy.LoadThermalPolicy` with ``rendezvous``). The hash is
BLAKE2b (``hashlib``), never Python's ``hash()``, which is salted per process.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Protocol, TypeVar


class _Named(Protocol):
    @property
    def id(self) -> str: ...


N = TypeVar("N", bound=_Named)


def weight(key: str, node: str) -> int:
    """The weight of ``node`` for ``key``: 64 bits of BLAKE2b over both (a NUL between)."""
    digest = hashlib.blake2b(f"{key}\x00{node}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def pick(key: str, nodes: Sequence[N]) -> N | None:
    """The node of ``nodes`` (by ``.id``) that ``key`` maps to, or None when there is none.
    Ties (a 64-bit collision) go to the smaller id, so the answer never depends on order."""
    best: N | None = None
    best_w = -1
    for n in nodes:
        w = weight(key, n.id)
        if w > best_w or (w == best_w and best is not None and n.id < best.id):
            best, best_w = n, w
    return best
