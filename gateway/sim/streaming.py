"""Streaming and collecting a generation's choices in vLLM's chunk order and SSE framing."""

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


def token_text(seed: int, ch: Choice, index: int, finish_reason: str | None) -> str:
    """Text of generated token ``index`` of a choice; the EOS token of a "stop" is empty."""
    if finish_reason == "stop":
        return ""
    return tx.generated_token_text(seed, ch.key, ch.sample, index)


def choice_text(seed: int, ch: Choice) -> str:
    """Whole text of a finished (or aborted) choice."""
    n = ch.tokens - 1 if ch.finish_reason == "stop" else ch.tokens
    return tx.generated_text(seed, ch.key, ch.sample, max(0, n))


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
    while left:
        ev = await queue.get()
        if first:
            first = False
            for c in choices.values():
                yield cont(P.chat_role_chunk(rid, created, model, c.index))
        ch = choices[ev.request_id]
        text = ""
        if ev.new_token:
            ch.tokens = ev.num_tokens
            completion_tokens += 1
            text = token_text(seed, ch, ev.num_tokens - 1, ev.finish_reason)
        reason = ev.finish_reason
        if chat:
            chunk = P.chat_delta_chunk(rid, created, model, ch.index, text, reason)
        else:
            chunk = P.completion_chunk(rid, created, model, ch.index, text, reason)
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
) -> AsyncIterator[bytes]:
    """SSE framing (``data: <json>\\n\\n``, then ``data: [DONE]\\n\\n``) and the drop fault."""
    sent = 0
    finished = False
    try:
        if drop_after == 0:
            await _drop(request, state)
        async for chunk in events:
            yield b"data: " + P.dumps(chunk).encode() + b"\n\n"
            sent += 1
            if drop_after is not None and sent >= drop_after:
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
