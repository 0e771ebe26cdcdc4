"""Arrival forecasts: per-model counts exported as ``gateway_forecast_*``, per-bucket ones
handed to the batcher.

:class:`ArrivalForecasts` counts arrivals (one dict increment per request) and, once a
second (a control loop), ticks the per-model and per-bucket Holt-Winters forecasts
(:mod:`gateway.traffic.forecast`), exports them and hands each bucket's forecast and the
TTFT-SLO slack to the batcher (:class:`gateway.traffic.batcher.Batcher`).
"""

from __future__ import annotations

from collections.abc import Callable

from gateway.config import GatewayConfig
from gateway.metrics import GatewayMetrics
from gateway.traffic.batcher import BUCKETS, Batcher, RateView
from gateway.traffic.forecast import ArrivalCounter, ForecastBank, ForecastParams


def forecast_params(cfg: GatewayConfig) -> ForecastParams:
    """The Holt-Winters parameters of the ``forecast:`` settings."""
    f = cfg.forecast
    return ForecastParams(
        alpha=f.alpha,
        beta=f.beta,
        gamma=f.gamma,
        phi=f.phi,
        horizon_s=f.horizon_s,
        season_s=f.season_s,
        season_bins=f.season_bins,
    )


class ArrivalForecasts:
    """Per-model (exported) and per-bucket (for the batcher) arrival forecasts."""

    def __init__(
        self,
        params: ForecastParams,
        metrics: GatewayMetrics,
        batcher: Batcher | None = None,
        ttft_slack: Callable[[], float | None] | None = None,
    ) -> None:
        self.models = ForecastBank(params)
        self.buckets = ForecastBank(params)
        self.metrics = metrics
        self.batcher = batcher
        self.ttft_slack = ttft_slack
        self._models_now = ArrivalCounter()
        self._buckets_now = ArrivalCounter()

    def rate_rps(self, model: str) -> float | None:
        """The forecast mean arrival rate of ``model`` over the next horizon (requests/s),
        or None before its first second was counted."""
        f = self.models.get(model)
        return None if f is None else f.rate

    def arrive(self, model: str, prio: int) -> None:
        """Count one arriving request (hot path)."""
        self._models_now.add(model)
        if self.batcher is not None:
            self._buckets_now.add(BUCKETS[prio])

    def tick(self, t: float) -> None:
        """Second ``t`` (Unix seconds, so the season follows the time of day) has ended."""
        m = self.metrics
        self.models.tick(t, self._models_now.take())
        for model, hw in self.models.series.items():
            f = hw.forecast()
            m.forecast_rps.labels(model).set(f.rate)
            m.forecast_interval.labels(model, "low").set(f.low)
            m.forecast_interval.labels(model, "high").set(f.high)
            if hw.last_error is not None:
                m.forecast_error.labels(model).set(hw.last_error)
        if self.batcher is None:
            return
        self.buckets.tick(t, self._buckets_now.take())
        for prio, name in enumerate(BUCKETS):
            bucket = self.buckets.get(name)
            self.batcher.set_rate(
                prio, None if bucket is None else RateView(bucket.rate, bucket.low, bucket.high)
            )
        if self.ttft_slack is not None:
            self.batcher.set_slack(self.ttft_slack())
