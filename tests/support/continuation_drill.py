"""The kill drill of issue 17's real-vLLM must-hold, shared by
``tests/realvllm/test_continuation_real_vllm.py`` and ``benchmarks/real_vllm.py
continuation``: streaming chat and completions requests at temperature 0 through the
gateway, one backend SIGKILLed while every stream is mid-generation, each stream read to
its end with the real ``openai`` SDK (``AsyncOpenAI``) and compared with the same request
answered by an uninterrupted server.

What the client got is seen twice: as the SDK parses it (text, chunk ids, finish reasons,
usage; an error event raises ``openai.APIError``) and as raw bytes, recorded by
:class:`TapTransport` (the SDK's own HTTP transport, the bytes teed on their way to the SDK: the
SDK hides ``data: [DONE]`` and stops reading there). The SDK's HTTP library is ``httpx2``
(openai 3's fork of httpx; httpx for older SDKs), so the tap is one of its transports. The
verdicts (whole, usage, text, the vLLM prompt leak) are in
``tests/support/continuation_check.py``.
"""

from __future__ import annotations

import asyncio
import json
import random
import signal
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import openai

try:  # the openai SDK's HTTP library: httpx2 (openai 3), httpx before
    import httpx2
except ImportError:  # pragma: no cover - an older openai
    import httpx as httpx2  # type: ignore[no-redef]

from tests.support.vllm import VllmServer

MODEL = "tiny-llama"
VOCAB = (4, 2048)  # the tiny model's token ids, without its 4 special tokens
TAG = "x-drill-stream"  # request header naming the stream, read back by the tap
WORDS = ("lighthouse", "river", "engine", "garden", "winter", "copper", "signal", "harbour",
         "meadow", "lantern", "orbit", "violin", "granite", "compass", "feather", "tunnel")


@dataclass(frozen=True)
class DrillRequest:
    """One streaming request: ``kind`` ``chat`` or ``completions``; ``key`` names it (the
    same request sent to the reference server and through the gateway)."""

    kind: str
    key: str
    prompt: str | list[int]
    max_tokens: int
    seed: int

    def sdk_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of ``chat.completions.create`` / ``completions.create``:
        temperature 0, ``seed``, ``ignore_eos`` (exactly ``max_tokens`` tokens), usage, and
        vLLM's token ids (``return_token_ids``: the client asks for them, so the gateway
        relays them, and the tokens received are counted by id)."""
        kw: dict[str, Any] = {
            "model": MODEL, "max_tokens": self.max_tokens, "temperature": 0, "seed": self.seed,
            "stream": True, "stream_options": {"include_usage": True},
            "extra_body": {"ignore_eos": True, "return_token_ids": True},
            "extra_headers": {TAG: self.key},
        }
        if self.kind == "chat":
            kw["messages"] = [{"role": "user", "content": self.prompt}]
        else:
            kw["prompt"] = self.prompt
        return kw


def make_requests(chat: int, completions: int, max_tokens: int, seed: int = 0
                  ) -> list[DrillRequest]:
    """``chat`` + ``completions`` requests with distinct prompts drawn with
    ``random.Random(seed)``, each its own ``seed``: chat, a sentence of a few words;
    completions, a few words (no final period: the tiny random model's next token depends
    mostly on the last one, so the answers differ), every other one sent as a list of
    random token ids (vLLM's token-id prompt)."""
    rng = random.Random(seed)
    out = []
    for i in range(chat):
        words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 9)))
        out.append(DrillRequest("chat", f"chat-{i}", f"Tell me about the {words}.",
                                max_tokens, seed * 1000 + i))
    for i in range(completions):
        prompt: str | list[int] = (
            " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 9))) if i % 2 == 0
            else [rng.randrange(*VOCAB) for _ in range(rng.randint(8, 48))])
        out.append(DrillRequest("completions", f"completions-{i}", prompt, max_tokens,
                                seed * 1000 + chat + i))
    return out


@dataclass
class StreamResult:
    """What one stream's client got. ``tokens``: completion tokens seen so far (a chunk's
    ``token_ids`` when present, else one per chunk with text), live while it runs."""

    request: DrillRequest
    text: str = ""
    ids: set[str] = field(default_factory=set)
    finishes: list[str] = field(default_factory=list)
    usages: list[dict[str, Any]] = field(default_factory=list)
    token_ids: list[int] | None = None
    tokens: int = 0
    error: str | None = None
    raw: bytes = b""
    prompt_ids: list[int] | None = None
    first_at: float | None = None  # monotonic time of the first token seen
    done_at: float | None = None  # monotonic time the stream ended

    @property
    def finished(self) -> bool:
        """A ``finish_reason`` (or an error) was seen."""
        return bool(self.finishes) or self.error is not None

    def events(self) -> list[str]:
        """The ``data`` of every raw SSE event, in order."""
        out = []
        for event in self.raw.replace(b"\r\n", b"\n").split(b"\n\n"):
            data = [ln[5:].strip() for ln in event.split(b"\n") if ln.startswith(b"data:")]
            if data:
                out.append(b"\n".join(data).decode("utf-8", "replace"))
        return out

    def ends_with_done(self) -> bool:
        """The last raw event is ``[DONE]``, and the only one."""
        ev = self.events()
        return bool(ev) and ev[-1] == "[DONE]" and ev.count("[DONE]") == 1

    def error_events(self) -> list[str]:
        """Raw events that carry an ``error`` object (an in-band error)."""
        out = []
        for data in self.events():
            if data == "[DONE]":
                continue
            try:
                obj = json.loads(data)
            except ValueError:
                out.append(data)
                continue
            if isinstance(obj, dict) and "error" in obj:
                out.append(data)
        return out


class TapTransport(httpx2.AsyncBaseTransport):
    """httpx2's transport (the SDK's HTTP library), with each response body teed into
    ``taps[key]`` (``key``: the request's ``x-drill-stream`` header) as the SDK reads it."""

    def __init__(self) -> None:
        self.inner = httpx2.AsyncHTTPTransport()
        self.taps: dict[str, bytearray] = {}

    async def handle_async_request(self, request: httpx2.Request) -> httpx2.Response:
        resp = await self.inner.handle_async_request(request)
        key = request.headers.get(TAG)
        if key is None:
            return resp
        tap = self.taps.setdefault(key, bytearray())
        inner = resp.stream

        async def teed() -> AsyncIterator[bytes]:
            async for chunk in inner:  # type: ignore[union-attr]
                tap.extend(chunk)
                yield chunk

        class Teed(httpx2.AsyncByteStream):
            async def __aiter__(self) -> AsyncIterator[bytes]:
                async for c in teed():
                    yield c

            async def aclose(self) -> None:
                await inner.aclose()  # type: ignore[union-attr]

        return httpx2.Response(resp.status_code, headers=resp.headers, stream=Teed(),
                              extensions=resp.extensions, request=request)

    async def aclose(self) -> None:
        await self.inner.aclose()


async def _read(client: openai.AsyncOpenAI, r: StreamResult) -> None:
    req = r.request
    try:
        if req.kind == "chat":
            stream: Any = await client.chat.completions.create(**req.sdk_kwargs())
        else:
            stream = await client.completions.create(**req.sdk_kwargs())
        async for chunk in stream:
            r.ids.add(chunk.id)
            if chunk.usage is not None:
                r.usages.append(chunk.usage.model_dump(exclude_none=True))
            for ch in chunk.choices:
                text = (ch.delta.content if req.kind == "chat" else ch.text) or ""
                ids = (ch.model_extra or {}).get("token_ids")
                if isinstance(ids, list):
                    r.token_ids = (r.token_ids or []) + ids
                    r.tokens += len(ids)
                elif text:
                    r.tokens += 1
                r.text += text
                if r.first_at is None and r.tokens:
                    r.first_at = time.monotonic()
                pids = (ch.model_extra or {}).get("prompt_token_ids") or (
                    chunk.model_extra or {}).get("prompt_token_ids")
                if isinstance(pids, list) and r.prompt_ids is None:
                    r.prompt_ids = pids
                if ch.finish_reason is not None:
                    r.finishes.append(ch.finish_reason)
    except openai.APIError as e:  # an error event, or the connection broke
        r.error = f"{type(e).__name__}: {e}"
    finally:
        r.done_at = time.monotonic()


GATE: list[Any] = []
"""The last gate: [whether ``ready`` held (else its timeout), seconds until then]."""
LAST_MISSED: list[tuple[str, int, bool]] = []
"""Diagnosis of the last :func:`run_streams` whose ``when`` never held."""


async def run_streams(
    base_url: str,
    requests: list[DrillRequest],
    *,
    when: Callable[[list[StreamResult]], bool] | None = None,
    then: Callable[[], None] | None = None,
    gate: Gate | None = None,
    freeze: Gate | None = None,
    timeout_s: float = 120.0,
) -> tuple[list[StreamResult], float | None]:
    """Send every request at once to ``base_url`` (``/v1`` appended) and read each stream
    to its end. When ``when`` and ``then`` are given, ``then()`` is called (once) as soon as
    ``when(results)`` holds (polled every 5 ms; not once a stream has finished); returns
    the results and the monotonic time of that call (None when it never came: then
    :data:`LAST_MISSED` holds each stream's tokens and whether it had finished when the
    first one finished).

    ``gate``: held while the requests are sent (:class:`Gate`; e.g. the backend's engine
    stopped, then continued once every request is in its queue, so that all start
    generating in the same step).

    ``freeze``: when ``when`` first holds, ``freeze.hold()`` stops the backend's engine,
    and ``when`` is asked again after ``freeze.grace_s`` (what the engine had produced has
    reached the clients by then): ``then()`` is called only if it still holds, with the
    engine still stopped, so nothing can finish between the check and ``then()`` (on a
    loaded machine the clients and the gateway lag behind the backend, and a check of
    them alone races its last tokens); otherwise ``freeze.release()`` lets the batch
    finish, and ``then()`` is never called."""
    tap = TapTransport()
    results = [StreamResult(r) for r in requests]
    called: float | None = None
    async with httpx2.AsyncClient(transport=tap, timeout=timeout_s) as http:
        client = openai.AsyncOpenAI(base_url=base_url + "/v1", api_key="none",
                                    max_retries=0, http_client=http)
        if gate is not None:
            gate.hold()
        tasks = [asyncio.create_task(_read(client, r)) for r in results]
        try:
            if gate is not None:
                start = time.monotonic()
                try:
                    while (not gate.ready(len(results))
                           and time.monotonic() - start < gate.timeout_s):
                        await asyncio.sleep(0.01)
                    GATE[:] = [gate.ready(len(results)), round(time.monotonic() - start, 3)]
                    await asyncio.sleep(gate.grace_s)
                finally:
                    gate.release()
            if when is not None and then is not None:
                deadline = time.monotonic() + timeout_s
                while time.monotonic() < deadline:
                    if when(results):
                        if freeze is not None:
                            freeze.hold()
                            await asyncio.sleep(freeze.grace_s)
                            if not when(results):
                                freeze.release()
                                LAST_MISSED[:] = [(r.request.key, r.tokens, r.finished)
                                                  for r in results]
                                break
                        then()
                        called = time.monotonic()
                        break
                    if any(r.finished for r in results):
                        LAST_MISSED[:] = [(r.request.key, r.tokens, r.finished)
                                          for r in results]
                        break
                    await asyncio.sleep(0.005)
            await asyncio.wait_for(asyncio.gather(*tasks), timeout_s)
        finally:
            for t in tasks:
                t.cancel()
    for r in results:
        r.raw = bytes(tap.taps.get(r.request.key, b""))
    return results, called


async def kill_drill(
    base_url: str,
    requests: list[DrillRequest],
    kill: Callable[[], None],
    min_tokens: int,
    tries: int = 3,
    gate: Gate | None = None,
    upstream_open: Callable[[], int] | None = None,
    freeze: Gate | None = None,
) -> tuple[list[StreamResult], float | None, int]:
    """:func:`run_streams` with ``kill`` called once every stream has ``min_tokens`` tokens
    and none has finished, and (``upstream_open``: the gateway's requests still open to the
    server to be killed) the gateway still has every one of them open: a client that has
    not seen a stream's end yet may lag behind a server that finished it (a loaded machine),
    and a kill then interrupts nothing. When a stream finished before the last one had
    started (the streams' starts are spread by the machine's load, and nothing was
    killed), the whole batch is sent again, at most ``tries`` times. ``gate``: as
    :func:`run_streams`'s. Returns the last results, the kill's monotonic time (None: never
    killed) and the batches that missed it. ``freeze``: as :func:`run_streams`'s (the
    server to be killed stopped while the condition is checked a last time:
    :func:`engine_freeze`)."""
    missed = 0
    started = all_started_none_finished(min_tokens)

    def when(results: list[StreamResult]) -> bool:
        return started(results) and (upstream_open is None
                                     or upstream_open() >= len(requests))

    while True:
        results, killed = await run_streams(
            base_url, requests, when=when, then=kill, gate=gate, freeze=freeze)
        if killed is not None or missed + 1 >= tries:
            return results, killed, missed
        missed += 1


@dataclass
class Gate:
    """Held while a batch of requests is sent (:func:`run_streams`): ``hold()`` before the
    first is sent, ``release()`` once ``ready(n)`` says the ``n`` requests arrived (polled
    every 10 ms), after ``grace_s`` more, or after ``timeout_s`` in all."""

    hold: Callable[[], None]
    release: Callable[[], None]
    ready: Callable[[int], bool]
    grace_s: float = 1.0
    timeout_s: float = 10.0


def engine_gate(server: VllmServer, in_flight: Callable[[], int]) -> Gate:
    """A :class:`Gate` that stops ``server``'s engine core (SIGSTOP; its API server keeps
    taking requests and queues them) until ``in_flight()`` (the gateway's requests sent to
    it) has grown by the batch, then continues it (SIGCONT): every request then starts in
    the same engine step (or the next). ``server`` must run with ``fast=False`` (an
    engine-core process of its own)."""
    base = [0]

    def hold() -> None:
        base[0] = in_flight()
        if server.signal_engine(signal.SIGSTOP) < 1:
            raise RuntimeError(f"{server!r} has no engine-core process (fast=True?)")

    def release() -> None:
        server.signal_engine(signal.SIGCONT)

    return Gate(hold, release, lambda n: in_flight() - base[0] >= n)


def engine_freeze(server: VllmServer, settle_s: float = 0.5) -> Gate:
    """A :class:`Gate` for :func:`run_streams`'s ``freeze``: ``hold()`` stops ``server``'s
    engine core (SIGSTOP; no token is generated after it), ``release()`` continues it;
    ``grace_s`` = ``settle_s``, the time given to what it had produced to reach the
    clients. ``server`` must run with ``fast=False``."""
    def hold() -> None:
        if server.signal_engine(signal.SIGSTOP) < 1:
            raise RuntimeError(f"{server!r} has no engine-core process (fast=True?)")

    return Gate(hold, lambda: server.signal_engine(signal.SIGCONT), lambda n: True,
                grace_s=settle_s)


def all_started_none_finished(min_tokens: int) -> Callable[[list[StreamResult]], bool]:
    """The kill condition: every stream has at least ``min_tokens`` tokens and none has a
    ``finish_reason`` yet."""
    def check(results: list[StreamResult]) -> bool:
        return all(r.tokens >= min_tokens and not r.finished for r in results)
    return check
