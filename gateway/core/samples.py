"""What the control plane reads from a backend: one ``/metrics`` scrape (:class:`LoadSample`)
and one GPU telemetry scrape (:class:`GpuReading` per GPU, reduced to :class:`GpuSample`).

Plain frozen values, written once by the scrape that made them and read by the pure
decision code (routing, admission, lifecycle) and the simulator alike.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass


@dataclass(slots=True, frozen=True)
class LoadSample:
    """One scrape of a backend's vLLM ``/metrics``.

    ``waiting``/``running`` are request counts (``vllm:num_requests_waiting`` /
    ``vllm:num_requests_running``), ``kv_cache_usage`` is 0-1 (``vllm:kv_cache_usage_perc``,
    or the older ``vllm:gpu_cache_usage_perc``), ``scraped_at`` is a monotonic time in
    seconds, and ``in_flight_at_scrape`` is the gateway's own in-flight count for this backend
    at that moment (the router corrects the sample by the change since);
    ``pooled_extra_at_scrape`` is :attr:`Backend.pooled_extra` at that moment.
    """

    waiting: float
    running: float
    kv_cache_usage: float
    scraped_at: float
    in_flight_at_scrape: int
    process_start_s: float | None = None  # ``process_start_time_seconds`` (unix s), if any
    pooled_extra_at_scrape: int = 0
    # ``vllm:request_success_total`` summed over finish reasons (None: not exported)
    finished_total: float | None = None
    # vLLM v1's prefix-cache counters (tokens; summed over engines; None: not exported)
    prefix_cache_hits_total: float | None = None
    prefix_cache_queries_total: float | None = None
    # the older gauge ``vllm:gpu_prefix_cache_hit_rate`` (0-1; None: not exported)
    prefix_cache_hit_rate: float | None = None


@dataclass(frozen=True, slots=True)
class GpuReading:
    """One GPU's readings (None: not reported). °C, W, MHz; ``xid`` is the code of the last
    Xid error (0: none; DCGM's ``DCGM_FI_DEV_XID_ERRORS`` is this gauge, not a count);
    ``ecc_dbe`` is the volatile double-bit ECC counter. ``gpu``: the exporter's ``gpu``
    label; ``util_ratio``: the share of time a kernel ran (0-1); ``fb_used_bytes`` /
    ``fb_total_bytes``: framebuffer memory (bytes)."""

    temp_c: float | None = None
    power_w: float | None = None
    power_limit_w: float | None = None
    sm_clock_mhz: float | None = None
    xid: int = 0
    ecc_dbe: float | None = None
    gpu: str = "0"  # the exporter's ``gpu`` label
    util_ratio: float | None = None  # DCGM_FI_DEV_GPU_UTIL / 100 (0-1)
    fb_used_bytes: float | None = None  # DCGM_FI_DEV_FB_USED (MiB) in bytes
    fb_total_bytes: float | None = None  # used + free (+ reserved), bytes


def _sum(values: Iterable[float | None]) -> float | None:
    vals = [v for v in values if v is not None]
    return sum(vals) if vals else None


@dataclass(frozen=True, slots=True)
class GpuSample:
    """One backend's GPUs at monotonic time ``at`` (seconds), reduced over its GPUs.

    ``temp_c``: the hottest GPU (°C; a tensor-parallel group is as slow as its slowest
    GPU). ``power_w`` / ``power_limit_w``: summed (W). ``sm_clock_mhz``: the lowest (MHz).
    ``xid_last``: the last Xid code of each GPU in GPU order (0: none).
    ``ecc_dbe_total``: summed double-bit ECC counter. ``gpus``: how many GPUs reported;
    ``readings``: each GPU's own (utilization and framebuffer memory are exported per GPU).
    """

    at: float
    temp_c: float | None
    power_w: float | None = None
    power_limit_w: float | None = None
    sm_clock_mhz: float | None = None
    xid_last: tuple[int, ...] = ()
    ecc_dbe_total: float | None = None
    gpus: int = 1
    readings: tuple[GpuReading, ...] = ()  # per GPU, in GPU order

    @classmethod
    def from_gpus(cls, at: float, gpus: Sequence[GpuReading]) -> GpuSample:
        """Reduce per-GPU readings (in GPU order) to one sample."""
        temps = [g.temp_c for g in gpus if g.temp_c is not None]
        clocks = [g.sm_clock_mhz for g in gpus if g.sm_clock_mhz is not None]
        return cls(
            at=at,
            temp_c=max(temps) if temps else None,
            power_w=_sum(g.power_w for g in gpus),
            power_limit_w=_sum(g.power_limit_w for g in gpus),
            sm_clock_mhz=min(clocks) if clocks else None,
            xid_last=tuple(g.xid for g in gpus),
            ecc_dbe_total=_sum(g.ecc_dbe for g in gpus),
            gpus=len(gpus),
            readings=tuple(gpus),
        )

    @property
    def power_ratio(self) -> float | None:
        """Draw over limit (0-1+), or None when either is unknown."""
        if self.power_w is None or not self.power_limit_w:
            return None
        return self.power_w / self.power_limit_w


def prefix_cache_hit_ratio(prev: LoadSample | None, cur: LoadSample) -> float | None:
    """The prefix-cache hit ratio (0-1) between two scrapes of one backend: the increase
    of ``vllm:prefix_cache_hits_total`` over that of ``vllm:prefix_cache_queries_total``
    (vLLM v1, both in tokens; the ratio vLLM's own dashboard plots). Without those counters
    in ``cur``: the older gauge ``vllm:gpu_prefix_cache_hit_rate`` as scraped. None when
    nothing says: no counters and no gauge, no previous scrape with counters, no query in
    between, or a counter went down (a restart reset it)."""
    hits, queries = cur.prefix_cache_hits_total, cur.prefix_cache_queries_total
    if hits is None or queries is None:
        rate = cur.prefix_cache_hit_rate
        return None if rate is None else min(1.0, max(0.0, rate))
    if prev is None or prev.prefix_cache_hits_total is None:
        return None
    if prev.prefix_cache_queries_total is None:
        return None
    dq = queries - prev.prefix_cache_queries_total
    dh = hits - prev.prefix_cache_hits_total
    if dq <= 0 or dh < 0:
        return None
    return min(1.0, dh / dq)

