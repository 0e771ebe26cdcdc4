"""Mutable state of one simulated server: counters behind ``/sim/stats``, engine, faults."""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any

from gateway.sim.config import SimConfig
from gateway.sim.engine_types import EngineStats
from gateway.sim.faults import FaultInjector
from gateway.sim.metrics import SimMetrics
from gateway.sim.runtime import EngineRunner

RECENT_MAX = 200
"""How many recent generation requests ``/sim/stats`` keeps (path, headers, JSON body)."""
CONTROL_MAX = 1000
"""How many dev-mode route calls ``/sim/stats`` keeps (``control_calls``)."""


@dataclass
class SimState:
    """Mutable state of one simulated server (``app.state.sim``)."""

    config: SimConfig
    faults: FaultInjector
    runner: EngineRunner
    metrics: SimMetrics
    fingerprint: str
    sleep_level: int = 0
    closing: asyncio.Event = field(default_factory=asyncio.Event)
    requests_by_path: Counter[str] = field(default_factory=Counter)
    responses_by_status: Counter[str] = field(default_factory=Counter)
    open_by_path: Counter[str] = field(default_factory=Counter)
    client_aborts: int = 0
    dropped_connections: int = 0
    recent: deque[dict[str, Any]] = field(default_factory=lambda: deque(maxlen=RECENT_MAX))
    ids: itertools.count[int] = field(default_factory=itertools.count)
    # the dev-mode routes' calls (/reset_prefix_cache, /sleep, /wake_up): counted, and each
    # one recorded with its unix time and result, so a test reads what this backend saw
    control_counts: Counter[str] = field(default_factory=Counter)
    control_calls: deque[dict[str, Any]] = field(
        default_factory=lambda: deque(maxlen=CONTROL_MAX)
    )
    gpus: Any = None  # gateway.sim.gpu.GpuTicker, set by create_sim_app

    def record_control(self, path: str, ok: bool) -> None:
        """Count one dev-mode route call (``path``) and keep its time (unix seconds) and
        result (``ok``: what the route answered, e.g. ``success`` of a prefix-cache reset)."""
        self.control_counts[path] += 1
        self.control_calls.append({"path": path, "at": time.time(), "ok": ok})

    @property
    def open_requests(self) -> int:
        """Generation requests in flight (until their last byte is sent)."""
        return sum(self.open_by_path.values())

    def engine_stats(self) -> EngineStats:
        """The engine's current snapshot."""
        return self.runner.engine.stats()

    def snapshot(self) -> dict[str, Any]:
        """The ``GET /sim/stats`` body."""
        s = self.engine_stats()
        return {
            "model": self.config.model,
            "release": self.config.release.model_dump(),  # the build played (issue 18)
            "requests_by_path": dict(self.requests_by_path),
            "responses_by_status": dict(self.responses_by_status),
            "open_requests": self.open_requests,
            "open_by_path": {k: v for k, v in self.open_by_path.items() if v},
            "aborted": self.client_aborts,
            "dropped_connections": self.dropped_connections,
            "faults_injected": dict(self.faults.injected),
            "sleeping": self.sleep_level > 0,
            "control": dict(self.control_counts),
            "control_calls": list(self.control_calls),
            "engine": {
                "running": s.num_running,
                "waiting": s.num_waiting,
                "kv_cache_usage": s.kv_usage,
                "prompt_tokens_total": s.prompt_tokens_total,
                "generation_tokens_total": s.generation_tokens_total,
                "prefix_cache_queries_total": s.prefix_cache_queries_total,
                "prefix_cache_hits_total": s.prefix_cache_hits_total,
                "num_preemptions_total": s.num_preemptions_total,
                "request_success_total": s.request_success_total,
                "client_aborts_total": s.num_client_aborts_total,
            },
            "recent_requests": list(self.recent),
        }

    def reset_stats(self) -> None:
        """Zero the HTTP-side counters (engine counters, like vLLM's, never reset)."""
        self.requests_by_path.clear()
        self.responses_by_status.clear()
        self.client_aborts = 0
        self.dropped_connections = 0
        self.recent.clear()
        self.control_counts.clear()
        self.control_calls.clear()
        self.faults.injected = dict.fromkeys(self.faults.injected, 0)
