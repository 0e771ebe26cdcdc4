"""Scripted vLLM backends that break a stream where a test says (issue 17's continuation).

A :class:`Plan` is one request's script: the i-th data-plane request the backends get,
whichever backend the router picked, is answered with ``legs[i]`` (:class:`Leg`): its SSE
events, one HTTP chunk per event as vLLM writes them, in one write, up to byte ``cut``,
then a break: ``fin`` (the connection closed in the middle of the chunked body; a cut
inside an event is a truncated HTTP chunk), ``end`` (the body's clean end, the chunked
terminator, without ``[DONE]``), ``rst`` (TCP RST), ``hang`` (silent until the gateway
closes). The break waits until the client has read ``client_has`` bytes (:func:`send`
counts them), so a RST cannot discard bytes the gateway had not read yet. A leg without a
cut is sent whole. :func:`make_rig` starts ``n`` such backends sharing one
:class:`Script` and a gateway under uvicorn in front of them; :func:`send` runs a plan for
one streaming request with a raw HTTP client (httpx) and returns the client's exact bytes,
the requests the backends got, in order, and the continuation metric's increments.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Literal

import httpx

from tests.support.scripted import Conn, Received, ScriptedBackend, error_obj
from tests.support.servers import GatewayThread, gateway_config

WAIT_S = 20.0  # generous bound on any wait for the other side (a slow, shared machine)

Break = Literal["fin", "end", "rst", "hang"]
"""How a leg's stream breaks (module docstring)."""


@dataclass
class Leg:
    """One backend's answer: ``events`` up to byte ``cut`` then the break ``brk``, once the
    client has read ``client_has`` bytes in all (``cut`` None: all of them, then the
    body's end)."""

    events: list[bytes]
    cut: int | None = None
    brk: Break = "fin"
    client_has: int = 0


@dataclass
class Plan:
    """One test's script: the i-th data-plane request (on whichever backend) gets
    ``legs[i]``; ``client_read``: bytes the client has read so far."""

    endpoint: str
    legs: list[Leg]
    client_read: int = 0
    vocab: dict[int, bytes] | None = None
    """Each token id's bytes: ``POST /detokenize`` answers as vLLM does (``{"prompt":
    text}``, incomplete UTF-8 decoded to U+FFFD as Hugging Face tokenizers do); None: 404,
    as a backend without the route."""


class Script:
    """The data-plane script every backend of a rig runs (whichever the router picks)."""

    def __init__(self) -> None:
        self.plan: Plan | None = None
        self.calls: list[tuple[int, dict[str, Any]]] = []  # (backend, JSON body) in order
        self.detokenized: list[list[int]] = []  # the ids each /detokenize asked about

    def backend(self, i: int) -> Callable[[Received, Conn], Awaitable[None]]:
        """Backend ``i``'s script (:class:`tests.support.scripted.ScriptedBackend`'s)."""
        return functools.partial(self.answer, i)

    async def answer(self, i: int, req: Received, conn: Conn) -> None:
        """Answer a data-plane request on backend ``i`` with the plan's next leg (a 500 when
        the plan has none left: the test's assertions on the requests then fail)."""
        plan = self.plan
        assert plan is not None
        if req.path == "/detokenize":
            await self.detokenize(plan, req, conn)
            return
        self.calls.append((i, req.json()))
        if len(self.calls) > len(plan.legs):
            await conn.send_json(500, error_obj("unexpected request", 500))
            return
        leg = plan.legs[len(self.calls) - 1]
        if leg.cut is None:
            await conn.write(http_stream(leg.events, end=True))
            return
        raw = b"".join(leg.events)
        whole = events_within(leg.events, leg.cut)
        partial = raw[sum(map(len, whole)):leg.cut]
        head = http_stream(whole, end=False)
        if partial and leg.brk == "end":
            head += chunk(partial)
        elif partial:  # the kill came in the middle of writing this event's HTTP chunk
            head += f"{len(partial) + 40:x}\r\n".encode() + partial
        await conn.write(head)
        deadline = time.monotonic() + WAIT_S
        while plan.client_read < leg.client_has and time.monotonic() < deadline:
            await asyncio.sleep(0.005)
        if leg.brk == "end":
            await conn.write(b"0\r\n\r\n")
            conn.close()
        elif leg.brk == "fin":
            conn.close()
        elif leg.brk == "rst":
            conn.reset()
        else:  # "hang": silent until the gateway gives up on it and closes
            await conn.sleep(WAIT_S)
            conn.close()


    async def detokenize(self, plan: Plan, req: Received, conn: Conn) -> None:
        """vLLM's ``/detokenize`` from the plan's ``vocab``."""
        ids = req.json()["tokens"]
        self.detokenized.append(ids)
        if plan.vocab is None:
            await conn.send_json(404, {"detail": "Not Found"})
            return
        text = b"".join(plan.vocab[t] for t in ids).decode("utf-8", "replace")
        await conn.send_json(200, {"prompt": text})


def chunk(data: bytes) -> bytes:
    """One HTTP/1.1 chunk of ``data``."""
    return f"{len(data):x}\r\n".encode() + data + b"\r\n"


def http_stream(events: list[bytes], end: bool) -> bytes:
    """A 200 ``text/event-stream`` response's head and one HTTP chunk per event (as vLLM
    writes them), with the chunked terminator when ``end``: one write."""
    head = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream; charset=utf-8\r\n"
            b"transfer-encoding: chunked\r\ncache-control: no-cache\r\n\r\n")
    return head + b"".join(chunk(e) for e in events) + (b"0\r\n\r\n" if end else b"")


def events_within(events: list[bytes], cut: int) -> list[bytes]:
    """The events wholly before byte ``cut``."""
    out, at = [], 0
    for e in events:
        if at + len(e) > cut:
            break
        out.append(e)
        at += len(e)
    return out


@dataclass
class Rig:
    """Backends, their shared script and the gateway in front of them."""

    backends: list[ScriptedBackend]
    script: Script
    gw: GatewayThread


def make_rig(idle_timeout_s: float | None, n: int = 2) -> Rig:
    """``n`` started backends and a gateway in front of them (``proxy.idle_timeout_s`` as
    given; None: the default)."""
    script = Script()
    backends = [ScriptedBackend(script.backend(i)) for i in range(n)]
    for b in backends:
        b.start()
    proxy = {} if idle_timeout_s is None else {"idle_timeout_s": idle_timeout_s}
    cfg = gateway_config(
        [{"id": f"b{i}", "url": b.url} for i, b in enumerate(backends)],
        proxy=proxy,
        # every request breaks a backend's stream: no breaker may open, nor the retry
        # budget (a continuation spends one retry) run out over many tests
        breaker={"consecutive_failures": 10_000, "min_requests": 10_000},
        retry={"budget_ratio": 1.0, "budget_min_per_s": 1_000.0},
    )
    gw = GatewayThread(cfg)
    gw.start()
    gw.wait_ready(routable=n)
    return Rig(backends, script, gw)


def stop_rig(rig: Rig) -> None:
    """Stop the gateway, then the backends."""
    rig.gw.stop()
    for b in rig.backends:
        b.stop()


@dataclass
class Result:
    """What one request did: the client's bytes, the data-plane requests the backends got
    (backend, JSON body) in order, and the continuation metric's increments."""

    raw: bytes
    calls: list[tuple[int, dict[str, Any]]]
    continuations: dict[tuple[str, str], float]
    detokenized: list[list[int]]

    @property
    def bodies(self) -> list[dict[str, Any]]:
        return [body for _, body in self.calls]

    @property
    def backends(self) -> list[int]:
        return [i for i, _ in self.calls]


def continuations(gw: GatewayThread) -> dict[tuple[str, str], float]:
    """``gateway_stream_continuations_total`` by ``(reason, outcome)``."""
    return {(s.labels["reason"], s.labels["outcome"]): s.value
            for m in gw.gateway.metrics.stream_continuations.collect() for s in m.samples
            if s.name.endswith("_total")}


def send(rig: Rig, plan: Plan, body: dict[str, Any],
         headers: dict[str, str] | None = None) -> Result:
    """Run ``plan`` for one streaming request of ``body`` (module docstring)."""
    rig.script.calls = []
    rig.script.detokenized = []
    rig.script.plan = plan
    before = continuations(rig.gw)
    got = b""
    with httpx.stream("POST", rig.gw.url + plan.endpoint, json=body, headers=headers,
                      timeout=WAIT_S) as r:
        assert r.status_code == 200, r.read()
        for piece in r.iter_raw():
            got += piece
            plan.client_read = len(got)
    after = continuations(rig.gw)
    delta = {k: v - before.get(k, 0.0) for k, v in after.items() if v != before.get(k, 0.0)}
    return Result(got, list(rig.script.calls), delta, list(rig.script.detokenized))
