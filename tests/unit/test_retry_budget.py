"""Retry rules, retry budget and full-jitter backoff with a fake clock
(``gateway.traffic.retry``)."""

from __future__ import annotations

import random

import pytest

from gateway.traffic.retry import RetryBudget, RetryPolicy, should_retry


class Clock:
    def __init__(self, t: float = 500.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


@pytest.mark.parametrize("kind", ["connect", "disconnected", "status", "rate_limited", "drained"])
def test_retryable_kinds(kind: str) -> None:
    assert should_retry(kind, 1, 3)
    assert not should_retry(kind, 3, 3), "never past max attempts"


@pytest.mark.parametrize("kind", ["ttfb_timeout", "idle_timeout", "client_error", "bad_request"])
def test_not_retried(kind: str) -> None:
    assert not should_retry(kind, 1, 3)


def test_budget_is_twenty_percent_of_requests_in_window():
    clock = Clock()
    b = RetryBudget(ratio=0.2, window_s=10.0, min_per_s=0.0, clock=clock)
    for _ in range(100):
        b.record_request()
    spent = sum(b.try_spend() for _ in range(50))
    assert spent == 20
    assert not b.try_spend()


def test_budget_floor_lets_a_quiet_gateway_fail_over():
    clock = Clock()
    b = RetryBudget(ratio=0.2, window_s=10.0, min_per_s=0.5, clock=clock)  # floor: 5
    b.record_request()
    assert sum(b.try_spend() for _ in range(10)) == 5


def test_budget_refills_as_the_window_slides():
    clock = Clock()
    b = RetryBudget(ratio=0.2, window_s=10.0, min_per_s=0.0, clock=clock)
    for _ in range(10):
        b.record_request()
    assert b.try_spend() and b.try_spend() and not b.try_spend()
    clock.t += 11  # old requests and retries leave the window
    assert not b.try_spend(), "no requests in the window: nothing to spend"
    for _ in range(10):
        b.record_request()
    assert b.try_spend() and b.try_spend() and not b.try_spend()


def test_failing_fleet_cannot_multiply_load():
    """Every request fails and wants a retry: retries stay <= 20% (+ floor) of requests."""
    clock = Clock()
    b = RetryBudget(ratio=0.2, window_s=10.0, min_per_s=0.1, clock=clock)
    requests = retries = 0
    for _ in range(1000):  # 100 req/s for 10 s
        b.record_request()
        requests += 1
        retries += b.try_spend()
        clock.t += 0.01
    assert retries <= 0.2 * requests + 1
    assert (requests + retries) / requests <= 1.2 + 1e-9


def test_full_jitter_first_delay_bounds():
    p = RetryPolicy(backoff_base_s=0.1, backoff_max_s=1.0, rng=random.Random(7))
    delays = [p.first_delay() for _ in range(2000)]
    assert min(delays) >= 0.0 and max(delays) <= 0.1
    assert 0.04 < sum(delays) / len(delays) < 0.06, "uniform(0, base): mean base/2"
    capped = RetryPolicy(backoff_base_s=5.0, backoff_max_s=0.2, rng=random.Random(1))
    assert max(capped.first_delay() for _ in range(500)) <= 0.2


def test_a_hung_backend_re_send_is_counted_but_never_refused():
    """``spend`` (a re-send off a hung backend) always goes through and takes room from the
    ordinary retries that follow."""
    clock = Clock()
    b = RetryBudget(ratio=0.2, window_s=10.0, min_per_s=1.0, clock=clock)  # floor: 10
    for _ in range(20):
        b.record_request()
    for _ in range(16):  # more than the budget holds
        b.spend()
    assert not b.try_spend(), "the forced re-sends used the budget up"
    clock.t += 11
    b.record_request()
    assert b.try_spend(), "and left the window with it"
    assert should_retry("backend_hung", 1, 2)
