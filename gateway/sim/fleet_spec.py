"""The simulated fleet's description: racks (power domains), engine model, observation
periods (:class:`FleetSpec`), and a backend's capacity at a full batch."""

from __future__ import annotations

from dataclasses import dataclass, field

from gateway.config import (
    AdmissionConfig,
    LifecycleConfig,
    RoutingWeights,
    SLOConfig,
    TelemetryConfig,
    ThermalConfig,
)
from gateway.sim.engine import EngineParams
from gateway.sim.thermal import H100_SXM, GpuSpec

FLEET_ENGINE = EngineParams(
    max_num_seqs=32,
    kv_cache_tokens=131_072,
    max_model_len=12_288,
    itl_base_s=0.025,
    itl_per_seq_s=0.0005,
    prefill_base_s=0.010,
    prefill_per_token_s=0.00012,
)
"""A 70B-class model in FP8 on one H100 80 GB: a decode step reads the ~70 GB of weights at
3.35 TB/s HBM bandwidth (about 21 ms, so 25 ms with overheads) plus ~0.5 ms per sequence;
prefill about 8,000 tokens/s. Capacity at a full batch of 32: about 780 tokens/s."""


@dataclass(frozen=True, slots=True)
class RackSpec:
    """One rack = one power domain: ``backends`` GPUs at inlet ``ambient_c`` (°C) with
    thermal resistance ``r_th_k_per_w`` (K/W), sharing ``budget_w`` (W)."""

    name: str
    backends: int
    ambient_c: float
    r_th_k_per_w: float
    budget_w: float


@dataclass(frozen=True)
class FleetSpec:
    """The simulated fleet and how it is observed (seconds, W, °C).

    ``physics_dt_s``: GPU integration and engine-speed update period (exact within a step,
    :mod:`gateway.sim.thermal`). ``gpu_scrape_s``: GPU telemetry period seen by
    ``load_thermal`` (the gateway's ``thermal.scrape_interval_s``); load scrapes follow
    ``telemetry.scrape_interval_s``. ``facility_cap_hold_s``: how long a rack stays capped
    once its 1-s draw exceeded its budget (an assumption: rack power-capping controllers,
    e.g. Meta's Dynamo, Wu et al. ISCA 2016, act within seconds and hold caps for tens of
    seconds). ``record_every_s``: period of the time series and of the power averages.
    ``admission``: the gateway's admission settings, of which the simulator's gateway runs
    the resource layer (shed by predicted queue wait; the live gateway's defaults unless
    given) with ``load_thermal`` and ``clocks``.
    """

    racks: tuple[RackSpec, ...]
    engine: EngineParams = FLEET_ENGINE
    gpu: GpuSpec = H100_SXM
    slo: SLOConfig = field(default_factory=SLOConfig)
    thermal: ThermalConfig = field(default_factory=ThermalConfig)
    lifecycle: LifecycleConfig = field(default_factory=LifecycleConfig)
    weights: RoutingWeights = field(default_factory=RoutingWeights)
    telemetry: TelemetryConfig = field(default_factory=TelemetryConfig)
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)
    physics_dt_s: float = 1.0
    gpu_scrape_s: float = 2.0
    facility_cap_hold_s: float = 30.0
    record_every_s: float = 60.0
    seed: int = 0

    @property
    def load_scrape_s(self) -> float:
        """vLLM ``/metrics`` scrape period (s): the gateway's ``telemetry.scrape_interval_s``."""
        return self.telemetry.scrape_interval_s

    @property
    def num_backends(self) -> int:
        return sum(r.backends for r in self.racks)

    def rack_of(self) -> list[int]:
        """Rack index of each backend, in backend order."""
        return [i for i, r in enumerate(self.racks) for _ in range(r.backends)]


def capacity_rps(params: EngineParams, prompt_mean: float, output_mean: float) -> float:
    """Requests/s one backend completes at a full batch: each request costs its prefill
    stall plus its share of the decode steps (``output * step(B) / B``)."""
    b = params.max_num_seqs
    per_req = params.prefill_time_s(round(prompt_mean)) + output_mean * params.decode_time_s(b) / b
    return 1.0 / per_req
