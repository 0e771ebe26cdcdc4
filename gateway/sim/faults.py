"""Fault injection for the simulator: errors, rate limits, latency, hangs, dropped streams.

``FaultConfig`` is the knob set (changeable at run time through ``/sim/faults``);
``FaultInjector`` turns it into one deterministic ``FaultDecision`` per request from a
seeded ``random.Random``, so the same config, seed and request order give the same
faults. Faults apply to the generation routes (``/v1/chat/completions``,
``/v1/completions``, ``/v1/embeddings``); ``unhealthy`` applies to ``GET /health``; the GPU
faults (``cooling_failure``, ``xid_errors``, ``ecc_dbe_errors``) to the simulated GPUs behind
``GET /gpu/metrics`` (:mod:`gateway.sim.gpu`).
"""

from __future__ import annotations

import random
import threading
from dataclasses import dataclass
from typing import Any, Literal

from gateway.config import FaultConfig as FaultConfig  # declared with the config schema


@dataclass(frozen=True)
class FaultDecision:
    """The faults one request gets.

    ``kind`` is "ok", "error" (answer ``status``) or "rate_limit" (429);
    ``latency_s`` is slept before answering; ``hang`` never answers; ``drop_after``
    cuts the connection after that many SSE events, ``drop_after_tokens`` right after
    the event carrying that many generated tokens (either set: a non-stream request
    gets no response at all).
    """

    kind: Literal["ok", "error", "rate_limit"] = "ok"
    status: int = 200
    retry_after_s: float = 0.0
    latency_s: float = 0.0
    hang: bool = False
    drop_after: int | None = None
    drop_after_tokens: int | None = None

    @property
    def drops(self) -> bool:
        """Whether this request's connection is cut (a drop fault of either kind)."""
        return self.drop_after is not None or self.drop_after_tokens is not None


class FaultInjector:
    """Holds the current ``FaultConfig`` and rolls the dice for each request (thread-safe)."""

    def __init__(self, config: FaultConfig | None = None) -> None:
        self._lock = threading.Lock()
        self._config = config or FaultConfig()
        self._rng = random.Random(self._config.seed)
        self.injected: dict[str, int] = {"error": 0, "rate_limit": 0, "hang": 0, "drop": 0}

    @property
    def config(self) -> FaultConfig:
        """The config in force."""
        return self._config

    def replace(self, config: FaultConfig) -> FaultConfig:
        """Put ``config`` in force; the dice restart from its seed."""
        with self._lock:
            self._config = config
            self._rng = random.Random(config.seed)
        return config

    def patch(self, changes: dict[str, Any]) -> FaultConfig:
        """Change only the given fields (validated); the dice restart if ``seed`` changes."""
        merged = FaultConfig.model_validate({**self._config.model_dump(), **changes})
        with self._lock:
            reseed = merged.seed != self._config.seed
            self._config = merged
            if reseed:
                self._rng = random.Random(merged.seed)
        return merged

    def decide(self) -> FaultDecision:
        """Draw the faults of one generation request.

        Order: hang, then rate limit, then error; latency and drop apply on top of an
        "ok" or error answer. Two dice are drawn per request whatever the config, so a
        change of rates does not shift later draws.
        """
        with self._lock:
            c = self._config
            r_limit = self._rng.random()
            r_error = self._rng.random()
        if c.hang:
            self.injected["hang"] += 1
            return FaultDecision(hang=True, latency_s=c.added_latency_s)
        if r_limit < c.rate_limit_rate:
            self.injected["rate_limit"] += 1
            return FaultDecision(
                kind="rate_limit",
                status=429,
                retry_after_s=c.retry_after_s,
                latency_s=c.added_latency_s,
            )
        if r_error < c.error_rate:
            self.injected["error"] += 1
            return FaultDecision(kind="error", status=c.error_status, latency_s=c.added_latency_s)
        if c.drop_after_chunks is not None or c.drop_after_tokens is not None:
            self.injected["drop"] += 1
        return FaultDecision(
            latency_s=c.added_latency_s,
            drop_after=c.drop_after_chunks,
            drop_after_tokens=c.drop_after_tokens,
        )
