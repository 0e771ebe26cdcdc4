"""How many vLLM replicas each model needs (pure: snapshots and a clock in, decisions out).

The gateway exports the answer (``gateway_autoscale_desired_replicas{model}``, ``GET
/autoscale``) for the autoscaler that owns the replicas (KEDA, an HPA, a cluster script);
it never starts or stops one itself. The live loop (:mod:`gateway.flow.autoscaling`) and the
fleet simulator (:mod:`gateway.sim.scaling`) feed the same :class:`ModelAutoscaler`.

**Desired replicas = the largest of three paradigms**, each a replica count:

* **fast** (seconds: vLLM's gauges, scraped every 0.5 s): the requests on the model's
  replicas, ``running + waiting``, over the per-replica target ``target_concurrency x
  slots`` (``slots``: ``max_num_seqs``; ``target_concurrency`` 0.85: a vLLM replica
  admits up to ``max_num_seqs`` at once without queueing, so the target sits close to it,
  with 15% of the batch for what arrives while a replica starts; Knative's 70% is for
  servers that queue past their concurrency; measured in the simulator, 0.75 held 5% more
  GPU-hours for 0.5 point of SLO attainment), and ``ceil(ready x kv / target_kv_cache)``; both
  Kubernetes HPA's rule ``ceil(current x metric / target)`` (HPA docs, "Algorithm details")
  with the metric per replica. Requests waiting count as load, so a queue raises it;
* **fine** (tens of seconds: a window of first tokens): P99 TTFT over the window against
  its target (the TTFT SLO), ``ceil(ready x p99 / target)``. It counts only the *ready*
  replicas (those that made that TTFT): replicas still starting do not improve it, and
  ``ceil(current x ...)`` would grow without end while they start. At most
  ``fine_max_step x ready``. **Settling**: while replicas are warming, and for
  ``ttft_window_s`` after the last of them became ready, the window still holds first
  tokens made before they served, so the fine paradigm asks for no more than the replicas
  that exist (it may hold them): otherwise each replica that becomes ready multiplies a
  stale P99 again (``ready`` grows, the P99 has not moved yet) and one slow minute asks for
  the maximum. A measurement is only read once the last step has had a full window to
  show (as the HPA leaves out pods still starting, ``--horizontal-pod-autoscaler-cpu-
  initialization-period``);
* **ahead** (minutes): the forecast mean arrival rate over the window that starts when a
  replica asked for now would be ready (now + the measured cold start) and lasts
  ``lead_s``, times the time a request spends on a replica (Little's law ``L = lambda W``;
  ``W`` from the replicas' own ``running + waiting`` over the current rate, smoothed), over
  the per-replica target; plus the **warm pool**: idle-but-ready replicas for what the
  forecast may have missed, ``warm_pool_share`` (0.3-0.7, default 0.3) of the forecast
  interval's width (``high - rate``: the upper half of the 95% interval), in replicas.
  The documented rule: a pool of 0.3 of the interval's upper half covers a rise of about
  0.6 standard deviation (z = 1.96 x 0.3) without a cold start, and what exceeds it is
  left to the fast paradigm; a larger share keeps GPUs idle for rises that seldom come.
  Measured in the fleet simulator (``benchmarks/autoscale.py --sweep``: a day of diurnal
  traffic with bursts, 60-90 s cold starts): 0.3 against 0.5 cut GPU-hours by about 3% at
  the same SLO attainment, because the per-replica target already leaves
  ``1 - target_concurrency`` of every batch free for what arrives within a cold start.
  The pool is rounded up on its own, not with the forecast: while the forecast is
  uncertain at all, at least one replica stands idle-but-ready (a model with
  ``min_replicas: 0`` keeps it until the forecaster's error has decayed, minutes after its
  traffic stopped). Measured on the same day, rounding the two together (no spare replica
  for a sliver of width) lost 1.1 points of SLO attainment for 1% of GPU-hours at 0.3, and
  0.8 points at 0.5, at the same GPU-hours as the default.

**Stabilization** (HPA's ``behavior.scaleDown.stabilizationWindowSeconds``): the desired
count is the largest recommendation of the last ``scale_down_cooldown_s`` (default 60 s:
Knative's KPA stable window, the low end of the 60-120 s that it and AIBrix recommend,
well under HPA's 300 s which the KEDA rule keeps; in the simulator 90 s held 4% more
GPU-hours for no measurable SLO gain, since the warm pool, not the hold, covers bursts).
A rise therefore takes effect at once, a fall only once it has held for the whole
window. At its first decision (a gateway that has just started) the replicas that exist
count as a recommendation, so a restart never scales the fleet down before a whole
window; in fleet mode the leader's answers count too (:meth:`ModelAutoscaler.hold`), so a
new leader does not fall below the old one's before a whole window. Then
``min_replicas`` / ``max_replicas``.

**Scale-up lag** (:class:`LagTracker`): from the decision that first asked for a replica
(a rise of the desired count) to the moment the ready count reaches what it asked for,
first asked first served; a replica that leaves and returns is no scale-up.

Units: seconds, requests, requests/s; KV-cache use in [0, 1].
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from gateway.config import AutoscaleConfig

PARADIGMS: tuple[str, ...] = ("fast", "fine", "ahead")
"""The paradigms' names, as ``gateway_autoscale_signal{paradigm}`` and ``/autoscale`` say
them."""

W_ALPHA = 0.1
"""EWMA weight of a new estimate of the time in system ``W`` (per decision: with decisions
every 5 s, ``W`` follows a change within about a minute)."""

MIN_RATE_FOR_W = 0.05
"""Below this arrival rate (requests/s) ``W`` is not re-estimated (too few requests)."""


@dataclass(frozen=True, slots=True)
class ModelSignals:
    """What one model's replicas look like at one moment.

    ``ready``: replicas serving it (warm); ``warming``: replicas that exist but do not
    serve yet (cold start, warm-up). ``slots``: a replica's ``max_num_seqs``.
    ``running`` / ``waiting``: requests on the ready replicas, summed (vLLM's
    ``num_requests_running`` / ``num_requests_waiting``). ``kv_cache_usage``: the mean
    over the ready replicas, 0-1. ``ttft_p99_s``: over the recent window, None with too
    few first tokens. ``rate_rps``: the arrival rate now (the forecaster's level),
    ``ahead_rps`` / ``ahead_high_rps``: the forecast mean rate over the ahead window and
    its interval's upper end; None before the forecaster has seen the model."""

    ready: int
    warming: int = 0
    slots: int = 256
    running: float = 0.0
    waiting: float = 0.0
    kv_cache_usage: float = 0.0
    ttft_p99_s: float | None = None
    rate_rps: float | None = None
    ahead_rps: float | None = None
    ahead_high_rps: float | None = None

    @property
    def current(self) -> int:
        """Replicas that exist: ready plus warming."""
        return self.ready + self.warming


@dataclass(frozen=True, slots=True)
class Decision:
    """One decision for one model (replica counts; ``time_in_system_s`` in seconds).

    ``recommended``: the largest paradigm (``ahead`` includes the warm pool) before
    stabilization and bounds; ``desired``: after them (what the autoscaler should run);
    ``reason``: which paradigm won, or what held the count."""

    at: float
    desired: int
    recommended: int
    current: int
    ready: int
    warming: int
    fast: int
    fine: int
    ahead: int
    warm_pool: int
    reason: str
    time_in_system_s: float | None = None

    def as_dict(self) -> dict[str, object]:
        """JSON-ready (``GET /autoscale``)."""
        return {
            "desired_replicas": self.desired,
            "recommended_replicas": self.recommended,
            "current_replicas": self.current,
            "ready_replicas": self.ready,
            "warming_replicas": self.warming,
            "warm_pool_replicas": self.warm_pool,
            "paradigms": {"fast": self.fast, "fine": self.fine, "ahead": self.ahead},
            "reason": self.reason,
            "time_in_system_s": self.time_in_system_s,
            "at": self.at,
        }

    @classmethod
    def from_dict(cls, d: dict[str, object]) -> Decision:
        """The inverse of :meth:`as_dict` (a decision another gateway replica wrote to the
        shared store). Raises KeyError / TypeError / ValueError for a malformed one."""
        p = d["paradigms"]
        if not isinstance(p, dict):
            raise TypeError("paradigms must be an object")
        w = d.get("time_in_system_s")

        def num(v: object) -> float:
            if isinstance(v, bool) or not isinstance(v, int | float):
                raise TypeError(f"not a number: {v!r}")
            return float(v)

        return cls(
            at=num(d["at"]),
            desired=int(num(d["desired_replicas"])),
            recommended=int(num(d["recommended_replicas"])),
            current=int(num(d["current_replicas"])),
            ready=int(num(d["ready_replicas"])),
            warming=int(num(d["warming_replicas"])),
            fast=int(num(p["fast"])),
            fine=int(num(p["fine"])),
            ahead=int(num(p["ahead"])),
            warm_pool=int(num(d["warm_pool_replicas"])),
            reason=str(d["reason"]),
            time_in_system_s=None if w is None else num(w),
        )


@dataclass(frozen=True, slots=True)
class ArrivalInputs:
    """What one gateway replica sees of a model's arrivals (the rest of
    :class:`ModelSignals` comes from the backends' gauges, the same on every replica).

    ``rate_rps`` / ``ahead_rps`` / ``ahead_high_rps``: requests/s as in
    :class:`ModelSignals` (None before the forecaster has seen the model);
    ``ttft_p99_s``: P99 TTFT (seconds) of the streams it relayed over the window, None with
    too few; ``ttft_samples``: how many first tokens that window held."""

    rate_rps: float | None = None
    ahead_rps: float | None = None
    ahead_high_rps: float | None = None
    ttft_p99_s: float | None = None
    ttft_samples: int = 0

    def as_dict(self) -> dict[str, float | int | None]:
        """JSON-ready (the fleet-mode inputs hash)."""
        return {
            "rate_rps": self.rate_rps,
            "ahead_rps": self.ahead_rps,
            "ahead_high_rps": self.ahead_high_rps,
            "ttft_p99_s": self.ttft_p99_s,
            "ttft_samples": self.ttft_samples,
        }

    @classmethod
    def from_dict(cls, d: dict[str, object]) -> ArrivalInputs:
        """The inverse of :meth:`as_dict`; a field that is not a number reads as None (0
        samples)."""

        def num(v: object) -> float | None:
            return float(v) if isinstance(v, int | float) and not isinstance(v, bool) else None

        samples = num(d.get("ttft_samples"))
        return cls(
            num(d.get("rate_rps")),
            num(d.get("ahead_rps")),
            num(d.get("ahead_high_rps")),
            num(d.get("ttft_p99_s")),
            int(samples) if samples is not None else 0,
        )


def combine_inputs(parts: list[ArrivalInputs]) -> ArrivalInputs:
    """Several gateway replicas' inputs for one model as one fleet's (fleet mode: each
    replica sees only the arrivals its load balancer gave it).

    Rates are summed (arrivals split between replicas add up; the sum of the replicas'
    interval upper ends is at least the upper end of the sum's, so the warm pool errs
    large). TTFT: the largest P99 among the replicas that had enough first tokens for one
    (the fine paradigm's target is an SLO every client should meet, so the worst replica's
    tail counts); samples summed. Fields no replica knows stay None."""

    def total(values: list[float | None]) -> float | None:
        known = [v for v in values if v is not None]
        return sum(known) if known else None

    p99s = [p.ttft_p99_s for p in parts if p.ttft_p99_s is not None]
    return ArrivalInputs(
        total([p.rate_rps for p in parts]),
        total([p.ahead_rps for p in parts]),
        total([p.ahead_high_rps for p in parts]),
        max(p99s) if p99s else None,
        sum(p.ttft_samples for p in parts),
    )


def ahead_window(cold_start_s: float, cfg: AutoscaleConfig) -> tuple[float, float]:
    """``(start_s, span_s)`` of the ahead paradigm's forecast window from now: a replica
    asked for now is ready after ``cold_start_s``, then it should serve ``lead_s`` (at
    least one second)."""
    return max(0.0, cold_start_s), max(1.0, cfg.lead_s)


def _ceil(x: float) -> int:
    """``ceil`` that forgives float noise (2.0000000001 is 2)."""
    return max(0, math.ceil(x - 1e-9))


@dataclass
class ModelAutoscaler:
    """One model's autoscaler: :meth:`decide` every ``cfg.interval_s`` with the model's
    :class:`ModelSignals` and the time (seconds, any monotonic origin).

    ``min_replicas`` / ``max_replicas``: this model's bounds (``cfg.limits(model)``).
    ``ttft_target_s``: the fine paradigm's target (``cfg.ttft_target_s`` or the TTFT SLO).
    State: the recent recommendations (the stabilization window) and the smoothed time a
    request spends on a replica."""

    cfg: AutoscaleConfig
    ttft_target_s: float
    min_replicas: int = 1
    max_replicas: int = 64
    time_in_system_s: float | None = None
    _recent: deque[tuple[float, int]] = field(default_factory=deque)
    _settled_from: float | None = None  # when the last warming replica became ready
    _warming_seen: bool = False
    last: Decision | None = None

    def _fine_settled(self, now: float, s: ModelSignals) -> bool:
        """Whether the TTFT window shows the replicas as they are (see "Settling" in the
        module docstring): no replica warming, and a full ``ttft_window_s`` since the last
        one became ready."""
        if s.warming > 0:
            self._warming_seen, self._settled_from = True, None
            return False
        if self._warming_seen:
            self._warming_seen, self._settled_from = False, now
        return self._settled_from is None or now >= self._settled_from + self.cfg.ttft_window_s

    def paradigms(self, s: ModelSignals) -> tuple[int, int, int, int]:
        """``(fast, fine, ahead, warm_pool)`` for ``s`` (``ahead`` includes the pool); a
        paradigm without its inputs says 0 (no opinion). Updates the smoothed ``W``."""
        cfg = self.cfg
        per_replica = max(1e-9, cfg.target_concurrency * max(1, s.slots))
        in_system = max(0.0, s.running) + max(0.0, s.waiting)
        fast = _ceil(in_system / per_replica)
        if s.ready > 0 and s.kv_cache_usage > 0:
            fast = max(fast, _ceil(s.ready * min(1.0, s.kv_cache_usage) / cfg.target_kv_cache))
        fine = 0
        if s.ttft_p99_s is not None and s.ready > 0 and self.ttft_target_s > 0:
            ratio = min(cfg.fine_max_step, s.ttft_p99_s / self.ttft_target_s)
            fine = _ceil(s.ready * ratio)
        if s.rate_rps is not None and s.rate_rps >= MIN_RATE_FOR_W and in_system > 0:
            w = in_system / s.rate_rps
            self.time_in_system_s = (
                w
                if self.time_in_system_s is None
                else (1 - W_ALPHA) * self.time_in_system_s + W_ALPHA * w
            )
        ahead = pool = 0
        if s.ahead_rps is not None and self.time_in_system_s is not None:
            w = self.time_in_system_s
            ahead = _ceil(s.ahead_rps * w / per_replica)
            if s.ahead_high_rps is not None and s.ahead_high_rps > s.ahead_rps:
                # rounded up on its own: while the forecast is uncertain at all, at least one
                # replica stands ready (see "warm pool" in the module docstring)
                pool = _ceil(
                    cfg.warm_pool_share * (s.ahead_high_rps - s.ahead_rps) * w / per_replica
                )
            ahead += pool
        return fast, fine, ahead, pool

    def hold(self, at: float, recommended: int) -> None:
        """Count ``recommended`` (replicas), answered at ``at`` (this autoscaler's clock)
        by another gateway replica, in this one's stabilization window, as if recommended
        here. Fleet mode: every replica holds the leader's answers, so the one that leads
        next does not fall below them before the fleet's cooldown has passed. Only another
        replica's: a replica holding its own ``desired`` would keep itself up for ever."""
        recent = self._recent
        i = len(recent)
        while i > 0 and recent[i - 1][0] > at:
            i -= 1
        recent.insert(i, (at, recommended))

    def decide(self, now: float, s: ModelSignals) -> Decision:
        """The decision at ``now`` for ``s`` (see the module docstring)."""
        fast, fine, ahead, pool = self.paradigms(s)
        if fine > s.current and not self._fine_settled(now, s):
            fine = s.current
        elif fine <= s.current:
            self._fine_settled(now, s)  # keep the settling clock going
        values = {"fast": fast, "fine": fine, "ahead": ahead}
        winner = max(PARADIGMS, key=lambda k: values[k])  # ties: the first in PARADIGMS
        recommended = values[winner]
        recent = self._recent
        if self.last is None:
            # first sight (a gateway restart): the replicas that exist count as recommended
            # now, so a restart never scales the fleet down before a whole cooldown
            recent.append((now, s.current))
        recent.append((now, recommended))
        while recent and recent[0][0] < now - self.cfg.scale_down_cooldown_s:
            recent.popleft()
        stabilized = max(r for _, r in recent)
        reason = winner
        if stabilized > recommended and stabilized >= s.current:
            reason = "scale-down cooldown"
        desired = stabilized
        if desired < self.min_replicas:
            desired, reason = self.min_replicas, "min_replicas"
        elif desired > self.max_replicas:
            desired, reason = self.max_replicas, "max_replicas"
        d = Decision(
            at=now,
            desired=desired,
            recommended=recommended,
            current=s.current,
            ready=s.ready,
            warming=s.warming,
            fast=fast,
            fine=fine,
            ahead=ahead,
            warm_pool=pool,
            reason=reason,
            time_in_system_s=self.time_in_system_s,
        )
        self.last = d
        return d


class Autoscaler:
    """Every model's :class:`ModelAutoscaler`, made on first sight from ``cfg``.

    ``ttft_slo_s``: the fine paradigm's target when ``cfg.ttft_target_s`` is unset."""

    def __init__(self, cfg: AutoscaleConfig, ttft_slo_s: float) -> None:
        self.cfg = cfg
        self.ttft_target_s = cfg.ttft_target_s or ttft_slo_s
        self.models: dict[str, ModelAutoscaler] = {}

    def model(self, name: str) -> ModelAutoscaler:
        """``name``'s autoscaler (created with its bounds on first use)."""
        m = self.models.get(name)
        if m is None:
            lim = self.cfg.limits(name)
            m = ModelAutoscaler(
                self.cfg, self.ttft_target_s, lim.min_replicas, lim.max_replicas
            )
            self.models[name] = m
        return m

    def decide(self, now: float, signals: dict[str, ModelSignals]) -> dict[str, Decision]:
        """A decision for each model in ``signals``; a model no longer given is forgotten."""
        for gone in self.models.keys() - signals.keys():
            del self.models[gone]
        return {name: self.model(name).decide(now, s) for name, s in signals.items()}


@dataclass
class LagTracker:
    """Scale-up lag: seconds from the decision that first asked for a replica to the moment
    one more replica was ready (discovery saw it warm). First asked, first served.

    Feed :meth:`observe` every decision with the desired count and the ready count; it
    returns the lags completed since the previous call. Each ask is for a ready count (a
    *level*): a rise of the desired count above the levels asked before, the previous
    desired count and the replicas ready asks for each level up to it (at the first
    observation: each desired replica not ready), and an ask is served when the ready count
    reaches its level. So a replica that leaves while the desired count stands (drained, in
    a maintenance cycle, crashed) asks nothing, and its return serves no ask: the ready
    count only comes back to where it was, which is no scale-up. A fall of the desired
    count withdraws the asks above it (the newest)."""

    asked: deque[tuple[float, int]] = field(default_factory=deque)  # (asked at, level)
    desired: int | None = None

    def observe(self, now: float, desired: int, ready: int) -> list[float]:
        """Lags (seconds) completed at ``now``; see the class docstring."""
        out: list[float] = []
        asked = self.asked
        while asked and asked[0][1] <= ready:
            out.append(now - asked.popleft()[0])
        base = max(ready, self.desired if self.desired is not None else ready,
                   asked[-1][1] if asked else 0)
        self.desired = desired
        asked.extend((now, level) for level in range(base + 1, desired + 1))
        while asked and asked[-1][1] > desired:
            asked.pop()
        return out
