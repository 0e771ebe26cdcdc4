"""Active probes of a backend: liveness (``GET /health``), model discovery (``/v1/models``),
and requests through the engine (application probes, warm-up; calibration uses the same
endpoint discovery): they go to the endpoint the backend serves for the model, found and
remembered per (backend, model) in :class:`ProbeEndpoints` (completions, else chat, else
embeddings). A backend that answers but serves none of them gets no health verdict from
them: a 404 of an endpoint says what it serves, not whether it is alive.

Probes never carry a client's credentials; they carry the backend's own key where one is
configured (vLLM leaves ``/health`` open and guards ``/v1/*`` with ``--api-key``). A 401 or 403
answer means the *gateway* is misconfigured (wrong or missing backend key), not that the
backend is dead: it is reported as a configuration error and the backend keeps its health
(case BUG-25, tests/cases/test_health_routing.py: production-stack marked healthy backends
down this way).
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any, Literal

import httpx

from gateway.core.urls import failure_detail
from gateway.fleet.backend import Backend
from gateway.fleet.records import ModelCard

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
        return ProbeResult("fail", failure_detail("/health", e))
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
        return ModelsResult(None, "fail", failure_detail("/v1/models", e))
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


# ---- engine endpoints: which one a backend serves for a model ---------------------------

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
EMBEDDINGS = "/v1/embeddings"
# Tried in this order until one answers: a generating model usually serves completions
# (vLLM does), a chat-only OpenAI-compatible server only chat, a pooling model embeddings.
ENGINE_ENDPOINTS: tuple[str, ...] = (COMPLETIONS, CHAT, EMBEDDINGS)


def not_this_endpoint(status: int, body: bytes = b"") -> bool:
    """Whether an HTTP ``status`` (and its ``body``) to an engine request means "the backend
    does not serve this endpoint for this model" (try the next one): a 4xx other than
    401/403 (our key is refused: a configuration error) and 429 (busy), unless the answer
    says the *model* does not exist (vLLM's 404 ``The model `x` does not exist.`` with
    ``param: "model"``, :func:`model_missing`): that is a verdict on the backend, which does
    not serve the model it is configured for. Neither a success nor a health verdict."""
    if not (400 <= status < 500 and status not in (401, 403, 429)):
        return False
    return not (status == 404 and model_missing(body))


def model_missing(body: bytes) -> bool:
    """Whether an error answer says the requested model does not exist (OpenAI's and
    vLLM's ``{"error": {"param": "model", ...}}`` or ``code: "model_not_found"``, or vLLM's
    message ``The model `x` does not exist.``)."""
    try:
        err = json.loads(body).get("error")
    except (ValueError, AttributeError):
        return False
    if not isinstance(err, dict):
        return False
    msg = str(err.get("message", ""))
    return (
        err.get("param") == "model"
        or err.get("code") == "model_not_found"
        or ("model" in msg.lower() and "does not exist" in msg)
    )


def engine_body(
    endpoint: str, model: str, prompt: str, max_tokens: int, seed: int | None = None
) -> dict[str, object]:
    """The JSON body of a probe or calibration request to ``endpoint`` (one of
    :data:`ENGINE_ENDPOINTS`): ``prompt`` as the completion prompt, as one user message
    (chat), or as the embedding input; temperature 0, ``max_tokens`` tokens at most and,
    when given, a fixed ``seed`` for the generating endpoints. ``ValueError`` for another
    endpoint."""
    if endpoint == EMBEDDINGS:
        return {"model": model, "input": prompt}
    body: dict[str, object] = {"model": model, "max_tokens": max_tokens, "temperature": 0}
    if endpoint == COMPLETIONS:
        body["prompt"] = prompt
    elif endpoint == CHAT:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        raise ValueError(f"not an engine endpoint: {endpoint!r}")
    if seed is not None:
        body["seed"] = seed
    return body


def engine_answer(endpoint: str, data: Any) -> object:
    """What a 200 answer of ``endpoint`` said, from its decoded JSON ``data``: the text
    (completions: ``choices[0].text``; chat: ``choices[0].message.content``) or the vector
    (embeddings: ``data[0].embedding``). ``ValueError`` when it is not shaped so."""
    try:
        if endpoint == COMPLETIONS:
            return data["choices"][0]["text"]
        if endpoint == CHAT:
            return data["choices"][0]["message"]["content"]
        if endpoint == EMBEDDINGS:
            return data["data"][0]["embedding"]
    except (KeyError, IndexError, TypeError) as e:
        raise ValueError(f"unexpected {endpoint} answer ({type(e).__name__}: {e})") from None
    raise ValueError(f"not an engine endpoint: {endpoint!r}")


class ProbeEndpoints:
    """Which engine endpoint answers warm-up, application probes and calibration, per
    (backend id, model): learnt by the probes (the first of :data:`ENGINE_ENDPOINTS` that
    answers 200), so later probes go straight to it, and forgotten when it stops being
    served (a "not this endpoint" 4xx), so the next probe looks again.

    One instance per :class:`~gateway.fleet.controller.FleetController`; only the probe
    functions of this module write it. It also remembers the (backend, model) pairs found
    serving none of the endpoints (:meth:`report` hands that out once, for the log).
    """

    __slots__ = ("_found", "_reported", "_unserved")

    def __init__(self) -> None:
        self._found: dict[tuple[str, str], str] = {}
        self._unserved: dict[tuple[str, str], str] = {}
        self._reported: set[tuple[str, str]] = set()

    def forget(self, backend_id: str) -> None:
        """``backend_id`` left the fleet: drop what was learnt of it."""
        for table in (self._found, self._unserved):
            for key in [k for k in table if k[0] == backend_id]:
                del table[key]
        self._reported = {k for k in self._reported if k[0] != backend_id}

    def get(self, backend_id: str, model: str) -> str | None:
        """The endpoint that last answered for ``model`` on the backend, or None."""
        return self._found.get((backend_id, model))

    def order(self, backend_id: str, model: str) -> tuple[str, ...]:
        """Endpoints to try, in order: the remembered one first, then the others."""
        known = self._found.get((backend_id, model))
        if known is None:
            return ENGINE_ENDPOINTS
        return (known, *(e for e in ENGINE_ENDPOINTS if e != known))

    def found(self, backend_id: str, model: str, endpoint: str) -> None:
        """``endpoint`` answered 200 for ``model``: remember it."""
        key = (backend_id, model)
        self._found[key] = endpoint
        if self._unserved.pop(key, None) is not None:
            self._reported.discard(key)

    def lost(self, backend_id: str, model: str, endpoint: str) -> None:
        """``endpoint`` answered "not this endpoint": forget it if it was the one."""
        if self._found.get((backend_id, model)) == endpoint:
            del self._found[(backend_id, model)]

    def unserved(self, backend_id: str, model: str, detail: str) -> None:
        """Every endpoint tried answered "not this endpoint" (``detail`` says how)."""
        key = (backend_id, model)
        self._found.pop(key, None)
        self._unserved[key] = detail

    def unserved_detail(self, backend_id: str, model: str) -> str | None:
        """Why the last discovery found no endpoint for ``model`` (None: one was found, or
        none was looked for yet)."""
        return self._unserved.get((backend_id, model))

    def report(self, backend_id: str, model: str) -> str | None:
        """:meth:`unserved_detail` the first time it is asked since the pair became
        unserved (the caller logs it then), else None: logged once, not at every probe."""
        key = (backend_id, model)
        detail = self._unserved.get(key)
        if detail is None or key in self._reported:
            return None
        self._reported.add(key)
        return detail


@dataclass(frozen=True, slots=True)
class EngineReply:
    """One engine request after discovery. ``endpoint``/``response``: the endpoint that
    answered and its answer (200, or a status that is a verdict: 5xx, 401/403, 429);
    ``unserved``: every endpoint tried answered "not this endpoint" (then ``endpoint`` and
    ``response`` are None and ``detail`` lists the answers)."""

    endpoint: str | None
    response: httpx.Response | None
    unserved: bool = False
    detail: str = ""


async def engine_request(
    client: httpx.AsyncClient,
    backend: Backend,
    model: str,
    api_key: str | None,
    prompt: str,
    max_tokens: int,
    endpoints: ProbeEndpoints,
    seed: int | None = None,
    timeout_s: float | None = None,
    order: tuple[str, ...] | None = None,
) -> EngineReply:
    """POST one prompt to the endpoint the backend serves for ``model``: the endpoints of
    ``order`` (default: ``endpoints.order(...)``, the remembered one first) in turn until
    one answers something other than "not this endpoint" (:func:`not_this_endpoint`); a 200
    is remembered in ``endpoints``, a "not this endpoint" of the remembered one forgets it,
    and when all of the default order refuse, the pair is marked unserved there.
    ``timeout_s`` (seconds) overrides the client's timeout. Raises ``httpx.HTTPError`` on a
    transport error or timeout (never a reason to try another endpoint)."""
    headers = _auth(api_key)
    timeout = httpx.USE_CLIENT_DEFAULT if timeout_s is None else timeout_s
    refused: list[str] = []
    for endpoint in order if order is not None else endpoints.order(backend.id, model):
        r = await client.post(
            f"{backend.base_url}{endpoint}",
            json=engine_body(endpoint, model, prompt, max_tokens, seed),
            headers=headers,
            timeout=timeout,
        )
        if r.status_code == 200:
            endpoints.found(backend.id, model, endpoint)
            return EngineReply(endpoint, r)
        if not not_this_endpoint(r.status_code, r.content):
            return EngineReply(endpoint, r)
        endpoints.lost(backend.id, model, endpoint)
        refused.append(f"{endpoint} {r.status_code}")
    detail = ", ".join(refused)
    if order is None:  # every endpoint was tried
        endpoints.unserved(backend.id, model, detail)
    return EngineReply(None, None, True, detail)


@dataclass(frozen=True, slots=True)
class AppProbeResult:
    """An application probe: ``ok``, its TTFT in seconds (a 1-token answer), or ``detail``.

    ``unserved``: the backend answered, but serves none of the engine endpoints for the
    model (every one a "not this endpoint" 4xx): no verdict, so ``ok`` is True and
    ``ttft_s`` None. ``endpoint``: the endpoint that answered."""

    ok: bool
    ttft_s: float | None = None
    detail: str = ""
    unserved: bool = False
    endpoint: str | None = None


async def app_probe(
    client: httpx.AsyncClient,
    backend: Backend,
    model: str,
    api_key: str | None,
    max_tokens: int = 1,
    timeout_s: float | None = None,
    endpoints: ProbeEndpoints | None = None,
) -> AppProbeResult:
    """A tiny request (``max_tokens`` 1 by default, prompt ``ping``) through the engine; its
    latency is the time to first token. It goes to the endpoint the backend serves for the
    model (:func:`engine_request`: completions, else chat with one user message, else a
    one-word embedding; remembered in ``endpoints``). A transport error, a timeout, a 5xx
    or 401/403/429 fails it; a backend that answers but serves none of the endpoints passes
    with ``unserved`` (a 404 of an endpoint is not a health verdict). ``timeout_s``
    (seconds) overrides the client's."""
    if endpoints is None:
        endpoints = ProbeEndpoints()
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    try:
        reply = await engine_request(
            client, backend, model, api_key, "ping", max_tokens, endpoints, timeout_s=timeout_s
        )
    except httpx.HTTPError as e:
        return AppProbeResult(False, detail=failure_detail("app probe", e))
    if reply.unserved:
        return AppProbeResult(
            True,
            detail=f"no engine endpoint served for model {model} ({reply.detail})",
            unserved=True,
        )
    assert reply.response is not None
    status = reply.response.status_code
    if status != 200:
        return AppProbeResult(
            False, detail=f"app probe {reply.endpoint} answered {status}", endpoint=reply.endpoint
        )
    return AppProbeResult(True, ttft_s=loop.time() - t0, endpoint=reply.endpoint)


async def warm_up(
    client: httpx.AsyncClient,
    backend: Backend,
    model: str,
    api_key: str | None,
    batch_shapes: list[int],
    max_tokens: int,
    endpoints: ProbeEndpoints | None = None,
) -> str | None:
    """Warm-up passes at each batch shape (1, 2, 4, 8 concurrent requests by default), so
    CUDA graphs, allocator pools and kernels for those batch sizes exist before real traffic
    arrives, on the endpoint the backend serves for ``model`` (found by the first request,
    remembered in ``endpoints``). Returns None when every pass answered, else what failed.
    A backend that serves none of the engine endpoints for the model passes (no verdict:
    ``endpoints.unserved_detail`` says so, and the rest of the passes are skipped)."""
    if endpoints is None:
        endpoints = ProbeEndpoints()
    for shape in batch_shapes:
        results = await asyncio.gather(
            *(
                app_probe(client, backend, model, api_key, max_tokens, endpoints=endpoints)
                for _ in range(shape)
            )
        )
        bad = [r.detail for r in results if not r.ok]
        if bad:
            return f"warm-up at batch {shape}: {bad[0]}"
        if all(r.unserved for r in results):
            return None  # nothing to warm through these endpoints
    return None
