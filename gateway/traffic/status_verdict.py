"""The status page's words (pure): what a model's users feel, in the order they feel it.

The words are Atlassian Statuspage's component states (``operational``, ``degraded
performance``, ``partial outage``, ``major outage``: the vocabulary status-page readers
know), worst first:

1. ``major outage``: no backend can serve the model (none routable: every one cold,
   unhealthy, draining, in a cooldown, or warm with its circuit breaker open), or fewer
   than :data:`MAJOR_BELOW` (90 %) of the window's requests were answered without an
   error of the service.
2. ``partial outage``: fewer than :data:`PARTIAL_BELOW` (99 %) were.
3. ``degraded performance``: it answers, but P99 TTFT or P99 ITL over the window is over
   the SLO (``slo.ttft_s``, ``slo.itl_s``), or admission's degraded mode caps answers. Said
   while P99 is over even when every request is answered: a page that says "operational"
   while users wait is the failure this module exists to prevent (issue 19: availability,
   then performance, then cost recover, in that order).
4. ``operational``: none of these.

Availability is the request-based measure of Google's *Site Reliability Engineering*
(2016), ch. 3 "Embracing Risk": successful requests / all requests (here: answered
without an error of the service, the client's own rate limit and hang-ups left out). The
thresholds are the first two tiers of that book's availability table (Appendix A): 99 %
("two nines", the lowest objective commonly set for a user-facing API) and 90 % ("one
nine"). Under 99 % the window burns the error budget of any such objective: some users
fail (partial); under 90 % at least one request in ten fails, which users meet as the
service being down (major).

**Minimum sample.** A window is judged on ``min_samples`` (``status.min_samples``, 20) or
more: requests for availability, streams for P99 TTFT, inter-token gaps for P99 ITL.
Fewer is not judged (one failed request of three is no outage rate, and the P99 of three
streams is their maximum), and is said as such with the count and the minimum
(:attr:`Judgement.notes`): the figures stay on the page, marked. The alert rules use the
same minimum and window (:mod:`gateway.ops.alerts`). No backend to serve the model is an
outage whatever the sample: requests for it cannot succeed.

:func:`model_verdict` judges the "now" window (the model's word) and the last hour (its
own word, shown beside: a past outage the "now" window no longer holds);
:func:`overall` is the gateway's word: the worst model's.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

OPERATIONAL = "operational"
DEGRADED = "degraded performance"
PARTIAL = "partial outage"
MAJOR = "major outage"
SEVERITY = (OPERATIONAL, DEGRADED, PARTIAL, MAJOR)
"""The words, best to worst."""

PARTIAL_BELOW = 0.99
"""Answered share (0-1) under which a judged window is a partial outage (module
docstring: the 99 % tier)."""
MAJOR_BELOW = 0.90
"""Answered share (0-1) under which a judged window is a major outage (the 90 % tier)."""

_STATE_WORDS = {"breaker_open": "circuit breaker open"}


@dataclass(frozen=True, slots=True)
class Window:
    """What a model's users got over one window of ``span_s`` seconds: ``requests`` ended,
    ``failed`` of them with an error of the service, P99 TTFT over ``streams`` streams and
    P99 ITL over ``itl_samples`` inter-token gaps (seconds; None: no sample)."""

    span_s: float
    requests: int = 0
    failed: int = 0
    ttft_p99_s: float | None = None
    streams: int = 0
    itl_p99_s: float | None = None
    itl_samples: int = 0

    @property
    def answered_share(self) -> float | None:
        """Share answered without an error of the service, 0-1 (None without requests)."""
        if self.requests <= 0:
            return None
        return max(0.0, 1.0 - self.failed / self.requests)


@dataclass(frozen=True, slots=True)
class ModelInputs:
    """What one model's verdict rests on: its backends by serving state
    (``backend_states``: ``(state, count)`` pairs, ``warm`` the routable ones, see
    :func:`gateway.core.vocab.serving_state`), the "now" window, the last hour (None: not
    judged) and admission's degraded-mode level (0: off or normal)."""

    model: str
    backend_states: tuple[tuple[str, int], ...]
    now: Window
    hour: Window | None = None
    degraded_level: int = 0

    @property
    def routable_backends(self) -> int:
        """Backends that can serve it now (``warm``)."""
        return sum(n for s, n in self.backend_states if s == "warm")


@dataclass(frozen=True, slots=True)
class Judgement:
    """One window's word, the reasons for it (empty when operational) and what could not
    be judged (too small a sample: the count and the minimum)."""

    words: str
    reasons: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class Verdict:
    """One model's word now (``words``, ``reasons``, ``notes``) and its last hour's."""

    model: str
    words: str
    reasons: tuple[str, ...]
    notes: tuple[str, ...]
    hour: Judgement | None = None


def window_words(span_s: float) -> str:
    """``the last 5 min``, ``the last hour``, ``the last 30 s``."""
    if span_s == 3600:
        return "the last hour"
    return f"the last {span_s / 60:g} min" if span_s >= 60 else f"the last {span_s:g} s"


def too_few(count: int, what: str, minimum: int) -> str:
    """How a figure with too small a sample is said on the page: ``3 streams: too few to
    judge (20 needed)``."""
    return f"{count} {what}: too few to judge ({minimum} needed)"


def availability(share: float | None) -> str:
    """The word for an answered share judged on enough requests (None: operational)."""
    if share is None or share >= PARTIAL_BELOW:
        return OPERATIONAL
    return MAJOR if share < MAJOR_BELOW else PARTIAL


def judge(w: Window, ttft_slo_s: float, itl_slo_s: float, min_samples: int) -> Judgement:
    """One window's word (module docstring): availability by the answered share, then P99
    TTFT / ITL against the SLO, each only on ``min_samples`` or more."""
    when = window_words(w.span_s)
    words = [OPERATIONAL]
    reasons: list[str] = []
    notes: list[str] = []
    share = w.answered_share
    if w.requests >= min_samples:
        word = availability(share)
        if word != OPERATIONAL and share is not None:
            bound = MAJOR_BELOW if word == MAJOR else PARTIAL_BELOW
            words.append(word)
            reasons.append(f"{share * 100:.1f} % of {w.requests} requests answered in {when} "
                           f"(under {bound * 100:g} %)")
    elif w.requests > 0:
        notes.append(f"availability in {when}: "
                     + too_few(w.requests, "requests", min_samples))
    for name, p99, count, slo, unit in (("TTFT", w.ttft_p99_s, w.streams, ttft_slo_s,
                                         "streams"),
                                        ("ITL", w.itl_p99_s, w.itl_samples, itl_slo_s,
                                         "inter-token gaps")):
        if p99 is None or count <= 0:
            continue
        if count < min_samples:
            notes.append(f"P99 {name} in {when}: " + too_few(count, unit, min_samples))
        elif p99 > slo:
            words.append(DEGRADED)
            reasons.append(f"P99 {name} {p99:.3g} s over the SLO {slo:g} s in {when}")
    return Judgement(worst(words), tuple(reasons), tuple(notes))


def model_verdict(inputs: ModelInputs, ttft_slo_s: float, itl_slo_s: float,
                  min_samples: int = 20) -> Verdict:
    """The words for one model now and over its last hour (module docstring), with every
    reason that applies and every figure too thinly sampled to judge."""
    now = judge(inputs.now, ttft_slo_s, itl_slo_s, min_samples)
    words = [now.words]
    reasons = list(now.reasons)
    if inputs.routable_backends <= 0:
        words.append(MAJOR)
        states = ", ".join(f"{n} {_STATE_WORDS.get(s, s)}"
                           for s, n in inputs.backend_states if n > 0)
        reasons.insert(0, f"no backend can serve it ({states or 'none lists it'})")
    if inputs.degraded_level > 0:
        words.append(DEGRADED)
        reasons.append(f"degraded mode level {inputs.degraded_level}: answers capped")
    hour = (None if inputs.hour is None
            else judge(inputs.hour, ttft_slo_s, itl_slo_s, min_samples))
    return Verdict(inputs.model, worst(words), tuple(reasons), now.notes, hour)


def worst(words: Iterable[str]) -> str:
    """The worst of ``words`` (:data:`SEVERITY`); ``operational`` when there are none."""
    return max(words, key=SEVERITY.index, default=OPERATIONAL)


def overall(words: Iterable[str]) -> str:
    """The gateway's word: the worst model's (:func:`worst`)."""
    return worst(words)
