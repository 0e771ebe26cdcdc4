"""Calibration: does a backend still answer as it did? (scoring pure; one async runner).

After each cooldown the gateway sends fixed prompts at temperature 0 with a fixed seed and
compares the answers with the backend's baseline (its first answers once warm, or a
baseline file). Two figures: the exact-match rate, and the mean token-overlap similarity
(F1 of the whitespace-token multisets, the unigram overlap behind ROUGE-1; 1.0 for
identical answers). For embedding models the answers are vectors and the similarity is the
mean cosine. A score below the threshold (default 0.95) means drift: a corrupted weight
load, a wrong model version, faulty GPU memory.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import httpx


def token_overlap(a: str, b: str) -> float:
    """F1 of the whitespace-token multisets of ``a`` and ``b`` (0-1; 1 when equal)."""
    ta, tb = Counter(a.split()), Counter(b.split())
    if not ta and not tb:
        return 1.0
    common = sum((ta & tb).values())
    if common == 0:
        return 0.0
    precision = common / sum(tb.values())
    recall = common / sum(ta.values())
    return 2 * precision * recall / (precision + recall)


def cosine(u: Sequence[float], v: Sequence[float]) -> float:
    """Cosine similarity of two vectors (0 when either is all zeros)."""
    dot = sum(x * y for x, y in zip(u, v, strict=True))
    nu = math.sqrt(sum(x * x for x in u))
    nv = math.sqrt(sum(y * y for y in v))
    return dot / (nu * nv) if nu and nv else 0.0


@dataclass(frozen=True, slots=True)
class CalibrationResult:
    """``exact_match``: share of answers identical to the baseline; ``similarity``: mean
    token overlap (or cosine); ``compared``: prompts present in both."""

    exact_match: float
    similarity: float
    compared: int


def compare(baseline: Mapping[str, object], answers: Mapping[str, object]) -> CalibrationResult:
    """Score ``answers`` against ``baseline`` (prompt -> text, or prompt -> vector).

    A prompt missing from ``answers`` counts as a complete miss (similarity 0).
    """
    if not baseline:
        return CalibrationResult(1.0, 1.0, 0)
    exact = 0
    total = 0.0
    for prompt, want in baseline.items():
        got = answers.get(prompt)
        if got is None:
            continue
        if got == want:
            exact += 1
            total += 1.0
        elif isinstance(want, str) and isinstance(got, str):
            total += token_overlap(want, got)
        elif isinstance(want, list) and isinstance(got, list) and len(want) == len(got):
            total += cosine(want, got)
    n = len(baseline)
    return CalibrationResult(exact / n, total / n, sum(1 for p in baseline if p in answers))


def _field(r: httpx.Response, get: Callable[[Any], object]) -> object:
    """One field of a JSON answer; ``ValueError`` when the answer is not shaped as expected."""
    try:
        return get(r.json())
    except (ValueError, KeyError, IndexError, TypeError) as e:
        raise ValueError(f"unexpected calibration answer ({type(e).__name__}: {e})") from None


async def collect_answers(
    client: httpx.AsyncClient,
    base_url: str,
    model: str,
    prompts: Sequence[str],
    max_tokens: int,
    seed: int,
    api_key: str | None,
) -> dict[str, object]:
    """Ask every prompt once (completions, temperature 0, fixed seed); prompt -> answer.

    A model that does not generate (4xx on ``/v1/completions``) is asked for embeddings
    instead: prompt -> vector. Raises ``httpx.HTTPError`` on transport errors and
    ``ValueError`` when the backend answers neither.
    """
    headers = {"authorization": f"Bearer {api_key}"} if api_key else None
    out: dict[str, object] = {}
    for prompt in prompts:
        r = await client.post(
            f"{base_url}/v1/completions",
            json={
                "model": model,
                "prompt": prompt,
                "max_tokens": max_tokens,
                "temperature": 0,
                "seed": seed,
            },
            headers=headers,
        )
        if r.status_code == 200:
            out[prompt] = _field(r, lambda d: d["choices"][0]["text"])
            continue
        if 400 <= r.status_code < 500:
            e = await client.post(
                f"{base_url}/v1/embeddings",
                json={"model": model, "input": prompt},
                headers=headers,
            )
            if e.status_code == 200:
                out[prompt] = _field(e, lambda d: d["data"][0]["embedding"])
                continue
        raise ValueError(f"calibration prompt answered {r.status_code}: {r.text[:200]}")
    return out
