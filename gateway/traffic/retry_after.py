"""Retry-After hints of admission refusals (pure): the bounds every hint is clamped to, and
the Little's-law estimate of when capacity frees.

Every refusal of :mod:`gateway.traffic.admission`, :mod:`gateway.traffic.limits` and
:mod:`gateway.traffic.scheduler` carries a ``retry-after`` in [1, 60] s (openai-python
honours 0 < value <= 60).
"""

from __future__ import annotations

import math

MIN_RETRY_AFTER_S = 1.0
MAX_RETRY_AFTER_S = 60.0


def clamp_retry_after(seconds: float) -> float:
    """Bound a predicted wait to [1, 60] s (openai-python honours 0 < value <= 60)."""
    if not math.isfinite(seconds):
        return MAX_RETRY_AFTER_S
    return min(MAX_RETRY_AFTER_S, max(MIN_RETRY_AFTER_S, seconds))


def retry_after_s(work_ahead: float, service_rate: float) -> float:
    """Predicted seconds until capacity frees for one more request: the work ahead of it
    over the recent service rate (Little's law), bounded to [1, 60] s."""
    if service_rate <= 0:
        return clamp_retry_after(MAX_RETRY_AFTER_S if work_ahead > 0 else MIN_RETRY_AFTER_S)
    return clamp_retry_after(work_ahead / service_rate)
