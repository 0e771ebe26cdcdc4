"""Thermal- and power-aware routing end to end: the real gateway under uvicorn, simulated
vLLM backends, DCGM exporter stand-ins serving the GPU readings each test sets, and the
``openai`` SDK as the client."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import httpx
import openai
import pytest

from tests.lifecycle.support import (
    Sim,
    admin,
    history,
    metric,
    metric_samples,
    sdk,
    sdk_kwargs,
    wait_state,
)
from tests.support.scripted import wait_for
from tests.support.servers import GatewayThread
from tests.thermal.support import DcgmStub


def backend(bid: str, sim: Sim, exporter: DcgmStub | None = None, **extra: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"id": bid, "url": sim.url, **extra}
    if exporter is not None:
        out["gpu_metrics_url"] = exporter.url
    return out


def send(gw: GatewayThread, n: int, **headers: str) -> None:
    client = sdk(gw.url)
    for _ in range(n):
        client.chat.completions.create(**sdk_kwargs(), extra_headers=headers or None)


def gpu(gw: GatewayThread, bid: str) -> dict[str, Any]:
    return admin(gw.url, bid)["gpu"]  # type: ignore[no-any-return]


def test_hot_backend_gets_no_requests_rests_until_cool_then_returns(
    sims: Callable[..., Sim],
    exporters: Callable[..., DcgmStub],
    th_gateway: Callable[..., GatewayThread],
) -> None:
    a, b = sims("a"), sims("b")
    ea, eb = exporters(gpus=2, temp_c=60.0), exporters(gpus=2, temp_c=55.0)
    gw = th_gateway([backend("a", a, ea), backend("b", b, eb)])
    assert gpu(gw, "a")["gpus"] == 2

    ea.gpus[1].temp_c = 90.0  # one GPU of the tensor-parallel pair overheats
    wait_state(gw.url, "a", "cooldown")
    assert ("warm", "draining", "cooldown_thermal") in history(gw.url, "a")
    shown = gpu(gw, "a")
    assert shown["tier"] == "hot" and shown["temperature_c"] == 90.0
    before = a.chat_requests()
    send(gw, 6)
    assert a.chat_requests() == before, "a hot backend got new requests"

    # Under the hot threshold but above the resume threshold: it keeps resting, although
    # the minimum rest (0.5 s) is long past.
    ea.gpus[1].temp_c = 72.0
    ea.wait_scraped(3)
    time.sleep(1.0)
    assert admin(gw.url, "a")["state"] == "cooldown"
    assert gpu(gw, "a")["tier"] == "hot"  # hysteresis: hot until below 70 °C

    ea.gpus[1].temp_c = 65.0
    wait_state(gw.url, "a", "warm")
    assert gpu(gw, "a")["tier"] == "cool"
    eb.set(temp_c=80.0)  # now b is the warm one: a, back in rotation, takes the requests
    assert wait_for(lambda: gpu(gw, "b")["tier"] == "warm", timeout=10)
    send(gw, 4)
    assert a.chat_requests() == before + 4
    m = metric_samples(gw.url)
    assert metric(m, "gateway_thermal_cooldowns_total", backend="a") == 1.0
    assert metric(m, "gateway_gpu_temperature_celsius", backend="a") == 65.0
    assert metric(m, "gateway_thermal_tier", backend="a", tier="cool") == 1.0
    assert metric(m, "gateway_thermal_cooldowns_total", backend="b") is None


def test_a_cooldown_that_cannot_cool_ends_at_the_cap_and_returns_as_warm(
    sims: Callable[..., Sim],
    exporters: Callable[..., DcgmStub],
    th_gateway: Callable[..., GatewayThread],
) -> None:
    a, b = sims("a"), sims("b")
    ea, eb = exporters(temp_c=60.0), exporters(temp_c=55.0)
    gw = th_gateway(
        [backend("a", a, ea), backend("b", b, eb)], thermal={"max_cooldown_s": 2.0}
    )
    ea.set(temp_c=90.0)
    wait_state(gw.url, "a", "cooldown")
    ea.set(temp_c=78.0)  # the cooling is poor: it never reaches 70 °C
    wait_state(gw.url, "a", "warm", timeout=15)
    # released by the cap: warm, avoided, not hot (the view is rebuilt at the next scrape)
    assert wait_for(lambda: gpu(gw, "a")["tier"] == "warm", timeout=10), gpu(gw, "a")
    ea.wait_scraped(5)
    assert admin(gw.url, "a")["state"] == "warm"  # and not sent straight back to rest
    m = metric_samples(gw.url)
    assert metric(m, "gateway_thermal_cooldowns_total", backend="a") == 1.0


def test_when_every_backend_is_hot_the_model_keeps_one(
    sims: Callable[..., Sim],
    exporters: Callable[..., DcgmStub],
    th_gateway: Callable[..., GatewayThread],
) -> None:
    """Staggering lets one of two backends rest; the other, hot too, keeps serving (the
    least-hot fallback) instead of the model answering 503."""
    a, b = sims("a"), sims("b")
    ea, eb = exporters(temp_c=88.0), exporters(temp_c=87.0)
    gw = th_gateway([backend("a", a, ea), backend("b", b, eb)], wait_routable=1)
    states = lambda: {x["state"] for x in admin(gw.url)}  # noqa: E731
    assert wait_for(lambda: states() == {"warm", "cooldown"}, timeout=10)
    resting = next(x["id"] for x in admin(gw.url) if x["state"] == "cooldown")
    serving = "b" if resting == "a" else "a"
    ea.wait_scraped(3)  # a few more readings of both: each a chance to rest the other
    eb.wait_scraped(3)
    assert admin(gw.url, serving)["state"] == "warm"  # never the last warm backend
    send(gw, 3)
    assert {"a": a, "b": b}[serving].chat_requests() >= 3
    assert metric(metric_samples(gw.url), "gateway_thermal_all_hot_total") == 3.0


def test_unknown_telemetry_is_shown_counted_and_never_read_as_cool(
    sims: Callable[..., Sim],
    exporters: Callable[..., DcgmStub],
    th_gateway: Callable[..., GatewayThread],
) -> None:
    a, b, c = sims("a"), sims("b"), sims("c")
    ea, eb = exporters(temp_c=50.0), exporters(temp_c=60.0)
    gw = th_gateway([backend("a", a, ea), backend("b", b, eb), backend("c", c)])
    assert wait_for(lambda: gpu(gw, "a")["tier"] == "cool", timeout=10)

    ea.status = 500  # the exporter breaks: a's temperature is no longer known
    assert wait_for(lambda: gpu(gw, "a")["tier"] == "unknown", timeout=10)
    shown = gpu(gw, "a")
    assert shown["monitored"] is True and shown["temperature_c"] is None
    assert "500" in gpu(gw, "a")["error"]
    unmonitored = gpu(gw, "c")
    assert unmonitored == {"monitored": False, "tier": "unknown", "power_domain": None}
    m = metric_samples(gw.url)
    assert metric(m, "gateway_thermal_tier", backend="a", tier="unknown") == 1.0
    assert metric(m, "gateway_thermal_tier", backend="a", tier="cool") == 0.0
    assert metric(m, "gateway_gpu_telemetry_unknown_total", backend="a") == 1.0
    assert (metric(m, "gateway_gpu_telemetry_scrape_errors_total", backend="a") or 0) > 0
    assert metric(m, "gateway_gpu_temperature_celsius", backend="a") is None
    assert metric(m, "gateway_thermal_tier", backend="c", tier="unknown") is None

    eb.set(temp_c=80.0)  # b warm: avoided too while a backend without concerns exists
    assert wait_for(lambda: gpu(gw, "b")["tier"] == "warm", timeout=10)
    before = (a.chat_requests(), b.chat_requests(), c.chat_requests())
    send(gw, 6)
    after = (a.chat_requests(), b.chat_requests(), c.chat_requests())
    assert (after[0] - before[0], after[1] - before[1], after[2] - before[2]) == (0, 0, 6)

    ea.status = 200  # telemetry back: a is known cool and takes its share again
    assert wait_for(lambda: gpu(gw, "a")["tier"] == "cool", timeout=10)
    send(gw, 6)
    assert a.chat_requests() - after[0] >= 2


def test_power_domain_over_target_steers_then_admission_sheds_low_priority_first(
    sims: Callable[..., Sim],
    exporters: Callable[..., DcgmStub],
    th_gateway: Callable[..., GatewayThread],
) -> None:
    a, b = sims("a"), sims("b")
    ea = exporters(temp_c=50.0, power_w=300.0, power_limit_w=2000.0)
    eb = exporters(temp_c=50.0, power_w=300.0, power_limit_w=2000.0)
    gw = th_gateway(
        [backend("a", a, ea, power_domain="r1"), backend("b", b, eb, power_domain="r2")],
        power_domains=[{"name": "r1", "budget_w": 1000}, {"name": "r2", "budget_w": 1000}],
        auth={"anonymous_max_priority": "high"},  # the clients' x-priority: high is granted
    )
    def domains() -> dict[str, Any]:
        r = httpx.get(gw.url + "/admin/backends", timeout=5).json()
        return {d["name"]: d for d in r["power_domains"]}

    ea.set(power_w=850.0)  # rack r1 above 80% of its budget: load goes to r2
    assert wait_for(lambda: domains()["r1"]["over_target"], timeout=10)
    before = a.chat_requests()
    send(gw, 5)
    assert a.chat_requests() == before

    eb.set(power_w=850.0)  # both racks over: steering cannot help, admission tightens
    assert wait_for(lambda: domains()["r2"]["over_target"], timeout=10)
    client = sdk(gw.url)
    with pytest.raises(openai.RateLimitError) as err:
        client.chat.completions.create(**sdk_kwargs(), extra_headers={"x-priority": "low"})
    assert float(err.value.response.headers["retry-after"]) >= 1
    assert "power" in err.value.message
    send(gw, 1, **{"x-priority": "normal"})
    send(gw, 1, **{"x-priority": "high"})

    ea.set(power_w=960.0)
    eb.set(power_w=950.0)  # 95% of budget: normal is refused too, high still passes
    assert wait_for(lambda: domains()["r1"]["draw_w"] == 960.0, timeout=10)
    assert wait_for(lambda: domains()["r2"]["draw_w"] == 950.0, timeout=10)
    with pytest.raises(openai.RateLimitError):
        send(gw, 1, **{"x-priority": "normal"})
    send(gw, 1, **{"x-priority": "high"})
    m = metric_samples(gw.url)
    assert metric(m, "gateway_admission_rejections_total", layer="power", priority="low") == 1
    assert metric(m, "gateway_admission_rejections_total", layer="power", priority="normal") == 1
    assert metric(m, "gateway_power_domain_watts", domain="r1") == 960.0
    assert metric(m, "gateway_power_domain_budget_watts", domain="r2") == 1000.0


def test_backend_over_its_power_cap_is_deprioritised(
    sims: Callable[..., Sim],
    exporters: Callable[..., DcgmStub],
    th_gateway: Callable[..., GatewayThread],
) -> None:
    a, b = sims("a"), sims("b")
    ea = exporters(temp_c=50.0, power_w=300.0, power_limit_w=700.0)
    eb = exporters(temp_c=50.0, power_w=300.0, power_limit_w=700.0)
    gw = th_gateway([backend("a", a, ea), backend("b", b, eb)])
    ea.set(power_w=650.0)  # 93% of its limit: above the 80% cap
    assert wait_for(lambda: gpu(gw, "a")["power_limit_ratio"] > 0.9, timeout=10)
    before = a.chat_requests()
    send(gw, 5)
    assert a.chat_requests() == before

