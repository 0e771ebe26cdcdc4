"""Pure parsing and derivation behind the operator signals of issue 19: vLLM's prefix-cache
counters and their ratio between scrapes, DCGM utilization and framebuffer memory, the
error type of an answer and of the gateway's fast-fail, cost and the tokens window, and the
exposition without ``_created`` series."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram

from gateway.core.cost import TokenWindow, accrued_cost, cost_per_million
from gateway.core.outcomes import (
    Refusal,
    refusal_error_type,
    shutting_down,
    status_error_type,
    stream_error_type,
)
from gateway.core.samples import LoadSample, prefix_cache_hit_ratio
from gateway.core.vocab import BackendState, ErrorType
from gateway.fleet.fleet import Fleet
from gateway.fleet.telemetry import parse_dcgm, scan_vllm
from gateway.flow.outcome import unavailable
from gateway.metrics import GatewayMetrics
from gateway.signals import CostCollector, exposition
from tests.support.servers import gateway_config

# ../shared/real-vllm beside the checkout (a real vLLM server's /metrics, scripts/vllm-cpu)
REAL_VLLM = Path(__file__).resolve().parents[3] / "shared" / "real-vllm" / "metrics_sample.txt"


def _load(hits: float | None, queries: float | None, rate: float | None = None) -> LoadSample:
    return LoadSample(0, 0, 0, 0.0, 0, prefix_cache_hits_total=hits,
                      prefix_cache_queries_total=queries, prefix_cache_hit_rate=rate)


def test_prefix_cache_counters_are_summed_over_engines() -> None:
    text = (
        'vllm:num_requests_waiting{engine="0"} 1.0\n'
        'vllm:prefix_cache_queries_total{engine="0",model_name="m"} 100.0\n'
        'vllm:prefix_cache_queries_total{engine="1",model_name="m"} 50.0\n'
        'vllm:prefix_cache_queries_created{engine="0",model_name="m"} 1.7e9\n'
        'vllm:prefix_cache_hits_total{engine="0",model_name="m"} 30.0\n'
        'vllm:prefix_cache_hits_total{engine="1",model_name="m"} 15.0\n'
        'vllm:external_prefix_cache_hits_total{engine="0"} 999.0\n'
    )
    scan = scan_vllm(text)
    assert scan is not None and scan[4] == (45.0, 150.0, None)


def test_the_older_hit_rate_gauge_is_read_when_it_is_all_there_is() -> None:
    text = 'vllm:num_requests_running 2\nvllm:gpu_prefix_cache_hit_rate{model_name="m"} 0.25\n'
    scan = scan_vllm(text)
    assert scan is not None and scan[4] == (None, None, 0.25)


@pytest.mark.skipif(not REAL_VLLM.exists(), reason="no real vLLM exposition sample here")
def test_a_real_vllm_exposition_has_the_counters() -> None:
    scan = scan_vllm(REAL_VLLM.read_text())
    assert scan is not None
    hits, queries, rate = scan[4]
    assert hits is not None and queries is not None and queries >= hits and rate is None


def test_hit_ratio_is_the_counters_increase_between_two_scrapes() -> None:
    assert prefix_cache_hit_ratio(_load(10, 100), _load(40, 140)) == pytest.approx(0.75)
    assert prefix_cache_hit_ratio(None, _load(40, 140)) is None  # no previous scrape
    assert prefix_cache_hit_ratio(_load(40, 140), _load(40, 140)) is None  # no query
    assert prefix_cache_hit_ratio(_load(40, 140), _load(0, 5)) is None  # restarted
    assert prefix_cache_hit_ratio(_load(None, None), _load(None, None, 0.3)) == 0.3
    assert prefix_cache_hit_ratio(None, _load(None, None)) is None


def test_dcgm_utilization_and_framebuffer() -> None:
    text = (
        'DCGM_FI_DEV_GPU_TEMP{gpu="0",UUID="a"} 50\n'
        'DCGM_FI_DEV_GPU_UTIL{gpu="0",UUID="a"} 87\n'
        'DCGM_FI_DEV_FB_USED{gpu="0",UUID="a"} 73000\n'
        'DCGM_FI_DEV_FB_FREE{gpu="0",UUID="a"} 8000\n'
        'DCGM_FI_DEV_FB_RESERVED{gpu="0",UUID="a"} 559\n'
        'DCGM_FI_DEV_GPU_TEMP{gpu="1",UUID="b"} 51\n'
        'DCGM_FI_DEV_GPU_UTIL{gpu="1",UUID="b"} 130\n'
        'DCGM_FI_DEV_FB_USED{gpu="1",UUID="b"} 100\n'
        'DCGM_FI_DEV_FB_TOTAL{gpu="1",UUID="b"} 40000\n'
        'DCGM_FI_DEV_GPU_TEMP{gpu="2",UUID="c"} 52\n'
    )
    g0, g1, g2 = parse_dcgm(text)
    mib = 1024 * 1024
    assert (g0.gpu, g0.util_ratio) == ("0", 0.87)
    assert g0.fb_used_bytes == 73000 * mib and g0.fb_total_bytes == 81559 * mib
    assert g1.util_ratio == 1.0  # a broken percent is capped
    assert g1.fb_total_bytes == 40000 * mib  # FB_TOTAL when exported
    assert (g2.util_ratio, g2.fb_used_bytes, g2.fb_total_bytes) == (None, None, None)


def test_error_types() -> None:
    assert status_error_type(200) is None and status_error_type(400) is None
    assert status_error_type(499) is ErrorType.CLIENT_DISCONNECT
    # an answer known by its status is a backend's: its 429 is no client key's limit
    assert status_error_type(429) is ErrorType.UPSTREAM_RATE_LIMITED
    assert status_error_type(504) is ErrorType.TIMEOUT
    assert status_error_type(503) is ErrorType.UPSTREAM_5XX
    assert refusal_error_type(Refusal(504, "x", code="upstream_timeout")) is ErrorType.TIMEOUT
    assert refusal_error_type(Refusal(502, "x", code="upstream_unavailable")) is ErrorType.CONNECT
    assert refusal_error_type(Refusal(503, "x", code="no_backend_available")) \
        is ErrorType.NO_BACKEND
    # a 429 of the gateway's own is never rate_limited unless the entry layer says so
    assert refusal_error_type(Refusal(429, "x")) is ErrorType.ADMISSION_REFUSED
    assert refusal_error_type(
        Refusal(429, "x", error_type=ErrorType.RATE_LIMITED)) is ErrorType.RATE_LIMITED
    assert refusal_error_type(
        Refusal(429, "x", error_type=ErrorType.ADMISSION_REFUSED)
    ) is ErrorType.ADMISSION_REFUSED
    assert refusal_error_type(shutting_down()) is ErrorType.ADMISSION_REFUSED
    assert refusal_error_type(Refusal(400, "bad")) is None
    assert stream_error_type("ok") is None
    assert stream_error_type("client_gone") is ErrorType.CLIENT_DISCONNECT
    assert stream_error_type("in_band_error") is ErrorType.IN_BAND_ERROR
    assert stream_error_type("upstream_idle_timeout") is ErrorType.TIMEOUT
    for cut in ("upstream_disconnected", "upstream_incomplete", "drain_deadline",
                "backend_hung", "gateway_shutdown"):
        assert stream_error_type(cut) is ErrorType.CUT


def test_the_gateways_fast_fail_is_no_backend_unless_the_backends_only_cool() -> None:
    now = [100.0]
    cfg = gateway_config(
        [{"id": i, "url": "http://127.0.0.1:9", "models": ["m1"]} for i in ("a", "b")],
        breaker={"consecutive_failures": 1, "open_base_s": 10, "open_max_s": 10})
    fleet = Fleet.from_config(cfg, lambda: now[0])
    a, b = fleet.backends
    a.state = b.state = BackendState.WARM  # (the fleet state's job, skipped here)
    for x in (a, b):
        x.breaker.on_failure()  # one failure in a row trips it: open for 10 s
    assert not a.routable and a.serving_state == "breaker_open"
    # every breaker open: an outage (503 + Retry-After, RFC 9110 15.6.4), not a rate limit
    refused = unavailable(fleet.backends, "m1", cfg.health, now[0])
    assert refused.status == 503 and refusal_error_type(refused) is ErrorType.NO_BACKEND
    assert refused.code == "no_backend_available" and refused.retry_after_s == 10
    # b's breaker closes again but b cools after its own 429: the backends refused
    now[0] += 10
    b.breaker.on_success(probe=b.breaker.acquire())
    a.breaker.on_failure(probe=a.breaker.acquire())  # a's probe fails: open again
    b.cool_until(now[0] + 5)
    assert b.routable and not a.routable
    refused = unavailable(fleet.backends, "m1", cfg.health, now[0])
    assert refused.status == 429 and refusal_error_type(refused) is ErrorType.UPSTREAM_RATE_LIMITED
    # nothing warm at all: 503, no_backend
    a.state = b.state = BackendState.UNHEALTHY
    refused = unavailable(fleet.backends, "m1", cfg.health, now[0])
    assert refused.status == 503 and refusal_error_type(refused) is ErrorType.NO_BACKEND



def test_cost_and_the_tokens_window() -> None:
    assert accrued_cost(2.0, 4, 1800) == 4.0  # 2/GPU-hour x 4 GPUs x half an hour
    assert accrued_cost(2.0, 1, -5) == 0.0
    assert cost_per_million(1.0, 0) is None
    assert cost_per_million(1.0, 500_000) == 2.0
    w = TokenWindow(window_s=300, bucket_s=5)
    w.add("m", 100, now=1000.0)
    w.add("m", 50, now=1002.0)  # same bucket
    w.add("m", 10, now=1200.0)
    assert w.total("m", now=1200.0) == 160
    assert w.total("m", now=1310.0) == 10  # the first bucket left the window
    assert w.total("other", now=1200.0) == 0
    w.forget("m")
    assert w.total("m", now=1200.0) == 0


def test_exposition_has_no_created_series() -> None:
    r = CollectorRegistry()
    Counter("c", "a counter", registry=r).inc()
    Histogram("h", "a histogram", registry=r).observe(1)
    text = exposition(r).decode()
    assert "c_total 1.0" in text and "h_count 1.0" in text
    assert "_created" not in text


@dataclass
class _Priced:
    gpu_hour_price: float | None
    gpus: int = 1


@dataclass
class _Backend:
    id: str
    config: _Priced
    models: tuple[str, ...] = ("m",)
    joined_at: float | None = 0.0


def _collect(c: CostCollector) -> dict[tuple[str, str], float]:
    return {(s.name, next(iter(s.labels.values()))): s.value
            for fam in c.collect() for s in fam.samples}


def test_cost_accrues_at_each_interval_s_price_and_per_million_tokens() -> None:
    now = [0.0]
    a = _Backend("a", _Priced(3.6, gpus=2))  # 2 GPUs at 3.6/h: 0.002 a second
    b = _Backend("b", _Priced(3.6), models=("m", "n"))  # split between two models
    free = _Backend("free", _Priced(None))
    tokens = TokenWindow()
    c = CostCollector([a, b, free], tokens, clock=lambda: now[0])
    now[0] = 100.0
    tokens.add("m", 1000, now=100.0)
    got = _collect(c)
    assert got[("gateway_backend_cost_total", "a")] == pytest.approx(0.2)
    assert got[("gateway_backend_cost_total", "b")] == pytest.approx(0.1)
    assert ("gateway_backend_cost_total", "free") not in got
    # m: a's 0.2 + half of b's 0.1 over 1000 tokens, per million
    assert got[("gateway_cost_per_million_tokens", "m")] == pytest.approx(250.0)
    assert ("gateway_cost_per_million_tokens", "n") not in got  # no tokens
    a.config = _Priced(0.0, gpus=2)  # a live price change: from now on
    now[0] = 200.0
    assert _collect(c)[("gateway_backend_cost_total", "a")] == pytest.approx(0.2)


def test_model_cost_splits_a_backend_between_its_models_and_fleet_mode_has_no_ratio() -> None:
    now = [0.0]
    b = _Backend("b", _Priced(3.6), models=("m", "n"))  # 0.001 a second, half each
    c = CostCollector([b], TokenWindow(), clock=lambda: now[0], per_million=False)
    now[0] = 100.0
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for fam in c.collect() for s in fam.samples}
    for model in ("m", "n"):
        assert samples[("gateway_model_cost_total",
                        (("backend", "b"), ("model", model)))] == pytest.approx(0.05)
    assert not any(name == "gateway_cost_per_million_tokens" for name, _ in samples)


def test_only_priced_backends_tokens_count_toward_the_per_million_window() -> None:
    m = GatewayMetrics()
    m.count_tokens("m", 10, 100, now=1.0, backend="priced", priced=True)
    m.count_tokens("m", 10, 300, now=1.0, backend="free", priced=False)
    assert m.generated.total("m", now=2.0) == 100  # the unpriced 300 do not dilute it
    got = {s.labels["backend"]: s.value for fam in m.registry.collect()
           if fam.name == "gateway_backend_generated_tokens" for s in fam.samples
           if s.name.endswith("_total")}
    assert got == {"priced": 100, "free": 300}
