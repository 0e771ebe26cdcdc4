"""Whether a canary's answer to a calibration prompt matches the baseline version's
(pure): the calibration measure of a rollout (issue 18; thresholds in
:class:`gateway.traffic.rollout_stats.Thresholds`).

The baseline version's answers to the fixed calibration prompts are the reference. Three
measures, by what the prompts ask for: ``exact`` (greedy text must be identical: the same
weights and the same kernels give the same tokens), ``token_overlap`` (F1 of whitespace
tokens, for answers that may be re-worded a little), ``cosine`` (embedding vectors).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal

from gateway.traffic.rollout_stats import Thresholds

CalibrationMeasure = Literal["exact", "token_overlap", "cosine"]
"""How a canary's calibration answer is matched against the baseline's (the reference)."""


def whitespace_f1(reference: str, answer: str) -> float:
    """F1 of the whitespace tokens' multisets (precision and recall of ``answer`` against
    ``reference``): SQuAD's token F1 (Rajpurkar et al. 2016) without its normalisation,
    since casing and punctuation are part of what a calibration answer must keep. Two empty
    texts: 1.0; one empty: 0.0. Unlike Jaccard it counts repeated tokens."""
    ref, ans = reference.split(), answer.split()
    if not ref and not ans:
        return 1.0
    if not ref or not ans:
        return 0.0
    counts: dict[str, int] = {}
    for t in ref:
        counts[t] = counts.get(t, 0) + 1
    common = 0
    for t in ans:
        if counts.get(t, 0) > 0:
            counts[t] -= 1
            common += 1
    if common == 0:
        return 0.0
    precision, recall = common / len(ans), common / len(ref)
    return 2 * precision * recall / (precision + recall)


def cosine(a: Sequence[float], b: Sequence[float]) -> float:
    """Cosine similarity of two vectors of the same length (0.0 when either is zero)."""
    if len(a) != len(b):
        raise ValueError(f"vectors of different lengths: {len(a)} and {len(b)}")
    dot = math.fsum(x * y for x, y in zip(a, b, strict=True))
    na = math.sqrt(math.fsum(x * x for x in a))
    nb = math.sqrt(math.fsum(y * y for y in b))
    if na == 0.0 or nb == 0.0:
        return 0.0
    return dot / (na * nb)


def calibration_score(
    measure: CalibrationMeasure,
    reference: str | Sequence[float],
    answer: str | Sequence[float],
) -> float:
    """How close a canary's calibration answer is to the baseline's (0..1): ``exact``: 1.0
    when the texts are equal, else 0.0; ``token_overlap``: :func:`whitespace_f1`;
    ``cosine``: :func:`cosine` of two embedding vectors."""
    if measure == "cosine":
        if isinstance(reference, str) or isinstance(answer, str):
            raise TypeError("the cosine measure compares embedding vectors, not text")
        return cosine(reference, answer)
    if not isinstance(reference, str) or not isinstance(answer, str):
        raise TypeError(f"the {measure} measure compares texts")
    if measure == "exact":
        return 1.0 if reference == answer else 0.0
    return whitespace_f1(reference, answer)


def probe_matches(
    measure: CalibrationMeasure,
    reference: str | Sequence[float],
    answer: str | Sequence[float],
    th: Thresholds,
) -> bool:
    """Whether a canary probe matches the reference: its :func:`calibration_score` is 1
    (``exact``), at least ``th.overlap_threshold`` (``token_overlap``) or at least
    ``th.cosine_threshold`` (``cosine``)."""
    score = calibration_score(measure, reference, answer)
    if measure == "exact":
        return score == 1.0
    return score >= (th.overlap_threshold if measure == "token_overlap"
                     else th.cosine_threshold)
