"""The spot health score per zone and the routing share it sets (gateway.routing.spot):
pure, injected clock and random draws."""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field

import pytest

from gateway.config import LifecycleConfig, RoutingConfig, RoutingPolicy, SpotConfig
from gateway.fleet.records import Placement
from gateway.routing.policies import build_policy
from gateway.routing.policy import C
from gateway.routing.spot import RECOVERED, SpotSteering, ZoneScores, session_draw
from gateway.routing.thermal import ThermalChoice
from tests.unit.test_policy import Clock

H = 600.0  # the default half-life


@dataclass(eq=False)
class S:
    """A candidate with a placement (what the live Backend has)."""

    id: str
    placement: Placement = field(default_factory=Placement)
    capacity: int | None = 16
    in_flight: int = 0
    load: None = None
    warm_since: float | None = None
    recent_failures: int = 0


def spot(id: str, zone: str, **kw: object) -> S:
    return S(id, Placement(zone=zone, capacity_type="spot"), **kw)  # type: ignore[arg-type]


def on_demand(id: str, zone: str, **kw: object) -> S:
    return S(id, Placement(zone=zone, capacity_type="on-demand"), **kw)  # type: ignore[arg-type]


# ---- the score ------------------------------------------------------------------------------
def test_a_notice_halves_the_score_and_the_deficit_halves_every_half_life() -> None:
    clock = Clock(1000.0)
    z = ZoneScores(SpotConfig(), clock)
    assert z.score("a") == 1.0 and z.score(None) == 1.0 and not z.demoted(clock())
    assert z.notice("a") == pytest.approx(0.5)
    assert z.demoted(clock()) and z.score("b") == 1.0
    clock.t += H
    assert z.score("a") == pytest.approx(0.75)
    clock.t += 2 * H
    assert z.score("a") == pytest.approx(1 - 0.5 / 8)
    assert z.snapshot() == {"a": pytest.approx(1 - 0.5 / 8)}


def test_notices_compound_down_to_the_floor() -> None:
    clock = Clock()
    z = ZoneScores(SpotConfig(), clock)
    assert z.notice("a") == pytest.approx(0.5)
    assert z.notice("a") == pytest.approx(0.25)
    for _ in range(10):
        z.notice("a")
    assert z.score("a") == pytest.approx(0.05)  # min_score
    full = ZoneScores(SpotConfig(notice_penalty=1.0, min_score=0.1), clock)
    assert full.notice("b") == pytest.approx(0.1)


def test_a_notice_after_partial_recovery_multiplies_the_recovered_score() -> None:
    clock = Clock()
    z = ZoneScores(SpotConfig(notice_penalty=0.4, half_life_s=100.0), clock)
    z.notice("a")  # 0.6
    clock.t += 100.0  # 1 - 0.4 / 2 = 0.8
    assert z.notice("a") == pytest.approx(0.8 * 0.6)


def test_a_zone_recovers_exactly_once_its_deficit_is_below_the_threshold() -> None:
    clock = Clock()
    z = ZoneScores(SpotConfig(), clock)
    z.notice("a")
    t_rec = H * math.log2(0.5 / RECOVERED)  # ~8.97 half-lives
    clock.t += t_rec - 1.0
    assert z.score("a") < 1.0 and z.demoted(clock())
    clock.t += 2.0
    assert z.score("a") == 1.0 and not z.demoted(clock()) and z.snapshot() == {}


def test_an_older_notice_never_moves_a_score_back_in_time() -> None:
    """A replica catching up with the fleet's notices applies them oldest first; one older
    than the zone's last counts at that last one's time."""
    clock = Clock(10_000.0)
    z = ZoneScores(SpotConfig(), clock)
    assert z.notice("a", at=clock() - H) == pytest.approx(0.75)  # given one half-life ago
    # older than that one: counted at its time (0.5 -> 0.25 then), then one half-life
    assert z.notice("a", at=clock() - 2 * H) == pytest.approx(1 - 0.75 / 2)
    assert z.notice("b", at=clock() + 50.0) == pytest.approx(0.5)  # never in the future


# ---- the routing share ----------------------------------------------------------------------
def steering(name: RoutingPolicy, clock: Clock, scores: ZoneScores, seed: int = 7,
             lifecycle: LifecycleConfig | None = None) -> SpotSteering:
    inner = build_policy(RoutingConfig(policy=name), lifecycle or LifecycleConfig(slow_start_s=0),
                         5.0, clock, rng=random.Random(seed))
    return SpotSteering(inner, scores, random.Random(seed + 1), clock)


def shares(p: SpotSteering, cands: Sequence[S], n: int) -> dict[str, float]:
    count = {c.id: 0 for c in cands}
    for _ in range(n):
        got = p.pick(cands)
        assert got is not None
        count[got.id] += 1
    return {k: v / n for k, v in count.items()}


def within(share: float, p: float, n: int) -> bool:
    """``share`` of ``n`` independent draws is within 4 standard deviations of ``p``."""
    return abs(share - p) <= 4 * math.sqrt(p * (1 - p) / n)


N = 20_000


@pytest.mark.parametrize("name", list(RoutingPolicy))
def test_a_demoted_spot_backend_takes_exactly_score_over_n_whatever_the_policy(
    name: RoutingPolicy,
) -> None:
    clock = Clock()
    z = ZoneScores(SpotConfig(), clock)
    a2, a3, b1, b2 = spot("a2", "a"), on_demand("a3", "a"), spot("b1", "b"), on_demand("b2", "b")
    p = steering(name, clock, z)
    before = shares(p, [a2, a3, b1, b2], N)
    z.notice("a")  # zone a: 0.5
    after = shares(p, [a2, a3, b1, b2], N)
    assert within(after["a2"], 0.5 / 4, N), after
    assert after["a2"] < before["a2"] * 0.6, (before, after)
    for other in ("a3", "b1", "b2"):  # on-demand and other zones' spot take the rest
        assert after[other] > before[other], (before, after)


@pytest.mark.parametrize("name", [RoutingPolicy.LEAST_REQUEST, RoutingPolicy.LOAD_THERMAL])
def test_a_load_aware_policy_cannot_give_a_demoted_backend_its_share_back(
    name: RoutingPolicy,
) -> None:
    """The idle demoted backend would win every pick on load; its share stays s / n."""
    clock = Clock()
    z = ZoneScores(SpotConfig(), clock)
    a2 = spot("a2", "a")
    busy = [on_demand(f"o{i}", "b", in_flight=8) for i in range(3)]
    z.notice("a")
    z.notice("a")  # 0.25
    got = shares(steering(name, clock, z), [a2, *busy], N)
    assert within(got["a2"], 0.25 / 4, N), got


def test_the_slow_start_weight_multiplies_the_share() -> None:
    clock = Clock()
    z = ZoneScores(SpotConfig(), clock)
    z.notice("a")
    a2 = spot("a2", "a", warm_since=clock() - 5.0)  # half-way up a 10 s ramp: weight 0.5
    p = steering(RoutingPolicy.ROUND_ROBIN, clock, z,
                 lifecycle=LifecycleConfig(slow_start_s=10.0, slow_start_min_weight=0.1))
    got = shares(p, [a2, on_demand("a3", "a"), on_demand("b2", "b")], N)
    assert within(got["a2"], 0.5 * 0.5 / 3, N), got


def test_a_model_never_becomes_unservable() -> None:
    clock = Clock()
    z = ZoneScores(SpotConfig(), clock)
    for _ in range(20):
        z.notice("a")  # floor: 0.05
    a1, a2 = spot("a1", "a"), spot("a2", "a")
    p = steering(RoutingPolicy.LOAD_THERMAL, clock, z)
    assert [p.pick([a1]) for _ in range(50)] == [a1] * 50  # the only one left
    assert shares(p, [a1, a2], 1000).keys() == {"a1", "a2"}  # all demoted: the policy picks
    assert p.pick([]) is None


def test_without_a_notice_the_policy_alone_decides() -> None:
    clock = Clock()
    z = ZoneScores(SpotConfig(), clock)
    cands = [spot("a1", "a"), on_demand("a3", "a"), spot("b1", "b")]
    p = steering(RoutingPolicy.ROUND_ROBIN, clock, z)
    assert [p.pick(cands).id for _ in range(6)] == ["a1", "a3", "b1"] * 2  # type: ignore[union-attr]
    z.notice("c")  # another zone's notice changes nothing here
    assert all(p.demotion(c, clock()) is None for c in cands[1:]) and p.demotion(
        cands[0], clock()) is None


def test_a_session_keeps_or_leaves_the_demoted_zone_consistently() -> None:
    clock = Clock()
    z = ZoneScores(SpotConfig(), clock)
    z.notice("a")
    a2, b2 = spot("a2", "a"), on_demand("b2", "b")
    p = steering(RoutingPolicy.LOAD_THERMAL, clock, z)
    kept = 0
    sessions = [f"s{i}" for i in range(4000)]
    for s in sessions:
        first = {p.pick([a2, b2], s).id for _ in range(5)}  # type: ignore[union-attr]
        may = session_draw(s, "a") < 0.5
        assert first <= ({"a2", "b2"} if may else {"b2"}), (s, first)
        assert len(first) == 1  # never alternates
        kept += may
    assert within(kept / len(sessions), 0.5, len(sessions))


def test_a_hot_demoted_backend_takes_nothing() -> None:
    clock = Clock()
    z = ZoneScores(SpotConfig(), clock)
    z.notice("a")
    a2, b2, b3 = spot("a2", "a"), on_demand("b2", "b"), on_demand("b3", "b")

    def thermal(cands: Sequence[C], now: float) -> ThermalChoice[C]:
        return ThermalChoice([c for c in cands if c.id != "a2"])

    inner = build_policy(RoutingConfig(), LifecycleConfig(slow_start_s=0), 5.0, clock,
                         thermal=thermal, rng=random.Random(1))
    p = SpotSteering(inner, z, random.Random(2), clock, thermal=thermal)
    assert shares(p, [a2, b2, b3], 2000)["a2"] == 0.0
