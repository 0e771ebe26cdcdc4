"""The status page's words (pure): what a model's users feel, in the order they feel it.

1. ``outage``: the model has no backend that can serve it (none routable): requests fail.
2. ``degraded performance``: it answers, but P99 TTFT or P99 ITL over the "now" window is
   over the SLO (``slo.ttft_s``, ``slo.itl_s``), or admission's degraded mode caps
   answers. Said while P99 is over even when every request is answered: a page that says
   "operational" while users wait is the failure this module exists to prevent (issue 19:
   availability, then performance, then cost recover, in that order).
3. ``operational``: neither. A P99 that cannot be judged (too few samples in the window)
   is not over the SLO: with no streams there is no one feeling them slow.

The gateway-wide word is the worst model's (:func:`overall`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

OPERATIONAL = "operational"
DEGRADED = "degraded performance"
OUTAGE = "outage"
SEVERITY = (OPERATIONAL, DEGRADED, OUTAGE)
"""The words, best to worst."""


@dataclass(frozen=True, slots=True)
class ModelInputs:
    """What one model's verdict rests on: backends that can serve it now (routable), its
    P99 TTFT and P99 ITL over the "now" window (seconds; None: too few samples), and
    admission's degraded-mode level (0: off or normal)."""

    model: str
    routable_backends: int
    ttft_p99_s: float | None
    itl_p99_s: float | None
    degraded_level: int = 0


@dataclass(frozen=True, slots=True)
class Verdict:
    """One model's word and the reasons for it (empty when operational)."""

    model: str
    words: str
    reasons: tuple[str, ...]


def model_verdict(inputs: ModelInputs, ttft_slo_s: float, itl_slo_s: float) -> Verdict:
    """The word for one model (module docstring), with every reason that applies."""
    if inputs.routable_backends <= 0:
        return Verdict(inputs.model, OUTAGE, ("no backend can serve it",))
    reasons: list[str] = []
    if inputs.ttft_p99_s is not None and inputs.ttft_p99_s > ttft_slo_s:
        reasons.append(f"P99 TTFT {inputs.ttft_p99_s:.3g} s over the SLO {ttft_slo_s:g} s")
    if inputs.itl_p99_s is not None and inputs.itl_p99_s > itl_slo_s:
        reasons.append(f"P99 ITL {inputs.itl_p99_s:.3g} s over the SLO {itl_slo_s:g} s")
    if inputs.degraded_level > 0:
        reasons.append(f"degraded mode level {inputs.degraded_level}: answers capped")
    return Verdict(inputs.model, DEGRADED if reasons else OPERATIONAL, tuple(reasons))


def overall(words: Iterable[str]) -> str:
    """The worst of ``words`` (:data:`SEVERITY`); ``operational`` when there are none."""
    return max(words, key=SEVERITY.index, default=OPERATIONAL)
