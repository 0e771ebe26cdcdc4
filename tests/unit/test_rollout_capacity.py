"""A rollout never moves a version past its backends' share of the model's capacity
(gateway.traffic.rollout_capacity, and the hold in gateway.traffic.rollout): pure, an
injected clock and seeded random sources."""

from __future__ import annotations

import random

import pytest

from gateway.config_rollouts import RolloutConfig
from gateway.traffic.rollout import Rollout, RolloutPlan
from gateway.traffic.rollout_capacity import PoolCapacity, pool_capacity, step_hold
from tests.unit.test_rollout import feed


def counted(baseline: int, canary: int) -> PoolCapacity:
    return pool_capacity([("v1", None)] * baseline + [("v2", None)] * canary, "v1", "v2")


def test_capacity_is_max_num_seqs_when_every_backend_has_it_else_a_count() -> None:
    cap = pool_capacity([("v1", 64), ("v1", 64), ("v2", 128), ("other", None)], "v1", "v2")
    assert (cap.baseline, cap.canary, cap.unit) == (128.0, 128.0, "max_num_seqs")
    assert cap.canary_share == 0.5 and cap.backends == (2, 1)
    cap = pool_capacity([("v1", 64), ("v1", None), ("v2", 128)], "v1", "v2")
    assert (cap.baseline, cap.canary, cap.unit) == (2.0, 1.0, "backends")
    assert pool_capacity([], "v1", "v2").canary_share == 0.0


@pytest.mark.parametrize(("baseline", "canary", "fits", "held"), [
    (3, 1, (0.01, 0.05, 0.25), (0.5, 1.0)),  # 25 % x 1.25 = 31 %; 1 x 1.25 < 3
    (3, 3, (0.01, 0.05, 0.25, 0.5, 1.0), ()),  # every default step
    (3, 2, (0.25, 0.5), (1.0,)),  # 40 % x 1.25 = 50 % exactly; 2 x 1.25 < 3
    (1, 3, (0.5, 1.0), ()),
    (2, 0, (), (0.01,)),  # no routable canary
])
def test_each_step_fits_within_the_slack_or_says_what_to_add(
    baseline: int, canary: int, fits: tuple[float, ...], held: tuple[float, ...]
) -> None:
    cap = counted(baseline, canary)
    assert [step_hold(s, cap, "v2") for s in fits] == [None] * len(fits)
    for s in held:
        reason = step_hold(s, cap, "v2")
        assert reason is not None and reason.endswith("add backends with model_version v2")
    assert step_hold(0.5, counted(3, 1), "v2") == (
        "canary capacity 25 % (x1.25 = 31 %) < step 50 %: add backends with model_version v2")


def test_a_passed_step_holds_for_capacity_then_moves_on_when_capacity_appears() -> None:
    plan = RolloutPlan("m", "v1", "v2", steps=(0.25, 0.5, 1.0), min_step_s=30.0,
                       min_step_requests=60)
    rng = random.Random(7)
    r = Rollout(plan, 0.0, random.Random(8))
    r.capacity = counted(3, 1)
    now = feed(r, rng, 0.0, 2000)  # 200 s: far past the step's minimum
    assert r.status == "running" and r.step == 0 and r.share == 0.25
    [hold] = r.history  # passed, and held once: not once per tick
    assert (hold.outcome, hold.cause) == ("hold", "capacity")
    assert hold.comparison is not None and hold.comparison.decision == "pass"
    assert r.held == hold.reason and "step 50 %" in hold.reason
    snap = r.snapshot(now)
    assert snap["held"] == hold.reason
    assert snap["capacity"] == {"baseline": 3.0, "canary": 1.0, "unit": "backends",
                                "backends": {"baseline": 3, "canary": 1},
                                "canary_share": 0.25}
    now = feed(r, rng, now, 5000)  # past max_step_s too: held, neither rolled back nor on
    assert r.status == "running" and r.step == 0 and len(r.history) == 1
    r.capacity = counted(3, 2)  # a reload added a canary backend: 40 % x 1.25 = 50 %
    assert r.tick(now + 0.1) is not None
    assert (r.step, r.held, r.history[-1].outcome) == (1, None, "pass")
    r.capacity = counted(3, 3)
    while r.status == "running" and now < 1e5:
        now = feed(r, rng, now, 10)
    assert r.status == "promoted"
    assert [h.outcome for h in r.history] == ["hold", "pass", "pass", "promoted"]


def test_a_held_canary_whose_calibration_fails_is_still_rolled_back() -> None:
    plan = RolloutPlan("m", "v1", "v2", steps=(0.25, 0.5, 1.0), min_step_s=30.0,
                       min_step_requests=60)
    r = Rollout(plan, 0.0, random.Random(8))
    r.capacity = counted(3, 1)
    now = feed(r, random.Random(7), 0.0, 1000)
    assert r.held is not None
    for _ in range(5):
        r.record_probe(False)
    rec = r.tick(now + 0.1)
    assert rec is not None and rec.outcome == "rolled_back"
    assert r.status == "rolled_back" and rec.reason.startswith("calibration")


def test_an_unknown_capacity_never_holds_and_the_slack_is_checked() -> None:
    plan = RolloutPlan("m", "v1", "v2", steps=(0.25, 0.5, 1.0), min_step_s=30.0,
                       min_step_requests=60)
    r = Rollout(plan, 0.0, random.Random(8))
    now = feed(r, random.Random(7), 0.0, 1000)
    assert r.step >= 1 and all(h.cause == "" for h in r.history), now
    with pytest.raises(ValueError, match="capacity_slack"):
        RolloutPlan("m", "v1", "v2", capacity_slack=0.9)
    with pytest.raises(ValueError, match="capacity_slack"):  # the config names the field
        RolloutConfig(model="m", baseline="v1", canary="v2", capacity_slack=0.9)
