"""Per-backend circuit breaker (pure: no I/O; clock injected).

States (Nygard, *Release It!*, "Circuit Breaker"; the same three as Envoy/Hystrix):

* ``closed``: traffic flows; failures are counted;
* ``open``: no traffic for the open time; it grows on repeated trips
  (``open_base_s * 2**(trips-1)``, capped at ``open_max_s``), like Envoy's outlier
  ejection time;
* ``half_open``: after the open time, at most ``half_open_max`` probe requests at a time go
  through; ``half_open_successes`` successes close it, any failure re-opens it.

A probe is a request booked (:meth:`CircuitBreaker.acquire`) while half-open: it gets the
number of that half-open period, and only an outcome carrying it frees a probe slot or
counts toward closing. A request sent while closed that ends during half-open is counted in
the window like any other, but is no evidence of recovery and holds no slot (without the
number, its success closed the breaker while the probe was still out, and its hang-up freed
a slot that a probe held, letting a second probe through).

It opens on ``consecutive_failures`` failures in a row, or on an error rate of at least
``error_rate`` over the last ``window_s`` seconds with at least ``min_requests`` requests,
or (checked by :meth:`CircuitBreaker.evaluate`, from a control loop) on a latency fuse:
P99 TTFT over the window above ``latency_fuse_factor`` times the TTFT SLO (seed 000).

What counts: failures are 5xx, connect errors, timeouts and broken
streams; a 4xx caused by the request, a 429 and a client disconnect are never failures
(:meth:`on_neutral`). All methods are O(1) on the request path except :meth:`evaluate`.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from enum import StrEnum


def windowed_p99(
    samples: Iterable[tuple[float, float]], horizon: float, min_samples: int
) -> float | None:
    """P99 of the values of ``(time, value)`` samples taken at ``horizon`` or later; None
    with fewer than ``min_samples`` of them. O(n log n): for control loops, not requests."""
    recent = sorted(v for at, v in samples if at >= horizon)
    if len(recent) < min_samples:
        return None
    return recent[min(len(recent) - 1, int(0.99 * len(recent)))]


class BreakerState(StrEnum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


@dataclass(frozen=True, slots=True)
class BreakerConfig:
    """Thresholds; seconds for times, 0-1 for rates."""

    consecutive_failures: int = 5
    error_rate: float = 0.5
    min_requests: int = 20
    window_s: float = 30.0
    open_base_s: float = 5.0
    open_max_s: float = 120.0
    half_open_max: int = 1
    half_open_successes: int = 1
    ttft_slo_s: float | None = None
    latency_fuse_factor: float = 5.0
    latency_min_samples: int = 20


class CircuitBreaker:
    """One backend's breaker. ``clock`` returns monotonic seconds."""

    __slots__ = (
        "_buckets",
        "_clock",
        "_closed_at",
        "_half_open_inflight",
        "_half_open_ok",
        "_held",
        "_open_until",
        "_period",
        "_ttfts",
        "cfg",
        "consecutive",
        "last_trip_reason",
        "state",
        "trips",
    )

    def __init__(self, cfg: BreakerConfig, clock: Callable[[], float]) -> None:
        self.cfg = cfg
        self._clock = clock
        self.state = BreakerState.CLOSED
        self.consecutive = 0
        self.trips = 0
        self.last_trip_reason: str | None = None
        self._open_until = 0.0
        self._held = False  # open because another replica's trip holds it (fleet mode)
        self._closed_at = clock()
        self._half_open_inflight = 0
        self._half_open_ok = 0
        self._period = 0  # the number of the current (or last) half-open period
        # 1-second buckets over the window: [second, requests, failures]
        self._buckets: deque[list[float]] = deque()
        self._ttfts: deque[tuple[float, float]] = deque(maxlen=512)

    # ---- queries ----------------------------------------------------------------------------
    def current(self) -> BreakerState:
        """The state now (an expired ``open`` reads as ``half_open``)."""
        if self.state is BreakerState.OPEN and self._clock() >= self._open_until:
            self.state = BreakerState.HALF_OPEN
            self._period += 1
            self._half_open_inflight = 0
            self._half_open_ok = 0
        return self.state

    def can_take(self) -> bool:
        """Whether a request may be sent now (without taking a half-open slot)."""
        s = self.current()
        if s is BreakerState.CLOSED:
            return True
        if s is BreakerState.HALF_OPEN:
            return self._half_open_inflight < self.cfg.half_open_max
        return False

    @property
    def half_open_in_flight(self) -> int:
        """Requests holding a half-open probe slot now (0 unless half-open)."""
        return self._half_open_inflight

    @property
    def open_until(self) -> float:
        """When the open time of the last trip or hold ends (monotonic seconds)."""
        return self._open_until

    @property
    def held(self) -> bool:
        """Whether it is open (or half-open after) a hold another replica's trip put on it
        (:meth:`hold_open_until`), not a trip of its own."""
        return self._held

    def retry_in(self) -> float:
        """Seconds until this breaker lets a request through (0 if it does now)."""
        if self.current() is BreakerState.OPEN:
            return max(0.0, self._open_until - self._clock())
        return 0.0

    # ---- request path -------------------------------------------------------------------------
    def acquire(self) -> int | None:
        """Book a request chosen for this backend. While half-open it is a probe: it takes
        a probe slot, and the number returned is passed back with its outcome (``probe=``);
        None otherwise (an ordinary request)."""
        if self.current() is BreakerState.HALF_OPEN:
            self._half_open_inflight += 1
            return self._period
        return None

    def _probe_ended(self, probe: int | None) -> bool:
        """Whether ``probe`` is a probe of the half-open period now running (its slot is
        freed); False for ordinary requests and for probes of an earlier period."""
        if probe is None or probe != self._period or self.state is not BreakerState.HALF_OPEN:
            return False
        self._half_open_inflight = max(0, self._half_open_inflight - 1)
        return True

    def _record(self, failed: bool) -> None:
        now = self._clock()
        second = float(int(now))
        b = self._buckets
        if b and b[-1][0] == second:
            b[-1][1] += 1
            b[-1][2] += failed
        else:
            b.append([second, 1, float(failed)])
        horizon = now - self.cfg.window_s
        while b and b[0][0] < horizon:
            b.popleft()

    def on_success(self, ttft_s: float | None = None, probe: int | None = None) -> None:
        """A request succeeded (``ttft_s``: its time to first token, for the fuse;
        ``probe``: what :meth:`acquire` returned for it)."""
        self._record(False)
        self.consecutive = 0
        if ttft_s is not None:
            self._ttfts.append((self._clock(), ttft_s))
        if self._probe_ended(probe):
            self._half_open_ok += 1
            if self._half_open_ok >= self.cfg.half_open_successes:
                self.state = BreakerState.CLOSED
                self._held = False
                self._closed_at = self._clock()
                self._half_open_inflight = 0  # the other probes' outcomes count as ordinary
                self.consecutive = 0
                self._buckets.clear()
                self._ttfts.clear()

    def on_failure(self, probe: int | None = None) -> bool:
        """A request failed because of the backend (5xx, connect, timeout, broken stream;
        ``probe``: what :meth:`acquire` returned for it). Any failure while half-open
        re-opens the breaker. Returns True if this failure opened it (as :meth:`evaluate`
        does)."""
        self._record(True)
        self.consecutive += 1
        if self.state is BreakerState.HALF_OPEN:
            self._trip("half_open_probe_failed")
            return True
        if self.state is not BreakerState.CLOSED:
            return False
        if self.consecutive >= self.cfg.consecutive_failures:
            self._trip("consecutive_failures")
            return True
        requests = sum(x[1] for x in self._buckets)
        if requests >= self.cfg.min_requests:
            failures = sum(x[2] for x in self._buckets)
            if failures / requests >= self.cfg.error_rate:
                self._trip("error_rate")
                return True
        return False

    def on_neutral(self, probe: int | None = None) -> None:
        """An answer that says nothing about the backend's health (4xx, 429, client gone;
        ``probe``: what :meth:`acquire` returned for it): frees its probe slot, if it held
        one, without counting."""
        self._probe_ended(probe)

    # ---- control loop ---------------------------------------------------------------------------
    def evaluate(self) -> bool:
        """Latency fuse: trip when P99 TTFT over the window exceeds the factor times the SLO.
        Returns True if it tripped. Sorting the samples costs O(n log n): call it from a
        control loop (about once a second), never per request."""
        slo = self.cfg.ttft_slo_s
        if slo is None or self.state is not BreakerState.CLOSED:
            return False
        p99 = windowed_p99(
            self._ttfts, self._clock() - self.cfg.window_s, self.cfg.latency_min_samples
        )
        if p99 is not None and p99 > self.cfg.latency_fuse_factor * slo:
            self._trip("latency_fuse")
            return True
        return False

    def _trip(self, reason: str) -> None:
        now = self._clock()
        if self.state is BreakerState.CLOSED and now - self._closed_at > self.cfg.open_max_s:
            self.trips = 0  # healthy for a while: the next open time starts small again
        self.trips += 1
        self.last_trip_reason = reason
        open_s = min(self.cfg.open_max_s, self.cfg.open_base_s * 2 ** (self.trips - 1))
        self._open_until = now + open_s
        self._held = False
        self.state = BreakerState.OPEN
        self._half_open_inflight = 0
        self._half_open_ok = 0

    # ---- fleet mode: another replica's trip ---------------------------------------------------
    def hold_open_until(self, until: float) -> None:
        """Hold the breaker open until ``until`` (monotonic seconds): another replica tripped
        it and owns the half-open probing (``gateway.coord.protection``). No probe goes out
        from here before then; after it the usual half-open follows (the owner is gone).
        A breaker tripped by its own failures keeps its own open time when that ends later
        (it stays the owner of its trip). Calling it again moves the end (the owner's record
        was renewed)."""
        if self.state is not BreakerState.CLOSED and not self._held:
            if self._open_until >= until:
                return
        self.state = BreakerState.OPEN
        self._held = True
        self._open_until = until
        self._half_open_inflight = 0
        self._half_open_ok = 0

    def release_hold(self) -> bool:
        """The owner of the trip reports the backend recovered (its record is cleared):
        a held breaker closes (its counts forgotten, the trips of its own kept). Returns
        whether it was held; a breaker not held is left as it is."""
        if not self._held:
            return False
        self._held = False
        self.state = BreakerState.CLOSED
        self._closed_at = self._clock()
        self.consecutive = 0
        self._half_open_inflight = 0
        self._buckets.clear()
        return True

    def reset(self) -> None:
        """Close and forget (a backend that came back through probes and warm-up)."""
        self._held = False
        self.state = BreakerState.CLOSED
        self.consecutive = 0
        self.trips = 0
        self._buckets.clear()
        self._ttfts.clear()
