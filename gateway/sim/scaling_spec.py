"""The autoscaling simulator's fixed parts and results (pure): :class:`ScalingSpec` (one
run's settings, the GPU-hour price), :class:`ScalingResult` and its :class:`ScalingSeries`
(``<L, W, S, C>`` and the time series), and what a run knows before it starts: the trace's
rates (:func:`trace_facts`) and a forecaster trained on earlier days
(:func:`train_forecaster`). The loop is :mod:`gateway.sim.scaling`."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from gateway.config import AutoscaleConfig, LifecycleConfig, SLOConfig
from gateway.sim.engine import EngineParams
from gateway.sim.fleet_spec import FLEET_ENGINE, capacity_rps
from gateway.sim.scaling_policies import TraceFacts
from gateway.sim.workload import DAY_S, Arrival, TraceSpec, generate
from gateway.traffic.forecast import ForecastParams, HoltWinters

DEFAULT_GPU_HOUR_USD = 3.00
"""Price of one H100 SXM GPU-hour on demand (USD): the middle of the $2.49-3.99 that the
specialised GPU clouds list (CoreWeave, Lambda, Crusoe, RunPod; pricegpu.pages.dev, "H100 vs
A100 Cloud Pricing", early 2026; RunPod's Secure Cloud H100 SXM5 at about $2.69). The
hyperscalers' on-demand rate is higher (AWS p5.48xlarge, 8 x H100: about $55-98 an hour,
$7-12 a GPU-hour, by date). C scales linearly with it; the comparisons do not depend on it."""


@dataclass(frozen=True)
class ScalingSpec:
    """One autoscaling run's fixed parts (seconds, USD).

    ``engine``: each replica's cost model; ``slo``: what a good request is;
    ``autoscale``: our autoscaler's settings (also its ``ttft_window_s``, ``lead_s``,
    ``cold_start_s`` shape every policy's view, and ``max_replicas`` bounds the dynamic
    baselines); ``cold_start_s``: the ``(min, max)`` of a replica's uniform cold start;
    ``gpu_hour_usd``: :data:`DEFAULT_GPU_HOUR_USD`; ``history_days``: days the forecaster
    was trained on before the run; ``record_every_s``: the time series' period;
    ``lifecycle``: the routing's slow-start ramp (``slow_start_s``, ``slow_start_min_weight``).
    ``warmup_s``: the run starts with an empty fleet (no request in flight), so for this
    long every policy decides (its windows fill) but nothing acts on it: the fleet keeps
    its start until the gauges show it loaded (300 s: several times a request's time on a
    replica, ~30-40 s, and KPA's 60-s stable window). ``seed``: the cold starts' and the
    slow start's draws."""

    engine: EngineParams = FLEET_ENGINE
    slo: SLOConfig = field(default_factory=SLOConfig)
    autoscale: AutoscaleConfig = field(default_factory=AutoscaleConfig)
    cold_start_s: tuple[float, float] = (60.0, 90.0)
    gpu_hour_usd: float = DEFAULT_GPU_HOUR_USD
    history_days: int = 3
    record_every_s: float = 60.0
    warmup_s: float = 300.0
    lifecycle: LifecycleConfig = field(default_factory=LifecycleConfig)
    seed: int = 0

    def __post_init__(self) -> None:
        lo, hi = self.cold_start_s
        if not 0 <= lo <= hi:
            raise ValueError(f"cold start needs 0 <= MIN <= MAX, got {lo:g},{hi:g}")
        if self.gpu_hour_usd < 0 or self.history_days < 0 or self.record_every_s <= 0:
            raise ValueError("need gpu_hour_usd >= 0, history_days >= 0, record_every_s > 0")
        if self.warmup_s < 0:
            raise ValueError("need warmup_s >= 0")


@dataclass
class ScalingSeries:
    """Every ``record_every_s``: time (s), replicas allocated (ready, starting and
    draining: the GPUs paid for), ready, the last desired count, and the arrival rate over
    the period (requests/s)."""

    t: list[float] = field(default_factory=list)
    allocated: list[int] = field(default_factory=list)
    ready: list[int] = field(default_factory=list)
    desired: list[int] = field(default_factory=list)
    arrival_rps: list[float] = field(default_factory=list)


@dataclass
class ScalingResult:
    """One policy's run (units in the field names). ``lag_p50_s`` (L) is None when no
    replica was asked for and became ready; ``idle_share`` is W, ``slo_attainment`` S,
    ``cost_per_mtok_usd`` C (None without output tokens). ``slot_share``: the batch slots
    paid for that held a request (the integral of ``running / max_num_seqs`` over all
    allocated GPU-seconds, 0-1): W counts a GPU busy while any request runs on it, so a
    fleet far larger than its load can show W near 0; ``1 - slot_share`` shows that waste."""

    policy: str
    duration_s: float
    arrived: int
    completed: int
    rejected: int
    good: int
    slo_attainment: float
    lag_p50_s: float | None
    lags: int
    idle_share: float
    gpu_hours: float
    cost_per_mtok_usd: float | None
    mean_replicas: float
    max_replicas: int
    ttft_p50_s: float
    ttft_p99_s: float
    output_tokens: int
    replicas_asked: int
    slot_share: float = 0.0
    series: ScalingSeries = field(default_factory=ScalingSeries, repr=False)

    def as_dict(self, with_series: bool = False) -> dict[str, Any]:
        """JSON-ready, with the four figures also under their letters (L, W, S, C)."""
        d = {k: v for k, v in self.__dict__.items() if k != "series"}
        for k in ("ttft_p50_s", "ttft_p99_s"):
            if isinstance(d[k], float) and not math.isfinite(d[k]):
                d[k] = None
        d.update(
            L=self.lag_p50_s, W=self.idle_share, S=self.slo_attainment, C=self.cost_per_mtok_usd
        )
        if with_series:
            d["series"] = dataclasses.asdict(self.series)
        return d


def trace_facts(arrivals: Sequence[Arrival], duration_s: float, cap_rps: float) -> TraceFacts:
    """Mean, highest 1-minute and first-minute arrival rates of ``arrivals`` over
    ``duration_s`` (requests/s), with the replica capacity ``cap_rps``."""
    minutes = max(1, math.ceil(duration_s / 60.0))
    counts = [0] * minutes
    for a in arrivals:
        if a.t < duration_s:
            counts[min(minutes - 1, int(a.t // 60))] += 1
    span = min(60.0, duration_s)
    return TraceFacts(
        mean_rps=sum(counts) / duration_s if duration_s > 0 else 0.0,
        peak_minute_rps=max(counts) / span,
        capacity_rps=cap_rps,
        first_minute_rps=counts[0] / span,
    )


def train_forecaster(
    trace: TraceSpec, days: int, params: ForecastParams | None = None
) -> HoltWinters:
    """A :class:`HoltWinters` that has seen ``days`` earlier days of ``trace``'s kind (the
    same spec over one day, seeds ``trace.seed + 1000 x k``), one count per second, its
    seconds numbered so that the run's second 0 follows them (the season lines up)."""
    hw = HoltWinters(params)
    for k in range(days, 0, -1):
        day = dataclasses.replace(trace, duration_s=DAY_S, seed=trace.seed + 1000 * k)
        counts = [0] * int(DAY_S)
        for a in generate(day):
            counts[int(a.t)] += 1
        base = -k * int(DAY_S)
        for s, c in enumerate(counts):
            hw.observe(base + s, c)
    return hw


def replica_capacity_rps(spec: ScalingSpec, trace: TraceSpec) -> float:
    """One replica's capacity for ``trace``'s request sizes (requests/s at a full batch)."""
    return capacity_rps(spec.engine, trace.prompt_mean, trace.output_mean)
