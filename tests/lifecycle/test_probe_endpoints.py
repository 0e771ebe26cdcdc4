"""Warm-up, application probes and calibration go to the engine endpoint the backend
serves for the model, and a 404 of an endpoint is not a health verdict.

A chat-only OpenAI-compatible server (404 on ``/v1/completions`` and ``/v1/embeddings``)
used to go ``warming -> unhealthy (warmup_failed)`` every 2 s forever, never routable.
"""

from __future__ import annotations

import httpx
import openai

from tests.lifecycle.support import (
    admin,
    history,
    metric,
    metric_samples,
    post_admin,
    sdk,
    wait_state,
)
from tests.support.scripted import Conn, Received, chunk_obj, completion_obj, error_obj, wait_for

CHAT = "/v1/chat/completions"
PROMPTS = ["Name a colour.", "Say hello.", "Count to three."]
SEED = 77

# warm-up at batch shapes 1 and 2, calibration on (3 prompts), short cycles every 0.3 s
SECTIONS = {
    "lifecycle": {"warmup_batch_shapes": [1, 2], "warmup_max_tokens": 4,
                  "check_interval_s": 0.1, "short": {"every_s": 0.3},
                  "medium": {"cooldown_s": 0}},
    "calibration": {"enabled": True, "prompts": PROMPTS, "seed": SEED, "max_tokens": 5},
}


def not_found(conn: Conn) -> object:
    return conn.send_json(404, error_obj("Not Found", 404, "NotFoundError"))


def test_chat_only_backend_warms_and_serves_chat(backends, lc_gateway):
    """A backend that serves only chat (404 to completions and embeddings) becomes warm and
    routable (``/ready/fleet``): warm-up found chat with one completions request (404) and then went
    straight to it (shapes 1 and 2: three chat requests of prompt ``ping`` as a user
    message, ``max_tokens`` 4, temperature 0); the calibration baseline was taken on chat
    (the prompts as user messages, temperature 0, the seed, ``max_tokens``; the answers'
    ``choices[0].message.content``). Short cycles probe chat directly, a medium cycle's
    calibration compares chat answers with the chat baseline (score 1.0), and chat through
    the gateway with the ``openai`` SDK works, streaming and not."""
    seen: list[tuple[str, dict]] = []

    async def chat_only(req: Received, conn: Conn) -> None:
        body = req.json() if req.body else {}
        seen.append((req.path, body))
        if req.path != CHAT:
            await not_found(conn)
            return
        text = f"answer to {body['messages'][-1]['content']}"
        if body.get("stream"):
            await conn.start_stream()
            await conn.event(chunk_obj(role="assistant", content=""))
            await conn.event(chunk_obj(content=text))
            await conn.event(chunk_obj(finish="stop"))
            await conn.done()
        else:
            await conn.send_json(200, completion_obj(text))

    a = backends(chat_only)
    gw = lc_gateway({"a": a.url}, **SECTIONS)
    assert httpx.get(gw.url + "/ready/fleet").json()["routable"] == ["a"]
    assert history(gw.url, "a") == [("cold", "warming", "probe_ok"), ("warming", "warm", "ready")]

    early = list(seen)  # what warm-up, calibration (and maybe a short cycle) sent
    paths = [p for p, _ in early]
    assert paths.count("/v1/completions") == 1, paths  # discovery: one 404, then chat
    assert "/v1/embeddings" not in paths
    pings = [b for p, b in early if p == CHAT and b["messages"][-1]["content"] == "ping"]
    assert all(b["messages"] == [{"role": "user", "content": "ping"}] and b["temperature"] == 0
               for b in pings), pings[:2]
    # warm-up: 1 + 2 of max_tokens 4 (a short cycle's probe, maybe in already, asks for 1)
    assert len([b for b in pings if b["max_tokens"] == 4]) == 3, pings
    calib = [b for p, b in early if p == CHAT and b["messages"][-1]["content"] in PROMPTS]
    assert [b["messages"] for b in calib] == [[{"role": "user", "content": q}] for q in PROMPTS]
    assert all(b["seed"] == SEED and b["temperature"] == 0 and b["max_tokens"] == 5
               for b in calib)
    b = gw.gateway.fleet.get("a")
    assert b is not None
    assert b.calibration_baseline == {q: f"answer to {q}" for q in PROMPTS}
    assert b.calibration_endpoint == CHAT

    # later probes (short cycles) go straight to chat: no more completions requests
    n = len(seen)
    assert wait_for(lambda: len(seen) >= n + 2, 10)
    assert [p for p, _ in seen].count("/v1/completions") == 1

    # a medium cycle: calibration on chat, compared with the chat baseline
    assert post_admin(gw.url, "a", "cooldown", {"force": True}).status_code == 202
    wait_state(gw.url, "a", "warm", timeout=15, maintenance=None)
    assert wait_for(lambda: admin(gw.url, "a")["calibration_score"] == 1.0, 10), admin(gw.url, "a")
    assert [p for p, _ in seen].count("/v1/completions") == 1
    assert "/v1/embeddings" not in [p for p, _ in seen]
    assert ("warm", "unhealthy") not in [(f, t) for f, t, _ in history(gw.url, "a")]

    client = sdk(gw.url)
    msgs = [{"role": "user", "content": "hi"}]
    got = client.chat.completions.create(model="m1", messages=msgs)  # type: ignore[arg-type]
    assert got.choices[0].message.content == "answer to hi"
    chunks = list(client.chat.completions.create(model="m1", messages=msgs,  # type: ignore[arg-type]
                                                 stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "answer to hi"


def test_backend_serving_no_probe_endpoint_still_warm(backends, lc_gateway):
    """A backend whose ``/health`` and ``/v1/models`` answer but that answers 404 to every
    engine request it is probed with still becomes warm, never ``unhealthy``: warm-up
    passes, calibration is skipped (no baseline, no score), short-cycle probes treat it as
    alive; the last error says why and ``gateway_probe_unserved_total`` counts each check."""
    seen: list[str] = []

    async def nothing(req: Received, conn: Conn) -> None:
        seen.append(req.path)
        await not_found(conn)

    a = backends(nothing)
    gw = lc_gateway({"a": a.url}, **SECTIONS)
    assert httpx.get(gw.url + "/ready/fleet").json()["routable"] == ["a"]
    assert history(gw.url, "a") == [("cold", "warming", "probe_ok"), ("warming", "warm", "ready")]
    assert {"/v1/completions", CHAT, "/v1/embeddings"} <= set(seen)

    def counted(check: str) -> float:
        return metric(metric_samples(gw.url), "gateway_probe_unserved_total",
                      backend="a", check=check) or 0.0

    assert counted("warmup") == 1
    assert counted("calibration") >= 1
    assert wait_for(lambda: counted("app_probe") >= 2, 10)  # short cycles: still alive
    b = admin(gw.url, "a")
    assert b["state"] == "warm"
    assert b["calibration_score"] is None
    assert "serves none of" in (b["last_error"] or ""), b["last_error"]
    assert all(t != "unhealthy" for _, t, _ in history(gw.url, "a"))
    # a request through the gateway gets the backend's own 404, unchanged (not a 5xx)
    try:
        sdk(gw.url).chat.completions.create(
            model="m1", messages=[{"role": "user", "content": "hi"}])
        raise AssertionError("expected the backend's 404")
    except openai.NotFoundError:
        pass


def test_a_backend_configured_for_a_model_it_does_not_serve_fails_its_warm_up(sims):
    """A 404 about the *model* (vLLM: ``The model `nope` does not exist.``) is a verdict,
    not a missing endpoint: the backend configured for ``nope`` never becomes routable:
    ``/ready/fleet`` stays 503 (it went warm and took traffic it could only 404), while the
    gateway itself is ready (``/ready`` 200: it answers such requests itself)."""
    from tests.support.servers import GatewayThread, gateway_config

    s = sims("a")
    cfg = gateway_config([{"id": "a", "url": s.url, "models": ["nope"]}],
                         lifecycle={"warmup_batch_shapes": [1]})
    gw = GatewayThread(cfg)
    gw.start(wait_ready=False)
    try:
        assert wait_for(lambda: any(t[2] == "warmup_failed"
                                    for t in history(gw.url, "a")), 15), history(gw.url, "a")
        assert admin(gw.url, "a")["state"] != "warm"
        assert httpx.get(gw.url + "/ready/fleet", timeout=5).status_code == 503
        assert httpx.get(gw.url + "/ready", timeout=5).status_code == 200
    finally:
        gw.stop()
