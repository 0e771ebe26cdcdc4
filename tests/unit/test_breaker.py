"""Circuit breaker decisions with a fake clock (``gateway.traffic.breaker``)."""

from __future__ import annotations

import pytest

from gateway.traffic.breaker import BreakerConfig, BreakerState, CircuitBreaker


class Clock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def make(**kw: float) -> tuple[CircuitBreaker, Clock]:
    clock = Clock()
    return CircuitBreaker(BreakerConfig(**kw), clock), clock  # type: ignore[arg-type]


def test_opens_after_consecutive_failures_only():
    br, _ = make(consecutive_failures=3, min_requests=1000)
    br.on_failure()
    br.on_failure()
    assert br.current() is BreakerState.CLOSED and br.can_take()
    br.on_success()  # a success in between resets the run
    br.on_failure()
    br.on_failure()
    assert br.current() is BreakerState.CLOSED
    br.on_failure()
    assert br.current() is BreakerState.OPEN
    assert not br.can_take()
    assert br.last_trip_reason == "consecutive_failures"


def test_neutral_outcomes_never_count():
    """4xx caused by the request, 429 and client disconnects (DESIGN.md decisions)."""
    br, _ = make(consecutive_failures=2, min_requests=2, error_rate=0.1)
    for _ in range(50):
        br.on_neutral()
    assert br.current() is BreakerState.CLOSED
    assert br.consecutive == 0


def test_error_rate_over_window():
    br, clock = make(consecutive_failures=100, min_requests=10, error_rate=0.5, window_s=10)
    for i in range(20):  # alternate: 50% errors, never 2 in a row
        if i % 2:
            br.on_failure()
        else:
            br.on_success()
        clock.t += 0.1
    assert br.current() is BreakerState.OPEN
    assert br.last_trip_reason == "error_rate"


def test_error_rate_forgets_old_failures():
    br, clock = make(consecutive_failures=100, min_requests=10, error_rate=0.5, window_s=10)
    for _ in range(4):
        br.on_failure()
        br.on_success()
    clock.t += 30  # the window has passed: the old requests no longer count
    br.on_success()
    br.on_failure()  # 10 requests, 5 failures, if the old ones still counted
    assert br.current() is BreakerState.CLOSED


def test_half_open_lets_one_probe_through_and_closes_on_success():
    br, clock = make(consecutive_failures=1, open_base_s=5, half_open_max=1)
    br.on_failure()
    assert br.retry_in() == pytest.approx(5.0)
    clock.t += 4.9
    assert not br.can_take()
    clock.t += 0.2
    assert br.current() is BreakerState.HALF_OPEN
    assert br.can_take()
    probe = br.acquire()  # the probe request
    assert probe is not None
    assert not br.can_take(), "only one probe at a time, not all traffic"
    br.on_success(probe=probe)
    assert br.current() is BreakerState.CLOSED
    assert br.can_take()


def test_failed_probes_reopen_for_longer_up_to_cap():
    br, clock = make(consecutive_failures=1, open_base_s=5, open_max_s=30)
    br.on_failure()
    seen = [br.retry_in()]
    for _ in range(4):
        clock.t += br.retry_in() + 0.01
        assert br.current() is BreakerState.HALF_OPEN
        probe = br.acquire()
        br.on_failure(probe)  # the probe fails: open again, for longer
        seen.append(br.retry_in())
    assert [round(x) for x in seen] == [5, 10, 20, 30, 30]
    clock.t += br.retry_in() + 0.01
    probe = br.acquire()
    br.on_success(probe=probe)
    assert br.current() is BreakerState.CLOSED


def test_neutral_frees_half_open_slot_without_closing():
    br, clock = make(consecutive_failures=1, open_base_s=1)
    br.on_failure()
    clock.t += 1.5
    probe = br.acquire()
    assert not br.can_take()
    br.on_neutral(probe)  # the probe met a 400: says nothing, frees the slot
    assert br.current() is BreakerState.HALF_OPEN and br.can_take()


def test_only_probes_free_slots_and_close_the_breaker():
    """A request booked while closed that ends during half-open holds no probe slot: its
    hang-up frees none and its success does not close the breaker while the probe is out;
    a probe of an earlier half-open period frees none of the next one's slots."""
    br, clock = make(consecutive_failures=1, open_base_s=1, half_open_max=1)
    old = br.acquire()  # an ordinary request, sent while closed
    assert old is None
    br.on_failure()  # another request fails: open
    clock.t += 1.5
    probe = br.acquire()
    assert probe is not None and not br.can_take()
    br.on_neutral(old)  # the old request's client hangs up
    assert not br.can_take(), "a slot freed that no probe gave back"
    br.on_success(probe=old)  # or it ends well
    assert br.current() is BreakerState.HALF_OPEN and not br.can_take()
    br.on_failure(probe)  # the probe fails: open again (longer), then half-open again
    clock.t += br.retry_in() + 0.01
    fresh = br.acquire()
    assert fresh is not None and fresh != probe and br.half_open_in_flight == 1
    br.on_neutral(probe)  # a late outcome of the earlier period's probe
    assert br.half_open_in_flight == 1 and not br.can_take()
    br.on_success(probe=fresh)
    assert br.current() is BreakerState.CLOSED and br.half_open_in_flight == 0


def test_closing_forgets_the_other_probes_slots():
    br, clock = make(consecutive_failures=1, open_base_s=1, half_open_max=2)
    br.on_failure()
    clock.t += 1.5
    first, second = br.acquire(), br.acquire()
    br.on_success(probe=first)
    assert br.current() is BreakerState.CLOSED and br.half_open_in_flight == 0
    br.on_success(probe=second)  # counted like any success now
    assert br.current() is BreakerState.CLOSED and br.half_open_in_flight == 0


def test_trip_count_resets_after_a_long_healthy_period():
    br, clock = make(consecutive_failures=1, open_base_s=5, open_max_s=60)
    br.on_failure()
    clock.t += 5.1
    probe = br.acquire()
    br.on_success(probe=probe)
    clock.t += 61  # closed for longer than open_max_s
    br.on_failure()
    assert br.retry_in() == pytest.approx(5.0)


def test_latency_fuse_trips_on_p99_over_five_times_slo():
    br, _ = make(ttft_slo_s=0.5, latency_fuse_factor=5, latency_min_samples=20, window_s=30)
    for _ in range(100):
        br.on_success(ttft_s=0.2)
    assert not br.evaluate()
    for _ in range(5):  # 5 of 105 slow: P99 is slow
        br.on_success(ttft_s=3.0)
    assert br.evaluate()
    assert br.current() is BreakerState.OPEN and br.last_trip_reason == "latency_fuse"


def test_latency_fuse_needs_samples_and_forgets_old_ones():
    br, clock = make(ttft_slo_s=0.5, latency_min_samples=20, window_s=30)
    for _ in range(10):
        br.on_success(ttft_s=10.0)
    assert not br.evaluate(), "too few samples to judge"
    for _ in range(20):
        br.on_success(ttft_s=10.0)
    clock.t += 31
    for _ in range(25):
        br.on_success(ttft_s=0.1)
    assert not br.evaluate(), "the slow samples are outside the window"


def test_latency_fuse_off_without_slo():
    br, _ = make()
    for _ in range(100):
        br.on_success(ttft_s=100.0)
    assert not br.evaluate()
