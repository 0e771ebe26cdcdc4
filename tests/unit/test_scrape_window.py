"""The load sample is stamped with the gateway's in-flight count of the instant vLLM
rendered its gauges, as well as the gateway can know it: the highest count between sending
the scrape and reading the answer (real ``scrape_load`` over an httpx transport that runs
the gateway's bookkeeping while the answer is on its way)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import httpx
import pytest

from gateway.config import BackendConfig, RoutingWeights
from gateway.fleet.backend import Backend
from gateway.fleet.telemetry import scrape_load
from gateway.routing.policy import estimated_load, score

METRICS = (
    "vllm:num_requests_waiting{model_name=\"m1\"} 1\n"
    "vllm:num_requests_running{model_name=\"m1\"} 0\n"
    "vllm:kv_cache_usage_perc{model_name=\"m1\"} 0.0\n"
)


def scrape(backend: Backend, meanwhile: Callable[[Backend], None],
           metrics: str = METRICS) -> float:
    """Scrape ``backend`` through real :func:`scrape_load`; ``meanwhile`` runs after vLLM
    rendered ``metrics`` and before the answer is read. Returns its score then."""

    async def handler(request: httpx.Request) -> httpx.Response:
        meanwhile(backend)  # vLLM has rendered; the gateway's requests move on
        return httpx.Response(200, text=metrics)

    async def go() -> None:
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            backend.load = await scrape_load(client, backend, None, lambda: 100.0)

    asyncio.run(go())
    return score(backend, RoutingWeights(), 100.0, 5.0)


def make() -> Backend:
    return Backend(BackendConfig(id="b", url="http://b.invalid:8000"))


def test_a_request_that_ended_while_the_scrape_answer_travelled_is_not_load() -> None:
    b = make()
    b.take(1, 0)  # queued on vLLM when it renders "waiting 1"

    def ends(x: Backend) -> None:
        x.give_back(1, 0)

    assert scrape(b, ends) == 0.0
    assert b.load is not None and b.load.in_flight_at_scrape == 1
    assert estimated_load(b, 100.0, 5.0) == (0.0, 0.0, 0.0)


def test_a_request_sent_while_the_scrape_answer_travelled_still_counts() -> None:
    b = make()
    b.take(1, 0)

    def another(x: Backend) -> None:
        x.take(1, 0)

    scrape(b, another)
    waiting, running, _ = estimated_load(b, 100.0, 5.0)
    assert waiting + running == 2.0  # never below the gateway's own in flight


def test_pooled_embeddings_that_ended_meanwhile_are_not_load() -> None:
    b = make()
    b.take(1, 7)  # one merged request of 8 inputs: vLLM counts 8 engine requests

    def ends(x: Backend) -> None:
        x.give_back(1, 7)

    scrape(b, ends, METRICS.replace('waiting{model_name="m1"} 1', 'waiting{model_name="m1"} 8'))
    assert b.load is not None and b.load.waiting == 8
    assert estimated_load(b, 100.0, 5.0)[:2] == (0.0, 0.0)


def test_over_real_http_the_window_closes_when_the_answer_headers_are_read() -> None:
    """Over a real socket (httpx ``trace`` events), what happens after the answer's headers
    were read, while its body is read, is outside the window: vLLM rendered before. A
    request of the gateway's that starts then and one that ends then leave the stamp at 1,
    and the 4 requests others queued there still read as 4 (with the window over the whole
    call, the peak of 2 took one of them off)."""
    from tests.support.scripted import Conn, Received, ScriptedBackend

    async def control(req: Received, conn: Conn) -> None:
        await conn.send_response(200, METRICS.replace('waiting{model_name="m1"} 1',
                                                      'waiting{model_name="m1"} 5').encode(),
                                 {"content-type": "text/plain"})

    server = ScriptedBackend(control=control)
    b = Backend(BackendConfig(id="b", url=server.start()))
    try:
        b.take(1, 0)  # rendered as one of the 5 waiting

        async def headers_read(response: httpx.Response) -> None:
            if response.request.url.path == "/metrics":
                b.take(1, 0)  # a new request ...
                b.give_back(1, 0)  # ... and the first one ends

        async def go() -> None:
            async with httpx.AsyncClient(event_hooks={"response": [headers_read]}) as client:
                b.load = await scrape_load(client, b, None, lambda: 100.0, timeout_s=5.0)

        asyncio.run(go())
    finally:
        server.stop()
    assert b.load is not None and b.load.in_flight_at_scrape == 1
    assert estimated_load(b, 100.0, 5.0)[:2] == (5.0, 0.0)


def test_the_scrape_timeout_bounds_a_silent_metrics_endpoint() -> None:
    """``telemetry.scrape_timeout_s`` is the scrape's limit: a ``/metrics`` that never
    answers raises a timeout after it, not after the control client's own limit."""
    import time

    from tests.support.scripted import Conn, Received, ScriptedBackend

    async def silent(req: Received, conn: Conn) -> None:
        await conn.sleep(30)

    server = ScriptedBackend(control=silent)
    b = Backend(BackendConfig(id="b", url=server.start()))

    async def go() -> None:
        async with httpx.AsyncClient(timeout=30) as client:
            await scrape_load(client, b, None, lambda: 100.0, timeout_s=0.3)

    started = time.monotonic()
    try:
        with pytest.raises(httpx.TimeoutException):
            asyncio.run(go())
    finally:
        server.stop()
    assert time.monotonic() - started < 10
