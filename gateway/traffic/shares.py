"""Capacity shares of the fleet's replicas (pure): N gateway replicas in front of the same
backends split each backend's in-flight capacity so that together they allow what one
replica alone would (issue 14, item 5).

Each replica reports its *demand* (requests it holds in flight plus those waiting in its
queue, by priority class); :func:`split_classes` gives every replica a share of a capacity,
the most urgent class first and in proportion to demand within a class, with a floor
(default 1 slot) so an idle replica can still start a request and report the demand it
meets; the shares sum to the capacity (largest-remainder apportionment, Hamilton's method),
so the replicas together never allow more than the capacity while each holds its share. Ties
between equal remainders are broken by a hash of the replica id and a ``salt`` (the backend
id), the same on every replica (``hashlib``, not Python's salted ``hash()``), so every
replica computes the same split from the same demands and the leftover slots of several
backends do not all go to the same replica.


The bound, documented in ``docs/architecture.md`` ("Fleet mode"): a share that shrinks does
not cut the requests already running under the larger one; they end at their own pace, and
until then the fleet's total in flight may exceed the capacity by what the shrinking
replicas still run above their new share. With more replicas than ``capacity / floor`` each
keeps its floor and the total is ``replicas x floor``.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping, Sequence


def _tiebreak(replica: str, salt: str) -> int:
    """A stable pseudo-random rank of ``replica`` for ``salt`` (same on every process)."""
    digest = hashlib.blake2b(f"{salt}\x00{replica}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def split(
    capacity: int, demands: Mapping[str, float], floor: int = 1, salt: str = ""
) -> dict[str, int]:
    """Replica id -> its share of ``capacity`` (slots, requests in flight), in proportion
    to one demand figure per replica (requests; :func:`split_classes` with one class).
    Empty ``demands``: ``{}``."""
    return split_classes(capacity, {r: (d,) for r, d in demands.items()}, floor, salt)


def split_classes(
    capacity: int, demands: Mapping[str, Sequence[float]], floor: int = 1, salt: str = ""
) -> dict[str, int]:
    """Replica id -> its share of ``capacity`` (slots), priorities first.

    ``demands``: replica id -> its demand per class, most urgent first (requests; negative
    counts as 0; e.g. ``(high running and queued, normal and low running plus normal queued,
    low queued)``). Every
    replica gets at least ``floor``; the rest, ``capacity - n x floor``, goes to the
    classes in order: a class whose total demand fits gets it all, the first that does not
    fit gets what is left in proportion to its demands, and the classes after it nothing;
    what is left when every demand is met is split in proportion to the replicas' total
    demands (equally when none has any). So a replica whose clients wait at high priority
    takes slots from one whose queue holds only low-priority requests, however the load
    balancer spread them. Rounded by largest remainder, so the shares sum to ``capacity``
    whenever ``capacity >= n x floor``; ``salt``: breaks ties between equal remainders
    differently per backend.
    """
    ids = sorted(demands)
    n = len(ids)
    if n == 0:
        return {}
    if capacity <= n * floor:
        return dict.fromkeys(ids, floor)
    rest = float(capacity - n * floor)
    clean = {r: [max(0.0, float(x)) if math.isfinite(x) else 0.0 for x in demands[r]]
             for r in ids}
    quotas = dict.fromkeys(ids, 0.0)
    for k in range(max(len(d) for d in clean.values())):
        if rest <= 0:
            break
        want = {r: clean[r][k] if k < len(clean[r]) else 0.0 for r in ids}
        total = sum(want.values())
        if total <= 0:
            continue
        take = min(rest, total)
        for r in ids:
            quotas[r] += take * want[r] / total
        rest -= take
    if rest > 1e-9:
        weights = {r: sum(clean[r]) for r in ids}
        total = sum(weights.values())
        if total <= 0:
            weights, total = dict.fromkeys(ids, 1.0), float(n)
        for r in ids:
            quotas[r] += rest * weights[r] / total
    out = {r: floor + math.floor(quotas[r] + 1e-9) for r in ids}
    left = capacity - sum(out.values())
    order = sorted(ids, key=lambda r: (-(quotas[r] - math.floor(quotas[r] + 1e-9)),
                                       _tiebreak(r, salt)))
    for r in order[: max(0, left)]:
        out[r] += 1
    return out
