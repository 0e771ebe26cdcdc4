"""The clock controller (issue 21, gateway/routing/clocks.py): steps, order, hysteresis, rate
limit, thermal caps, the floor before shedding; time is injected (plain floats)."""

from __future__ import annotations

import pytest

from gateway.config import ClockControlConfig, ThermalConfig
from gateway.routing.clocks import ClockController, GpuView, PowerShedGate
from gateway.routing.thermal import DomainStatus

# One sample per decision: the tests of the steps, the order and the marks; the window
# (the default, smooth_intervals 3) has its own test below.
CFG = ClockControlConfig(
    enabled=True, interval_s=2.0, step_ratio=0.1, floor_ratio=0.5, efficient_after_s=0.0,
    smooth_intervals=1,
)
MAX = 2000.0


def gpu(
    bid: str,
    running: float = 8,
    waiting: float = 1,
    temp: float | None = 60.0,
    power: float | None = None,
) -> GpuView:
    return GpuView(bid, "rack", MAX, temp, running, waiting, power)


def rack(draw: float, budget: float = 1000.0) -> dict[str, DomainStatus]:
    return {"rack": DomainStatus("rack", budget, 0.8 * budget, draw, members=2, reporting=2)}


def test_over_the_high_mark_steps_the_most_decode_heavy_gpu_first_then_the_next() -> None:
    """Just over the mark one GPU moves; how many grows with the excess (all at the budget)."""
    c = ClockController(CFG, hot_c=85.0)
    gpus = [gpu("prefill", running=4, waiting=4), gpu("decode", running=8, waiting=1)]
    ch = c.decide(0.0, gpus, rack(900.0))  # 90% > 85%: one step, one GPU
    assert [(x.backend_id, x.max_mhz, x.reason) for x in ch] == [("decode", 1800.0, "power")]
    assert c.decide(1.0, gpus, rack(900.0)) == []  # rate limit: one step per 2 s
    ch = c.decide(2.0, gpus, rack(900.0))
    assert [(x.backend_id, x.max_mhz) for x in ch] == [("decode", 1600.0)]
    assert c.cap_mhz("prefill") is None


def test_over_budget_steps_every_gpu_of_the_domain_down_to_the_floor_then_exhausted() -> None:
    c = ClockController(CFG, hot_c=85.0)
    gpus = [gpu("a"), gpu("b")]
    t = 0.0
    for _ in range(10):
        c.decide(t, gpus, rack(1100.0))
        t += 2.0
    assert c.caps() == {"a": pytest.approx(0.5), "b": pytest.approx(0.5)}  # never below
    assert c.exhausted("rack", ["a", "b"])
    assert not ClockController(CFG, 85.0).exhausted("rack", ["a"])


def test_hysteresis_holds_between_the_marks_and_releases_below_the_low_one() -> None:
    c = ClockController(CFG, hot_c=85.0)
    gpus = [gpu("prefill", running=4, waiting=4), gpu("decode", running=8, waiting=1)]
    for t in (0.0, 2.0):
        c.decide(t, gpus, rack(1100.0))  # both at 0.8
    assert c.decide(4.0, gpus, rack(800.0)) == []  # 80%: inside the band, nothing moves
    assert c.decide(6.0, gpus, rack(760.0)) == []
    ch = c.decide(8.0, gpus, rack(700.0))  # below 75%: one step up, most prefill-heavy first
    assert [(x.backend_id, x.max_mhz) for x in ch] == [("prefill", 1800.0)]
    ch = c.decide(10.0, gpus, rack(700.0))
    assert [(x.backend_id, x.max_mhz, x.reason) for x in ch] == [("prefill", None, "release")]
    ch = c.decide(12.0, gpus, rack(700.0))
    assert [x.backend_id for x in ch] == ["decode"]


def test_in_the_band_a_queued_gpu_steps_up_only_while_the_domain_has_room_for_it() -> None:
    """Inside the band only a power-capped GPU with requests waiting steps up, one step per
    interval, and only if its bounded rise keeps the domain under the high mark."""
    c = ClockController(CFG, hot_c=85.0)
    for t in (0.0, 2.0):
        c.decide(t, [gpu("q"), gpu("d")], rack(1100.0))  # both capped at 0.8
    queued = gpu("q", running=8, waiting=3, power=150.0)
    decoding = gpu("d", running=8, waiting=0, power=150.0)
    # q's rise is bounded by 150 W * ((0.9 / 0.8)^3 - 1) = 64 W: 800 + 64 > 850, no room
    assert c.decide(4.0, [queued, decoding], rack(800.0)) == []
    ch = c.decide(6.0, [queued, decoding], rack(780.0))  # 780 + 64 < 850: q steps up
    assert [(x.backend_id, x.max_mhz, x.reason) for x in ch] == [("q", 1800.0, "power")]
    assert c.decide(7.0, [queued, decoding], rack(780.0)) == []  # one step per interval
    idle = gpu("q", waiting=0, power=150.0)
    assert c.decide(8.0, [idle, decoding], rack(760.0)) == []  # no queue: band holds
    unknown = gpu("q", waiting=3, power=None)
    assert c.decide(10.0, [unknown, decoding], rack(760.0)) == []  # no draw known: holds
    assert c.caps() == {"q": pytest.approx(0.9), "d": pytest.approx(0.8)}


def test_a_warm_gpu_is_capped_under_hot_c_and_released_once_cool() -> None:
    c = ClockController(CFG, hot_c=85.0)
    ch = c.decide(0.0, [gpu("w", temp=83.0)], {})  # from hot_c - 2 °C
    assert [(x.max_mhz, x.reason) for x in ch] == [(1800.0, "thermal")]
    assert c.decide(2.0, [gpu("w", temp=81.0)], {}) == []  # between the margins: hold
    ch = c.decide(4.0, [gpu("w", temp=79.0)], {})  # below hot_c - 5 °C: step back up
    assert [(x.max_mhz, x.reason) for x in ch] == [(None, "release")]


def test_no_queue_runs_at_the_efficient_clock_and_a_queue_lifts_it() -> None:
    c = ClockController(CFG.model_copy(update={"efficient_ratio": 0.7}), hot_c=85.0)
    ch = c.decide(0.0, [gpu("a", waiting=0)], {})
    assert [(x.max_mhz, x.reason) for x in ch] == [(1400.0, "efficiency")]
    ch = c.decide(0.5, [gpu("a", waiting=3)], {})
    assert [x.max_mhz for x in ch] == [None]
    slow = ClockController(
        CFG.model_copy(update={"efficient_ratio": 0.7, "efficient_after_s": 10}), 85.0
    )
    assert slow.decide(0.0, [gpu("a", waiting=3)], {}) == []
    assert slow.decide(5.0, [gpu("a", waiting=0)], {}) == []  # not idle long enough yet
    assert [x.max_mhz for x in slow.decide(10.0, [gpu("a", waiting=0)], {})] == [1400.0]


def test_power_shedding_waits_for_the_floor_and_has_hysteresis() -> None:
    gate = PowerShedGate((1.0, 0.9, 0.8), release=0.05)
    assert gate.level(0.95, exhausted=False) == 0.0  # clocks can still help
    assert gate.level(0.95, exhausted=True) == pytest.approx(1.0)
    assert gate.level(0.78, exhausted=True) == pytest.approx(0.83)  # low still shed
    assert gate.level(0.74, exhausted=True) == 0.0  # 0.79 < 0.8: off
    assert not gate.active


def test_config_orders_its_marks() -> None:
    with pytest.raises(ValueError, match="domain_low_ratio"):
        ClockControlConfig(domain_low_ratio=0.9, domain_high_ratio=0.8)
    assert ThermalConfig().clocks.enabled is False  # off unless asked for


def test_a_single_low_reading_steps_no_clock_up() -> None:
    """Default window (3 rounds): caps at 0.8 on a domain drawing 80% (in the band), one
    reading at 60% (under the low mark) moves nothing up; a draw that stays under the low
    mark for the whole window does."""
    cfg = ClockControlConfig(
        enabled=True, interval_s=2.0, step_ratio=0.1, floor_ratio=0.5, efficient_after_s=0.0
    )
    c = ClockController(cfg, hot_c=85.0)
    gpus = [gpu("a", waiting=0), gpu("b", waiting=0)]
    c.adopt("a", 0.8, MAX)
    c.adopt("b", 0.8, MAX)
    t = 0.0
    for draw in (800.0, 800.0, 800.0, 600.0, 800.0, 810.0, 600.0, 800.0):
        assert c.decide(t, gpus, rack(draw)) == []
        t += 2.0
    ups = []
    for _ in range(4):
        ups += c.decide(t, gpus, rack(600.0))
        t += 2.0
    assert ups and ups[0].max_mhz is not None and ups[0].max_mhz > 1600.0 - 1e-6
