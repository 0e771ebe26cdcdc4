"""Calibration: does a backend still answer as it did? (scoring pure; one async runner).

After each cooldown the gateway sends fixed prompts at temperature 0 with a fixed seed and
compares the answers with the backend's baseline (its first answers once warm, or a
baseline file), on the engine endpoint the backend serves for the model (completions, else
chat with the prompt as a user message, else embeddings; the baseline's endpoint when it
has one). Two figures: the exact-match rate, and the mean token-overlap similarity
(F1 of the whitespace-token multisets, the unigram overlap behind ROUGE-1; 1.0 for
identical answers). For embedding models the answers are vectors and the similarity is the
mean cosine. A score below the threshold (default 0.95) means drift: a corrupted weight
load, a wrong model version, faulty GPU memory.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import httpx

from gateway.fleet.backend import Backend
from gateway.fleet.probes import ProbeEndpoints, engine_answer, engine_request


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


@dataclass(frozen=True, slots=True)
class Answers:
    """A backend's calibration answers (prompt -> text, or prompt -> vector) and the
    engine ``endpoint`` that gave them (a baseline is compared only with answers of the
    same endpoint). ``unserved``: the backend answered, but none of the endpoints tried
    serves the model (every one a "not this endpoint" 4xx, ``detail`` says which): no
    answers, and no verdict to draw from them."""

    endpoint: str | None
    answers: dict[str, object]
    unserved: bool = False
    detail: str = ""


async def collect_answers(
    client: httpx.AsyncClient,
    backend: Backend,
    model: str,
    prompts: Sequence[str],
    max_tokens: int,
    seed: int,
    api_key: str | None,
    endpoints: ProbeEndpoints | None = None,
    only: str | None = None,
) -> Answers:
    """Ask every prompt once (temperature 0, fixed ``seed``, ``max_tokens``) on the engine
    endpoint the backend serves for ``model``: completions (the prompt; answer
    ``choices[0].text``), else chat (the prompt as one user message; answer
    ``choices[0].message.content``), else embeddings (answer: the vector), the one
    remembered in ``endpoints`` first (:func:`gateway.fleet.probes.engine_request`); with
    ``only``, that endpoint alone (the baseline's). The first prompt picks the endpoint,
    the others use it.

    Returns :class:`Answers` (``unserved`` when no endpoint tried serves the model).
    Raises ``httpx.HTTPError`` on transport errors and timeouts, ``ValueError`` on any
    other failed answer (5xx, 401/403/429, a body not shaped as the endpoint's).
    """
    if endpoints is None:
        endpoints = ProbeEndpoints()
    out: dict[str, object] = {}
    used: str | None = only
    for prompt in prompts:
        reply = await engine_request(
            client,
            backend,
            model,
            api_key,
            prompt,
            max_tokens,
            endpoints,
            seed=seed,
            order=None if used is None else (used,),
        )
        if reply.unserved:
            return Answers(None, {}, True, reply.detail)
        r = reply.response
        assert r is not None and reply.endpoint is not None
        if r.status_code != 200:
            raise ValueError(
                f"calibration prompt answered {r.status_code} on {reply.endpoint}: "
                f"{r.text[:200]}"
            )
        used = reply.endpoint
        try:
            data = r.json()
        except ValueError as e:
            raise ValueError(f"unexpected calibration answer (not JSON: {e})") from None
        out[prompt] = engine_answer(used, data)
    return Answers(used, out)
