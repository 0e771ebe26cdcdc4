"""The lifecycle drill's load (``benchmarks/lifecycle_drill.py``), what it checks of each
stream, and what it reads of the gateway's continuations (issue 17).

* :class:`StreamView`: one chat stream as the client read it (every ``data:`` event), with
  :meth:`StreamView.cut` (no final ``[DONE]``, or an error event) and
  :meth:`StreamView.not_whole` (why its text is not the whole generation, None when it is).
* :func:`reference`: what an uninterrupted simulated backend generates for a greedy
  (``temperature`` 0) chat request with ``ignore_eos``: the simulator's text is a function of
  the context (:mod:`gateway.sim.text`), the same on every backend at temperature 0, so a
  stream continued on another backend must carry exactly this text and usage.
* :func:`counters`: ``gateway_stream_continuations_total{reason,outcome}`` and
  ``gateway_retry_budget_exhausted_total`` read from the gateway's ``/metrics``.
* :func:`run_load`: the drill's client, an open loop of greedy chat requests (half streams
  with ``include_usage``), each read to its end and checked (:class:`Result`).
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field
from functools import cache
from typing import Any

import aiohttp
import httpx
from prometheus_client.parser import text_string_to_metric_families

from gateway.sim import protocol as P
from gateway.sim import text as tx
from gateway.sim.engine import EngineParams

CONTINUATIONS = "gateway_stream_continuations_total"
BUDGET_EXHAUSTED = "gateway_retry_budget_exhausted_total"
MODEL = "m1"


@cache
def reference(model: str, content: str, max_tokens: int) -> tuple[str, int]:
    """``(text, prompt tokens)`` an uninterrupted simulated backend streams for the greedy chat
    request ``[{"role": "user", "content": content}]`` with ``max_tokens`` and
    ``ignore_eos`` (exactly ``max_tokens`` tokens): the simulator's own prompt rendering and
    greedy text (:func:`gateway.sim.text.continuation_point`, ``GREEDY_SEED``)."""
    body = {"model": model, "messages": [{"role": "user", "content": content}],
            "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0}
    req = P.parse_generation(body, "chat", model, [model], [model], EngineParams().max_model_len)
    prompt = req.prompts[0]
    key, offset = tx.continuation_point(tx.GREEDY_SEED, prompt)
    assert offset == 0, "a fresh prompt starts a new generation"
    return tx.generated_text(tx.GREEDY_SEED, key, 0, max_tokens), len(prompt)


@dataclass
class StreamView:
    """One chat stream as its client read it: each event's ``data`` payload, in order, and
    the unframed tail (bytes after the last complete event)."""

    events: list[bytes] = field(default_factory=list)
    tail: bytes = b""

    def feed(self, buf: bytes) -> bytes:
        """Take the complete events (``\\n\\n``-terminated) of ``buf``; returns the rest."""
        while b"\n\n" in buf:
            ev, buf = buf.split(b"\n\n", 1)
            if ev.startswith(b"data: "):
                self.events.append(ev[6:])
        self.tail = buf
        return buf

    @property
    def chunks(self) -> list[dict[str, Any]]:
        """The JSON events (``[DONE]`` left out)."""
        return [json.loads(e) for e in self.events if e != b"[DONE]"]

    def errors(self) -> list[Any]:
        """The error events' ``error`` objects."""
        return [c["error"] for c in self.chunks if "error" in c]

    def cut(self) -> str | None:
        """Why the client saw a cut stream (no single final ``[DONE]``, or an error event);
        None when it ended normally."""
        done = self.events.count(b"[DONE]")
        if done != 1 or self.events[-1] != b"[DONE]" or self.tail.strip():
            return f"stream without a final [DONE] ({done} [DONE], tail {self.tail[:80]!r})"
        errs = self.errors()
        return f"error event: {errs[0]}" if errs else None

    def finish_reasons(self) -> list[str]:
        """Every non-null ``finish_reason`` the stream carried."""
        return [ch["finish_reason"] for c in self.chunks for ch in c.get("choices") or []
                if ch.get("finish_reason")]

    def not_whole(self, model: str, content: str, max_tokens: int) -> str | None:
        """Why an uncut greedy ``ignore_eos`` stream is not the whole generation (None: it
        is): one ``id``, one ``model``, one ``created``, one role delta, one
        ``finish_reason`` (``length``), one usage with ``prompt_tokens`` as the backend counts
        them and ``completion_tokens == max_tokens``, and the text of :func:`reference`."""
        chunks = self.chunks
        text, prompt_tokens = reference(model, content, max_tokens)
        for key in ("id", "model", "created"):
            seen = {c.get(key) for c in chunks}
            if len(seen) != 1:
                return f"{len(seen)} values of {key}: {sorted(map(str, seen))[:3]}"
        roles = sum(1 for c in chunks for ch in c.get("choices") or []
                    if (ch.get("delta") or {}).get("role"))
        if roles != 1:
            return f"{roles} role deltas"
        if self.finish_reasons() != ["length"]:
            return f"finish_reason {self.finish_reasons()}"
        usages = [c["usage"] for c in chunks if c.get("usage")]
        if len(usages) != 1:
            return f"{len(usages)} usage chunks"
        got = (usages[0].get("prompt_tokens"), usages[0].get("completion_tokens"))
        if got != (prompt_tokens, max_tokens):
            return f"usage (prompt, completion) {got}, expected {(prompt_tokens, max_tokens)}"
        said = "".join((ch.get("delta") or {}).get("content") or ""
                       for c in chunks for ch in c.get("choices") or [])
        if said != text:
            at = next((i for i, (a, b) in enumerate(zip(said, text, strict=False)) if a != b),
                      min(len(said), len(text)))
            return (f"text differs at char {at} ({len(said)} chars, expected {len(text)}): "
                    f"{said[max(0, at - 20):at + 20]!r} vs {text[max(0, at - 20):at + 20]!r}")
        return None


def counters(base_url: str) -> tuple[dict[tuple[str, str], int], int]:
    """From the gateway's ``/metrics``: ``gateway_stream_continuations_total`` as
    ``{(reason, outcome): count}`` (empty before the first continuation), and
    ``gateway_retry_budget_exhausted_total`` (retries and continuations refused for want of
    retry budget: a continuation refused so is counted with outcome ``no_budget``)."""
    text = httpx.get(base_url + "/metrics", timeout=10).text
    out: dict[tuple[str, str], int] = {}
    exhausted = 0
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == CONTINUATIONS:
                out[(s.labels["reason"], s.labels["outcome"])] = int(s.value)
            elif s.name == BUDGET_EXHAUSTED:
                exhausted = int(s.value)
    return out, exhausted


def by_label(counts: dict[tuple[str, str], int], i: int) -> dict[str, int]:
    """``counts`` summed by its ``i``-th label (0: reason, 1: outcome)."""
    out: dict[str, int] = {}
    for key, n in counts.items():
        out[key[i]] = out.get(key[i], 0) + n
    return out


@dataclass
class Result:
    stream: bool
    start: float
    end: float
    request_id: str = ""
    max_tokens: int = 0
    status: int = 0
    error: str | None = None  # client-visible error: status, transport, error event
    cut: bool = False  # a stream without [DONE] or with an error event
    cut_code: str | None = None  # its error event's code, else "no_done" / "transport"
    aborted: bool = False  # finish_reason "abort" (the backend ended it itself)
    not_whole: str | None = None  # an uncut stream that is not the whole generation: why


def prompt_of(max_tokens: int) -> str:
    return f"Story {max_tokens}."


async def one_request(
    session: aiohttp.ClientSession, url: str, stream: bool, max_tokens: int, request_id: str
) -> Result:
    body: dict[str, Any] = {
        "model": MODEL,
        "messages": [{"role": "user", "content": prompt_of(max_tokens)}],
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0,  # greedy: the same text on every backend, so it can be checked
        "stream": stream,
    }
    if stream:
        body["stream_options"] = {"include_usage": True}
    res = Result(stream, time.monotonic(), 0.0, request_id, max_tokens)
    view = StreamView()
    try:
        async with session.post(
            url + "/v1/chat/completions", json=body, headers={"x-request-id": request_id}
        ) as r:
            res.status = r.status
            if r.status != 200:  # an error answer (not a cut stream: none started)
                res.error = f"HTTP {r.status}: {(await r.text())[:200]}"
                return res
            if not stream:
                data = await r.json()
                if not data.get("choices"):
                    res.error = f"no choices: {str(data)[:200]}"
                else:
                    res.aborted = data["choices"][0].get("finish_reason") == "abort"
                return res
            buf = b""
            async for chunk in r.content.iter_any():
                buf = view.feed(buf + chunk)
        cut = view.cut()
        if cut is not None:
            res.cut = True
            res.error = cut
            errs = view.errors()
            res.cut_code = str(errs[0].get("code")) if errs else "no_done"
        res.aborted = "abort" in view.finish_reasons()
        if not res.cut:
            res.not_whole = view.not_whole(MODEL, prompt_of(max_tokens), max_tokens)
    except (aiohttp.ClientError, TimeoutError, ValueError) as e:
        res.error = f"{type(e).__name__}: {e}"
        res.cut = stream and res.status == 200  # broke after the stream started
        res.cut_code = "transport" if res.cut else None
    finally:
        res.end = time.monotonic()
    return res


async def run_load(
    url: str, duration: float, rate: float, seed: int, tag: str = "drill", max_tokens: int = 256
) -> list[Result]:
    """An open loop of ``rate`` requests/s for ``duration`` s (even: stream; odd: not),
    ``max_tokens`` drawn uniformly from 32..``max_tokens`` by ``random.Random(seed)``;
    request ids ``{tag}-{n}``."""
    rng = random.Random(seed)
    timeout = aiohttp.ClientTimeout(total=120)
    tasks: list[asyncio.Task[Result]] = []
    async with aiohttp.ClientSession(timeout=timeout) as session:
        start = time.monotonic()
        n = 0
        while time.monotonic() - start < duration:
            tasks.append(asyncio.create_task(
                one_request(session, url, n % 2 == 0, rng.randint(32, max_tokens), f"{tag}-{n}")
            ))
            n += 1
            await asyncio.sleep(max(0.0, start + n / rate - time.monotonic()))
        return list(await asyncio.gather(*tasks))
