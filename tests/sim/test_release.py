"""The simulator playing a bad release (issue 18, Deliver 5): a slower build (``ttft_factor``,
``itl_factor``) and drifted text (``drift``), through real HTTP with the openai SDK.

Timings are compared between servers on the same request over a few tries (the best TTFT:
load only ever adds to it; the median ITL: load can also bunch tokens together), in ratio
bands wide enough for a loaded machine.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterator

import openai
import pytest

from gateway.sim import EngineParams, ReleaseConfig, SimConfig, SimServerThread
from gateway.sim import text as tx

MODEL = "sim-model"
STORY = [{"role": "user", "content": "Tell me a long story about a lighthouse."}]
# A prefill step (0.10 s + a decode step) that dwarfs the HTTP overhead, and a decode step
# (0.03 s) several times the event loop's jitter: TTFT ~0.13 s, ITL 0.03 s by default.
ENGINE = EngineParams(prefill_base_s=0.10, itl_base_s=0.03, itl_per_seq_s=0.0)
TOKENS = 6  # generated tokens per timed stream: 5 inter-token gaps
TRIES = 5  # odd: the median ITL is one stream's


def _server(release: ReleaseConfig) -> SimServerThread:
    return SimServerThread(SimConfig(model=MODEL, engine=ENGINE, release=release))


@pytest.fixture(scope="module")
def builds() -> Iterator[dict[str, str]]:
    """Three servers, the default build and two slower ones: name -> base URL."""
    servers = {
        "default": _server(ReleaseConfig()),
        "ttft_x2": _server(ReleaseConfig(ttft_factor=2.0)),
        "itl_x2": _server(ReleaseConfig(itl_factor=2.0)),
    }
    try:
        yield {name: s.start() for name, s in servers.items()}
    finally:
        for s in servers.values():
            s.stop()


def _timings(url: str) -> tuple[float, float]:
    """(TTFT, mean ITL) in seconds of a greedy chat stream, as the client sees them, over
    ``TRIES`` streams (the first one also pays for the connection): the best TTFT (load
    only adds to it) and the median ITL. Not the best ITL: a client thread stalled by a
    loaded machine reads the chunks that piled up meanwhile in one burst, and such a stream
    was measured at 0.4 ms a token against the engine's 30 ms."""
    best_ttft = float("inf")
    itls: list[float] = []
    with openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=30) as c:
        for _ in range(TRIES):
            sent = time.perf_counter()
            stream = c.chat.completions.create(
                model=MODEL, messages=STORY, max_tokens=TOKENS, temperature=0, stream=True,
                extra_body={"ignore_eos": True},
            )  # fmt: skip
            arrivals = [
                time.perf_counter()
                for chunk in stream
                if chunk.choices and chunk.choices[0].delta.content
            ]
            assert len(arrivals) == TOKENS
            best_ttft = min(best_ttft, arrivals[0] - sent)
            itls.append((arrivals[-1] - arrivals[0]) / (TOKENS - 1))
    return best_ttft, statistics.median(itls)


@pytest.fixture(scope="module")
def default_timings(builds: dict[str, str]) -> tuple[float, float]:
    """(TTFT, ITL) of the default build, in seconds."""
    return _timings(builds["default"])


def test_ttft_factor_slows_the_first_token_only(
    builds: dict[str, str], default_timings: tuple[float, float]
) -> None:
    ttft, itl = default_timings
    slow_ttft, slow_itl = _timings(builds["ttft_x2"])
    assert 1.5 < slow_ttft / ttft < 3.0, (ttft, slow_ttft)
    assert slow_itl / itl < 1.4, (itl, slow_itl)  # decode steps as fast as the default's


def test_itl_factor_slows_the_tokens_after_the_first(
    builds: dict[str, str], default_timings: tuple[float, float]
) -> None:
    ttft, itl = default_timings
    slow_ttft, slow_itl = _timings(builds["itl_x2"])
    assert 1.5 < slow_itl / itl < 3.0, (itl, slow_itl)
    assert slow_ttft / ttft < 1.4, (ttft, slow_ttft)  # the prefill as fast as the default's


# ---- drifted text -------------------------------------------------------------------------

PROMPT = "Describe the gateway in detail."
LENGTH = 80  # tokens per answer (ignore_eos): one word each
FAST = EngineParams(speed=20.0)  # text matters here, not time: ~0.5 ms per token


@pytest.fixture(scope="module")
def drift_clients() -> Iterator[dict[str, openai.OpenAI]]:
    """The default build and a build with ``drift: 0.2``, with other text seeds (which a
    greedy request ignores): name -> an openai client on it."""
    servers = {
        "default": SimServerThread(SimConfig(model=MODEL, seed=1, engine=FAST)),
        "drifted": SimServerThread(
            SimConfig(model=MODEL, seed=2, engine=FAST, release=ReleaseConfig(drift=0.2))
        ),
    }
    clients = {
        name: openai.OpenAI(base_url=s.start() + "/v1", api_key="none", max_retries=0, timeout=30)
        for name, s in servers.items()
    }
    try:
        yield clients
    finally:
        for c in clients.values():
            c.close()
        for s in servers.values():
            s.stop()


def _greedy(client: openai.OpenAI, stream: bool = False) -> str:
    """A greedy completion's text (``LENGTH`` tokens), streamed or not."""
    extra = {"ignore_eos": True}
    if stream:
        chunks = client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=LENGTH, temperature=0, stream=True,
            extra_body=extra,
        )  # fmt: skip
        return "".join(c.choices[0].text for c in chunks)
    done = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=LENGTH, temperature=0, extra_body=extra
    )
    return done.choices[0].text


def test_drift_changes_a_greedy_answer_the_same_way_every_time(
    drift_clients: dict[str, openai.OpenAI],
) -> None:
    base = _greedy(drift_clients["default"])
    drifted = _greedy(drift_clients["drifted"])
    words, other = base.split(), drifted.split()
    assert len(words) == len(other) == LENGTH
    overlap = sum(a == b for a, b in zip(words, other, strict=True)) / LENGTH
    assert 0.6 < overlap < 0.95, overlap  # about 1 - drift
    # deterministic: the same drifted answer again, streamed or not
    assert _greedy(drift_clients["drifted"]) == drifted
    assert _greedy(drift_clients["drifted"], stream=True) == drifted


def test_drifted_build_continues_its_own_text(drift_clients: dict[str, openai.OpenAI]) -> None:
    """A token-id prompt made of the prompt plus the first k drifted ids (a stream cut and
    continued, issue 17) gets the rest of the drifted answer, ids and all."""
    c = drift_clients["drifted"]
    whole = c.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=LENGTH, temperature=0,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    ).choices[0]  # fmt: skip
    assert whole.text != _greedy(drift_clients["default"])  # drifted text, continued below
    assert whole.model_extra is not None  # vLLM's fields, beyond the SDK's model
    prompt_ids: list[int] = whole.model_extra["prompt_token_ids"]
    ids: list[int] = whole.model_extra["token_ids"]
    k = 30
    rest = c.completions.create(
        model=MODEL, prompt=prompt_ids + ids[:k], max_tokens=LENGTH - k, temperature=0,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    ).choices[0]  # fmt: skip
    assert rest.model_extra is not None
    assert rest.model_extra["token_ids"] == ids[k:]
    assert tx.detokenize(ids[:k]) + rest.text == whole.text


def test_drift_zero_is_the_default_builds_text() -> None:
    """Pure: no drift gives exactly the tokens of the default build; drift 1 replaces every
    token, each by another word with the same leading space; a drift is a function of its
    inputs."""
    key = tx.prompt_key(tx.tokenize(PROMPT))
    plain = [tx.generated_token_id(0, key, 0, i) for i in range(LENGTH)]
    assert [tx.generated_token_id(0, key, 0, i, tx.Drift(0.0, 9)) for i in range(LENGTH)] == plain
    every = [tx.generated_token_id(0, key, 0, i, tx.Drift(1.0)) for i in range(LENGTH)]
    assert all(a != b and a % 2 == b % 2 for a, b in zip(plain, every, strict=True))
    assert every == [tx.generated_token_id(0, key, 0, i, tx.Drift(1.0)) for i in range(LENGTH)]
    other_seed = [tx.generated_token_id(0, key, 0, i, tx.Drift(1.0, 2)) for i in range(LENGTH)]
    assert other_seed != every
    with pytest.raises(ValueError, match="drift share"):
        tx.Drift(1.5)
