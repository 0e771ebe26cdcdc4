"""``gateway_time_to_first_byte_seconds`` and ``gateway_request_duration_seconds`` cover
every answered request, streaming or not, by endpoint and model (the TTFB histogram left
out every non-streaming request: 800 of 4904 in a bench run)."""

from __future__ import annotations

import asyncio

import httpx
import openai
from prometheus_client.parser import text_string_to_metric_families

from tests.support.scripted import (
    Conn,
    Received,
    chunk_obj,
    completion_obj,
    default_script,
    models_obj,
)
from tests.support.servers import GatewayThread, gateway_config

CHAT = "/v1/chat/completions"
SLOW_S = 0.4  # the non-streaming answer's delay; the stream's end after its first event


def samples(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = httpx.get(url + "/metrics", timeout=5).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def series(m: dict, name: str, model: str, endpoint: str = CHAT) -> float | None:
    return m.get((name, (("endpoint", endpoint), ("model", model))))


def test_streaming_and_non_streaming_requests_in_both_histograms(backends, gateway):
    """A non-streaming chat request for ``slow`` (answered after 0.4 s) and a streaming one
    for ``fast`` (first event at once, the end 0.4 s later), through the ``openai`` SDK: each
    lands once in both histograms with its model label. The non-streaming answer's TTFB is
    when it was ready (about its duration); the stream's TTFB is its first event, well
    before its end. A request refused by the gateway (unknown model: 404) lands too, with
    an empty model label (unknown models never become label values)."""

    async def script(req: Received, conn: Conn) -> None:
        body = req.json()
        if body.get("stream"):
            await conn.start_stream()
            await conn.event(chunk_obj(role="assistant", content="", model=body["model"]))
            await asyncio.sleep(SLOW_S)
            await conn.event(chunk_obj(content="ok", model=body["model"]))
            await conn.event(chunk_obj(finish="stop", model=body["model"]))
            await conn.done()
        else:
            await asyncio.sleep(SLOW_S)
            await conn.send_json(200, completion_obj("ok", model=body["model"]))

    async def control(req: Received, conn: Conn) -> None:
        if req.path == "/v1/models":
            await conn.send_json(200, models_obj("slow", "fast"))
        else:
            await default_script(req, conn)

    a = backends(script, control=control, models=("slow", "fast"))
    gw = gateway({"a": a})
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key="none", max_retries=0)
    msgs = [{"role": "user", "content": "hi"}]
    got = client.chat.completions.create(model="slow", messages=msgs)  # type: ignore[arg-type]
    assert got.choices[0].message.content == "ok"
    chunks = list(client.chat.completions.create(model="fast", messages=msgs,  # type: ignore[arg-type]
                                                 stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "ok"
    try:
        client.chat.completions.create(model="nope", messages=msgs)  # type: ignore[arg-type]
        raise AssertionError("expected 404")
    except openai.NotFoundError:
        pass

    m = samples(gw.url)
    ttfb, dur = "gateway_time_to_first_byte_seconds", "gateway_request_duration_seconds"
    for model in ("slow", "fast", ""):
        assert series(m, f"{ttfb}_count", model) == 1.0, (model, [k for k in m if ttfb in k[0]])
        assert series(m, f"{dur}_count", model) == 1.0, model
    # non-streaming: the first byte goes out when the answer is ready
    slow_ttfb = series(m, f"{ttfb}_sum", "slow")
    slow_dur = series(m, f"{dur}_sum", "slow")
    assert slow_ttfb is not None and slow_dur is not None
    assert SLOW_S <= slow_ttfb <= slow_dur + 1e-6
    # streaming: the first event, long before the end
    fast_ttfb = series(m, f"{ttfb}_sum", "fast")
    fast_dur = series(m, f"{dur}_sum", "fast")
    assert fast_ttfb is not None and fast_dur is not None
    assert fast_dur >= SLOW_S and fast_ttfb < fast_dur - SLOW_S / 2
    # the request counter has the same labels, and the version of the backend that
    # answered: "" for one without model_version
    assert m.get(("gateway_requests_total",
                  (("endpoint", CHAT), ("model", "slow"), ("status", "200"),
                   ("version", "")))) == 1.0


def test_requests_counted_under_the_version_of_the_backend_that_answered(backends):
    """``gateway_requests_total``'s ``version``: the ``model_version`` of the backend whose
    answer the client got, a stream or not (``m1`` on ``a``, version ``v1``), and of the
    backend whose own error answer was relayed (``m2`` on ``b``, ``v2``, answers 500: no
    other backend takes it, the 500 goes to the client as sent); no rollout needed."""

    async def failing(req: Received, conn: Conn) -> None:
        await conn.send_json(500, {"error": {"message": "boom", "type": "InternalServerError",
                                             "param": None, "code": 500}})

    a = backends(models=("m1",))
    b = backends(failing, models=("m2",))
    cfg = gateway_config([
        {"id": "a", "url": a.url, "models": ["m1"], "model_version": "v1"},
        {"id": "b", "url": b.url, "models": ["m2"], "model_version": "v2"},
    ])
    with GatewayThread(cfg) as gw:
        gw.wait_ready(routable=2)
        client = openai.OpenAI(base_url=gw.url + "/v1", api_key="none", max_retries=0)
        msgs = [{"role": "user", "content": "hi"}]
        client.chat.completions.create(model="m1", messages=msgs)  # type: ignore[arg-type]
        list(client.chat.completions.create(model="m1", messages=msgs,  # type: ignore[arg-type]
                                            stream=True))
        r = httpx.post(gw.url + CHAT, json={"model": "m2", "messages": msgs}, timeout=10)
        assert r.status_code == 500 and r.json()["error"]["message"] == "boom", r.text
        m = {k: v for k, v in samples(gw.url).items() if k[0] == "gateway_requests_total"}
    assert m == {
        ("gateway_requests_total",
         (("endpoint", CHAT), ("model", "m1"), ("status", "200"), ("version", "v1"))): 2.0,
        ("gateway_requests_total",
         (("endpoint", CHAT), ("model", "m2"), ("status", "500"), ("version", "v2"))): 1.0,
    }, m
