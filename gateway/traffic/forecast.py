"""Arrival-rate forecast: per-second arrival counts -> the mean rate over the next
``horizon_s`` seconds, with a prediction interval (pure: no clock, no I/O).

Model: additive Holt-Winters with a damped trend, written out by hand (no statsmodels: it
refits a whole series per call, while this updates in O(1) per 1 s tick). Equations from
Hyndman & Athanasopoulos, *Forecasting: Principles and Practice* (3rd ed., FPP3) §8.3
(additive seasonal method) with the damped trend of §8.2; ``y_t`` is the count of second
``t`` (requests/s), ``m`` the seasonal period::

    level     l_t = alpha * (y_t - s_{t-m}) + (1 - alpha) * (l_{t-1} + phi * b_{t-1})
    trend     b_t = beta * (l_t - l_{t-1}) + (1 - beta) * phi * b_{t-1}
    season    s_t = gamma * (y_t - l_{t-1} - phi * b_{t-1}) + (1 - gamma) * s_{t-m}
    forecast  y_{t+h} = l_t + (phi + phi^2 + ... + phi^h) * b_t + s_{t+h-m}

Daily seasonality at 1 s resolution would need 86,400 seasonal states per series, so the
season is kept in ``season_bins`` bins (default 288 bins of 5 min, ``season_s`` = one day):
the bin of second ``t`` plays ``s_{t-m}``. A bin is visited by ``season_s / season_bins``
ticks per period, so each tick moves it by ``gamma / ticks_per_bin``: ``gamma`` keeps
FPP3's meaning (weight of one period's new observation), and within a period the level,
not the season, follows the changes. The forecast over the horizon is the mean of
``y_{t+1..t+H}``, the bins it crosses read once each (``H / bin width + 1`` reads: O(1) in
the length of the history).

Defaults (alpha 0.1, beta 0.02, phi 0.9, gamma 0.3) were chosen on synthetic traces
(``tests/unit/test_forecast.py``, ``benchmarks/batcher.py``): they beat the naive
last-value forecast on steady, step, burst and daily-pattern traces; on a cycle only a few
times longer than the horizon (e.g. 150 s) the 1 s-smoothed level lags and naive is as good
or better.

Prediction interval: empirical, from the forecaster's own errors (FPP3 §5.5, intervals
from the distribution of past forecast errors): every tick compares the mean actually
observed over the last ``H`` seconds with the forecast made ``H`` seconds earlier (that
difference is ``gateway_forecast_error``); an exponentially weighted mean of the squared
errors gives ``sigma``; the interval is ``forecast +- z * sigma`` (z = 1.96: 95 %), never
narrower than the Poisson noise of an H-second mean (``sqrt(rate / H)``), and clipped at 0.

Units: counts per second (requests/s) throughout; times in seconds.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ForecastParams:
    """Smoothing parameters (FPP3 notation) and shapes. ``alpha``, ``beta``, ``gamma`` in
    [0, 1]: weights of the newest observation for level and trend (per 1 s tick) and season
    (``gamma`` per period: one visit of a seasonal bin); ``phi`` the trend damping (1: none);
    ``horizon_s`` H; ``season_s`` the period m (s);
    ``season_bins`` how many seasonal states cover one period; ``z`` the interval's
    normal quantile; ``error_alpha`` the weight of the newest squared error in sigma^2."""

    alpha: float = 0.1
    beta: float = 0.02
    gamma: float = 0.3
    phi: float = 0.9
    horizon_s: int = 30
    season_s: float = 86_400.0
    season_bins: int = 288
    z: float = 1.96
    error_alpha: float = 0.05

    def __post_init__(self) -> None:
        for name in ("alpha", "beta", "gamma", "error_alpha"):
            v = getattr(self, name)
            if not 0.0 <= v <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {v}")
        if not 0.0 < self.phi <= 1.0:
            raise ValueError(f"phi must be in (0, 1], got {self.phi}")
        if self.horizon_s < 1 or self.season_bins < 1 or self.season_s <= 0:
            raise ValueError("horizon_s, season_bins and season_s must be positive")


@dataclass(frozen=True, slots=True)
class Forecast:
    """Mean arrival rate over the next ``horizon_s`` seconds (requests/s), the interval
    ``[low, high]`` around it, and ``level``: the de-seasonalised rate right now."""

    rate: float
    low: float
    high: float
    level: float
    horizon_s: int

    @property
    def width(self) -> float:
        """``high - low`` (requests/s)."""
        return self.high - self.low


class HoltWinters:
    """One series (e.g. one model's arrivals). Feed :meth:`observe` one count per second
    (second index ``t`` = seconds since any fixed origin, e.g. Unix time, so the season
    lines up with the time of day); read :meth:`forecast`. O(1) time per tick, O(bins + H)
    memory."""

    def __init__(self, params: ForecastParams | None = None) -> None:
        self.p = p = params or ForecastParams()
        self.level: float | None = None
        self.trend = 0.0
        self.season = [0.0] * p.season_bins
        self.ticks = 0
        self._bin_s = p.season_s / p.season_bins
        self._gamma_tick = p.gamma / max(1.0, self._bin_s)  # per 1 s tick
        self._damp_sum = sum(p.phi**k for k in range(1, p.horizon_s + 1))
        # mean over h = 1..H of (phi + ... + phi^h): the trend's weight in an H-second mean
        self._trend_weight = (
            sum(sum(p.phi**k for k in range(1, h + 1)) for h in range(1, p.horizon_s + 1))
            / p.horizon_s
        )
        self._recent: deque[float] = deque(maxlen=p.horizon_s)  # last H counts
        self._recent_sum = 0.0
        self._past: deque[float] = deque(maxlen=p.horizon_s)  # forecasts made 1..H s ago
        self._err_var: float | None = None
        self.last_error: float | None = None  # actual - predicted, last full horizon
        self._t = 0.0

    def _bin(self, t: float) -> int:
        return int(t // self._bin_s) % self.p.season_bins

    def observe(self, t: float, count: float) -> None:
        """The arrivals counted during second ``t`` (requests in that second)."""
        p = self.p
        self._t = t
        self.ticks += 1
        # score the forecast made H seconds ago against what the last H seconds brought
        if len(self._recent) == p.horizon_s:
            self._recent_sum -= self._recent[0]
        self._recent.append(count)
        self._recent_sum += count
        if len(self._past) == p.horizon_s:
            actual = self._recent_sum / p.horizon_s
            err = actual - self._past[0]
            self.last_error = err
            sq = err * err
            self._err_var = (
                sq if self._err_var is None else (1 - p.error_alpha) * self._err_var
                + p.error_alpha * sq
            )
        b = self._bin(t)
        if self.level is None:
            self.level = float(count)
        else:
            prev_level, prev_trend = self.level, self.trend
            s = self.season[b]
            self.level = p.alpha * (count - s) + (1 - p.alpha) * (prev_level + p.phi * prev_trend)
            self.trend = p.beta * (self.level - prev_level) + (1 - p.beta) * p.phi * prev_trend
            g = self._gamma_tick
            self.season[b] = g * (count - prev_level - p.phi * prev_trend) + (1 - g) * s
        self._past.append(self._mean_forecast(t))

    def _mean_forecast(self, t: float) -> float:
        """Point forecast of the mean rate over seconds ``t+1 .. t+H`` (requests/s, >= 0)."""
        p = self.p
        if self.level is None:
            return 0.0
        h = p.horizon_s
        # mean seasonal term over seconds t+1 .. t+h, one step per bin crossed
        season = 0.0
        k = 1
        while k <= h:
            start = t + k
            bin_end = (math.floor(start / self._bin_s) + 1) * self._bin_s
            n = min(h - k + 1, max(1, math.ceil(bin_end - start)))
            season += self.season[self._bin(start)] * n
            k += n
        season /= h
        return max(0.0, self.level + self._trend_weight * self.trend + season)

    def forecast(self) -> Forecast:
        """The forecast now (all zeros before the first observation)."""
        p = self.p
        rate = self._mean_forecast(self._t)
        poisson_var = rate / p.horizon_s
        var = max(poisson_var, self._err_var or 0.0) if self.ticks > p.horizon_s else max(
            poisson_var, rate * rate
        )  # no error history yet: an interval as wide as the rate itself
        half = p.z * math.sqrt(var)
        level = max(0.0, (self.level or 0.0) + self.season[self._bin(self._t)])
        return Forecast(rate, max(0.0, rate - half), rate + half, level, p.horizon_s)

    def window(self, start_s: float, span_s: float) -> Forecast:
        """The forecast mean rate over seconds ``now + start_s .. now + start_s + span_s``
        (requests/s; ``now`` the last observed second), for a decision that takes effect
        later (the autoscaler's "ahead" paradigm: ``start_s`` a replica's cold start).

        Same model as :meth:`forecast`: level, the damped trend's mean weight over those
        steps (``phi + ... + phi^h`` averaged over ``h``, in closed form), the seasonal bins
        the window crosses weighted by the seconds in each. The interval keeps the
        forecaster's own error (``sigma`` of its ``horizon_s`` means), never narrower than
        the Poisson noise of a ``span_s`` mean. Raises ValueError for a negative start or
        a span under 1 s."""
        if start_s < 0 or span_s < 1:
            raise ValueError("need start_s >= 0 and span_s >= 1")
        p = self.p
        if self.level is None:
            return Forecast(0.0, 0.0, 0.0, 0.0, round(span_s))
        a, n = int(start_s), max(1, int(span_s))
        phi = p.phi
        if phi >= 1.0:
            weight = a + (n + 1) / 2.0  # mean of h over a+1 .. a+n
        else:  # mean over h of phi (1 - phi^h) / (1 - phi)
            mean_pow = phi ** (a + 1) * (1 - phi**n) / ((1 - phi) * n)
            weight = phi / (1 - phi) * (1 - mean_pow)
        t0 = self._t + a + 1
        season = 0.0
        covered = 0.0
        start = t0
        end = t0 + n
        while start < end:
            bin_end = (math.floor(start / self._bin_s) + 1) * self._bin_s
            step = min(end, bin_end) - start
            if step <= 0:
                step = 1.0
            season += self.season[self._bin(start)] * step
            covered += step
            start += step
        season /= covered
        rate = max(0.0, self.level + weight * self.trend + season)
        poisson_var = rate / n
        var = (
            max(poisson_var, self._err_var or 0.0)
            if self.ticks > p.horizon_s
            else max(poisson_var, rate * rate)
        )
        half = p.z * math.sqrt(var)
        level = max(0.0, self.level + self.season[self._bin(self._t)])
        return Forecast(rate, max(0.0, rate - half), rate + half, level, n)


class ArrivalCounter:
    """Counts arrivals per series key between ticks (the hot path's only forecast work:
    one dict increment per request)."""

    __slots__ = ("counts",)

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}

    def add(self, key: str, n: int = 1) -> None:
        self.counts[key] = self.counts.get(key, 0) + n

    def take(self) -> dict[str, int]:
        """The counts since the last call, and reset."""
        out, self.counts = self.counts, {}
        return out


class ForecastBank:
    """A :class:`HoltWinters` per series key, all ticked together once per second.

    A key seen once keeps being ticked (with 0 when quiet), so a model that stops
    receiving traffic decays to 0 rather than freezing at its last rate."""

    def __init__(self, params: ForecastParams | None = None) -> None:
        self.params = params or ForecastParams()
        self.series: dict[str, HoltWinters] = {}

    def tick(self, t: float, counts: dict[str, int]) -> None:
        """One second ``t`` has ended with ``counts`` arrivals per key."""
        for key in counts:
            if key not in self.series:
                self.series[key] = HoltWinters(self.params)
        for key, hw in self.series.items():
            hw.observe(t, counts.get(key, 0))

    def get(self, key: str) -> Forecast | None:
        hw = self.series.get(key)
        return None if hw is None else hw.forecast()


def naive_forecast(last_count: float) -> float:
    """The baseline: the next H seconds bring what the last second did (requests/s)."""
    return last_count


def mape(actual: list[float], predicted: list[float]) -> float:
    """Mean absolute percentage error (%) over points with ``actual > 0`` (nan if none)."""
    terms = [abs(a - p) / a for a, p in zip(actual, predicted, strict=True) if a > 0]
    return 100.0 * sum(terms) / len(terms) if terms else math.nan
