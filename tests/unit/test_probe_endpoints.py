"""The engine endpoint of warm-up, application probes and calibration (pure helpers, the
per-(backend, model) memory, the probe functions over an in-memory HTTP transport), and
the latency histograms' cached label children."""

from __future__ import annotations

import json
from collections.abc import Callable

import httpx
import pytest

from gateway.config import BackendConfig
from gateway.fleet.backend import Backend
from gateway.fleet.calibration import collect_answers
from gateway.fleet.probes import (
    CHAT,
    COMPLETIONS,
    EMBEDDINGS,
    ENGINE_ENDPOINTS,
    ProbeEndpoints,
    app_probe,
    engine_answer,
    engine_body,
    not_this_endpoint,
    warm_up,
)
from gateway.metrics import GatewayMetrics

# ---- pure helpers ----------------------------------------------------------------------


@pytest.mark.parametrize("status", [400, 404, 405, 422])
def test_a_4xx_means_not_this_endpoint(status: int) -> None:
    assert not_this_endpoint(status)


@pytest.mark.parametrize("status", [200, 401, 403, 429, 500, 502, 503])
def test_success_auth_busy_and_5xx_are_verdicts(status: int) -> None:
    assert not not_this_endpoint(status)


def test_engine_bodies() -> None:
    assert engine_body(COMPLETIONS, "m", "hi", 3) == {
        "model": "m", "max_tokens": 3, "temperature": 0, "prompt": "hi"}
    assert engine_body(CHAT, "m", "hi", 3, seed=7) == {
        "model": "m", "max_tokens": 3, "temperature": 0,
        "messages": [{"role": "user", "content": "hi"}], "seed": 7}
    assert engine_body(EMBEDDINGS, "m", "hi", 3, seed=7) == {"model": "m", "input": "hi"}
    with pytest.raises(ValueError):
        engine_body("/v1/responses", "m", "hi", 3)


def test_engine_answers() -> None:
    assert engine_answer(COMPLETIONS, {"choices": [{"text": " 2, 3"}]}) == " 2, 3"
    assert engine_answer(CHAT, {"choices": [{"message": {"content": "Tokyo"}}]}) == "Tokyo"
    assert engine_answer(EMBEDDINGS, {"data": [{"embedding": [0.5, 1.0]}]}) == [0.5, 1.0]
    with pytest.raises(ValueError, match="unexpected /v1/chat/completions answer"):
        engine_answer(CHAT, {"choices": [{"text": "a completion's shape"}]})
    with pytest.raises(ValueError):
        engine_answer(COMPLETIONS, [])


def test_memory_order_found_lost_and_unserved_reported_once() -> None:
    e = ProbeEndpoints()
    assert e.order("a", "m") == ENGINE_ENDPOINTS == (COMPLETIONS, CHAT, EMBEDDINGS)
    e.found("a", "m", CHAT)
    assert e.get("a", "m") == CHAT
    assert e.order("a", "m") == (CHAT, COMPLETIONS, EMBEDDINGS)
    assert e.order("b", "m") == ENGINE_ENDPOINTS  # per backend
    assert e.order("a", "m2") == ENGINE_ENDPOINTS  # and per model
    e.lost("a", "m", COMPLETIONS)  # not the remembered one: kept
    assert e.get("a", "m") == CHAT
    e.lost("a", "m", CHAT)
    assert e.get("a", "m") is None
    e.unserved("a", "m", "all 404")
    assert e.unserved_detail("a", "m") == "all 404"
    assert e.report("a", "m") == "all 404"
    assert e.report("a", "m") is None  # logged once
    e.found("a", "m", EMBEDDINGS)
    assert e.unserved_detail("a", "m") is None
    e.unserved("a", "m", "again")
    assert e.report("a", "m") == "again"  # a new episode is reported again


def test_latency_children_cached_and_first_byte_optional() -> None:
    m = GatewayMetrics()
    m.observe_latency("/v1/chat/completions", "m", 0.1, 0.5)
    children = m._latency_children[("/v1/chat/completions", "m")]
    m.observe_latency("/v1/chat/completions", "m", None, 0.25)  # client gone: no first byte
    assert m._latency_children[("/v1/chat/completions", "m")] is children
    labels = {"endpoint": "/v1/chat/completions", "model": "m"}
    get = m.registry.get_sample_value
    assert get("gateway_time_to_first_byte_seconds_count", labels) == 1
    assert get("gateway_time_to_first_byte_seconds_sum", labels) == pytest.approx(0.1)
    assert get("gateway_request_duration_seconds_count", labels) == 2
    assert get("gateway_request_duration_seconds_sum", labels) == pytest.approx(0.75)


# ---- the probes over an in-memory transport ----------------------------------------------

Handler = Callable[[str, dict], httpx.Response]


def backend() -> Backend:
    return Backend(config=BackendConfig(id="a", url="http://backend"))


def client(handler: Handler, seen: list[tuple[str, dict]]) -> httpx.AsyncClient:
    def handle(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        seen.append((request.url.path, body))
        return handler(request.url.path, body)

    return httpx.AsyncClient(transport=httpx.MockTransport(handle))


def chat_only(path: str, body: dict) -> httpx.Response:
    if path != CHAT:
        return httpx.Response(404, json={"detail": "Not Found"})
    text = "echo " + body["messages"][0]["content"]
    return httpx.Response(200, json={"choices": [{"message": {"content": text}}]})


async def test_app_probe_finds_chat_and_remembers_it() -> None:
    seen: list[tuple[str, dict]] = []
    memory = ProbeEndpoints()
    async with client(chat_only, seen) as c:
        first = await app_probe(c, backend(), "m", None, endpoints=memory)
        assert first.ok and first.endpoint == CHAT and first.ttft_s is not None
        assert not first.unserved
        assert [p for p, _ in seen] == [COMPLETIONS, CHAT]
        assert seen[1][1]["messages"] == [{"role": "user", "content": "ping"}]
        seen.clear()
        again = await app_probe(c, backend(), "m", None, endpoints=memory)
        assert again.ok and [p for p, _ in seen] == [CHAT]  # straight to it


async def test_remembered_endpoint_that_starts_404ing_is_looked_for_again() -> None:
    seen: list[tuple[str, dict]] = []
    memory = ProbeEndpoints()
    memory.found("a", "m", COMPLETIONS)
    async with client(chat_only, seen) as c:
        res = await app_probe(c, backend(), "m", None, endpoints=memory)
    assert res.ok and res.endpoint == CHAT
    assert [p for p, _ in seen] == [COMPLETIONS, CHAT]
    assert memory.get("a", "m") == CHAT


async def test_all_404_passes_unserved_without_a_verdict() -> None:
    seen: list[tuple[str, dict]] = []
    memory = ProbeEndpoints()
    async with client(lambda p, b: httpx.Response(404), seen) as c:
        res = await app_probe(c, backend(), "m", None, endpoints=memory)
        assert res.ok and res.unserved and res.ttft_s is None
        assert [p for p, _ in seen] == list(ENGINE_ENDPOINTS)
        assert memory.unserved_detail("a", "m") is not None
        assert await warm_up(c, backend(), "m", None, [1, 2, 4], 8, memory) is None
        # (the passes after the first all-unserved one are skipped)
        assert len(seen) == 2 * len(ENGINE_ENDPOINTS)


@pytest.mark.parametrize("status", [500, 503, 401, 429])
async def test_5xx_auth_and_busy_fail_without_trying_another_endpoint(status: int) -> None:
    seen: list[tuple[str, dict]] = []
    async with client(lambda p, b: httpx.Response(status), seen) as c:
        res = await app_probe(c, backend(), "m", None, endpoints=ProbeEndpoints())
        assert not res.ok and not res.unserved and str(status) in res.detail
        assert [p for p, _ in seen] == [COMPLETIONS]
        err = await warm_up(c, backend(), "m", None, [1], 8, ProbeEndpoints())
        assert err is not None and str(status) in err


async def test_transport_error_fails_the_probe() -> None:
    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused", request=request)

    async with httpx.AsyncClient(transport=httpx.MockTransport(refuse)) as c:
        res = await app_probe(c, backend(), "m", None, endpoints=ProbeEndpoints())
    assert not res.ok and "ConnectError" in res.detail


async def test_calibration_over_chat_and_only_its_baseline_endpoint() -> None:
    seen: list[tuple[str, dict]] = []
    memory = ProbeEndpoints()
    async with client(chat_only, seen) as c:
        got = await collect_answers(c, backend(), "m", ["p1", "p2"], 5, 42, None, memory)
        assert got.endpoint == CHAT and not got.unserved
        assert got.answers == {"p1": "echo p1", "p2": "echo p2"}
        chats = [b for p, b in seen if p == CHAT]
        assert chats == [
            {"model": "m", "max_tokens": 5, "temperature": 0, "seed": 42,
             "messages": [{"role": "user", "content": q}]} for q in ("p1", "p2")]
        assert [p for p, _ in seen].count(COMPLETIONS) == 1  # discovery, then chat only
        # a baseline taken on completions is compared only with completions answers
        seen.clear()
        only = await collect_answers(c, backend(), "m", ["p1"], 5, 42, None, memory,
                                     only=COMPLETIONS)
        assert only.unserved and only.answers == {} and only.endpoint is None
        assert [p for p, _ in seen] == [COMPLETIONS]
        assert memory.unserved_detail("a", "m") is None  # one endpoint tried: no verdict


async def test_calibration_5xx_raises() -> None:
    async with client(lambda p, b: httpx.Response(500, text="boom"), []) as c:
        with pytest.raises(ValueError, match="500"):
            await collect_answers(c, backend(), "m", ["p1"], 5, 42, None, ProbeEndpoints())


def test_a_404_about_the_model_is_a_verdict_not_a_missing_endpoint():
    """vLLM answers a model it does not serve with 404 ``The model `x` does not exist.``
    (``param: "model"``): that backend does not serve what it is configured for, and must
    not pass warm-up as if the endpoint were absent."""
    from gateway.fleet.probes import model_missing, not_this_endpoint

    vllm = (b'{"error": {"message": "The model `nope` does not exist.", "type": '
            b'"NotFoundError", "param": "model", "code": 404}}')
    assert model_missing(vllm) and not not_this_endpoint(404, vllm)
    openai_style = b'{"error": {"message": "x", "code": "model_not_found"}}'
    assert not not_this_endpoint(404, openai_style)
    assert not_this_endpoint(404, b'{"detail": "Not Found"}')  # FastAPI: no such route
    assert not_this_endpoint(404, b"")
    assert not_this_endpoint(405, vllm.replace(b"404", b"405"))  # only a 404 is about it
    assert not not_this_endpoint(429, b"") and not not_this_endpoint(500, b"")
