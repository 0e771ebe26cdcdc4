"""The simulated GPU's RC thermal model and its hook into the engine (fake clock only)."""

from __future__ import annotations

import math

import pytest

from gateway.sim.engine import Engine, EngineParams
from gateway.sim.engine_types import EngineRequest
from gateway.sim.faults import FaultConfig
from gateway.sim.gpu import GpuConfig, SimGpus, render_dcgm
from gateway.sim.thermal import (
    H100_SXM,
    Cooling,
    GpuThermal,
    clock_for_share,
    dynamic_share,
    prefill_time_factor,
    steady_state_c,
    step_time_factor,
    utilisation,
)


def run(g: GpuThermal, until: float, util: float, step: float = 1.0) -> None:
    t = g._t
    while t < until - 1e-9:
        t = min(until, t + step)
        g.advance(t, util)


def test_idle_gpu_sits_at_its_idle_steady_state() -> None:
    g = GpuThermal(H100_SXM, Cooling(25.0, 0.075))
    assert g.temp_c == pytest.approx(25.0 + 70.0 * 0.075)
    run(g, 600.0, 0.0)
    assert g.temp_c == pytest.approx(30.25)
    assert g.power_w == pytest.approx(70.0)


def test_heating_under_load_follows_the_rc_curve() -> None:
    g = GpuThermal(H100_SXM, Cooling(25.0, 0.075))
    t0 = g.temp_c
    tss = steady_state_c(700.0, g.cooling)  # 77.5 °C at full power
    run(g, g.tau_s, 1.0)  # one time constant (60 s)
    assert g.temp_c == pytest.approx(tss + (t0 - tss) * math.exp(-1.0), abs=1e-6)
    assert t0 < g.temp_c < tss
    run(g, 20 * g.tau_s, 1.0)
    assert g.temp_c == pytest.approx(tss, abs=1e-3)
    assert g.power_w == pytest.approx(700.0)
    assert g.throttle_events == 0 and g.clock == 1.0


def test_power_rises_with_batch_occupancy() -> None:
    floor = H100_SXM.busy_floor
    idle, one, half, full = (
        utilisation(b, o, floor) for b, o in ((0, 0), (1, 1 / 32), (1, 0.5), (1, 1))
    )
    assert idle == 0.0 < one < half < full == 1.0
    g = GpuThermal()
    assert g.demand_w(half, 1.0) < g.demand_w(full, 1.0) == pytest.approx(700.0)


def test_throttling_at_threshold_with_hysteresis_and_step_independence() -> None:
    results = []
    for step in (0.25, 1.0, 7.0, 600.0):
        g = GpuThermal(H100_SXM, Cooling(32.0, 0.085))  # 700 W -> 91.5 °C steady: throttles
        run(g, 600.0, 1.0, step)
        results.append((g.throttle_events, round(g.throttle_time_s, 6), round(g.temp_c, 6)))
        assert g.throttle_events >= 1
        assert g.temp_c < H100_SXM.throttle_c + 1e-6  # never runs away above the threshold
    assert len(set(results)) == 1  # exact crossings: the step size does not matter


def test_throttled_clock_lowers_power_and_slows_steps() -> None:
    g = GpuThermal(H100_SXM, Cooling(32.0, 0.085))
    g.temp_c = 88.0
    g.advance(0.001, 1.0)
    assert g.throttling and g.throttle_events == 1
    assert g.clock == pytest.approx(H100_SXM.throttle_clock)
    assert g.sm_clock_mhz == pytest.approx(1980 * 0.6)
    assert g.power_w < 700.0
    # decode is memory-bound (6% of a step follows the clock), prefill compute-bound (1/f)
    assert step_time_factor(g.clock, H100_SXM.clock_bound_share) == pytest.approx(1.04)
    assert prefill_time_factor(g.clock, H100_SXM) == pytest.approx(1 / 0.6)


def test_dvfs_law_is_cubic_at_the_top_and_calibrated_to_the_measured_saving() -> None:
    s = H100_SXM
    assert dynamic_share(1.0, s) == pytest.approx(1.0)
    # above the voltage floor the SM share falls as f^3
    assert dynamic_share(0.8, s) == pytest.approx(1 / 3 + 2 / 3 * 0.8**3)
    # below it as f (voltage at its floor)
    assert dynamic_share(0.5, s) == pytest.approx(1 / 3 + 2 / 3 * 0.5 * 0.7**2)
    for share in (0.4, 0.5, 0.7, 0.9):
        assert dynamic_share(clock_for_share(share, s), s) == pytest.approx(share)
    # a full batch at half the clock: 42% less energy for a 6% slower decode (Maliakel et al.)
    full = GpuThermal().demand_w(1.0, 1.0)
    half = GpuThermal().demand_w(1.0, 0.5) * step_time_factor(0.5, s.clock_bound_share)
    assert 1 - half / full == pytest.approx(0.42, abs=0.01)


def test_locked_clocks_and_power_limit_bound_the_gpu_like_nvml() -> None:
    g = GpuThermal()
    assert g.lock_clocks(100.0, 1500.0) == (210.0, 1500.0)  # clamped to the supported range
    g.advance(1.0, 1.0)
    assert g.sm_clock_mhz == pytest.approx(1500.0) and not g.power_capped
    assert g.power_w < 0.75 * 700.0
    g.reset_clocks()
    assert g.set_power_limit(50.0) == 200.0 and g.set_power_limit(9000.0) == 700.0
    assert g.set_power_limit(450.0) == 450.0
    g.advance(2.0, 1.0)
    assert g.power_capped and g.power_w == pytest.approx(450.0)
    assert g.set_power_limit(None) == 700.0


def test_power_limit_caps_the_clock() -> None:
    g = GpuThermal()
    g.power_limit_w = 400.0
    g.advance(1.0, 1.0)
    assert g.power_capped and g.power_w == pytest.approx(400.0)
    assert g.clock < 1.0 and not g.throttling


def test_cooling_failure_heats_higher_and_faster() -> None:
    ok = GpuThermal(H100_SXM, Cooling(25.0, 0.075))
    bad = GpuThermal(H100_SXM, Cooling(25.0, 0.075))
    bad.set_cooling_failure(2.5)
    run(ok, 300.0, 0.7)
    run(bad, 300.0, 0.7)
    assert bad.temp_c > ok.temp_c + 20
    assert bad.throttle_events >= 1 and ok.throttle_events == 0


def _itl_under_load(cooling: Cooling, seconds: float) -> tuple[float, float, int]:
    """Keep a token-level engine's batch full on a GPU; return (mean ITL of the first
    10 s, of the last 10 s, throttling events)."""
    params = EngineParams(max_num_seqs=8)
    eng = Engine(params)
    gpus = SimGpus(GpuConfig(ambient_c=cooling.ambient_c, r_th_k_per_w=cooling.r_th_k_per_w), eng)
    n = 0
    early: list[float] = []
    late: list[float] = []
    t = 0.0
    while t < seconds:
        while eng.num_running + eng.num_waiting < params.max_num_seqs:
            eng.submit(EngineRequest(f"r{n}", [1, 2, 3, 4], max_tokens=200), t)
            n += 1
        t += 0.25
        eng.advance(t)
        gpus.tick(t)
        for m in eng.drain_finished():
            if t <= 10:
                early.extend(m.itl_s)
            elif t > seconds - 10:
                late.extend(m.itl_s)
    return sum(early) / len(early), sum(late) / len(late), gpus.gpus[0].throttle_events


def test_throttling_raises_itl_of_the_engine() -> None:
    cool_early, cool_late, cool_events = _itl_under_load(Cooling(25.0, 0.075), 180.0)
    hot_early, hot_late, hot_events = _itl_under_load(Cooling(40.0, 0.1), 180.0)
    assert cool_events == 0 and cool_late == pytest.approx(cool_early, rel=0.02)
    assert hot_events >= 1
    assert hot_late > 1.02 * hot_early  # throttled clock: slower (memory-bound) decode steps


def test_gpu_faults_inject_xid_ecc_and_cooling_failure() -> None:
    eng = Engine(EngineParams())
    gpus = SimGpus(GpuConfig(count=2), eng)
    gpus.tick(1.0, FaultConfig(xid_errors=2, xid_code=48, ecc_dbe_errors=1, fault_gpu=1))
    g0, g1 = gpus.gpus
    assert (g0.last_xid, g0.ecc_dbe) == (0, 0)
    assert (g1.xid_errors, g1.last_xid, g1.ecc_dbe) == (2, 48, 1)
    gpus.tick(2.0, FaultConfig(xid_errors=2, xid_code=48, ecc_dbe_errors=1, fault_gpu=1))
    assert g1.xid_errors == 2  # no new errors unless the count rises
    gpus.tick(3.0, FaultConfig(cooling_failure=True, cooling_failure_factor=3.0))
    assert g0.r_th == pytest.approx(0.075 * 3.0)
    text = render_dcgm(gpus)
    assert 'DCGM_FI_DEV_XID_ERRORS{gpu="1",' in text and "} 48\n" in text
    assert 'DCGM_FI_DEV_ECC_DBE_VOL_TOTAL{gpu="1",' in text


def test_a_power_limit_below_what_the_minimum_clock_draws_leaves_the_gpu_at_that_clock() -> None:
    """A 200 W limit on a fully loaded H100 (the bottom of NVML's range): the firmware lowers
    the clock to the GPU's minimum, 210 MHz, never below; the draw is what that clock needs
    (over the limit), the least the GPU can draw at that load."""
    g = GpuThermal()
    assert g.set_power_limit(200.0) == 200.0
    g.advance(1.0, 1.0)
    assert g.power_capped and g.sm_clock_mhz == pytest.approx(210.0)
    at_min = g.demand_w(1.0, 210.0 / 1980.0)
    assert g.power_w == pytest.approx(at_min) and g.power_w > 200.0
    g.advance(2.0, 0.4)  # a lighter load: the limit is met above the minimum clock
    assert g.sm_clock_mhz > 210.0 and g.power_w == pytest.approx(200.0)


def test_gpu_utilisation_counts_an_engine_step_still_running() -> None:
    """Steps slower than the tick (a low clock): every tick inside a step reads busy, not
    the idle draw, and the batch of the running step sets the draw."""
    eng = Engine(EngineParams(max_num_seqs=8))
    gpus = SimGpus(GpuConfig(tick_s=0.1), eng)
    for i in range(8):
        eng.submit(EngineRequest(f"r{i}", [1, 2, 3, 4], max_tokens=500), 0.0)
    eng.advance(0.0)
    eng.slowdown = 50.0  # each decode step now spans many ticks
    idle_w = gpus.gpus[0].spec.idle_w
    t, lows = 0.0, 0
    while t < 20.0:
        t = round(t + 0.1, 6)
        eng.advance(t)
        gpus.tick(t)
        eng.slowdown = 50.0  # the tick sets it from the clock; keep the steps slow
        lows += gpus.busy < 0.99 or gpus.gpus[0].power_w < idle_w + 100
    assert lows == 0
