"""The operator signals of issue 19 through real HTTP: a gateway over simulated vLLM servers
(one healthy with GPU telemetry and a price; one per error to induce) serves streams,
non-streams and errors of several types, and its ``/metrics``, read with prometheus_client's
parser, has data for every new series: TTFT and ITL per model and backend, errors by type,
the prefix-cache hit ratio from the simulator's vLLM counters, GPU utilization and
framebuffer memory from its DCGM endpoint, cost, build info, process metrics, and no
``_created`` series."""

from __future__ import annotations

import math
import platform
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway.config import FaultConfig
from gateway.sim import SimConfig, SimServerThread
from gateway.sim.engine import EngineParams
from tests.support.scripted import wait_for
from tests.support.servers import GatewayThread, gateway_config

PRICE = 2.0  # per GPU-hour
MIB = 1024 * 1024
Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def _sim(model: str, **faults: Any) -> SimServerThread:
    engine = EngineParams(itl_base_s=0.005, itl_per_seq_s=0.0, max_num_seqs=16)
    cfg = SimConfig(model=model, engine_label=model, engine=engine,
                    faults=FaultConfig(**faults))
    return SimServerThread(cfg)


@pytest.fixture(scope="module")
def fleet() -> Iterator[str]:
    """A gateway over five simulators: ``m1`` healthy (GPU telemetry, priced), ``m5xx``
    answering 500, ``m429`` answering 429, ``mslow`` answering after 2 s (the gateway's
    ttfb_timeout_s is 1 s), ``mcut`` dropping streams after 3 chunks."""
    sims = {
        "a": _sim("m1"),
        "e5": _sim("m5xx", error_rate=1.0),
        "rl": _sim("m429", rate_limit_rate=1.0, retry_after_s=1.0),
        "slow": _sim("mslow", added_latency_s=2.0),
        "cut": _sim("mcut", drop_after_chunks=3),
    }
    urls = {k: s.start() for k, s in sims.items()}
    backends: list[dict[str, Any]] = [
        {"id": k, "url": u, "models": [s.config.model]} for (k, u), s in
        zip(urls.items(), sims.values(), strict=True)
    ]
    backends[0].update(gpu_metrics_url=urls["a"] + "/gpu/metrics", gpu_hour_price=PRICE,
                       gpus=1)
    cfg = gateway_config(
        backends,
        proxy={"ttfb_timeout_s": 1.0},
        thermal={"scrape_interval_s": 0.1, "scrape_timeout_s": 1.0},
    )
    gw = GatewayThread(cfg)
    try:
        url = gw.start(wait_ready=False)
        gw.wait_ready(timeout=20, routable=len(sims))
        yield url
    finally:
        gw.stop()
        for s in sims.values():
            s.stop()


def samples(url: str) -> tuple[Samples, str]:
    text = httpx.get(url + "/metrics", timeout=5).text
    got = {(s.name, tuple(sorted(s.labels.items()))): s.value
           for fam in text_string_to_metric_families(text) for s in fam.samples}
    return got, text


def value(m: Samples, name: str, **labels: str) -> float | None:
    return m.get((name, tuple(sorted(labels.items()))))


def chat(url: str, model: str, stream: bool = False, max_tokens: int = 8,
         content: str = "Tell me about lighthouses.") -> httpx.Response:
    body = {"model": model, "messages": [{"role": "user", "content": content}],
            "max_tokens": max_tokens, "stream": stream}
    return httpx.post(url + "/v1/chat/completions", json=body, timeout=30)


def data_events(text: str) -> int:
    """Data events other than ``[DONE]`` a client read in a stream's body."""
    return sum(1 for block in text.split("\n\n")
               if block.startswith("data:") and block.strip() != "data: [DONE]")


def test_every_new_signal_has_data(fleet: str) -> None:
    url = fleet
    # ---- streams: TTFT per backend, ITL = events - 1 per stream ----------------------
    before, _ = samples(url)
    itl0 = value(before, "gateway_itl_seconds_count", model="m1", backend="a") or 0.0
    r = chat(url, "m1", stream=True, max_tokens=12)
    assert r.status_code == 200
    events = data_events(r.text)
    assert events >= 5
    m, _ = samples(url)
    assert value(m, "gateway_itl_seconds_count", model="m1", backend="a") == itl0 + events - 1
    itl_sum = value(m, "gateway_itl_seconds_sum", model="m1", backend="a")
    assert itl_sum is not None and 0 < itl_sum < 10
    assert value(m, "gateway_ttft_seconds_count", model="m1", backend="a") == 1
    ttft_sum = value(m, "gateway_ttft_seconds_sum", model="m1", backend="a")
    assert ttft_sum is not None and 0 < ttft_sum < 5
    # non-streams are not in the TTFT histogram
    for _ in range(3):  # the same prompt again: prefix-cache hits
        assert chat(url, "m1").status_code == 200
    m, _ = samples(url)
    assert value(m, "gateway_ttft_seconds_count", model="m1", backend="a") == 1
    assert (value(m, "gateway_tokens_total", model="m1", kind="completion") or 0) > 0

    # ---- errors by type --------------------------------------------------------------
    assert chat(url, "m5xx").status_code == 500
    assert chat(url, "m429").status_code == 429
    assert chat(url, "mslow").status_code == 504
    cut = chat(url, "mcut", stream=True, max_tokens=20)
    assert cut.status_code == 200 and '"error"' in cut.text
    with httpx.stream("POST", url + "/v1/chat/completions", timeout=30, json={
            "model": "m1", "messages": [{"role": "user", "content": "a long story"}],
            "max_tokens": 400, "stream": True, "ignore_eos": True}) as s:
        # ignore_eos: the simulator's answer runs its 400 tokens (2 s) whatever its seed
        # draws for a natural stop, so the client is gone before the answer ends
        next(s.iter_lines())  # the first event, then the client hangs up

    def errors() -> dict[tuple[str, str], float]:
        got, _ = samples(url)
        return {(dict(k[1])["model"], dict(k[1])["error_type"]): v for k, v in got.items()
                if k[0] == "gateway_request_errors_total"}

    assert wait_for(lambda: ("m1", "client_disconnect") in errors(), timeout=10)
    assert errors() == {
        ("m5xx", "upstream_5xx"): 1.0,
        ("m429", "upstream_rate_limited"): 1.0,  # the backend's own 429
        ("mslow", "timeout"): 1.0,
        ("mcut", "cut"): 1.0,
        ("m1", "client_disconnect"): 1.0,
    }

    # ---- prefix cache, GPUs, cost (scraped in the background) --------------------------
    def scraped() -> bool:
        got, _ = samples(url)
        return (value(got, "gateway_backend_prefix_cache_hit_ratio", backend="a") is not None
                and value(got, "gateway_gpu_utilization_ratio", backend="a", gpu="0")
                is not None)

    for _ in range(2):
        assert chat(url, "m1").status_code == 200  # queries between two scrapes
    assert wait_for(scraped, timeout=10)
    m, text = samples(url)
    ratio = value(m, "gateway_backend_prefix_cache_hit_ratio", backend="a")
    assert ratio is not None and 0.0 <= ratio <= 1.0
    util = value(m, "gateway_gpu_utilization_ratio", backend="a", gpu="0")
    assert util is not None and 0.0 <= util <= 1.0
    used = value(m, "gateway_gpu_framebuffer_used_bytes", backend="a", gpu="0")
    total = value(m, "gateway_gpu_framebuffer_total_bytes", backend="a", gpu="0")
    assert total == 81559 * MIB  # an 80 GB H100 as DCGM reports it
    assert used is not None and 0 < used < total
    cost = value(m, "gateway_backend_cost_total", backend="a")
    assert cost is not None and 0 < cost < PRICE  # less than an hour in the fleet
    assert value(m, "gateway_backend_cost_total", backend="e5") is None  # no price
    per_m = value(m, "gateway_cost_per_million_tokens", model="m1")
    assert per_m is not None and math.isfinite(per_m) and per_m > 0
    assert value(m, "gateway_cost_per_million_tokens", model="m5xx") is None

    # ---- renamed ratios (both names, one release), build info, process, no _created ---
    kv = value(m, "gateway_backend_kv_cache_usage_ratio", backend="a")
    assert kv is not None and kv == value(m, "gateway_backend_kv_cache_usage", backend="a")
    build = [k for k in m if k[0] == "gateway_build_info"]
    assert len(build) == 1 and m[build[0]] == 1.0
    labels = dict(build[0][1])
    assert set(labels) == {"version", "python", "platform"}
    assert labels["python"] == platform.python_version() and labels["version"]
    assert (value(m, "process_cpu_seconds_total") or 0) > 0
    assert (value(m, "process_resident_memory_bytes") or 0) > 0
    assert any(k[0] == "python_info" for k in m)
    assert "_created" not in text
