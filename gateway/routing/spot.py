"""Spot capacity: each zone's spot health score, and how it steers routing (pure: no I/O;
clock and random draws injected).

**The score** (:class:`ZoneScores`, ``spot:`` in the config, :class:`gateway.config.SpotConfig`).
A zone starts at 1 (no recent notice). A spot interruption notice in the zone multiplies its
score by ``1 - notice_penalty`` (default 0.5), never below ``min_score`` (0.05); between
notices what is missing from 1 halves every ``half_life_s`` seconds (600)::

    score(t) = 1 - (1 - score(t0)) * 2 ** (-(t - t0) / half_life_s)      (t0: the last notice)
    notice:    score = max(min_score, score(t) * (1 - notice_penalty))

So one notice halves a zone's score, which is back to 0.75 after one half-life and to 0.97
after three; two notices in quick succession leave 0.25. A zone whose score is within
:data:`RECOVERED` (0.001) of 1 counts as recovered (score 1; one notice's deficit needs
``log2(0.5 / 0.001)`` = 9 half-lives, 1.5 h at the default). Providers reclaim spot capacity
by zone and instance type (AWS "EC2 Spot Instance interruptions", GCP "Spot VMs"): a notice
for one node says its neighbours may follow, and the score is how much the gateway believes
it; a notice ages out as the provider's capacity pool recovers.

**The routing share** (:class:`SpotSteering`, around whichever policy ``routing.policy``
names). A candidate is *demoted* when it is a spot backend (``placement.capacity_type`` =
``spot``) in a zone of score ``s < 1``; on-demand backends and spot backends of other zones
never are. For a request with ``n`` candidates, ``D`` of them demoted and at least one not:

* without a session: each demoted backend ``d`` takes the request with probability
  ``s_d * w_d / n`` (``w_d``: its slow-start weight, 1 past the ramp) from one uniform draw
  of the injected RNG; otherwise the policy picks among the candidates that are not demoted.
  At full score every policy spreads equal backends evenly (``1 / n`` each: round robin
  exactly, the load-aware policies by balancing), so a demoted backend's share is its share
  at full score times ``s`` -- **exactly, whatever the policy and whatever the load**: the
  draw does not depend on load, so a load-aware policy cannot give back what was taken
  (thinning the candidate list instead would let it: a thinned backend is less loaded and
  wins more of the requests it is still offered). The rest goes to the others, spread by the
  policy.
* with a session (``routing.session_header``): the demoted backends of zone ``z`` stay among
  the request's candidates only when the session's hash for ``z`` (BLAKE2b, uniform in [0,
  1), the same in every process) is below ``s_z``; the policy then picks as usual (affinity
  included). A fraction ``s`` of the sessions keeps the zone's spot backends and the rest
  moves, each session consistently (a session never alternates between zones per request).
* with a thermal hook (``load_thermal`` with GPU telemetry): a demoted backend the hook
  drops as hot takes nothing.

When every candidate is demoted (or none is) the policy picks among all of them unchanged:
the score never makes a model unservable, it only moves traffic to where it can go.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from gateway.config import SpotConfig
from gateway.routing import rendezvous
from gateway.routing.policies import Policy
from gateway.routing.policy import C, Candidate, ThermalHook

__all__ = ["RECOVERED", "SpotSteering", "ZoneScores", "session_draw"]

RECOVERED = 1e-3
"""A zone whose score is within this of 1 counts as recovered (score exactly 1)."""


@dataclass(slots=True)
class _Deficit:
    """What is missing from 1 of a zone's score (``amount``) at monotonic time ``at``."""

    amount: float
    at: float


class ZoneScores:
    """The spot health score of every zone (module docstring), under ``cfg``; ``clock``:
    monotonic seconds. Written by one owner (:class:`gateway.fleet.spot.SpotNotices`), read
    by the router (:class:`SpotSteering`) and the admin API."""

    def __init__(self, cfg: SpotConfig, clock: Callable[[], float]) -> None:
        self.cfg = cfg
        self.clock = clock
        self._deficits: dict[str, _Deficit] = {}
        self._recovered_at = -math.inf  # when the last zone with a deficit recovers

    def _deficit(self, zone: str, now: float) -> float:
        d = self._deficits.get(zone)
        if d is None:
            return 0.0
        left = d.amount * 2.0 ** (-max(0.0, now - d.at) / self.cfg.half_life_s)
        return 0.0 if left < RECOVERED else left

    def score(self, zone: str | None, now: float | None = None) -> float:
        """The zone's score in [``min_score``, 1] at ``now`` (default: the clock); 1 for a
        zone without a recent notice, or None (a backend whose zone is unknown)."""
        if zone is None:
            return 1.0
        return 1.0 - self._deficit(zone, self.clock() if now is None else now)

    def demoted(self, now: float) -> bool:
        """Whether some zone's score is below 1 at ``now`` (O(1): the routing fast path)."""
        return now < self._recovered_at

    def notice(self, zone: str, at: float | None = None) -> float:
        """A spot interruption notice in ``zone`` at monotonic ``at`` (default now): the
        score is multiplied by ``1 - notice_penalty``, floored at ``min_score``. Returns the
        new score. A notice older than the zone's last one (a replica catching up on the
        fleet's notices) is applied at the time of that last one, so scores never go back
        in time (slightly more penalty than an exact replay: documented approximation)."""
        now = self.clock()
        at = now if at is None else min(at, now)
        last = self._deficits.get(zone)
        if last is not None and at < last.at:
            at = last.at
        before = 1.0 - self._deficit(zone, at)
        after = max(self.cfg.min_score, before * (1.0 - self.cfg.notice_penalty))
        deficit = 1.0 - after
        if deficit >= RECOVERED:
            self._deficits[zone] = _Deficit(deficit, at)
            recovers = at + self.cfg.half_life_s * math.log2(deficit / RECOVERED)
            self._recovered_at = max(self._recovered_at, recovers)
        return 1.0 - self._deficit(zone, now)

    def snapshot(self, now: float | None = None) -> dict[str, float]:
        """Zone -> score of every zone not recovered at ``now`` (default: the clock)."""
        t = self.clock() if now is None else now
        out = {z: 1.0 - self._deficit(z, t) for z in self._deficits}
        return {z: s for z, s in out.items() if s < 1.0}


class _Where(Protocol):
    """What :class:`SpotSteering` reads of a backend's placement
    (:class:`gateway.fleet.records.Placement` is one)."""

    @property
    def zone(self) -> str | None: ...

    @property
    def spot(self) -> bool: ...


def session_draw(session_key: str, zone: str) -> float:
    """A session's uniform draw in [0, 1) for ``zone``: rendezvous hashing's 64-bit BLAKE2b
    weight of the pair (:func:`gateway.routing.rendezvous.weight`), the same in every
    process (never Python's salted ``hash()``), over 2**64."""
    return rendezvous.weight(session_key, zone) / 2.0**64


class SpotSteering:
    """``inner`` (any :class:`gateway.routing.policies.Policy`) with the spot share rule of
    the module docstring over ``scores``. ``rng``: the per-request draw; ``clock``:
    monotonic seconds; ``thermal``: the hook ``inner`` applies (``load_thermal`` with GPU
    telemetry), so a hot demoted backend takes nothing. A candidate is read through its
    ``placement`` (zone, spot); one without is never demoted."""

    def __init__(
        self,
        inner: Policy,
        scores: ZoneScores,
        rng: random.Random,
        clock: Callable[[], float],
        thermal: ThermalHook | None = None,
    ) -> None:
        self.inner = inner
        self.scores = scores
        self._rng = rng
        self._clock = clock
        self._thermal = thermal

    def weight(self, c: Candidate, now: float) -> float:
        """The inner policy's slow-start share multiplier of ``c`` at ``now``."""
        return self.inner.weight(c, now)

    def demotion(self, c: Candidate, now: float) -> tuple[str, float] | None:
        """``(zone, score)`` when ``c`` is demoted at ``now`` (a spot backend in a zone of
        score below 1), else None."""
        where: _Where | None = getattr(c, "placement", None)
        if where is None or not where.spot or where.zone is None:
            return None
        s = self.scores.score(where.zone, now)
        return (where.zone, s) if s < 1.0 else None

    def pick(self, candidates: Sequence[C], session_key: str | None = None) -> C | None:
        """The backend for the next request among ``candidates`` (the module docstring's
        rule), or None when there is none."""
        now = self._clock()
        if not candidates or not self.scores.demoted(now):
            return self.inner.pick(candidates, session_key)
        demoted: list[tuple[C, str, float]] = []
        rest: list[C] = []
        for c in candidates:
            d = self.demotion(c, now)
            if d is None:
                rest.append(c)
            else:
                demoted.append((c, d[0], d[1]))
        if not demoted or not rest:
            return self.inner.pick(candidates, session_key)
        if self._thermal is not None:
            kept = {c.id for c in self._thermal(candidates, now).candidates}
            demoted = [x for x in demoted if x[0].id in kept]
        if session_key is not None:
            allowed = {c.id for c in rest}
            allowed.update(c.id for c, zone, s in demoted if session_draw(session_key, zone) < s)
            return self.inner.pick([c for c in candidates if c.id in allowed], session_key)
        n = len(candidates)
        u = self._rng.random()
        acc = 0.0
        for c, _zone, s in demoted:
            acc += s * self.inner.weight(c, now) / n
            if u < acc:
                return c
        return self.inner.pick(rest, session_key)
