"""Thermal tiers, trend prediction, power budgets and the router's thermal choice (pure)."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from gateway.config import ThermalConfig
from gateway.core.samples import GpuReading, GpuSample
from gateway.fleet.gpu_health import GPU_ECC, GPU_XID, GpuHealth
from gateway.routing.thermal import (
    UNMONITORED,
    DomainStatus,
    ThermalStatus,
    ThermalTier,
    ThermalTracker,
    choose,
    domain_statuses,
    power_pressure,
)

T = ThermalTier
# explicit, non-zero weights (not the defaults), so each penalty term is visible
CFG = ThermalConfig(
    warm_penalty=8.0, unknown_penalty=8.0, power_penalty=4.0, domain_penalty=4.0,
    predicted_weight=0.1,
)


def sample(
    at: float,
    temp: float | None,
    power: float | None = None,
    limit: float | None = 700.0,
    **kw: object,
) -> GpuSample:
    return GpuSample(at=at, temp_c=temp, power_w=power, power_limit_w=limit, **kw)  # type: ignore[arg-type]


@dataclass
class Cand:
    id: str


# ---- reduction over GPUs --------------------------------------------------------------------
def test_from_gpus_takes_hottest_temp_summed_power_lowest_clock() -> None:
    s = GpuSample.from_gpus(
        5.0,
        [
            GpuReading(
                temp_c=61, power_w=300, power_limit_w=700, sm_clock_mhz=1980, xid=0, ecc_dbe=0
            ),
            GpuReading(
                temp_c=83, power_w=650, power_limit_w=700, sm_clock_mhz=1410, xid=79, ecc_dbe=2
            ),
        ],
    )
    assert (s.temp_c, s.power_w, s.power_limit_w, s.sm_clock_mhz) == (83, 950, 1400, 1410)
    assert s.xid_last == (0, 79) and s.ecc_dbe_total == 2 and s.gpus == 2
    assert s.power_ratio == pytest.approx(950 / 1400)


def test_from_gpus_with_nothing_reported_has_no_temperature() -> None:
    s = GpuSample.from_gpus(1.0, [GpuReading(), GpuReading()])
    assert s.temp_c is None and s.power_w is None and s.power_ratio is None


# ---- tiers and hysteresis -------------------------------------------------------------------
@pytest.mark.parametrize(
    ("temp", "tier"),
    [(40.0, T.COOL), (74.9, T.COOL), (75.0, T.WARM), (84.9, T.WARM), (85.0, T.HOT), (97.0, T.HOT)],
)
def test_tier_thresholds(temp: float, tier: ThermalTier) -> None:
    tr = ThermalTracker(CFG)
    tr.observe(sample(0.0, temp))
    assert tr.tier(1.0) is tier


def test_hot_stays_hot_until_below_resume_threshold() -> None:
    tr = ThermalTracker(CFG)
    temps = [80, 86, 82, 74, 70.5, 69.9, 72, 76]
    tiers = []
    for i, t in enumerate(temps):
        tr.observe(sample(float(i), t))
        tiers.append(tr.tier(float(i)))
    assert tiers == [T.WARM, T.HOT, T.HOT, T.HOT, T.HOT, T.COOL, T.COOL, T.WARM]


def test_missing_or_stale_telemetry_is_unknown_never_cool() -> None:
    tr = ThermalTracker(CFG)
    assert tr.tier(0.0) is T.UNKNOWN
    tr.observe(sample(0.0, 50.0))
    assert tr.tier(CFG.stale_after_s) is T.COOL
    assert tr.tier(CFG.stale_after_s + 0.1) is T.UNKNOWN
    st = tr.status(CFG.stale_after_s + 0.1)
    assert st.tier is T.UNKNOWN and st.temp_c is None and st.predicted_c is None
    assert st.age_s == pytest.approx(CFG.stale_after_s + 0.1)


def test_hot_latch_survives_a_telemetry_gap() -> None:
    tr = ThermalTracker(CFG)
    tr.observe(sample(0.0, 90.0))
    assert tr.tier(100.0) is T.UNKNOWN
    tr.observe(sample(100.0, 78.0))  # back, still above resume
    assert tr.tier(100.0) is T.HOT


def test_sample_without_temperature_is_ignored() -> None:
    tr = ThermalTracker(CFG)
    tr.observe(sample(0.0, 60.0))
    tr.observe(sample(8.0, None))
    assert tr.latest is not None and tr.latest.at == 0.0
    assert tr.tier(11.0) is T.UNKNOWN


# ---- trend and prediction -------------------------------------------------------------------
def test_slope_and_prediction_a_minute_ahead() -> None:
    tr = ThermalTracker(CFG)
    for i in range(11):  # +0.2 °C/s over 20 s
        tr.observe(sample(2.0 * i, 60.0 + 0.4 * i))
    assert tr.slope_c_per_s() == pytest.approx(0.2)
    assert tr.predicted_c(20.0) == pytest.approx(64.0 + 0.2 * 60)
    assert tr.predicted_c(21.0, ahead_s=10) == pytest.approx(64.0 + 0.2 * 11)


def test_slope_uses_only_the_trend_window() -> None:
    tr = ThermalTracker(ThermalConfig(trend_window_s=10))
    for i in range(10):
        tr.observe(sample(float(i), 80.0 - 2 * i))  # falling fast, long ago
    for i in range(10, 31, 2):
        tr.observe(sample(float(i), 62.0))  # flat for the last 20 s
    assert tr.slope_c_per_s() == pytest.approx(0.0)


def test_slope_is_clamped_and_needs_two_samples() -> None:
    tr = ThermalTracker(CFG)
    tr.observe(sample(0.0, 50.0))
    assert tr.slope_c_per_s() is None
    assert tr.predicted_c(0.0) == 50.0
    tr.observe(sample(1.0, 70.0))  # a 20 °C jump in 1 s: a glitch, not a trend
    assert tr.slope_c_per_s() == CFG.max_slope_c_per_s


# ---- the router's choice --------------------------------------------------------------------
def status(
    tier: ThermalTier,
    temp: float | None = None,
    predicted: float | None = None,
    ratio: float | None = None,
    domain: str | None = None,
) -> ThermalStatus:
    return ThermalStatus(
        tier, True, temp, predicted if predicted is not None else temp, None, None, ratio, domain
    )


def run_choose(
    st: dict[str, ThermalStatus],
    domains: dict[str, DomainStatus] | None = None,
    cfg: ThermalConfig = CFG,
):
    cands = [Cand(k) for k in st]
    return choose(cands, lambda c: st[c.id], domains or {}, cfg)


def test_hot_candidates_are_dropped_and_reported() -> None:
    ch = run_choose({"a": status(T.HOT, 90), "b": status(T.COOL, 60)})
    assert [c.id for c in ch.candidates] == ["b"]
    assert [c.id for c in ch.hot] == ["a"] and not ch.all_hot


def test_all_hot_keeps_them_and_prefers_the_least_hot() -> None:
    ch = run_choose({"a": status(T.HOT, 92), "b": status(T.HOT, 86)})
    assert ch.all_hot and not ch.hot
    assert [c.id for c in ch.candidates] == ["a", "b"]
    assert ch.penalties["a"] > ch.penalties.get("b", 0.0)


def test_warm_and_unknown_are_penalised_cool_is_not() -> None:
    ch = run_choose(
        {
            "cool": status(T.COOL, 60),
            "warm": status(T.WARM, 78, predicted=78),
            "stale": status(T.UNKNOWN),
            "unmonitored": UNMONITORED,
        }
    )
    assert [c.id for c in ch.candidates] == ["cool", "warm", "stale", "unmonitored"]
    assert "cool" not in ch.penalties and "unmonitored" not in ch.penalties
    assert ch.penalties["warm"] == pytest.approx(CFG.warm_penalty + CFG.predicted_weight * 18)
    assert ch.penalties["stale"] == CFG.unknown_penalty


def test_cool_but_predicted_hot_is_avoided_like_warm() -> None:
    ch = run_choose({"rising": status(T.COOL, 72, predicted=88), "flat": status(T.COOL, 73)})
    assert ch.penalties["rising"] >= CFG.warm_penalty
    assert "flat" not in ch.penalties


def test_lowest_predicted_temperature_gets_least_penalty() -> None:
    ch = run_choose({"a": status(T.COOL, 60, predicted=70), "b": status(T.COOL, 64, predicted=62)})
    assert "b" not in ch.penalties
    assert ch.penalties["a"] == pytest.approx(CFG.predicted_weight * 8)


def test_power_cap_and_domain_over_target_are_penalised() -> None:
    domains = {
        "r1": DomainStatus("r1", 1000.0, 800.0, 850.0, 2, 2),
        "r2": DomainStatus("r2", 1000.0, 800.0, 500.0, 1, 1),
    }
    ch = run_choose(
        {
            "capped": status(T.COOL, 60, ratio=0.85, domain="r2"),
            "in_hot_rack": status(T.COOL, 60, ratio=0.5, domain="r1"),
            "fine": status(T.COOL, 60, ratio=0.8, domain="r2"),
        },
        domains,
    )
    assert ch.penalties == {"capped": CFG.power_penalty, "in_hot_rack": CFG.domain_penalty}


def test_disabled_keeps_everything_without_penalty() -> None:
    ch = run_choose(
        {"a": status(T.HOT, 95), "b": status(T.WARM, 80)}, cfg=ThermalConfig(enabled=False)
    )
    assert [c.id for c in ch.candidates] == ["a", "b"] and ch.penalties == {} and not ch.hot


def test_load_thermal_policy_adds_the_thermal_hooks_penalties() -> None:
    from gateway.config import RoutingWeights
    from gateway.core.samples import LoadSample
    from gateway.routing.policy import AffinityTable, LoadThermalPolicy

    @dataclass
    class B:
        id: str
        capacity: int | None = 8
        in_flight: int = 0
        load: LoadSample | None = field(default_factory=lambda: LoadSample(0, 0, 0.0, 0.0, 0))
        warm_since: float | None = None
        recent_failures: int = 0

    st = {"warm": status(T.WARM, 80), "cool": status(T.COOL, 60), "hot": status(T.HOT, 90)}
    router = LoadThermalPolicy(
        RoutingWeights(), 5.0, AffinityTable(60, 10, lambda: 0.0), lambda: 0.0,
        thermal=lambda cands, now: choose(cands, lambda c: st[c.id], {}, CFG),
    )
    warm, cool, hot = B("warm"), B("cool", in_flight=3), B("hot")
    # cool has 3 requests queued-equivalent more, still below the warm penalty: cool wins
    assert router.pick([warm, cool]) is cool
    cool.in_flight = 30  # far busier: the warm one takes it rather than pile up a queue
    assert router.pick([warm, cool]) is warm
    assert router.pick([hot, cool]) is cool  # an idle hot backend is dropped, however busy
    assert router.pick([hot]) is hot  # every candidate hot: kept (the GPU throttles itself)
    unaware = LoadThermalPolicy(
        RoutingWeights(), 5.0, AffinityTable(60, 10, lambda: 0.0), lambda: 0.0
    )
    cool.in_flight = 3
    assert unaware.pick([warm, cool]) is warm  # without the hook: load alone


# ---- power domains --------------------------------------------------------------------------
def test_domain_statuses_sum_fresh_draw() -> None:
    sts = [
        ThermalStatus(T.COOL, power_w=400.0, domain="r1"),
        ThermalStatus(T.WARM, power_w=500.0, domain="r1"),
        ThermalStatus(T.UNKNOWN, power_w=None, domain="r1"),
        ThermalStatus(T.COOL, power_w=300.0, domain="r2"),
        ThermalStatus(T.COOL, power_w=999.0, domain=None),
    ]
    d = domain_statuses(sts, {"r1": 1000.0, "r2": 1000.0, "r3": 500.0}, CFG)
    assert (d["r1"].draw_w, d["r1"].members, d["r1"].reporting) == (900.0, 3, 2)
    assert d["r1"].target_w == 800.0 and d["r1"].over_target
    assert not d["r2"].over_target and d["r2"].utilisation == pytest.approx(0.3)
    assert d["r3"].draw_w == 0.0 and d["r3"].members == 0


def test_power_pressure_is_the_roomiest_domain() -> None:
    d = {
        "r1": DomainStatus("r1", 1000.0, 800.0, 950.0, 1, 1),
        "r2": DomainStatus("r2", 1000.0, 800.0, 850.0, 1, 1),
    }
    assert power_pressure(["r1", "r2"], d) == pytest.approx(0.85)
    assert power_pressure(["r1"], d) == pytest.approx(0.95)
    assert power_pressure(["r1", None], d) == 0.0  # a candidate outside any domain
    assert power_pressure([], d) == 0.0


def test_config_rejects_inverted_thresholds() -> None:
    with pytest.raises(ValueError, match="resume_c"):
        ThermalConfig(resume_c=90)
    with pytest.raises(ValueError, match="max_cooldown_s"):
        ThermalConfig(cooldown_s=100, max_cooldown_s=50)


# ---- GPU health breaker ---------------------------------------------------------------------
def xid(at: float, *codes: int, ecc: float | None = 0.0) -> GpuSample:
    return GpuSample(at=at, temp_c=60.0, xid_last=codes, ecc_dbe_total=ecc)


def test_three_new_xids_within_an_hour_trip() -> None:
    h = GpuHealth(3, 3600.0)
    assert h.observe(xid(0.0, 0, 0)) is None
    assert h.observe(xid(10.0, 79, 0)) is None
    assert h.observe(xid(20.0, 79, 0)) is None  # same gauge value: not new
    assert h.observe(xid(1000.0, 79, 48)) is None
    assert h.recent_xids(1000.0) == 2
    assert h.observe(xid(2000.0, 13, 48)) == GPU_XID
    assert h.total_xids == 3 and h.recent_xids(2000.0) == 0  # the window restarts


def test_xids_spread_over_more_than_an_hour_do_not_trip() -> None:
    h = GpuHealth(3, 3600.0)
    h.observe(xid(0.0, 0))
    assert h.observe(xid(100.0, 79)) is None
    assert h.observe(xid(2000.0, 0)) is None  # cleared by a GPU reset: not an error
    assert h.observe(xid(2100.0, 79)) is None
    assert h.observe(xid(3800.0, 48)) is None  # the first one left the window
    assert h.recent_xids(3800.0) == 2


def test_xids_present_at_the_first_sample_are_the_baseline() -> None:
    h = GpuHealth(1, 3600.0)
    assert h.observe(xid(0.0, 79, 79)) is None
    assert h.observe(xid(5.0, 79, 79)) is None
    assert h.total_xids == 0


def test_any_new_double_bit_ecc_error_trips() -> None:
    h = GpuHealth()
    assert h.observe(xid(0.0, 0, ecc=4.0)) is None  # old errors: baseline
    assert h.observe(xid(2.0, 0, ecc=4.0)) is None
    assert h.observe(xid(4.0, 0, ecc=5.0)) == GPU_ECC
    assert h.observe(xid(6.0, 0, ecc=0.0)) is None  # counter reset after a restart
    assert h.observe(xid(8.0, 0, ecc=None)) is None


def test_gpu_count_change_rebaselines() -> None:
    h = GpuHealth(1, 3600.0)
    h.observe(xid(0.0, 0))
    assert h.observe(xid(1.0, 79, 79)) is None  # two GPUs now: a new baseline
    assert h.observe(xid(2.0, 79, 13)) == GPU_XID
