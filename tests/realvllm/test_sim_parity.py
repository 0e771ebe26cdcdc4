"""Wire-shape parity: the simulator against a running real vLLM 0.32 (CPU, tiny model).

The real servers are the session's (tests/realvllm/conftest.py), or the ones named by
``LLM_GATEWAY_REAL_VLLM_URL`` and, for embeddings, ``LLM_GATEWAY_REAL_VLLM_EMBED_URL`` (one
started with ``--runner pooling --convert embed``); the same requests go to both and the
JSON shapes (keys, their order, types, and the values that must match), status codes and
header names are compared.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from gateway.sim import EngineParams, SimConfig, SimServerThread

REAL_URL = os.environ.get("LLM_GATEWAY_REAL_VLLM_URL")
pytestmark = pytest.mark.realvllm

# Values that must match. Prompt token counts are left out: the simulator only
# approximates a tokenizer, and the tiny model's (scripts/vllm-cpu) is its own.
KEEP = {
    "completion_tokens",
    "code",
    "index",
    "param",
    "type",
    "finish_reason",
    "object",
    "owned_by",
    "parent",
    "max_model_len",
    "model",
}
USER = [{"role": "user", "content": "hello world"}]
CASES: list[tuple[str, str, Any]] = [
    ("POST", "/v1/chat/completions", {"messages": USER, "max_tokens": 3, "ignore_eos": True}),
    (
        "POST",
        "/v1/chat/completions",
        # one token: under load vLLM may merge two quick tokens in one chunk
        {"messages": USER, "max_tokens": 1, "ignore_eos": True, "stream": True},
    ),
    (
        "POST",
        "/v1/chat/completions",
        {  # one token: under load vLLM may merge two quick tokens in one chunk
            "messages": USER,
            "max_tokens": 1,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    ),
    (
        "POST",
        "/v1/chat/completions",
        {"messages": USER, "max_tokens": 1, "ignore_eos": True, "n": 2, "stream": True},
    ),
    (
        "POST",
        "/v1/chat/completions",
        {"messages": USER, "max_completion_tokens": 2, "ignore_eos": True, "n": 2},
    ),
    ("POST", "/v1/completions", {"prompt": "hello world", "max_tokens": 3, "ignore_eos": True}),
    (
        "POST",
        "/v1/completions",
        {  # one token: vLLM may merge two quick tokens of a completion stream in one chunk
            "prompt": "hello world",
            "max_tokens": 1,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    ),
    (
        "POST",
        "/v1/completions",
        {"prompt": "hello world", "max_tokens": 2, "ignore_eos": True, "stream": True},
    ),
    ("POST", "/v1/chat/completions", {"model": "nope", "messages": USER}),
    ("POST", "/v1/chat/completions", {}),
    ("POST", "/v1/chat/completions", "{bad json"),
    ("POST", "/v1/chat/completions", {"messages": []}),
    ("POST", "/v1/chat/completions", {"messages": USER, "max_tokens": 10**6}),
    ("POST", "/v1/chat/completions", {"messages": USER, "max_tokens": -1}),
    ("POST", "/v1/completions", {"prompt": "hi", "n": 0}),
    ("POST", "/v1/completions", {"prompt": "hi", "stream_options": {"include_usage": True}}),
    ("POST", "/v1/completions", {}),
    ("GET", "/v1/models", None),
    ("GET", "/health", None),
    ("GET", "/version", None),
    ("GET", "/load", None),
    ("POST", "/tokenize", {"prompt": "hello world"}),
    ("POST", "/tokenize", {"messages": USER}),
    ("POST", "/reset_prefix_cache", None),
    ("GET", "/v1/nothing", None),
]


def shape(o: Any, key: str | None = None) -> Any:
    if isinstance(o, dict):
        return {k: shape(v, k) for k, v in o.items()}
    if key == "tokens" and isinstance(o, list):  # token ids: the tokenizers differ
        return "list"
    if isinstance(o, list):
        return [shape(v) for v in o]
    if key in KEEP:
        return o
    return type(o).__name__


def payload(r: httpx.Response) -> Any:
    ct = r.headers.get("content-type", "")
    if "event-stream" in ct:
        events = [b for b in r.text.split("\n\n") if b]
        return [
            e if e == "data: [DONE]" else shape(json.loads(e.removeprefix("data: ")))
            for e in events
        ]
    if "json" in ct:
        return shape(r.json())
    return r.text


@pytest.fixture(scope="module")
def pair(real_vllm) -> Iterator[tuple[str, str, str]]:
    real_url = REAL_URL or real_vllm["a"].url
    real = httpx.get(real_url + "/v1/models").json()["data"][0]
    sim = SimServerThread(
        SimConfig(model=real["id"], engine=EngineParams(max_model_len=real["max_model_len"]))
    )
    url = sim.start()
    yield real_url, url, real["id"]
    sim.stop()


def compare(pair: tuple[str, str, str], method: str, path: str, body: Any) -> None:
    """The same request to real vLLM and to the simulator: the same status, content type,
    header names and payload shape. A stream is asked of real vLLM again (3 tries at most)
    when its events are fewer than the simulator's: vLLM sends several tokens in one event
    when its output lags (a busy machine), which is vLLM's timing, not its shape."""
    real, sim, model = pair
    kw: dict[str, Any] = {}
    if isinstance(body, str):
        kw = {"content": body, "headers": {"content-type": "application/json"}}
    elif body is not None:
        kw = {"json": {"model": model, **body}}

    def ask(base: str) -> tuple[Any, ...]:
        r = httpx.request(method, base + path, timeout=30, **kw)
        headers = sorted(
            k for k in r.headers if k not in ("date", "content-length", "x-request-id")
        )
        return r.status_code, r.headers.get("content-type"), headers, payload(r)

    want = ask(sim)
    got = ask(real)
    for _ in range(2):
        lagged = isinstance(got[3], list) and isinstance(want[3], list) and len(
            got[3]) < len(want[3])
        if not lagged:
            break
        got = ask(real)
    assert want == got


@pytest.mark.parametrize(("method", "path", "body"), CASES, ids=lambda c: str(c)[:40])
def test_same_shape_as_real_vllm(
    pair: tuple[str, str, str], method: str, path: str, body: Any
) -> None:
    compare(pair, method, path, body)


EMBED_URL = os.environ.get("LLM_GATEWAY_REAL_VLLM_EMBED_URL")
EMBED_CASES: list[tuple[str, str, Any]] = [
    ("POST", "/v1/embeddings", {"input": "hello world"}),
    ("POST", "/v1/embeddings", {"input": ["hello world", "hello"], "encoding_format": "base64"}),
    ("POST", "/v1/embeddings", {"input": [[1, 2, 3], [4, 5]]}),
    ("POST", "/v1/embeddings", {"input": []}),
    ("POST", "/v1/embeddings", {"input": "hi", "dimensions": 8}),
    ("POST", "/v1/embeddings", {"model": "nope", "input": "hi"}),
]


@pytest.fixture(scope="module")
def embed_pair(real_vllm) -> Iterator[tuple[str, str, str]]:
    embed_url = EMBED_URL or real_vllm["embed"].url
    real = httpx.get(embed_url + "/v1/models").json()["data"][0]
    probe = httpx.post(embed_url + "/v1/embeddings", json={"input": "x"}).json()
    sim = SimServerThread(
        SimConfig(
            model=real["id"],
            engine=EngineParams(max_model_len=real["max_model_len"]),
            embedding_dim=len(probe["data"][0]["embedding"]),
        )
    )
    url = sim.start()
    yield embed_url, url, real["id"]
    sim.stop()


@pytest.mark.parametrize(("method", "path", "body"), EMBED_CASES, ids=lambda c: str(c)[:40])
def test_embeddings_same_shape_as_real_vllm(
    embed_pair: tuple[str, str, str], method: str, path: str, body: Any
) -> None:
    compare(embed_pair, method, path, body)
