"""What the request flow records about its attempts and answers: metrics and the recent
TTFT windows (the latency fuse and degraded mode read the global one's P99, the
autoscaler's fine paradigm each model's).

Counting only: no release of anything (that is the lease's job) and no decision.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from gateway.fleet.backend import Backend
from gateway.flow.context import version_label
from gateway.metrics import GatewayMetrics
from gateway.proxy.inband import InBandError
from gateway.traffic.breaker import windowed_p99
from gateway.traffic.estimate import plausible_usage

log = logging.getLogger("gateway.flow.accounting")

MODEL_TTFT_SAMPLES = 2048
"""First tokens kept per model (the newest): bounds the memory of a busy model's window; at
2048 a P99 rests on its 20 largest."""


class Accounting:
    """Attempt, usage and served counters, and the TTFT window. ``clock``: monotonic
    seconds; ``weight(backend, now)``: the routing policy's slow-start weight (a backend
    at 1.0 is warm: a request it serves is a warm-pool hit)."""

    def __init__(
        self,
        metrics: GatewayMetrics,
        clock: Callable[[], float],
        weight: Callable[[Backend, float], float],
    ) -> None:
        self.metrics = metrics
        self.clock = clock
        self.weight = weight
        self._attempt_children: dict[tuple[str, str], Any] = {}
        # (monotonic time, TTFT seconds) of recent streams: the latency fuse, degraded mode
        self.ttft_window: deque[tuple[float, float]] = deque(maxlen=4096)
        # the same per model (the autoscaler's fine paradigm): each bounded, and a model is
        # dropped when no backend serves it any more (forget_model)
        self.model_ttft: dict[str, deque[tuple[float, float]]] = {}

    def forget(self, backend_id: str) -> None:
        """``backend_id`` left the fleet (its series were dropped): drop the cached label
        children, so a backend coming back under that id is counted afresh."""
        for key in [k for k in self._attempt_children if k[0] == backend_id]:
            del self._attempt_children[key]

    def attempt(self, backend: Backend, outcome: str) -> None:
        """Count one attempt on ``backend`` ending with ``outcome`` (``ok``, ``http_4xx``,
        a :class:`gateway.core.vocab.FailureKind` or a stream's end)."""
        key = (backend.id, str(outcome))
        child = self._attempt_children.get(key)
        if child is None:
            child = self._attempt_children[key] = self.metrics.upstream_attempts.labels(*key)
        child.inc()

    def in_band_error(
        self, endpoint: str, model: str, backend: Backend, err: InBandError, request_id: str
    ) -> None:
        """A stream from ``backend`` that carried a request error (``err``): the request
        is counted under ``err.status`` (not as a success; version: ``backend``'s,
        :func:`gateway.flow.context.version_label`), the attempt as
        ``in_band_error``, and it is logged with the request id and the backend's message
        (WARNING for a 5xx, else INFO)."""
        status = err.status
        self.metrics.count_request(endpoint, model, status, version_label(backend))
        self.attempt(backend, "in_band_error")
        log.log(
            logging.WARNING if status >= 500 else logging.INFO,
            "%s stream from %s carried an error (%s, code %r): %s [request %s]",
            endpoint,
            backend.id,
            err.type,
            err.code,
            err.message,
            request_id,
        )

    def served(self, backend: Backend) -> None:
        """Count one request served by ``backend`` (the 10,000-request cycle trigger, the
        warm-pool hit ratio: served by a backend that was warm and past its slow start)."""
        backend.count_served()
        m = self.metrics
        m.warm_pool_requests += 1
        if self.weight(backend, self.clock()) >= 1.0:
            m.warm_pool_hits += 1

    def usage(self, model: str, usage: tuple[int, int] | None, backend: Backend) -> None:
        """Count an answer's (prompt, completion) tokens, when it reported them, as
        ``backend``'s (the one that served it; a continued stream's last backend), priced
        when its config has a ``gpu_hour_price`` (the cost signals'
        denominator); a report with a count outside ``[0, MAX_REPORTED_TOKENS]``
        (:mod:`gateway.traffic.estimate`) is not counted at all (logged)."""
        if usage is None:
            return
        prompt, completion = usage
        if plausible_usage(usage) is None:
            log.warning("model %s: usage (%d, %d) not counted: out of range", model, *usage)
            return
        self.metrics.count_tokens(model, prompt, completion, self.clock(), backend.id,
                                  backend.config.gpu_hour_price is not None)

    def stream_started(self, ttft_s: float, model: str | None = None) -> None:
        """A stream of ``model`` (a model some backend serves) had its first token reach
        its client ``ttft_s`` seconds after arrival."""
        now = self.clock()
        self.ttft_window.append((now, ttft_s))
        if model:
            window = self.model_ttft.get(model)
            if window is None:
                window = self.model_ttft[model] = deque(maxlen=MODEL_TTFT_SAMPLES)
            window.append((now, ttft_s))

    def model_p99_ttft(
        self, model: str, window_s: float, min_samples: int = 20
    ) -> tuple[float | None, int]:
        """``(P99 TTFT seconds or None, samples)`` of ``model``'s streams whose first token
        reached the client within the last ``window_s`` seconds (None with fewer than
        ``min_samples``; at most :data:`MODEL_TTFT_SAMPLES` newest are kept)."""
        window = self.model_ttft.get(model)
        if not window:
            return None, 0
        horizon = self.clock() - window_s
        samples = sum(1 for at, _ in window if at >= horizon)
        return windowed_p99(window, horizon, min_samples), samples

    def forget_model(self, model: str) -> None:
        """No backend serves ``model`` any more: drop its TTFT window."""
        self.model_ttft.pop(model, None)

    def p99_ttft(self, window_s: float, min_samples: int = 20) -> float | None:
        """P99 TTFT (seconds) of the streams whose first token reached the client within
        the last ``window_s`` seconds; None with fewer than ``min_samples`` samples.
        Non-streaming answers have no first token of their own and are not counted."""
        return windowed_p99(self.ttft_window, self.clock() - window_s, min_samples)

    def request_latency(
        self, endpoint: str, model: str, ttft_s: float | None, started: float
    ) -> None:
        """Observe a request's time to first byte and duration (``started``:
        ``time.perf_counter()`` at arrival)."""
        self.metrics.observe_latency(endpoint, model, ttft_s, time.perf_counter() - started)
