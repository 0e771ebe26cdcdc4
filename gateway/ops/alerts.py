"""The Prometheus alert rules, as data (issue 19): ``deploy/prometheus/alerts.yaml``.

Percentiles, not means: the latency alerts compare the P99 of the gateway's histograms
(``histogram_quantile`` over 5-minute rates) with the SLO, held for a window (``for``), so
one slow minute does not page and a tail that users feel for five minutes does. Google's
SRE workbook ("Alerting on SLOs") is the model: alert on what users see, with a window,
and say in each alert what to look at (``annotations.runbook``).

Rules cannot read the gateway's config: the thresholds are baked in from a
:class:`~gateway.ops.limits.Limits` (the committed file: the schema's defaults, ``slo.ttft_s``
2 s, ``slo.itl_s`` 0.1 s, ``thermal.hot_c`` 85 °C, ``calibration.threshold`` 0.95,
``status.now_s`` 300 s, ``status.min_samples`` 20); ``python -m gateway.ops --config FILE``
writes rules with a fleet's own values.

**The status page and the alerts agree.** The latency and error-ratio alerts take their
rate window from the status page's "now" window (``status.now_s``: ``5m``) and fire only on
a window with at least ``status.min_samples`` streams (TTFT), inter-token gaps (ITL) or
requests (errors), the sample the page judges a window on
(:mod:`gateway.traffic.status_verdict`): at lower traffic the page says "too few to judge"
and the alert stays quiet, rather than a P99 of three streams paging someone. The
error-ratio alert counts every error type but the client's own doing
(:data:`~gateway.core.vocab.CLIENT_CAUSED`: its key's rate limit, its hang-ups), the same
failures the page's answered share counts: ``no_backend`` (every breaker open, nothing
routable), a backend's own 429 (``upstream_rate_limited``), admission's shedding included.
The page says at once what the alert says after its ``for`` hold.

Each :class:`Alert` keeps its ``signal`` (the expression before its threshold) beside the
rule's ``expr``: ``tests/ops/test_prometheus_dashboard.py`` evaluates both through a real
Prometheus, and the signal must have data where the test load makes some (``under_load``).
The rules' unit tests (each alert firing and not firing) are
``deploy/prometheus/alerts_test.yaml``, run by ``promtool test rules`` in ``.ci/run``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import yaml

from gateway.core.vocab import CLIENT_CAUSED
from gateway.ops.limits import Limits

WINDOW = "5m"
"""The rate window of the breaker-storm alert (five 1-minute evaluations at least); the
latency and error alerts use the status page's "now" window (:func:`duration` of
``Limits.now_s``, 5m by default)."""
NOT_SERVER_ERRORS = "|".join(sorted(CLIENT_CAUSED))
"""Error types that are the client's doing (it hung up, or went over its key's rate
limit: ``client_disconnect|rate_limited``): counted on the dashboard, left out of the
error-ratio alert and of the status page's failures."""


@dataclass(frozen=True)
class Alert:
    """One alerting rule: ``name``, the measured ``signal`` (PromQL), the rule's ``expr``
    (the signal against its threshold), how long it must hold (``for_``, a Prometheus
    duration; "" for at once), ``severity`` (``page``: users feel it now; ``ticket``:
    capacity or hardware going bad), a one-line ``summary`` (label templates) and
    ``runbook`` (what to look at, what to do), and ``under_load`` (module docstring)."""

    name: str
    signal: str
    expr: str
    for_: str
    severity: str
    summary: str
    runbook: str
    under_load: bool = True


def duration(seconds: float) -> str:
    """Seconds as a Prometheus duration: ``5m``, ``90s``, ``1500ms``."""
    ms = round(seconds * 1000)
    if ms % 60_000 == 0:
        return f"{ms // 60_000}m"
    return f"{ms // 1000}s" if ms % 1000 == 0 else f"{ms}ms"


def _p99(metric: str, window: str) -> str:
    return (f"histogram_quantile(0.99, sum by (model, le) "
            f"(rate({metric}_bucket[{window}])))")


def _enough(metric: str, window: str, minimum: int) -> str:
    """``and`` clause: the model had at least ``minimum`` samples of ``metric`` (a
    counter, or a histogram's ``_count``) in the window."""
    return f"and on (model) sum by (model) (increase({metric}[{window}])) >= {minimum}"


def _num(x: float) -> str:
    """A threshold as PromQL and people write it (2, not 2.0)."""
    return f"{x:g}"


def alerts(lim: Limits) -> list[Alert]:
    """Every alert rule for these limits."""
    win, least = duration(lim.now_s), lim.min_samples
    ttft, itl = _p99("gateway_ttft_seconds", win), _p99("gateway_itl_seconds", win)
    errors = (f"sum by (model, error_type) (rate(gateway_request_errors_total"
              f"{{error_type!~\"{NOT_SERVER_ERRORS}\"}}[{win}])) / on (model) group_left "
              f"sum by (model) (rate(gateway_requests_total[{win}]))")
    enough_ttft = _enough("gateway_ttft_seconds_count", win, least)
    enough_itl = _enough("gateway_itl_seconds_count", win, least)
    enough_requests = _enough("gateway_requests_total", win, least)
    warm = 'min by (model) (gateway_model_backends{state="warm"})'
    tripped = (f"count(sum by (backend) (increase(gateway_breaker_trips_total[{WINDOW}])) "
               "> 0)")
    storm = f"{tripped} / count(count by (backend) (gateway_backend_state))"
    temp = "max by (backend) (gateway_gpu_temperature_celsius)"
    power = ("max by (domain) (gateway_power_domain_watts) / max by (domain) "
             "(gateway_power_domain_budget_watts)")
    calib = "min by (backend) (gateway_calibration_score_ratio)"
    fallback = "max by (instance) (gateway_coordination_fallback)"
    return [
        Alert("GatewayTTFTP99OverSLO", ttft, f"{ttft} > {_num(lim.ttft_s)} {enough_ttft}",
              "5m", "page",
              f"P99 time to first token of {{{{ $labels.model }}}} is "
              f"{{{{ $value | humanizeDuration }}}} (SLO {_num(lim.ttft_s)}s) for 5m",
              "Dashboard 'Traffic and SLOs': TTFT P99 by backend - one backend slow: drain "
              "it (POST /admin/backends/{id}/drain); all slow: queue depth, KV-cache use and "
              "admission rejections say the fleet is short of capacity: add replicas."),
        Alert("GatewayITLP99OverSLO", itl, f"{itl} > {_num(lim.itl_s)} {enough_itl}", "5m",
              "page",
              f"P99 inter-token latency of {{{{ $labels.model }}}} is "
              f"{{{{ $value | humanizeDuration }}}} (SLO {_num(lim.itl_s)}s) for 5m",
              "Dashboard: ITL P99 by backend and KV-cache use - batches too large on busy "
              "backends (lower max_num_seqs, add replicas), or one backend's GPUs hot or "
              "throttled (thermal row): drain it."),
        Alert("GatewayErrorRatioHigh", errors, f"{errors} > 0.05 {enough_requests}", "5m",
              "page",
              "{{ $labels.error_type }} errors are {{ $value | humanizePercentage }} of "
              "{{ $labels.model }} requests for 5m",
              "Dashboard: errors by type and upstream attempts by outcome; upstream_5xx / "
              "connect / timeout: the backends (GET /admin/backends, their logs); "
              "no_backend: none can take the model (breakers open, none warm: /status); "
              "upstream_rate_limited: the backends' own 429s, short of capacity; "
              "admission_refused: capacity or power budget; cut / in_band_error: "
              "backend crashes mid-stream."),
        Alert("GatewayNoWarmBackend", warm, f"{warm} == 0", "1m", "page",
              "No backend can serve {{ $labels.model }}: none warm, or every warm one's "
              "circuit breaker open (its requests fail at once: no_backend)",
              "GET /status and /admin/backends: why each backend of the model is not "
              "routable (cold, unhealthy, draining, cooldown, or breaker_open: its "
              "requests failed; its logs, GET /admin/backends/{id}); undrain one, fix or "
              "restart the unhealthy, or scale the model up."),
        Alert("GatewayBreakerStorm", storm,
              f"{storm} >= 0.25 and {tripped} >= 2", "", "page",
              "Circuit breakers tripped on {{ $value | humanizePercentage }} of the "
              "backends within 5m",
              "Many backends failing at once is rarely the backends: a bad release or "
              "config rollout (GET /admin/rollouts, /admin/config/history), the network, "
              "or an overload; trips by reason on the dashboard.",
              under_load=False),
        Alert("GatewayGpuHot", temp, f"{temp} >= {_num(lim.hot_c)}", "5m", "ticket",
              "Hottest GPU of {{ $labels.backend }} at {{ $value }} °C "
              f"(thermal.hot_c {_num(lim.hot_c)}) for 5m",
              "A cooldown did not cool it: check the host's cooling (fans, inlet "
              "temperature, the rack's other GPUs); drain the backend and keep it out "
              "(POST /admin/backends/{id}/drain) until it reads cool."),
        Alert("GatewayPowerDomainOverBudget", power, f"{power} > 1", "2m", "ticket",
              "Power domain {{ $labels.domain }} draws {{ $value | humanizePercentage }} "
              "of its budget for 2m",
              "Dashboard 'Thermal and power': admission sheds in the domain; move load or "
              "backends to other domains, or raise power_domains[].budget_w if the PDU "
              "allows it."),
        Alert("GatewayCalibrationDrift", calib, f"{calib} < {_num(lim.calibration_threshold)}",
              "", "ticket",
              "Calibration of {{ $labels.backend }} scored {{ $value }} "
              f"(threshold {_num(lim.calibration_threshold)}): its answers drifted",
              "The backend was made unhealthy and its restart hook ran; if it comes back "
              "drifted: compare its vLLM version / model files with its peers "
              "(GET /admin/backends/{id}), then replace it.",
              under_load=False),
        Alert("GatewayCoordinationFallback", fallback, f"{fallback} == 1", "1m", "page",
              "Gateway replica {{ $labels.instance }} runs on its local share: the shared "
              "store does not answer",
              "Redis (coordination.redis_url) is down or unreachable: rate limits are "
              "split locally, no maintenance lease, admin writes answer 503 - restore "
              "Redis; GET /admin/fleet shows the store's state."),
    ]


def build_rules(lim: Limits) -> dict[str, Any]:
    """The rule file (``groups``) as a dict, for ``yaml.safe_dump``."""
    rules = []
    for a in alerts(lim):
        rule: dict[str, Any] = {"alert": a.name, "expr": a.expr}
        if a.for_:
            rule["for"] = a.for_
        rule["labels"] = {"severity": a.severity}
        rule["annotations"] = {"summary": a.summary, "runbook": a.runbook}
        rules.append(rule)
    return {"groups": [{"name": "llm-gateway", "rules": rules}]}


HEADER = """\
# Prometheus alert rules of llm-gateway (issue 19). Generated by `python -m gateway.ops`
# (gateway/ops/alerts.py) from {source}: slo.ttft_s {ttft} s,
# slo.itl_s {itl} s, thermal.hot_c {hot} C, calibration.threshold {calib}; the latency and
# error alerts judge the status page's window, status.now_s {now_s} s, on at least
# status.min_samples {least} streams / gaps / requests, as the page does. Rules cannot
# read the gateway's config: for a fleet's own values run
#   python -m gateway.ops --config config/gateway.yaml --out-dir deploy
# Unit tests: deploy/prometheus/alerts_test.yaml (promtool test rules).
"""


def render_rules(lim: Limits, source: str = "the config schema's defaults") -> str:
    """The rule file's text: a header saying where its thresholds come from (``source``),
    then the YAML."""
    head = HEADER.format(source=source, ttft=_num(lim.ttft_s), itl=_num(lim.itl_s),
                         hot=_num(lim.hot_c), calib=_num(lim.calibration_threshold),
                         now_s=_num(lim.now_s), least=lim.min_samples)
    body = yaml.safe_dump(build_rules(lim), sort_keys=False, width=10_000,
                          allow_unicode=True)
    return head + body
