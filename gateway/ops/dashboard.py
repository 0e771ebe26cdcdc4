"""The operators' Grafana dashboard, as data (issue 19): ``deploy/grafana/llm-gateway.json``.

Rows: traffic and SLOs, fleet health, thermal and power, cache, admission and batching,
cost. Every latency panel is a percentile from a histogram (``histogram_quantile`` over
``sum by (..., le) (rate(..._bucket[$__rate_interval]))``), never a mean: a mean hides the
tail users feel, and alerts fire on the same P99s (:mod:`gateway.ops.alerts`). Per-backend
gauges are exported by every gateway replica, so panels take ``max by (backend)`` of them
before summing over backends; counters of the request path (each replica counts its own
requests) are summed.

Each query is a :class:`Target` whose ``under_load`` says whether the test load of
``tests/ops/test_prometheus_dashboard.py`` (streams and non-streams through a gateway over
simulated backends with GPU telemetry and a power domain, a few errors, a rate-limited
key) makes samples for it; the others (hot GPUs, breaker trips, calibration drift,
cooldowns) are events that load does not cause, and that test only checks that their
queries run. Grafana's JSON model: https://grafana.com/docs/grafana/latest/dashboards/
build-dashboards/view-dashboard-json-model/ (schemaVersion 39, timeseries panels, row
panels, a datasource and a ``model`` template variable).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gateway.ops.limits import Limits

RATE = "$__rate_interval"
"""Grafana's rate window (at least four scrape intervals); the test substitutes ``1m``."""
MODEL = 'model=~"$model"'
"""The model selector of the ``model`` template variable (All: ``.*``)."""
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}


@dataclass(frozen=True)
class Target:
    """One PromQL query of a panel, its legend (Grafana's ``{{label}}`` template) and
    whether the test load makes data for it (``under_load``; module docstring)."""

    expr: str
    legend: str
    under_load: bool = True


@dataclass(frozen=True)
class Panel:
    """A timeseries panel: title, what it shows (``description``), its queries, Grafana's
    unit id (``s``, ``reqps``, ``percentunit``, ``celsius``, ``watt``, ``short``,
    ``bytes``) and threshold lines (value, colour), e.g. the SLO."""

    title: str
    description: str
    targets: tuple[Target, ...]
    unit: str = "short"
    thresholds: tuple[tuple[float, str], ...] = ()
    stacked: bool = False


@dataclass(frozen=True)
class Row:
    """A dashboard row: its title and panels (three to a line)."""

    title: str
    panels: tuple[Panel, ...]


def _quantiles(metric: str, by: str, qs: tuple[float, ...], selector: str = MODEL,
               under_load: bool = True, legend: str = "") -> tuple[Target, ...]:
    """``histogram_quantile`` targets of ``metric``'s buckets by ``by`` at each of ``qs``
    (legends ``<legend><by value> P<q>``)."""
    sel = f"{{{selector}}}" if selector else ""
    return tuple(
        Target(
            f"histogram_quantile({q}, sum by ({by}, le) "
            f"(rate({metric}_bucket{sel}[{RATE}])))",
            legend + "{{" + by + "}}" + f" P{round(q * 100)}",
            under_load,
        )
        for q in qs
    )


def traffic(lim: Limits) -> Row:
    """QPS, TTFT and ITL percentiles against the SLO, output tokens/s, errors by type."""
    slo_ttft = ((lim.ttft_s, "red"),)
    return Row("Traffic and SLOs", (
        Panel("Requests/s by model", "Client requests answered per second (every status).",
              (Target(f"sum by (model) (rate(gateway_requests_total{{{MODEL}}}[{RATE}]))",
                      "{{model}}"),), "reqps"),
        Panel("Requests/s by status", "Answered requests per second by HTTP status (499: "
              "the client closed the connection).",
              (Target(f"sum by (status) (rate(gateway_requests_total{{{MODEL}}}[{RATE}]))",
                      "{{status}}"),), "reqps", stacked=True),
        Panel("TTFT P50 / P99 by model", "Streams' time to first token as the client sees "
              "it (gateway_ttft_seconds), against slo.ttft_s.",
              _quantiles("gateway_ttft_seconds", "model", (0.5, 0.99)), "s", slo_ttft),
        Panel("TTFT P99 by backend", "P99 time to first token of the streams each backend "
              "produced.", _quantiles("gateway_ttft_seconds", "backend", (0.99,)), "s",
              slo_ttft),
        Panel("ITL P50 / P99 by model", "Inter-token latency: seconds between two content "
              "events of one stream written to the client (gateway_itl_seconds), against "
              "slo.itl_s.", _quantiles("gateway_itl_seconds", "model", (0.5, 0.99)), "s",
              ((lim.itl_s, "red"),)),
        Panel("ITL P99 by backend", "P99 inter-token latency of the streams each backend "
              "produced.", _quantiles("gateway_itl_seconds", "backend", (0.99,)), "s",
              ((lim.itl_s, "red"),)),
        Panel("Time to first byte P99 by endpoint", "Request received -> first byte sent, "
              "streams and non-streams (a non-stream's first byte is its whole answer).",
              _quantiles("gateway_time_to_first_byte_seconds", "endpoint", (0.99,)), "s"),
        Panel("Request duration P50 / P99 by model", "Request received -> answer complete.",
              _quantiles("gateway_request_duration_seconds", "model", (0.5, 0.99)), "s"),
        Panel("Output tokens/s by model", "Generated (completion) tokens per second from "
              "the backends' usage.",
              (Target("sum by (model) (rate(gateway_tokens_total"
                      f"{{kind=\"completion\", {MODEL}}}[{RATE}]))", "{{model}}"),)),
        Panel("Errors/s by type", "Requests that ended in an error, by type (timeout, "
              "upstream_5xx, connect, no_backend, cut, in_band_error, rate_limited: the "
              "client key's own limit, upstream_rate_limited: a backend's own 429, "
              "admission_refused, client_disconnect).",
              (Target("sum by (error_type) (rate(gateway_request_errors_total"
                      f"{{{MODEL}}}[{RATE}]))", "{{error_type}}"),), stacked=True),
        Panel("Error ratio by model and type", "Errors of each type over answered requests "
              "of the model (the alert GatewayErrorRatioHigh fires above 5 %).",
              (Target("sum by (model, error_type) (rate(gateway_request_errors_total"
                      f"{{{MODEL}}}[{RATE}])) / on (model) group_left sum by (model) "
                      f"(rate(gateway_requests_total{{{MODEL}}}[{RATE}]))",
                      "{{model}} {{error_type}}"),), "percentunit", ((0.05, "red"),)),
        Panel("Upstream attempts/s by outcome", "Attempts sent to backends by outcome (ok, "
              "or the failure kind: connect, ttfb_timeout, status, rate_limited, ...).",
              (Target(f"sum by (outcome) (rate(gateway_upstream_attempts_total[{RATE}]))",
                      "{{outcome}}"),), stacked=True),
    ))


def fleet(lim: Limits) -> Row:
    """Backends by state, warm backends per model, cooldowns, breakers, calibration."""
    return Row("Fleet health", (
        Panel("Backends by state", "Backends in each lifecycle state (cold, warming, warm, "
              "draining, cooldown, unhealthy).",
              (Target("sum by (state) (max by (backend, state) (gateway_backend_state))",
                      "{{state}}"),), stacked=True),
        Panel("Warm backends by model", "Backends serving the model that are warm (0: the "
              "alert GatewayNoWarmBackend).",
              (Target(f"min by (model) (gateway_model_backends{{state=\"warm\", {MODEL}}})",
                      "{{model}}"),)),
        Panel("Cooldowns", "Backends resting now (state cooldown) and thermal cooldowns "
              "started per backend.",
              (Target("sum(max by (backend) (gateway_backend_state{state=\"cooldown\"}))",
                      "in cooldown"),
               Target(f"sum by (backend) (increase(gateway_thermal_cooldowns_total[{RATE}]))",
                      "{{backend}} thermal cooldowns started", under_load=False))),
        Panel("Circuit breakers", "Backends by breaker state, and breaker trips by reason.",
              (Target("sum by (state) (max by (backend, state) "
                      "(gateway_backend_breaker_state))", "{{state}}"),
               Target(f"sum by (reason) (increase(gateway_breaker_trips_total[{RATE}]))",
                      "trips: {{reason}}", under_load=False))),
        Panel("Calibration score", "Last calibration similarity to the backend's baseline "
              "(0-1), against calibration.threshold (below it: drift, unhealthy).",
              (Target("min by (backend) (gateway_calibration_score_ratio)", "{{backend}}",
                      under_load=False),), "percentunit",
              ((lim.calibration_threshold, "red"),)),
        Panel("Requests in flight by backend", "Requests the gateway replicas have open on "
              "each backend.",
              (Target("sum by (backend) (gateway_backend_in_flight)", "{{backend}}"),)),
        Panel("Scrape age by backend", "Seconds since the last good /metrics scrape of the "
              "backend (a stale load view routes blind).",
              (Target("min by (backend) (gateway_backend_scrape_age_seconds)",
                      "{{backend}}"),), "s"),
        Panel("Coordination (fleet mode)", "1 while a replica runs on its local share "
              "because the shared store does not answer; replicas alive.",
              (Target("max(gateway_coordination_fallback)", "fallback"),
               Target("max(gateway_fleet_replicas_alive)", "replicas alive"))),
        Panel("Gateway replicas by version", "Gateway replicas running each version "
              "(gateway_build_info).",
              (Target("count by (version) (gateway_build_info)", "{{version}}"),)),
        Panel("Resident memory by replica", "Each gateway replica's resident memory.",
              (Target("process_resident_memory_bytes and on (instance) gateway_build_info",
                      "{{instance}}"),), "bytes"),
    ))


def thermal(lim: Limits) -> Row:
    """Temperature distribution per tier, power per domain against budget, GPU use."""
    joined = ("max by (backend, tier) (gateway_gpu_temperature_celsius * on (instance, "
              "backend) group_left (tier) (gateway_thermal_tier == 1))")
    tiers = ((lim.warm_c, "orange"), (lim.hot_c, "red"))
    return Row("Thermal and power", (
        Panel("Backends by thermal tier", "Backends whose hottest GPU is cool, warm, hot "
              "(or unknown: telemetry missing or stale).",
              (Target("sum by (tier) (max by (backend, tier) (gateway_thermal_tier))",
                      "{{tier}}"),), stacked=True),
        Panel("GPU temperature distribution by tier", "Hottest-GPU temperature of the "
              "backends in each tier: min, P50, max, against thermal.warm_c / hot_c.",
              (Target(f"min by (tier) ({joined})", "{{tier}} min"),
               Target(f"quantile by (tier) (0.5, {joined})", "{{tier}} P50"),
               Target(f"max by (tier) ({joined})", "{{tier}} max")), "celsius", tiers),
        Panel("GPU temperature by backend", "Hottest GPU now and predicted "
              "thermal.predict_ahead_s ahead (trend).",
              (Target("max by (backend) (gateway_gpu_temperature_celsius)", "{{backend}}"),
               Target("max by (backend) (gateway_gpu_predicted_temperature_celsius)",
                      "{{backend}} predicted")), "celsius", tiers),
        Panel("Power by domain against budget", "Summed GPU draw of each power domain and "
              "its budget, watts.",
              (Target("max by (domain) (gateway_power_domain_watts)", "{{domain}} draw"),
               Target("max by (domain) (gateway_power_domain_budget_watts)",
                      "{{domain}} budget")), "watt"),
        Panel("Power domain draw / budget", "Share of each domain's budget drawn "
              "(admission sheds from thermal.power_shed_levels).",
              (Target("max by (domain) (gateway_power_domain_watts) / max by (domain) "
                      "(gateway_power_domain_budget_watts)", "{{domain}}"),), "percentunit",
              ((1.0, "red"),)),
        Panel("GPU utilization by backend", "DCGM_FI_DEV_GPU_UTIL (0-1) of each GPU.",
              (Target("max by (backend, gpu) (gateway_gpu_utilization_ratio)",
                      "{{backend}} gpu {{gpu}}"),), "percentunit"),
        Panel("GPU framebuffer used by backend", "Framebuffer memory used over total "
              "(DCGM_FI_DEV_FB_USED / FB_USED + FB_FREE).",
              (Target("max by (backend) (gateway_gpu_framebuffer_used_bytes) / max by "
                      "(backend) (gateway_gpu_framebuffer_total_bytes)", "{{backend}}"),),
              "percentunit"),
    ))


def cache() -> Row:
    """Prefix-cache hit-rate trend, KV-cache use, warm-pool hits."""
    return Row("Cache", (
        Panel("Prefix-cache hit ratio by backend", "vLLM's prefix-cache hits / queries "
              "between the gateway's last two scrapes, and over the rate window.",
              (Target("max by (backend) (gateway_backend_prefix_cache_hit_ratio)",
                      "{{backend}}"),
               Target("max by (backend) (avg_over_time("
                      f"gateway_backend_prefix_cache_hit_ratio[{RATE}]))",
                      "{{backend}} window")), "percentunit"),
        Panel("KV-cache use by backend", "Last scraped KV-cache usage (0-1).",
              (Target("max by (backend) (gateway_backend_kv_cache_usage_ratio)", "{{backend}}"),),
              "percentunit"),
        Panel("Warm-pool hit ratio", "Requests served by backends warm and past slow start "
              "over all requests, per gateway replica.",
              (Target("gateway_warm_pool_hit_ratio", "{{instance}}"),), "percentunit"),
    ))


def admission() -> Row:
    """Queue depth, queue wait, rejections, batch sizes, degraded mode."""
    return Row("Admission and batching", (
        Panel("Queue depth", "Requests waiting in the batcher by priority bucket, and in "
              "the backends' own queues (vllm:num_requests_waiting).",
              (Target("sum by (bucket) (gateway_queue_depth)", "batcher {{bucket}}"),
               Target("sum(max by (backend) (gateway_backend_waiting))",
                      "vLLM waiting")), stacked=False),
        Panel("Queue wait P99", "Time requests waited for a slot: in the admission "
              "scheduler's queue by priority, or, with the batcher on (its buckets are the "
              "queue then), in the batcher by bucket.",
              _quantiles("gateway_admission_queue_wait_seconds", "priority", (0.99,),
                         selector="", under_load=False, legend="admission ")
              + _quantiles("gateway_batch_wait_seconds", "bucket", (0.99,), selector="",
                           legend="batcher "),
              "s"),
        Panel("Rejections/s by layer", "Requests refused by admission (entry: per-key "
              "limits; scheduler; resource; power; degraded).",
              (Target("sum by (layer) (rate(gateway_admission_rejections_total"
                      f"[{RATE}]))", "{{layer}}"),), "reqps", stacked=True),
        Panel("Batch size P50 / P99", "Requests per batch the batcher dispatched.",
              _quantiles("gateway_batch_size", "bucket", (0.5, 0.99), selector="")),
        Panel("Degraded mode level", "0: off; higher levels cap max_tokens and shed.",
              (Target("max(gateway_degraded_mode)", "level"),)),
    ))


PRICED = "gateway_backend_cost_total"
"""Exported for the backends with a ``gpu_hour_price`` only: ``and on (backend)`` it keeps
a per-backend series of priced backends, ``unless on (backend)`` those of the others."""


def cost() -> Row:
    """Cost per million output tokens (priced backends only), spend per hour
    (``gpu_hour_price``) and the output tokens of backends without a price.

    Cost per million tokens = the priced backends' cost / the tokens those backends
    generated, x 1e6, over the rate window. Each replica exports the cost of every backend
    (the same counter: ``max by`` it) and counts the tokens of its own clients (``sum``
    them): the ratio of the two is the fleet's whatever the number of replicas, where a
    per-replica ratio would be N times too high."""
    return Row("Cost", (
        Panel("Cost per million output tokens by model", "Cost of the model's priced "
              "backends over the completion tokens those backends generated, x 1e6, over "
              "the rate window (currency of backends[].gpu_hour_price; backends without a "
              "price are left out of both: 'Unpriced output tokens/s').",
              (Target("sum by (model) (max by (model, backend) (rate(gateway_model_cost_total"
                      f"{{{MODEL}}}[{RATE}]))) / sum by (model) (rate("
                      f"gateway_backend_generated_tokens_total{{{MODEL}}}[{RATE}]) and on "
                      f"(backend) {PRICED}) * 1e6", "{{model}}"),)),
        Panel("Spend per hour by backend", "Currency units per hour accrued by each backend "
              "in the fleet (gpu_hour_price x gpus).",
              (Target(f"max by (backend) (rate({PRICED}[{RATE}])) * 3600",
                      "{{backend}}"),
               Target(f"sum(max by (backend) (rate({PRICED}[{RATE}]))) * 3600",
                      "fleet")), stacked=False),
        Panel("Unpriced output tokens/s by model", "Completion tokens per second generated "
              "by backends without a gpu_hour_price: not in the cost per million tokens.",
              (Target("sum by (model) (rate(gateway_backend_generated_tokens_total"
                      f"{{{MODEL}}}[{RATE}]) unless on (backend) {PRICED})",
                      "{{model}}"),)),
    ))


def rows(lim: Limits) -> tuple[Row, ...]:
    """Every row of the dashboard, top to bottom."""
    return (traffic(lim), fleet(lim), thermal(lim), cache(), admission(), cost())


# ---- the Grafana JSON model ------------------------------------------------------------------

WIDTH, HEIGHT, PER_LINE = 24, 8, 3


def _panel_json(p: Panel, pid: int, x: int, y: int) -> dict[str, Any]:
    steps: list[dict[str, Any]] = [{"color": "green", "value": None}]
    steps += [{"color": color, "value": value} for value, color in p.thresholds]
    custom: dict[str, Any] = {
        "drawStyle": "line",
        "lineWidth": 1,
        "fillOpacity": 20 if p.stacked else 0,
        "stacking": {"mode": "normal" if p.stacked else "none", "group": "A"},
        "thresholdsStyle": {"mode": "line" if p.thresholds else "off"},
    }
    return {
        "id": pid,
        "type": "timeseries",
        "title": p.title,
        "description": p.description,
        "datasource": DATASOURCE,
        "gridPos": {"x": x, "y": y, "w": WIDTH // PER_LINE, "h": HEIGHT},
        "fieldConfig": {
            "defaults": {
                "unit": p.unit,
                "custom": custom,
                "thresholds": {"mode": "absolute", "steps": steps},
            },
            "overrides": [],
        },
        "options": {
            "legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
            "tooltip": {"mode": "multi", "sort": "desc"},
        },
        "targets": [
            {"refId": chr(ord("A") + i), "datasource": DATASOURCE, "expr": t.expr,
             "legendFormat": t.legend, "range": True}
            for i, t in enumerate(p.targets)
        ],
    }


def _templating() -> dict[str, Any]:
    return {"list": [
        {"name": "datasource", "label": "Prometheus", "type": "datasource",
         "query": "prometheus", "current": {}, "hide": 0, "refresh": 1},
        {"name": "model", "label": "Model", "type": "query", "datasource": DATASOURCE,
         "query": {"query": "label_values(gateway_requests_total, model)",
                   "refId": "PrometheusVariableQueryEditor-VariableQuery"},
         "definition": "label_values(gateway_requests_total, model)",
         "includeAll": True, "allValue": ".*", "multi": True, "refresh": 2, "sort": 1,
         "current": {"selected": True, "text": ["All"], "value": ["$__all"]}, "hide": 0},
    ]}


def build_dashboard(lim: Limits) -> dict[str, Any]:
    """The Grafana dashboard JSON model (a dict; ``json.dumps`` it) for these limits."""
    panels: list[dict[str, Any]] = []
    pid, y = 1, 0
    for row in rows(lim):
        panels.append({"id": pid, "type": "row", "title": row.title, "collapsed": False,
                       "gridPos": {"x": 0, "y": y, "w": WIDTH, "h": 1}, "panels": []})
        pid, y = pid + 1, y + 1
        for i, p in enumerate(row.panels):
            x = (i % PER_LINE) * (WIDTH // PER_LINE)
            panels.append(_panel_json(p, pid, x, y + (i // PER_LINE) * HEIGHT))
            pid += 1
        y += -(-len(row.panels) // PER_LINE) * HEIGHT
    return {
        "uid": "llm-gateway",
        "title": "llm-gateway",
        "description": "LLM gateway over a vLLM fleet (issue 19). Generated by "
                       "`python -m gateway.ops` (gateway/ops/dashboard.py): edit the "
                       "generator, not this file.",
        "tags": ["llm-gateway", "vllm"],
        "editable": True,
        "graphTooltip": 1,
        "refresh": "30s",
        "schemaVersion": 39,
        "version": 1,
        "time": {"from": "now-6h", "to": "now"},
        "timezone": "browser",
        "annotations": {"list": []},
        "templating": _templating(),
        "panels": panels,
    }


@dataclass(frozen=True)
class Query:
    """One query of the built dashboard: panel title, Grafana ``refId``, PromQL, and
    whether the test load makes data for it."""

    panel: str
    ref_id: str
    expr: str
    under_load: bool


def queries(lim: Limits) -> list[Query]:
    """Every panel query of :func:`build_dashboard` with its ``under_load`` mark."""
    return [
        Query(p.title, chr(ord("A") + i), t.expr, t.under_load)
        for row in rows(lim) for p in row.panels for i, t in enumerate(p.targets)
    ]
