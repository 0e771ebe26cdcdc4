"""Admission control: who gets in now, who waits, who is told to come back (pure).

Three layers, each with its own rejection reason and metric
(``gateway_admission_rejections_total{layer,priority}``):

1. **entry** (per client key): token buckets for requests per minute and tokens per minute
   (the prompt estimated from the parsed request, :mod:`gateway.traffic.estimate`, plus
   ``max_tokens``; settled against the answer's reported usage), the way OpenAI's own
   ``x-ratelimit-*`` limits work;
2. **scheduler** (global): a bound on requests in flight, a bounded priority queue in front
   of it, and a bound on the time a request may wait there;
3. **resource** (fleet): the queue wait a new request would meet on the least-loaded
   backend, predicted from its scraped queue and its learned concurrency and service rate
   (:mod:`gateway.traffic.capacity`), against the TTFT SLO: ``low`` priority is shed
   first, then ``normal``; ``high`` last. A non-empty vLLM queue alone sheds nothing.

Where each lives: the entry layer in :mod:`gateway.traffic.limits`, the scheduler in
:mod:`gateway.traffic.scheduler`, the resource layer here, with the request's cost estimates
(:func:`estimate_tokens`, :func:`completion_budget`) and :class:`DegradedMode`. Every
rejection carries a ``retry-after`` from :mod:`gateway.traffic.retry_after`: the predicted
time until capacity frees (queued work over the recent service rate), bounded to [1, 60] s.

Nothing here does I/O or reads a clock of its own: time comes in as arguments (monotonic
seconds).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from gateway.core.vocab import Prio
from gateway.traffic.retry_after import clamp_retry_after


# ---- cost estimates ------------------------------------------------------------------------
def estimate_tokens(
    prompt_tokens: int, max_tokens: int | None, default_max_tokens: int, sequences: int = 1
) -> int:
    """Tokens a request may cost: its estimated ``prompt_tokens``
    (:func:`gateway.traffic.estimate.prompt_tokens`, read from the parsed body) plus the
    completion budget (``max_tokens``, or the default when it sets none; never negative) of
    each of its ``sequences`` (prompts x ``n``; 0 for embeddings, which generate nothing)."""
    budget = max_tokens if max_tokens is not None else default_max_tokens
    return prompt_tokens + sequences * max(0, budget)


MAX_COUNT = 1 << 31


def as_count(value: object) -> int | None:
    """``value`` read as vLLM's pydantic (lax mode) reads an integer field: an int, an
    integral float (``3000.0``) or a numeric string (``"3000"``); None otherwise (bools
    too). Clamped to [0, 2**31]: a negative budget is refused by vLLM, never a credit."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        n = value
    elif isinstance(value, float | str):
        try:
            f = float(value)
        except ValueError:
            return None
        if not math.isfinite(f) or not f.is_integer():
            return None
        n = int(f)
    else:
        return None
    return min(MAX_COUNT, max(0, n))


def completion_budget(payload: dict[str, object]) -> int | None:
    """The most completion tokens one sequence of a request body may make (tokens), or
    None when it sets no budget: the largest of ``max_tokens``, ``max_completion_tokens``
    (vLLM's chat endpoint prefers it, its completions endpoint reads ``max_tokens``) and
    ``max_output_tokens`` (the Responses API). Read as vLLM reads them (:func:`as_count`),
    so ``"3000"`` counts as 3000. Multiply by the sequences (prompts x ``n``)."""
    fields = ("max_tokens", "max_completion_tokens", "max_output_tokens")
    budgets = [c for c in (as_count(payload.get(f)) for f in fields) if c is not None]
    return max(budgets) if budgets else None


# ---- resource layer ----------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Saturation:
    """How overloaded the fleet serving one model is: the predicted queue wait of a new
    request in units of the TTFT SLO (0: it would start at once; 1: it would wait a whole
    SLO before its prefill starts), or for the power layer the draw over the budget."""

    level: float


def pool_wait(waits: Iterable[float]) -> float:
    """The least predicted queue wait (seconds) among a model's routable backends, 0 with
    none: the router sends a request to the least-loaded one, so that is the wait it meets.
    Each wait comes from :meth:`gateway.traffic.capacity.ServiceModel.predicted_wait`."""
    best: float | None = None
    for w in waits:
        best = w if best is None else min(best, w)
    return 0.0 if best is None else best


def wait_level(wait_s: float, slo_ttft_s: float) -> Saturation:
    """The resource layer's saturation: predicted queue wait ``wait_s`` over the TTFT SLO
    ``slo_ttft_s`` (both seconds). A backend's own queue is not an overload; a wait that
    makes the request miss its SLO by a margin is (``admission.shed_levels``)."""
    return Saturation(wait_s / slo_ttft_s if slo_ttft_s > 0 else math.inf)


def shed_retry_after(wait_s: float, level: float, slo_ttft_s: float) -> float:
    """Retry-After (seconds, bounded to [1, 60]) of a request shed at predicted wait
    ``wait_s`` by a class shed from ``level`` x ``slo_ttft_s``: the queue drains one second
    of wait per second, so a retry after the excess would be let in (arrivals meanwhile
    aside)."""
    return clamp_retry_after(wait_s - level * slo_ttft_s)


def shed(prio: Prio, saturation: Saturation, thresholds: tuple[float, float, float]) -> bool:
    """Whether a request of ``prio`` is shed at this saturation. ``thresholds`` are the
    levels at which high, normal and low requests are shed (low sheds first)."""
    return saturation.level >= thresholds[prio]


# ---- degraded mode -----------------------------------------------------------------------
class DegradedMode:
    """Under sustained overload, cap ``max_tokens`` and refuse long low-priority prompts;
    lift it one step at a time while P99 TTFT stays under the SLO.

    Level 0 is normal. Each :meth:`update` (about once a second) raises the level by one after
    ``enter_after_s`` of continuous overload (up to ``max_level``), and lowers it by one
    after every ``step_s`` with P99 TTFT under the SLO. The cap halves with each level.
    """

    def __init__(self, enter_after_s: float, step_s: float, max_level: int = 3) -> None:
        self.enter_after_s = enter_after_s
        self.step_s = step_s
        self.max_level = max_level
        self.level = 0
        self._over_since: float | None = None
        self._ok_since: float | None = None

    def update(self, overloaded: bool, now: float) -> int:
        if overloaded:
            self._ok_since = None
            if self._over_since is None:
                self._over_since = now
            elif now - self._over_since >= self.enter_after_s and self.level < self.max_level:
                self.level += 1
                self._over_since = now
        else:
            self._over_since = None
            if self.level > 0:
                if self._ok_since is None:
                    self._ok_since = now
                elif now - self._ok_since >= self.step_s:
                    self.level -= 1
                    self._ok_since = now
        return self.level

    def max_tokens_cap(self, base_cap: int) -> int | None:
        """The ``max_tokens`` cap now (None: no cap)."""
        if self.level == 0:
            return None
        return max(1, base_cap >> (self.level - 1))
