"""The gateway's own routing policy: load score, thermal hook, slow start, session affinity
(pure: no I/O; clock injected). :class:`LoadThermalPolicy` is the ``load_thermal``
implementation of :class:`gateway.routing.policies.Policy` (the default of ``routing.policy``).

Score (lower wins) of a candidate backend, from its last vLLM scrape corrected by the
gateway's own in-flight count since that scrape::

    total     = waiting + running + (in_flight_now - in_flight_at_scrape)   (>= 0)
    running'  = min(total, capacity)        waiting' = total - running'   (capacity known)
    running'  = running + delta             waiting' = waiting   (capacity unknown, delta >= 0)
    waiting'  = max(0, waiting + delta)     running' = the rest  (capacity unknown, delta < 0:
                                                                  the queue moves up first)
    score     = w_waiting * waiting' + w_running * running' / capacity + w_kv * kv_usage
                + w_failures * consecutive failures on the backend's breaker

(capacity = vLLM ``--max-num-seqs``; unknown -> 256, vLLM's default ``max_num_seqs``.) The
correction means a burst that arrives between two scrapes spreads over the fleet instead of
landing on the backend that looked idle at the last scrape. Without a fresh sample (none, or
older than the stale limit) only the gateway's in-flight count is used. Ties are broken
round-robin so an idle fleet shares load evenly. The failure term (off by default) steers
traffic away from a backend that just failed, before its breaker opens or its probes fail;
with it off, a failing backend keeps its share until ``breaker.consecutive_failures`` in a
row open its breaker (each such request is retried elsewhere, within the retry budget).

Slow start: a backend that just became warm (``warm_since``) takes a share of traffic that
ramps linearly over ``slow_start_s`` (:func:`slow_start_weight`):
when it wins the pick, it keeps the request only with probability equal to its weight,
otherwise the best other candidate takes it. Its share is thus its weight times what it
would get at full weight.

Thermal and power awareness (optional ``thermal`` hook given at construction, in the live
gateway :meth:`gateway.fleet.gpu_monitor.GpuMonitor.choose` over
:func:`gateway.routing.thermal.choose`): hot backends are dropped from the candidates and
warm, stale-telemetry, power-capped or over-budget-domain backends get a score penalty,
plus a term for predicted temperature.

Session affinity (header ``x-session-id`` by default) pins a session to the backend that
served its first request, for prefix-cache reuse; when that backend stops being a candidate
(unhealthy, draining, gone) the session is re-pinned to the best candidate and stays there.
In fleet mode (``rendezvous``) a session goes instead to its rendezvous-hashing choice among
the candidates (:mod:`gateway.routing.rendezvous`), which every replica computes alike.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol, TypeVar

from gateway.config import RoutingWeights
from gateway.core.samples import LoadSample
from gateway.routing import rendezvous
from gateway.routing.thermal import ThermalChoice

__all__ = [
    "DEFAULT_CAPACITY",
    "AffinityTable",
    "C",
    "Candidate",
    "LoadThermalPolicy",
    "SlowStart",
    "ThermalHook",
    "estimated_load",
    "score",
]

DEFAULT_CAPACITY = 256  # vLLM's default --max-num-seqs
_EPS = 1e-9


def slow_start_weight(
    warm_since: float | None, now: float, slow_start_s: float, min_weight: float
) -> float:
    """Share multiplier (0-1] of a backend that became warm at ``warm_since`` (seconds).

    Ramps linearly from ``min_weight`` to 1 over ``slow_start_s`` (Envoy's slow-start mode
    ramps weights over a window the same way, with a minimum weight of 10% by default).
    """
    if warm_since is None or slow_start_s <= 0:
        return 1.0
    progress = (now - warm_since) / slow_start_s
    if progress >= 1.0:
        return 1.0
    return max(min_weight, progress)


class Candidate(Protocol):
    """What a policy reads of a backend (:class:`gateway.fleet.backend.Backend` is one).

    ``capacity``: vLLM ``--max-num-seqs`` when known; ``in_flight``: the gateway's requests
    open there now; ``load``: the last vLLM scrape; ``warm_since``: monotonic seconds the
    slow-start ramp began; ``recent_failures``: consecutive failures on its breaker.
    """

    @property
    def id(self) -> str: ...

    @property
    def capacity(self) -> int | None: ...

    in_flight: int
    load: LoadSample | None
    warm_since: float | None

    @property
    def recent_failures(self) -> int: ...


def estimated_load(c: Candidate, now: float, stale_after_s: float) -> tuple[float, float, float]:
    """``(waiting, running, kv_usage)`` of ``c`` now, corrected by in-flight changes.

    ``now`` is monotonic seconds (same clock as ``LoadSample.scraped_at``). Counts are in
    the gateway's places: the extra engine requests of the embeddings requests in flight at
    scrape time (``pooled_extra_at_scrape``: vLLM runs an embeddings request of k inputs,
    a client's list or the batcher's merge, as k engine requests queued at once, one
    prefill step) are taken out of the sample, so a list of inputs never reads as saturation
    (counting them had the gateway shed its own merged traffic with 429s,
    ``benchmarks/embed_merge_real.py``).

    Never less than the gateway's own requests in flight there (``in_flight``): a backend
    that holds them without reporting them (hung, or a broken ``/metrics``) still counts
    them (it took every request while it reported none).
    """
    s = c.load
    mine = float(c.in_flight)
    if s is None or now - s.scraped_at > stale_after_s:
        return 0.0, mine, 0.0
    delta = c.in_flight - s.in_flight_at_scrape
    own = s.pooled_extra_at_scrape
    cap = c.capacity
    if cap:
        total = max(mine, s.waiting + s.running - own + delta)
        running = min(total, float(cap))
        return total - running, running, s.kv_cache_usage
    waiting = max(0.0, s.waiting - own)
    running = max(0.0, s.running - max(0.0, own - s.waiting))
    if delta >= 0:
        running += delta
    else:  # departures: the queue moves up first (vLLM admits waiting requests FCFS)
        left = -delta
        moved = min(waiting, left)
        waiting -= moved
        running = max(0.0, running - (left - moved))
    return waiting, max(running, mine - waiting), s.kv_cache_usage


def score(c: Candidate, w: RoutingWeights, now: float, stale_after_s: float) -> float:
    """The load score of one candidate (see the module docstring); dimensionless."""
    waiting, running, kv = estimated_load(c, now, stale_after_s)
    cap = c.capacity or DEFAULT_CAPACITY
    return (
        w.waiting * waiting
        + w.running * running / cap
        + w.kv_cache * kv
        + w.failures * c.recent_failures
    )


C = TypeVar("C", bound=Candidate)


class ThermalHook(Protocol):
    """``(candidates, now)`` (positional; ``now`` monotonic seconds) -> the candidates kept
    (hot ones dropped) and their penalties: :func:`gateway.routing.thermal.choose` over the
    fleet's current view (live: :meth:`gateway.fleet.gpu_monitor.GpuMonitor.choose`)."""

    def __call__(self, candidates: Sequence[C], now: float, /) -> ThermalChoice[C]: ...


class AffinityTable:
    """Session key -> backend id, bounded (LRU) and with a time to live.

    ``clock`` returns monotonic seconds. Memory is bounded by ``max_entries``.
    """

    def __init__(self, ttl_s: float, max_entries: int, clock: Callable[[], float]) -> None:
        self._ttl = ttl_s
        self._max = max_entries
        self._clock = clock
        self._pins: OrderedDict[str, tuple[str, float]] = OrderedDict()

    def get(self, key: str) -> str | None:
        """The backend id ``key`` is pinned to, or None (never pinned, or expired)."""
        item = self._pins.get(key)
        if item is None:
            return None
        backend_id, expires = item
        if expires < self._clock():
            del self._pins[key]
            return None
        return backend_id

    def pin(self, key: str, backend_id: str) -> None:
        """Pin ``key`` to ``backend_id`` for ``ttl_s`` from now (the oldest pin goes when
        over ``max_entries``)."""
        self._pins[key] = (backend_id, self._clock() + self._ttl)
        self._pins.move_to_end(key)
        while len(self._pins) > self._max:
            self._pins.popitem(last=False)

    def __len__(self) -> int:
        return len(self._pins)


class SlowStart:
    """The slow-start ramp every policy applies (Envoy's slow-start mode).

    A backend that became warm ``slow_start_s`` ago or less has a weight in
    [``min_weight``, 1) (:func:`slow_start_weight`); when a policy
    picks it, it keeps the request only with probability equal to its weight (``rng``),
    otherwise the policy picks among the others. Off with ``slow_start_s`` 0.
    """

    def __init__(self, slow_start_s: float, min_weight: float, rng: random.Random) -> None:
        self.slow_start_s = slow_start_s
        self.min_weight = min_weight
        self._rng = rng

    def weight(self, c: Candidate, now: float) -> float:
        """Share multiplier (0-1] of ``c`` at ``now`` (monotonic seconds); 1 past the ramp."""
        return slow_start_weight(c.warm_since, now, self.slow_start_s, self.min_weight)

    def passes_over(self, c: Candidate, others: int, now: float) -> bool:
        """Whether the pick of ``c`` goes to one of ``others`` other candidates instead:
        never without others or with the ramp off; else a draw against ``c``'s weight."""
        if others < 1 or self.slow_start_s <= 0:
            return False
        w = self.weight(c, now)
        return w < 1.0 and self._rng.random() >= w


class LoadThermalPolicy:
    """The gateway's own policy (``routing.policy: load_thermal``): least load score
    (:func:`score`) plus the ``thermal`` hook's penalties, hot backends dropped, session
    affinity first, round-robin among equal scores, slow start for newly warm backends.

    ``stale_after_s``: a load sample older than this is ignored (``telemetry``);
    ``clock``: monotonic seconds; ``rng``: the slow-start draws (seeded in tests and in the
    simulator); ``thermal``: ``(candidates, now) -> ThermalChoice`` or None (thermal
    awareness off).
    """

    def __init__(
        self,
        weights: RoutingWeights,
        stale_after_s: float,
        affinity: AffinityTable,
        clock: Callable[[], float],
        slow_start_s: float = 0.0,
        slow_start_min_weight: float = 0.1,
        rng: random.Random | None = None,
        thermal: ThermalHook | None = None,
        rendezvous: bool = False,
    ) -> None:
        self.weights = weights
        # fleet mode: sessions by rendezvous hashing (gateway.routing.rendezvous), the same
        # backend from every replica without a shared table
        self.rendezvous = rendezvous
        self.stale_after_s = stale_after_s
        self.affinity = affinity
        self._thermal = thermal
        self._clock = clock
        self._slow = SlowStart(slow_start_s, slow_start_min_weight, rng or random.Random())
        self._rr = 0

    def reweight(self, weights: RoutingWeights) -> None:
        """A live reload's ``routing.weights``: the next pick scores with them."""
        self.weights = weights

    @property
    def thermal(self) -> ThermalHook | None:
        """The thermal hook given at construction (read-only), or None."""
        return self._thermal

    def weight(self, c: Candidate, now: float) -> float:
        """Slow-start share multiplier of ``c`` now (1 when past the ramp)."""
        return self._slow.weight(c, now)

    def pick(self, candidates: Sequence[C], session_key: str | None = None) -> C | None:
        """The backend for the next request, or None when no candidate is left.

        ``candidates`` are already filtered (routable, serving the model, not yet tried by
        this request). With a ``thermal`` hook, hot candidates are dropped first and its
        penalties (backend id -> load-score units) added to the scores (every candidate
        hot: the hook keeps them all). With ``session_key``, a pinned backend still among
        the candidates wins (a session pinned to a warm backend stays there, for its prefix
        cache; never on a hot one); otherwise the best one is chosen and pinned. With
        ``rendezvous`` (fleet mode), a session goes to its rendezvous-hashing choice among
        the candidates instead (the same on every replica; load and slow start not asked).
        """
        penalties: Mapping[str, float] | None = None
        if self._thermal is not None and candidates:
            choice = self._thermal(candidates, self._clock())
            candidates = choice.candidates
            penalties = choice.penalties
        if not candidates:
            return None
        if session_key is not None and self.rendezvous:
            return rendezvous.pick(session_key, candidates)
        if session_key is not None:
            pinned = self.affinity.get(session_key)
            if pinned is not None:
                for c in candidates:
                    if c.id == pinned:
                        self.affinity.pin(session_key, c.id)  # refresh the TTL
                        return c
        now = self._clock()
        best = self._least_loaded(candidates, now, penalties)
        if self._slow.passes_over(best, len(candidates) - 1, now):
            rest = [c for c in candidates if c is not best]
            best = self._least_loaded(rest, now, penalties)
        if session_key is not None:
            self.affinity.pin(session_key, best.id)
        return best

    def _least_loaded(
        self, candidates: Sequence[C], now: float, penalties: Mapping[str, float] | None
    ) -> C:
        if len(candidates) == 1:
            return candidates[0]
        w, stale = self.weights, self.stale_after_s
        scores = [score(c, w, now, stale) for c in candidates]
        if penalties:
            scores = [s + penalties.get(c.id, 0.0) for c, s in zip(candidates, scores, strict=True)]
        low = min(scores)
        ties = [c for c, s in zip(candidates, scores, strict=True) if s - low <= _EPS]
        self._rr += 1
        return ties[self._rr % len(ties)]
