"""Maintenance-cycle schedules, staggering and slow start (pure, fake clock)."""

from __future__ import annotations

import math
import random

import pytest

from gateway.config import BackendConfig, LifecycleConfig, RoutingWeights
from gateway.core.vocab import BackendState
from gateway.fleet.backend import Backend
from gateway.fleet.cycles import CycleKind, cycle_started, due_cycle, initial_cycle_clock
from gateway.fleet.lifecycle import max_unavailable, may_take_out
from gateway.routing.policy import AffinityTable, LoadThermalPolicy, slow_start_weight

S = BackendState
CFG = LifecycleConfig()  # short 300 s, medium 1800 s / 10,000 requests, long 4 h


def fleet(n: int, model: str = "m") -> list[Backend]:
    out = []
    for i in range(n):
        b = Backend(config=BackendConfig(id=f"b{i}", url=f"http://h:{8000 + i}"))
        b.state, b.models = S.WARM, (model,)
        out.append(b)
    return out


def test_first_due_times_are_spread_over_the_period():
    clocks = [initial_cycle_clock(i, 3, 0.0, CFG) for i in range(3)]
    assert [c.next_medium for c in clocks] == [600.0, 1200.0, 1800.0]
    assert [c.next_short for c in clocks] == [100.0, 200.0, 300.0]
    assert [c.next_long for c in clocks] == [4800.0, 9600.0, 14400.0]


def test_due_order_and_rescheduling():
    c = initial_cycle_clock(0, 1, 0.0, CFG)
    assert due_cycle(c, 299.0, 0, CFG) is None
    assert due_cycle(c, 300.0, 0, CFG) is CycleKind.SHORT
    cycle_started(c, CycleKind.SHORT, 300.0, 0, CFG)
    assert c.next_short == 600.0 and due_cycle(c, 301.0, 0, CFG) is None
    assert due_cycle(c, 1800.0, 0, CFG) is CycleKind.MEDIUM  # medium beats short
    cycle_started(c, CycleKind.MEDIUM, 1800.0, 0, CFG)
    assert (c.next_medium, c.next_short) == (3600.0, 2100.0)
    assert due_cycle(c, 14400.0, 0, CFG) is CycleKind.LONG  # long beats everything
    cycle_started(c, CycleKind.LONG, 14400.0, 0, CFG)
    assert c.next_long == 28800.0 and c.next_medium == 16200.0


def test_medium_after_10000_requests_even_before_30_minutes():
    c = initial_cycle_clock(0, 1, 0.0, CFG)
    cycle_started(c, CycleKind.SHORT, 0.0, 0, CFG)
    assert due_cycle(c, 10.0, 9_999, CFG) is None
    assert due_cycle(c, 10.0, 10_000, CFG) is CycleKind.MEDIUM
    cycle_started(c, CycleKind.MEDIUM, 10.0, 10_000, CFG)
    assert due_cycle(c, 20.0, 19_999, CFG) is None
    assert due_cycle(c, 20.0, 20_000, CFG) is CycleKind.MEDIUM


def test_zero_period_disables_a_cycle():
    cfg = LifecycleConfig(short={"every_s": 0}, medium={"every_s": 0, "every_requests": 0},
                          long={"every_s": 0})
    c = initial_cycle_clock(0, 1, 0.0, cfg)
    assert c.next_short == c.next_medium == c.next_long == math.inf
    assert due_cycle(c, 1e12, 10**9, cfg) is None


@pytest.mark.parametrize(("n", "allowed"), [(1, 1), (2, 1), (4, 1), (5, 1), (8, 2), (12, 3)])
def test_max_unavailable_default_is_1_or_25_percent(n, allowed):
    assert max_unavailable(n, CFG) == allowed


def test_stagger_one_backend_never_leaves():
    (b,) = fleet(1)
    assert not may_take_out(b, [b], CFG)  # the last warm backend of its model


def test_stagger_two_backends_one_at_a_time():
    a, b = fleet(2)
    assert may_take_out(a, [a, b], CFG)
    a.state = S.DRAINING
    assert not may_take_out(b, [a, b], CFG)
    a.state = S.COOLDOWN
    assert not may_take_out(b, [a, b], CFG)
    a.state = S.WARM
    assert may_take_out(b, [a, b], CFG)


def test_stagger_five_backends_and_unhealthy_counts_as_out():
    bs = fleet(5)
    assert all(may_take_out(b, bs, CFG) for b in bs)
    bs[0].state = S.UNHEALTHY  # already out for another reason: nobody else may leave
    assert not any(may_take_out(b, bs, CFG) for b in bs[1:])
    bs[0].state = S.WARM
    cfg2 = LifecycleConfig(max_unavailable=2)
    bs[1].state = S.COOLDOWN
    assert may_take_out(bs[2], bs, cfg2) and not may_take_out(bs[2], bs, CFG)


def test_stagger_is_per_model():
    a, b = fleet(2, "m1")
    c = fleet(1, "m2")[0]
    c.config = BackendConfig(id="c", url="http://h:9")
    a.state = S.DRAINING
    assert not may_take_out(b, [a, b, c], CFG)  # m1 would have no warm backend
    assert not may_take_out(c, [a, b, c], CFG)  # c is the only m2 backend
    d = fleet(1, "m2")[0]
    d.config = BackendConfig(id="d", url="http://h:10")
    assert may_take_out(c, [a, b, c, d], CFG)  # m2 is unaffected by m1's drain


def test_only_warm_backends_are_taken_out():
    a, b = fleet(2)
    a.state = S.WARMING
    assert not may_take_out(a, [a, b], CFG)


def test_slow_start_weight_ramps_linearly():
    assert slow_start_weight(None, 5.0, 30.0, 0.1) == 1.0
    assert slow_start_weight(0.0, 0.0, 30.0, 0.1) == 0.1  # floor
    assert slow_start_weight(0.0, 15.0, 30.0, 0.1) == pytest.approx(0.5)
    assert slow_start_weight(0.0, 30.0, 30.0, 0.1) == 1.0
    assert slow_start_weight(0.0, 1.0, 0.0, 0.1) == 1.0  # disabled


class Clock:
    def __init__(self, t: float = 0.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def test_router_gives_a_ramping_backend_its_weight_times_its_share():
    clock = Clock(100.0)
    r = LoadThermalPolicy(RoutingWeights(), 5.0, AffinityTable(60, 100, clock), clock,
                          slow_start_s=30.0, slow_start_min_weight=0.1, rng=random.Random(7))
    old, new = fleet(2)
    new.warm_since = 100.0 - 15.0  # half-way through the ramp: weight 0.5
    picks = [r.pick([old, new]).id for _ in range(4000)]
    share = picks.count(new.id) / len(picks)
    assert share == pytest.approx(0.5 * 0.5, abs=0.03)  # weight x fair share (1/2)
    clock.t = 200.0  # ramp over
    picks = [r.pick([old, new]).id for _ in range(1000)]
    assert picks.count(new.id) == 500
