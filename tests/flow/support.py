"""In-process harness for the request flow: the gateway's own components built by
:func:`gateway.wiring.build_gateway` with a scripted transport, called through the real
ASGI entry (:func:`gateway.api.openai.serve`), no sockets and no sleeps."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from gateway.api.openai import serve
from gateway.config import load_config
from gateway.core.vocab import BackendState
from gateway.fleet import lifecycle
from gateway.proxy.upstream import Target, UpstreamRequest
from gateway.wiring import Gateway, build_gateway
from tests.support.transport import Handler, ScriptedResponse, ScriptedTransport

MODEL = "m"


def make_gateway(
    handler: Handler, backends: int = 1, backend: dict[str, Any] | None = None, **sections: Any
) -> Gateway:
    """A gateway over ``backends`` warm backends serving :data:`MODEL` (``backend``: more
    fields of each backend's config), with config ``sections``."""
    cfg = load_config(
        None,
        backends=[
            {"id": f"b{i}", "url": f"http://b{i}.invalid", "models": [MODEL], **(backend or {})}
            for i in range(backends)
        ],
        **sections,
    )
    gw = build_gateway(cfg, ScriptedTransport(handler))
    for b in gw.fleet:
        lifecycle.apply_transition(b, BackendState.WARMING, "test", 0.0)
        lifecycle.apply_transition(b, BackendState.WARM, "test", 0.0)
    return gw


@dataclass
class Call:
    """One in-process request: what was sent back, and its controls."""

    status: int | None = None
    headers: dict[str, str] = field(default_factory=dict)
    body: bytearray = field(default_factory=bytearray)
    complete: asyncio.Event = field(default_factory=asyncio.Event)
    started: asyncio.Event = field(default_factory=asyncio.Event)
    hang_up: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task[None] | None = None

    def json(self) -> Any:
        return json.loads(bytes(self.body))


def start(
    gw: Gateway,
    payload: dict[str, Any],
    path: str = "/v1/chat/completions",
    headers: Iterable[tuple[bytes, bytes]] = (),
) -> Call:
    """Start one request as a task; :attr:`Call.hang_up` makes its client disconnect."""
    call = Call()
    body = json.dumps(payload).encode()
    sent_body = [False]

    async def receive() -> dict[str, Any]:
        if not sent_body[0]:
            sent_body[0] = True
            return {"type": "http.request", "body": body, "more_body": False}
        await call.hang_up.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            call.status = message["status"]
            call.headers = {
                k.decode("latin-1"): v.decode("latin-1") for k, v in message["headers"]
            }
            call.started.set()
        elif message["type"] == "http.response.body":
            call.body += message.get("body", b"")
            if not message.get("more_body", False):
                call.complete.set()

    scope = {
        "type": "http",
        "method": "POST",
        "path": path,
        "query_string": b"",
        "headers": [(b"content-type", b"application/json"), *headers],
        "client": ("127.0.0.1", 5000),
    }
    call.task = asyncio.get_running_loop().create_task(serve(gw, scope, receive, send))
    return call


async def settle(rounds: int = 20) -> None:
    """Let the loop run what is ready (callbacks scheduled with call_soon)."""
    for _ in range(rounds):
        await asyncio.sleep(0)


def assert_nothing_held(gw: Gateway) -> None:
    """Every hold of every request is given back: backend slots and counts (the prefill
    load too), watchdog handles, breaker half-open slots, admission tickets, batcher
    reservations and merge windows, and every upstream response released or closed."""
    for b in gw.fleet:
        assert (b.in_flight, b.pooled_extra) == (0, 0), f"{b.id} in flight"
        assert not b.active, f"{b.id}: drain handles left"
        assert not b.awaiting, f"{b.id}: hung-watchdog handles left"
        assert b.prefill_load == 0, f"{b.id}: {b.prefill_load} left before a first token"
        assert b.breaker.half_open_in_flight == 0, f"{b.id}: half-open slot held"
    assert gw.gate.scheduler.in_flight == 0, "admission ticket not released"
    if gw.batching is not None:
        assert gw.batching.pending == {}, "batcher reservation left"
        assert gw.batching.merge_flight == {}, "merge-window place left"
    transport = gw.transport
    assert isinstance(transport, ScriptedTransport)
    assert all(r.settled for r in transport.responses), "an upstream response leaked"


CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
EVENT = b'data: {"choices":[{"index":0,"delta":{"content":"a"}}]}\n\n'


def run(coro: Any) -> Any:
    """Run one test's event loop."""
    return asyncio.run(coro)


def sse() -> ScriptedResponse:
    """An event-stream answer whose body the test feeds."""
    return ScriptedResponse(200, "text/event-stream")


class Streams(list[ScriptedResponse]):
    """A handler answering every request with a stream that has sent its first event; the
    streams it opened, in order, for the test to end (:func:`end_stream`) when it likes."""

    async def __call__(self, t: Target, req: UpstreamRequest) -> ScriptedResponse:
        r = sse()
        r.feed(EVENT)
        self.append(r)
        return r


def end_stream(r: ScriptedResponse) -> None:
    """The backend finishes ``r``: ``[DONE]``, then the body's end."""
    r.feed(b"data: [DONE]\n\n")
    r.end()
