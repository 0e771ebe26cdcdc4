"""The simulator's ``/metrics``: vLLM's metric names, labels, help texts and buckets.

Each app gets its OWN ``CollectorRegistry`` (never the global one), so many simulators
can live in one process. Gauges and counters are read from the engine's snapshot at
scrape time (a custom collector); histograms are observed when a request finishes.
Names, help strings and buckets are copied from a real vLLM 0.32.0 scrape (the CPU build of
``scripts/vllm-cpu/``); labels are ``engine`` and ``model_name``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from gateway.sim.engine import EngineParams
from gateway.sim.engine_types import FINISH_REASONS, EngineStats, RequestMetrics

TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
ITL_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
REQUEST_LATENCY_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)
LABELS = ("engine", "model_name")


def token_buckets(max_model_len: int) -> list[float]:
    """vLLM's 1-2-5 token buckets up to ``max_model_len`` (``build_1_2_5_buckets``)."""
    out: list[float] = []
    mantissa, exponent = [1, 2, 5], 0
    while True:
        for m in mantissa:
            v = m * 10**exponent
            if v > max_model_len:
                return out
            out.append(float(v))
        exponent += 1


class _EngineCollector(Collector):
    """Gauges and counters from ``stats_fn()`` at scrape time."""

    def __init__(
        self,
        stats_fn: Callable[[], EngineStats],
        sleep_level_fn: Callable[[], int],
        labels: tuple[str, str],
        params: EngineParams,
    ) -> None:
        self._stats = stats_fn
        self._sleep_level = sleep_level_fn
        self._lv = list(labels)
        self._params = params
        self._created = time.time()

    def _gauge(self, name: str, doc: str, value: float) -> GaugeMetricFamily:
        g = GaugeMetricFamily(name, doc, labels=LABELS)
        g.add_metric(self._lv, value)
        return g

    def _counter(self, name: str, doc: str, value: float) -> CounterMetricFamily:
        c = CounterMetricFamily(name, doc, labels=LABELS)
        c.add_metric(self._lv, value, created=self._created)
        return c

    def collect(self) -> Iterable[Metric]:
        s = self._stats()
        # prometheus-client's process collector on a real vLLM; here the start of this
        # simulated server (several may share one Python process), so a restart shows
        yield GaugeMetricFamily(
            "process_start_time_seconds",
            "Start time of the process since unix epoch in seconds.",
            value=self._created,
        )
        yield self._gauge(
            "vllm:num_requests_running",
            "Number of requests in model execution batches.",
            s.num_running,
        )
        yield self._gauge(
            "vllm:num_requests_waiting",
            "Number of requests waiting to be processed.",
            s.num_waiting,
        )
        w = GaugeMetricFamily(
            "vllm:num_requests_waiting_by_reason",
            "Number of waiting requests by reason. Reason labels: 'capacity' = waiting for "
            "scheduling capacity; 'deferred' = deferred by transient constraints (LoRA "
            "budget, KV transfer, blocked status). Sum of all reasons equals "
            "vllm:num_requests_waiting.",
            labels=(*LABELS, "reason"),
        )
        w.add_metric([*self._lv, "capacity"], s.num_waiting)
        w.add_metric([*self._lv, "deferred"], 0)
        yield w
        level = self._sleep_level()
        sl = GaugeMetricFamily(
            "vllm:engine_sleep_state",
            "Engine sleep state; awake = 0 means engine is sleeping; awake = 1 means engine "
            "is awake; weights_offloaded = 1 means sleep level 1; discard_all = 1 means "
            "sleep level 2.",
            labels=(*LABELS, "sleep_state"),
        )
        sl.add_metric([*self._lv, "awake"], 0 if level else 1)
        sl.add_metric([*self._lv, "weights_offloaded"], 1 if level == 1 else 0)
        sl.add_metric([*self._lv, "discard_all"], 1 if level == 2 else 0)
        yield sl
        yield self._gauge(
            "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", s.kv_usage
        )
        yield self._counter(
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
            s.prefix_cache_queries_total,
        )
        yield self._counter(
            "vllm:prefix_cache_hits",
            "Prefix cache hits, in terms of number of cached tokens.",
            s.prefix_cache_hits_total,
        )
        yield self._counter(
            "vllm:num_preemptions",
            "Cumulative number of preemption from the engine.",
            s.num_preemptions_total,
        )
        yield self._counter(
            "vllm:prompt_tokens", "Number of prefill tokens processed.", s.prompt_tokens_total
        )
        src = CounterMetricFamily(
            "vllm:prompt_tokens_by_source",
            "Number of prompt tokens by source.",
            labels=(*LABELS, "source"),
        )
        cached = s.prompt_tokens_cached_total
        for source, value in (
            ("local_compute", s.prompt_tokens_total - cached),
            ("local_cache_hit", cached),
            ("external_kv_transfer", 0),
        ):
            src.add_metric([*self._lv, source], value, created=self._created)
        yield src
        yield self._counter(
            "vllm:prompt_tokens_cached",
            "Number of cached prompt tokens (local + external).",
            cached,
        )
        yield self._counter(
            "vllm:generation_tokens",
            "Number of generation tokens processed.",
            s.generation_tokens_total,
        )
        succ = CounterMetricFamily(
            "vllm:request_success",
            "Count of successfully processed requests.",
            labels=("engine", "finished_reason", "model_name"),
        )
        for reason in FINISH_REASONS:
            succ.add_metric(
                [self._lv[0], reason, self._lv[1]],
                s.request_success_total.get(reason, 0),
                created=self._created,
            )
        yield succ
        p = self._params
        info = GaugeMetricFamily(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            labels=(
                "block_size",
                "cache_dtype",
                "enable_prefix_caching",
                "engine",
                "kv_cache_size_tokens",
                "num_gpu_blocks",
            ),
        )
        info.add_metric(
            [
                str(p.block_size),
                "auto",
                str(p.enable_prefix_caching),
                self._lv[0],
                str(p.num_blocks * p.block_size),
                str(p.num_blocks),
            ],
            1.0,
        )
        yield info


class SimMetrics:
    """All ``vllm:`` metrics of one simulated server, in their own registry."""

    def __init__(
        self,
        model_name: str,
        engine_label: str,
        params: EngineParams,
        stats_fn: Callable[[], EngineStats],
        sleep_level_fn: Callable[[], int],
    ) -> None:
        self.registry = CollectorRegistry()
        self._lv = (engine_label, model_name)
        self.registry.register(_EngineCollector(stats_fn, sleep_level_fn, self._lv, params))
        r = self.registry

        def hist(name: str, doc: str, buckets: Any) -> Any:
            return Histogram(name, doc, LABELS, buckets=buckets, registry=r).labels(*self._lv)

        tok = token_buckets(params.max_model_len)
        self.ttft = hist(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            TTFT_BUCKETS,
        )
        self.itl = hist(
            "vllm:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            ITL_BUCKETS,
        )
        self.tpot = hist(
            "vllm:request_time_per_output_token_seconds",
            "Histogram of time_per_output_token_seconds per request.",
            ITL_BUCKETS,
        )
        self.e2e = hist(
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.queue = hist(
            "vllm:request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.inference = hist(
            "vllm:request_inference_time_seconds",
            "Histogram of time spent in RUNNING phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.prefill = hist(
            "vllm:request_prefill_time_seconds",
            "Histogram of time spent in PREFILL phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.decode = hist(
            "vllm:request_decode_time_seconds",
            "Histogram of time spent in DECODE phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.prompt_tokens = hist(
            "vllm:request_prompt_tokens", "Number of prefill tokens processed.", tok
        )
        self.generation_tokens = hist(
            "vllm:request_generation_tokens", "Number of generation tokens processed.", tok
        )
        self.max_tokens = hist(
            "vllm:request_params_max_tokens",
            "Histogram of the max_tokens request parameter.",
            tok,
        )

    def observe(self, m: RequestMetrics) -> None:
        """Record one finished request (latencies in seconds, sizes in tokens)."""
        if m.ttft_s is not None:
            self.ttft.observe(m.ttft_s)
        for gap in m.itl_s:
            self.itl.observe(gap)
        if m.generation_tokens > 1:
            self.tpot.observe(m.decode_time_s / (m.generation_tokens - 1))
        self.e2e.observe(m.e2e_s)
        self.queue.observe(m.queue_time_s)
        self.inference.observe(m.inference_time_s)
        self.prefill.observe(m.prefill_time_s)
        self.decode.observe(m.decode_time_s)
        self.prompt_tokens.observe(m.prompt_tokens)
        self.generation_tokens.observe(m.generation_tokens)
        self.max_tokens.observe(m.max_tokens)

    def render(self) -> bytes:
        """Prometheus text exposition of this registry."""
        return generate_latest(self.registry)
