"""The three-way verdict of a rollout step (issue 18's trial: a TTFT x1.5 canary passed
its first step on P50 x1.25 at p = 0.056, 46 samples): fail / inconclusive / pass on
injected p-values and samples, and the state machine on an injected clock (an inconclusive
step waits for samples, is rolled back at ``max_step_s`` with reason ``inconclusive``)."""

from __future__ import annotations

import dataclasses
import math
import random
from statistics import NormalDist
from typing import Literal

import pytest

from gateway.traffic.rollout import Rollout, RolloutPlan
from gateway.traffic.rollout_stats import (
    MetricResult,
    Thresholds,
    combine,
    compare_errors,
    effect_verdict,
    latency_verdict,
)

# the trial's plan: three steps, the smallest minimums the API accepts
TRIAL_TH = Thresholds(min_samples=20, min_requests=20)
STEP_TH = TRIAL_TH.per_step(3)  # alpha per test 0.01 / 3 / 3 = 0.0011


def quantiles(n: int, factor: float = 1.0, median_s: float = 0.25,
              sigma: float = 0.5) -> list[float]:
    """``n`` evenly spread quantiles of a lognormal (seconds): a sample without noise."""
    nd = NormalDist(math.log(median_s), sigma)
    return [factor * math.exp(nd.inv_cdf((i + 0.5) / n)) for i in range(n)]


@pytest.mark.parametrize(("significant", "over_gate", "verdict"), [
    (True, True, "fail"), (False, True, "inconclusive"),
    (True, False, "pass"), (False, False, "pass")])
def test_effect_verdict_passes_only_within_the_gate(significant: bool, over_gate: bool,
                                                    verdict: str) -> None:
    assert effect_verdict(significant, over_gate) == verdict
    if verdict == "inconclusive":  # over the gate with a test that does not lean: noise
        assert effect_verdict(significant, over_gate, leaning=False) == "pass"


@pytest.mark.parametrize(("factor", "p", "verdict"), [
    (1.25, 0.056, "inconclusive"),  # the trial's numbers: over the x1.10 gate, p > alpha
    (1.25, 0.0005, "fail"),         # the same effect, significant
    (1.05, 0.056, "pass"),          # within the gates: no evidence of harm needed
    (1.05, 1e-9, "pass")])          # significant but within the tolerances
def test_latency_verdict_on_injected_p(factor: float, p: float, verdict: str) -> None:
    base, canary = quantiles(400), quantiles(46, factor)
    r = latency_verdict("ttft", base, canary, p, STEP_TH, {}, "Mann-Whitney")
    assert r.decision == verdict, r.reason
    assert r.numbers["p_value"] == p and r.numbers["alpha"] == pytest.approx(0.01 / 9)
    if verdict == "inconclusive":
        assert r.reason.startswith("ttft inconclusive: P50 x1.2")
        assert "not below 0.00111 yet" in r.reason


@pytest.mark.parametrize(("p", "verdict"), [(0.05, "inconclusive"), (0.32, "pass")])
def test_a_p99_over_its_gate_waits_only_while_the_test_leans_to_a_regression(
        p: float, verdict: str) -> None:
    """The same median, a long tail (P99 over its x1.2 gate): inconclusive while the test
    leans toward a regression (p < lean_p, 0.10); at p = 0.32 (a good canary end to end:
    ITL P50 x0.88, P99 x1.28) the tail is a percentile's noise and passes."""
    base = quantiles(400)
    canary = [*quantiles(200)[:-4], 3.0, 3.0, 3.0, 3.0]
    r = latency_verdict("itl", base, canary, p, STEP_TH, {}, "Mann-Whitney")
    r50, r99 = r.numbers["p50_ratio"], r.numbers["p99_ratio"]
    assert isinstance(r50, float) and r50 < 1.1 and isinstance(r99, float) and r99 > 1.2
    assert r.decision == verdict, r.reason
    assert "P99 x" in r.reason and "over its x1.2 gate" in r.reason
    assert "P50 x" not in r.reason.split(":")[1] or verdict == "pass"  # only what is over
    if verdict == "pass":
        assert "does not lean toward a regression" in r.reason


def test_a_p99_of_fewer_than_100_samples_is_shown_not_gated() -> None:
    """The 99th percentile of 46 values is their largest: a single draw, not a gate (a
    user's trial: an x1.25 release allowed x1.45 at P99 was rolled back on P99 x1.49 read
    off 29 baseline samples)."""
    base = quantiles(400)
    canary = [*quantiles(46)[:-2], 3.0, 3.0]
    r = latency_verdict("itl", base, canary, 0.05, STEP_TH, {}, "Mann-Whitney")
    r99 = r.numbers["p99_ratio"]
    assert isinstance(r99, float) and r99 > 1.2
    assert r.decision == "pass" and "(not gated)" in r.reason, r.reason


@pytest.mark.parametrize(("canary_errors", "canary_n", "verdict"), [
    (0, 40, "pass"),          # no excess
    (2, 40, "inconclusive"),  # 5 % against 0.1 %: Fisher p = 0.0014, not below 0.0011
    (5, 40, "fail"),          # 12.5 %: significant
    (1, 400, "pass")])        # 0.25 %: under the 0.5-point gate
def test_error_rate_small_samples(canary_errors: int, canary_n: int, verdict: str) -> None:
    r = compare_errors(4, 4000, canary_errors, canary_n, STEP_TH)
    assert r.decision == verdict, r.reason
    if verdict == "inconclusive":
        assert r.reason.startswith("error_rate inconclusive: 5.00% vs 0.10%, over the 0.50%")


def test_combine_orders_fail_insufficient_inconclusive_pass() -> None:
    ok, maybe = MetricResult("ttft", "pass", "a"), MetricResult("itl", "inconclusive", "b")
    short, bad = MetricResult("error_rate", "insufficient", "c"), MetricResult("ttft", "fail", "d")
    assert combine([ok]).decision == "pass"
    assert (combine([ok, maybe]).decision, combine([ok, maybe]).reason) == ("inconclusive", "b")
    assert combine([maybe, short]).decision == "insufficient"
    assert combine([maybe, short, bad]).decision == "fail"


PLAN = RolloutPlan("m1", "v1", "v3", steps=(0.1, 0.5, 1.0), min_step_s=10.0,
                   min_step_requests=20, max_step_s=600.0, recheck_s=10.0,
                   thresholds=Thresholds(min_samples=20, min_requests=20,
                                             min_calibration_probes=0))


def feed(r: Rollout, version: str, values: list[float]) -> None:
    for v in values:
        r.observe(version, v, v / 10, False)  # type: ignore[arg-type]


def test_an_inconclusive_step_waits_then_fails_once_the_regression_is_significant() -> None:
    r = Rollout(PLAN, 0.0, random.Random(1))
    feed(r, "baseline", quantiles(400))
    feed(r, "canary", quantiles(24, 1.25))
    assert r.tick(10.0) is None  # due, but inconclusive: no decision
    cmp = r.last_comparison
    assert cmp is not None
    assert cmp.decision == "inconclusive", cmp.reason
    assert r.status == "running" and r.step == 0
    feed(r, "canary", quantiles(200, 1.25))  # more samples of the same slow canary
    rec = r.tick(20.0)
    assert rec is not None and rec.outcome == "rolled_back", r.last_comparison
    assert rec.reason.startswith("ttft regression") and rec.step == 0


@pytest.mark.parametrize("on", ["rollback", "hold"])
def test_still_inconclusive_at_max_step_s_is_rolled_back_or_held(
        on: Literal["rollback", "hold"]) -> None:
    plan = dataclasses.replace(PLAN, on_insufficient=on)
    r = Rollout(plan, 0.0, random.Random(1))
    feed(r, "baseline", quantiles(400))
    feed(r, "canary", quantiles(24, 1.25))
    for t in range(10, 600, 10):
        assert r.tick(float(t)) is None, t
    rec = r.tick(600.0)
    assert rec is not None and rec.cause == "inconclusive"
    if on == "rollback":
        assert (rec.outcome, r.status) == ("rolled_back", "rolled_back")
        assert rec.reason.startswith("inconclusive after 600 s: ttft inconclusive")
    else:
        assert (rec.outcome, r.status) == ("hold", "running")
        assert rec.reason.startswith("holding past 600 s: ttft inconclusive")


def test_a_good_canary_is_not_held_by_the_new_rule() -> None:
    r = Rollout(PLAN, 0.0, random.Random(1))
    feed(r, "baseline", quantiles(400))
    feed(r, "canary", quantiles(24))
    rec = r.tick(10.0)
    assert rec is not None and rec.outcome == "pass", r.last_comparison


def test_alpha_is_spent_over_a_steps_looks_within_the_steps_alpha() -> None:
    """3/4 of a step's alpha at its first decisive look, then 1/8, 1/16, ...: however many
    looks an inconclusive step takes, their levels sum to at most the step's alpha."""
    th = TRIAL_TH.per_step(3)
    levels = [th.at_look(k).alpha for k in range(60)]
    assert levels[0] == pytest.approx(0.75 * th.alpha)
    assert levels[1:4] == pytest.approx([th.alpha / 8, th.alpha / 16, th.alpha / 32])
    assert sum(levels) <= th.alpha
    with pytest.raises(ValueError, match="look index"):
        th.at_look(-1)


def test_an_inconclusive_step_looks_again_only_on_twice_the_sample() -> None:
    r = Rollout(PLAN, 0.0, random.Random(1))
    feed(r, "baseline", quantiles(400))
    feed(r, "canary", quantiles(24, 1.25))
    assert r.tick(10.0) is None and r.looks == 1  # inconclusive at 24 canary requests
    first = r.last_comparison
    assert first is not None and first.decision == "inconclusive"
    ttft = next(m for m in first.metrics if m.metric == "ttft")
    assert ttft.numbers["alpha"] == pytest.approx(0.75 * 0.01 / 9)
    feed(r, "canary", quantiles(20, 1.25))  # 44 < 2 x 24: no look, no alpha spent
    assert r.tick(20.0) is None and r.looks == 1
    feed(r, "canary", quantiles(8, 1.25))  # 52: the second decisive look, at 1/8
    r.tick(30.0)
    assert r.looks == 2
    assert r.last_comparison is not None
    ttft = next(m for m in r.last_comparison.metrics if m.metric == "ttft")
    assert ttft.numbers["alpha"] == pytest.approx(0.01 / 9 / 8)


def test_whole_answers_are_compared_only_with_whole_answers() -> None:
    """A non-streamed request's TTFT is its whole answer's time (~10x a first token here):
    filed under its own strata, a good canary whose traffic streams less often than the
    baseline's still compares at x1 (a user's trial, pooled, read P50 x5.67)."""
    r = Rollout(PLAN, 0.0, random.Random(1))
    for version, streamed_share in (("baseline", 0.8), ("canary", 0.2)):
        n = 400 if version == "baseline" else 100
        k = round(n * streamed_share)
        for v in quantiles(k):
            r.observe(version, v, v / 10, False, load=1)  # type: ignore[arg-type]
        for v in quantiles(n - k, 10.0):
            r.observe(version, v, None, False, load=1, streamed=False)  # type: ignore[arg-type]
    cmp = r.compare()
    ttft = next(m for m in cmp.metrics if m.metric == "ttft")
    assert ttft.decision == "pass", ttft.reason
    r50 = ttft.numbers["p50_ratio"]
    assert isinstance(r50, float) and 0.9 < r50 < 1.1, ttft.reason


@pytest.mark.parametrize(("requests", "samples", "decision"), [
    (36, 14, "insufficient"),  # half streamed, a short step: wait for the samples
    (400, 5, "pass"),          # ~1 % streamed: the traffic does not make ITL
])
def test_itl_is_not_measured_only_when_the_traffic_hardly_makes_it(
        requests: int, samples: int, decision: str) -> None:
    from gateway.traffic.rollout_stats import compare_latency
    r = compare_latency("itl", quantiles(samples), quantiles(40), TRIAL_TH, requests)
    assert r.decision == decision, r.reason
