"""Cost signals (pure): what a backend's GPUs cost while it is in the fleet, and the
generated tokens of a model over a recent window, for ``gateway_backend_cost_total`` and
``gateway_cost_per_million_tokens`` (:class:`gateway.signals.CostCollector`).

The price is the operator's: ``backends[].gpu_hour_price`` currency units per GPU-hour,
times ``backends[].gpus``. A backend costs from the moment the gateway first knew it
(``Backend.first_seen``, monotonic seconds) until it leaves the fleet, whatever its state
(a cold, draining or cooling backend's GPUs are paid for too).
"""

from __future__ import annotations

from collections import deque

COST_WINDOW_S = 300.0
"""The window of ``gateway_cost_per_million_tokens`` (seconds): 5 minutes, as the metric
names contract of issue 19 says."""


def accrued_cost(price_per_gpu_hour: float, gpus: int, seconds: float) -> float:
    """Currency units one backend accrues in ``seconds`` (negative counts as 0):
    ``price_per_gpu_hour`` x ``gpus`` x hours."""
    return price_per_gpu_hour * gpus * max(0.0, seconds) / 3600.0


def cost_per_million(cost: float, tokens: float) -> float | None:
    """``cost`` (currency units) per 1e6 generated ``tokens``; None without tokens (the
    ratio is undefined: an idle model has no cost per token, not an infinite one)."""
    if tokens <= 0:
        return None
    return cost / tokens * 1e6


class TokenWindow:
    """Generated tokens per model over the last ``window_s`` seconds, in ``bucket_s``
    buckets (a sum over the buckets whose start is inside the window: the window's edge
    is exact to one bucket). ``add`` is O(1): the hot path calls it once per answer."""

    __slots__ = ("_buckets", "bucket_s", "window_s")

    def __init__(self, window_s: float = COST_WINDOW_S, bucket_s: float = 5.0) -> None:
        self.window_s = window_s
        self.bucket_s = bucket_s
        self._buckets: dict[str, deque[list[float]]] = {}

    def add(self, model: str, tokens: int, now: float) -> None:
        """Count ``tokens`` generated for ``model`` at ``now`` (monotonic seconds)."""
        start = now - now % self.bucket_s
        q = self._buckets.get(model)
        if q is None:
            q = self._buckets[model] = deque()
        if q and q[-1][0] == start:
            q[-1][1] += tokens
            return
        q.append([start, float(tokens)])
        horizon = now - self.window_s - self.bucket_s
        while q and q[0][0] < horizon:
            q.popleft()

    def total(self, model: str, now: float) -> float:
        """Tokens of ``model`` in the buckets that overlap the last ``window_s`` seconds
        before ``now``."""
        q = self._buckets.get(model)
        if not q:
            return 0.0
        horizon = now - self.window_s
        return sum(n for start, n in q if start + self.bucket_s > horizon)

    def models(self) -> list[str]:
        """Models that had tokens counted (some perhaps outside the window now)."""
        return list(self._buckets)

    def forget(self, model: str) -> None:
        """Drop ``model``'s buckets (no backend serves it any more)."""
        self._buckets.pop(model, None)
