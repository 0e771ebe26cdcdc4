"""The gateway against the simulator's own GPUs (``GET /gpu/metrics``: an RC thermal model
behind dcgm-exporter's names) instead of a stand-in exporter: what ``llm-gateway demo``
shows, and how an operator would rehearse a thermal event or an Xid burst."""

from __future__ import annotations

from collections.abc import Callable

import httpx

from tests.lifecycle.support import Sim, admin, history, metric, metric_samples, wait_state
from tests.support.scripted import wait_for
from tests.support.servers import GatewayThread

# A GPU that starts at 110 °C and cools with a 10 s time constant (R_th 0.0125 K/W x the
# H100 model's 800 J/K): it reads hot for about 3.5 s and falls below 70 °C after about 6.5 s.
HOT_START = {"count": 2, "temp_c": 110.0, "r_th_k_per_w": 0.0125, "tick_s": 0.1}


def sim_backend(bid: str, sim: Sim) -> dict[str, str]:
    return {"id": bid, "url": sim.url, "gpu_metrics_url": f"{sim.url}/gpu/metrics"}


def test_simulated_gpu_that_runs_hot_rests_until_it_cools_below_resume(
    sims: Callable[..., Sim], th_gateway: Callable[..., GatewayThread]
) -> None:
    a, b = sims("a", gpu=HOT_START), sims("b")
    gw = th_gateway([sim_backend("a", a), sim_backend("b", b)], wait_routable=1)
    assert wait_for(lambda: ("warm", "draining", "cooldown_thermal") in history(gw.url, "a"),
                    timeout=10)
    assert admin(gw.url, "b")["gpu"]["tier"] == "cool"  # the idle simulated GPU, ~30 °C
    wait_state(gw.url, "a", "warm", timeout=30)
    shown = admin(gw.url, "a")["gpu"]
    assert shown["tier"] == "cool" and shown["temperature_c"] < 70 and shown["gpus"] == 2
    m = metric_samples(gw.url)
    assert metric(m, "gateway_thermal_cooldowns_total", backend="a") == 1.0
    assert (metric(m, "gateway_gpu_power_watts", backend="b") or 0) > 0


def test_xid_errors_injected_in_the_simulator_trip_the_gpu_breaker(
    sims: Callable[..., Sim], th_gateway: Callable[..., GatewayThread]
) -> None:
    a, b = sims("a", gpu={"tick_s": 0.1}), sims("b")
    gw = th_gateway([sim_backend("a", a), sim_backend("b", b)])
    for n, code in enumerate((79, 48, 13), start=1):  # distinct codes: DCGM shows the last
        r = httpx.patch(f"{a.url}/sim/faults", json={"xid_errors": n, "xid_code": code})
        assert r.status_code == 200
        seen = lambda n=n: (  # noqa: E731
            admin(gw.url, "a")["gpu"]["recent_xid_errors"] >= n
            or admin(gw.url, "a")["state"] == "unhealthy"
        )
        assert wait_for(seen, timeout=10)
    wait_state(gw.url, "a", "unhealthy", timeout=10)
    assert ("warm", "unhealthy", "gpu_xid") in history(gw.url, "a")
