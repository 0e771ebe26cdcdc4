"""A stream whose backend fails mid-generation goes on on another backend (issue 17), as the
real ``openai`` SDK sees it through the gateway under uvicorn.

Two simulated vLLM servers of ``m1``; A cuts every stream's connection right after the event
carrying its 5th generated token (its ``drop_after_tokens`` fault). A streaming request at
temperature 0 that lands on A is continued on B (:mod:`gateway.flow.continuing`): the SDK
collects the same text as an uninterrupted run on B, one ``finish_reason``, one usage equal
to the uninterrupted one, and no error.
Which backend the router picks first is its own business, so requests are sent until one
was continued (at most a few: A and B share the load); every one of them must be whole.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from tests.lifecycle.support import MODEL, Sim, metric, metric_samples, sdk
from tests.support.scripted import wait_for
from tests.support.servers import GatewayThread, gateway_config

MAX_TOKENS = 24
CUT_AT = 5  # A's stream breaks after the event carrying this many tokens
TRIES = 6  # requests sent at most until one lands on A
MESSAGES: Any = [{"role": "user", "content": "Tell me a long story about a lighthouse."}]
PROMPT = "The story of a lighthouse keeper"


@pytest.fixture(scope="module")
def fleet() -> Iterator[tuple[Sim, Sim, GatewayThread]]:
    """Sims A (cuts its streams) and B, and a gateway in front of both."""
    a, b = Sim("a", 0.005), Sim("b", 0.005)
    httpx.patch(f"{a.url}/sim/faults", json={"drop_after_tokens": CUT_AT},
                timeout=20).raise_for_status()
    # A's breaker must not open on its cut streams, or the router stops sending it any
    cfg = gateway_config([{"id": "a", "url": a.url}, {"id": "b", "url": b.url}],
                         breaker={"consecutive_failures": 100})
    gw = GatewayThread(cfg)
    gw.start()
    yield a, b, gw
    gw.stop()
    a.stop()
    b.stop()


def _collect(stream: Any, chat: bool) -> tuple[str, list[str], list[Any]]:
    """The text, the finish reasons and the usages an SDK stream yields (raises on an error
    event)."""
    text, finishes, usages = "", [], []
    for chunk in stream:
        if chunk.usage is not None:
            usages.append(chunk.usage.model_dump())
        for ch in chunk.choices:
            text += (ch.delta.content if chat else ch.text) or ""
            if ch.finish_reason is not None:
                finishes.append(ch.finish_reason)
    return text, finishes, usages


def _run(client: openai.OpenAI, chat: bool) -> tuple[str, list[str], list[Any]]:
    """One streaming request at temperature 0 with ``include_usage``, as the SDK sees it."""
    extra = {"ignore_eos": True}
    usage: Any = {"include_usage": True}
    if chat:
        return _collect(client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0, seed=7,
            stream=True, stream_options=usage, extra_body=extra), chat)
    return _collect(client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, seed=7,
        stream=True, stream_options=usage, extra_body=extra), chat)


def _continued(gw: GatewayThread, outcome: str = "continued") -> float:
    v = metric(metric_samples(gw.url), "gateway_stream_continuations_total",
               reason="upstream_disconnected", outcome=outcome)
    return v or 0.0


@pytest.mark.parametrize("chat", [True, False], ids=["chat", "completions"])
def test_a_stream_cut_on_one_backend_ends_whole_on_another(
    fleet: tuple[Sim, Sim, GatewayThread], chat: bool
) -> None:
    a, b, gw = fleet
    whole = _run(openai.OpenAI(base_url=b.url + "/v1", api_key="none", max_retries=0), chat)
    text, finishes, usages = whole
    assert finishes == ["length"] and text and usages[-1]["completion_tokens"] == MAX_TOKENS
    client = sdk(gw.url)
    before = _continued(gw)
    for _ in range(TRIES):
        got = _run(client, chat)  # an error event would raise openai.APIError
        # the same text, one finish_reason, one usage (prompt tokens once, completion
        # tokens summed)
        assert got == whole
        if _continued(gw) > before:
            break
    assert _continued(gw) == before + 1, "no stream was cut and continued"
    path = "/v1/chat/completions" if chat else "/v1/completions"
    assert a.stats()["requests_by_path"].get(path, 0) >= 1
    _assert_nothing_held(gw)


def _assert_nothing_held(gw: GatewayThread) -> None:
    """Every hold of the continued requests was given back (docs/architecture.md section 3,
    the lease): both backends' slots and watchdog handles, breaker half-open slots, the
    admission tickets."""
    g = gw.gateway

    def free() -> bool:
        return all((b.in_flight, b.pooled_extra, len(b.active), len(b.awaiting),
                    b.breaker.half_open_in_flight) == (0, 0, 0, 0, 0) for b in g.fleet
                   ) and g.gate.scheduler.in_flight == 0

    assert wait_for(free, 10), [(b.id, b.in_flight, b.active, b.awaiting) for b in g.fleet]


def test_a_client_may_turn_continuation_off(fleet: tuple[Sim, Sim, GatewayThread]) -> None:
    """``x-gateway-continuation: off``: the stream cut on A ends as before (error event,
    which the SDK raises on) and no continuation goes to B."""
    _, b, gw = fleet
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key="none", max_retries=0,
                           default_headers={"x-gateway-continuation": "off"})
    before = _continued(gw)
    for _ in range(TRIES):
        on_b = b.chat_requests()
        try:
            _run(client, True)
        except openai.APIError:
            break  # cut on A, not continued
    else:
        pytest.fail("no stream landed on A")
    assert b.chat_requests() == on_b  # nothing was sent to B for it
    assert _continued(gw) == before


def test_a_stream_with_no_other_backend_ends_as_before() -> None:
    """Only A serves the model: the cut stream cannot be continued (A already failed it), so
    it ends with the error event (the SDK raises), counted as ``no_backend``."""
    a = Sim("a", 0.005)
    try:
        httpx.patch(f"{a.url}/sim/faults", json={"drop_after_tokens": CUT_AT},
                    timeout=20).raise_for_status()
        gw = GatewayThread(gateway_config([{"id": "a", "url": a.url}]))
        gw.start()
        try:
            with pytest.raises(openai.APIError, match="broke mid-stream"):
                _run(sdk(gw.url), True)
            assert _continued(gw, "no_backend") == 1
            assert _continued(gw) == 0
            _assert_nothing_held(gw)
        finally:
            gw.stop()
    finally:
        a.stop()


@pytest.mark.parametrize("asked", [False, True], ids=["not-asked", "asked"])
def test_token_ids_the_gateway_asked_for_are_hidden_from_the_client(
    fleet: tuple[Sim, Sim, GatewayThread], asked: bool
) -> None:
    """The gateway asks every continuable stream for vLLM's token ids
    (``return_token_ids``); a client that did not ask gets none of them (``token_ids``,
    ``prompt_token_ids``), even on a stream continued from A to B; one that asked gets
    them, as vLLM sends them."""
    gw = fleet[2]
    body: dict[str, Any] = {"model": MODEL, "prompt": PROMPT, "max_tokens": MAX_TOKENS,
                            "temperature": 0, "stream": True, "ignore_eos": True}
    if asked:
        body["return_token_ids"] = True
    before = _continued(gw)
    for _ in range(TRIES):
        raw = httpx.post(gw.url + "/v1/completions", json=body, timeout=30).content
        assert raw.endswith(b"data: [DONE]\n\n") and b'"error"' not in raw
        assert (b'"token_ids"' in raw) is asked and (b'"prompt_token_ids"' in raw) is asked
        if _continued(gw) > before:
            break
    assert _continued(gw) == before + 1, "no stream was cut and continued"
