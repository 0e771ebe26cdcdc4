"""Cost per million tokens in fleet mode (issue 19, finding 4): two gateway replicas on one
real Redis over two simulated backends of one model, one with a ``gpu_hour_price`` and
one without. Each replica exports the priced backend's cost (the same counter on both)
and counts the tokens each backend generated for its own clients, so the dashboard's
ratio (``max by`` the cost, ``sum`` the tokens of priced backends) is the fleet's; the
unpriced backend's tokens are exported under its own id, never mixed into the ratio,
and no replica exports a per-replica ratio that would be N times too high."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.lifecycle.support import Sim, sdk, sdk_kwargs
from tests.support.servers import GatewayThread, gateway_config

PRICE = 36.0  # per GPU-hour: 0.01 a second


def _metrics(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = httpx.get(url + "/metrics", timeout=5).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def test_replicas_export_cost_and_tokens_that_add_up_to_the_fleets_ratio(
        redis_server: Any, sims: Callable[..., Sim]) -> None:
    priced, free = sims("priced"), sims("free")
    replicas = []
    try:
        for i in (1, 2):
            cfg = gateway_config(
                [{"id": "priced", "url": priced.url, "models": ["m1"],
                  "gpu_hour_price": PRICE, "gpus": 1},
                 {"id": "free", "url": free.url, "models": ["m1"]}],
                coordination={"redis_url": redis_server.url, "replica_id": f"r{i}",
                              "sync_interval_s": 0.1})
            gw = GatewayThread(cfg)
            replicas.append(gw)
            gw.start(wait_ready=False)
        for gw in replicas:
            gw.wait_ready(timeout=30, routable=2)
        by_fingerprint = {priced.fingerprint: "priced", free.fingerprint: "free"}
        generated: Counter[str] = Counter()  # completion tokens the clients got, by backend
        for gw in replicas:
            client = sdk(gw.url)
            for _ in range(4):
                r = client.chat.completions.create(**sdk_kwargs(max_tokens=8))
                assert r.usage is not None
                generated[by_fingerprint[r.system_fingerprint or ""]] += (
                    r.usage.completion_tokens)
        assert generated["priced"] > 0 and generated["free"] > 0, generated
        scraped = [_metrics(gw.url) for gw in replicas]
    finally:
        for gw in replicas:
            gw.stop()

    def tokens(m: dict[Any, float], backend: str) -> float:
        return m.get(("gateway_backend_generated_tokens_total",
                      (("backend", backend), ("model", "m1"))), 0.0)

    # the tokens: per replica, each under the backend that generated them; summed over
    # the replicas, what the clients got from each backend
    for backend in ("priced", "free"):
        assert sum(tokens(m, backend) for m in scraped) == generated[backend], backend
    # the cost: the priced backend's, on every replica (a fact about the backend), split
    # to its one model; none for the backend without a price
    for m in scraped:
        cost = m.get(("gateway_backend_cost_total", (("backend", "priced"),)))
        assert cost is not None and 0 < cost < PRICE  # under an hour
        by_model = m.get(("gateway_model_cost_total", (("backend", "priced"), ("model", "m1"))))
        assert by_model is not None and 0 < by_model <= cost
        assert ("gateway_backend_cost_total", (("backend", "free"),)) not in m
        # no replica's own ratio of the fleet's cost over its share of the tokens
        assert not any(k[0] == "gateway_cost_per_million_tokens" for k in m)
