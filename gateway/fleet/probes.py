"""Active probes of a backend: liveness (``GET /health``) and model discovery (``/v1/models``).

Probes never carry a client's credentials; they carry the backend's own key where one is
configured (vLLM leaves ``/health`` open and guards ``/v1/*`` with ``--api-key``). A 401 or 403
answer means the *gateway* is misconfigured (wrong or missing backend key), not that the
backend is dead: it is reported as a configuration error and the backend keeps its health
(case BUG-25 in ../shared/cases: production-stack marked healthy backends down this way).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Literal

import httpx

from gateway.fleet.backend import Backend, ModelCard

ProbeStatus = Literal["ok", "fail", "auth"]


@dataclass(frozen=True, slots=True)
class ProbeResult:
    """``status``: ok / fail / auth (backend refused our credentials); ``detail`` says why."""

    status: ProbeStatus
    detail: str = ""
    http_status: int | None = None


def _auth(api_key: str | None) -> dict[str, str] | None:
    return {"authorization": f"Bearer {api_key}"} if api_key else None


async def probe_health(
    client: httpx.AsyncClient, backend: Backend, api_key: str | None
) -> ProbeResult:
    """``GET /health``: 200 -> ok; 401/403 -> auth; anything else or no answer -> fail."""
    try:
        r = await client.get(f"{backend.base_url}/health", headers=_auth(api_key))
    except httpx.HTTPError as e:
        return ProbeResult("fail", f"/health: {type(e).__name__}: {e}".rstrip(": "))
    if r.status_code == 200:
        return ProbeResult("ok", http_status=200)
    if r.status_code in (401, 403):
        return ProbeResult(
            "auth", f"/health answered {r.status_code} to the gateway's key", r.status_code
        )
    return ProbeResult("fail", f"/health answered {r.status_code}", r.status_code)


@dataclass(frozen=True, slots=True)
class ModelsResult:
    """Outcome of ``GET /v1/models``: the cards, or why not."""

    cards: tuple[ModelCard, ...] | None
    status: ProbeStatus
    detail: str = ""
    http_status: int | None = None


async def fetch_models(
    client: httpx.AsyncClient, backend: Backend, api_key: str | None
) -> ModelsResult:
    """``GET /v1/models`` of one backend; every entry kept whole (vLLM's fields survive)."""
    try:
        r = await client.get(f"{backend.base_url}/v1/models", headers=_auth(api_key))
    except httpx.HTTPError as e:
        return ModelsResult(None, "fail", f"/v1/models: {type(e).__name__}: {e}".rstrip(": "))
    if r.status_code in (401, 403):
        return ModelsResult(
            None,
            "auth",
            f"/v1/models answered {r.status_code} to the gateway's key",
            r.status_code,
        )
    if r.status_code != 200:
        return ModelsResult(None, "fail", f"/v1/models answered {r.status_code}", r.status_code)
    try:
        data = r.json()["data"]
        cards = tuple(ModelCard(str(m["id"]), m) for m in data if isinstance(m, dict) and "id" in m)
    except (ValueError, KeyError, TypeError) as e:
        return ModelsResult(None, "fail", f"/v1/models: unexpected body ({e})", 200)
    return ModelsResult(cards, "ok", http_status=200)


@dataclass(frozen=True, slots=True)
class AppProbeResult:
    """An application probe: ``ok``, its TTFT in seconds (a 1-token answer), or ``detail``."""

    ok: bool
    ttft_s: float | None = None
    detail: str = ""


async def app_probe(
    client: httpx.AsyncClient,
    backend: Backend,
    model: str,
    api_key: str | None,
    max_tokens: int = 1,
    timeout_s: float | None = None,
) -> AppProbeResult:
    """A tiny completion (``max_tokens`` 1 by default) through the engine; its latency is
    the time to first token. A model that does not generate (a 4xx on completions) is
    probed with a one-word embedding instead. ``timeout_s`` overrides the client's."""
    headers = {"authorization": f"Bearer {api_key}"} if api_key else None
    body = {"model": model, "prompt": "ping", "max_tokens": max_tokens, "temperature": 0}
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    try:
        timeout = httpx.USE_CLIENT_DEFAULT if timeout_s is None else timeout_s
        r = await client.post(
            f"{backend.base_url}/v1/completions", json=body, headers=headers, timeout=timeout
        )
        if 400 <= r.status_code < 500 and r.status_code not in (401, 403, 429):
            r = await client.post(
                f"{backend.base_url}/v1/embeddings",
                json={"model": model, "input": "ping"},
                headers=headers,
                timeout=timeout,
            )
    except httpx.HTTPError as e:
        return AppProbeResult(False, detail=f"app probe: {type(e).__name__}: {e}".rstrip(": "))
    if r.status_code != 200:
        return AppProbeResult(False, detail=f"app probe answered {r.status_code}")
    return AppProbeResult(True, ttft_s=loop.time() - t0)


async def warm_up(
    client: httpx.AsyncClient,
    backend: Backend,
    model: str,
    api_key: str | None,
    batch_shapes: list[int],
    max_tokens: int,
) -> str | None:
    """Warm-up passes at each batch shape (1, 2, 4, 8 concurrent requests by default), so
    CUDA graphs, allocator pools and kernels for those batch sizes exist before real traffic
    arrives. Returns None when every pass answered, else what failed."""
    for shape in batch_shapes:
        results = await asyncio.gather(
            *(app_probe(client, backend, model, api_key, max_tokens) for _ in range(shape))
        )
        bad = [r.detail for r in results if not r.ok]
        if bad:
            return f"warm-up at batch {shape}: {bad[0]}"
    return None
