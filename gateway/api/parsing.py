"""Reading a model request at the edge: its id, its client's key, its body (bounded in size
and idle time, refused compressed), its JSON and model, each failure a
:class:`gateway.core.outcomes.Refusal` with the status OpenAI would use."""

from __future__ import annotations

import asyncio
import json
import secrets
from collections.abc import Awaitable, Callable, MutableMapping
from typing import TYPE_CHECKING, Any

from gateway.api.errors import INVALID_REQUEST, SERVER_ERROR, Refusal
from gateway.config import ClientKey
from gateway.core.keys import key_digest
from gateway.flow.candidates import recovery_s
from gateway.flow.merging import MAX_SEQUENCES
from gateway.traffic.admission import as_count

if TYPE_CHECKING:
    from gateway.wiring import Gateway

Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]

# Field each endpoint cannot do without (vLLM answers 400 without it too).
REQUIRED_FIELD = {
    "/v1/chat/completions": "messages",
    "/v1/completions": "prompt",
    "/v1/embeddings": "input",
}


def new_request_id() -> str:
    """A fresh request id: 32 hex digits (128 random bits, like a UUID4's hex)."""
    return secrets.token_hex(16)


def sane_request_id(value: bytes | None) -> str:
    """The client's request id if sane (1-200 printable ASCII characters, what RFC 9110
    field values should be, so it reads the same in every header, log and codec), else a
    new one."""
    if value:
        rid = value.decode("latin-1")
        if len(rid) <= 200 and rid.isascii() and rid.isprintable():
            return rid
    return new_request_id()


class ClientGone(Exception):
    """The client disconnected while its request body was being read."""


async def read_body(
    receive: Receive, declared: bytes | None, limit: int, idle_timeout_s: float = 30.0
) -> bytes:
    """The whole request body from ASGI ``receive``, refusing more than ``limit`` bytes
    with a 413 (checked against ``content-length`` first, then while reading), and a
    client that stops sending it for ``idle_timeout_s`` seconds with a 408 (a slow upload
    may take as long as it likes, as long as bytes keep coming)."""
    too_big = Refusal(
        413,
        f"Request body is larger than the gateway's limit of {limit} bytes "
        "(server.max_body_bytes).",
        INVALID_REQUEST,
        "request_too_large",
    )
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise too_big
    parts: list[bytes] = []
    size = 0
    loop = asyncio.get_running_loop()
    try:
        async with asyncio.timeout(idle_timeout_s) as timer:
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    raise ClientGone
                chunk = message.get("body", b"")
                if chunk:
                    size += len(chunk)
                    if size > limit:
                        raise too_big
                    parts.append(chunk)
                if not message.get("more_body", False):
                    break
                timer.reschedule(loop.time() + idle_timeout_s)
    except TimeoutError:
        raise Refusal(
            408,
            f"The request body stalled: no bytes for {idle_timeout_s:g} s "
            "(server.body_idle_timeout_s).",
            INVALID_REQUEST,
            "request_timeout",
        ) from None
    return parts[0] if len(parts) == 1 else b"".join(parts)


class UploadCut(Exception):
    """The shutdown's grace period ended while the request's body was still arriving."""


async def read_body_counted(gw: Gateway, receive: Receive, declared: bytes | None) -> bytes:
    """:func:`read_body` with the request counted in ``gw.uploading``: a shutdown waits
    for it during its grace period, then cancels it (:class:`UploadCut`, answered 503
    ``gateway_shutting_down`` without the rest of the body, rather than uvicorn's bare 500
    when its own shutdown timeout cancels the request)."""
    task = asyncio.current_task()
    assert task is not None
    gw.uploading.add(task)
    try:
        return await read_body(
            receive, declared, gw.cfg.server.max_body_bytes, gw.cfg.server.body_idle_timeout_s
        )
    except asyncio.CancelledError:
        if gw.uploads_cut and task.uncancel() == 0:
            raise UploadCut from None
        raise
    finally:
        gw.uploading.discard(task)


def check_content_encoding(value: bytes | None) -> None:
    """415 for a compressed request body (``Content-Encoding`` other than ``identity``):
    the gateway reads the JSON to route it, and vLLM does not accept compressed bodies
    either (RFC 9110 section 15.5.16)."""
    if value is None:
        return
    coding = value.decode("latin-1").strip().lower()
    if coding in ("", "identity"):
        return
    raise Refusal(
        415,
        f"Request bodies with Content-Encoding '{coding}' are not supported; send "
        "uncompressed JSON.",
        code="unsupported_content_encoding",
    )


def parse_object(body: bytes) -> dict[str, Any]:
    """The JSON object of a request body; raises 400 ``invalid_json`` for anything else."""
    try:
        payload = json.loads(body)
    except (ValueError, UnicodeDecodeError) as e:
        raise Refusal(
            400, f"Request body is not valid JSON: {e}", code="invalid_json"
        ) from None
    except RecursionError:
        raise Refusal(
            400, "Request body JSON is nested too deeply.", code="invalid_json"
        ) from None
    if not isinstance(payload, dict):
        raise Refusal(400, "Request body must be a JSON object.", code="invalid_json")
    return payload


def check_payload(payload: dict[str, Any], endpoint: str, max_n: int = MAX_SEQUENCES) -> str:
    """The request's model; raises 400 for a missing or non-string ``model``, a missing
    field the endpoint requires, a non-boolean ``stream``, or an ``n`` / ``best_of`` (read
    as vLLM reads an integer: :func:`gateway.traffic.admission.as_count`) above ``max_n``
    (``proxy.max_n``, default 128: OpenAI's bound; at most
    :data:`gateway.flow.merging.MAX_SEQUENCES`, 65536 sequences)."""
    model = payload.get("model")
    if not isinstance(model, str) or not model:
        raise Refusal(
            400,
            "'model' is required and must be a string.",
            code="missing_required_parameter",
            param="model",
        )
    required = REQUIRED_FIELD.get(endpoint)
    if required is not None and required not in payload:
        raise Refusal(
            400,
            f"'{required}' is a required property.",
            code="missing_required_parameter",
            param=required,
        )
    stream = payload.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise Refusal(400, "'stream' must be a boolean.", code="invalid_type", param="stream")
    for name in ("n", "best_of"):
        # vLLM has no bound: it makes one sequence per choice, and n=1e30 held a server's
        # event loop for good (found by the fuzz tests, issue 20)
        count = as_count(payload.get(name))
        if count is not None and count > max_n:
            raise Refusal(
                400,
                f"'{name}' must be at most {max_n} (proxy.max_n: the sequences one request "
                "may make).",
                code="invalid_value",
                param=name,
            )
    return model


def model_label(gw: Gateway, payload: dict[str, Any] | None) -> str:
    """The ``model`` label of a request the gateway refused itself: the body's ``model``
    when the body parsed to an object whose ``model`` is a string some backend serves now,
    else "" (no body read yet, not JSON, or a model no backend lists: a client's arbitrary
    string never becomes a label value, which would let clients grow the metrics without
    bound)."""
    model = payload.get("model") if payload is not None else None
    if isinstance(model, str) and any(model in b.models for b in gw.fleet.backends):
        return model
    return ""


async def check_model(gw: Gateway, model: str) -> None:
    """404 ``model_not_found`` when no backend lists ``model`` (after one fresh look);
    503 only while no backend has ever listed its models (nothing is reachable yet)."""
    if any(model in b.models for b in gw.fleet.backends):
        return
    await gw.controller.refresh_models_soon()
    if any(model in b.models for b in gw.fleet.backends):
        return
    misconfigured = [b.id for b in gw.fleet.backends if b.config_error and not b.models]
    if misconfigured:
        who = (
            f"Backend {misconfigured[0]} rejects"
            if len(misconfigured) == 1
            else f"Backends {', '.join(misconfigured)} reject"
        )
        raise Refusal(
            502,
            f"{who} the gateway's credentials, so the "
            f"model '{model}' cannot be looked up: the gateway's backend key is misconfigured "
            "(backends[].api_key / api_key_env).",
            SERVER_ERROR,
            "backend_auth_failed",
        )
    # 404 as soon as some backend told us what it serves: a typo must not get a 503 that
    # SDKs retry (case BUG-07); 503 only while no backend has answered at all.
    if any(b.model_cards or b.config.models is not None for b in gw.fleet.backends):
        raise Refusal(
            404,
            f"The model '{model}' does not exist or is not served by any backend.",
            INVALID_REQUEST,
            "model_not_found",
            param="model",
        )
    raise Refusal(
        503,
        f"No reachable backend serves the model '{model}' right now.",
        SERVER_ERROR,
        "no_backend_available",
        retry_after_s=recovery_s(gw.cfg.health),
    )


def check_client_key(gw: Gateway, authorization: bytes | None) -> ClientKey | None:
    """The client's configured key; 401 unless it presents one (no keys configured: open,
    None)."""
    if not gw.client_keys:
        return None
    auth = authorization.decode("latin-1") if authorization else ""
    scheme, _, token = auth.partition(" ")
    # by the token's digest, not the token: no timing side channel (gateway.core.keys)
    presented = key_digest(token.strip().encode("latin-1"))
    key = gw.client_keys.get(presented) if scheme.lower() == "bearer" else None
    if key is None:
        raise Refusal(
            401,
            "Incorrect API key provided."
            if auth
            else "Missing API key: send 'Authorization: Bearer <key>'.",
            INVALID_REQUEST,
            "invalid_api_key",
        )
    return key
