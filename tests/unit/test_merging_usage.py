"""Usage apportioned among merged members (pure): exact for token ids, never 0 for a short
text merged with a long one (the review found 0 prompt tokens for "a" beside 11 KB)."""

from __future__ import annotations

import json

from gateway.api.merging import EMBEDDINGS, Part, split_answer


def answer(n_inputs: int, prompt_tokens: int) -> bytes:
    data = [{"index": i, "object": "embedding", "embedding": [0.0]} for i in range(n_inputs)]
    return json.dumps({"object": "list", "data": data, "model": "m",
                       "usage": {"prompt_tokens": prompt_tokens,
                                 "total_tokens": prompt_tokens}}).encode()


def shares(parts: list[Part], total: int) -> list[int]:
    out = split_answer(EMBEDDINGS, answer(sum(len(p.inputs) for p in parts), total), parts)
    return [json.loads(b)["usage"]["prompt_tokens"] for b in out]


def test_token_inputs_are_exact() -> None:
    parts = [Part({}, [[1]]), Part({}, [[1, 2, 3], [4, 5]]), Part({}, [[9] * 7])]
    assert shares(parts, 13) == [1, 5, 7]


def test_a_short_text_beside_a_long_one_gets_a_token() -> None:
    parts = [Part({}, ["a"]), Part({}, ["x" * 11_000])]
    got = shares(parts, 2751)
    assert got[0] >= 1 and sum(got) == 2751
