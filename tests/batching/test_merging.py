"""Request merging through the real gateway (openai SDK -> gateway -> simulated vLLM):
concurrent embeddings / completions become one upstream request, and each client's answer,
split back, is byte for byte the answer it gets unmerged (``id`` and ``created`` aside,
which belong to one request); a merged request that fails is retried unmerged; chat and
streams are never merged."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import openai

from gateway.sim import SimServerThread
from tests.batching.conftest import MODEL
from tests.support.scripted import wait_for
from tests.support.servers import GatewayThread, gateway_config

N = 8
# fixed-wait batcher, 8 per batch, a wait long enough for 8 concurrent requests to gather
MERGING = {
    "batcher": {
        "enabled": True,
        "predictive": False,
        "normal": {"max_batch_size": N, "max_wait_ms": 1500},
    }
}


def sdk(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=30)


def normalised(body: bytes) -> bytes:
    """``id`` and ``created`` blanked (they name one upstream request)."""
    body = re.sub(rb'"id":"[^"]*"', b'"id":""', body)
    return re.sub(rb'"created":\d+', b'"created":0', body)


def upstream_count(s: SimServerThread, path: str) -> int:
    stats = httpx.get(s.url + "/sim/stats").json()
    return int(stats["requests_by_path"].get(path, 0))


def concurrently(fn: Callable[[int], Any], n: int = N) -> list[Any]:
    with ThreadPoolExecutor(n) as pool:
        return list(pool.map(fn, range(n)))


def direct(s: SimServerThread, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(s.url + path, json=body, timeout=30)


def test_embeddings_merged_and_split_exactly(sim, batching_gateway) -> None:
    s = sim()
    gw: GatewayThread = batching_gateway([("a", s.url, 16)], **MERGING)
    client = sdk(gw.url)
    # token-id inputs, one or two per request: usage apportioned exactly
    inputs: list[Any] = [
        [[7 + i] * (3 + i)] if i % 2 else [[5] * (i + 1), [9, 9]] for i in range(N)
    ]
    before = upstream_count(s, "/v1/embeddings")

    def call(i: int) -> bytes:
        raw = client.embeddings.with_raw_response.create(
            model=MODEL, input=inputs[i], encoding_format="float"
        )
        return raw.http_response.content

    merged = concurrently(call)
    assert upstream_count(s, "/v1/embeddings") - before < N  # merged upstream
    for i, body in enumerate(merged):
        alone = direct(s, "/v1/embeddings", {"model": MODEL, "input": inputs[i],
                                              "encoding_format": "float"})
        assert alone.status_code == 200
        assert normalised(body) == normalised(alone.content)
    merged_total = httpx.get(gw.url + "/metrics").text
    assert 'gateway_merged_requests_total{endpoint="/v1/embeddings",outcome="ok"}' in merged_total
    # every member's duration is observed, merged or not (dashboards missed the merged ones)
    series = f'{{endpoint="/v1/embeddings",model="{MODEL}"}} {N}.0'
    assert f"gateway_request_duration_seconds_count{series}" in merged_total
    assert f"gateway_time_to_first_byte_seconds_count{series}" in merged_total


def test_merged_members_counted_under_the_answering_backends_version(sim) -> None:
    """Each member of a merged request is counted in ``gateway_requests_total`` under the
    ``model_version`` of the backend that answered the merged request (``v7``)."""
    s = sim()
    cfg = gateway_config([{"id": "a", "url": s.url, "max_num_seqs": 16,
                           "model_version": "v7"}], **MERGING)
    with GatewayThread(cfg) as gw:
        client = sdk(gw.url)
        concurrently(lambda i: client.embeddings.create(model=MODEL, input=[[5 + i] * 3]))
        text = httpx.get(gw.url + "/metrics").text
    assert 'gateway_merged_requests_total{endpoint="/v1/embeddings",outcome="ok"}' in text
    label = f'endpoint="/v1/embeddings",model="{MODEL}",status="200"'
    assert f'gateway_requests_total{{{label},version="v7"}} {N}.0' in text, text


def test_text_embeddings_base64_split(sim, batching_gateway) -> None:
    """Text inputs and the SDK's default base64 encoding: vectors and indices exact, usage
    apportioned (by text size) and adding up to the merged request's."""
    s = sim()
    gw = batching_gateway([("a", s.url, 16)], **MERGING)
    client = sdk(gw.url)
    texts = [[f"sentence number {i} about the sea"] * (1 + i % 3) for i in range(N)]
    before = upstream_count(s, "/v1/embeddings")
    results = concurrently(
        lambda i: client.embeddings.with_raw_response.create(model=MODEL, input=texts[i])
    )
    assert upstream_count(s, "/v1/embeddings") - before < N
    for i, raw in enumerate(results):
        got = json.loads(raw.http_response.content)
        alone = direct(s, "/v1/embeddings", {"model": MODEL, "input": texts[i],
                                              "encoding_format": "base64"}).json()
        assert got["data"] == alone["data"]
        assert got["usage"]["prompt_tokens"] == got["usage"]["total_tokens"] > 0
        assert raw.parse().data[0].embedding  # the SDK decodes it


def test_completions_merged_and_split_exactly(sim, batching_gateway) -> None:
    s = sim()
    gw = batching_gateway([("a", s.url, 16)], **MERGING)
    client = sdk(gw.url)
    prompts = [[[11 + i] * (2 + i)] for i in range(N)]  # one token-id prompt each
    params = {"max_tokens": 5, "temperature": 0.7, "seed": 42}
    before = upstream_count(s, "/v1/completions")

    def call(i: int) -> bytes:
        raw = client.completions.with_raw_response.create(
            model=MODEL, prompt=prompts[i], extra_body={"ignore_eos": True}, **params
        )
        return raw.http_response.content

    merged = concurrently(call)
    assert upstream_count(s, "/v1/completions") - before < N
    for i, body in enumerate(merged):
        alone = direct(s, "/v1/completions", {"model": MODEL, "prompt": prompts[i],
                                               "ignore_eos": True, **params})
        assert normalised(body) == normalised(alone.content)


def test_different_sampling_params_are_not_merged(sim, batching_gateway) -> None:
    s = sim()
    gw = batching_gateway([("a", s.url, 16)], **MERGING)
    client = sdk(gw.url)
    before = upstream_count(s, "/v1/completions")
    concurrently(
        lambda i: client.completions.create(
            model=MODEL, prompt="hello", max_tokens=2 + i, seed=1  # all different
        )
    )
    assert upstream_count(s, "/v1/completions") - before == N


def test_members_with_different_headers_or_query_are_not_merged(sim, batching_gateway) -> None:
    """Eight concurrent embeddings: tenant ``red`` or ``blue`` (a header the gateway does not
    know), each with its own W3C ``traceparent``, and two of the red ones with a query
    string. Only requests with equal headers and query merge (trace context aside), so each
    upstream request carries the tenant and query its every input was sent with."""
    s = sim()
    gw = batching_gateway([("a", s.url, 16)], **MERGING)
    client = sdk(gw.url)
    before = len(httpx.get(s.url + "/sim/stats").json()["recent_requests"])

    def call(i: int) -> None:
        tenant = "red" if i % 2 else "blue"
        query = {"tag": "q"} if i in (1, 3) else None
        client.embeddings.create(
            model=MODEL,
            input=f"{tenant} {i}",
            extra_headers={"x-tenant": tenant,
                           "traceparent": f"00-{i + 1:032x}-{i + 1:016x}-01"},
            extra_query=query,
        )

    concurrently(call)
    recent = httpx.get(s.url + "/sim/stats").json()["recent_requests"][before:]
    sent = [r for r in recent if r["path"] == "/v1/embeddings"]
    assert len(sent) < N  # requests with equal headers still merged
    seen_inputs: list[str] = []
    for r in sent:
        inputs = r["body"]["input"]
        inputs = [inputs] if isinstance(inputs, str) else inputs
        seen_inputs += inputs
        tenant = r["headers"]["x-tenant"]
        assert all(x.startswith(tenant + " ") for x in inputs), (tenant, inputs)
        assert "traceparent" in r["headers"]
    assert sorted(seen_inputs) == sorted(f"{'red' if i % 2 else 'blue'} {i}" for i in range(N))
    with_query = {"red 1", "red 3"}
    for r in sent:
        inputs = r["body"]["input"]
        inputs = {inputs} if isinstance(inputs, str) else set(inputs)
        assert inputs <= with_query if r["query"] == "tag=q" else not inputs & with_query, r


def batcher_is_empty(gw: GatewayThread) -> bool:
    """Nothing reserved, in a merge window or queued in the gateway's batcher."""
    b = gw.gateway.batching
    assert b is not None
    return not b.pending and not b.merge_flight and b.core.queued == 0


def test_a_lone_surrogate_fails_alone_and_its_neighbours_answer(sim, batching_gateway) -> None:
    """``"\\ud800"`` is legal JSON but not text: one such input among seven good ones. It
    is never merged (its merged body could not even be written as UTF-8, which left every
    member of its merge waiting forever and the batcher's reservations held), so it gets
    the backend's own answer alone and the seven get theirs."""
    s = sim()
    gw = batching_gateway([("a", s.url, 16)], **MERGING)
    bad = b'{"model":"%s","input":"bad \\ud800 x"}' % MODEL.encode()
    alone = httpx.post(s.url + "/v1/embeddings", content=bad,
                       headers={"content-type": "application/json"}, timeout=10)

    def call(i: int) -> httpx.Response:
        body = bad if i == 0 else json.dumps({"model": MODEL, "input": f"good {i}"}).encode()
        return httpx.post(gw.url + "/v1/embeddings", content=body,
                          headers={"content-type": "application/json"}, timeout=20)

    got = concurrently(call)
    assert got[0].status_code == alone.status_code
    assert [r.status_code for r in got[1:]] == [200] * (N - 1)
    assert wait_for(lambda: batcher_is_empty(gw))


def test_a_merge_that_cannot_be_built_answers_every_member(
    sim, batching_gateway, monkeypatch
) -> None:
    """Whatever fails while the merged request is built, each member is sent alone and
    answered, and the batcher's reservations are given back (fault injected into the
    merged body writer; the gateway runs in this process)."""
    from gateway.flow import merging

    def broken(endpoint: str, parts: Any) -> bytes:
        raise RuntimeError("injected")

    monkeypatch.setattr(merging, "merged_body", broken)
    s = sim()
    gw = batching_gateway([("a", s.url, 16)], **MERGING)
    client = sdk(gw.url)
    before = upstream_count(s, "/v1/embeddings")
    got = concurrently(lambda i: client.embeddings.create(model=MODEL, input=f"x {i}"))
    assert all(len(r.data) == 1 for r in got)
    assert upstream_count(s, "/v1/embeddings") - before == N  # each alone
    assert wait_for(lambda: batcher_is_empty(gw))


def test_failed_merge_is_retried_unmerged(sim, batching_gateway) -> None:
    """One input over the model's length fails the merged request (400): every member is
    sent again alone, so only the bad one fails."""
    s = sim()
    gw = batching_gateway([("a", s.url, 16)], **MERGING)
    client = sdk(gw.url)
    inputs: list[Any] = [[[3] * (i + 2)] for i in range(N)]
    inputs[3] = [[3] * 5000]  # max_model_len is 4096
    before = upstream_count(s, "/v1/embeddings")

    def call(i: int) -> tuple[int, bytes]:
        try:
            raw = client.embeddings.with_raw_response.create(
                model=MODEL, input=inputs[i], encoding_format="float"
            )
            return 200, raw.http_response.content
        except openai.BadRequestError as e:
            return e.status_code, e.response.content

    results = concurrently(call)
    assert upstream_count(s, "/v1/embeddings") - before == 1 + N  # merged once, then alone
    assert [st for st, _ in results] == [200, 200, 200, 400, 200, 200, 200, 200]
    for i, (_, body) in enumerate(results):
        if i != 3:
            alone = direct(s, "/v1/embeddings", {"model": MODEL, "input": inputs[i],
                                                  "encoding_format": "float"})
            assert normalised(body) == normalised(alone.content)
    assert "maximum context length" in results[3][1].decode()
    m = httpx.get(gw.url + "/metrics").text
    assert 'gateway_merged_requests_total{endpoint="/v1/embeddings",outcome="unmerged"} 8.0' in m


def test_chat_and_streams_are_never_merged(sim, batching_gateway) -> None:
    s = sim()
    gw = batching_gateway([("a", s.url, 16)], **MERGING)
    client = sdk(gw.url)
    before_chat = upstream_count(s, "/v1/chat/completions")
    before_cmpl = upstream_count(s, "/v1/completions")

    def call(i: int) -> None:
        if i % 2:
            client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2
            )
        else:
            list(client.completions.create(model=MODEL, prompt="hi", max_tokens=2, stream=True))

    concurrently(call)
    assert upstream_count(s, "/v1/chat/completions") - before_chat == N // 2
    assert upstream_count(s, "/v1/completions") - before_cmpl == N // 2
