"""The fleet: every :class:`~gateway.fleet.backend.Backend`, in config order, each built whole
from the configuration (its circuit breaker, cycle clock, GPU trackers and API key)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

from gateway.config import (
    BackendConfig,
    BreakerSettings,
    GatewayConfig,
    LifecycleConfig,
    ThermalConfig,
)
from gateway.fleet.backend import Backend
from gateway.fleet.cycles import initial_cycle_clock, never_due
from gateway.fleet.gpu_health import GpuHealth
from gateway.routing.thermal import ThermalTracker
from gateway.traffic.breaker import BreakerConfig, CircuitBreaker


class Fleet:
    """The set of backends, in config order, with lookups by id and by model.

    Builds each :class:`Backend` whole: its circuit breaker from ``breaker`` (thresholds;
    the TTFT SLO ``ttft_slo_s`` arms its latency fuse), its cycle clock from ``lifecycle``
    (first due times spread over each period from ``clock()`` now, monotonic seconds), its
    GPU trackers from ``thermal`` when it has a ``gpu_metrics_url``, its cold-start timer
    from now. Without those settings its parts are the defaults (a default breaker, no cycle
    ever due, no GPU trackers). Raises ``ConfigError`` for an unset ``api_key_env``.
    """

    def __init__(
        self,
        configs: list[BackendConfig],
        breaker: BreakerConfig | None = None,
        lifecycle: LifecycleConfig | None = None,
        thermal: ThermalConfig | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.backends: list[Backend] = []
        self._by_id: dict[str, Backend] = {}
        now = clock()
        for i, c in enumerate(configs):
            monitored = thermal is not None and c.gpu_metrics_url is not None
            b = Backend(
                config=c,
                models=tuple(c.models or ()),
                breaker=CircuitBreaker(breaker or BreakerConfig(), clock),
                cycles=(
                    initial_cycle_clock(i, len(configs), now, lifecycle)
                    if lifecycle is not None
                    else never_due()
                ),
                thermal=ThermalTracker(thermal) if monitored and thermal else None,
                gpu_health=(
                    GpuHealth(thermal.xid_threshold, thermal.xid_window_s)
                    if monitored and thermal
                    else None
                ),
                first_seen=now,
            )
            self.backends.append(b)
            self._by_id[c.id] = b

    @classmethod
    def from_config(cls, cfg: GatewayConfig, clock: Callable[[], float] = time.monotonic) -> Fleet:
        """The fleet of ``cfg.backends`` with the breaker, lifecycle and thermal settings of
        ``cfg`` (``clock``: monotonic seconds)."""
        return cls(
            cfg.backends,
            breaker_config(cfg.breaker, cfg.slo.ttft_s),
            cfg.lifecycle,
            cfg.thermal,
            clock,
        )

    def __iter__(self) -> Iterator[Backend]:
        return iter(self.backends)

    def __len__(self) -> int:
        return len(self.backends)

    def get(self, backend_id: str) -> Backend | None:
        return self._by_id.get(backend_id)

    def serving(self, model: str) -> list[Backend]:
        """Backends that list ``model`` (any state)."""
        return [b for b in self.backends if model in b.models]

    def known_models(self) -> set[str]:
        out: set[str] = set()
        for b in self.backends:
            out.update(b.models)
        return out

    def any_routable(self) -> bool:
        return any(b.routable for b in self.backends)


def breaker_config(bc: BreakerSettings, ttft_slo_s: float) -> BreakerConfig:
    """The circuit breaker's thresholds from the ``breaker:`` settings and the TTFT SLO
    (seconds; the latency fuse trips at ``latency_fuse_factor`` times it, on P99)."""
    return BreakerConfig(
        consecutive_failures=bc.consecutive_failures,
        error_rate=bc.error_rate,
        min_requests=bc.min_requests,
        window_s=bc.window_s,
        open_base_s=bc.open_base_s,
        open_max_s=bc.open_max_s,
        half_open_max=bc.half_open_max,
        ttft_slo_s=ttft_slo_s,
        latency_fuse_factor=bc.latency_fuse_factor,
    )
