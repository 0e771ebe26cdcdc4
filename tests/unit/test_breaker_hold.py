"""The breaker's fleet-mode seam: held open by another replica's trip (pure, fake clock)."""

from __future__ import annotations

from gateway.traffic.breaker import BreakerConfig, BreakerState, CircuitBreaker


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_a_held_breaker_takes_no_request_and_no_probe_until_the_hold_ends():
    c = Clock()
    br = CircuitBreaker(BreakerConfig(open_base_s=1.0), c)
    br.hold_open_until(105.0)
    assert br.held and br.current() is BreakerState.OPEN and not br.can_take()
    assert br.retry_in() == 5.0
    c.t = 104.9
    assert not br.can_take()
    br.hold_open_until(108.0)  # the owner renewed its record
    c.t = 107.0
    assert not br.can_take()
    c.t = 108.0  # the owner is gone: the usual local half-open, one probe
    assert br.current() is BreakerState.HALF_OPEN
    probe = br.acquire()
    assert probe is not None and not br.can_take()


def test_release_closes_a_held_breaker_but_leaves_its_own_trip_alone():
    c = Clock()
    br = CircuitBreaker(BreakerConfig(consecutive_failures=1, open_base_s=10.0), c)
    br.hold_open_until(105.0)
    assert br.release_hold() and br.current() is BreakerState.CLOSED and not br.held
    assert br.on_failure()  # a trip of its own
    assert not br.held
    assert not br.release_hold() and br.current() is BreakerState.OPEN


def test_a_hold_shorter_than_its_own_open_time_keeps_its_own_trip():
    c = Clock()
    br = CircuitBreaker(BreakerConfig(consecutive_failures=1, open_base_s=10.0), c)
    br.on_failure()
    br.hold_open_until(103.0)
    assert not br.held and br.open_until == 110.0
    br.hold_open_until(120.0)  # a longer hold from the owner of the fleet's record
    assert br.held and br.open_until == 120.0


def test_a_failed_local_probe_after_a_hold_is_a_trip_of_its_own():
    c = Clock()
    br = CircuitBreaker(BreakerConfig(open_base_s=2.0), c)
    br.hold_open_until(101.0)
    c.t = 101.0
    probe = br.acquire()
    assert br.on_failure(probe)
    assert not br.held and br.current() is BreakerState.OPEN and br.open_until == 103.0
