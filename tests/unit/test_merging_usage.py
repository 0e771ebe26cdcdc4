"""Usage apportioned among merged members (pure): exact for token ids, never 0 for a short
text merged with a long one (the review found 0 prompt tokens for "a" beside 11 KB)."""

from __future__ import annotations

import json

from gateway.flow.merging import EMBEDDINGS, Part, split_answer


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


def test_per_input_special_tokens_stay_with_their_inputs() -> None:
    """The review's case: 200 one-character inputs (2 tokens each alone: BOS + 1) merged
    with one sentence (9 tokens alone). Billed by bytes only, the sentence got 204 tokens;
    it must get about its own 9, and the 200 inputs about their 400."""
    parts = [Part({}, ["s"] * 200), Part({}, ["The quick brown fox jumps over the dog."])]
    a, b = shares(parts, 409)
    assert a + b == 409
    assert 395 <= a <= 404 and 5 <= b <= 14, (a, b)


def test_token_inputs_with_a_fixed_cost_per_input() -> None:
    """Token-id inputs to a model that adds CLS and SEP: 2 more per input, still exact."""
    parts = [Part({}, [[1]]), Part({}, [[1, 2, 3], [4, 5]]), Part({}, [[9] * 7])]
    assert shares(parts, 13 + 2 * 4) == [3, 9, 9]


def test_cached_tokens_are_shared_like_the_prompt() -> None:
    """vLLM's ``prompt_tokens_details.cached_tokens`` (``--enable-prompt-tokens-details``)
    is split like the prompt tokens: no member is told more of its prompt was cached than
    its prompt, and the shares add up."""
    parts = [Part({}, [[1, 2]]), Part({}, [[3] * 8])]
    body = json.loads(answer(2, 10))
    body["usage"]["prompt_tokens_details"] = {"cached_tokens": 8}
    out = [json.loads(b)["usage"] for b in split_answer(EMBEDDINGS, json.dumps(body).encode(),
                                                        parts)]
    cached = [u["prompt_tokens_details"]["cached_tokens"] for u in out]
    assert sum(cached) == 8
    assert all(c <= u["prompt_tokens"] for c, u in zip(cached, out, strict=True))


def test_engine_requests_read_n_as_vllm_does() -> None:
    """Sequences a request makes: prompts x ``n`` (``"8"`` is 8 to vLLM's pydantic, so it
    takes 8 places in the batcher's flow control, not 1)."""
    from gateway.flow.merging import COMPLETIONS, engine_requests

    assert engine_requests("/v1/chat/completions", {"n": "8"}) == 8
    assert engine_requests("/v1/chat/completions", {"n": 8.0}) == 8
    assert engine_requests(COMPLETIONS, {"prompt": ["a", "b", "c"], "n": "2"}) == 6
    assert engine_requests(EMBEDDINGS, {"input": ["a", "b"], "n": 5}) == 2
    assert engine_requests("/v1/chat/completions", {"n": "many"}) == 1
    # best_of: vLLM makes that many candidates (admission charges each its max_tokens)
    assert engine_requests(COMPLETIONS, {"prompt": "a", "n": 2, "best_of": "5"}) == 5
