"""TTFT strata by prefill load (gateway.traffic.rollout_strata.ttft_stratum) and the
backend's prefill load on the request path (gateway.fleet.backend.Backend.prefill_load):
pure, injected values and seeded samples."""

from __future__ import annotations

import math
import random

from gateway.config import BackendConfig
from gateway.fleet.backend import Backend
from gateway.traffic.rollout import Rollout, RolloutPlan
from gateway.traffic.rollout_stats import Thresholds
from gateway.traffic.rollout_strata import (
    STRATA_BASE,
    compare_latency_matched,
    load_stratum,
    prefill_class,
    ttft_stratum,
)

TH = Thresholds()


def test_prefill_classes_are_exact_to_four_then_powers_of_two() -> None:
    assert [prefill_class(n) for n in (0, -3, 1, 2, 3, 4, 5, 8, 9, 16, 17, 32)] == [
        0, 0, 1, 2, 3, 4, 5, 5, 6, 6, 7, 7]


def test_a_ttft_stratum_combines_prefill_and_in_flight_classes() -> None:
    assert ttft_stratum(6, 2) == 2 * STRATA_BASE + load_stratum(6)
    assert ttft_stratum(6, 3) != ttft_stratum(6, 2)  # same in-flight class, more prefills
    assert ttft_stratum(5, 2) == ttft_stratum(8, 2)  # in flight 5-8: one class
    assert ttft_stratum(6) == load_stratum(6)  # prefill load unknown: the load's class


def pooled(rng: random.Random, n: int, waits: list[float]) -> tuple[list[float], list[int]]:
    """``n`` TTFTs (seconds) of one build at 6 in flight, the prefill load drawn with
    ``waits`` (weights of 1, 2, 3 requests before their first token, this one included):
    40 ms per prefill waited behind, lognormal noise."""
    vals: list[float] = []
    strata: list[int] = []
    for _ in range(n):
        k = rng.choices((1, 2, 3), waits)[0]
        vals.append(0.04 * k * math.exp(rng.gauss(0.0, 0.2)))
        strata.append(ttft_stratum(6, k))
    return vals, strata


def test_a_good_canary_on_one_server_waits_behind_more_prefills_and_passes() -> None:
    """1 canary server of 4 at the same requests in flight as the baseline's: its requests
    more often meet another's prefill (no router to pick an idle server). The same build;
    by in-flight count alone it fails, by prefill load it passes."""
    rng = random.Random(7)
    base = pooled(rng, 600, [0.7, 0.25, 0.05])
    can = pooled(rng, 200, [0.4, 0.4, 0.2])
    by_load = ([*base[0]], [s % STRATA_BASE for s in base[1]])
    can_by_load = ([*can[0]], [s % STRATA_BASE for s in can[1]])
    assert compare_latency_matched("ttft", by_load, can_by_load, TH).decision == "fail"
    got = compare_latency_matched("ttft", base, can, TH)
    assert got.decision == "pass", got.reason
    assert got.numbers["strata"] == 3


def test_a_slower_canary_on_one_server_is_still_caught() -> None:
    rng = random.Random(8)
    base = pooled(rng, 600, [0.7, 0.25, 0.05])
    slow = pooled(rng, 200, [0.4, 0.4, 0.2])
    slow = ([v * 1.5 for v in slow[0]], slow[1])
    got = compare_latency_matched("ttft", base, slow, TH)
    assert got.decision == "fail", got.reason


def test_rollout_observe_files_a_ttft_under_its_prefill_load() -> None:
    """The state machine compares TTFTs at the prefill load they were sent at: the good
    canary of the test above, observed request by request, passes its step (on 600
    canary TTFTs: on 200 its P99 read x1.3, over the 20 % gate, and the step would wait
    as inconclusive, :mod:`gateway.traffic.rollout_stats`)."""
    rng = random.Random(9)
    plan = RolloutPlan("m", "v1", "v2", steps=(0.25, 1.0), min_step_s=0.0,
                       min_step_requests=100)
    r = Rollout(plan, 0.0, random.Random(1))
    for version, n, waits in (("baseline", 1800, [0.7, 0.25, 0.05]),
                              ("canary", 600, [0.4, 0.4, 0.2])):
        vals, strata = pooled(rng, n, waits)
        for v, s in zip(vals, strata, strict=True):
            r.observe(version, v, 0.01, False, load=6,  # type: ignore[arg-type]
                      prefill_load=s // STRATA_BASE)
    ttft = next(m for m in r.compare().metrics if m.metric == "ttft")
    assert ttft.decision == "pass", ttft.reason
    assert ttft.numbers["strata"] == 3


class Cut:
    """A stand-in cut handle (the backend only keeps it in sets)."""

    def cut(self, reason: object) -> None:  # pragma: no cover - never called here
        pass


def test_a_backends_prefill_load_counts_each_attempt_once_until_its_answer_or_end() -> None:
    b = Backend(BackendConfig.model_validate({"id": "b1", "url": "http://h:1"}))
    a, c = Cut(), Cut()
    b.attempt_started(a, 1, 0, 0.0, "m")
    b.attempt_started(c, 1, 0, 0.0, None)
    assert b.prefill_load == 2 and b.in_flight == 2
    b.answer_started(a, 0.1)
    assert b.prefill_load == 1 and b.in_flight == 2  # decoding: in flight, not prefilling
    b.answer_started(a, 0.2)  # a second answer start: no effect
    assert b.prefill_load == 1
    b.attempt_ended(c, 1, 0)  # failed before its answer
    b.attempt_ended(a, 1, 0)
    assert b.prefill_load == 0 and b.in_flight == 0
    b.calibration_round(1)
    assert b.prefill_load == 1 and b.in_flight == 1
    b.calibration_round(-1)
    assert b.prefill_load == 0 and b.in_flight == 0
