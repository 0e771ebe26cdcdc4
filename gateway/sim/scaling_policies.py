"""Autoscaling policies compared by the autoscaling fleet simulator (pure, simulated time).

Each policy is a small class: :meth:`~ScalingPolicy.initial` (the replicas ready at the
start, from what the run knows of its trace: :class:`TraceFacts`), and
:meth:`~ScalingPolicy.decide` every ``period_s`` with a :class:`ScalingView` of the fleet,
returning the desired replica count. The orchestrator that acts on it is the same for all
(:mod:`gateway.sim.scaling`).

* ``static-peak``: ``ceil(highest 1-minute arrival rate of the trace / capacity_rps)``,
  fixed. An **oracle** sizing: it reads the whole trace in advance, which no operator can;
  it stands for "provision for the peak".
* ``static-mean``: ``ceil(mean arrival rate / capacity_rps)``, fixed (also from the trace).
* ``keda``: vLLM production-stack's Helm chart, KEDA enabled with its default trigger
  (``helm/templates/scaledobject-vllm.yaml``: a ``prometheus`` trigger on
  ``vllm:num_requests_waiting``, ``threshold: '5'``), KEDA's defaults for what the chart
  leaves unset (KEDA ScaledObject spec: ``pollingInterval`` 30 s; ``cooldownPeriod`` 300 s
  applies only to scaling to zero, and ``minReplicaCount`` is 1 here, as in the chart's
  tutorial ``docs/source/use_cases/autoscaling-keda.rst``: KEDA's own default 0 would
  never wake up on a waiting-queue metric), and the HPA KEDA creates: the Prometheus
  scaler's default ``metricType`` ``AverageValue``, so ``desired = ceil(sum(waiting) /
  5)`` (Kubernetes HPA docs, "Algorithm details"), no change while ``|sum / (5 x current)
  - 1| <= 0.1`` (the HPA's ``--horizontal-pod-autoscaler-tolerance``, 0.1), HPA's default
  behaviour (HPA docs, "Default Behavior"): scale-down stabilization 300 s (the largest
  recommendation of the last 5 minutes: the issue's "300 s cooldown"), scale-up at most
  ``max(2 x current, current + 4)`` per 15 s; ``maxReplicaCount`` as ours. The metric is
  summed over replicas: KEDA's Prometheus scaler errors on a query that returns more than
  one element (``pkg/scalers/prometheus_scaler.go``: "returned multiple elements"), and the
  chart's query ``vllm:num_requests_waiting`` returns one per replica, so a working setup
  wraps it in ``sum()``. **Timing**: KEDA's ``pollingInterval`` governs only activation
  (0 <-> 1, KEDA docs "ScaledObject specification"); 1 <-> N is the HPA's, which syncs
  every 15 s (kube-controller-manager ``--horizontal-pod-autoscaler-sync-period``) and at
  each sync asks KEDA's metrics server, which queries Prometheus afresh (the trigger's
  ``useCachedMetrics`` defaults to false). Prometheus holds each replica's gauge as of its
  last scrape, every 30 s (the chart's ServiceMonitor ``interval: 30s``; also KEDA's
  default ``pollingInterval``): the issue's "30 s polling". So the HPA decides every 15 s
  (``period_s``) on a metric sampled every 30 s (``scrape_s``), held in between.
* ``kpa``: Knative's KPA (``knative/serving`` ``pkg/autoscaler/scaling/autoscaler.go``;
  AIBrix's KPA, ``pkg/controller/podautoscaler/algorithm``, ports the same code), with
  Knative's defaults (``config-autoscaler``, Knative docs "Additional autoscaling
  configuration for Knative Pod Autoscaler"): concurrency (``running + waiting`` of the
  ready replicas, what queue-proxy counts) against a per-replica target of
  ``container-concurrency-target-percentage`` 70% of the replica's concurrency limit
  (``max_num_seqs``); stable window 60 s, panic window 10% of it (6 s); panic when the
  panic window's desire is at least ``panic-threshold-percentage`` 200% of the ready
  replicas, and while panicking no scale-down (the panic desire only ratchets up), left
  once a stable window has passed without a reason to panic; ``max-scale-up-rate`` 1000,
  ``max-scale-down-rate`` 2 (at most half the ready replicas removed per decision);
  decided every 2 s (the autoscaler's tick), concurrency sampled at each decision.
* ``ours``: :class:`gateway.autoscale.ModelAutoscaler` with the given
  :class:`~gateway.config.AutoscaleConfig` (defaults unless a sweep says otherwise), every
  ``interval_s``.

Units: seconds, requests, requests/s.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Protocol

from gateway.autoscale import ModelAutoscaler, ModelSignals
from gateway.config import AutoscaleConfig

POLICY_NAMES: tuple[str, ...] = ("static-peak", "static-mean", "keda", "kpa", "ours")
"""The policies, in the order the simulator reports them."""


@dataclass(frozen=True, slots=True)
class ScalingView:
    """What an autoscaler sees of the fleet at ``now`` (s).

    ``ready``: replicas serving; ``starting``: asked for, in their cold start; ``running``
    / ``waiting``: requests on the ready replicas, summed (vLLM's gauges);
    ``kv_cache_usage``: their mean, 0-1; ``ttft_p99_s``: P99 TTFT of the first tokens of the
    last ``ttft_window_s`` (None with none); ``rate_rps``: the forecaster's level (arrivals
    now, requests/s); ``ahead_rps`` / ``ahead_high_rps``: its forecast mean over the ahead
    window and the interval's upper end; ``slots``: a replica's ``max_num_seqs``."""

    now: float
    ready: int
    starting: int
    running: int
    waiting: int
    kv_cache_usage: float
    ttft_p99_s: float | None
    rate_rps: float | None
    ahead_rps: float | None
    ahead_high_rps: float | None
    slots: int

    @property
    def current(self) -> int:
        """Replicas that exist for the autoscaler: ready plus starting (draining ones are
        gone for it, as a terminating pod is for a Deployment)."""
        return self.ready + self.starting


@dataclass(frozen=True, slots=True)
class TraceFacts:
    """What the policies size their start from: the trace's mean, highest 1-minute and
    first-minute arrival rates (requests/s) and one replica's capacity at a full batch
    (requests/s, :func:`gateway.sim.fleet_spec.capacity_rps`).

    The dynamic policies start with :meth:`at_start` replicas: the peak-sized fleet, scaled
    from there by each, so that none starts overloaded (a ramp from an undersized fleet
    is a transient of the start, not of the day)."""

    mean_rps: float
    peak_minute_rps: float
    capacity_rps: float
    first_minute_rps: float = 0.0

    def replicas_for(self, rate_rps: float) -> int:
        """``ceil(rate / capacity)``, at least 1."""
        return max(1, _ceil(rate_rps / self.capacity_rps))

    def at_start(self) -> int:
        """The dynamic policies' start: :meth:`replicas_for` the peak minute."""
        return self.replicas_for(self.peak_minute_rps)


def _ceil(x: float) -> int:
    return max(0, math.ceil(x - 1e-9))


class ScalingPolicy(Protocol):
    """An autoscaling policy: ``name``, ``period_s`` (seconds between decisions)."""

    name: str

    @property
    def period_s(self) -> float:
        """Seconds between decisions."""
        ...

    def initial(self, facts: TraceFacts) -> int:
        """Replicas ready at the start of the run."""
        ...

    def decide(self, now: float, view: ScalingView) -> int:
        """The desired replica count at ``now``."""
        ...


@dataclass
class StaticPolicy:
    """A fixed fleet: ``ceil(rate / capacity)`` replicas, ``rate`` the trace's highest
    1-minute rate (``peak``) or its mean (``mean``); never changes."""

    basis: str = "peak"
    name: str = "static-peak"
    period_s: float = 60.0
    replicas: int = 1

    def initial(self, facts: TraceFacts) -> int:
        rate = facts.peak_minute_rps if self.basis == "peak" else facts.mean_rps
        self.replicas = facts.replicas_for(rate)
        return self.replicas

    def decide(self, now: float, view: ScalingView) -> int:
        return self.replicas


@dataclass
class KedaPolicy:
    """production-stack's KEDA trigger through the HPA it creates (module docstring):
    ``threshold`` waiting requests per replica (5), the HPA's sync ``period_s`` (15 s) on
    the summed gauge as scraped every ``scrape_s`` (30 s), HPA tolerance (0.1), scale-down
    stabilization ``stabilization_s`` (300 s), scale-up limit ``max(2 x current, current +
    4)`` per sync, ``[min_replicas, max_replicas]``."""

    max_replicas: int = 64
    threshold: float = 5.0
    period_s: float = 15.0
    scrape_s: float = 30.0
    tolerance: float = 0.1
    stabilization_s: float = 300.0
    min_replicas: int = 1
    initial_replicas: int | None = None
    name: str = "keda"
    _recs: deque[tuple[float, int]] = field(default_factory=deque)
    _metric: float = 0.0
    _scraped_at: float | None = None

    def initial(self, facts: TraceFacts) -> int:
        n = facts.at_start() if self.initial_replicas is None else self.initial_replicas
        return min(self.max_replicas, max(self.min_replicas, n))

    def decide(self, now: float, view: ScalingView) -> int:
        if self._scraped_at is None or now >= self._scraped_at + self.scrape_s - 1e-9:
            self._metric, self._scraped_at = float(view.waiting), now  # a scrape
        current = max(1, view.current)
        metric = self._metric
        ratio = metric / (self.threshold * current)
        rec = current if abs(ratio - 1.0) <= self.tolerance else _ceil(metric / self.threshold)
        rec = min(self.max_replicas, max(self.min_replicas, rec))
        recs = self._recs
        recs.append((now, rec))
        while recs and recs[0][0] < now - self.stabilization_s:
            recs.popleft()
        # HPA's stabilizeRecommendationWithBehaviors: up at once (window 0), down to the
        # largest recommendation of the window
        desired = current
        if rec > current:
            desired = rec
        else:
            down = max(r for _, r in recs)
            if down < current:
                desired = down
        up_limit = max(2 * current, current + 4)
        return min(self.max_replicas, max(self.min_replicas, min(desired, up_limit)))


@dataclass
class KpaPolicy:
    """Knative's KPA decision (module docstring): ``target_utilization`` (0.7) of the
    replica's slots per replica, ``stable_window_s`` (60), ``panic_window_share`` (0.1),
    ``panic_threshold`` (2.0), ``max_scale_up_rate`` (1000), ``max_scale_down_rate`` (2),
    every ``period_s`` (2 s)."""

    max_replicas: int = 64
    target_utilization: float = 0.7
    stable_window_s: float = 60.0
    panic_window_share: float = 0.1
    panic_threshold: float = 2.0
    max_scale_up_rate: float = 1000.0
    max_scale_down_rate: float = 2.0
    period_s: float = 2.0
    min_replicas: int = 1
    initial_replicas: int | None = None
    name: str = "kpa"
    _samples: deque[tuple[float, float]] = field(default_factory=deque)
    _panic_since: float | None = None
    _max_panic: int = 0

    def initial(self, facts: TraceFacts) -> int:
        n = facts.at_start() if self.initial_replicas is None else self.initial_replicas
        return min(self.max_replicas, max(self.min_replicas, n))

    def _mean(self, now: float, window_s: float) -> float:
        vals = [c for t, c in self._samples if t > now - window_s]
        return sum(vals) / len(vals) if vals else 0.0

    def decide(self, now: float, view: ScalingView) -> int:
        samples = self._samples
        samples.append((now, float(view.running + view.waiting)))
        while samples and samples[0][0] <= now - self.stable_window_s:
            samples.popleft()
        target = self.target_utilization * view.slots
        ready = float(max(1, view.ready))
        stable = self._mean(now, self.stable_window_s)
        panic = self._mean(now, self.stable_window_s * self.panic_window_share)
        max_up = math.ceil(self.max_scale_up_rate * ready)
        max_down = math.floor(ready / self.max_scale_down_rate)
        dspc = math.ceil(stable / target)
        dppc = math.ceil(panic / target)
        want_stable = int(min(max(dspc, max_down), max_up))
        want_panic = int(min(max(dppc, max_down), max_up))
        over = dppc / ready >= self.panic_threshold
        if over:
            self._panic_since = now  # begin, or extend, panicking
        elif self._panic_since is not None and now > self._panic_since + self.stable_window_s:
            self._panic_since, self._max_panic = None, 0
        desired = want_stable
        if self._panic_since is not None:
            desired = max(desired, want_panic)
            if desired > self._max_panic:
                self._max_panic = desired
            desired = self._max_panic  # no scale-down while panicking
        return min(self.max_replicas, max(self.min_replicas, desired))


@dataclass
class OursPolicy:
    """:class:`gateway.autoscale.ModelAutoscaler` (``cfg``, the TTFT target
    ``ttft_target_s``: the SLO's), every ``cfg.interval_s``; starts with
    ``initial_replicas``."""

    cfg: AutoscaleConfig
    ttft_target_s: float
    initial_replicas: int | None = None
    name: str = "ours"
    scaler: ModelAutoscaler | None = None

    @property
    def period_s(self) -> float:
        return self.cfg.interval_s

    def initial(self, facts: TraceFacts) -> int:
        self.scaler = ModelAutoscaler(
            self.cfg, self.ttft_target_s, self.cfg.min_replicas, self.cfg.max_replicas
        )
        n = facts.at_start() if self.initial_replicas is None else self.initial_replicas
        return min(self.cfg.max_replicas, max(self.cfg.min_replicas, n))

    def decide(self, now: float, view: ScalingView) -> int:
        assert self.scaler is not None, "initial() first"
        s = ModelSignals(
            ready=view.ready,
            warming=view.starting,
            slots=view.slots,
            running=view.running,
            waiting=view.waiting,
            kv_cache_usage=view.kv_cache_usage,
            ttft_p99_s=view.ttft_p99_s,
            rate_rps=view.rate_rps,
            ahead_rps=view.ahead_rps,
            ahead_high_rps=view.ahead_high_rps,
        )
        return self.scaler.decide(now, s).desired


def build_policy(
    name: str,
    autoscale: AutoscaleConfig,
    ttft_slo_s: float,
    initial_replicas: int | None = None,
    keda_threshold: float = 5.0,
) -> ScalingPolicy:
    """A fresh policy by name (:data:`POLICY_NAMES`); the dynamic ones start with
    ``initial_replicas`` ready (None: :meth:`TraceFacts.at_start`) and are bounded by
    ``autoscale.max_replicas``.
    ``keda_threshold``: the KEDA trigger's threshold (5; other values for a sweep).
    Raises ValueError for an unknown name."""
    top = autoscale.max_replicas
    if name == "static-peak":
        return StaticPolicy("peak", name)
    if name == "static-mean":
        return StaticPolicy("mean", name)
    if name == "keda":
        return KedaPolicy(
            max_replicas=top, threshold=keda_threshold, initial_replicas=initial_replicas
        )
    if name == "kpa":
        return KpaPolicy(max_replicas=top, initial_replicas=initial_replicas)
    if name == "ours":
        return OursPolicy(
            autoscale, autoscale.ttft_target_s or ttft_slo_s, initial_replicas=initial_replicas
        )
    raise ValueError(f"unknown autoscaling policy {name!r} (one of {', '.join(POLICY_NAMES)})")
