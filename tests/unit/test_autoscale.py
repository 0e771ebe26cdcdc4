"""The pure autoscaler (gateway/autoscale.py): each paradigm, the warm pool, the
stabilization window, the bounds and the scale-up lag, with an injected clock (the ``now``
every call takes)."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.autoscale import (
    Autoscaler,
    LagTracker,
    ModelAutoscaler,
    ModelSignals,
    ahead_window,
)
from gateway.config import AutoscaleConfig, AutoscaleModelLimits, ConfigError, load_config


def scaler(**over: object) -> ModelAutoscaler:
    cfg = AutoscaleConfig(**over)  # type: ignore[arg-type]
    lim = cfg.limits("m")
    return ModelAutoscaler(cfg, 2.0, lim.min_replicas, lim.max_replicas)


# ---- fast: requests and KV-cache use per replica against targets ------------------------------


def test_fast_counts_running_and_waiting_against_the_per_replica_target() -> None:
    a = scaler(target_concurrency=0.5, min_replicas=0)
    # 4 ready replicas of 32 slots, target 16 each: 100 requests need ceil(100/16) = 7
    d = a.decide(0.0, ModelSignals(ready=4, slots=32, running=80, waiting=20))
    assert (d.fast, d.desired, d.reason) == (7, 7, "fast")


def test_fast_follows_kv_cache_use_with_the_hpa_rule() -> None:
    a = scaler(target_kv_cache=0.8, min_replicas=0)
    # few requests but the KV cache 96% full on 5 replicas: ceil(5 x 0.96 / 0.8) = 6
    d = a.decide(0.0, ModelSignals(ready=5, slots=256, running=10, kv_cache_usage=0.96))
    assert d.fast == 6


def test_idle_fleet_goes_to_min_replicas() -> None:
    a = scaler(min_replicas=2, scale_down_cooldown_s=0)
    a.decide(0.0, ModelSignals(ready=6, slots=32))
    d = a.decide(1.0, ModelSignals(ready=6, slots=32))
    assert (d.recommended, d.desired, d.reason) == (0, 2, "min_replicas")


def test_a_restarted_gateway_keeps_the_replicas_for_a_whole_cooldown() -> None:
    a = scaler(scale_down_cooldown_s=60, min_replicas=0)
    idle = ModelSignals(ready=6, slots=32)
    assert a.decide(100.0, idle).desired == 6  # first sight: what exists is kept
    assert a.decide(159.0, idle).desired == 6
    assert a.decide(161.0, idle).desired == 0


# ---- fine: P99 TTFT against the SLO --------------------------------------------------------------


def test_fine_scales_the_ready_replicas_by_ttft_over_target() -> None:
    a = scaler(min_replicas=0)  # target 2.0 s (the SLO the scaler was made with)
    d = a.decide(0.0, ModelSignals(ready=4, slots=256, running=4, ttft_p99_s=3.0))
    assert (d.fine, d.desired, d.reason) == (6, 6, "fine")


def test_fine_counts_only_ready_replicas_and_is_capped() -> None:
    a = scaler(min_replicas=0, fine_max_step=2.0)
    # 10 replicas starting do not multiply a TTFT they did not make
    s = ModelSignals(ready=3, warming=10, slots=256, running=3, ttft_p99_s=20.0)
    assert a.decide(0.0, s).fine == 6  # at most 2 x the 3 ready, not 10 x 13


def test_fine_without_enough_first_tokens_has_no_opinion() -> None:
    a = scaler(min_replicas=0)
    assert a.decide(0.0, ModelSignals(ready=3, slots=256, ttft_p99_s=None)).fine == 0


# ---- ahead: forecast x time in system, plus the warm pool ----------------------------------------


def test_ahead_uses_littles_law_on_the_forecast_rate() -> None:
    a = scaler(target_concurrency=0.5, warm_pool_share=0.0, min_replicas=0)
    # now: 10 req/s and 160 requests in the system -> W = 16 s; forecast 20 req/s ahead:
    # 320 requests in the system, 16 per replica -> 20 replicas
    s = ModelSignals(
        ready=10, slots=32, running=160, rate_rps=10.0, ahead_rps=20.0, ahead_high_rps=20.0
    )
    d = a.decide(0.0, s)
    assert d.time_in_system_s == pytest.approx(16.0)
    assert (d.fast, d.ahead, d.warm_pool, d.desired, d.reason) == (10, 20, 0, 20, "ahead")


def test_warm_pool_is_a_share_of_the_interval_width() -> None:
    a = scaler(target_concurrency=0.5, warm_pool_share=0.5, min_replicas=0)
    s = ModelSignals(
        ready=10, slots=32, running=160, rate_rps=10.0, ahead_rps=10.0, ahead_high_rps=14.0
    )
    d = a.decide(0.0, s)
    # pool: 0.5 x (14 - 10) req/s x 16 s / 16 per replica = 2 replicas on top of 10
    assert (d.warm_pool, d.ahead) == (2, 12)


def test_time_in_system_is_smoothed_and_not_learned_from_a_trickle() -> None:
    a = scaler(min_replicas=0)
    a.decide(0.0, ModelSignals(ready=1, slots=32, running=10, rate_rps=1.0))  # W = 10
    a.decide(5.0, ModelSignals(ready=1, slots=32, running=20, rate_rps=1.0))  # W = 20
    assert a.time_in_system_s == pytest.approx(11.0)  # EWMA weight 0.1
    a.decide(10.0, ModelSignals(ready=1, slots=32, running=30, rate_rps=0.01))
    assert a.time_in_system_s == pytest.approx(11.0)  # below MIN_RATE_FOR_W: kept


def test_ahead_without_a_forecast_has_no_opinion() -> None:
    a = scaler(min_replicas=0)
    d = a.decide(0.0, ModelSignals(ready=2, slots=32, running=10, rate_rps=2.0))
    assert d.ahead == 0 and d.warm_pool == 0


def test_ahead_window_starts_after_the_cold_start() -> None:
    assert ahead_window(75.0, AutoscaleConfig(lead_s=600)) == (75.0, 600.0)
    assert ahead_window(-1.0, AutoscaleConfig(lead_s=0)) == (0.0, 1.0)


# ---- stabilization: up at once, down after the cooldown ------------------------------------------


def test_scale_up_is_immediate_and_scale_down_waits_for_the_cooldown() -> None:
    a = scaler(target_concurrency=1.0, scale_down_cooldown_s=90, min_replicas=0)
    high = ModelSignals(ready=2, slots=10, running=20, waiting=30)  # 50 -> 5
    low = ModelSignals(ready=5, slots=10, running=10)  # 10 -> 1
    assert a.decide(0.0, ModelSignals(ready=1, slots=10, running=10)).desired == 1
    assert a.decide(5.0, high).desired == 5  # at once
    for t in range(10, 95, 5):  # 85 s of low load: still within 90 s of the high one
        d = a.decide(float(t), low)
        assert (d.desired, d.recommended, d.reason) == (5, 1, "scale-down cooldown")
    assert a.decide(96.0, low).desired == 1  # the high recommendation left the window


def test_a_short_dip_does_not_scale_down() -> None:
    a = scaler(target_concurrency=1.0, scale_down_cooldown_s=60, min_replicas=0)
    busy = ModelSignals(ready=4, slots=10, running=40)
    quiet = ModelSignals(ready=4, slots=10, running=5)
    for t in range(0, 300, 5):
        s = quiet if (t // 5) % 6 == 5 else busy  # a quiet tick every 30 s
        assert a.decide(float(t), s).desired == 4


def test_zero_cooldown_follows_the_recommendation() -> None:
    a = scaler(target_concurrency=1.0, scale_down_cooldown_s=0, min_replicas=0)
    assert a.decide(0.0, ModelSignals(ready=1, slots=10, running=40)).desired == 4
    assert a.decide(1.0, ModelSignals(ready=4, slots=10, running=10)).desired == 1
    assert a.decide(2.0, ModelSignals(ready=1, slots=10, running=30)).desired == 3


# ---- bounds --------------------------------------------------------------------------------------


def test_bounds_per_model() -> None:
    cfg = AutoscaleConfig(
        min_replicas=1, max_replicas=8, models={"big": AutoscaleModelLimits(max_replicas=3)}
    )
    scalers = Autoscaler(cfg, ttft_slo_s=2.0)
    flood = ModelSignals(ready=2, slots=4, running=8, waiting=200)
    out = scalers.decide(0.0, {"big": flood, "small": flood})
    assert (out["big"].desired, out["big"].reason) == (3, "max_replicas")
    assert out["small"].desired == 8
    assert out["big"].fast > 8  # the recommendation is kept for the operator to see


def test_autoscaler_forgets_models_no_longer_given() -> None:
    scalers = Autoscaler(AutoscaleConfig(), ttft_slo_s=2.0)
    scalers.decide(0.0, {"a": ModelSignals(ready=1), "b": ModelSignals(ready=1)})
    scalers.decide(5.0, {"a": ModelSignals(ready=1)})
    assert set(scalers.models) == {"a"}


def test_ttft_target_defaults_to_the_slo() -> None:
    assert Autoscaler(AutoscaleConfig(), ttft_slo_s=1.5).ttft_target_s == 1.5
    assert Autoscaler(AutoscaleConfig(ttft_target_s=0.5), ttft_slo_s=1.5).ttft_target_s == 0.5


def test_config_refuses_min_above_max(tmp_path: Path) -> None:
    path = tmp_path / "gateway.yaml"
    path.write_text("autoscale: {min_replicas: 5, max_replicas: 2}\n")
    with pytest.raises(ConfigError, match="min_replicas must not exceed max_replicas"):
        load_config(path)
    path.write_text("autoscale: {models: {m: {min_replicas: 3, max_replicas: 1}}}\n")
    with pytest.raises(ConfigError, match=r"autoscale\.models\.m.*min_replicas"):
        load_config(path)


def test_decision_as_dict_names_every_paradigm() -> None:
    d = scaler().decide(0.0, ModelSignals(ready=1, slots=8, running=4))
    out = d.as_dict()
    assert out["desired_replicas"] == d.desired
    paradigms = out["paradigms"]
    assert isinstance(paradigms, dict) and set(paradigms) == {"fast", "fine", "ahead"}


# ---- scale-up lag --------------------------------------------------------------------------------


def test_lag_is_from_the_ask_to_the_replica_ready_first_in_first_out() -> None:
    lag = LagTracker()
    assert lag.observe(0.0, desired=2, ready=2) == []
    assert lag.observe(10.0, desired=4, ready=2) == []  # two asked at 10 s
    assert lag.observe(20.0, desired=5, ready=2) == []  # one more at 20 s
    assert lag.observe(80.0, desired=5, ready=3) == [70.0]
    assert lag.observe(95.0, desired=5, ready=5) == [85.0, 75.0]
    assert lag.observe(100.0, desired=5, ready=5) == []


def test_lag_asks_withdrawn_when_desired_falls() -> None:
    lag = LagTracker()
    lag.observe(0.0, desired=1, ready=1)
    lag.observe(5.0, desired=4, ready=1)  # three asked
    lag.observe(10.0, desired=2, ready=1)  # two withdrawn, the oldest ask stays
    assert list(lag.asked) == [(5.0, 2)]
    assert lag.observe(60.0, desired=2, ready=3) == [55.0]  # the second ready had no ask


def test_a_replica_back_from_a_drain_completes_no_ask() -> None:
    lag = LagTracker()
    lag.observe(0.0, desired=3, ready=2)  # asks 1 at 0 s
    lag.observe(1.0, desired=3, ready=2)
    assert lag.observe(2.0, desired=3, ready=3) == [2.0]
    lag.observe(3.0, desired=3, ready=2)  # one drained: nothing new asked of anyone
    assert list(lag.asked) == []
    assert lag.observe(60.0, desired=3, ready=3) == []  # its return is no scale-up lag
    lag.observe(61.0, desired=3, ready=2)  # drained again, then a rise: one new ask
    lag.observe(62.0, desired=4, ready=2)
    assert list(lag.asked) == [(62.0, 4)]
    assert lag.observe(70.0, desired=4, ready=3) == []  # the drained one is back: not it
    assert lag.observe(90.0, desired=4, ready=4) == [28.0]  # the new one


def test_a_crash_and_return_during_a_scale_up_serves_no_ask() -> None:
    lag = LagTracker()
    lag.observe(0.0, desired=2, ready=2)
    lag.observe(10.0, desired=5, ready=2)  # asks for the 3rd, 4th and 5th
    lag.observe(12.0, desired=5, ready=1)  # one of the two crashes
    assert lag.observe(30.0, desired=5, ready=2) == []  # it is back: still two ready
    assert lag.observe(70.0, desired=5, ready=3) == [60.0]  # the 3rd, asked at 10 s


def test_any_uncertainty_keeps_one_replica_ready_in_the_pool() -> None:
    a = scaler(target_concurrency=0.5, warm_pool_share=0.3, min_replicas=0)
    # W = 16 s, 16 per replica: the forecast needs ceil(9.5) = 10 replicas; a sliver of
    # width (0.3 x 0.2 req/s x 16 s / 16 = 0.06 replica) is rounded up on its own: 1 ready
    s = ModelSignals(
        ready=10, slots=32, running=160, rate_rps=10.0, ahead_rps=9.5, ahead_high_rps=9.7
    )
    d = a.decide(0.0, s)
    assert (d.ahead, d.warm_pool) == (11, 1)
    # no width, no pool
    s2 = ModelSignals(
        ready=10, slots=32, running=160, rate_rps=10.0, ahead_rps=9.5, ahead_high_rps=9.5
    )
    assert (a.decide(5.0, s2).warm_pool) == 0
