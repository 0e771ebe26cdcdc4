"""Windowed power readings for the clock and power-limit rules (issue 21; pure).

One telemetry sample of a draw is noisy: a GPU's reading moves with its batch from one
scrape to the next, and a single low sample under a hysteresis mark would flip a lever off
only for the next sample to flip it on again. The rules of :mod:`gateway.routing.clocks`
and :mod:`gateway.routing.power_limits` therefore decide on the **mean of the samples of the
last ``window_s`` seconds** (``smooth_intervals x interval_s`` of
:class:`gateway.config.ClockControlConfig`: with one sample per interval, the last
``smooth_intervals`` rounds), and take the **window's maximum** where they need the highest
draw a load reached (what a backend drew before its power limit was set). The same
moving-average-over-a-few-periods filter is what DCGM's and ``nvidia-smi``'s averaged
power readings do over their sampling window.

Everything takes time (seconds) and watts as arguments; no I/O.
"""

from __future__ import annotations

from collections import deque

_EPS = 1e-9


class DrawWindow:
    """The draw samples (W) of each key (a domain or a backend) of the last ``window_s``
    seconds: :meth:`add` one per telemetry round, read :meth:`mean` and :meth:`peak`."""

    def __init__(self, window_s: float) -> None:
        if window_s <= 0:
            raise ValueError("window_s must be > 0")
        self.window_s = window_s
        self._samples: dict[str, deque[tuple[float, float]]] = {}

    def add(self, key: str, now: float, watts: float) -> None:
        """Record ``watts`` for ``key`` at ``now`` (seconds, never backwards) and drop the
        samples older than the window."""
        q = self._samples.setdefault(key, deque())
        q.append((now, watts))
        while q and q[0][0] <= now - self.window_s + _EPS:
            q.popleft()

    def mean(self, key: str) -> float | None:
        """Mean of ``key``'s samples in the window (W); None without any."""
        q = self._samples.get(key)
        return sum(w for _, w in q) / len(q) if q else None

    def peak(self, key: str, since: float = -float("inf")) -> float | None:
        """Highest of ``key``'s samples in the window (W), those taken at or after ``since``
        (seconds) only; None without any."""
        q = self._samples.get(key)
        ws = [w for t, w in q if t >= since - _EPS] if q else []
        return max(ws) if ws else None

    def forget(self, key: str) -> None:
        """Drop ``key``'s samples (a backend that left the fleet)."""
        self._samples.pop(key, None)
