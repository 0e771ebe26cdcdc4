"""The arrival-rate forecaster on synthetic traces (steady, diurnal, burst, step change),
scored against the naive last-value baseline on the same seeded Poisson counts."""

from __future__ import annotations

import math
import random

import pytest

from gateway.traffic.forecast import ForecastBank, ForecastParams, HoltWinters, mape

H = 30


def poisson(rng: random.Random, lam: float) -> int:
    """A Poisson draw (Knuth's method; normal approximation above 50/s)."""
    if lam <= 0:
        return 0
    if lam > 50:
        return max(0, round(rng.gauss(lam, math.sqrt(lam))))
    limit, k, p = math.exp(-lam), 0, 1.0
    while True:
        p *= rng.random()
        if p <= limit:
            return k
        k += 1


def score(rates: list[float], params: ForecastParams, seed: int = 7) -> tuple[float, float, float]:
    """(MAPE of the forecaster %, MAPE of the naive forecast %, interval coverage 0-1),
    each forecast made at second t scored on the mean of seconds t+1..t+H."""
    rng = random.Random(seed)
    counts = [poisson(rng, r) for r in rates]
    hw = HoltWinters(params)
    actual, ours, naive = [], [], []
    inside = 0
    for t, y in enumerate(counts):
        hw.observe(t, y)
        if H < t < len(counts) - H:
            a = sum(counts[t + 1 : t + H + 1]) / H
            f = hw.forecast()
            actual.append(a)
            ours.append(f.rate)
            naive.append(float(y))
            inside += f.low <= a <= f.high
    return mape(actual, ours), mape(actual, naive), inside / len(actual)


DAY = 600  # a compressed "day" (s) so that several periods fit in a fast test

TRACES = {
    "steady": ([20.0] * 3000, ForecastParams()),
    "step": ([10.0] * 1500 + [40.0] * 1500, ForecastParams()),
    "burst": ([10.0 + (60.0 if t % 300 < 20 else 0.0) for t in range(3000)], ForecastParams()),
    "diurnal": (
        [20 + 15 * math.sin(2 * math.pi * t / DAY) for t in range(DAY * 8)],
        ForecastParams(season_s=DAY, season_bins=60),
    ),
}


@pytest.mark.parametrize("name", list(TRACES))
def test_beats_naive_last_value(name: str) -> None:
    rates, params = TRACES[name]
    ours, naive, _ = score(rates, params)
    assert ours < naive, f"{name}: forecaster MAPE {ours:.1f}% vs naive {naive:.1f}%"


def test_steady_interval_covers_most_outcomes() -> None:
    rates, params = TRACES["steady"]
    _, _, coverage = score(rates, params)
    assert coverage >= 0.85  # a 95% interval; the error variance is itself estimated


def test_step_change_is_followed() -> None:
    hw = HoltWinters()
    for t in range(600):
        hw.observe(t, 10)
    errors = []
    for t in range(600, 720):
        hw.observe(t, 40)
        errors.append(hw.last_error)
    assert abs(hw.forecast().rate - 40) < 4  # within 10% two minutes after the step
    assert max(e for e in errors if e is not None) > 10  # the step showed as a large error


def test_daily_pattern_is_anticipated() -> None:
    """Each "day" the rate jumps from 10 to 40/s at the same time: after a few days the
    forecast made just before the jump already rises (the season), a level-only model's
    does not."""
    seasonal = HoltWinters(ForecastParams(season_s=DAY, season_bins=60))
    flat = HoltWinters(ForecastParams(season_s=DAY, season_bins=60, gamma=0.0))
    for t in range(DAY * 6 + 290):  # stop 10 s before the jump at phase 300
        y = 40.0 if 300 <= t % DAY < 450 else 10.0
        seasonal.observe(t, y)
        flat.observe(t, y)
    assert seasonal.forecast().rate > flat.forecast().rate + 5


def test_wide_interval_when_errors_are_large() -> None:
    calm, noisy = HoltWinters(), HoltWinters()
    rng = random.Random(3)
    for t in range(600):
        calm.observe(t, 20)
        noisy.observe(t, rng.choice((0, 40)))
    assert noisy.forecast().width > 3 * calm.forecast().width


def test_quiet_series_decays_to_zero() -> None:
    bank = ForecastBank()
    bank.tick(0, {"m": 50})
    for t in range(1, 300):
        bank.tick(t, {})
    f = bank.get("m")
    assert f is not None and f.rate < 1.0
    assert bank.get("other") is None


def test_invalid_params_refused() -> None:
    with pytest.raises(ValueError):
        ForecastParams(alpha=1.5)
    with pytest.raises(ValueError):
        ForecastParams(phi=0)


def test_arrival_forecasts_export_metrics_and_feed_the_batcher() -> None:
    """The 1 s tick of the app: per-model gauges, and each bucket's rate to the batcher."""
    from gateway.flow.forecasts import ArrivalForecasts
    from gateway.metrics import GatewayMetrics
    from gateway.traffic.batcher import Batcher, BucketSettings

    metrics = GatewayMetrics()
    batcher = Batcher([BucketSettings(4, 0.002)] * 3, 100)
    fc = ArrivalForecasts(ForecastParams(), metrics, batcher, lambda: 0.5)
    for t in range(120):
        for _ in range(10):
            fc.arrive("m1", 0)  # 10 high-priority requests per second
        fc.tick(float(t))
    reg = metrics.registry
    rate = reg.get_sample_value("gateway_forecast_rps", {"model": "m1"})
    low = reg.get_sample_value("gateway_forecast_interval_rps", {"model": "m1", "bound": "low"})
    high = reg.get_sample_value("gateway_forecast_interval_rps", {"model": "m1", "bound": "high"})
    assert rate is not None and abs(rate - 10) < 0.5
    assert low is not None and high is not None and low <= rate <= high
    assert reg.get_sample_value("gateway_forecast_error", {"model": "m1"}) is not None
    view = batcher.rates[0]
    assert view is not None and abs(view.rate - 10) < 0.5
    assert batcher.rates[1] is None and batcher.ttft_slack_s == 0.5


# ---- the forecast over a later window (the autoscaler's "ahead" paradigm) ----------------------


def test_window_of_a_steady_series_is_its_rate() -> None:
    hw = HoltWinters()
    for t in range(300):
        hw.observe(t, 4.0)
    f = hw.window(90, 600)
    assert f.rate == pytest.approx(4.0, rel=1e-6)
    assert f.horizon_s == 600
    assert f.low <= f.rate <= f.high


def test_window_reads_the_season_of_the_seconds_it_covers() -> None:
    # a "day" of 200 s in 4 bins of 50 s: 10 req/s in the third bin, 2 req/s elsewhere
    p = ForecastParams(season_s=200.0, season_bins=4, gamma=0.9, horizon_s=10)
    hw = HoltWinters(p)
    for t in range(200 * 6):
        hw.observe(t, 10.0 if 100 <= t % 200 < 150 else 2.0)
    # now: the end of a day (t = 1199). Seconds 101..150 ahead are the busy bin
    busy = hw.window(100, 50).rate
    quiet = hw.window(0, 50).rate
    assert busy > quiet + 4.0


def test_window_extends_a_damped_trend() -> None:
    hw = HoltWinters(ForecastParams(beta=0.2, phi=0.98))
    for t in range(600):
        hw.observe(t, t / 60.0)  # rising by one request/s every minute
    near, far = hw.window(0, 30).rate, hw.window(300, 300).rate
    assert far > near  # further ahead on the rising trend
    # damped: never more than the undamped slope would give
    assert far < near + (450 / 60.0) + 1.0


def test_window_interval_is_never_narrower_than_poisson_noise() -> None:
    hw = HoltWinters()
    for t in range(300):
        hw.observe(t, 9.0)
    f = hw.window(0, 100)
    assert f.high - f.rate >= 1.96 * (9.0 / 100) ** 0.5 - 1e-9


def test_window_before_any_observation_and_bad_arguments() -> None:
    hw = HoltWinters()
    assert hw.window(60, 600).rate == 0.0
    with pytest.raises(ValueError):
        hw.window(-1, 60)
    with pytest.raises(ValueError):
        hw.window(0, 0.5)
