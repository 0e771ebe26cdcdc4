"""The simulated vLLM OpenAI server: ``create_sim_app(SimConfig) -> FastAPI``.

Routes, bodies, headers and errors follow a real vLLM 0.32.0 (see ``protocol.py``);
generation is paced by the pure ``Engine`` driven in real time by ``EngineRunner``.
Beyond vLLM's API it serves ``/sim/faults`` (read, replace, patch the ``FaultConfig``),
``/sim/stats`` (what this backend received), for tests and the demo, and ``/gpu/metrics``:
its simulated GPUs (:mod:`gateway.sim.gpu`) under dcgm-exporter's metric names.

Differences from vLLM, on purpose: ``/v1/embeddings`` is served next to generation
(vLLM serves it only for pooling models); dev-mode routes (``/reset_prefix_cache``,
``/sleep``, ...) are always on; while sleeping, generation answers 503 at once (vLLM
0.32 holds the request until ``/wake_up``); every response carries ``X-Request-Id``
(vLLM only with ``--enable-request-id-headers``).
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import math
import struct
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any, Literal

from fastapi import FastAPI, Request
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.middleware.cors import CORSMiddleware
from starlette.responses import Response

from gateway.sim import protocol as P
from gateway.sim import text as tx
from gateway.sim.asgi import (
    DroppedConnection,
    SimEventSourceResponse,
    SimFastAPI,
    SimMiddleware,
    close_connection,
    error_response,
    json_response,
    wait_disconnect,
)
from gateway.sim.config import LoraAdapter, SimConfig
from gateway.sim.embeddings import embedding_vector, parse_embedding
from gateway.sim.engine_types import EngineEvent, EngineRequest
from gateway.sim.faults import FaultConfig, FaultDecision, FaultInjector
from gateway.sim.gpu import GpuTicker, SimGpus, render_dcgm
from gateway.sim.metrics import SimMetrics
from gateway.sim.runtime import EngineRunner
from gateway.sim.state import SimState
from gateway.sim.streaming import Choice, choice_text, sse, stream_events

__all__ = ["LoraAdapter", "SimConfig", "SimState", "create_sim_app"]


def _fault_error(d: FaultDecision) -> P.SimHTTPError:
    if d.kind == "rate_limit":
        headers = {
            "Retry-After": str(math.ceil(d.retry_after_s)),
            "retry-after-ms": str(round(d.retry_after_s * 1000)),
        }
        return P.error(
            429,
            "Too many requests (injected by the simulator). Please retry later.",
            "Too Many Requests",
            None,
            headers,
        )
    err_type = {500: "InternalServerError", 503: "Service Unavailable"}.get(d.status)
    return P.error(d.status, f"Injected failure (simulator, status {d.status}).", err_type)


def create_sim_app(config: SimConfig | None = None) -> FastAPI:
    """Build a FastAPI app that behaves like a vLLM 0.32 OpenAI server (see module doc).

    The engine loop starts in the app's lifespan and stops with it. State, including
    the live ``FaultInjector`` and the engine, is at ``app.state.sim`` (``SimState``).
    """
    cfg = config or SimConfig()
    params = cfg.engine
    holder: dict[str, SimState] = {}

    def on_finished(m: Any) -> None:
        holder["state"].metrics.observe(m)

    runner = EngineRunner(params, on_finished=on_finished)
    fp = hashlib.sha256(cfg.model_dump_json().encode()).hexdigest()[:8]
    state = SimState(
        config=cfg,
        faults=FaultInjector(cfg.faults),
        runner=runner,
        metrics=SimMetrics(
            cfg.model,
            cfg.engine_label,
            params,
            runner.engine.stats,
            lambda: holder["state"].sleep_level,
        ),
        fingerprint=f"vllm-{cfg.vllm_version}-{fp}",
    )
    holder["state"] = state
    state.gpus = GpuTicker(
        SimGpus(cfg.gpu, runner.engine, seed=cfg.seed), lambda: state.faults.config, runner.now
    )
    lora_names = {a.name for a in cfg.lora_adapters}
    served = cfg.served_ids

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        state.closing = asyncio.Event()
        await runner.start()
        await state.gpus.start()
        try:
            yield
        finally:
            state.closing.set()
            await state.gpus.stop()
            await runner.stop()

    app = SimFastAPI(
        title=f"vLLM simulator ({cfg.model})",
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
    )
    app.state.sim = state

    async def not_unicode(request: Request, exc: Exception) -> Response:
        # a lone UTF-16 surrogate ("\ud800") in the JSON text cannot be tokenized
        reason = getattr(exc, "reason", str(exc))
        return error_response(P.bad_request(f"The input is not valid Unicode text: {reason}."))

    app.add_exception_handler(UnicodeEncodeError, not_unicode)
    app.add_middleware(
        CORSMiddleware,
        allow_origins=["*"],
        allow_credentials=False,
        allow_methods=["*"],
        allow_headers=["*"],
    )
    app.add_middleware(SimMiddleware, state=state)

    # ------------------------------------------------------------------ helpers
    # The modelled API-server frontend (request_overhead_s, input_overhead_s): one process,
    # requests served one at a time. Its timeline is computed (when it frees), so the
    # simulator's own event-loop delays do not add to the modelled cost.
    frontend_free_at = [0.0]  # loop time (s)

    def record(request: Request, body: Any) -> None:
        state.recent.append(
            {
                "path": request.url.path,
                "query": request.url.query,
                "method": request.method,
                "headers": dict(request.headers),
                "body": body,
            }
        )

    async def apply_faults(request: Request, stream: bool) -> tuple[FaultDecision, Response | None]:
        d = state.faults.decide()
        if d.latency_s > 0:
            await asyncio.sleep(d.latency_s)
        if d.hang:
            wait_closing = asyncio.ensure_future(state.closing.wait())
            wait_client = asyncio.ensure_future(wait_disconnect(request.receive))
            try:
                await asyncio.wait({wait_closing, wait_client}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                wait_closing.cancel()
                wait_client.cancel()
            if not wait_client.done() or wait_client.cancelled():
                # Server shutting down: the hung request dies with its connection.
                await close_connection(request)
            return d, Response(status_code=499)
        if d.kind != "ok":
            return d, error_response(_fault_error(d))
        if d.drop_after is not None and not stream:
            state.dropped_connections += 1
            if not await close_connection(request):
                raise DroppedConnection("simulated dropped connection")
            return d, Response(status_code=499)
        return d, None

    def sleeping_error() -> P.SimHTTPError:
        return P.error(503, "The engine is sleeping. Call /wake_up first.", "Service Unavailable")

    # ----------------------------------------------------------------- generation
    async def generate(request: Request, kind: Literal["chat", "completion"]) -> Response:
        raw = await request.body()
        try:
            body = P.parse_json_body(raw)
        except P.SimHTTPError as err:
            record(request, None)
            return error_response(err)
        record(request, body)
        stream_requested = body.get("stream") is True
        decision, early = await apply_faults(request, stream_requested)
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

        seed = req.seed if req.seed is not None else cfg.seed
        salt = req.model if req.model in lora_names else ""
        header_id = request.headers.get("x-request-id")
        rid = ("chatcmpl-" if kind == "chat" else "cmpl-") + (header_id or P.random_id())
        base = f"{next(state.ids)}"
        choices: dict[str, Choice] = {}
        queue: asyncio.Queue[EngineEvent] = asyncio.Queue()
        for i, prompt in enumerate(req.prompts):
            key = tx.prompt_key(prompt)
            for j in range(req.n):
                ch = Choice(len(choices), f"{base}-{i}-{j}", len(prompt), key, j)
                eos = (
                    None
                    if req.ignore_eos
                    else tx.natural_stop_length(
                        seed, key, j, cfg.stop_length_min, cfg.stop_length_max
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
                sse(events, abort_unfinished, decision.drop_after, request, state),
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
                out.append(P.chat_choice(ch.index, text, ch.finish_reason))
            else:
                out.append(P.completion_choice(ch.index, text, ch.finish_reason))
        build = P.chat_response if kind == "chat" else P.completion_response
        return json_response(
            build(rid, created, req.model, out, state.fingerprint, prompt_tokens, completion_tokens)
        )

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await generate(request, "chat")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await generate(request, "completion")

    # ----------------------------------------------------------------- embeddings
    @app.post("/v1/embeddings")
    async def embeddings(request: Request) -> Response:
        raw = await request.body()
        try:
            body = P.parse_json_body(raw)
        except P.SimHTTPError as err:
            record(request, None)
            return error_response(err)
        record(request, body)
        _, early = await apply_faults(request, False)
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

    # ----------------------------------------------------------------- models etc.
    @app.get("/v1/models")
    async def models() -> Response:
        created = P.now_s()
        cards = [
            P.model_card(
                cfg.model, cfg.model_root or cfg.model, None, params.max_model_len, created
            )
        ]
        for a in cfg.lora_adapters:
            cards.append(
                P.model_card(
                    a.name,
                    a.path or f"/adapters/{a.name}",
                    a.parent or cfg.model,
                    params.max_model_len,
                    created,
                )
            )
        return json_response({"object": "list", "data": cards})

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=503 if state.faults.config.unhealthy else 200)

    @app.api_route("/ping", methods=["GET", "POST"])
    async def ping() -> Response:
        return Response(status_code=503 if state.faults.config.unhealthy else 200)

    @app.get("/version")
    async def version() -> Response:
        return json_response({"version": cfg.vllm_version})

    @app.get("/load")
    async def load() -> Response:
        return json_response({"server_load": state.open_requests})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/gpu/metrics")
    async def gpu_metrics() -> Response:
        """dcgm-exporter's metrics of the simulated GPUs (:mod:`gateway.sim.gpu`)."""
        state.gpus.tick()
        return Response(render_dcgm(state.gpus.gpus), media_type=CONTENT_TYPE_LATEST)

    # ------------------------------------------------------------ tokenizer routes
    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        try:
            body = P.parse_json_body(await request.body())
            P.check_model(body.get("model"), served, cfg.model)
            if "messages" in body:
                msgs = body["messages"]
                if not isinstance(msgs, list):
                    raise P.validation_error(
                        "list_type", "body.messages", "Input should be a valid list", msgs
                    )
                ids = tx.tokenize_chat(msgs, bool(body.get("add_generation_prompt", True)))
            elif isinstance(body.get("prompt"), str):
                ids = tx.tokenize(body["prompt"], bool(body.get("add_special_tokens", True)))
            else:
                raise P.validation_error("missing", "body.prompt", "Field required", body)
        except P.SimHTTPError as err:
            return error_response(err)
        strs = [tx.token_str(t) for t in ids] if body.get("return_token_strs") else None
        return json_response(
            {
                "count": len(ids),
                "max_model_len": params.max_model_len,
                "tokens": ids,
                "token_strs": strs,
            }
        )

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        try:
            body = P.parse_json_body(await request.body())
            P.check_model(body.get("model"), served, cfg.model)
            toks = body.get("tokens")
            if not isinstance(toks, list) or not all(isinstance(t, int) for t in toks):
                raise P.validation_error("missing", "body.tokens", "Field required", body)
        except P.SimHTTPError as err:
            return error_response(err)
        return json_response({"prompt": tx.detokenize(toks)})

    # ------------------------------------------------------------- dev-mode routes
    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache(
        reset_running_requests: bool = False, reset_external: bool = False
    ) -> Response:
        if reset_running_requests:
            runner.abort_all()
        return json_response({"success": runner.engine.reset_prefix_cache()})

    @app.post("/sleep")
    async def sleep(level: int = 1) -> Response:
        if not 0 <= level <= 2:
            return error_response(
                P.validation_error(
                    "less_than_equal",
                    "query.level",
                    "Input should be less than or equal to 2",
                    level,
                )
            )
        runner.abort_all()
        runner.engine.reset_prefix_cache()
        state.sleep_level = max(level, 1)
        return json_response({"status": "sleeping", "level": level})

    @app.post("/wake_up")
    async def wake_up(request: Request) -> Response:
        tags = request.query_params.getlist("tags") or None
        state.sleep_level = 0
        return json_response({"status": "awake", "tags": tags})

    @app.get("/is_sleeping")
    async def is_sleeping() -> Response:
        return json_response({"is_sleeping": state.sleep_level > 0})

    # ------------------------------------------------------------ simulator routes
    @app.get("/sim/faults")
    async def get_faults() -> Response:
        return json_response(state.faults.config.model_dump())

    @app.api_route("/sim/faults", methods=["POST", "PUT", "PATCH"])
    async def set_faults(request: Request) -> Response:
        """POST/PUT replace the whole FaultConfig; PATCH (or POST ?merge=true) merges."""
        try:
            body = P.parse_json_body(await request.body())
            merge = request.method == "PATCH" or request.query_params.get("merge") in (
                "1",
                "true",
                "yes",
            )
            new = (
                state.faults.patch(body)
                if merge
                else state.faults.replace(FaultConfig.model_validate(body))
            )
        except P.SimHTTPError as err:
            return error_response(err)
        except ValueError as exc:  # pydantic.ValidationError
            return error_response(P.error(400, str(exc), "BadRequestError"))
        return json_response(new.model_dump())

    def stats_response() -> Response:
        # ASCII JSON: recorded bodies may hold lone surrogates ("\ud800"), which have no
        # UTF-8 form but a JSON escape
        return Response(json.dumps(state.snapshot()), media_type="application/json")

    @app.get("/sim/stats")
    async def get_stats() -> Response:
        return stats_response()

    @app.delete("/sim/stats")
    async def reset_stats() -> Response:
        state.reset_stats()
        return stats_response()

    return app
