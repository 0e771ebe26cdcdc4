"""Scraping each backend's vLLM ``/metrics`` into a :class:`LoadSample`.

Only four gauges matter to the router, so :func:`parse_vllm_load` scans lines for them
instead of parsing the whole exposition. Measured on a full vLLM 0.32 scrape (671 lines,
from the CPU build of ``scripts/vllm-cpu/``): prometheus_client's parser takes about 20 ms, the
scan about 0.2 ms; at two scrapes a second per backend the parser alone would cost a
16-backend fleet over half a CPU core.

Metric names (vLLM docs, "Production Metrics"): ``vllm:num_requests_waiting``,
``vllm:num_requests_running``, ``vllm:kv_cache_usage_perc`` (0-1; before vLLM 0.10 named
``vllm:gpu_cache_usage_perc``). With several engines (data parallel) in one server, the
counts are summed and the KV-cache usage is the highest engine's.

GPU telemetry (:func:`parse_dcgm`, :func:`scrape_gpus`) reads a backend's
``gpu_metrics_url``: NVIDIA dcgm-exporter's Prometheus text (or ``llm-gateway agent``'s,
which serves the same names), one line per GPU with a ``gpu`` label, reduced to one
:class:`gateway.routing.thermal.GpuSample` (hottest GPU, summed power).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import httpx

from gateway.core.samples import GpuReading, GpuSample, LoadSample
from gateway.fleet.backend import Backend

_WAITING = "vllm:num_requests_waiting{"
_WAITING_BARE = "vllm:num_requests_waiting "
_RUNNING = "vllm:num_requests_running"
_KV = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
_SUCCESS = "vllm:request_success_total"
_PREFIX_HITS = "vllm:prefix_cache_hits_total"
_PREFIX_QUERIES = "vllm:prefix_cache_queries_total"
_PREFIX_RATE = "vllm:gpu_prefix_cache_hit_rate"  # before vLLM v1: a 0-1 gauge


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
    individual gauges count as 0; negative or NaN values (a broken exporter) count as 0
    (request counts and a usage fraction are never negative), KV cache usage at most 1.
    """
    g = parse_vllm_gauges(text)
    return None if g is None else g[:3]


def parse_vllm_gauges(
    text: str,
) -> tuple[float, float, float, float | None] | None:
    """:func:`parse_vllm_load`'s three gauges plus what the service model learns from
    (:mod:`gateway.traffic.capacity`): ``finished``, ``vllm:request_success_total`` summed
    over its finish reasons and engines (None when absent). One pass over the lines; None
    when none of the load gauges is present."""
    scan = scan_vllm(text)
    return None if scan is None else scan[:4]


def _ends_name(line: str, name: str) -> bool:
    """Whether the metric name of ``line`` (which starts with ``name``) is ``name``."""
    return line[len(name) : len(name) + 1] in ("{", " ")


def _add(total: float | None, v: float | None) -> float | None:
    if v is None or v < 0:
        return total
    return v if total is None else total + v


PrefixCounters = tuple[float | None, float | None, float | None]


def scan_vllm(text: str) -> tuple[float, float, float, float | None, PrefixCounters] | None:
    """:func:`parse_vllm_gauges`' four values plus the prefix cache's
    ``(hits, queries, hit_rate)``: vLLM v1's ``vllm:prefix_cache_hits_total`` and
    ``vllm:prefix_cache_queries_total`` (tokens, summed over engines) and the older 0-1
    gauge ``vllm:gpu_prefix_cache_hit_rate`` (the highest engine's); each None when
    absent. One pass over the lines; None when none of the load gauges is present."""
    waiting = running = 0.0
    kv = 0.0
    found = False
    finished: float | None = None
    hits: float | None = None
    queries: float | None = None
    rate: float | None = None
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
        elif line.startswith(_SUCCESS) and line[len(_SUCCESS)] in "{ ":
            v = _value(line)
            if v is not None and v >= 0:
                finished = v if finished is None else finished + v
        elif line.startswith("vllm:prefix_cache_"):
            if line.startswith(_PREFIX_HITS) and _ends_name(line, _PREFIX_HITS):
                hits = _add(hits, _value(line))
            elif line.startswith(_PREFIX_QUERIES) and _ends_name(line, _PREFIX_QUERIES):
                queries = _add(queries, _value(line))
        elif line.startswith(_PREFIX_RATE) and _ends_name(line, _PREFIX_RATE):
            v = _value(line)
            if v is not None and v >= 0:
                rate = v if rate is None else max(rate, v)
    if not found:
        return None

    def sane(x: float) -> float:
        return x if x > 0.0 else 0.0  # (NaN > 0 is False)

    return (
        sane(waiting), sane(running), min(1.0, sane(kv)), finished, (hits, queries, rate)
    )


async def scrape_load(
    client: httpx.AsyncClient,
    backend: Backend,
    api_key: str | None,
    clock: Callable[[], float],
    timeout_s: float | None = None,
) -> LoadSample:
    """GET ``/metrics`` of ``backend`` and return its load.

    The sample is stamped (``clock``: monotonic seconds) with the gateway's in-flight counts
    for the backend at their highest in the window where vLLM rendered its gauges
    (:meth:`Backend.open_scrape_window`): from sending the request's headers to reading the
    answer's headers (httpx ``trace`` events; prometheus-client renders the whole body
    before its headers go out), so the time waiting for a pooled connection, connecting and
    reading the body, when vLLM cannot be rendering, is left out. A transport without
    those events (a mock) widens it to the whole call. ``timeout_s``: the whole scrape's
    time limit in seconds (``telemetry.scrape_timeout_s``; None: the client's own).
    Raises ``httpx.HTTPError`` on transport errors and timeouts and ``ValueError`` when
    the answer is not a vLLM exposition.
    """
    headers = {"authorization": f"Bearer {api_key}"} if api_key else None
    stamp: tuple[int, int] | None = None

    async def trace(event: str, info: dict[str, Any]) -> None:
        nonlocal stamp
        if event.endswith("send_request_headers.started"):
            backend.open_scrape_window()
        elif event.endswith("receive_response_headers.complete"):
            stamp = backend.scrape_peak

    backend.open_scrape_window()
    r = await client.get(
        f"{backend.base_url}/metrics",
        headers=headers,
        extensions={"trace": trace},
        timeout=timeout_s if timeout_s is not None else httpx.USE_CLIENT_DEFAULT,
    )
    if r.status_code != 200:
        raise ValueError(f"/metrics answered {r.status_code}")
    parsed = scan_vllm(r.text)
    if parsed is None:
        raise ValueError("/metrics has no vllm: load gauges")
    waiting, running, kv, finished, (hits, queries, rate) = parsed
    in_flight, pooled_extra = stamp if stamp is not None else backend.scrape_peak
    return LoadSample(
        waiting,
        running,
        kv,
        clock(),
        in_flight,
        process_start(r.text),
        pooled_extra,
        finished,
        hits,
        queries,
        rate,
    )


_PROCESS_START = "process_start_time_seconds "


def process_start(text: str) -> float | None:
    """``process_start_time_seconds`` (unix seconds; prometheus-client's process collector,
    which vLLM's ``/metrics`` includes): a new value means a new server process."""
    at = text.find("\n" + _PROCESS_START)
    if at < 0:
        if not text.startswith(_PROCESS_START):
            return None
        at = -1
    line = text[at + 1 : text.find("\n", at + 1) if text.find("\n", at + 1) >= 0 else None]
    return _value(line)


# ---- GPU telemetry (DCGM exporter names) ------------------------------------------------------
# dcgm-exporter's metric names (NVIDIA DCGM field names). Temperature in °C, power in W,
# SM clock in MHz; XID_ERRORS is a gauge holding the last Xid code, ECC_DBE_VOL_TOTAL a
# counter. The power limit is DCGM_FI_DEV_POWER_MGMT_LIMIT (the configured limit), falling
# back to DCGM_FI_DEV_ENFORCED_POWER_LIMIT when only that is exported.
DCGM_TEMP = "DCGM_FI_DEV_GPU_TEMP"
DCGM_POWER = "DCGM_FI_DEV_POWER_USAGE"
DCGM_POWER_LIMIT = "DCGM_FI_DEV_POWER_MGMT_LIMIT"
DCGM_ENFORCED_LIMIT = "DCGM_FI_DEV_ENFORCED_POWER_LIMIT"
DCGM_SM_CLOCK = "DCGM_FI_DEV_SM_CLOCK"
DCGM_XID = "DCGM_FI_DEV_XID_ERRORS"
DCGM_ECC_DBE = "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL"
# utilization in percent (0-100), framebuffer memory in MiB (dcgm-exporter's default
# counters: GPU_UTIL, FB_USED, FB_FREE; FB_RESERVED in newer ones; FB_TOTAL when configured)
DCGM_UTIL = "DCGM_FI_DEV_GPU_UTIL"
DCGM_FB_USED = "DCGM_FI_DEV_FB_USED"
DCGM_FB_FREE = "DCGM_FI_DEV_FB_FREE"
DCGM_FB_RESERVED = "DCGM_FI_DEV_FB_RESERVED"
DCGM_FB_TOTAL = "DCGM_FI_DEV_FB_TOTAL"
MIB = 1024 * 1024
_DCGM_FIELDS = {
    DCGM_TEMP: "temp_c",
    DCGM_POWER: "power_w",
    DCGM_POWER_LIMIT: "power_limit_w",
    DCGM_ENFORCED_LIMIT: "enforced_limit_w",
    DCGM_SM_CLOCK: "sm_clock_mhz",
    DCGM_XID: "xid",
    DCGM_ECC_DBE: "ecc_dbe",
    DCGM_UTIL: "util_pct",
    DCGM_FB_USED: "fb_used_mib",
    DCGM_FB_FREE: "fb_free_mib",
    DCGM_FB_RESERVED: "fb_reserved_mib",
    DCGM_FB_TOTAL: "fb_total_mib",
}


def framebuffer_bytes(fields: dict[str, float]) -> tuple[float | None, float | None]:
    """``(used, total)`` framebuffer bytes from one GPU's DCGM fields in MiB: ``used`` is
    ``DCGM_FI_DEV_FB_USED``; ``total`` is ``DCGM_FI_DEV_FB_TOTAL`` when exported, else
    used + free (+ reserved, which dcgm-exporter 3.3+ reports apart); None when unknown."""
    used = fields.get("fb_used_mib")
    total = fields.get("fb_total_mib")
    if total is None and used is not None and "fb_free_mib" in fields:
        total = used + fields["fb_free_mib"] + fields.get("fb_reserved_mib", 0.0)
    return (
        None if used is None else used * MIB,
        None if total is None else total * MIB,
    )


def _label(line: str, name: str) -> str | None:
    """The value of label ``name`` in an exposition line (no escapes expected in it)."""
    key = f'{name}="'
    i = line.find(key, 0, line.rfind("}") + 1)
    if i < 0 or (i > 0 and line[i - 1] not in "{,"):
        return None
    j = line.find('"', i + len(key))
    return None if j < 0 else line[i + len(key) : j]


def _gpu_order(key: str) -> tuple[int, str]:
    return (int(key), "") if key.isdigit() else (1 << 30, key)


def parse_dcgm(text: str, gpu_indices: Sequence[int] | None = None) -> list[GpuReading]:
    """Per-GPU readings (ordered by the ``gpu`` label) from a DCGM exporter exposition.

    ``gpu_indices`` keeps only those GPUs (an exporter serves a whole node; a backend may
    use some of its GPUs). A GPU without a ``gpu`` label counts as GPU "0". Returns an empty
    list when no GPU reports a temperature (not a DCGM exposition, or no GPU of ours).
    """
    wanted = None if gpu_indices is None else {str(i) for i in gpu_indices}
    per_gpu: dict[str, dict[str, float]] = {}
    for line in text.split("\n"):
        if not line.startswith("DCGM_FI_DEV_"):
            continue
        end = len(line)
        for stop in "{ ":
            k = line.find(stop)
            if 0 <= k < end:
                end = k
        field = _DCGM_FIELDS.get(line[:end])
        if field is None:
            continue
        value = _value(line)
        if value is None:
            continue
        gpu = _label(line, "gpu") or "0"
        if wanted is not None and gpu not in wanted:
            continue
        per_gpu.setdefault(gpu, {})[field] = value
    out: list[GpuReading] = []
    for gpu in sorted(per_gpu, key=_gpu_order):
        f = per_gpu[gpu]
        used, total = framebuffer_bytes(f)
        out.append(
            GpuReading(
                temp_c=f.get("temp_c"),
                power_w=f.get("power_w"),
                power_limit_w=f.get("power_limit_w", f.get("enforced_limit_w")),
                sm_clock_mhz=f.get("sm_clock_mhz"),
                xid=int(f.get("xid", 0.0)),
                ecc_dbe=f.get("ecc_dbe"),
                gpu=gpu,
                util_ratio=(
                    None if "util_pct" not in f else min(1.0, max(0.0, f["util_pct"] / 100))
                ),
                fb_used_bytes=used,
                fb_total_bytes=total,
            )
        )
    if not any(g.temp_c is not None for g in out):
        return []
    return out


async def scrape_gpus(
    client: httpx.AsyncClient,
    url: str,
    clock: Callable[[], float],
    gpu_indices: Sequence[int] | None = None,
    timeout_s: float | None = None,
) -> GpuSample:
    """GET a DCGM-style exposition at ``url`` and reduce it to one :class:`GpuSample`
    stamped with ``clock()`` (monotonic seconds) when the answer arrived.

    Raises ``httpx.HTTPError`` on transport errors and ``ValueError`` when the answer is not
    200 or carries no GPU temperature.
    """
    r = await client.get(url, timeout=timeout_s)
    if r.status_code != 200:
        raise ValueError(f"GPU metrics answered {r.status_code}")
    readings = parse_dcgm(r.text, gpu_indices)
    if not readings:
        raise ValueError(f"GPU metrics have no {DCGM_TEMP}")
    return GpuSample.from_gpus(clock(), readings)
