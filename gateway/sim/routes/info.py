"""The simulated server's read-only routes: ``/v1/models``, ``/health``, ``/ping``,
``/version``, ``/load``, ``/metrics`` (vLLM's Prometheus metrics), ``/gpu/metrics``
(dcgm-exporter's, of the simulated GPUs) and the tokenizer routes ``/tokenize`` and
``/detokenize``."""

from __future__ import annotations

from fastapi import FastAPI, Request
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.responses import Response

from gateway.sim import protocol as P
from gateway.sim import text as tx
from gateway.sim.asgi import error_response, json_response
from gateway.sim.gpu import render_dcgm
from gateway.sim.state import SimState

_METHODS = ("GET", "POST", "DELETE", "PUT", "PATCH", "HEAD", "OPTIONS")
"""Every method the control route takes (the service answers 405 to those it does not serve)."""


def add_info_routes(app: FastAPI, state: SimState) -> None:
    """Mount the model, health, metrics and tokenizer routes on ``app``, serving from
    ``state``."""
    cfg = state.config
    params = cfg.engine
    served = cfg.served_ids

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

    @app.api_route("/control{rest:path}", methods=list(_METHODS))
    async def gpu_control(request: Request, rest: str) -> Response:
        """The agent's GPU control endpoint over the simulated GPUs (issue 21,
        :mod:`gateway.core.gpu_control`); 404 without ``gpu.control_token``. Every method
        reaches the service, so a wrong one gets its OpenAI-shaped 405, not FastAPI's."""
        service = state.gpus.control
        if service is None:
            return error_response(P.error(404, "Not Found", "NotFoundError"))
        auth = request.headers.get("authorization", "")
        token = auth[7:] if auth.lower().startswith("bearer ") else None
        state.gpus.tick()  # the clocks as of now before they change
        status, body = service.handle(
            request.method, request.url.path, token, await request.body(), state.runner.now()
        )
        return json_response(body, status)

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
                P.check_generation_prompt(body)  # vLLM's TokenizeChatRequest checks it too
                add_gen = bool(body.get("add_generation_prompt", True))
                cont = bool(body.get("continue_final_message", False))
                if add_gen and cont:
                    raise P.error(400, P.CONTINUE_WITH_GENERATION_PROMPT, "BadRequestError")
                ids = tx.tokenize_chat(msgs, add_gen, cont)
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
