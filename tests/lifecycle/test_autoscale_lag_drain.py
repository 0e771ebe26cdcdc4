"""``gateway_autoscale_lag_seconds`` measures scale-up lag (the decision that asked for a
replica -> one more replica ready), not maintenance: the real gateway under uvicorn with
two simulated vLLM servers, one drained through ``POST /admin/backends/{id}/drain`` and
returned through ``/undrain`` while the desired count stands at two.

Before this was fixed the drain itself "asked" (desired 2, ready 1) and the return
"completed" the ask, so every drain, maintenance cycle or crash-and-return was observed as
a scale-up lag of its own duration, though nothing had been asked of the orchestrator.
A real rise of the desired count still opens an ask (``tests/lifecycle/test_autoscale.py``,
``tests/discovery/test_dns_cold_start.py``)."""

from __future__ import annotations

import time
from typing import Any

import httpx

from tests.lifecycle.support import MODEL, Sim, metric, metric_samples, wait_for
from tests.support.servers import GatewayThread, gateway_config


def answer(gw: GatewayThread) -> dict[str, Any]:
    r = httpx.get(gw.url + "/autoscale", params={"model": MODEL}, timeout=5)
    assert r.status_code == 200, r.text
    return r.json()  # type: ignore[no-any-return]


def test_a_drain_and_return_is_no_scale_up_lag() -> None:
    sims = [Sim("a", 0.01), Sim("b", 0.01)]
    cfg = gateway_config(
        [{"id": s.name, "url": s.url} for s in sims],
        forecast={"enabled": False},
        # the two replicas that exist at start count as the desired count for the cooldown
        autoscale={"interval_s": 0.2, "scale_down_cooldown_s": 120},
    )
    gw = GatewayThread(cfg)
    gw.start()
    try:
        assert wait_for(lambda: answer(gw)["ready_replicas"] == 2, 15), answer(gw)
        assert answer(gw)["desired_replicas"] == 2
        r = httpx.post(gw.url + "/admin/backends/a/drain", json={"deadline_s": 1}, timeout=5)
        assert r.status_code in (200, 202), r.text
        assert wait_for(lambda: answer(gw)["ready_replicas"] == 1, 15), answer(gw)
        assert answer(gw)["desired_replicas"] == 2  # the drained one is not counted, as said
        time.sleep(1.0)  # a few decisions (every 0.2 s) with one replica out
        r = httpx.post(gw.url + "/admin/backends/a/undrain", timeout=5)
        assert r.status_code in (200, 202), r.text
        assert wait_for(lambda: answer(gw)["ready_replicas"] == 2, 20), answer(gw)
        time.sleep(0.5)  # decisions after its return
        samples = metric_samples(gw.url)
        lags = metric(samples, "gateway_autoscale_lag_seconds_count", model=MODEL)
        assert not lags, f"a drain and return observed as {lags} scale-up lag(s)"
    finally:
        gw.stop()
        for s in sims:
            s.stop()
