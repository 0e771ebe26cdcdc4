"""``gateway_model_backends{model,state}``: the backends serving each model by serving
state (the lifecycle state, or ``breaker_open`` for a warm one with its circuit breaker
open), every state exported (0 included), so the alert GatewayNoWarmBackend is the sample
``state="warm"`` at 0 - seen on a live gateway's /metrics as an operator's drain takes a
model's only backend out of rotation."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from gateway.core.vocab import BackendState
from gateway.fleet.liveness import Liveness
from gateway.metrics import GatewayMetrics
from gateway.traffic.breaker import BreakerConfig, CircuitBreaker
from tests.lifecycle.support import Sim, metric, metric_samples, post_admin, wait_state
from tests.support.scripted import wait_for
from tests.support.servers import GatewayThread


def test_warm_backends_per_model_drop_to_zero_when_the_last_is_drained(
        sims: Callable[..., Sim], lc_gateway: Callable[..., GatewayThread]) -> None:
    a, b, c = sims("a"), sims("b"), sims("c")
    gw = lc_gateway({"a": a.url, "b": b.url, "c": c.url})
    # every backend serves m1 (the simulators' model): 3 warm, every other state at 0
    s = metric_samples(gw.url)
    for state in BackendState:
        want = 3.0 if state is BackendState.WARM else 0.0
        assert metric(s, "gateway_model_backends", model="m1", state=state.value) == want

    for bid in ("a", "b", "c"):
        assert post_admin(gw.url, bid, "drain", {"deadline_s": 1}).status_code == 202
    for bid in ("a", "b", "c"):
        wait_state(gw.url, bid, "draining")

    def no_warm() -> bool:
        s = metric_samples(gw.url)
        return (metric(s, "gateway_model_backends", model="m1", state="warm") == 0.0
                and metric(s, "gateway_model_backends", model="m1", state="draining") == 3.0)

    assert wait_for(no_warm, timeout=10), metric_samples(gw.url)


def test_a_backend_counts_for_each_model_it_serves() -> None:
    @dataclass
    class B:  # what FleetCollector reads of a backend (gateway.metrics.BackendGauges)
        id: str
        models: tuple[str, ...]
        state: BackendState
        in_flight: int = 0
        load: None = None
        last_scrape_ok_at: None = None
        liveness: Liveness = field(default_factory=Liveness)
        breaker: None = None
        prefix_cache_hit_ratio: None = None

    m = GatewayMetrics()
    m.attach_fleet([B("a", ("m1", "lora"), BackendState.WARM),
                    B("b", ("m1",), BackendState.UNHEALTHY),
                    B("c", ("m2",), BackendState.COOLDOWN)])
    got = {(s.labels["model"], s.labels["state"]): s.value
           for f in text_string_to_metric_families(generate_latest(m.registry).decode())
           if f.name == "gateway_model_backends" for s in f.samples if s.value}
    assert got == {("m1", "warm"): 1, ("lora", "warm"): 1, ("m1", "unhealthy"): 1,
                   ("m2", "cooldown"): 1}


def test_a_warm_backend_with_its_breaker_open_is_counted_breaker_open_not_warm() -> None:
    now = [0.0]
    cfg = BreakerConfig(consecutive_failures=1, open_base_s=10.0)

    @dataclass
    class B:
        id: str
        breaker: CircuitBreaker
        models: tuple[str, ...] = ("m1",)
        state: BackendState = BackendState.WARM
        in_flight: int = 0
        load: None = None
        last_scrape_ok_at: None = None
        liveness: Liveness = field(default_factory=Liveness)
        prefix_cache_hit_ratio: None = None

    tripped = CircuitBreaker(cfg, lambda: now[0])
    tripped.on_failure()  # one failure in a row trips it: open for 10 s
    m = GatewayMetrics()
    m.attach_fleet([B("a", tripped), B("b", CircuitBreaker(cfg, lambda: now[0]))])

    def counts() -> dict[str, float]:
        return {s.labels["state"]: s.value
                for f in text_string_to_metric_families(generate_latest(m.registry).decode())
                if f.name == "gateway_model_backends" for s in f.samples if s.value}

    assert counts() == {"warm": 1, "breaker_open": 1}
    now[0] = 10.0  # the open time over: half-open lets a probe through, it is warm again
    assert counts() == {"warm": 2}
