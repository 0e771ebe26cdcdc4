"""The thresholds the dashboard draws and the alert rules fire on, read from a config.

Prometheus rules cannot read the gateway's config, so the generator bakes these numbers in:
``python -m gateway.ops --config FILE`` writes rules for that fleet's own SLO; the committed
``deploy/prometheus/alerts.yaml`` uses the schema's defaults (``Limits.defaults()``).
"""

from __future__ import annotations

from dataclasses import dataclass

from gateway.config import (
    CalibrationConfig,
    GatewayConfig,
    SLOConfig,
    StatusConfig,
    ThermalConfig,
)


@dataclass(frozen=True)
class Limits:
    """What "too slow", "too hot" and "drifted" mean for a fleet.

    ``ttft_s`` / ``itl_s``: the SLO (``slo.ttft_s`` 2 s, ``slo.itl_s`` 0.1 s by default),
    compared with P99s. ``warm_c`` / ``hot_c``: the thermal tiers' lower bounds, °C
    (``thermal.warm_c`` 75, ``thermal.hot_c`` 85). ``calibration_threshold``: the
    similarity (0-1) below which a backend's calibration is a drift
    (``calibration.threshold`` 0.95). ``now_s`` / ``min_samples``: the status page's "now"
    window (seconds, ``status.now_s`` 300) and the sample it judges a window on
    (``status.min_samples`` 20: requests, streams, inter-token gaps); the latency and
    error-ratio alerts use the same window and minimum, so the page and the alerts agree
    on when there is enough traffic to judge."""

    ttft_s: float
    itl_s: float
    warm_c: float
    hot_c: float
    calibration_threshold: float
    now_s: float = 300.0
    min_samples: int = 20

    @classmethod
    def of(
        cls, slo: SLOConfig, thermal: ThermalConfig, calibration: CalibrationConfig,
        status: StatusConfig | None = None,
    ) -> Limits:
        """The limits of these config sections (``status`` None: its defaults)."""
        status = status or StatusConfig()
        return cls(
            ttft_s=slo.ttft_s,
            itl_s=slo.itl_s,
            warm_c=thermal.warm_c,
            hot_c=thermal.hot_c,
            calibration_threshold=calibration.threshold,
            now_s=status.now_s,
            min_samples=status.min_samples,
        )

    @classmethod
    def from_config(cls, cfg: GatewayConfig) -> Limits:
        """The limits of a loaded gateway config."""
        return cls.of(cfg.slo, cfg.thermal, cfg.calibration, cfg.status)

    @classmethod
    def defaults(cls) -> Limits:
        """The config schema's defaults (what the committed files are built with)."""
        return cls.of(SLOConfig(), ThermalConfig(), CalibrationConfig(), StatusConfig())
