"""Thermal cooldown decisions (gateway.routing.cooldown): when a hot backend is sent to rest
and when the rest ends; pure, times passed in."""

from __future__ import annotations

import pytest

from gateway.config import ThermalConfig
from gateway.core.samples import GpuSample
from gateway.core.vocab import BackendState
from gateway.routing.cooldown import cooldown_done, cooldown_due, rest_over
from gateway.routing.thermal import UNMONITORED, ThermalStatus, ThermalTier, ThermalTracker

T = ThermalTier
S = BackendState


def sample(at: float, temp: float | None) -> GpuSample:
    return GpuSample(at=at, temp_c=temp, power_w=None, power_limit_w=700.0)


# ---- when a backend is sent to rest --------------------------------------------------------
@pytest.mark.parametrize(
    ("state", "tier", "monitored", "enabled", "due"),
    [
        (S.WARM, T.HOT, True, True, True),
        (S.WARM, T.WARM, True, True, False),
        (S.WARM, T.COOL, True, True, False),
        (S.WARM, T.UNKNOWN, True, True, False),  # stale telemetry is no reading of heat
        (S.WARM, T.HOT, True, False, False),  # thermal routing off
        (S.WARMING, T.HOT, True, True, False),  # not in rotation: nothing to take out
        (S.DRAINING, T.HOT, True, True, False),  # already on its way out
        (S.COOLDOWN, T.HOT, True, True, False),
        (S.UNHEALTHY, T.HOT, True, True, False),
    ],
)
def test_cooldown_is_due_for_a_warm_backend_whose_gpus_are_hot(
    state: BackendState, tier: ThermalTier, monitored: bool, enabled: bool, due: bool
) -> None:
    cfg = ThermalConfig(enabled=enabled)
    assert cooldown_due(state, ThermalStatus(tier, monitored), cfg) is due


def test_no_cooldown_without_gpu_telemetry() -> None:
    assert not cooldown_due(S.WARM, UNMONITORED, ThermalConfig())


def test_cooldown_due_follows_the_trackers_hot_latch() -> None:
    """Hot from ``hot_c`` on, still hot between ``resume_c`` and ``hot_c`` (hysteresis)."""
    cfg = ThermalConfig()
    tr = ThermalTracker(cfg)
    tr.observe(sample(0.0, cfg.hot_c - 1))
    assert not cooldown_due(S.WARM, tr.status(0.0), cfg)
    tr.observe(sample(1.0, cfg.hot_c))
    assert cooldown_due(S.WARM, tr.status(1.0), cfg)
    tr.observe(sample(2.0, cfg.resume_c + 1))
    assert cooldown_due(S.WARM, tr.status(2.0), cfg)
    tr.observe(sample(3.0, cfg.resume_c - 1))
    assert not cooldown_due(S.WARM, tr.status(3.0), cfg)


# ---- when the rest ends --------------------------------------------------------------------
def test_cooldown_waits_for_resume_temperature_and_minimum_rest() -> None:
    cfg = ThermalConfig(cooldown_s=60, max_cooldown_s=300)
    tr = ThermalTracker(cfg)
    tr.observe(sample(0.0, 90.0))
    assert not cooldown_done(tr, 10.0, 10.0, cfg)
    tr.observe(sample(30.0, 65.0))  # cooled, but rested too little
    assert not cooldown_done(tr, 30.0, 30.0, cfg)
    tr.observe(sample(60.0, 66.0))
    assert cooldown_done(tr, 60.0, 60.0, cfg)


def test_cooldown_stays_while_hot_or_unknown_until_the_cap() -> None:
    cfg = ThermalConfig(cooldown_s=60, max_cooldown_s=300)
    tr = ThermalTracker(cfg)
    tr.observe(sample(100.0, 72.0))  # below hot, above resume
    assert not cooldown_done(tr, 100.0, 100.0, cfg)
    assert not cooldown_done(tr, 200.0, 200.0, cfg)  # stale: unknown is not cool
    assert cooldown_done(tr, 300.0, 300.0, cfg)  # the cap


def test_end_of_cooldown_rereads_the_hot_latch() -> None:
    cfg = ThermalConfig()
    tr = ThermalTracker(cfg)
    tr.observe(sample(0.0, 90.0))
    tr.observe(sample(1.0, 78.0))
    assert tr.tier(1.0) is T.HOT
    tr.end_cooldown()  # released by the cap at 78 °C: warm, not hot
    assert tr.tier(1.0) is T.WARM
    tr.observe(sample(2.0, 86.0))
    tr.end_cooldown()
    assert tr.tier(2.0) is T.HOT


def test_rest_over_ends_the_cooldown_only_when_it_is_done() -> None:
    """The end condition the GPU monitor and the simulator both give a thermal rest: a
    release by the cap between resume_c and hot_c returns the backend warm, not hot (else
    it would be sent straight back); while the rest is not done the latch is untouched."""
    cfg = ThermalConfig(cooldown_s=60, max_cooldown_s=300)
    tr = ThermalTracker(cfg)
    tr.observe(sample(0.0, 90.0))
    tr.observe(sample(290.0, 78.0))  # fresh, between resume and hot: still latched hot
    assert not rest_over(tr, 290.0, 290.0, cfg)
    assert tr.hot_latched and cooldown_due(S.WARM, tr.status(290.0), cfg)
    assert rest_over(tr, 300.0, 291.0, cfg)  # the cap
    assert not tr.hot_latched and tr.tier(291.0) is T.WARM
    assert not cooldown_due(S.WARM, tr.status(291.0), cfg)
    cool = ThermalTracker(cfg)
    cool.observe(sample(0.0, 90.0))
    cool.observe(sample(60.0, 65.0))  # below resume: the latch is already off
    assert rest_over(cool, 60.0, 60.0, cfg) and cool.tier(60.0) is T.COOL
