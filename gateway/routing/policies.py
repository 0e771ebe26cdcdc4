"""The routing policy interface, the field's simple policies, and the factory (pure: no I/O).

The request path (pipeline, batcher) and the fleet simulator call a policy only through
:class:`Policy`: ``pick(candidates, session_key)`` and ``weight(candidate, now)``.
``routing.policy`` selects the implementation, :func:`build_policy` builds it:

* ``load_thermal`` (default): :class:`gateway.routing.policy.LoadThermalPolicy`, the
  gateway's own: least load score from vLLM's gauges corrected by the gateway's in-flight
  count, thermal and power penalties through its ``thermal`` hook, session affinity;
* ``least_request``: :class:`LeastRequestPolicy`, fewest requests in flight (the gateway's
  own exact count), ties in turn: Envoy's ``LEAST_REQUEST`` comparing every host (Envoy
  samples two by default), what most LLM routers do;
* ``round_robin``: :class:`RoundRobinPolicy`, every candidate in turn, blind to load and heat.

The two simple policies read only ``in_flight`` and ``warm_since`` of a candidate: no load
sample, no GPU telemetry, no session affinity (``session_key`` is accepted and ignored).
All three apply the same slow-start ramp (:class:`gateway.routing.policy.SlowStart`), so a
backend back from a rest takes a growing share whatever the policy.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from typing import Protocol

from gateway.config import LifecycleConfig, RoutingConfig, RoutingPolicy
from gateway.routing.policy import (
    AffinityTable,
    C,
    Candidate,
    LoadThermalPolicy,
    SlowStart,
    ThermalHook,
)

__all__ = [
    "LeastRequestPolicy",
    "Policy",
    "RoundRobinPolicy",
    "build_policy",
]


class Policy(Protocol):
    """What the request path calls to choose a backend."""

    def pick(self, candidates: Sequence[C], session_key: str | None = None) -> C | None:
        """The backend for the next request among ``candidates`` (already filtered:
        routable, serving the model, not yet tried by this request), or None when there is
        none to take it. ``session_key``: the request's session (affinity), or None."""
        ...

    def weight(self, c: Candidate, now: float) -> float:
        """Slow-start share multiplier (0-1] of ``c`` at ``now`` (monotonic seconds)."""
        ...


class RoundRobinPolicy:
    """Every candidate in turn (a counter over the candidates given), then slow start.

    ``slow_start``: the shared ramp (a winner still ramping may pass the request to the
    next in turn).
    """

    def __init__(self, slow_start: SlowStart, clock: Callable[[], float]) -> None:
        self._slow = slow_start
        self._clock = clock
        self._next = 0

    def weight(self, c: Candidate, now: float) -> float:
        """Slow-start share multiplier of ``c`` now (1 when past the ramp)."""
        return self._slow.weight(c, now)

    def pick(self, candidates: Sequence[C], session_key: str | None = None) -> C | None:
        """The next candidate in turn, or None when there is none (``session_key`` ignored)."""
        if not candidates:
            return None
        best = candidates[self._next % len(candidates)]
        if self._slow.passes_over(best, len(candidates) - 1, self._clock()):
            rest = [c for c in candidates if c is not best]  # the turn moves on all the same
            best = rest[self._next % len(rest)]
        self._next += 1
        return best


class LeastRequestPolicy:
    """Fewest requests in flight; among equals, the first after the last pick's position
    (ties in turn, so an idle fleet shares evenly); then slow start."""

    def __init__(self, slow_start: SlowStart, clock: Callable[[], float]) -> None:
        self._slow = slow_start
        self._clock = clock
        self._last = -1

    def weight(self, c: Candidate, now: float) -> float:
        """Slow-start share multiplier of ``c`` now (1 when past the ramp)."""
        return self._slow.weight(c, now)

    def pick(self, candidates: Sequence[C], session_key: str | None = None) -> C | None:
        """The candidate with the fewest requests in flight, or None when there is none
        (``session_key`` ignored)."""
        if not candidates:
            return None
        j = self._fewest(candidates, self._last)
        best = candidates[j]
        self._last = j  # the turn moves on even when slow start passes the request over
        if self._slow.passes_over(best, len(candidates) - 1, self._clock()):
            rest = [c for c in candidates if c is not best]
            best = rest[self._fewest(rest, j - 1)]
        return best

    @staticmethod
    def _fewest(candidates: Sequence[C], after: int) -> int:
        """Position of the first candidate with the fewest in flight after ``after``."""
        n = len(candidates)
        low = min(c.in_flight for c in candidates)
        for k in range(1, n + 1):
            j = (after + k) % n
            if candidates[j].in_flight == low:
                return j
        raise AssertionError("unreachable: one candidate has the least in flight")


def build_policy(
    routing: RoutingConfig,
    lifecycle: LifecycleConfig,
    stale_after_s: float,
    clock: Callable[[], float],
    thermal: ThermalHook | None = None,
    rng: random.Random | None = None,
    rendezvous: bool = False,
) -> Policy:
    """The policy ``routing.policy`` names, configured.

    ``lifecycle``: its ``slow_start_s`` / ``slow_start_min_weight`` (the ramp, every policy);
    ``stale_after_s``: load samples older than this are ignored (``telemetry.stale_after_s``;
    ``load_thermal`` only); ``clock``: monotonic seconds; ``thermal``: the thermal hook
    (``load_thermal`` only; the simple policies are blind to heat by definition);
    ``rng``: the slow-start draws (a fresh ``random.Random()`` when None); ``rendezvous``:
    sessions by rendezvous hashing (fleet mode; ``load_thermal`` only).
    """
    rng = rng or random.Random()
    name = routing.policy
    if name is RoutingPolicy.LOAD_THERMAL:
        return LoadThermalPolicy(
            routing.weights,
            stale_after_s,
            AffinityTable(routing.session_ttl_s, routing.session_max_entries, clock),
            clock,
            slow_start_s=lifecycle.slow_start_s,
            slow_start_min_weight=lifecycle.slow_start_min_weight,
            rng=rng,
            thermal=thermal,
            rendezvous=rendezvous,
        )
    slow = SlowStart(lifecycle.slow_start_s, lifecycle.slow_start_min_weight, rng)
    if name is RoutingPolicy.LEAST_REQUEST:
        return LeastRequestPolicy(slow, clock)
    if name is RoutingPolicy.ROUND_ROBIN:
        return RoundRobinPolicy(slow, clock)
    raise ValueError(f"unknown routing policy {name!r}")
