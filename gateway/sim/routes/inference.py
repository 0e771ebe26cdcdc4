"""The simulated server's inference routes: ``/v1/chat/completions`` and
``/v1/completions`` (generation paced by the engine, streamed or not) and
``/v1/embeddings`` (vectors after a modelled prefill)."""

from __future__ import annotations

import asyncio
import base64
import struct
from typing import Any, Literal

from fastapi import FastAPI, Request
from starlette.responses import Response

from gateway.sim import protocol as P
from gateway.sim import text as tx
from gateway.sim.asgi import SimEventSourceResponse, error_response, json_response, wait_disconnect
from gateway.sim.embeddings import embedding_vector, parse_embedding
from gateway.sim.engine_types import EngineEvent, EngineRequest
from gateway.sim.routes.intake import apply_faults, record, sleeping_error
from gateway.sim.state import SimState
from gateway.sim.streaming import Choice, choice_text, choice_token_ids, sse, stream_events


def add_inference_routes(app: FastAPI, state: SimState) -> None:
    """Mount the generation and embedding routes on ``app``, serving from ``state``."""
    cfg = state.config
    params = cfg.engine
    runner = state.runner
    lora_names = {a.name for a in cfg.lora_adapters}
    drift = tx.Drift(cfg.release.drift, cfg.release.drift_seed)  # the build's text
    served = cfg.served_ids
    # The modelled API-server frontend (request_overhead_s, input_overhead_s): one process,
    # requests served one at a time. Its timeline is computed (when it frees), so the
    # simulator's own event-loop delays do not add to the modelled cost.
    frontend_free_at = [0.0]  # loop time (s)

    async def generate(request: Request, kind: Literal["chat", "completion"]) -> Response:
        raw = await request.body()
        try:
            body = P.parse_json_body(raw)
        except P.SimHTTPError as err:
            record(state, request, None)
            return error_response(err)
        record(state, request, body)
        stream_requested = body.get("stream") is True
        decision, early = await apply_faults(state, request, stream_requested)
        if early is not None:
            return early
        try:
            req = P.parse_generation(
                body, kind, cfg.model, served, [cfg.model], params.max_model_len
            )
            if state.sleep_level:
                raise sleeping_error()
            if state.closing.is_set():
                raise P.error(503, "The server is shutting down.", "Service Unavailable")
        except P.SimHTTPError as err:
            return error_response(err)

        # Greedy decoding (temperature 0) is the same on every server of the model whatever
        # the seeds, as in vLLM; sampled text follows the request's seed, else the server's.
        seed = tx.GREEDY_SEED if req.greedy else req.seed if req.seed is not None else cfg.seed
        salt = req.model if req.model in lora_names else ""
        header_id = request.headers.get("x-request-id")
        rid = ("chatcmpl-" if kind == "chat" else "cmpl-") + (header_id or P.random_id())
        base = f"{next(state.ids)}"
        choices: dict[str, Choice] = {}
        queue: asyncio.Queue[EngineEvent] = asyncio.Queue()
        for i, prompt in enumerate(req.prompts):
            # A prompt that ends in this simulator's own generation continues it.
            key, offset = tx.continuation_point(seed, prompt, drift)
            for j in range(req.n):
                ch = Choice(
                    len(choices), f"{base}-{i}-{j}", len(prompt), key, j, offset=offset,
                    prompt_ids=prompt if req.return_token_ids else None, drift=drift,
                )
                eos = (
                    None
                    if req.ignore_eos
                    else max(
                        1,
                        tx.natural_stop_length(
                            seed, key, j, cfg.stop_length_min, cfg.stop_length_max
                        )
                        - offset,
                    )
                )
                choices[ch.engine_id] = ch
                runner.submit(
                    EngineRequest(ch.engine_id, prompt, req.max_tokens[i], eos, salt), queue
                )
        prompt_tokens = sum(len(p) for p in req.prompts)
        created = P.now_s()

        def abort_unfinished() -> None:
            aborted = False
            for ch in choices.values():
                if ch.finish_reason is None and runner.abort(ch.engine_id):
                    aborted = True
            if aborted:
                state.client_aborts += 1

        if req.stream:
            events = stream_events(
                req, choices, queue, rid, created, prompt_tokens, seed, state.fingerprint
            )
            return SimEventSourceResponse(
                sse(
                    events,
                    abort_unfinished,
                    decision.drop_after,
                    request,
                    state,
                    decision.drop_after_tokens,
                    lambda: sum(ch.tokens for ch in choices.values()),
                ),
                ping=0,
                sep="\n",
            )

        async def collect() -> None:
            left = len(choices)
            while left:
                ev = await queue.get()
                ch = choices[ev.request_id]
                if ev.new_token:
                    ch.tokens = ev.num_tokens
                if ev.finish_reason is not None:
                    ch.finish_reason = ev.finish_reason
                    left -= 1

        gen = asyncio.ensure_future(collect())
        disc = asyncio.ensure_future(wait_disconnect(request.receive))
        try:
            await asyncio.wait({gen, disc}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not gen.done():
                gen.cancel()
                abort_unfinished()
            disc.cancel()
        if not gen.done() or gen.cancelled():
            return Response(status_code=499)
        completion_tokens = sum(ch.tokens for ch in choices.values())
        out = []
        for ch in choices.values():
            text = choice_text(seed, ch)
            if kind == "chat":
                choice = P.chat_choice(ch.index, text, ch.finish_reason, req.response_role)
            else:
                choice = P.completion_choice(ch.index, text, ch.finish_reason)
                if req.return_token_ids:
                    choice["prompt_token_ids"] = ch.prompt_ids
            if req.return_token_ids:
                choice["token_ids"] = choice_token_ids(seed, ch)
            out.append(choice)
        build = P.chat_response if kind == "chat" else P.completion_response
        body_out = build(
            rid, created, req.model, out, state.fingerprint, prompt_tokens, completion_tokens
        )
        if kind == "chat" and req.return_token_ids:
            body_out["prompt_token_ids"] = req.prompts[0]
        return json_response(body_out)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await generate(request, "chat")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await generate(request, "completion")

    @app.post("/v1/embeddings")
    async def embeddings(request: Request) -> Response:
        raw = await request.body()
        try:
            body = P.parse_json_body(raw)
        except P.SimHTTPError as err:
            record(state, request, None)
            return error_response(err)
        record(state, request, body)
        _, early = await apply_faults(state, request, False)
        if early is not None:
            return early
        try:
            model, inputs, fmt = parse_embedding(body, cfg, served)
            if state.sleep_level:
                raise sleeping_error()
        except P.SimHTTPError as err:
            return error_response(err)
        n_tokens = sum(len(t) for t in inputs)
        if cfg.request_overhead_s or cfg.input_overhead_s:
            loop = asyncio.get_running_loop()
            start = max(loop.time(), frontend_free_at[0])
            done = frontend_free_at[0] = (
                start + cfg.request_overhead_s + cfg.input_overhead_s * len(inputs)
            )
            await asyncio.sleep(done - loop.time())
        await asyncio.sleep(params.prefill_time_s(n_tokens))
        data = []
        for i, toks in enumerate(inputs):
            vec = embedding_vector(model, toks, cfg.embedding_dim)
            emb: Any = vec
            if fmt == "base64":
                emb = base64.b64encode(struct.pack(f"<{len(vec)}f", *vec)).decode()
            data.append({"index": i, "object": "embedding", "embedding": emb})
        return json_response(
            {
                "id": f"embd-{P.random_id()}",
                "object": "list",
                "created": P.now_s(),
                "model": model,
                "data": data,
                "usage": {
                    "prompt_tokens": n_tokens,
                    "total_tokens": n_tokens,
                    "completion_tokens": 0,
                    "prompt_tokens_details": None,
                    "completion_tokens_details": None,
                },
            }
        )
