"""An hour of each model's service, kept per minute for the status page (pure: time is
passed in).

Per model and per bucket of ``bucket_s`` seconds (a minute by default), for the last
``span_s`` seconds (an hour): requests answered, those that failed (an error of the
service: :data:`gateway.core.vocab.CLIENT_CAUSED` left out), and the TTFT
and ITL samples as log-bucketed histograms (:class:`LogHistogram`). A window's P99 is the
quantile of the merged histograms of its buckets: percentiles cannot be averaged across
minutes, histograms can be added (the reason Prometheus' ``histogram_quantile`` works on
summed bucket rates). Memory is bounded by ``span_s / bucket_s`` buckets per model times
the histogram's distinct buckets (about 300 between 1 ms and 10 min).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

GROWTH = 1.05
"""Ratio of one histogram bucket's upper bound to the previous one's: a quantile read from
the histogram is at most 5 % above the true sample (the same relative-error idea as
DDSketch, Masson et al., VLDB 2019, with a fixed ratio)."""
MIN_VALUE_S = 1e-4
"""Samples below this (seconds) are counted in the lowest bucket."""


@dataclass(slots=True)
class LogHistogram:
    """Counts of samples (seconds) in buckets ``(GROWTH**(i-1), GROWTH**i]`` keyed by ``i``;
    sparse, mergeable by addition."""

    counts: dict[int, int] = field(default_factory=dict)

    @property
    def total(self) -> int:
        """How many samples."""
        return sum(self.counts.values())

    def add(self, value_s: float, count: int = 1) -> None:
        """Count ``count`` samples of ``value_s`` seconds (non-finite values are ignored)."""
        if count <= 0 or not math.isfinite(value_s):
            return
        i = math.ceil(math.log(max(value_s, MIN_VALUE_S)) / math.log(GROWTH))
        self.counts[i] = self.counts.get(i, 0) + count

    def merge(self, other: LogHistogram) -> None:
        """Add ``other``'s counts to this one."""
        for i, n in other.counts.items():
            self.counts[i] = self.counts.get(i, 0) + n

    def quantile(self, q: float) -> float | None:
        """The ``q``-quantile (0-1) in seconds: the upper bound of the bucket holding the
        sample of rank ``ceil(q * total)`` (never below the true sample, at most 5 % above);
        None when empty."""
        total = self.total
        if total == 0:
            return None
        rank = max(1, math.ceil(q * total))
        seen = 0
        for i in sorted(self.counts):
            seen += self.counts[i]
            if seen >= rank:
                return float(GROWTH**i)
        return None  # pragma: no cover (seen reaches total)


@dataclass(slots=True)
class Bucket:
    """One model's service in ``[start, start + bucket_s)`` (the injected clock's seconds)."""

    start: float
    requests: int = 0
    failed: int = 0
    ttft: LogHistogram = field(default_factory=LogHistogram)
    itl: LogHistogram = field(default_factory=LogHistogram)


@dataclass(frozen=True, slots=True)
class WindowSummary:
    """A model's service over a window: requests, those that failed (an error of the
    service), P99 TTFT and ITL (seconds; None without ``min_samples`` samples) and the
    sample counts (streams' first tokens, inter-token gaps)."""

    requests: int
    failed: int
    ttft_p99_s: float | None
    itl_p99_s: float | None
    ttft_samples: int
    itl_samples: int

    @property
    def answered_share(self) -> float | None:
        """Share of requests answered without an error of the service, 0-1 (None without
        requests)."""
        if self.requests == 0:
            return None
        return max(0.0, 1.0 - self.failed / self.requests)


class MinuteRollup:
    """Each model's last ``span_s`` seconds in buckets of ``bucket_s`` seconds (module
    docstring). Every call passes ``now`` (the same clock throughout, e.g. monotonic
    seconds); buckets older than ``span_s`` are dropped as time passes."""

    def __init__(self, span_s: float = 3600.0, bucket_s: float = 60.0) -> None:
        if bucket_s <= 0 or span_s < bucket_s:
            raise ValueError("bucket_s must be > 0 and span_s >= bucket_s")
        self.span_s = span_s
        self.bucket_s = bucket_s
        self._models: dict[str, deque[Bucket]] = {}

    def models(self) -> list[str]:
        """The models with a bucket kept, sorted."""
        return sorted(self._models)

    def forget(self, model: str) -> None:
        """Drop everything kept of ``model``."""
        self._models.pop(model, None)

    def _bucket(self, model: str, now: float) -> Bucket:
        start = math.floor(now / self.bucket_s) * self.bucket_s
        buckets = self._models.setdefault(model, deque())
        if not buckets or buckets[-1].start < start:
            buckets.append(Bucket(start))
        self._expire(buckets, now)
        return buckets[-1]

    def _expire(self, buckets: deque[Bucket], now: float) -> None:
        while buckets and buckets[0].start + self.bucket_s <= now - self.span_s:
            buckets.popleft()

    def add_requests(self, model: str, now: float, requests: int, failed: int) -> None:
        """``requests`` ended at ``now``, ``failed`` of them (counted among ``requests``)
        with an error of the service."""
        if requests <= 0 and failed <= 0:
            return
        b = self._bucket(model, now)
        b.requests += requests
        b.failed += failed

    def add_ttft(self, model: str, now: float, values_s: Iterable[float]) -> None:
        """First tokens (TTFT seconds) of ``model``'s streams at ``now``."""
        b = self._bucket(model, now)
        for v in values_s:
            b.ttft.add(v)

    def add_itl(self, model: str, now: float, value_s: float, count: int = 1) -> None:
        """``count`` inter-token gaps of ``value_s`` seconds of ``model``'s streams at
        ``now``."""
        self._bucket(model, now).itl.add(value_s, count)

    def summary(self, model: str, now: float, window_s: float,
                min_samples: int = 20) -> WindowSummary:
        """``model``'s service in the buckets that overlap ``[now - window_s, now]`` (a
        window of whole buckets: up to one bucket longer than asked)."""
        ttft, itl = LogHistogram(), LogHistogram()
        requests = errors = 0
        buckets = self._models.get(model)
        if buckets:
            self._expire(buckets, now)
        for b in buckets or ():
            if b.start + self.bucket_s > now - window_s and b.start <= now:
                requests += b.requests
                errors += b.failed
                ttft.merge(b.ttft)
                itl.merge(b.itl)

        def p99(h: LogHistogram) -> float | None:
            return h.quantile(0.99) if h.total >= min_samples else None

        return WindowSummary(requests, errors, p99(ttft), p99(itl), ttft.total, itl.total)
