"""A dead backend on the operators' screens (issue 19, finding 8): a gateway over two
simulated backends, the first of which is killed. Its values scraped from vLLM's
``/metrics`` (prefix-cache hit ratio, KV-cache use, queue) leave ``/metrics`` once older
than ``telemetry.stale_after_s`` instead of standing at their last value forever, while
the live backend's stay; and ``/status.json`` names no "next cooldown" on it (the
maintenance loop starts cycles only on warm backends)."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.lifecycle.support import Sim, chat_body
from tests.support.scripted import wait_for
from tests.support.servers import GatewayThread, gateway_config

SCRAPED = ("gateway_backend_prefix_cache_hit_ratio", "gateway_backend_kv_cache_usage_ratio",
           "gateway_backend_waiting", "gateway_backend_running")


def _per_backend(url: str) -> dict[str, set[str]]:
    """Metric name -> the backends it has a sample for."""
    text = httpx.get(url + "/metrics", timeout=5).text
    out: dict[str, set[str]] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if "backend" in s.labels:
                out.setdefault(s.name, set()).add(s.labels["backend"])
    return out


def test_a_dead_backend_s_scraped_gauges_go_and_it_has_no_next_cooldown() -> None:
    dead, live = Sim("dead"), Sim("live")
    # backend 0 ("dead") has the first medium cycle due: what the status page would name
    cfg = gateway_config(
        [{"id": "dead", "url": dead.url}, {"id": "live", "url": live.url}],
        telemetry={"scrape_interval_s": 0.1, "stale_after_s": 0.5},
        health={"interval_s": 0.1},
        lifecycle={"medium": {"every_s": 3600, "every_requests": 0}},
    )
    gw = GatewayThread(cfg)
    try:
        gw.start(wait_ready=False)
        gw.wait_ready(timeout=20, routable=2)
        status = httpx.get(gw.url + "/status.json", timeout=5).json()
        assert status["cooldowns"]["next"]["backend"] == "dead"  # while it is warm

        def both_have_a_prefix_ratio() -> bool:  # queries on each between two scrapes
            for _ in range(2):
                httpx.post(gw.url + "/v1/chat/completions", json=chat_body(), timeout=10)
            got = _per_backend(gw.url).get(SCRAPED[0], set())
            return got == {"dead", "live"}

        assert wait_for(both_have_a_prefix_ratio, timeout=15, interval=0.1)
        dead.kill()

        def unhealthy() -> bool:
            view = httpx.get(gw.url + "/status.json", timeout=5).json()
            return any(b["id"] == "dead" and b["state"] == "unhealthy"
                       for b in view["backends"])

        assert wait_for(unhealthy, timeout=15, interval=0.1)

        def stale_values_gone() -> bool:
            got = _per_backend(gw.url)
            return all("dead" not in got.get(name, set()) for name in SCRAPED)

        assert wait_for(stale_values_gone, timeout=5, interval=0.1), _per_backend(gw.url)
        got = _per_backend(gw.url)
        assert all("live" in got.get(name, set()) for name in SCRAPED), got
        assert "dead" in got["gateway_backend_scrape_age_seconds"]  # how old they are
        status = httpx.get(gw.url + "/status.json", timeout=5).json()
        nxt = status["cooldowns"]["next"]
        assert nxt is not None and nxt["backend"] == "live", nxt
    finally:
        gw.stop()
        dead.stop()
        live.stop()
