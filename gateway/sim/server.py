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

This module builds the app (state, lifespan, middleware); the routes are mounted from
:mod:`gateway.sim.routes`: ``inference`` (generation, embeddings), ``info`` (models,
health, metrics, tokenizer), ``control`` (dev-mode and ``/sim/*``).
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from starlette.middleware.cors import CORSMiddleware
from starlette.responses import Response

from gateway.sim import protocol as P
from gateway.sim.asgi import SimFastAPI, SimMiddleware, error_response
from gateway.sim.config import ReleaseConfig, SimConfig
from gateway.sim.faults import FaultInjector
from gateway.sim.gpu import GpuTicker, SimGpus
from gateway.sim.metrics import SimMetrics
from gateway.sim.routes.control import add_control_routes
from gateway.sim.routes.inference import add_inference_routes
from gateway.sim.routes.info import add_info_routes
from gateway.sim.runtime import EngineRunner
from gateway.sim.state import SimState


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

    release = cfg.release
    runner = EngineRunner(
        params,
        on_finished=on_finished,
        ttft_factor=release.ttft_factor,
        itl_factor=release.itl_factor,
    )
    # A default build fingerprints as it did before ``release`` existed; any other build
    # (slower, drifted) has a fingerprint of its own.
    default_build = release == ReleaseConfig()
    dumped = cfg.model_dump_json(exclude={"release"} if default_build else None)
    fp = hashlib.sha256(dumped.encode()).hexdigest()[:8]
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

    add_inference_routes(app, state)
    add_info_routes(app, state)
    add_control_routes(app, state)
    return app
