"""The status page and the error classes in outages and at low traffic, through real HTTP
(a gateway under uvicorn over simulated vLLM servers):

* every backend's circuit breaker open: ``/status.json`` and ``/status`` say "major
  outage" (no backend can serve the model), ``gateway_model_backends`` counts them as
  ``breaker_open`` (none ``warm``), and the gateway's fast-fail answers are counted as
  ``no_backend``, not ``rate_limited`` (which only a client key's own limit is);
* a third of the requests failing: the answered share makes it an outage;
* three streams in the "now" window: their P99 is shown with the count and the minimum
  needed to judge it, never "no data".
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx

from gateway.config import FaultConfig
from tests.lifecycle.support import Sim, chat_body, metric, metric_samples
from tests.support.scripted import wait_for
from tests.support.servers import GatewayThread

MAIN, TIGHT = "sk-main", "sk-tight"


def status(url: str) -> dict[str, Any]:
    return httpx.get(url + "/status.json", timeout=5).json()  # type: ignore[no-any-return]


def post(client: httpx.Client, url: str, key: str | None = None, **kw: Any) -> httpx.Response:
    headers = {"authorization": f"Bearer {key}"} if key else {}
    return client.post(url + "/v1/chat/completions", json=chat_body(4, **kw),
                       headers=headers, timeout=10)


def errors(url: str, model: str = "m1") -> dict[str, float]:
    return {dict(lbl)["error_type"]: v for (name, lbl), v in metric_samples(url).items()
            if name == "gateway_request_errors_total" and dict(lbl)["model"] == model}


def test_breakers_open_on_every_backend_is_a_major_outage_counted_as_no_backend(
        sims: Callable[..., Sim], lc_gateway: Callable[..., GatewayThread]) -> None:
    a = sims("a", itl_s=0.001, faults=FaultConfig(error_rate=1.0))
    b = sims("b", itl_s=0.001, faults=FaultConfig(error_rate=1.0))
    gw = lc_gateway(
        {"a": a.url, "b": b.url},
        status={"tick_s": 0.1},
        breaker={"open_base_s": 60, "open_max_s": 120},  # open for the whole test
        auth={"client_keys": [{"name": "main", "key": MAIN},
                              {"name": "tight", "key": TIGHT, "rpm": 1}]},
    )
    url = gw.url
    with httpx.Client() as client:
        for _ in range(30):  # 500s until both breakers open (5 failures in a row each)
            if status(url)["models"][0]["availability"]["routable_backends"] == 0:
                break
            post(client, url, MAIN)
        for _ in range(5):  # the gateway's own fast-fail answers, no backend asked
            assert post(client, url, MAIN).status_code in (429, 503)

        def said() -> bool:
            m = status(url)["models"][0]
            return m["availability"]["requests_now"] >= 5 and m["status"] == "major outage"

        assert wait_for(said, 10), status(url)
        view = status(url)
        model = view["models"][0]
        assert view["status"] == "major outage"
        assert model["availability"]["routable_backends"] == 0
        assert model["availability"]["backends"] == 2
        assert any("circuit breaker open" in r for r in model["reasons"]), model["reasons"]
        assert view["backend_states"] == {"breaker_open": 2}
        assert model["availability"]["answered_share_now"] < 0.5
        page = httpx.get(url + "/status", timeout=5).text
        assert 'id="overall" class="words major-outage">major outage<' in page

        s = metric_samples(url)
        assert metric(s, "gateway_model_backends", model="m1", state="breaker_open") == 2
        assert metric(s, "gateway_model_backends", model="m1", state="warm") == 0
        seen = errors(url)
        assert seen.get("no_backend", 0) >= 5, seen
        assert "rate_limited" not in seen, seen

        # only a client key's own limit is rate_limited: the tight key's first request
        # gets the fast-fail (no_backend), its second its own limit's 429
        before = errors(url).get("no_backend", 0)
        post(client, url, TIGHT)
        refused = post(client, url, TIGHT)
        assert refused.status_code == 429 and "x-ratelimit-limit-requests" in refused.headers
        seen = errors(url)
        assert seen.get("rate_limited") == 1 and seen["no_backend"] == before + 1, seen


def test_a_third_of_requests_failing_is_an_outage_by_the_answered_share(
        sims: Callable[..., Sim], lc_gateway: Callable[..., GatewayThread]) -> None:
    a = sims("a", itl_s=0.001, faults=FaultConfig(error_rate=0.35, seed=5))
    gw = lc_gateway(
        {"a": a.url},
        status={"tick_s": 0.1},
        # the breaker never trips: the backend stays routable, only its answers fail
        breaker={"consecutive_failures": 1000, "error_rate": 1.0, "min_requests": 1000},
    )
    url = gw.url
    with httpx.Client() as client:
        codes = [post(client, url).status_code for _ in range(40)]
    assert 5 < codes.count(500) < 30 and codes.count(200) + codes.count(500) == 40, codes

    def counted() -> bool:
        return status(url)["models"][0]["availability"]["requests_now"] == 40

    assert wait_for(counted, 10), status(url)
    model = status(url)["models"][0]
    share = model["availability"]["answered_share_now"]
    assert share == codes.count(200) / 40
    assert model["availability"]["routable_backends"] == 1
    assert model["status"] == "major outage", model  # under 90 % answered
    assert any("answered" in r for r in model["reasons"]), model["reasons"]
    assert model["last_hour"]["status"] == "major outage", model


def test_low_traffic_says_too_few_streams_with_the_count_and_keeps_the_figures(
        sims: Callable[..., Sim], lc_gateway: Callable[..., GatewayThread]) -> None:
    a = sims("a", itl_s=0.001)
    gw = lc_gateway({"a": a.url}, status={"tick_s": 0.1, "min_samples": 20})
    url = gw.url
    with httpx.Client() as client:
        for _ in range(3):
            assert post(client, url, stream=True).status_code == 200

    def counted() -> bool:
        return status(url)["models"][0]["performance"]["streams_hour"] == 3

    assert wait_for(counted, 10), status(url)
    view = status(url)
    model, perf = view["models"][0], view["models"][0]["performance"]
    assert model["status"] == "operational"
    assert perf["streams_now"] == 3 and view["min_samples"] == 20
    assert perf["ttft_p99_now_s"] is not None and perf["ttft_p99_hour_s"] is not None
    assert "P99 TTFT in the last 5 min: 3 streams: too few to judge (20 needed)" \
        in model["notes"], model["notes"]
    page = httpx.get(url + "/status", timeout=5).text
    assert "no data" not in page
    assert "3 streams: too few to judge (20 needed)" in page, page
