"""Every Prometheus metric of the gateway, defined once.

One :class:`GatewayMetrics` is built per app (in the lifespan) with its own
``CollectorRegistry``: no global mutable state, several gateways can live in one process
(tests). Per-backend gauges (state, in-flight, scraped load) are not updated on the hot path:
a custom collector reads them from the fleet at scrape time. This module sits at the bottom
layer: it names what it reads of a backend and of the thermal view as small protocols
(:class:`BackendGauges`, :class:`ThermalReadings`), never the fleet's or the router's types.

Units follow Prometheus conventions: seconds, ``_total`` counters, 0-1 ratios.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, Protocol

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    PlatformCollector,
    ProcessCollector,
)
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.registry import Collector

from gateway.core.cost import TokenWindow
from gateway.core.samples import GpuReading, LoadSample
from gateway.core.vocab import SERVING_STATES, BackendState, ThermalTier, serving_state
from gateway.signals import ITL_BUCKETS, TTFT_BUCKETS, CostCollector, CostSource, build_labels

# Latency buckets (seconds) spanning sub-millisecond proxy overhead to long generations.
LATENCY_BUCKETS = (
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
    300.0,
)


class _Silence(Protocol):
    @property
    def silence_s(self) -> float: ...


class _Valued(Protocol):
    @property
    def value(self) -> str: ...


class _Breaker(Protocol):
    def current(self) -> _Valued: ...


class BackendGauges(Protocol):
    """What :class:`FleetCollector` reads of one backend (``gateway.fleet.backend.Backend``
    has it): the models it serves, lifecycle state, requests open on it, the last scraped
    load, when the last good scrape was (monotonic s, None: never), the hung watchdog's
    silence (s), the breaker (None: none yet) and the prefix-cache hit ratio between its
    last scrapes (0-1, None: unknown)."""

    @property
    def id(self) -> str: ...
    @property
    def models(self) -> tuple[str, ...]: ...
    @property
    def state(self) -> BackendState: ...
    @property
    def in_flight(self) -> int: ...
    @property
    def load(self) -> LoadSample | None: ...
    @property
    def last_scrape_ok_at(self) -> float | None: ...
    @property
    def liveness(self) -> _Silence: ...
    @property
    def breaker(self) -> _Breaker | None: ...
    @property
    def prefix_cache_hit_ratio(self) -> float | None: ...


class ThermalReading(Protocol):
    """One backend's GPUs as :class:`ThermalCollector` reads them (°C, W, draw/limit);
    ``monitored`` False: no GPU telemetry configured."""

    @property
    def monitored(self) -> bool: ...
    @property
    def tier(self) -> ThermalTier: ...
    @property
    def temp_c(self) -> float | None: ...
    @property
    def predicted_c(self) -> float | None: ...
    @property
    def power_w(self) -> float | None: ...
    @property
    def power_ratio(self) -> float | None: ...


class DomainReading(Protocol):
    """One power domain: its name, the summed draw of its reporting backends and its
    budget (W)."""

    @property
    def name(self) -> str: ...
    @property
    def draw_w(self) -> float: ...
    @property
    def budget_w(self) -> float: ...


class ThermalReadings(Protocol):
    """The GPU telemetry's latest view (``gateway.routing.thermal.ThermalView`` has it):
    the monitored backends' ids (``statuses``' keys), one backend's reading at ``now``
    (monotonic s) and the power domains."""

    @property
    def statuses(self) -> Mapping[str, object]: ...
    @property
    def domains(self) -> Mapping[str, DomainReading]: ...
    def status(self, backend_id: str, now: float) -> ThermalReading: ...


class FleetCollector(Collector):
    """Per-backend gauges read from the live fleet at scrape time. The values scraped from
    a backend's ``/metrics`` (waiting, running, KV-cache use, prefix-cache hit ratio) are
    exported only while its last good scrape is at most ``stale_after_s`` old
    (``telemetry.stale_after_s``, the router's own rule): a dead backend's last values
    leave the exposition instead of standing forever, and
    ``gateway_backend_scrape_age_seconds`` says how old they are."""

    def __init__(
        self,
        fleet: Iterable[BackendGauges],
        metrics: GatewayMetrics,
        clock: Callable[[], float] = time.monotonic,
        stale_after_s: float = math.inf,
    ) -> None:
        self._fleet = fleet
        self._metrics = metrics
        self._clock = clock
        self._stale_after_s = stale_after_s

    def collect(self) -> Iterator[Metric]:
        state = GaugeMetricFamily(
            "gateway_backend_state",
            "1 for the backend's current lifecycle state",
            labels=["backend", "state"],
        )
        in_flight = GaugeMetricFamily(
            "gateway_backend_in_flight",
            "Requests the gateway has open on the backend",
            labels=["backend"],
        )
        waiting = GaugeMetricFamily(
            "gateway_backend_waiting",
            "Last scraped vllm:num_requests_waiting",
            labels=["backend"],
        )
        running = GaugeMetricFamily(
            "gateway_backend_running",
            "Last scraped vllm:num_requests_running",
            labels=["backend"],
        )
        kv = GaugeMetricFamily(
            "gateway_backend_kv_cache_usage",
            "DEPRECATED (removed in the next release): gateway_backend_kv_cache_usage_ratio",
            labels=["backend"],
        )
        kv_ratio = GaugeMetricFamily(
            "gateway_backend_kv_cache_usage_ratio",
            "Last scraped KV-cache usage (0-1, vllm:kv_cache_usage_perc)",
            labels=["backend"],
        )
        prefix = GaugeMetricFamily(
            "gateway_backend_prefix_cache_hit_ratio",
            "Prefix-cache hits over queries (tokens, 0-1) between the backend's last two "
            "scrapes that saw queries (vllm:prefix_cache_hits_total / "
            "vllm:prefix_cache_queries_total; vllm:gpu_prefix_cache_hit_rate when the "
            "server has only that)",
            labels=["backend"],
        )
        breaker = GaugeMetricFamily(
            "gateway_backend_breaker_state",
            "1 for the circuit breaker's current state",
            labels=["backend", "state"],
        )
        age = GaugeMetricFamily(
            "gateway_backend_scrape_age_seconds",
            "Seconds since the last good /metrics scrape",
            labels=["backend"],
        )
        silence = GaugeMetricFamily(
            "gateway_backend_silence_seconds",
            "Seconds the backend has owed a probe/scrape answer with nothing heard from it "
            "(the hung watchdog; 0 when it owes nothing)",
            labels=["backend"],
        )
        per_model = GaugeMetricFamily(
            "gateway_model_backends",
            "Backends serving the model, by serving state: the lifecycle state, or "
            "breaker_open for a warm one whose circuit breaker is open (every state, 0 "
            "included, so that 'no routable backend for a model' is the sample "
            "state=warm == 0)",
            labels=["model", "state"],
        )
        counts: dict[str, dict[str, int]] = {}
        now = self._clock()
        for b in self._fleet:
            for s in BackendState:
                state.add_metric([b.id, s.value], 1.0 if b.state is s else 0.0)
            current = b.breaker.current().value if b.breaker is not None else None
            serving = serving_state(b.state, current)
            for model in b.models:
                by_state = counts.setdefault(model, dict.fromkeys(SERVING_STATES, 0))
                by_state[serving] += 1
                self._metrics.backend_token_child(model, b.id)  # at 0 before its first
            in_flight.add_metric([b.id], b.in_flight)
            scraped_at = b.last_scrape_ok_at
            fresh = scraped_at is not None and now - scraped_at <= self._stale_after_s
            if b.load is not None and fresh:
                waiting.add_metric([b.id], b.load.waiting)
                running.add_metric([b.id], b.load.running)
                kv.add_metric([b.id], b.load.kv_cache_usage)
                kv_ratio.add_metric([b.id], b.load.kv_cache_usage)
            if b.prefix_cache_hit_ratio is not None and fresh:
                prefix.add_metric([b.id], b.prefix_cache_hit_ratio)
            if scraped_at is not None:
                age.add_metric([b.id], now - scraped_at)
            silence.add_metric([b.id], b.liveness.silence_s)
            if current is not None:
                for st in ("closed", "open", "half_open"):
                    breaker.add_metric([b.id, st], 1.0 if st == current else 0.0)
        m = self._metrics
        ratio = GaugeMetricFamily(
            "gateway_warm_pool_hit_ratio",
            "Requests served by backends that were warm and past slow start / all requests",
        )
        ratio.add_metric(
            [], m.warm_pool_hits / m.warm_pool_requests if m.warm_pool_requests else 1.0
        )
        for model, by_state in sorted(counts.items()):
            for serving, n in by_state.items():
                per_model.add_metric([model, serving], n)
        yield from (
            state, per_model, in_flight, waiting, running, kv, kv_ratio, prefix, age, silence,
            breaker, ratio,
        )


class ThermalCollector(Collector):
    """GPU temperature, power, thermal tier and power-domain gauges, read at scrape time
    from the GPU telemetry loop's latest view (:class:`ThermalReadings`).
    A backend without GPU telemetry configured is left out; one whose telemetry is missing
    or stale has tier ``unknown`` and no temperature/power sample."""

    def __init__(
        self, view: Callable[[], ThermalReadings], clock: Callable[[], float]
    ) -> None:
        self._view = view
        self._clock = clock

    def collect(self) -> Iterator[Metric]:
        temp = GaugeMetricFamily(
            "gateway_gpu_temperature_celsius",
            "Hottest GPU of the backend (DCGM_FI_DEV_GPU_TEMP), degrees Celsius",
            labels=["backend"],
        )
        predicted = GaugeMetricFamily(
            "gateway_gpu_predicted_temperature_celsius",
            "Hottest GPU's temperature predicted thermal.predict_ahead_s ahead (trend)",
            labels=["backend"],
        )
        power = GaugeMetricFamily(
            "gateway_gpu_power_watts",
            "Summed GPU power draw of the backend (DCGM_FI_DEV_POWER_USAGE), watts",
            labels=["backend"],
        )
        power_ratio = GaugeMetricFamily(
            "gateway_gpu_power_limit_ratio",
            "Summed GPU power draw over summed power limit (0-1)",
            labels=["backend"],
        )
        tier = GaugeMetricFamily(
            "gateway_thermal_tier",
            "1 for the backend's current thermal tier (cool/warm/hot/unknown)",
            labels=["backend", "tier"],
        )
        domain_w = GaugeMetricFamily(
            "gateway_power_domain_watts",
            "Summed GPU draw of the backends in the power domain that report, watts",
            labels=["domain"],
        )
        domain_budget = GaugeMetricFamily(
            "gateway_power_domain_budget_watts",
            "Power budget of the domain, watts",
            labels=["domain"],
        )
        view = self._view()
        now = self._clock()
        for bid in view.statuses:
            st = view.status(bid, now)
            if not st.monitored:
                continue
            for t in ThermalTier:
                tier.add_metric([bid, t.value], 1.0 if st.tier is t else 0.0)
            if st.temp_c is not None:
                temp.add_metric([bid], st.temp_c)
            if st.predicted_c is not None:
                predicted.add_metric([bid], st.predicted_c)
            if st.power_w is not None:
                power.add_metric([bid], st.power_w)
            if st.power_ratio is not None:
                power_ratio.add_metric([bid], st.power_ratio)
        for d in view.domains.values():
            domain_w.add_metric([d.name], d.draw_w)
            domain_budget.add_metric([d.name], d.budget_w)
        yield from (temp, predicted, power, power_ratio, tier, domain_w, domain_budget)


class ZoneScoreCollector(Collector):
    """``gateway_spot_zone_score{zone}`` read at scrape time (the score decays continuously,
    so a gauge set at each notice would be stale)."""

    def __init__(self, scores: Callable[[], Mapping[str, float]]) -> None:
        self._scores = scores

    def collect(self) -> Iterator[Metric]:
        g = GaugeMetricFamily(
            "gateway_spot_zone_score",
            "Spot health score of the zone (1: no recent spot interruption notice; a notice "
            "multiplies it by 1 - spot.notice_penalty, the deficit halves every "
            "spot.half_life_s); a spot backend's share of traffic is scaled by it",
            labels=["zone"],
        )
        ratio = GaugeMetricFamily(
            "gateway_spot_zone_score_ratio",
            "Spot health score of the zone (0-1; gateway_spot_zone_score's new name, that "
            "one is DEPRECATED and removed in the next release)",
            labels=["zone"],
        )
        for zone, score in sorted(self._scores().items()):
            g.add_metric([zone], score)
            ratio.add_metric([zone], score)
        yield g
        yield ratio


def _remove_series(metric: MetricWrapperBase, label: str, value: str) -> None:
    """Remove every series of ``metric`` whose ``label`` is ``value`` (a histogram's
    buckets, sum and count go with their series)."""
    names: tuple[str, ...] = tuple(metric._labelnames)
    stale: set[tuple[str, ...]] = set()
    for family in metric.collect():
        for sample in family.samples:
            if sample.labels.get(label) == value:
                stale.add(tuple(sample.labels[n] for n in names))
    for values in stale:
        metric.remove(*values)

class GatewayMetrics:
    """The gateway's metrics, registered in ``self.registry``."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        r = self.registry = registry or CollectorRegistry()
        self.requests = Counter(
            "gateway_requests",
            "Client requests answered, by endpoint, model, HTTP status (499 = client "
            "closed the connection) and version: the model_version of the backend whose "
            "answer was relayed (a stream continued on another backend: the one that "
            "finished it; a backend's own error answer: that backend's), or, when no "
            "backend's answer was (a refusal, the client gone first), the version a canary "
            "rollout assigned the request; '' for neither (a backend without model_version, "
            "a model without rollout). The share of traffic per version during a rollout: "
            "sum by (model, version)",
            ["endpoint", "model", "status", "version"],
            registry=r,
        )
        self.request_duration = Histogram(
            "gateway_request_duration_seconds",
            "Client request duration, request received -> answer complete (a stream's last "
            "event; a non-streaming answer ready to send), every answered request, by endpoint "
            "and model (empty when the request was refused before its model was known)",
            ["endpoint", "model"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.ttft = Histogram(
            "gateway_time_to_first_byte_seconds",
            "Request received -> first byte of the answer sent to the client: a stream's "
            "first event (TTFT as the client sees it), a non-streaming answer once ready "
            "(its whole body), a refusal once decided; every answered request, by endpoint "
            "and model (not counted: clients that hung up before any byte)",
            ["endpoint", "model"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.upstream_attempts = Counter(
            "gateway_upstream_attempts",
            "Attempts sent to a backend, by outcome",
            ["backend", "outcome"],
            registry=r,
        )
        self.retries = Counter(
            "gateway_retries",
            "Requests re-sent to another backend, by the failure that caused it",
            ["reason"],
            registry=r,
        )
        self.stream_errors = Counter(
            "gateway_stream_errors",
            "Streams ended with an error event after bytes were sent",
            ["backend", "code"],
            registry=r,
        )
        self.stream_continuations = Counter(
            "gateway_stream_continuations",
            "Streams whose backend failed after events reached the client (issue 17), by "
            "the failure (reason: the stream error code the client would have seen) and what "
            "the gateway did (outcome: continued on another backend; closed, the generation "
            "was over; no_backend, no other backend took it; no_budget, the retry budget was "
            "spent; shutdown; else the reason it could not "
            "continue exactly, gateway.proxy.transcript.Reason)",
            ["reason", "outcome"],
            registry=r,
        )
        self.config_reloads = Counter(
            "gateway_config_reloads",
            "Live config changes (issue 18) by source (sighup, watch, admin, rollback; fleet: "
            "another replica's, from the shared store) and "
            "outcome (applied; unchanged, the same config; invalid: not a valid config; "
            "refused: a field that cannot change live, a key that cannot be resolved, a "
            "store that did not take it; nothing changed then)",
            ["source", "outcome"],
            registry=r,
        )
        self.config_version = Gauge(
            "gateway_config_version",
            "Version of the running config in the config history (GET "
            "/admin/config/history); 0 before the first is recorded",
            registry=r,
        )
        self.config_fleet_version = Gauge(
            "gateway_config_fleet_version",
            "Fleet mode: the version of the fleet's current config in the shared store, as "
            "last read (gateway.coord.config_sync); a replica whose gateway_config_version "
            "differs for longer than a sync round does not run it (refused: see "
            "GET /admin/fleet, config_refused); 0 outside fleet mode",
            registry=r,
        )
        self.rollout_step = Gauge(
            "gateway_rollout_step",
            "Canary rollouts (issue 18): the step a model's rollout is at (0 = the first; "
            "the number of steps once promoted; -1 once rolled back)",
            ["model"],
            registry=r,
        )
        self.rollout_decisions = Counter(
            "gateway_rollout_decisions",
            "Canary rollout decisions by model, decision (pass, hold, promoted, "
            "rolled_back) and reason (ok; ttft, itl, errors, calibration: the metric that "
            "failed; insufficient: not enough samples by max_step_s; inconclusive: an effect over "
            "a gate still not significant by max_step_s; operator: an abort or "
            "the config entry removed; capacity: a passed step held, once per hold, until the "
            "next step fits the versions' routable capacity)",
            ["model", "decision", "reason"],
            registry=r,
        )
        self.rollout_fallbacks = Counter(
            "gateway_rollout_fallbacks",
            "Requests assigned to a version (label) with no routable backend of it, served "
            "by the other version of the rollout instead",
            ["model", "version"],
            registry=r,
        )
        self.client_disconnects = Counter(
            "gateway_client_disconnects",
            "Client closed the connection before the answer "
            "ended (the upstream request was closed too)",
            ["endpoint"],
            registry=r,
        )
        self.tokens = Counter(
            "gateway_tokens",
            "Tokens reported by backends' usage, by kind (prompt/completion)",
            ["model", "kind"],
            registry=r,
        )
        self.backend_tokens = Counter(
            "gateway_backend_generated_tokens",
            "Completion tokens the backend generated for this replica's clients (its "
            "answers' usage). Over the backends with a price (those with "
            "gateway_backend_cost_total), summed over replicas, the denominator of the cost "
            "per million tokens (README, Metrics)",
            ["model", "backend"],
            registry=r,
        )
        self.backend_config_errors = Counter(
            "gateway_backend_config_errors",
            "Backend rejected the gateway's own credentials "
            "(401/403): a gateway configuration error, not a dead backend",
            ["backend", "status"],
            registry=r,
        )
        self.transitions = Counter(
            "gateway_backend_transitions",
            "Backend lifecycle transitions",
            ["backend", "from", "to", "reason"],
            registry=r,
        )
        self.liveness_events = Counter(
            "gateway_backend_liveness_events",
            "Hung watchdog: suspected (silent: new requests go elsewhere), cleared (heard "
            "from again), hung (made unhealthy: backend_hung)",
            ["backend", "event"],
            registry=r,
        )
        self.scrape_errors = Counter(
            "gateway_scrape_errors",
            "Failed scrapes of a backend's /metrics",
            ["backend"],
            registry=r,
        )
        self.probe_results = Counter(
            "gateway_probe_results",
            "Active health probe results",
            ["backend", "result"],
            registry=r,
        )
        self.loop_last_success = Gauge(
            "gateway_loop_last_success_timestamp_seconds",
            "Unix time of each control loop's last successful iteration",
            ["loop"],
            registry=r,
        )
        self.loop_errors = Counter(
            "gateway_loop_errors",
            "Exceptions caught in a control loop",
            ["loop"],
            registry=r,
        )
        self.cold_start = Histogram(
            "gateway_cold_start_seconds",
            "A backend's cold start by model, GPU type (its node's instance type, 'unknown' "
            "when not said) and stage: load (first seen by discovery, or gone cold / "
            "unhealthy -> first healthy probe), warmup (-> warm), total",
            ["model", "gpu_type", "stage"],
            buckets=(1, 2, 5, 10, 20, 30, 60, 90, 120, 180, 300, 600, 1200),
            registry=r,
        )
        self.autoscale_desired = Gauge(
            "gateway_autoscale_desired_replicas",
            "Replicas of the model the autoscaler asks for (gateway.autoscale: the largest "
            "paradigm, stabilized, within min/max)",
            ["model"],
            registry=r,
        )
        self.replicas_by_state = Gauge(
            "gateway_replicas",
            "Replicas of the model: desired (the autoscaler's answer), current (ready + "
            "warming), ready (warm, in rotation), warming (cold or warming up)",
            ["model", "state"],
            registry=r,
        )
        self.autoscale_signal = Gauge(
            "gateway_autoscale_signal",
            "Replicas each paradigm asks for (fast, fine, ahead incl. the warm pool; "
            "warm_pool alone)",
            ["model", "paradigm"],
            registry=r,
        )
        self.autoscale_lag = Histogram(
            "gateway_autoscale_lag_seconds",
            "Scale-up lag: the decision that first asked for a replica -> one more replica "
            "ready (warm), measured from discovery",
            ["model"],
            buckets=(5, 10, 20, 30, 60, 90, 120, 180, 300, 600, 1200),
            registry=r,
        )
        self.cycles = Counter(
            "gateway_maintenance_cycles",
            "Maintenance cycles started (short/medium/long)",
            ["backend", "cycle"],
            registry=r,
        )
        self.cycle_deferrals = Counter(
            "gateway_maintenance_deferrals",
            "Due maintenance cycles held back because the other backends could not carry "
            "the load or a running rollout needs the backend, the last routable one of its "
            "version (outcome deferred), and those skipped to their next period after "
            "lifecycle.max_defer_s (outcome skipped)",
            ["backend", "cycle", "outcome"],
            registry=r,
        )
        self.cycle_deferred = Gauge(
            "gateway_maintenance_deferred",
            "1 while a due maintenance cycle of the backend is deferred",
            ["backend"],
            registry=r,
        )
        self.cycle_deferral_seconds = Histogram(
            "gateway_maintenance_deferral_seconds",
            "How long a deferred maintenance cycle waited for a quiet moment",
            buckets=(1, 10, 30, 60, 120, 300, 600, 1200, 1800, 3600),
            registry=r,
        )
        self.drain_seconds = Histogram(
            "gateway_drain_seconds",
            "Drain start -> nothing in flight (or deadline)",
            buckets=(0.1, 0.5, 1, 2, 5, 10, 30, 60, 120, 300),
            registry=r,
        )
        self.probe_unserved = Counter(
            "gateway_probe_unserved",
            "Warm-ups, application probes and calibrations that found the backend serving "
            "none of /v1/completions, /v1/chat/completions, /v1/embeddings for the model "
            "(each a 4xx): passed without a health verdict, by check "
            "(warmup/app_probe/calibration)",
            ["backend", "check"],
            registry=r,
        )
        self.probe_ttft = Gauge(
            "gateway_probe_ttft_seconds",
            "Last application probe's time to first token",
            ["backend"],
            registry=r,
        )
        self.calibration_score = Gauge(
            "gateway_calibration_score",
            "DEPRECATED (removed in the next release): gateway_calibration_score_ratio",
            ["backend"],
            registry=r,
        )
        self.calibration_score_ratio = Gauge(
            "gateway_calibration_score_ratio",
            "Last calibration similarity to the baseline (0-1)",
            ["backend"],
            registry=r,
        )
        self.restart_hooks = Counter(
            "gateway_restart_hooks",
            "Restart hook runs by result (ok/failed/none)",
            ["backend", "result"],
            registry=r,
        )
        self.prefix_cache_resets = Counter(
            "gateway_prefix_cache_resets",
            "Successful POST /reset_prefix_cache",
            ["backend"],
            registry=r,
        )
        self.breaker_trips = Counter(
            "gateway_breaker_trips",
            "Circuit breaker openings by reason",
            ["backend", "reason"],
            registry=r,
        )
        self.retry_budget_exhausted = Counter(
            "gateway_retry_budget_exhausted",
            "Retries refused because the retry budget was spent",
            registry=r,
        )
        self.admission_rejections = Counter(
            "gateway_admission_rejections",
            "Requests refused by admission control, by layer (entry/scheduler/resource/power/"
            "degraded) and priority",
            ["layer", "priority"],
            registry=r,
        )
        self.priority_capped = Counter(
            "gateway_priority_capped",
            "Requests whose x-priority asked for more than their key was granted "
            "(auth.client_keys[].max_priority, auth.anonymous_max_priority), served at the "
            "bound; by key name ('anonymous' without a key), asked and granted priority",
            ["key", "asked", "granted"],
            registry=r,
        )
        self.queue_wait = Histogram(
            "gateway_admission_queue_wait_seconds",
            "Time requests waited for a slot",
            ["priority"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.degraded_level = Gauge(
            "gateway_degraded_mode",
            "Degraded mode level (0 = off)",
            registry=r,
        )
        # ---- predictive batcher and arrival forecast (gateway.flow.batching) ----
        self.batch_size = Histogram(
            "gateway_batch_size",
            "Requests per batch dispatched by the batcher, by priority bucket",
            ["bucket"],
            buckets=(1, 2, 4, 8, 16, 32, 64, 128),
            registry=r,
        )
        self.batch_wait = Histogram(
            "gateway_batch_wait_seconds",
            "Time a request waited in its batcher bucket before dispatch",
            ["bucket"],
            buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, *LATENCY_BUCKETS[5:]),
            registry=r,
        )
        self.queue_depth = Gauge(
            "gateway_queue_depth",
            "Requests waiting in the batcher, by priority bucket",
            ["bucket"],
            registry=r,
        )
        self.batch_dispatches = Counter(
            "gateway_batch_dispatches",
            "Batches dispatched, by bucket and reason (full, timeout, forecast, priority)",
            ["bucket", "reason"],
            registry=r,
        )
        self.merged_requests = Counter(
            "gateway_merged_requests",
            "Client requests sent in a merged upstream request, by endpoint and outcome (ok; "
            "unmerged: the merge failed and each was retried alone; cancelled: every member's "
            "client hung up, so the upstream request was cancelled)",
            ["endpoint", "outcome"],
            registry=r,
        )
        self.forecast_rps = Gauge(
            "gateway_forecast_rps",
            "Forecast mean arrival rate over the next horizon (requests/s), by model",
            ["model"],
            registry=r,
        )
        self.forecast_interval = Gauge(
            "gateway_forecast_interval_rps",
            "Bounds of the forecast's 95% prediction interval (requests/s)",
            ["model", "bound"],
            registry=r,
        )
        self.forecast_error = Gauge(
            "gateway_forecast_error",
            "Last full horizon's actual mean rate minus the rate forecast for it (requests/s)",
            ["model"],
            registry=r,
        )
        self.gpu_scrape_errors = Counter(
            "gateway_gpu_telemetry_scrape_errors",
            "Failed scrapes of a backend's gpu_metrics_url",
            ["backend"],
            registry=r,
        )
        self.gpu_telemetry_unknown = Counter(
            "gateway_gpu_telemetry_unknown",
            "Times a backend's thermal tier became unknown (GPU telemetry missing or stale)",
            ["backend"],
            registry=r,
        )
        self.gpu_errors = Counter(
            "gateway_gpu_errors",
            "New GPU errors seen in telemetry, by kind (xid, ecc_dbe)",
            ["backend", "kind"],
            registry=r,
        )
        self.clock_caps = Counter(
            "gateway_clock_caps",
            "GPU clock caps set or released through the backend's agent (issue 21), by reason "
            "(power, thermal, efficiency, release)",
            ["backend", "reason"],
            registry=r,
        )
        self.clock_cap_mhz = Gauge(
            "gateway_clock_cap_mhz",
            "The SM clock cap the gateway set on the backend's GPUs (MHz; 0: uncapped)",
            ["backend"],
            registry=r,
        )
        self.power_limits = Counter(
            "gateway_power_limits",
            "GPU power limits set or cleared through the backend's agent once its domain's "
            "clock caps sit at their floor (issue 21), by reason (power, release)",
            ["backend", "reason"],
            registry=r,
        )
        self.power_limit_w = Gauge(
            "gateway_power_limit_w",
            "The power limit the gateway set on each of the backend's GPUs (W; 0: the GPU's "
            "default)",
            ["backend"],
            registry=r,
        )
        self.clock_control_owner = Gauge(
            "gateway_clock_control_owner",
            "1 while this replica drives the fleet's GPU clock caps and power limits (fleet "
            "mode: the clock lease holder; one replica: always), else 0",
            registry=r,
        )
        self.clock_control_errors = Counter(
            "gateway_clock_control_errors",
            "Failed calls to a backend's GPU control endpoint",
            ["backend"],
            registry=r,
        )
        self.thermal_cooldowns = Counter(
            "gateway_thermal_cooldowns",
            "Cooldowns started because the backend's GPU was hot",
            ["backend"],
            registry=r,
        )
        # ---- fleet mode (coordination over Redis) -------------------------------------
        self.coord_up = Gauge(
            "gateway_coordination_up",
            "1 while the shared store (Redis) answers, 0 while it does not; absent meaning "
            "(always 0) without fleet mode",
            registry=r,
        )
        self.coord_fallback = Gauge(
            "gateway_coordination_fallback",
            "1 while this replica runs on its local share because the shared store does not "
            "answer (rate limits split locally, no new maintenance lease, admin writes 503)",
            registry=r,
        )
        self.coord_errors = Counter(
            "gateway_coordination_errors",
            "Shared-store calls that failed or timed out, by operation",
            ["op"],
            registry=r,
        )
        self.coord_resyncs = Counter(
            "gateway_coordination_resyncs",
            "Times the shared store answered again after failing and this replica wrote "
            "back what it holds",
            registry=r,
        )
        self.replicas_alive = Gauge(
            "gateway_fleet_replicas_alive",
            "Gateway replicas of this fleet heard from within coordination.replica_ttl_s "
            "(this one included), as last read from the shared store",
            registry=r,
        )
        self.protection_applied = Counter(
            "gateway_fleet_protection_applied",
            "Backend protection learned from another replica and applied here: kind "
            "cooling (a 429/503 Retry-After) or breaker_hold (a breaker held open while "
            "its owner probes), by backend",
            ["backend", "kind"],
            registry=r,
        )
        self.capacity_share = Gauge(
            "gateway_fleet_capacity_share",
            "This replica's share of the fleet's in-flight capacity (requests), from its "
            "demand against the other replicas'",
            registry=r,
        )
        self.response_lookups = Counter(
            "gateway_fleet_response_lookups",
            "Responses API ids unknown here looked up in the shared store, by result "
            "(found, unknown, unavailable)",
            ["result"],
            registry=r,
        )
        self.lease_handovers = Counter(
            "gateway_fleet_lease_handovers",
            "Maintenance leases taken over from a replica that stopped renewing them "
            "(its cycle finished or the backend returned by another replica), by backend",
            ["backend"],
            registry=r,
        )
        self.leases_held = Gauge(
            "gateway_fleet_leases_held",
            "Maintenance leases this replica holds now",
            registry=r,
        )
        self.operator_actions = Counter(
            "gateway_fleet_operator_actions",
            "Operator actions and shared verdicts on backends (drain, preempt, undrain, "
            "gpu_fault, restarting): origin 'submitted' (written to the store by this "
            "replica's admin API) or 'applied' (another replica's, applied here)",
            ["action", "origin"],
            registry=r,
        )
        self.gpu_restart_claims = Counter(
            "gateway_fleet_gpu_restart_claims",
            "GPU-fault restart claims by this replica: 'won' (it runs the restart hook), "
            "'lost' (another replica does), 'local' (store down: the hook runs here)",
            ["backend", "outcome"],
            registry=r,
        )
        self.quota_fetches = Counter(
            "gateway_fleet_quota_fetches",
            "Quota chunks fetched from the global rate-limit buckets, by limit kind (req, tok) "
            "and result: full (all asked), partial, none (the global bucket was short), "
            "failed (the store did not answer)",
            ["kind", "result"],
            registry=r,
        )
        self.quota_waits = Counter(
            "gateway_fleet_quota_waits",
            "Requests that found their key's local quota empty and waited for the running "
            "fetch (coordination.quota_wait_s), by result: landed or timed_out",
            ["result"],
            registry=r,
        )
        self.quota_returned = Counter(
            "gateway_fleet_quota_returned",
            "Unspent quota (requests or tokens) given back to the global rate-limit buckets "
            "by this replica (idle keys, refunds above a chunk, stop), by limit kind",
            ["kind"],
            registry=r,
        )
        # ---- discovery (gateway/fleet/membership.py) -------------------------------------
        self.discovery_endpoints = Gauge(
            "gateway_discovery_endpoints",
            "Endpoints in the discovery source's last snapshot (static: the backends list)",
            ["source"],
            registry=r,
        )
        self.discovery_up = Gauge(
            "gateway_discovery_up",
            "1 while the discovery source answers, 0 during an outage (the last known "
            "fleet is kept)",
            ["source"],
            registry=r,
        )
        self.discovery_outages = Counter(
            "gateway_discovery_outages",
            "Discovery outages (the source could not be read; counted when one begins)",
            ["source"],
            registry=r,
        )
        self.discovery_changes = Counter(
            "gateway_discovery_changes",
            "Fleet membership changes made by discovery: added, draining (terminating or "
            "gone), rejoined, removed, ignored (an id taken by a static backend)",
            ["change"],
            registry=r,
        )
        self.thermal_all_hot = Counter(
            "gateway_thermal_all_hot",
            "Requests routed to a hot backend because every candidate was hot",
            registry=r,
        )
        self.spot_interruptions = Counter(
            "gateway_spot_interruptions",
            "Spot interruption notices applied by this replica (Kubernetes node watch or "
            "POST /admin/zones/{zone}/notice; a repeat for a node already noticed is not "
            "counted), by zone and instance type ('unknown' when not said)",
            ["zone", "instance_type"],
            registry=r,
        )
        # ---- operator signals (issue 19) ----------------------------------------------------
        self.stream_ttft = Histogram(
            "gateway_ttft_seconds",
            "A stream's time to first token as the client sees it: request received -> its "
            "first events (vLLM sends its first chunk with the first token) written to the "
            "client, by model and the backend that produced them (non-streams are not in "
            "it: see gateway_time_to_first_byte_seconds)",
            ["model", "backend"],
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "gateway_itl_seconds",
            "Inter-token latency as the gateway sees it: seconds between two consecutive "
            "content events (data events other than [DONE]) of one stream written to the "
            "client (0 for events written together), by model and backend (after a "
            "continuation, the backend that sent the later event); n events give n-1 "
            "observations",
            ["model", "backend"],
            buckets=ITL_BUCKETS,
            registry=r,
        )
        self.request_errors = Counter(
            "gateway_request_errors",
            "Client requests that ended in an error, by model ('' when refused before the "
            "model was known) and error_type (gateway.core.vocab.ErrorType): timeout, "
            "upstream_5xx, connect, no_backend, cut, in_band_error, rate_limited (the "
            "client key's own limit only), upstream_rate_limited (a backend's own 429), "
            "admission_refused, client_disconnect; a 4xx about the request itself is not "
            "counted",
            ["model", "error_type"],
            registry=r,
        )
        self.gpu_utilization = Gauge(
            "gateway_gpu_utilization_ratio",
            "Share of time a kernel ran on the GPU (0-1; DCGM_FI_DEV_GPU_UTIL / 100 or "
            "NVML's utilization through llm-gateway agent), last GPU telemetry scrape",
            ["backend", "gpu"],
            registry=r,
        )
        self.gpu_fb_used = Gauge(
            "gateway_gpu_framebuffer_used_bytes",
            "GPU framebuffer memory used, bytes (DCGM_FI_DEV_FB_USED MiB x 2^20)",
            ["backend", "gpu"],
            registry=r,
        )
        self.gpu_fb_total = Gauge(
            "gateway_gpu_framebuffer_total_bytes",
            "GPU framebuffer memory in all, bytes (DCGM_FI_DEV_FB_USED + FB_FREE "
            "(+ FB_RESERVED), or DCGM_FI_DEV_FB_TOTAL)",
            ["backend", "gpu"],
            registry=r,
        )
        self.build_info = Gauge(
            "gateway_build_info",
            "1, labelled with the gateway's version, the Python version and the platform",
            ["version", "python", "platform"],
            registry=r,
        )
        self.build_info.labels(**build_labels()).set(1)
        ProcessCollector(registry=r)  # process_* (Linux /proc)
        PlatformCollector(registry=r)  # python_info
        # completion tokens of priced backends per model over the cost window
        # (gateway_cost_per_million_tokens, one process's view)
        self.generated = TokenWindow()
        self._backend_token_children: dict[tuple[str, str], Any] = {}
        # (model, backend) -> (TTFT child, ITL child's observe)
        self._stream_children: dict[tuple[str, str], tuple[Any, Callable[[float], None]]] = {}
        self._error_children: dict[tuple[str, str], Any] = {}
        self._token_children: dict[str, tuple[Any, Any]] = {}
        # warm pool hit ratio = hits / requests, computed at scrape time
        self.warm_pool_requests = 0
        self.warm_pool_hits = 0
        self._req_children: dict[tuple[str, str, int, str], Counter] = {}
        # (endpoint, model) -> (TTFB child, duration child) of the two latency histograms
        self._latency_children: dict[tuple[str, str], tuple[Any, Any]] = {}

    def forget_backend(self, backend_id: str) -> None:
        """Drop every series labelled ``backend=backend_id`` (gauges and counters): the
        backend left the fleet, and a fleet whose pods come and go would otherwise grow
        its series without bound. The per-backend gauges the collectors read from the fleet
        leave with it by themselves."""
        for metric in vars(self).values():
            if isinstance(metric, MetricWrapperBase) and "backend" in metric._labelnames:
                _remove_series(metric, "backend", backend_id)
        for key in [k for k in self._stream_children if k[1] == backend_id]:
            del self._stream_children[key]
        for key in [k for k in self._backend_token_children if k[1] == backend_id]:
            del self._backend_token_children[key]

    def forget_model(self, model: str) -> None:
        """Drop the autoscaling and cold-start series of ``model`` (no backend serves it
        any more, and the autoscaler no longer decides for it) and its token window."""
        self.generated.forget(model)
        for metric in (
            self.autoscale_desired,
            self.replicas_by_state,
            self.autoscale_signal,
            self.autoscale_lag,
            self.cold_start,
        ):
            _remove_series(metric, "model", model)

    def attach_fleet(
        self, fleet: Iterable[BackendGauges], stale_after_s: float = math.inf
    ) -> None:
        """Export the per-backend gauges of ``fleet`` and the warm-pool hit ratio; scraped
        values older than ``stale_after_s`` seconds are left out (:class:`FleetCollector`)."""
        self.registry.register(FleetCollector(fleet, self, stale_after_s=stale_after_s))

    def attach_cost(
        self,
        fleet: Iterable[CostSource],
        clock: Callable[[], float] = time.monotonic,
        replica_gauge: bool = True,
    ) -> None:
        """Export ``gateway_backend_cost_total``, ``gateway_model_cost_total`` and (with
        ``replica_gauge``: one process, not fleet mode) ``gateway_cost_per_million_tokens``
        of ``fleet``'s priced backends (:class:`gateway.signals.CostCollector`; ``clock``:
        the monotonic seconds its ``joined_at`` and :attr:`generated` are in)."""
        self.registry.register(
            CostCollector(fleet, self.generated, clock, per_million=replica_gauge))

    def stream_children(self, model: str, backend: str) -> tuple[Any, Callable[[float], None]]:
        """The ``gateway_ttft_seconds`` child and the ``gateway_itl_seconds`` child's
        ``observe`` of (``model``, ``backend``), cached: the relay calls the latter once per
        content event, a dict lookup and one observe."""
        key = (model, backend)
        children = self._stream_children.get(key)
        if children is None:
            children = self._stream_children[key] = (
                self.stream_ttft.labels(model, backend),
                self.itl.labels(model, backend).observe,
            )
        return children

    def count_error(self, model: str, error_type: str) -> None:
        """Count one client request that ended in an error of ``error_type``
        (:class:`gateway.core.vocab.ErrorType`) in ``gateway_request_errors_total``."""
        key = (model, error_type)
        child = self._error_children.get(key)
        if child is None:
            child = self._error_children[key] = self.request_errors.labels(model, error_type)
        child.inc()

    def count_tokens(
        self,
        model: str,
        prompt: int,
        completion: int,
        now: float,
        backend: str | None = None,
        priced: bool = False,
    ) -> None:
        """Count an answer's ``prompt`` and ``completion`` tokens in
        ``gateway_tokens_total{model,kind}`` (cached children), the completion tokens in
        ``gateway_backend_generated_tokens_total{model,backend}`` (the backend that
        generated them, when known) and, when that backend is ``priced``
        (``gpu_hour_price`` set), in :attr:`generated` at ``now`` (monotonic seconds)."""
        children = self._token_children.get(model)
        if children is None:
            children = self._token_children[model] = (
                self.tokens.labels(model, "prompt"),
                self.tokens.labels(model, "completion"),
            )
        children[0].inc(prompt)
        children[1].inc(completion)
        if backend is not None:
            self.backend_token_child(model, backend).inc(completion)
        if completion and priced:
            self.generated.add(model, completion, now)

    def backend_token_child(self, model: str, backend: str) -> Any:
        """The ``gateway_backend_generated_tokens_total{model,backend}`` child, cached. The
        fleet's collector asks for each backend's models at every scrape, so the series
        is exported at 0 before the backend's first tokens: Prometheus's ``rate`` does
        not count a series' first sample, which would otherwise hold its first answers."""
        key = (model, backend)
        child = self._backend_token_children.get(key)
        if child is None:
            child = self._backend_token_children[key] = self.backend_tokens.labels(*key)
        return child

    def observe_gpus(self, backend: str, readings: Iterable[GpuReading]) -> None:
        """Set the per-GPU utilization and framebuffer gauges of ``backend`` from one GPU
        telemetry scrape's ``readings`` (a value a GPU did not report is left out)."""
        for g in readings:
            for gauge, value in (
                (self.gpu_utilization, g.util_ratio),
                (self.gpu_fb_used, g.fb_used_bytes),
                (self.gpu_fb_total, g.fb_total_bytes),
            ):
                if value is not None:
                    gauge.labels(backend, g.gpu).set(value)

    def forget_gpus(self, backend: str) -> None:
        """Drop ``backend``'s per-GPU gauges (its GPU telemetry failed: no stale value)."""
        for gauge in (self.gpu_utilization, self.gpu_fb_used, self.gpu_fb_total):
            _remove_series(gauge, "backend", backend)

    def attach_thermal(
        self, view: Callable[[], ThermalReadings], clock: Callable[[], float]
    ) -> None:
        """Export the GPU and power-domain gauges of the thermal view ``view()`` returns."""
        self.registry.register(ThermalCollector(view, clock))

    def attach_zone_scores(self, scores: Callable[[], Mapping[str, float]]) -> None:
        """Export ``gateway_spot_zone_score{zone}``: each zone's spot health score in
        [``spot.min_score``, 1] (``gateway.routing.spot``) read at scrape time from
        ``scores()`` (zones whose score is below 1; a recovered zone leaves the gauge)."""
        self.registry.register(ZoneScoreCollector(scores))

    def observe_latency(
        self, endpoint: str, model: str, first_byte_s: float | None, total_s: float
    ) -> None:
        """Observe one answered request in both latency histograms (cached label children,
        one dict lookup): ``first_byte_s`` (seconds from the request's arrival to its
        answer's first byte reaching the client; None when none did, e.g. the client hung
        up first) in ``gateway_time_to_first_byte_seconds``, ``total_s`` (seconds to the
        answer's end) in ``gateway_request_duration_seconds``. ``model`` is the request's
        model, or "" when it was refused before the model was known."""
        key = (endpoint, model)
        children = self._latency_children.get(key)
        if children is None:
            children = self._latency_children[key] = (
                self.ttft.labels(endpoint, model),
                self.request_duration.labels(endpoint, model),
            )
        if first_byte_s is not None:
            children[0].observe(first_byte_s)
        children[1].observe(total_s)

    def count_request(self, endpoint: str, model: str, status: int, version: str) -> None:
        """Count one answered client request in ``gateway_requests_total`` (cached label
        child: one dict lookup, ~0.3 us). ``version``: the label
        :func:`gateway.flow.context.version_label` gives ("" for none)."""
        key = (endpoint, model, status, version)
        child = self._req_children.get(key)
        if child is None:
            child = self._req_children[key] = self.requests.labels(
                endpoint, model, str(status), version
            )
        child.inc()
