"""Canary vs baseline latencies at matched load (gateway.traffic.rollout_strata): pure,
seeded samples whose latency depends on the load they were served at."""

from __future__ import annotations

import math
import random

import pytest
from scipy import stats

from gateway.traffic.rollout_stats import Thresholds, compare_latency, mann_whitney_greater
from gateway.traffic.rollout_strata import (
    compare_latency_matched,
    load_stratum,
    matched,
    reweighted_baseline,
    van_elteren_greater,
)

TH = Thresholds()


def served(rng: random.Random, n: int, in_flight: int, factor: float = 1.0
           ) -> tuple[list[float], list[int]]:
    """``n`` TTFTs (seconds) of a server at ``in_flight`` requests: 50 ms per request in
    flight (its queue and batch), times the build's ``factor``, lognormal noise."""
    vals = [factor * 0.05 * in_flight * math.exp(rng.gauss(0.0, 0.2)) for _ in range(n)]
    return vals, [load_stratum(in_flight)] * n


def joined(*parts: tuple[list[float], list[int]]) -> tuple[list[float], list[int]]:
    return [v for p in parts for v in p[0]], [s for p in parts for s in p[1]]


def test_strata_are_powers_of_two_and_zero_is_unknown() -> None:
    assert [load_stratum(n) for n in (0, -1, 1, 2, 3, 4, 5, 8, 9, 16, 17)] == [
        0, 0, 1, 2, 3, 3, 4, 4, 5, 5, 6]


def test_one_stratum_is_the_plain_mann_whitney_test() -> None:
    rng = random.Random(1)
    b, c = served(rng, 60, 2), served(rng, 40, 2, 1.1)
    _, p = van_elteren_greater(matched(b, c))
    assert p == pytest.approx(mann_whitney_greater(c[0], b[0])[1])
    assert p == pytest.approx(stats.mannwhitneyu(c[0], b[0], alternative="greater",
                                                 method="asymptotic").pvalue)
    plain = compare_latency("ttft", b[0], c[0], TH)
    assert compare_latency_matched("ttft", b, c, TH).decision == plain.decision


def test_a_slower_build_on_idle_servers_is_caught_though_the_loaded_baseline_is_slower() -> None:
    """The first step: the canary's servers are nearly idle (1-2 in flight), the baseline's
    busy (mostly 8, sometimes 1-2); the canary is x1.5 slower at any load. Compared whole,
    the canary looks faster; at matched load it is the regression it is."""
    rng = random.Random(2)
    base = joined(served(rng, 400, 8), served(rng, 60, 1), served(rng, 60, 2))
    can = joined(served(rng, 40, 1, 1.5), served(rng, 20, 2, 1.5))
    assert compare_latency("ttft", base[0], can[0], TH).decision == "pass"  # the load hid it
    got = compare_latency_matched("ttft", base, can, TH)
    assert got.decision == "fail", got.reason
    assert "matched load" in got.reason and got.numbers["strata"] == 2
    assert got.numbers["matched_baseline_n"] == 120


def test_a_good_build_carrying_twice_the_load_per_server_passes() -> None:
    """A 50 % step on one canary server beside two baseline ones: the canary runs at 4 in
    flight, the baseline at 2 (sometimes 3-4); the same build. Compared whole it fails on
    TTFT; at matched load it passes."""
    rng = random.Random(3)
    base = joined(served(rng, 300, 2), served(rng, 80, 4))
    can = joined(served(rng, 200, 4), served(rng, 40, 2))
    assert compare_latency("ttft", base[0], can[0], TH).decision == "fail"  # the load
    got = compare_latency_matched("ttft", base, can, TH)
    assert got.decision == "pass", got.reason


def test_versions_that_never_ran_at_a_comparable_load_are_insufficient() -> None:
    rng = random.Random(4)
    base, can = served(rng, 200, 16), served(rng, 200, 1)
    got = compare_latency_matched("ttft", base, can, TH)
    assert got.decision == "insufficient"
    assert "different loads" in got.reason and got.numbers["matched_canary_n"] == 0


def test_the_reweighted_baseline_has_the_canarys_mix_of_strata() -> None:
    groups = [(1, [1.0, 2.0, 3.0], [9.0]), (2, [10.0, 20.0], [9.0, 9.0, 9.0, 9.0])]
    out = reweighted_baseline(groups)
    assert len(out) == 5 and out[0] == pytest.approx(2.0)  # the median of stratum 1
    assert all(10.0 <= v <= 20.0 for v in out[1:])
