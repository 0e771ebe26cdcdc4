"""Admission decisions (pure, times as arguments): token buckets, per-key limits, the
priority scheduler, Retry-After prediction, saturation shedding, degraded mode
(``gateway.traffic.admission``)."""

from __future__ import annotations

import math

import pytest

from gateway.core.vocab import Prio
from gateway.traffic.admission import (
    DegradedMode,
    KeyLimiter,
    Saturation,
    Scheduler,
    TokenBucket,
    as_count,
    clamp_retry_after,
    completion_budget,
    estimate_tokens,
    pool_wait,
    ratelimit_duration,
    retry_after_s,
    shed,
    shed_retry_after,
    wait_level,
)


def test_token_bucket_refills_at_its_rate():
    b = TokenBucket(60, 60.0, now=0.0)  # 1 per second, burst 60
    b.take(60, 0.0)
    assert b.wait_for(1, 0.0) == pytest.approx(1.0)
    assert b.wait_for(1, 0.5) == pytest.approx(0.5)
    assert b.wait_for(1, 1.0) == 0.0
    assert b.wait_for(61, 1.0) == math.inf
    assert b.reset_in(1.0) == pytest.approx(59.0)


def test_key_limiter_rpm_verdicts_feed_ratelimit_headers():
    lim = KeyLimiter(rpm=3, tpm=None, now=0.0)
    verdicts = [lim.check(10, 0.0) for _ in range(4)]
    assert [v.admitted for v in verdicts] == [True, True, True, False]
    assert [v.remaining_requests for v in verdicts] == [2, 1, 0, 0]
    last = verdicts[-1]
    assert last.limit_requests == 3 and last.retry_after_s == pytest.approx(20.0)
    assert last.reason == "requests per minute"
    assert last.limit_tokens is None
    assert lim.check(10, 20.0).admitted


def test_key_limiter_tpm_and_oversized_request():
    lim = KeyLimiter(rpm=None, tpm=1000, now=0.0)
    assert lim.check(800, 0.0).admitted
    v = lim.check(400, 0.0)
    assert not v.admitted and v.reason == "tokens per minute"
    assert v.retry_after_s == pytest.approx(200 / (1000 / 60))
    huge = lim.check(5000, 0.0)
    assert not huge.admitted and "exceed" in huge.reason


def test_rejected_check_charges_nothing():
    lim = KeyLimiter(rpm=2, tpm=100, now=0.0)
    assert lim.check(90, 0.0).admitted
    assert not lim.check(90, 0.0).admitted  # tokens short
    assert lim.check(5, 0.0).admitted, "the refused request did not use a request slot"


def test_estimate_tokens():
    assert estimate_tokens(400, 50, 256) == 150
    assert estimate_tokens(400, None, 256) == 356


def test_completion_budget_reads_fields_as_vllm_does():
    """vLLM's pydantic reads ``"3000"`` and ``3000.0`` as 3000, and its chat endpoint
    prefers ``max_completion_tokens``: the budget is the larger field, times ``n``, never
    negative (a negative estimate would credit the token bucket)."""
    assert completion_budget({}) is None
    assert completion_budget({"max_tokens": "3000"}) == 3000
    assert completion_budget({"max_tokens": 3000.0}) == 3000
    assert completion_budget({"max_tokens": 1, "max_completion_tokens": 3000}) == 3000
    assert completion_budget({"max_tokens": -5000, "max_completion_tokens": 3000}) == 3000
    assert completion_budget({"max_tokens": -5000}) == 0
    assert completion_budget({"max_output_tokens": 700}) == 700  # the Responses API
    assert completion_budget({"max_tokens": 100, "n": 4}) == 100  # per sequence
    assert completion_budget({"max_tokens": True}) is None
    assert completion_budget({"max_tokens": "many"}) is None
    assert as_count(2.5) is None and as_count(float("nan")) is None and as_count([1]) is None
    assert estimate_tokens(400, 0, 256) == 100 and estimate_tokens(400, -50, 256) == 100
    assert estimate_tokens(400, 500, 256, sequences=8) == 100 + 4000  # 8 prompts
    assert estimate_tokens(400, None, 256, sequences=8) == 100 + 8 * 256  # n 8, no budget
    assert estimate_tokens(400, None, 256, sequences=0) == 100  # embeddings generate nothing


def test_full_limiter_is_like_a_new_one():
    lim = KeyLimiter(60, 600, 0.0)
    assert lim.full(0.0)
    assert lim.check(100, 0.0).admitted and not lim.full(0.0)
    assert not lim.full(5.0)  # 100 of 600 tokens back after 10 s
    assert lim.full(10.0)


def test_ratelimit_duration_format():
    assert ratelimit_duration(0.02) == "20ms"
    assert ratelimit_duration(1.5) == "1.5s"
    assert ratelimit_duration(360) == "6m0s"


def test_retry_after_bounds_and_littles_law():
    assert retry_after_s(10, 5.0) == pytest.approx(2.0)
    assert retry_after_s(1, 100.0) == 1.0  # floor 1 s
    assert retry_after_s(10_000, 1.0) == 60.0  # cap 60 s
    assert retry_after_s(5, 0.0) == 60.0  # nothing finishing: come back late
    assert clamp_retry_after(float("nan")) == 60.0


def test_scheduler_runs_until_full_then_queues_in_priority_order():
    s = Scheduler(max_in_flight=2, max_queued=10)
    assert s.offer(Prio.LOW, 0).action == "run"
    assert s.offer(Prio.LOW, 0).action == "run"
    for name, prio in [("low1", Prio.LOW), ("norm", Prio.NORMAL), ("high", Prio.HIGH),
                       ("low2", Prio.LOW)]:
        assert s.offer(prio, 0).action == "queue"
        s.enqueue(prio, name)
    order = [s.release(1.0) for _ in range(4)]
    assert order == ["high", "norm", "low1", "low2"]
    assert s.in_flight == 2, "each release handed its slot on"
    assert s.release(2.0) is None and s.release(2.0) is None
    assert s.in_flight == 0


def test_scheduler_sheds_low_first_when_queue_fills():
    s = Scheduler(max_in_flight=1, max_queued=10)
    s.offer(Prio.NORMAL, 0)
    for i in range(5):
        s.enqueue(Prio.NORMAL, i)
    low = s.offer(Prio.LOW, 0)
    assert low.action == "reject" and 1.0 <= low.retry_after_s <= 60.0  # 50% share
    assert s.offer(Prio.NORMAL, 0).action == "queue"
    for i in range(5, 10):
        s.enqueue(Prio.NORMAL, i)
    assert s.offer(Prio.NORMAL, 0).action == "reject"
    assert s.offer(Prio.HIGH, 0).action == "reject"  # full: high must evict
    assert s.evict_lowest(Prio.HIGH) == 9, "the newest lower-priority waiter gives way"
    assert s.evict_lowest(Prio.NORMAL) is None, "never evicts its own class"


def test_scheduler_retry_after_from_queue_over_service_rate():
    s = Scheduler(max_in_flight=1, max_queued=100, rate_window_s=10.0)
    s.offer(Prio.NORMAL, 0)
    for _ in range(20):  # 2 requests/s finished over the window
        s.enqueue(Prio.NORMAL, object())
        s.release(5.0)
    for i in range(9):
        s.enqueue(Prio.NORMAL, i)
    # 9 ahead + itself = 10 requests at 2/s -> 5 s
    assert s.retry_after(Prio.NORMAL, 10.0) == pytest.approx(5.0)
    assert s.retry_after(Prio.HIGH, 10.0) == pytest.approx(1.0)  # nobody ahead of high


def test_unbounded_scheduler_always_runs():
    s = Scheduler(max_in_flight=None, max_queued=0)
    assert all(s.offer(Prio.LOW, 0).action == "run" for _ in range(1000))


def test_pool_wait_is_the_least_loaded_backends_wait_over_the_slo():
    assert pool_wait([6.0, 1.5, math.inf]) == 1.5  # the router picks the least loaded
    assert pool_wait([]) == 0.0
    assert wait_level(3.0, slo_ttft_s=2.0).level == pytest.approx(1.5)
    assert wait_level(0.0, 2.0).level == 0.0


def test_shed_retry_after_is_the_excess_wait_over_the_class_bound():
    # 10 s predicted, high shed from 4 x 2 s = 8 s: come back in 2 s
    assert shed_retry_after(10.0, 4.0, 2.0) == pytest.approx(2.0)
    assert shed_retry_after(8.2, 4.0, 2.0) == 1.0  # at least 1 s
    assert shed_retry_after(500.0, 1.0, 2.0) == 60.0  # at most 60 s


def test_shed_low_first_high_last():
    levels = (2.0, 1.5, 1.0)
    assert [shed(p, Saturation(1.2), levels) for p in Prio] == [False, False, True]
    assert [shed(p, Saturation(1.6), levels) for p in Prio] == [False, True, True]
    assert [shed(p, Saturation(2.0), levels) for p in Prio] == [True, True, True]


def test_degraded_mode_enters_after_sustained_overload_and_lifts_step_by_step():
    d = DegradedMode(enter_after_s=10, step_s=30)
    t = 0.0
    while t < 9:
        assert d.update(True, t) == 0
        t += 1
    assert d.update(True, 10.0) == 1
    assert d.max_tokens_cap(512) == 512
    assert d.update(True, 20.0) == 2 and d.max_tokens_cap(512) == 256
    assert d.update(False, 21.0) == 2  # back under SLO: lifts one level per step_s
    assert d.update(False, 50.0) == 2
    assert d.update(False, 51.0) == 1
    assert d.update(True, 52.0) == 1  # overload again: the calm clock restarts
    assert d.update(False, 53.0) == 1
    assert d.update(False, 83.0) == 0
    assert d.max_tokens_cap(512) is None


def test_degraded_mode_level_is_capped():
    d = DegradedMode(enter_after_s=1, step_s=1, max_level=3)
    for t in range(100):
        d.update(True, float(t))
    assert d.level == 3 and d.max_tokens_cap(512) == 128


def test_service_rate_from_slot_hold_time_ignores_idle_periods():
    s = Scheduler(max_in_flight=4, max_queued=10, service_alpha=0.5)
    for _ in range(4):
        s.offer(Prio.NORMAL, 0.0)
    s.release(1.0, held_s=2.0)
    assert s.service_rate(1.0) == pytest.approx(2.0)  # 4 slots / 2 s
    assert s.service_rate(500.0) == pytest.approx(2.0), "an idle hour does not slow it"
    s.release(501.0, held_s=1.0)
    assert s.service_s == pytest.approx(1.5)


def test_predicted_wait_over_bound_is_refused_at_once_with_that_wait():
    """Honest 429: a request whose predicted wait exceeds ``max_wait_s`` is refused on
    arrival, instead of waiting out the bound first, with Retry-After = the time until its
    predicted wait is back under the bound; a high-priority request with nobody ahead of
    it is still queued."""
    s = Scheduler(max_in_flight=2, max_queued=100, max_wait_s=3.0)
    s.offer(Prio.NORMAL, 0.0)
    s.offer(Prio.NORMAL, 0.0)
    s.release(0.0, held_s=1.0)  # 2 slots / 1 s = 2 requests/s
    s.offer(Prio.NORMAL, 0.0)
    for i in range(6):
        s.enqueue(Prio.NORMAL, i)
    # 6 ahead + itself, at 2/s less the 3 normal grants over the 10 s window (0.3/s):
    # 4.1 s; let in again once that falls under the 3 s bound, in 1.1 s
    v = s.offer(Prio.LOW, 0.0)
    assert s.predicted_wait(Prio.LOW, 0.0) == pytest.approx(7 / 1.7)
    assert v.action == "reject" and v.retry_after_s == pytest.approx(7 / 1.7 - 3.0)
    assert "predicted wait" in v.reason
    assert s.offer(Prio.NORMAL, 0.0).action == "reject"
    assert s.offer(Prio.HIGH, 0.0).action == "queue"


def test_higher_class_traffic_lengthens_a_lower_class_wait():
    """While high-priority requests keep taking slots, a low request waits for the capacity
    they leave: (ahead + 1) / (mu - lambda_high); none left -> the 60 s cap."""
    s = Scheduler(max_in_flight=1, max_queued=100, rate_window_s=10.0)
    s.offer(Prio.HIGH, 0.0)
    s.release(0.0, held_s=0.5)  # mu = 2/s
    for i in range(1, 10):  # one high request per second takes the slot
        assert s.offer(Prio.HIGH, float(i)).action == "run"
        s.release(i + 0.5, held_s=0.5)
    assert s.rate_above(Prio.LOW, 9.5) == pytest.approx(1.0)  # 10 grants in the window
    assert s.rate_above(Prio.HIGH, 9.5) == 0.0
    s.offer(Prio.NORMAL, 9.6)  # holds the slot
    s.enqueue(Prio.LOW, "w")
    # 10 high grants and this normal one in the window: 1.1 slots/s taken above low
    assert s.predicted_wait(Prio.LOW, 9.6) == pytest.approx(2 / (2.0 - 1.1))
    assert s.predicted_wait(Prio.HIGH, 9.6) == pytest.approx(1 / 2.0)
    for i in range(20):  # high traffic now takes every slot the fleet has
        s.offer(Prio.HIGH, 9.7)
        s.enqueue(Prio.HIGH, i)
        s.release(9.7, held_s=0.5)
    assert s.predicted_wait(Prio.LOW, 9.8) == math.inf
    assert s.retry_after(Prio.LOW, 9.8) == 60.0


def test_refund_gives_back_what_a_later_refusal_charged():
    lim = KeyLimiter(rpm=2, tpm=1000, now=0.0)
    assert lim.check(400, 0.0).admitted
    lim.refund(400, 0.0)  # e.g. the queue was full: the key keeps its quota
    v = lim.check(400, 0.0)
    assert v.admitted and v.remaining_requests == 1 and v.remaining_tokens == 600
    lim.refund(10_000, 0.0)
    assert lim.check(1, 0.0).remaining_tokens == 999, "never above capacity"


def test_gate_forgets_clients_whose_limits_are_full_again():
    """Per-client limiters (``default_rpm``, keyed by client IP without keys) are dropped
    once their buckets are full again, so a stream of one-off clients cannot grow the
    table without bound; a client still being limited keeps its limiter."""
    from gateway.config import load_config
    from gateway.fleet.backend import Fleet
    from gateway.flow.admission import LIMITER_SWEEP_MIN, AdmissionGate
    from gateway.metrics import GatewayMetrics

    now = [0.0]
    cfg = load_config(None, admission={"default_rpm": 60})
    gate = AdmissionGate(cfg, Fleet(cfg.backends), GatewayMetrics(), clock=lambda: now[0])
    busy = gate._limiter("busy", None)
    assert busy is not None
    for _ in range(60):
        busy.check(1, now[0])  # used up: a minute to refill
    for i in range(10 * LIMITER_SWEEP_MIN):
        now[0] += 0.001
        lim = gate._limiter(f"10.0.{i // 256}.{i % 256}", None)
        assert lim is not None
        lim.check(1, now[0])  # one request each: full again a second later
    assert len(gate.limiters) <= 2 * LIMITER_SWEEP_MIN + 1
    assert gate.limiters.get("busy") is busy
