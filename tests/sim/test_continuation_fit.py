"""The two halves of mid-stream continuation (issue 17) fit: the pure side
(:mod:`gateway.proxy.transcript`, :mod:`gateway.proxy.continuation`,
:mod:`gateway.proxy.stitch`) driven by real simulated vLLM servers over HTTP.

No gateway yet: this file plays the relay's part by hand, as the continuation module's
docstring describes it. Server A streams a chat / completions request (``return_token_ids``
added by :func:`with_token_ids`, ``include_usage``, temperature 0) and is cut by its
``drop_after_tokens`` fault (or ``drop_after_chunks`` for the cut after the usage chunk);
its bytes go through :class:`EventFramer` (only complete events reach the client) into the
client's bytes and a :class:`StreamTranscript`. At the cut, :func:`continuable` judges;
``ok``: :func:`continuation_body` goes to server B, whose bytes go through a fresh framer and
a :class:`Stitcher` to the client (and back into the transcript); ``closes``:
:func:`closing_events` ends the stream. The client's stream must equal an uninterrupted
server's: the same text and token ids, one ``finish_reason`` (the same), one usage with the
original prompt tokens and the uninterrupted completion tokens, one ``[DONE]``, no error
event, one ``id`` / ``created`` / ``model`` / ``system_fingerprint`` throughout.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest

from gateway.proxy.continuation import (
    CHAT,
    COMPLETIONS,
    StreamTranscript,
    continuable,
    continuation_body,
    with_token_ids,
)
from gateway.proxy.sse import EventFramer
from gateway.proxy.stitch import Stitcher, closing_events
from gateway.sim import EngineParams, SimConfig, SimServerThread

MODEL = "sim-model"
MAX_TOKENS = 40


def _server(label: str, seed: int) -> SimServerThread:
    # Natural stops (EOS included) fall within 12-30 tokens: below MAX_TOKENS ("stop").
    # Each server its own engine label, so its system_fingerprint differs from its peers',
    # and its own seed, as gateway/demo_fleet.yaml and benchmarks/lifecycle_drill.py run them.
    return SimServerThread(
        SimConfig(model=MODEL, seed=seed, stop_length_min=12, stop_length_max=30,
                  engine_label=label, engine=EngineParams(speed=20.0))
    )


@pytest.fixture(scope="module")
def servers() -> Iterator[list[SimServerThread]]:
    """Servers A, B and C of one model."""
    sims = [_server(x, seed) for x, seed in (("a", 1), ("b", 2), ("c", 3))]
    for s in sims:
        s.start()
    yield sims
    for s in sims:
        s.stop()


@pytest.fixture(autouse=True)
def no_faults(servers: list[SimServerThread]) -> Iterator[None]:
    """Every server starts and ends each test without faults."""
    yield
    for s in servers:
        httpx.put(f"{s.url}/sim/faults", json={}, timeout=20).raise_for_status()


def _request(endpoint: str, max_tokens: int = MAX_TOKENS, **extra: Any) -> dict[str, Any]:
    """The client's request (temperature 0, a ``seed`` the continuation keeps); the gateway
    sends :func:`with_token_ids` of it."""
    body: dict[str, Any] = {
        "model": MODEL, "max_tokens": max_tokens, "temperature": 0, "seed": 11,
        "stream": True, "stream_options": {"include_usage": True}, **extra,
    }
    if endpoint == CHAT:
        body["messages"] = [{"role": "user", "content": "tell me about the gateway"}]
    else:
        body["prompt"] = "the story of a stream"
    return with_token_ids(endpoint, body)


def _post(url: str, endpoint: str, body: dict[str, Any]) -> tuple[list[bytes], bool]:
    """The raw body parts a server sent, and whether the connection was cut before its end."""
    parts: list[bytes] = []
    try:
        with httpx.stream("POST", url + endpoint, json=body, timeout=30) as resp:
            assert resp.status_code == 200, resp.read()
            for part in resp.iter_raw():
                parts.append(part)
    except httpx.HTTPError:  # the connection cut: no chunked terminator
        return parts, True
    return parts, False


def _fault(server: SimServerThread, **faults: int) -> None:
    httpx.patch(f"{server.url}/sim/faults", json=faults, timeout=20).raise_for_status()


@dataclass
class Relay:
    """The relay's part, by hand: what one client's stream got, attempt after attempt."""

    endpoint: str
    request: dict[str, Any]
    transcript: StreamTranscript = field(init=False)
    client: bytes = b""
    cuts: int = 0  # attempts whose stream broke
    continuations: int = 0  # continuation requests sent
    closed_by: str | None = None  # the closing verdict's reason, if the stream was closed

    def __post_init__(self) -> None:
        self.transcript = StreamTranscript(self.endpoint)

    def run(self, servers: list[SimServerThread]) -> None:
        """Stream on ``servers[0]``; on each cut judge, and continue on the next server."""
        t = self.transcript
        stitcher: Stitcher | None = None
        body = self.request
        for n, server in enumerate(servers):
            if n:
                verdict = continuable(self.endpoint, self.request, t, used=n - 1)
                if verdict.closes:
                    self.closed_by = verdict.reason
                    self._send(closing_events(self.endpoint, self.request, t, verdict))
                    return
                assert verdict.ok, verdict
                body = continuation_body(self.endpoint, self.request, t)
                stitcher = Stitcher(self.endpoint, self.request, t)
                self.continuations += 1
            parts, cut = _post(server.url or "", self.endpoint, body)
            framer = EventFramer()
            for part in parts:
                out = framer.feed(part)
                self._send(stitcher.feed(out) if stitcher is not None else out)
            if not cut:
                tail = framer.finish()
                self._send(stitcher.feed(tail) if stitcher is not None else tail)
                return
            self.cuts += 1  # the held incomplete tail never reaches the client
        raise AssertionError("every server cut the stream")

    def _send(self, block: bytes) -> None:
        self.client += block
        self.transcript.feed(block)


@dataclass
class Seen:
    """A client's view of one stream (parsed from its bytes)."""

    chunks: list[dict[str, Any]]
    dones: int
    text: str
    token_ids: list[int]
    finishes: list[str]
    usages: list[dict[str, Any]]


def _seen(endpoint: str, raw: bytes) -> Seen:
    assert b"\r" not in raw
    events = [e for e in raw.split(b"\n\n") if e]
    assert raw.endswith(b"\n\n")
    chunks: list[dict[str, Any]] = []
    dones = 0
    for e in events:
        assert e.startswith(b"data: "), e
        data = e[6:]
        if data == b"[DONE]":
            dones += 1
            continue
        assert dones == 0, "an event after [DONE]"
        obj = json.loads(data)
        assert "error" not in obj, obj
        chunks.append(obj)
    text = ""
    ids: list[int] = []
    finishes: list[str] = []
    for c in chunks:
        for ch in c["choices"]:
            assert ch["index"] == 0
            text += (ch["delta"].get("content") if endpoint == CHAT else ch["text"]) or ""
            ids += ch.get("token_ids") or []
            if ch["finish_reason"] is not None:
                finishes.append(ch["finish_reason"])
    usages = [c["usage"] for c in chunks if c.get("usage") is not None]
    return Seen(chunks, dones, text, ids, finishes, usages)


def _whole(server: SimServerThread, endpoint: str, request: dict[str, Any]) -> Seen:
    """The same request's stream from an uninterrupted server."""
    parts, cut = _post(server.url or "", endpoint, request)
    assert not cut
    return _seen(endpoint, b"".join(parts))


def _check(endpoint: str, relay: Relay, whole: Seen) -> Seen:
    """The client's stream equals the uninterrupted one in everything the issue names."""
    got = _seen(endpoint, relay.client)
    assert got.dones == 1
    assert got.text == whole.text
    assert got.token_ids == whole.token_ids
    assert got.finishes == whole.finishes and len(got.finishes) == 1
    assert len(got.usages) == len(whole.usages) and got.chunks[-1]["choices"] == []
    assert got.usages[-1] == whole.usages[-1]  # prompt tokens once, completion tokens summed
    first = got.chunks[0]
    for c in got.chunks:
        assert (c["id"], c["created"], c["model"], c["object"]) == (
            first["id"], first["created"], first["model"], first["object"])
    fps = {c["system_fingerprint"] for c in got.chunks if c.get("system_fingerprint")}
    assert len(fps) <= 1
    if endpoint == CHAT:
        roles = [ch["delta"]["role"] for c in got.chunks for ch in c["choices"]
                 if "role" in ch["delta"]]
        assert roles == ["assistant"]
    # Event for event the uninterrupted stream (the original prompt's ids once, no second
    # role chunk, no extra or missing event), but for the stream's own id, created and
    # fingerprint.
    assert [_anonymous(c) for c in got.chunks] == [_anonymous(c) for c in whole.chunks]
    return got


def _anonymous(chunk: dict[str, Any]) -> dict[str, Any]:
    """A chunk without what differs between two servers' runs of one request. The
    fingerprint is left out too: with ``include_usage`` vLLM sends it only on the usage
    chunk, so a stream closed after a cut (:func:`closing_events`) has none to repeat."""
    return {k: (None if k in ("id", "created") else v)
            for k, v in chunk.items() if k != "system_fingerprint"}


ENDPOINTS = [CHAT, COMPLETIONS]
CUTS = ["first", "middle", "last_content", "finish", "usage"]


@pytest.mark.parametrize("endpoint", ENDPOINTS)
@pytest.mark.parametrize("where", CUTS)
def test_a_stream_cut_at_each_token_continues_on_another_server_exactly(
    servers: list[SimServerThread], endpoint: str, where: str
) -> None:
    a, b, _ = servers
    request = _request(endpoint)
    whole = _whole(b, endpoint, request)
    tokens = len(whole.token_ids)  # generated tokens, the EOS of the "stop" included
    assert whole.finishes == ["stop"] and whole.usages[0]["completion_tokens"] == tokens
    assert tokens >= 4
    if where == "usage":  # cut after the usage chunk, before [DONE]
        events = len(whole.chunks)
        _fault(a, drop_after_chunks=events)
    else:
        n = {"first": 1, "middle": tokens // 2, "last_content": tokens - 1,
             "finish": tokens}[where]
        _fault(a, drop_after_tokens=n)
    relay = Relay(endpoint, request)
    relay.run([a, b])
    assert relay.cuts == 1
    if where in ("finish", "usage"):  # the generation was over: the stream is closed
        assert relay.continuations == 0 and relay.closed_by == "finished"
    else:
        assert relay.continuations == 1 and relay.closed_by is None
    _check(endpoint, relay, whole)


@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_a_stream_cut_twice_finishes_on_a_third_server(
    servers: list[SimServerThread], endpoint: str
) -> None:
    a, b, c = servers
    request = _request(endpoint)
    whole = _whole(c, endpoint, request)
    tokens = len(whole.token_ids)
    _fault(a, drop_after_tokens=3)  # A: tokens 1-3
    _fault(b, drop_after_tokens=tokens // 2 - 3)  # B: its first half less A's share
    relay = Relay(endpoint, request)
    relay.run([a, b, c])
    assert (relay.cuts, relay.continuations) == (2, 2)
    _check(endpoint, relay, whole)


@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_a_stream_cut_by_length_continues_with_the_rest_of_its_budget(
    servers: list[SimServerThread], endpoint: str
) -> None:
    """max_tokens below the natural stop: the continuation's budget ends it with "length"."""
    a, b, _ = servers
    request = _request(endpoint, max_tokens=8)
    whole = _whole(b, endpoint, request)
    assert whole.finishes == ["length"] and len(whole.token_ids) == 8
    for n, continued in ((5, True), (8, False)):
        _fault(a, drop_after_tokens=n)
        relay = Relay(endpoint, request)
        relay.run([a, b])
        assert relay.continuations == int(continued)
        _check(endpoint, relay, whole)


@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_greedy_text_is_the_same_on_servers_with_different_seeds(
    servers: list[SimServerThread], endpoint: str
) -> None:
    """Greedy decoding (temperature 0) depends on neither the request's seed nor the
    server's (vLLM's sampler ignores seeds there), so a stream without a seed continues
    exactly on a server started with another ``--seed``; sampled text still follows each
    server's seed."""
    a, b, _ = servers
    request = _request(endpoint)
    del request["seed"]
    whole = _whole(b, endpoint, request)
    assert _whole(a, endpoint, request).token_ids == whole.token_ids
    assert _whole(a, endpoint, {**request, "seed": 5}).token_ids == whole.token_ids
    _fault(a, drop_after_tokens=len(whole.token_ids) // 2)
    relay = Relay(endpoint, request)
    relay.run([a, b])
    assert relay.continuations == 1
    _check(endpoint, relay, whole)
    httpx.put(f"{a.url}/sim/faults", json={}, timeout=20).raise_for_status()
    sampled = {**request, "temperature": 0.7}
    assert _whole(a, endpoint, sampled).text != _whole(b, endpoint, sampled).text
    seeded = {**sampled, "seed": 5}
    assert _whole(a, endpoint, seeded).text == _whole(b, endpoint, seeded).text


@pytest.mark.parametrize("endpoint", ENDPOINTS)
@pytest.mark.parametrize("where", ["first", "middle", "finish"])
def test_continuous_usage_stats_count_on_across_the_seam(
    servers: list[SimServerThread], endpoint: str, where: str
) -> None:
    """With ``continuous_usage_stats`` every chunk's usage is the uninterrupted stream's:
    the original prompt tokens, the completion tokens so far counted from the start."""
    a, b, _ = servers
    request = _request(endpoint, stream_options={"include_usage": True,
                                                 "continuous_usage_stats": True})
    whole = _whole(b, endpoint, request)
    assert len(whole.usages) == len(whole.chunks)  # a usage on every chunk
    tokens = len(whole.token_ids)
    _fault(a, drop_after_tokens={"first": 1, "middle": tokens // 2, "finish": tokens}[where])
    relay = Relay(endpoint, request)
    relay.run([a, b])
    assert relay.continuations == int(where != "finish")
    _check(endpoint, relay, whole)
