"""Issue 19's must-hold: a real Prometheus scrapes a gateway over simulated backends under
load, and every dashboard panel query (taken from deploy/grafana/llm-gateway.json, Grafana's
variables substituted) and every alert expression (deploy/prometheus/alerts.yaml, loaded as
rules) is evaluated through Prometheus's HTTP API: each returns without error, and with
data where the load makes some (the generator's ``under_load`` marks: the panels about
events this load does not cause, hot GPUs or breaker trips, need only run). The rules must
have loaded and evaluated with health ``ok``.

The load: chat streams and non-streams of model m1 on two simulated backends (one
without a ``gpu_hour_price``) with GPU
telemetry (``/gpu/metrics``) in one power domain, through the batcher; model m2 on a
backend that answers half its requests with a 500 (upstream 5xx errors); a client key
limited to 2 requests a minute sending 4 (admission refusals); a stream the client closes
after its first event (a client disconnect). Prometheus scrapes every second."""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway.config import FaultConfig
from gateway.ops.alerts import alerts
from gateway.ops.dashboard import queries
from gateway.ops.limits import Limits
from gateway.sim import EngineParams, SimConfig, SimServerThread
from tests.support.prometheus import Prometheus, prometheus_binary
from tests.support.scripted import wait_for
from tests.support.servers import GatewayThread, gateway_config

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
ENGINE = EngineParams(prefill_base_s=0.01, prefill_per_token_s=0.0, itl_base_s=0.004,
                      itl_per_seq_s=0.0, max_num_seqs=32)
GRAFANA_VARS = {"$__rate_interval": "1m", "$model": ".*"}
"""What Grafana would put for its variables: the rate window (1 m: at least four of the
test's 1-s scrapes) and the ``model`` variable's All value."""
PROMPT = [{"role": "user", "content": "Tell me about the lighthouse keeper's long night."}]


def substitute(expr: str) -> str:
    """``expr`` with Grafana's variables replaced; fails on any left over."""
    for var, value in GRAFANA_VARS.items():
        expr = expr.replace(var, value)
    assert "$" not in expr, f"unsubstituted Grafana variable in {expr}"
    return expr


@pytest.fixture
def servers() -> Iterator[list[SimServerThread]]:
    made: list[SimServerThread] = []
    yield made
    for s in made:
        s.stop()


def _sim(made: list[SimServerThread], name: str, model: str, **cfg: Any) -> str:
    t = SimServerThread(SimConfig(model=model, engine_label=name, engine=ENGINE, **cfg))
    url = t.start()
    made.append(t)
    return url


def _backend(bid: str, url: str, model: str) -> dict[str, Any]:
    b: dict[str, Any] = {"id": bid, "url": url, "models": [model],
                         "gpu_metrics_url": url + "/gpu/metrics", "power_domain": "rack1"}
    if bid != "b2":  # cost (issue 19's signals); b2 has no price: the unpriced tokens
        b["gpu_hour_price"] = 2.5
    return b


def _load(url: str) -> None:
    """The test load (module docstring); every failure but the expected ones raises."""
    main = openai.OpenAI(base_url=url + "/v1", api_key="k-main", max_retries=0, timeout=30)
    errors: list[BaseException] = []

    def m1(i: int) -> None:
        try:
            for n in range(6):
                if (i + n) % 2:
                    stream = main.chat.completions.create(
                        model="m1", messages=PROMPT, max_tokens=12, temperature=0,
                        stream=True, extra_body={"ignore_eos": True})
                    assert any(c.choices and c.choices[0].delta.content for c in stream)
                else:
                    r = main.chat.completions.create(
                        model="m1", messages=PROMPT, max_tokens=12, temperature=0,
                        extra_body={"ignore_eos": True})
                    assert r.choices[0].message.content
        except BaseException as e:  # reported in the main thread
            errors.append(e)

    threads = [threading.Thread(target=m1, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    failed = 0
    for _ in range(8):  # m2's backend answers half with a 500
        try:
            main.chat.completions.create(model="m2", messages=PROMPT, max_tokens=4)
        except openai.APIStatusError:
            failed += 1
    tight = openai.OpenAI(base_url=url + "/v1", api_key="k-tight", max_retries=0, timeout=30)
    refused = 0
    for _ in range(4):  # 2 requests a minute
        try:
            tight.chat.completions.create(model="m1", messages=PROMPT, max_tokens=4)
        except openai.RateLimitError:
            refused += 1
    stream = main.chat.completions.create(
        model="m1", messages=PROMPT, max_tokens=400, stream=True,
        extra_body={"ignore_eos": True})
    next(iter(stream))
    stream.close()  # the client hangs up mid-stream
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert failed > 0 and refused >= 2, (failed, refused)


def _gateway_requests(url: str) -> float:
    text = httpx.get(url + "/metrics", timeout=5).text
    return sum(s.value for f in text_string_to_metric_families(text)
               if f.name == "gateway_requests" for s in f.samples
               if s.name == "gateway_requests_total")


def test_every_panel_query_and_alert_expression_through_prometheus(
        servers: list[SimServerThread], tmp_path: Path) -> None:
    prometheus_binary()  # skip (fail under CI) before starting anything
    urls = {bid: _sim(servers, bid, "m1") for bid in ("b1", "b2")}
    urls["b3"] = _sim(servers, "b3", "m2", faults=FaultConfig(error_rate=0.5, seed=3))
    cfg = gateway_config(
        [_backend(b, u, "m2" if b == "b3" else "m1") for b, u in urls.items()],
        thermal={"scrape_interval_s": 0.2, "stale_after_s": 5.0},
        power_domains=[{"name": "rack1", "budget_w": 3000}],
        batcher={"enabled": True},
        auth={"client_keys": [{"name": "main", "key": "k-main"},
                              {"name": "tight", "key": "k-tight", "rpm": 2}]},
    )
    gw = GatewayThread(cfg)
    gw.start(wait_ready=False)
    prom: Prometheus | None = None
    try:
        gw.wait_ready(timeout=20, routable=3)
        prom = Prometheus(tmp_path, [gw.url.removeprefix("http://")],
                          [DEPLOY / "prometheus" / "alerts.yaml"])
        prom.wait_ready()
        _load(gw.url)
        # every request the gateway counted has been scraped, then one more scrape
        answered = _gateway_requests(gw.url)
        scraped = "sum(gateway_requests_total)"
        assert wait_for(lambda: (prom.value(scraped) or 0) >= answered, timeout=15)
        when = "max(timestamp(gateway_requests_total))"
        last = prom.value(when) or 0
        assert wait_for(lambda: (prom.value(when) or 0) > last, timeout=10)

        problems: list[str] = []

        def check(what: str, expr: str, needs_data: bool) -> None:
            answer = prom.query(expr)
            if answer.get("status") != "success":
                problems.append(f"{what}: {answer.get('error')} in {expr}")
            elif needs_data and not answer["data"]["result"]:
                problems.append(f"{what}: no data in {expr}")

        board = json.loads((DEPLOY / "grafana" / "llm-gateway.json").read_text())
        marks = {(q.panel, q.ref_id): q.under_load for q in queries(Limits.defaults())}
        evaluated = 0
        for panel in board["panels"]:
            for t in panel.get("targets", []):
                key = (panel["title"], t["refId"])
                check(f"panel {key}", substitute(t["expr"]), marks[key])
                evaluated += 1
        assert evaluated == len(marks)

        rule_file = (DEPLOY / "prometheus" / "alerts.yaml").read_text()
        for a in alerts(Limits.defaults()):
            assert a.expr in rule_file
            check(f"alert {a.name}", a.expr, needs_data=False)
            check(f"alert {a.name} signal", a.signal, a.under_load)

        # the rules loaded and evaluated without error
        def evaluated_all() -> bool:
            rules = prom.rules()
            return len(rules) == len(alerts(Limits.defaults())) and all(
                r["health"] != "unknown" for r in rules)

        assert wait_for(evaluated_all, timeout=10), prom.rules()
        for r in prom.rules():
            if r["health"] != "ok":
                problems.append(f"rule {r['name']}: health {r['health']} {r.get('lastError')}")
        # the load's own facts, seen through Prometheus
        assert (prom.value('sum(gateway_admission_rejections_total{layer="entry"})') or 0) >= 2
        assert re.search(r"rack1", json.dumps(prom.query("gateway_power_domain_watts")))
        assert not problems, "\n".join(problems)
    finally:
        if prom is not None:
            prom.stop()
        gw.stop()
