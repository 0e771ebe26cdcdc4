"""The routing policies behind one interface (gateway.routing.policies): round-robin,
least-request, the factory that builds the configured one (pure, injected clock)."""

from __future__ import annotations

import random
from collections.abc import Sequence
from pathlib import Path

import pytest
from pydantic import ValidationError

from gateway.config import LifecycleConfig, RoutingConfig, RoutingPolicy, RoutingWeights
from gateway.core.samples import LoadSample
from gateway.routing.policies import (
    LeastRequestPolicy,
    Policy,
    RoundRobinPolicy,
    build_policy,
)
from gateway.routing.policy import C, LoadThermalPolicy, SlowStart
from gateway.routing.thermal import ThermalChoice
from tests.unit.test_policy import B, Clock  # the same fake candidates and clock

NO_RAMP = LifecycleConfig(slow_start_s=0.0)


def make(name: RoutingPolicy, clock: Clock, lifecycle: LifecycleConfig = NO_RAMP,
         **kw: object) -> Policy:
    return build_policy(RoutingConfig(policy=name), lifecycle, 5.0, clock, **kw)  # type: ignore[arg-type]


# ---- round-robin ----------------------------------------------------------------------------
def test_round_robin_takes_each_candidate_in_turn_blind_to_load() -> None:
    p = RoundRobinPolicy(SlowStart(0.0, 0.1, random.Random(1)), Clock())
    a, b, c = B("a", in_flight=50), B("b"), B("c", load=LoadSample(40, 16, 0.99, 100.0, 0))
    assert [p.pick([a, b, c]).id for _ in range(7)] == list("abcabca")  # type: ignore[union-attr]


def test_round_robin_keeps_turning_when_the_candidates_change() -> None:
    p = RoundRobinPolicy(SlowStart(0.0, 0.1, random.Random(1)), Clock())
    a, b, c = B("a"), B("b"), B("c")
    assert p.pick([a, b, c]) is a
    assert p.pick([a, c]) is c  # b left: the turn goes on over those given
    assert p.pick([a, b, c]) is c
    assert p.pick([]) is None


# ---- least-request --------------------------------------------------------------------------
def test_least_request_picks_the_fewest_in_flight_ties_in_turn() -> None:
    p = LeastRequestPolicy(SlowStart(0.0, 0.1, random.Random(1)), Clock())
    a, b, c = B("a", in_flight=2), B("b", in_flight=1), B("c", in_flight=1)
    # b and c tie: in turn, starting after the last pick's position
    assert [p.pick([a, b, c]).id for _ in range(4)] == ["b", "c", "b", "c"]  # type: ignore[union-attr]
    c.in_flight = 0
    assert p.pick([a, b, c]) is c
    busy = B("busy", in_flight=0, load=LoadSample(50, 16, 0.99, 100.0, 0))  # load unread
    assert p.pick([a, busy]) is busy
    assert p.pick([]) is None


def test_least_request_spreads_a_burst_evenly() -> None:
    p = LeastRequestPolicy(SlowStart(0.0, 0.1, random.Random(1)), Clock())
    bs = [B("a"), B("b"), B("c")]
    for _ in range(30):
        chosen = p.pick(bs)
        assert chosen is not None
        chosen.in_flight += 1  # what the request path does at dispatch
    assert [b.in_flight for b in bs] == [10, 10, 10]


# ---- slow start, the same in every policy ---------------------------------------------------
@pytest.mark.parametrize("name", list(RoutingPolicy))
def test_every_policy_ramps_a_newly_warm_backend(name: RoutingPolicy) -> None:
    clock = Clock(100.0)
    lc = LifecycleConfig(slow_start_s=30.0, slow_start_min_weight=0.1)
    p = make(name, clock, lc, rng=random.Random(7))
    old, new = B("old"), B("new", warm_since=100.0 - 15.0)  # half-way: weight 0.5
    assert p.weight(new, clock.t) == pytest.approx(0.5)
    assert p.weight(old, clock.t) == 1.0
    picks = []
    for _ in range(4000):
        chosen = p.pick([old, new])
        assert chosen is not None
        picks.append(chosen.id)
    assert picks.count("new") / len(picks) == pytest.approx(0.5 * 0.5, abs=0.03)
    clock.t = 200.0  # ramp over: its fair share
    picks = [p.pick([old, new]).id for _ in range(1000)]  # type: ignore[union-attr]
    assert picks.count("new") == 500
    assert p.pick([new]) is new  # alone: it takes the request whatever its weight


# ---- the simple policies ignore sessions; the gateway's keeps them --------------------------
@pytest.mark.parametrize(
    ("name", "sticky"),
    [(RoutingPolicy.LOAD_THERMAL, True), (RoutingPolicy.LEAST_REQUEST, False),
     (RoutingPolicy.ROUND_ROBIN, False)],
)
def test_session_affinity_only_in_the_gateways_policy(name: RoutingPolicy, sticky: bool) -> None:
    p = make(name, Clock())
    a, b = B("a"), B("b")
    first = p.pick([a, b], "s1")
    assert first is not None
    first.in_flight += 5
    again = [p.pick([a, b], "s1") for _ in range(3)]
    assert all(x is first for x in again) is sticky


# ---- the factory ----------------------------------------------------------------------------
def test_config_defaults_to_the_gateways_policy_and_rejects_unknown_names() -> None:
    assert RoutingConfig().policy is RoutingPolicy.LOAD_THERMAL
    assert RoutingConfig.model_validate({"policy": "least_request"}).policy is (
        RoutingPolicy.LEAST_REQUEST
    )
    with pytest.raises(ValidationError, match="policy"):
        RoutingConfig.model_validate({"policy": "random"})
    assert "round_robin" in (RoutingConfig.model_fields["policy"].description or "")


@pytest.mark.parametrize(
    ("name", "kind"),
    [(RoutingPolicy.LOAD_THERMAL, LoadThermalPolicy), (RoutingPolicy.LEAST_REQUEST,
     LeastRequestPolicy), (RoutingPolicy.ROUND_ROBIN, RoundRobinPolicy)],
)
def test_factory_builds_the_configured_policy(name: RoutingPolicy, kind: type) -> None:
    assert type(make(name, Clock())) is kind


def test_factory_configures_the_gateways_policy() -> None:
    """Weights, stale limit, session TTL and the thermal hook come from the arguments."""
    clock = Clock(100.0)
    calls: list[tuple[list[str], float]] = []

    def thermal(cands: Sequence[C], now: float) -> ThermalChoice[C]:
        calls.append(([c.id for c in cands], now))
        return ThermalChoice([c for c in cands if c.id != "hot"], {"warm": 100.0})

    cfg = RoutingConfig(
        weights=RoutingWeights(waiting=1.0, running=2.0, kv_cache=0.1), session_ttl_s=10.0
    )
    p = build_policy(cfg, NO_RAMP, 5.0, clock, thermal=thermal)
    kv = B("kv", load=LoadSample(0, 0, 0.9, 100.0, 0))  # 0.09 here, 0.9 by default weights
    full = B("full", load=LoadSample(0, 16, 0.0, 100.0, 0))  # 2.0 here, 0.5 by default
    assert p.pick([full, kv]) is kv
    assert calls == [(["full", "kv"], 100.0)]
    hot, warm = B("hot"), B("warm")
    assert p.pick([hot, warm, kv], "s") is kv  # hot dropped, warm's penalty 100
    assert p.pick([hot, warm], "s") is warm  # the pinned one left: re-pinned
    clock.t += 6.0
    assert p.pick([warm, kv], "s") is warm  # pinned (and the load samples went stale)
    clock.t += 11.0  # past the session TTL (10 s since the last hit): the pin is gone
    assert p.pick([warm, kv], "s") is kv
    # stale samples (older than 5 s) read as the in-flight count only: a tie, in turn
    assert sorted(p.pick([full, kv]).id for _ in range(2)) == ["full", "kv"]  # type: ignore[union-attr]


@pytest.mark.parametrize("name", [RoutingPolicy.LEAST_REQUEST, RoutingPolicy.ROUND_ROBIN])
def test_simple_policies_never_call_the_thermal_hook(name: RoutingPolicy) -> None:
    def thermal(cands: Sequence[C], now: float) -> ThermalChoice[C]:
        raise AssertionError("a simple policy is blind to heat")

    p = make(name, Clock(), thermal=thermal)
    assert p.pick([B("a"), B("b")]) is not None


# ---- the app builds the configured policy ---------------------------------------------------
@pytest.mark.parametrize(
    ("yaml", "kind", "hooked"),
    [
        ("", LoadThermalPolicy, False),  # no GPU telemetry, no power domains: no hook
        ("power_domains: [{name: r1, budget_w: 1000}]\n", LoadThermalPolicy, True),
        ("routing: {policy: least_request}\n", LeastRequestPolicy, False),
        ("routing: {policy: round_robin}\npower_domains: [{name: r1, budget_w: 1000}]\n",
         RoundRobinPolicy, False),
    ],
)
def test_the_app_routes_with_the_configured_policy(
    tmp_path: Path, yaml: str, kind: type, hooked: bool
) -> None:
    from gateway.app import build_gateway
    from gateway.config import load_config

    f = tmp_path / "gw.yaml"
    f.write_text(yaml + "backends: [{id: a, url: 'http://10.0.0.1:8000'}]\n")
    gw = build_gateway(load_config(f))
    assert type(gw.router) is kind
    if isinstance(gw.router, LoadThermalPolicy):
        assert gw.router.thermal == (gw.controller.gpu.choose if hooked else None)
        with pytest.raises(AttributeError):
            gw.router.thermal = None  # type: ignore[misc]  # set at construction only
