"""Streaming and collecting a generation's choices in vLLM's chunk order and SSE framing.

A choice's token ``i`` (0-based, in this request) is generation token ``offset + i`` of
the generation keyed ``key`` (:func:`gateway.sim.text.continuation_point`): a request
that continues an earlier generation picks up where it was cut. A drifted build's tokens
drift by the choice's ``drift`` (:class:`gateway.sim.text.Drift`). With
``return_token_ids`` (vLLM's field) the chunks carry the ids: ``prompt_token_ids`` on
the first chunk (top level for chat, in the choice for completions) and per choice
``token_ids`` (the ids generated in that chunk; the EOS id on a "stop").

``sse`` frames the chunks and applies the drop faults: after ``drop_after`` events,
or after the event that carries generated token number ``drop_after_tokens`` (counted
over all choices of the request), the TCP connection is cut without the chunked
terminator, as a backend that dies mid-stream.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from fastapi import Request

from gateway.sim import protocol as P
from gateway.sim import text as tx
from gateway.sim.asgi import TRANSPORT_KEY, DroppedConnection
from gateway.sim.engine_types import EngineEvent
from gateway.sim.state import SimState


@dataclass
class Choice:
    """One output choice of a request: its engine request and its progress (tokens)."""

    index: int
    engine_id: str
    prompt_len: int
    key: int
    sample: int
    tokens: int = 0
    finish_reason: str | None = None
    offset: int = 0  # generation tokens already in the prompt (a continued generation)
    prompt_ids: list[int] | None = None  # for ``prompt_token_ids`` (return_token_ids)
    drift: tx.Drift = tx.NO_DRIFT  # the build's drift (``ReleaseConfig.drift``)


def token_id(seed: int, ch: Choice, index: int, finish_reason: str | None) -> int:
    """Id of token ``index`` of a choice in this request; the EOS id for a "stop"."""
    if finish_reason == "stop":
        return tx.EOS_ID
    return tx.generated_token_id(seed, ch.key, ch.sample, ch.offset + index, ch.drift)


def token_text(seed: int, ch: Choice, index: int, finish_reason: str | None) -> str:
    """Text of generated token ``index`` of a choice; the EOS token of a "stop" is empty."""
    if finish_reason == "stop":
        return ""
    return tx.generated_token_text(seed, ch.key, ch.sample, ch.offset + index, ch.drift)


def choice_token_ids(seed: int, ch: Choice) -> list[int]:
    """Ids of a finished (or aborted) choice's tokens, the EOS id last on a "stop"."""
    n = ch.tokens - 1 if ch.finish_reason == "stop" else ch.tokens
    ids = [
        tx.generated_token_id(seed, ch.key, ch.sample, ch.offset + i, ch.drift) for i in range(n)
    ]
    return [*ids, tx.EOS_ID] if ch.finish_reason == "stop" and ch.tokens else ids


def choice_text(seed: int, ch: Choice) -> str:
    """Whole text of a finished (or aborted) choice."""
    n = ch.tokens - 1 if ch.finish_reason == "stop" else ch.tokens
    return "".join(
        tx.generated_token_text(seed, ch.key, ch.sample, ch.offset + i, ch.drift)
        for i in range(max(0, n))
    )


def _with_usage(chunk: dict[str, Any], usage: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in chunk.items():
        out[k] = v
        if k == "choices":
            out["usage"] = usage
    return out


async def stream_events(
    req: P.GenerationRequest,
    choices: dict[str, Choice],
    queue: asyncio.Queue[EngineEvent],
    rid: str,
    created: int,
    prompt_tokens: int,
    seed: int,
    fingerprint: str,
) -> AsyncIterator[dict[str, Any]]:
    """The stream's chunks as dicts, in vLLM's order, ending with the usage chunk if asked."""
    chat = req.kind == "chat"
    model = req.model
    completion_tokens = 0

    def cont(chunk: dict[str, Any]) -> dict[str, Any]:
        if not req.continuous_usage:
            return chunk
        u = P.usage(prompt_tokens, completion_tokens, full=False)
        u["completion_tokens_details"] = None
        return _with_usage(chunk, u)

    left = len(choices)
    first = chat  # vLLM sends the role chunks with the first engine output (first token)
    ids = req.return_token_ids
    unseen = {c.engine_id for c in choices.values()}  # completions: prompt ids not yet sent
    while left:
        ev = await queue.get()
        if first:
            first = False
            for c in choices.values():
                role = P.chat_role_chunk(rid, created, model, c.index, req.response_role)
                if ids:
                    role["prompt_token_ids"] = c.prompt_ids
                yield cont(role)
        ch = choices[ev.request_id]
        text = ""
        new_ids: list[int] = []
        if ev.new_token:
            ch.tokens = ev.num_tokens
            completion_tokens += 1
            text = token_text(seed, ch, ev.num_tokens - 1, ev.finish_reason)
            new_ids.append(token_id(seed, ch, ev.num_tokens - 1, ev.finish_reason))
        reason = ev.finish_reason
        if chat:
            chunk = P.chat_delta_chunk(rid, created, model, ch.index, text, reason)
        else:
            chunk = P.completion_chunk(rid, created, model, ch.index, text, reason)
            if ids and ch.engine_id in unseen:
                chunk["choices"][0]["prompt_token_ids"] = ch.prompt_ids
        unseen.discard(ch.engine_id)
        if ids:
            chunk["choices"][0]["token_ids"] = new_ids
        if reason is not None:
            ch.finish_reason = reason
            left -= 1
            if not req.include_usage:
                chunk["system_fingerprint"] = fingerprint
        yield cont(chunk)
    if req.include_usage:
        obj = "chat.completion.chunk" if chat else "text_completion"
        yield P.usage_chunk(rid, created, model, obj, prompt_tokens, completion_tokens, fingerprint)


async def sse(
    events: AsyncIterator[dict[str, Any]],
    on_abort: Callable[[], None],
    drop_after: int | None,
    request: Request,
    state: SimState,
    drop_after_tokens: int | None = None,
    tokens_sent: Callable[[], int] = lambda: 0,
) -> AsyncIterator[bytes]:
    """SSE framing (``data: <json>\\n\\n``, then ``data: [DONE]\\n\\n``) and the drop faults.

    ``drop_after``: cut after that many events (0: before the first). ``drop_after_tokens``:
    cut right after the event that brings ``tokens_sent()`` (generated tokens in the events
    so far, all choices, the EOS of a "stop" included) to that many (0: before the first
    event); a stream that ends with fewer tokens is not cut.
    """
    sent = 0
    finished = False
    try:
        if drop_after == 0 or drop_after_tokens == 0:
            await _drop(request, state)
        async for chunk in events:
            yield b"data: " + P.dumps(chunk).encode() + b"\n\n"
            sent += 1
            if drop_after is not None and sent >= drop_after:
                await _drop(request, state)
            if drop_after_tokens is not None and tokens_sent() >= drop_after_tokens:
                await _drop(request, state)
        finished = True
        yield b"data: [DONE]\n\n"
    finally:
        if not finished:
            on_abort()


async def _drop(request: Request, state: SimState) -> None:
    """Cut the connection mid-stream (no chunked terminator) and wait to be cancelled."""
    state.dropped_connections += 1
    transport = request.scope.get(TRANSPORT_KEY)
    if transport is None:
        raise DroppedConnection("simulated dropped stream")
    transport.close()
    await asyncio.Event().wait()  # the disconnect listener cancels the response
