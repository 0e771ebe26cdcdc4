"""Workload traces for the fleet simulator: generated (diurnal + bursts, seeded) or a CSV.

A trace is an iterator of :class:`Arrival` in time order (seconds from the trace start,
tokens). Generated traces are a non-homogeneous Poisson process whose rate follows a
24-hour sine (trough at 04:00, peak at 16:00, as the diurnal swing of production LLM
traffic in the Azure LLM inference traces, Patel et al. / Stojkovic et al.) times bursts:
burst starts arrive as a Poisson process (``bursts_per_hour``), each lasting a uniform
``burst_s`` range and multiplying the rate by a uniform ``burst_factor`` range. Prompt and
output lengths are log-normal (tokens), clipped to ``[1, max_*]``; the default means (2,000
prompt, 800 output tokens: long-form chat) keep a simulated day near 700,000 requests for 16
backends, since heat follows tokens per second, not requests. The same seed always
gives the same trace.

CSV: a header with ``arrival_s`` (or ``time``/``timestamp``), ``prompt_tokens`` and
``output_tokens`` columns (Azure's trace names ``ContextTokens`` / ``GeneratedTokens`` are
accepted too); rows sorted by arrival or not (they are sorted on read).
"""

from __future__ import annotations

import csv
import math
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

DAY_S = 86_400.0


@dataclass(frozen=True, slots=True)
class Arrival:
    """One request of a trace: arrival time (s from trace start) and sizes (tokens)."""

    t: float
    prompt_tokens: int
    output_tokens: int


@dataclass(frozen=True, slots=True)
class TraceSpec:
    """A generated trace. ``mean_rps`` is the day-average request rate (requests/s)
    before bursts; ``diurnal_amplitude`` the relative swing of the sine (0.35: peak 1.35x,
    trough 0.65x the mean); ``start_hour`` the time of day at t = 0."""

    duration_s: float = 600.0
    mean_rps: float = 4.0
    diurnal_amplitude: float = 0.35
    start_hour: float = 10.0
    bursts_per_hour: float = 1.0
    burst_s: tuple[float, float] = (120.0, 600.0)
    burst_factor: tuple[float, float] = (1.2, 1.5)
    prompt_mean: float = 2000.0
    prompt_sigma: float = 0.8
    output_mean: float = 800.0
    output_sigma: float = 0.7
    max_prompt: int = 8000
    max_output: int = 2000
    seed: int = 0

    def diurnal(self, t: float) -> float:
        """Rate multiplier of the 24-hour swing at ``t`` (s): peak at 16:00."""
        hour = (self.start_hour + t / 3600.0) % 24.0
        return 1.0 + self.diurnal_amplitude * math.sin(2 * math.pi * (hour - 10.0) / 24.0)

    def mean_burst_gain(self) -> float:
        """Expected rate multiplier from bursts over the long run (>= 1)."""
        share = self.bursts_per_hour * (sum(self.burst_s) / 2) / 3600.0
        return 1.0 + min(1.0, share) * (sum(self.burst_factor) / 2 - 1.0)


def _lognormal(rng: random.Random, mean: float, sigma: float, cap: int) -> int:
    mu = math.log(mean) - sigma * sigma / 2  # so that the mean is ``mean``
    return max(1, min(cap, round(rng.lognormvariate(mu, sigma))))


def bursts(spec: TraceSpec) -> list[tuple[float, float, float]]:
    """The trace's bursts: ``(start_s, end_s, factor)``, from its own seeded stream."""
    rng = random.Random(spec.seed * 7919 + 1)
    out: list[tuple[float, float, float]] = []
    if spec.bursts_per_hour <= 0:
        return out
    t = 0.0
    while True:
        t += rng.expovariate(spec.bursts_per_hour / 3600.0)
        if t >= spec.duration_s:
            return out
        out.append((t, t + rng.uniform(*spec.burst_s), rng.uniform(*spec.burst_factor)))


def generate(spec: TraceSpec) -> Iterator[Arrival]:
    """Arrivals of ``spec`` in time order (thinning of a Poisson process, Lewis-Shedler)."""
    rng = random.Random(spec.seed)
    bl = bursts(spec)
    peak_burst = max((f for _, _, f in bl), default=1.0)
    lam_max = spec.mean_rps * (1 + spec.diurnal_amplitude) * peak_burst * 1.5
    t = 0.0
    bi = 0
    while True:
        t += rng.expovariate(lam_max)
        if t >= spec.duration_s:
            return
        while bi < len(bl) and bl[bi][1] < t:
            bi += 1
        factor = 1.0
        for s, e, f in bl[bi : bi + 4]:
            if s <= t < e:
                factor = max(factor, f)
        lam = spec.mean_rps * spec.diurnal(t) * factor
        if rng.random() * lam_max < lam:
            yield Arrival(
                t,
                _lognormal(rng, spec.prompt_mean, spec.prompt_sigma, spec.max_prompt),
                _lognormal(rng, spec.output_mean, spec.output_sigma, spec.max_output),
            )


_TIME_COLS = ("arrival_s", "arrival", "time", "timestamp", "t")
_PROMPT_COLS = ("prompt_tokens", "contexttokens", "input_tokens", "prompt")
_OUTPUT_COLS = ("output_tokens", "generatedtokens", "completion_tokens", "output")


def _col(header: list[str], names: tuple[str, ...], path: Path) -> int:
    low = [h.strip().lower() for h in header]
    for n in names:
        if n in low:
            return low.index(n)
    raise ValueError(f"{path}: no column named any of {', '.join(names)} (have {header})")


def read_csv(path: str | Path) -> list[Arrival]:
    """Read a CSV trace (see the module docstring); times are shifted to start at 0.

    Raises ``ValueError`` naming the file and line for a missing column or a bad value.
    """
    p = Path(path)
    with p.open(newline="") as f:
        rows = csv.reader(f)
        header = next(rows, None)
        if header is None:
            raise ValueError(f"{p}: empty file")
        it, ip, io = (_col(header, c, p) for c in (_TIME_COLS, _PROMPT_COLS, _OUTPUT_COLS))
        out: list[Arrival] = []
        for lineno, row in enumerate(rows, start=2):
            if not row or all(not c.strip() for c in row):
                continue
            try:
                a = Arrival(float(row[it]), int(float(row[ip])), int(float(row[io])))
            except (ValueError, IndexError) as e:
                raise ValueError(f"{p}:{lineno}: bad row {row!r}: {e}") from None
            if a.prompt_tokens < 0 or a.output_tokens < 1 or not math.isfinite(a.t):
                raise ValueError(f"{p}:{lineno}: need prompt >= 0, output >= 1, finite time")
            out.append(a)
    out.sort(key=lambda a: a.t)
    if out:
        t0 = out[0].t
        out = [Arrival(a.t - t0, max(1, a.prompt_tokens), a.output_tokens) for a in out]
    return out
