"""Scraping each backend's vLLM ``/metrics`` into a :class:`LoadSample`.

Only four gauges matter to the router, so :func:`parse_vllm_load` scans lines for them
instead of parsing the whole exposition. Measured on a full vLLM 0.32 scrape (671 lines,
../shared/real-vllm/metrics_sample.txt): prometheus_client's parser takes about 20 ms, the
scan about 0.2 ms; at two scrapes a second per backend the parser alone would cost a
16-backend fleet over half a CPU core.

Metric names (vLLM docs, "Production Metrics"): ``vllm:num_requests_waiting``,
``vllm:num_requests_running``, ``vllm:kv_cache_usage_perc`` (0-1; before vLLM 0.10 named
``vllm:gpu_cache_usage_perc``). With several engines (data parallel) in one server, the
counts are summed and the KV-cache usage is the highest engine's.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import httpx

from gateway.fleet.backend import Backend, LoadSample

_WAITING = "vllm:num_requests_waiting{"
_WAITING_BARE = "vllm:num_requests_waiting "
_RUNNING = "vllm:num_requests_running"
_KV = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")


def _value(line: str) -> float | None:
    # "name{labels} value [timestamp]" -> value; labels may contain spaces inside quotes.
    brace = line.rfind("}")
    rest = line[brace + 1 :] if brace >= 0 else line.split(" ", 1)[1] if " " in line else ""
    parts = rest.split()
    if not parts:
        return None
    try:
        v = float(parts[0])
    except ValueError:
        return None
    return v if math.isfinite(v) else None


def parse_vllm_load(text: str) -> tuple[float, float, float] | None:
    """``(waiting, running, kv_cache_usage)`` from a vLLM Prometheus exposition.

    Returns None when the text has none of the gauges (not a vLLM server). Missing
    individual gauges count as 0.
    """
    waiting = running = 0.0
    kv = 0.0
    found = False
    for line in text.split("\n"):
        if not line.startswith("vllm:"):
            continue
        if line.startswith(_WAITING) or line.startswith(_WAITING_BARE):
            v = _value(line)
            if v is not None:
                waiting += v
                found = True
        elif line.startswith(_RUNNING) and line[len(_RUNNING)] in "{ ":
            v = _value(line)
            if v is not None:
                running += v
                found = True
        elif line.startswith(_KV):
            v = _value(line)
            if v is not None:
                kv = max(kv, v)
                found = True
    return (waiting, running, kv) if found else None


async def scrape_load(
    client: httpx.AsyncClient, backend: Backend, api_key: str | None, clock: Callable[[], float]
) -> LoadSample:
    """GET ``/metrics`` of ``backend`` and return its load.

    The sample is stamped when the answer arrives (``clock``: monotonic seconds) with the
    gateway's in-flight count for the backend at that moment, the closest match to the
    instant vLLM rendered its gauges. Raises ``httpx.HTTPError`` on transport errors and
    ``ValueError`` when the answer is not a vLLM exposition.
    """
    headers = {"authorization": f"Bearer {api_key}"} if api_key else None
    r = await client.get(f"{backend.base_url}/metrics", headers=headers)
    if r.status_code != 200:
        raise ValueError(f"/metrics answered {r.status_code}")
    parsed = parse_vllm_load(r.text)
    if parsed is None:
        raise ValueError("/metrics has no vllm: load gauges")
    waiting, running, kv = parsed
    return LoadSample(waiting, running, kv, clock(), backend.in_flight)
