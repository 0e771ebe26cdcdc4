"""Capacity shares of the fleet's replicas (pure): N gateway replicas in front of the same
backends split each backend's in-flight capacity so that together they allow what one
replica alone would (issue 14, item 5).

Each replica reports its *demand* (requests it holds in flight plus those waiting in its
queue); :func:`split` gives every replica a share of a capacity proportional to its demand,
with a floor (default 1 slot) so an idle replica can still start a request and report the
demand it meets; the shares sum to the capacity (largest-remainder apportionment, Hamilton's
method), so the replicas together never allow more than the capacity while each holds its
share. Ties between equal remainders are broken by a hash of the replica id and a ``salt``
(the backend id), the same on every replica (``hashlib``, not Python's salted ``hash()``),
so every replica computes the same split from the same demands and the leftover slots of
several backends do not all go to the same replica.

The bound, documented in ``docs/architecture.md`` ("Fleet mode"): a share that shrinks does
not cut the requests already running under the larger one; they end at their own pace, and
until then the fleet's total in flight may exceed the capacity by what the shrinking
replicas still run above their new share. With more replicas than ``capacity / floor`` each
keeps its floor and the total is ``replicas x floor``.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping


def _tiebreak(replica: str, salt: str) -> int:
    """A stable pseudo-random rank of ``replica`` for ``salt`` (same on every process)."""
    digest = hashlib.blake2b(f"{salt}\x00{replica}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def split(
    capacity: int, demands: Mapping[str, float], floor: int = 1, salt: str = ""
) -> dict[str, int]:
    """Replica id -> its share of ``capacity`` (slots, requests in flight).

    ``demands``: replica id -> demand (requests in flight plus queued; negative counts as
    0). Every replica gets at least ``floor``; the rest, ``capacity - n x floor``, is split
    in proportion to the demands (equally when none has any), rounded by largest remainder,
    so the shares sum to ``capacity`` whenever ``capacity >= n x floor``. ``salt``: breaks
    ties between equal remainders differently per backend. Empty ``demands``: ``{}``.
    """
    ids = sorted(demands)
    n = len(ids)
    if n == 0:
        return {}
    if capacity <= n * floor:
        return dict.fromkeys(ids, floor)
    rest = capacity - n * floor
    weights = {r: max(0.0, float(demands[r])) for r in ids}
    total = sum(weights.values())
    if total <= 0 or not math.isfinite(total):
        weights = dict.fromkeys(ids, 1.0)
        total = float(n)
    quotas = {r: rest * weights[r] / total for r in ids}
    out = {r: floor + math.floor(quotas[r]) for r in ids}
    left = capacity - sum(out.values())
    order = sorted(ids, key=lambda r: (-(quotas[r] - math.floor(quotas[r])), _tiebreak(r, salt)))
    for r in order[:left]:
        out[r] += 1
    return out
