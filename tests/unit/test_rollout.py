"""One model's canary rollout (gateway.traffic.rollout, gateway.traffic.rollout_sim): pure,
an injected clock and seeded random sources."""

from __future__ import annotations

import json
import math
import random

import pytest

from gateway.core.vocab import Prio
from gateway.traffic.rollout import DEFAULT_STEPS, Rollout, RolloutPlan, Version
from gateway.traffic.rollout_sim import Release, Traffic, simulate
from gateway.traffic.rollout_stats import Thresholds
from gateway.traffic.rollout_window import Reservoir

QUICK = RolloutPlan("m", "v1", "v2", min_step_s=60.0, min_step_requests=100)
"""The default steps and thresholds, with one-minute steps to keep the runs short."""
TRAFFIC = Traffic(rate_rps=20.0)


class AlwaysCanary(random.Random):
    """A random source whose every draw is 0.0: every request asks for the canary."""

    def random(self) -> float:
        return 0.0


def feed(r: Rollout, rng: random.Random, now: float, n: int, *, canary_factor: float = 1.0,
         canary_errors: float = 0.0, sessions: int = 0) -> float:
    """``n`` requests at 10 per second from ``now``; returns the clock after them."""
    for _ in range(n):
        now += 0.1
        key = f"s{rng.randrange(sessions)}" if sessions else None
        v = r.assign(key, None, Prio.NORMAL, now)
        f = canary_factor if v == "canary" else 1.0
        err = v == "canary" and rng.random() < canary_errors
        r.observe(v, f * math.exp(rng.gauss(math.log(0.25), 0.5)),
                  f * math.exp(rng.gauss(math.log(0.03), 0.3)), err)
        if v == "canary":
            r.record_probe(True)
    return now


def test_slow_canary_is_rolled_back_at_the_first_step_once_the_minimum_is_reached() -> None:
    plan = RolloutPlan("m", "v1", "v2", min_step_s=30.0, min_step_requests=100,
                       steps=(0.2, 0.5, 1.0))
    rng = random.Random(11)
    r = Rollout(plan, 0.0, random.Random(12))
    now = feed(r, rng, 0.0, 250, canary_factor=1.5)  # 25 s: too early, whatever the data
    assert r.status == "running" and not r.history
    while r.status == "running" and now < 600:
        now = feed(r, rng, now, 1, canary_factor=1.5)
    assert r.status == "rolled_back" and r.step == 0
    rec = r.history[-1]
    assert rec.outcome == "rolled_back" and rec.reason.startswith("ttft regression")
    assert rec.at >= 30.0
    assert rec.comparison is not None
    assert rec.comparison.metric("ttft").numbers["canary_n"] == 100  # decided at the minimum
    assert r.assign(None, None, Prio.NORMAL, now + 1) == "baseline"  # all back on baseline


def test_good_canary_is_promoted_through_every_step() -> None:
    out = simulate(QUICK, Release(), TRAFFIC, seed=0)
    assert out.status == "promoted" and out.step == len(DEFAULT_STEPS) - 1
    assert out.decided_after_s is not None and out.decided_after_s >= 60.0 * 5


def test_no_false_rollbacks_of_a_good_canary_over_20_rollouts() -> None:
    outcomes = [simulate(QUICK, Release(), TRAFFIC, seed=s) for s in range(20)]
    rolled = [o.reason for o in outcomes if o.status != "promoted"]
    # measured: 0 of these 20 (the tests' bound: alpha 0.01 a rollout, each step decided
    # once at alpha / 5); the z-test without its exact fallback rolled back 4 of 20
    assert len(rolled) <= 1, rolled


@pytest.mark.parametrize(("release", "reason"), [
    (Release(ttft_factor=1.5), "ttft regression"),
    (Release(itl_factor=1.5), "itl regression"),
    (Release(extra_error_rate=0.05), "error_rate regression"),
    (Release(calibration_failure_rate=0.05), "calibration failed"),  # as fast as the baseline
])
def test_bad_release_is_rolled_back_at_its_first_step(release: Release, reason: str) -> None:
    out = simulate(QUICK, release, TRAFFIC, seed=3)
    assert out.status == "rolled_back" and out.step == 0
    assert out.reason.startswith(reason)


@pytest.mark.parametrize(("rate", "session_share"), [(20.0, 0.5), (20.0, 0.0), (200.0, 0.0),
                                                      (200.0, 0.5)])
def test_share_served_before_a_first_step_rollback_is_bounded(
    rate: float, session_share: float
) -> None:
    """The must-hold, stated for the pure model: canary requests / all requests <= the
    first step's share + min_step_requests / all requests."""
    traffic = Traffic(rate_rps=rate, session_share=session_share)
    out = simulate(QUICK, Release(ttft_factor=1.5), traffic, seed=5)
    assert out.status == "rolled_back" and out.step == 0
    bound = QUICK.steps[0] + QUICK.min_step_requests / out.total_requests
    assert out.canary_share <= bound
    assert out.canary_requests >= QUICK.min_step_requests


def test_the_cap_holds_even_when_every_draw_asks_for_the_canary() -> None:
    plan = RolloutPlan("m", "v1", "v2", min_step_s=1e6, max_step_s=1e6, min_step_requests=50)
    r = Rollout(plan, 0.0, AlwaysCanary())
    got = [r.assign(None, None, Prio.NORMAL, i * 0.01) for i in range(5000)]
    canary = got.count("canary")
    assert canary <= plan.steps[0] * len(got) + plan.min_step_requests + 1
    assert canary >= plan.min_step_requests  # the step can still reach its sample


def test_sticky_sessions_never_go_back_from_canary_as_the_share_grows() -> None:
    plan = RolloutPlan("m", "v1", "v2", min_step_s=10.0, min_step_requests=100,
                       thresholds=Thresholds(min_calibration_probes=0))
    rng = random.Random(21)
    r = Rollout(plan, 0.0, random.Random(22))
    keys = [f"session-{i}" for i in range(3000)]
    on_canary: set[str] = set()
    now, seen_steps = 0.0, []
    while r.status == "running":
        seen_steps.append(r.step)
        placed = {k: r.assign(k, None, Prio.NORMAL, now) for k in keys}
        canary = {k for k, v in placed.items() if v == "canary"}
        assert on_canary <= canary  # once on the canary, always on it
        assert abs(len(canary) / len(keys) - r.share) < 0.03
        on_canary = canary
        step = r.step
        while r.status == "running" and r.step == step:
            now = feed(r, rng, now, 1)
    assert r.status == "promoted" and sorted(set(seen_steps)) == [0, 1, 2, 3, 4]
    assert {r.assign(k, None, Prio.NORMAL, now) for k in keys} == {"canary"}


def test_targeted_steps_send_only_the_chosen_keys_and_low_priority_to_the_canary() -> None:
    plan = RolloutPlan("m", "v1", "v2", steps=(0.5, 1.0), targeted_steps=1,
                       target_keys=frozenset({"tester"}),
                       target_priorities=frozenset({Prio.LOW}), min_step_s=0.0,
                       min_step_requests=1, thresholds=Thresholds(min_calibration_probes=0))
    r = Rollout(plan, 0.0, random.Random(1))

    def versions(key: str | None, prio: Prio) -> set[Version]:
        return {r.assign(None, key, prio, 0.0) for _ in range(200)}

    assert versions("someone", Prio.NORMAL) == {"baseline"}
    assert versions("someone", Prio.HIGH) == {"baseline"}
    assert versions("tester", Prio.HIGH) == {"baseline", "canary"}
    assert versions(None, Prio.LOW) == {"baseline", "canary"}
    assert r.snapshot(0.0)["targeted"] is True
    r.step = 1  # past the targeted steps: everyone
    assert versions("someone", Prio.NORMAL) == {"canary"}


@pytest.mark.parametrize("choice", ["rollback", "hold"])
def test_insufficient_after_the_max_step_time(choice: str) -> None:
    plan = RolloutPlan("m", "v1", "v2", min_step_s=60.0, max_step_s=600.0,
                       min_step_requests=100, on_insufficient=choice)  # type: ignore[arg-type]
    rng = random.Random(2)
    r = Rollout(plan, 0.0, random.Random(3))
    feed(r, rng, 0.0, 1000)  # 100 s: ~10 canary requests at 1 %, far from 100
    assert r.tick(599.0) is None and r.status == "running"
    rec = r.tick(600.0)
    assert rec is not None
    if choice == "rollback":
        assert r.status == "rolled_back" and rec.reason.startswith("insufficient after 600 s")
    else:
        assert r.status == "running" and rec.outcome == "hold"
        assert r.tick(700.0) is None  # one hold record, the step goes on
        assert r.history == [rec]


def test_snapshot_is_json_with_step_shares_comparison_and_history() -> None:
    rng = random.Random(8)
    r = Rollout(QUICK, 100.0, random.Random(9))
    now = feed(r, rng, 100.0, 800, canary_factor=2.0)
    while r.status == "running":
        now = feed(r, rng, now, 1, canary_factor=2.0)
    doc = json.loads(json.dumps(r.snapshot(now)))
    assert doc["status"] == "rolled_back" and doc["step"] == 0 and doc["share"] == 0.0
    assert doc["steps"] == list(DEFAULT_STEPS) and doc["started_at"] == 100.0
    assert doc["served"]["canary"] >= 100
    # the request whose arrival decided the step went to the baseline, after the rollback
    before = doc["served"]["canary"] + doc["served"]["baseline"] - 1
    assert doc["share_before_rollback"] == pytest.approx(doc["served"]["canary"] / before)
    assert doc["share_before_rollback"] <= 0.01 + QUICK.min_step_requests / before
    (last,) = doc["history"]
    assert last["outcome"] == "rolled_back" and last["at"] >= 160.0
    ttft = next(m for m in last["comparison"]["metrics"] if m["metric"] == "ttft")
    assert ttft["decision"] == "fail" and ttft["p50_ratio"] > 1.5


def test_operator_rollback_and_nothing_after_the_end() -> None:
    r = Rollout(QUICK, 0.0, random.Random(0))
    rec = r.rollback(5.0, "operator: POST /admin/rollouts/m/rollback")
    assert rec is not None and rec.comparison is None and r.status == "rolled_back"
    assert r.rollback(6.0, "again") is None and r.tick(1e9) is None
    r.observe("canary", 1.0, 0.1, True)  # ignored
    assert r.snapshot(7.0)["history"][0]["reason"].startswith("operator")


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"steps": (0.1, 0.05, 1.0)}, "steps"), ({"steps": (0.1, 0.5)}, "steps"),
    ({"min_step_s": -1.0}, "min_step_s"), ({"max_step_s": 1.0}, "max_step_s"),
    ({"min_step_requests": 0}, "min_step_requests"),
    ({"targeted_steps": 1}, "targeted_steps"), ({"canary": "v1"}, "canary"),
])
def test_bad_plans_name_the_field(kwargs: dict[str, object], field: str) -> None:
    base: dict[str, object] = {"model": "m", "baseline": "v1", "canary": "v2"}
    with pytest.raises(ValueError, match=f"RolloutPlan.{field}"):
        RolloutPlan(**{**base, **kwargs})  # type: ignore[arg-type]


def test_detection_time_shrinks_as_the_regression_grows() -> None:
    times = {}
    for factor in (1.1, 1.5, 2.0):
        out = simulate(QUICK, Release(ttft_factor=factor), TRAFFIC, seed=4)
        assert out.status == "rolled_back"
        assert out.decided_after_s is not None
        times[factor] = out.decided_after_s
    assert times[2.0] <= times[1.5] <= times[1.1]


def test_the_window_keeps_a_bounded_uniform_sample() -> None:
    res = Reservoir(200, random.Random(0))
    for v in range(20_000):
        res.add(float(v))
    assert res.seen == 20_000 and len(res.values) == 200
    assert 7000 < sum(res.values) / 200 < 13_000  # uniform over 0..19 999: mean ~10 000
    assert max(res.values) > 15_000  # late values get in too


def test_a_resumed_rollout_goes_on_at_its_step_with_its_decisions_and_state_round_trips() -> None:
    """``state`` -> JSON -> ``resume`` (a restart, a config rollback): the step, its age,
    the counts and the decisions carry over; the window starts empty, so the resumed step
    decides on new samples; ended rollouts keep their routing."""
    rng = random.Random(5)
    r = Rollout(QUICK, 0.0, random.Random(6))
    now = feed(r, rng, 0.0, 1200)  # 120 s: step 0 passed
    while r.step < 2 and now < 2000:
        now = feed(r, rng, now, 10)
    assert r.status == "running" and r.step == 2
    age = now - r.step_started_at
    saved = json.loads(json.dumps(r.state(now)))
    # the same plan in another process, 1000 s of clock later
    later = 1000.0 + now
    again = Rollout(QUICK, later, random.Random(7))
    again.resume(saved, later)
    assert (again.status, again.step, again.served) == ("running", 2, r.served)
    assert again.step_started_at == pytest.approx(later - age)
    assert [h["outcome"] for h in again.snapshot(later)["history"]] == ["pass", "pass"]
    assert again.snapshot(later)["history"][0]["at"] == pytest.approx(  # type: ignore[index]
        later - (now - r.history[0].at))
    assert again.compare().decision == "insufficient"  # a new window
    end = feed(again, rng, later, 3000)  # goes on from step 2 to the end
    assert again.status == "promoted", again.snapshot(end)["history"]
    assert [h["step"] for h in again.snapshot(end)["history"]] == [0, 1, 2, 3, 4]  # type: ignore[index]
    # an ended rollout keeps its routing
    back = Rollout(QUICK, 0.0, random.Random(8))
    back.rollback(1.0, "operator")
    resumed = Rollout(QUICK, 5.0, random.Random(9))
    resumed.resume(json.loads(json.dumps(back.state(2.0))), 5.0)
    assert resumed.status == "rolled_back"
    assert resumed.assign(None, None, Prio.NORMAL, 6.0) == "baseline"
    for bad in ({"status": "paused", "step": 0}, {"status": "running", "step": 9}, {}):
        with pytest.raises((KeyError, ValueError)):
            Rollout(QUICK, 0.0, random.Random(1)).resume(bad, 0.0)


def test_a_good_canary_of_a_model_without_streams_is_promoted_though_it_has_no_itl() -> None:
    """Non-streaming clients give no ITL: the metric is not measured (its reason says so)
    rather than holding every step until ``max_step_s`` and rolling the canary back."""
    plan = RolloutPlan("m", "v1", "v2", min_step_s=30.0, min_step_requests=100,
                       max_step_s=3000.0)
    rng = random.Random(3)
    r = Rollout(plan, 0.0, random.Random(4))
    now = 0.0
    while r.status == "running" and now < 20000:
        now += 0.1
        v = r.assign(None, None, Prio.NORMAL, now)
        r.observe(v, math.exp(rng.gauss(math.log(0.25), 0.5)), None, False)
        if v == "canary":
            r.record_probe(True)
    assert r.status == "promoted", [h.reason for h in r.history]
    itl = r.history[0].comparison.metric("itl")  # type: ignore[union-attr]
    assert itl.decision == "pass" and "not measured" in itl.reason


def test_failing_calibration_rolls_back_as_soon_as_the_probes_say_so_not_when_due() -> None:
    """Wrong answers end the rollout at the first tick after the minimum of probes, long
    before the step is due (``min_step_s`` 600 s): the canary serves no more than that."""
    r = Rollout(RolloutPlan("m", "v1", "v2", min_step_s=600.0, min_step_requests=100),
                0.0, random.Random(1))
    need = r.plan.thresholds.min_calibration_probes
    for i in range(need - 1):
        r.record_probe(i % 2 == 0)
    assert r.tick(1.0) is None and r.status == "running"  # not enough probes yet
    r.record_probe(False)
    rec = r.tick(2.0)
    assert rec is not None and rec.outcome == "rolled_back" and rec.step == 0
    assert rec.reason.startswith("calibration failed"), rec.reason


E2E_LIKE = RolloutPlan("m", "v1", "v2", steps=(0.05, 0.25, 1.0), min_step_s=0.5,
                       min_step_requests=40, recheck_s=0.2, max_step_s=900,
                       thresholds=Thresholds(min_samples=20, min_requests=40))
"""benchmarks/rollout_e2e.py's short steps (three of its shares, to keep the test short):
40 canary requests give about 20 ITL samples (half the requests streamed), so a step is
looked at every 0.2 s until they are in."""


def test_a_step_is_decided_once_every_metric_has_its_sample() -> None:
    """No peeking: a metric failing while another still lacks its sample is shown, not
    acted on, however many looks; the step decides at its first complete comparison."""
    th = Thresholds(min_samples=20, min_requests=40, min_calibration_probes=0)
    plan = RolloutPlan("m", "v1", "v2", min_step_s=0.0, min_step_requests=40,
                       recheck_s=0.05, thresholds=th)
    r = Rollout(plan, 0.0, random.Random(1))
    rng = random.Random(2)

    def ttft(f: float = 1.0) -> float:
        return f * math.exp(rng.gauss(math.log(0.25), 0.5))

    for _ in range(400):
        r.observe("baseline", ttft(), ttft() / 8, False)
    for _ in range(40):  # twice as slow; no stream yet: no ITL sample
        r.observe("canary", ttft(2.0), None, False)
    for k in range(20):
        assert r.tick(1.0 + 0.1 * k) is None
    assert r.looks == 20 and r.status == "running"
    assert r.last_comparison is not None and r.last_comparison.decision == "fail"
    assert r.last_comparison.metric("itl").decision == "insufficient"
    for _ in range(20):
        r.observe("canary", ttft(2.0), ttft() / 8, False)
    rec = r.tick(5.0)
    assert rec is not None and r.status == "rolled_back"
    assert rec.reason.startswith("ttft regression")


def test_a_good_canary_looked_at_repeatedly_is_promoted() -> None:
    """benchmarks/rollout.py --profile e2e in small: every step looked at many times while
    its ITL sample fills (400 seeds: docs/architecture.md, "Canary rollouts: the statistics")."""
    traffic = Traffic(rate_rps=60.0, stream_share=0.5, probe_interval_s=0.1)
    outcomes = [simulate(E2E_LIKE, Release(), traffic, seed=s) for s in range(10)]
    assert sum(o.looks for o in outcomes) > 2 * 3 * len(outcomes)  # repeated looks
    rolled = [(o.step, o.reason) for o in outcomes if o.status != "promoted"]
    assert not rolled, rolled


def test_itl_is_compared_at_the_load_its_decode_met() -> None:
    r = Rollout(QUICK, 0.0, random.Random(1))
    r.observe("canary", 0.2, 0.01, False, load=1, itl_load=4)  # arrivals stalled its decode
    r.observe("canary", 0.2, 0.01, False, load=2)
    side = r._window["canary"]
    assert side.ttft.strata == [1, 2] and side.itl.strata == [3, 2]


def _through_first_step(plan: RolloutPlan, rng: random.Random) -> tuple[Rollout, float]:
    r = Rollout(plan, 0.0, random.Random(3))
    now = 0.0
    while r.step == 0 and r.status == "running" and now < 600:
        now = feed(r, rng, now, 1)
    assert r.status == "running" and r.step == 1, r.history
    return r, now


def test_at_the_last_step_latencies_are_shown_not_gated_and_errors_still_are() -> None:
    """At 100 % the baseline's side is the previous step's sample, taken at another load per
    server: the canary, slower there (x1.5, its servers now carry everything), is promoted
    with the comparison shown; a canary that errs there is still rolled back."""
    plan = RolloutPlan("m", "v1", "v2", min_step_s=30.0, min_step_requests=100,
                       steps=(0.5, 1.0))
    r, now = _through_first_step(plan, random.Random(5))
    rng = random.Random(6)
    while r.status == "running" and now < 900:
        now = feed(r, rng, now, 1, canary_factor=1.5)
    assert r.status == "promoted", r.history
    ttft = r.history[-1].comparison.metric("ttft")  # type: ignore[union-attr]
    assert ttft.numbers["p50_ratio"] > 1.3 and "not gated" in ttft.reason

    r, now = _through_first_step(plan, random.Random(5))
    while r.status == "running" and now < 900:
        now = feed(r, rng, now, 1, canary_errors=0.1)
    assert r.status == "rolled_back" and r.step == 1
    assert r.history[-1].reason.startswith("error"), r.history[-1].reason
