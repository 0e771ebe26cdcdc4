"""The fleet: every :class:`~gateway.fleet.backend.Backend`, in config order, each built whole
from the configuration (its circuit breaker, cycle clock, GPU trackers and API key).

Membership changes while the gateway runs (discovery, :mod:`gateway.fleet.membership`, is
the only caller of :meth:`Fleet.add` and :meth:`Fleet.remove`). Parts that keep something
per backend either read the fleet live (the collectors, the probe and scrape loops,
:attr:`Fleet.version` for a cache keyed on membership) or listen
(:meth:`Fleet.on_change`) to forget a removed backend's things (its upstream session,
procedures, metric series).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Literal

from gateway.config import (
    BackendConfig,
    BreakerSettings,
    GatewayConfig,
    LifecycleConfig,
    ThermalConfig,
)
from gateway.fleet.backend import Backend
from gateway.fleet.cycles import (
    SPREAD_SLOTS,
    initial_cycle_clock,
    joined_cycle_clock,
    never_due,
    spread_slot,
)
from gateway.fleet.gpu_health import GpuHealth
from gateway.routing.thermal import ThermalTracker
from gateway.traffic.breaker import BreakerConfig, CircuitBreaker

# What happened to the backend a membership listener is called with.
Change = Literal["added", "removed"]
MembershipListener = Callable[[Backend, Change], None]


class Fleet:
    """The set of backends, in config order (discovered ones after them, in the order they
    came), with lookups by id and by model.

    Builds each :class:`Backend` whole: its circuit breaker from ``breaker`` (thresholds;
    the TTFT SLO ``ttft_slo_s`` arms its latency fuse), its cycle clock from ``lifecycle``
    (first due times spread over each period from ``clock()`` now, monotonic seconds), its
    GPU trackers from ``thermal`` when it has a ``gpu_metrics_url``, its cold-start timer
    from now. Without those settings its parts are the defaults (a default breaker, no cycle
    ever due, no GPU trackers). Raises ``ConfigError`` for an unset ``api_key_env``.
    :attr:`backends` is replaced, never changed in place, by :meth:`add` / :meth:`remove`.
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
        self._breaker = breaker or BreakerConfig()
        self._lifecycle = lifecycle
        self._thermal = thermal
        self._clock = clock
        self._listeners: list[MembershipListener] = []
        self.version = 0  # bumped by every add / remove (a cache key for per-backend tables)
        now = clock()
        for i, c in enumerate(configs):
            b = self._build(c, i, len(configs), now)
            self.backends.append(b)
            self._by_id[c.id] = b

    def _build(
        self, c: BackendConfig, index: int, count: int, now: float, joined: bool = False
    ) -> Backend:
        """One backend, whole: breaker, cycle clock (slot ``index`` of ``count`` of each
        period; ``joined``: it joins a running gateway, so no cycle is due within a full
        period, :func:`~gateway.fleet.cycles.joined_cycle_clock`), GPU trackers when it has
        a ``gpu_metrics_url``, cold-start timer from ``now``."""
        thermal = self._thermal
        monitored = thermal is not None and c.gpu_metrics_url is not None
        lifecycle = self._lifecycle
        return Backend(
            config=c,
            models=tuple(c.models or ()),
            breaker=CircuitBreaker(self._breaker, self._clock),
            cycles=(
                never_due()
                if lifecycle is None
                else joined_cycle_clock(index, count, now, lifecycle)
                if joined
                else initial_cycle_clock(index, count, now, lifecycle)
            ),
            thermal=ThermalTracker(thermal) if monitored and thermal else None,
            gpu_health=(
                GpuHealth(thermal.xid_threshold, thermal.xid_window_s)
                if monitored and thermal
                else None
            ),
            first_seen=now,
            joined_at=now,
        )

    # ---- membership (gateway.fleet.membership is the only caller) ---------------------------
    def on_change(self, listener: MembershipListener) -> None:
        """Call ``listener(backend, "added" | "removed")`` after every :meth:`add` /
        :meth:`remove` (e.g. the upstream pool closes a removed backend's session)."""
        self._listeners.append(listener)

    def add(self, config: BackendConfig) -> Backend:
        """Add a backend built whole from ``config`` (as at start: breaker, cycle clock with
        its first due times one full period after now plus its slot's share of the next,
        slot by a hash of its id (it was just started: no cycle within a period of
        joining, :func:`~gateway.fleet.cycles.joined_cycle_clock`), GPU trackers when
        it has a ``gpu_metrics_url``, cold-start timer from now), state ``cold``: the probe
        loop finds it, warm-up and slow start apply before it gets traffic. Raises
        ``ValueError`` for an id already in the fleet and ``ConfigError`` for an unset
        ``api_key_env``."""
        if config.id in self._by_id:
            raise ValueError(f"backend {config.id} is already in the fleet")
        slot = spread_slot(config.id)
        b = self._build(config, slot, SPREAD_SLOTS, self._clock(), joined=True)
        self.backends = [*self.backends, b]  # a new list: a loop iterating the old one is safe
        self._by_id[config.id] = b
        self.version += 1
        for listener in self._listeners:
            listener(b, "added")
        return b

    def remove(self, backend_id: str) -> Backend | None:
        """Take ``backend_id`` out of the fleet (the caller drained it first); returns the
        removed backend, or None when it was not in the fleet. Requests still holding it
        end on the detached record."""
        b = self._by_id.pop(backend_id, None)
        if b is None:
            return None
        self.backends = [x for x in self.backends if x is not b]
        self.version += 1
        for listener in self._listeners:
            listener(b, "removed")
        return b

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
