"""The scheduler layer of admission (pure, times as arguments): the in-flight bound, the
priority queue, predicted waits and their Retry-After (``gateway.traffic.scheduler``)."""

from __future__ import annotations

import math

import pytest

from gateway.core.vocab import Prio
from gateway.traffic.scheduler import Scheduler


def test_scheduler_runs_until_full_then_queues_in_priority_order():
    s = Scheduler(max_in_flight=2, max_queued=10)
    assert s.offer(Prio.LOW, 0).action == "run"
    assert s.offer(Prio.LOW, 0).action == "run"
    for name, prio in [("low1", Prio.LOW), ("norm", Prio.NORMAL), ("high", Prio.HIGH),
                       ("low2", Prio.LOW)]:
        assert s.offer(prio, 0).action == "queue"
        s.enqueue(prio, name)
    assert s.running == [0, 0, 2]
    order = [s.release(1.0, prio=Prio.LOW) for _ in range(2)]
    assert s.running == [1, 1, 0], "each slot handed on is counted in its new class"
    order += [s.release(1.0, prio=Prio.HIGH), s.release(1.0, prio=Prio.NORMAL)]
    assert order == ["high", "norm", "low1", "low2"]
    assert s.in_flight == 2, "each release handed its slot on"
    assert s.running == [0, 0, 2]
    assert s.release(2.0, prio=Prio.LOW) is None and s.release(2.0, prio=Prio.LOW) is None
    assert s.in_flight == 0 and s.running == [0, 0, 0]


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
        s.release(5.0, prio=Prio.NORMAL)
    for i in range(9):
        s.enqueue(Prio.NORMAL, i)
    # 9 ahead + itself = 10 requests at 2/s -> 5 s
    assert s.retry_after(Prio.NORMAL, 10.0) == pytest.approx(5.0)
    assert s.retry_after(Prio.HIGH, 10.0) == pytest.approx(1.0)  # nobody ahead of high


def test_unbounded_scheduler_always_runs():
    s = Scheduler(max_in_flight=None, max_queued=0)
    assert all(s.offer(Prio.LOW, 0).action == "run" for _ in range(1000))


def test_service_rate_from_slot_hold_time_ignores_idle_periods():
    s = Scheduler(max_in_flight=4, max_queued=10, service_alpha=0.5)
    for _ in range(4):
        s.offer(Prio.NORMAL, 0.0)
    s.release(1.0, held_s=2.0, prio=Prio.NORMAL)
    assert s.service_rate(1.0) == pytest.approx(2.0)  # 4 slots / 2 s
    assert s.service_rate(500.0) == pytest.approx(2.0), "an idle hour does not slow it"
    s.release(501.0, held_s=1.0, prio=Prio.NORMAL)
    assert s.service_s == pytest.approx(1.5)


def test_predicted_wait_over_bound_is_refused_at_once_with_that_wait():
    """Honest 429: a request whose predicted wait exceeds ``max_wait_s`` is refused on
    arrival, instead of waiting out the bound first, with Retry-After = the time until its
    predicted wait is back under the bound; a high-priority request with nobody ahead of
    it is still queued."""
    s = Scheduler(max_in_flight=2, max_queued=100, max_wait_s=3.0)
    s.offer(Prio.NORMAL, 0.0)
    s.offer(Prio.NORMAL, 0.0)
    s.release(0.0, held_s=1.0, prio=Prio.NORMAL)  # 2 slots / 1 s = 2 requests/s
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
    s.release(0.0, held_s=0.5, prio=Prio.HIGH)  # mu = 2/s
    for i in range(1, 10):  # one high request per second takes the slot
        assert s.offer(Prio.HIGH, float(i)).action == "run"
        s.release(i + 0.5, held_s=0.5, prio=Prio.HIGH)
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
        # the slot's holder ends: the normal request first, then each high one woken
        s.release(9.7, held_s=0.5, prio=Prio.NORMAL if i == 0 else Prio.HIGH)
    assert s.predicted_wait(Prio.LOW, 9.8) == math.inf
    assert s.retry_after(Prio.LOW, 9.8) == 60.0
