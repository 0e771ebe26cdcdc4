"""The floor for proxy overhead: a bare FastAPI + aiohttp pass-through (the reference
that benchmarks/proxy_overhead.py measures the gateway against).

Reads the body, forwards it to ``--upstream`` with one shared aiohttp ``ClientSession`` and
answers with a ``Response`` (or a ``StreamingResponse`` of ``resp.content.iter_any()`` for
``text/event-stream``). Nothing else: no parsing, no routing, no metrics. Served by uvicorn
with the gateway's settings (``gateway.cli.uvicorn_config``: one worker, uvloop/httptools as
uvicorn picks them, no access log, no server header, keep-alive 5 s).

Run: ``python benchmarks/bare_proxy.py --port 8200 --upstream http://127.0.0.1:8101``.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import aiohttp
import uvicorn
from fastapi import FastAPI, Request
from starlette.background import BackgroundTask
from starlette.responses import Response, StreamingResponse

UPSTREAM = os.environ.get("BARE_PROXY_UPSTREAM", "http://127.0.0.1:8101")
session: aiohttp.ClientSession


@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    global session
    session = aiohttp.ClientSession(UPSTREAM, connector=aiohttp.TCPConnector(limit=1024))
    yield
    await session.close()


try:  # as gateway/app.py: FastAPI >= 0.16x adds OpenTelemetry hooks unless told not to
    app = FastAPI(
        lifespan=lifespan,
        openapi_url=None,
        telemetry={"tracing": False, "metrics": False, "logs": False},
    )
except TypeError:
    app = FastAPI(lifespan=lifespan, openapi_url=None)


@app.post("/v1/chat/completions")
async def chat(request: Request) -> Response:
    body = await request.body()
    resp = await session.post(
        "/v1/chat/completions", data=body, headers={"content-type": "application/json"}
    )
    if resp.content_type == "text/event-stream":
        return StreamingResponse(
            resp.content.iter_any(),
            resp.status,
            media_type="text/event-stream",
            background=BackgroundTask(resp.release),
        )
    data = await resp.read()
    return Response(data, resp.status, media_type=resp.content_type)


def main() -> None:
    global UPSTREAM
    p = argparse.ArgumentParser(description="bare FastAPI + aiohttp pass-through")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8200)
    p.add_argument("--upstream", default=UPSTREAM)
    args = p.parse_args()
    UPSTREAM = args.upstream
    uvicorn.run(
        app,
        host=args.host,
        port=args.port,
        log_level="warning",
        access_log=False,
        server_header=False,
        timeout_keep_alive=5,
        lifespan="on",
    )


if __name__ == "__main__":
    main()
