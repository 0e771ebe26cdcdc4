"""Thermal tiers, temperature trend and power budgets for routing (pure: no I/O, no clock).

Everything here takes plain values and times passed in (monotonic seconds), so the live
gateway (:mod:`gateway.fleet.gpu_monitor`, :mod:`gateway.routing.policy`) and the fleet
simulator (simulated time) run the same code. Thresholds come from
:class:`gateway.config.ThermalConfig` (defaults from seed 000; build one with
``ThermalConfig()`` or ``ThermalConfig(hot_c=83)``).

Public API
----------
:class:`ThermalTier`
    ``cool`` (< ``warm_c`` 75 °C), ``warm`` (75-85 °C), ``hot`` (>= ``hot_c`` 85 °C, and
    until it reads below ``resume_c`` 70 °C: hysteresis), ``unknown`` (no fresh sample).
:class:`GpuReading` / :class:`GpuSample`
    One GPU's readings / one backend's GPUs reduced (:meth:`GpuSample.from_gpus`): hottest
    temperature (°C), summed power and power limit (W), lowest SM clock (MHz), the last Xid
    code of each GPU and the summed double-bit ECC counter.
:class:`ThermalTracker`
    One backend's recent samples. ``observe(sample)`` then ``tier(now)``,
    ``slope_c_per_s()`` (least-squares slope over ``trend_window_s``),
    ``predicted_c(now)`` (temperature ``predict_ahead_s`` = 60 s ahead, as TAPAS routes on
    predicted headroom), ``status(now, domain)`` -> :class:`ThermalStatus`.
:class:`ThermalStatus`
    What the router reads of one backend's GPUs now. :data:`UNMONITORED` is the status of a
    backend without GPU telemetry configured: tier ``unknown``, ``monitored=False``, routed
    as if thermal awareness were off (a choice: its operator asked for nothing else), while
    a *monitored* backend whose telemetry is missing or stale is ``unknown`` and avoided
    while a backend with known, cooler GPUs can take the request -- never read as cool.
:func:`domain_statuses` -> ``{name: DomainStatus}``
    Summed draw of each power domain (W) against its budget and its target
    (``domain_target_ratio`` = 80% of budget: 20% headroom, seed 000).
:class:`ThermalView` / :func:`build_view`
    A snapshot of every backend's status and every domain at one moment (the live gateway
    takes one per GPU telemetry round; a stale view reads monitored backends as unknown).
:func:`choose` -> :class:`ThermalChoice`
    The one call the router makes: drops hot candidates (unless every candidate is hot:
    then they stay, flagged ``all_hot``, the least hot preferred, so a model never loses its
    last backends to a reading; the GPU's own throttling protects the hardware), and gives
    every kept candidate a score penalty (load-score units, one unit = one queued request):
    warm, unknown, or cool but predicted to reach ``hot_c`` -> ``warm_penalty`` /
    ``unknown_penalty``; over ``power_cap_ratio`` (80%) of its power limit ->
    ``power_penalty``; in a domain over its target -> ``domain_penalty``; and
    ``predicted_weight`` per °C of predicted temperature above the coolest candidate's.
    Penalties rather than a hard filter: a warm backend is avoided while a cooler one can
    take the request without queueing ``warm_penalty`` requests deeper, so steering never
    piles an unbounded queue on the few cool backends. ``hot`` lists the dropped ones (the
    caller sends them to cooldown).
:func:`power_pressure`
    Draw / budget of the least-loaded domain among a model's candidates: admission sheds
    by priority on it (``power_shed_levels``), once steering can no longer help.

When a hot backend is sent to rest, and when that rest ends: :mod:`gateway.routing.cooldown`.

Use outside the gateway (e.g. simulated time)::

    cfg = ThermalConfig()
    trackers = {b.id: ThermalTracker(cfg) for b in backends}
    trackers["b0"].observe(GpuSample(at=t, temp_c=71.0, power_w=520.0, power_limit_w=700.0))
    view = build_view(t, trackers, domain_of, {"rack1": 12_000.0}, cfg)
    choice = choose(candidates, lambda c: view.status(c.id, t), view.domains, cfg)
    # the policy calls it per pick: LoadThermalPolicy(..., thermal=lambda cands, now:
    #     choose(cands, lambda c: view.status(c.id, now), view.domains, cfg))
    hot_now = choice.hot  # -> the lifecycle's cooldown (gateway.routing.cooldown)

The live gateway wires it in :mod:`gateway.fleet.gpu_monitor` (the GPU telemetry loop) and
:class:`gateway.routing.policy.LoadThermalPolicy` (the ``thermal`` hook); admission reads
:func:`power_pressure` (:mod:`gateway.flow.admission`), and the GPU health breaker (Xid / ECC) is
:mod:`gateway.fleet.gpu_health`.

Sources: tiers 75/85 °C, resume 70 °C, 80% power cap and 20% domain headroom are seed 000's
thresholds; routing on predicted temperature follows TAPAS (Stojkovic et al., "TAPAS:
Thermal- and Power-Aware Scheduling for LLM Inference in Cloud Platforms", ASPLOS 2025,
arXiv:2501.02600).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar

from gateway.config import ThermalConfig
from gateway.core.samples import GpuSample
from gateway.core.vocab import ThermalTier as ThermalTier  # the shared vocabulary


@dataclass(frozen=True, slots=True)
class ThermalStatus:
    """What the router reads of one backend's GPUs at one moment.

    ``temp_c``/``predicted_c`` in °C, ``slope_c_per_s`` in °C/s, ``power_w`` in W,
    ``power_ratio`` draw over limit. ``monitored`` False: no GPU telemetry configured.
    """

    tier: ThermalTier
    monitored: bool = True
    temp_c: float | None = None
    predicted_c: float | None = None
    slope_c_per_s: float | None = None
    power_w: float | None = None
    power_ratio: float | None = None
    domain: str | None = None
    age_s: float | None = None


UNMONITORED = ThermalStatus(ThermalTier.UNKNOWN, monitored=False)


class ThermalTracker:
    """Recent GPU samples of one backend: tier with hysteresis, slope, prediction.

    Samples must be observed in time order. The hot latch survives a telemetry gap: a
    backend that was hot stays hot until a fresh reading below ``resume_c``.
    """

    def __init__(self, cfg: ThermalConfig, max_samples: int = 256) -> None:
        self.cfg = cfg
        self._samples: deque[GpuSample] = deque(maxlen=max_samples)
        self._hot = False

    @property
    def latest(self) -> GpuSample | None:
        """The last sample observed (fresh or not)."""
        return self._samples[-1] if self._samples else None

    @property
    def hot_latched(self) -> bool:
        """Whether the last temperature reading left the backend hot (hysteresis)."""
        return self._hot

    def observe(self, sample: GpuSample) -> None:
        """Add one sample. A sample without a temperature leaves the tier to go stale."""
        if sample.temp_c is None:
            return
        self._samples.append(sample)
        if sample.temp_c >= self.cfg.hot_c:
            self._hot = True
        elif sample.temp_c < self.cfg.resume_c:
            self._hot = False

    def end_cooldown(self) -> None:
        """A thermal cooldown ended (:func:`gateway.routing.cooldown.rest_over`): the hot
        latch is re-read from the last temperature, so a backend released by the
        ``max_cooldown_s`` cap between ``resume_c`` and ``hot_c`` returns as warm instead of
        being sent straight back."""
        s = self.latest
        self._hot = s is not None and s.temp_c is not None and s.temp_c >= self.cfg.hot_c

    def fresh(self, now: float) -> bool:
        """Whether the last sample is at most ``stale_after_s`` old at ``now``."""
        s = self.latest
        return s is not None and now - s.at <= self.cfg.stale_after_s

    def tier(self, now: float) -> ThermalTier:
        """The tier at ``now``: ``unknown`` without a fresh sample."""
        s = self.latest
        if s is None or not self.fresh(now) or s.temp_c is None:
            return ThermalTier.UNKNOWN
        if self._hot:
            return ThermalTier.HOT
        if s.temp_c >= self.cfg.warm_c:
            return ThermalTier.WARM
        return ThermalTier.COOL

    def slope_c_per_s(self) -> float | None:
        """Least-squares temperature slope (°C/s) over the last ``trend_window_s``, clamped
        to +/- ``max_slope_c_per_s``; None with fewer than two samples spanning over 0 s."""
        s = self.latest
        if s is None:
            return None
        horizon = s.at - self.cfg.trend_window_s
        pts = [(x.at, x.temp_c) for x in self._samples if x.at >= horizon and x.temp_c is not None]
        if len(pts) < 2:
            return None
        n = len(pts)
        mt = sum(t for t, _ in pts) / n
        my = sum(y for _, y in pts) / n
        var = sum((t - mt) ** 2 for t, _ in pts)
        if var <= 1e-12:
            return None
        slope = sum((t - mt) * (y - my) for t, y in pts) / var
        cap = self.cfg.max_slope_c_per_s
        return max(-cap, min(cap, slope))

    def predicted_c(self, now: float, ahead_s: float | None = None) -> float | None:
        """Temperature (°C) expected ``ahead_s`` (default ``predict_ahead_s``) after ``now``,
        extrapolating the slope from the last sample; None without a fresh sample."""
        s = self.latest
        if s is None or s.temp_c is None or not self.fresh(now):
            return None
        ahead = self.cfg.predict_ahead_s if ahead_s is None else ahead_s
        slope = self.slope_c_per_s() or 0.0
        return s.temp_c + slope * (now - s.at + ahead)

    def status(self, now: float, domain: str | None = None) -> ThermalStatus:
        """The router's view of this backend at ``now`` (power fields only when fresh)."""
        s = self.latest
        fresh = self.fresh(now)
        return ThermalStatus(
            tier=self.tier(now),
            monitored=True,
            temp_c=s.temp_c if s is not None and fresh else None,
            predicted_c=self.predicted_c(now),
            slope_c_per_s=self.slope_c_per_s() if fresh else None,
            power_w=s.power_w if s is not None and fresh else None,
            power_ratio=s.power_ratio if s is not None and fresh else None,
            domain=domain,
            age_s=None if s is None else now - s.at,
        )


# ---- power domains ---------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class DomainStatus:
    """One power domain now: summed draw of its backends that report (W) against its
    budget (W). ``members``/``reporting``: backends in it / with a fresh power reading."""

    name: str
    budget_w: float
    target_w: float
    draw_w: float
    members: int
    reporting: int

    @property
    def utilisation(self) -> float:
        """Draw over budget (0-1+)."""
        return self.draw_w / self.budget_w if self.budget_w > 0 else 0.0

    @property
    def over_target(self) -> bool:
        """Draw above the target (budget minus headroom): the router steers away."""
        return self.draw_w > self.target_w


def domain_statuses(
    statuses: Iterable[ThermalStatus], budgets_w: Mapping[str, float], cfg: ThermalConfig
) -> dict[str, DomainStatus]:
    """Each domain of ``budgets_w`` (name -> budget in W) with the summed draw of the
    ``statuses`` naming it. A backend without a fresh power reading adds nothing (its draw
    is unknown: the sum is then a lower bound, visible as ``reporting < members``)."""
    draw = dict.fromkeys(budgets_w, 0.0)
    members = dict.fromkeys(budgets_w, 0)
    reporting = dict.fromkeys(budgets_w, 0)
    for st in statuses:
        d = st.domain
        if d is None or d not in budgets_w:
            continue
        members[d] += 1
        if st.power_w is not None:
            draw[d] += st.power_w
            reporting[d] += 1
    return {
        name: DomainStatus(
            name,
            budget,
            budget * cfg.domain_target_ratio,
            draw[name],
            members[name],
            reporting[name],
        )
        for name, budget in budgets_w.items()
    }


# ---- the fleet's snapshot ----------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class ThermalView:
    """Every backend's :class:`ThermalStatus` and every power domain, taken at ``at``
    (monotonic seconds) by the GPU telemetry loop; the request path reads it without
    recomputing. A view older than ``stale_after_s`` reads every monitored backend as
    ``unknown`` (the loop that refreshes it stopped: nothing is known)."""

    at: float
    statuses: Mapping[str, ThermalStatus]
    domains: Mapping[str, DomainStatus]
    stale_after_s: float

    def status(self, backend_id: str, now: float) -> ThermalStatus:
        """The status of one backend (:data:`UNMONITORED` when it has no GPU telemetry)."""
        st = self.statuses.get(backend_id, UNMONITORED)
        if st.monitored and now - self.at > self.stale_after_s:
            return ThermalStatus(ThermalTier.UNKNOWN, domain=st.domain)
        return st


def build_view(
    now: float,
    trackers: Mapping[str, ThermalTracker | None],
    domain_of: Mapping[str, str | None],
    budgets_w: Mapping[str, float],
    cfg: ThermalConfig,
) -> ThermalView:
    """A :class:`ThermalView` at ``now``: ``trackers`` maps backend id -> its tracker (None:
    no GPU telemetry configured), ``domain_of`` backend id -> power domain name or None,
    ``budgets_w`` domain name -> budget (W)."""
    statuses = {
        bid: (
            tr.status(now, domain_of.get(bid))
            if tr is not None
            else ThermalStatus(ThermalTier.UNKNOWN, monitored=False, domain=domain_of.get(bid))
        )
        for bid, tr in trackers.items()
    }
    return ThermalView(
        now, statuses, domain_statuses(statuses.values(), budgets_w, cfg), cfg.stale_after_s
    )


# ---- the router's call -----------------------------------------------------------------------
class _HasId(Protocol):
    @property
    def id(self) -> str: ...


C = TypeVar("C", bound=_HasId)


@dataclass(slots=True)
class ThermalChoice(Generic[C]):
    """The outcome of :func:`choose`.

    ``candidates``: those the router may pick from (order kept); ``penalties``: id -> score
    added to each kept candidate's load score; ``hot``: candidates dropped as hot;
    ``all_hot``: every candidate was hot, so they were kept (least hot preferred).
    """

    candidates: list[C]
    penalties: dict[str, float] = field(default_factory=dict)
    hot: list[C] = field(default_factory=list)
    all_hot: bool = False


def choose(
    candidates: Sequence[C],
    status_of: Callable[[C], ThermalStatus],
    domains: Mapping[str, DomainStatus],
    cfg: ThermalConfig,
) -> ThermalChoice[C]:
    """Filter and penalise ``candidates`` by thermal tier, predicted temperature and power.

    See the module docstring for the rules. ``status_of`` returns each candidate's status
    (:data:`UNMONITORED` for one without GPU telemetry); ``domains`` comes from
    :func:`domain_statuses`. With thermal routing off (``cfg.enabled`` False) every
    candidate is kept without penalty.
    """
    if not cfg.enabled or not candidates:
        return ThermalChoice(list(candidates))
    statuses = [status_of(c) for c in candidates]
    kept: list[tuple[C, ThermalStatus]] = []
    hot: list[C] = []
    for c, st in zip(candidates, statuses, strict=True):
        if st.monitored and st.tier is ThermalTier.HOT:
            hot.append(c)
        else:
            kept.append((c, st))
    all_hot = not kept
    if all_hot:
        kept = list(zip(candidates, statuses, strict=True))
        hot = []
    predicted = [st.predicted_c for _, st in kept if st.monitored and st.predicted_c is not None]
    coolest = min(predicted) if predicted else 0.0
    penalties: dict[str, float] = {}
    for c, st in kept:
        p = 0.0
        if st.monitored:
            if st.tier is ThermalTier.UNKNOWN:
                p += cfg.unknown_penalty
            elif st.tier is ThermalTier.WARM or (
                st.predicted_c is not None and st.predicted_c >= cfg.hot_c
            ):
                p += cfg.warm_penalty
            if st.predicted_c is not None:
                p += cfg.predicted_weight * (st.predicted_c - coolest)
        if st.power_ratio is not None and st.power_ratio > cfg.power_cap_ratio:
            p += cfg.power_penalty
        dom = domains.get(st.domain) if st.domain is not None else None
        if dom is not None and dom.over_target:
            p += cfg.domain_penalty
        if p:
            penalties[c.id] = p
    return ThermalChoice([c for c, _ in kept], penalties, hot, all_hot)


def power_pressure(
    domains_of_candidates: Iterable[str | None], domains: Mapping[str, DomainStatus]
) -> float:
    """Draw over budget of the least-loaded domain among a model's candidates (0 when any
    candidate is in no domain, or in none known): the level admission sheds on. While one
    candidate sits in a domain with room, steering can still help and nothing is shed."""
    best = math.inf
    for name in domains_of_candidates:
        dom = domains.get(name) if name is not None else None
        if dom is None:
            return 0.0
        best = min(best, dom.utilisation)
    return 0.0 if best == math.inf else best
