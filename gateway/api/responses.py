"""The Responses API's calls by response id, sent to the backend that holds the response.

``GET /v1/responses/{id}`` (vLLM also streams it with ``?stream=true&starting_after=N``),
``DELETE /v1/responses/{id}``, ``POST /v1/responses/{id}/cancel`` and
``GET /v1/responses/{id}/input_items`` (OpenAI API reference, "Responses"; vLLM serves the
first and the cancel, and answers the others itself). Installed when ``/v1/responses`` is
served (``proxy.passthrough_paths``, the default).

Each call runs through the request flow's lease and attempts
(:meth:`gateway.flow.pipeline.Pipeline.open`, pinned to one backend: no retry elsewhere)
and the backend's answer is relayed unchanged, a stream as a stream. Admission's entry
layer only (:meth:`gateway.flow.admission.AdmissionGate.check_entry`: one request of the
client key's requests per minute, no token; its 429 and ``x-ratelimit-*`` headers as on
any route): these calls start no generation, so no queue (a cancel must never wait behind
the work it cancels). Which backend (:class:`gateway.flow.responses.ResponseRouting`):

- a known id: its owner; a gone owner gets a 404 on ``response_id``, one judged hung a
  503 without being asked;
- an unknown one (created before a gateway restart, expired, evicted): every backend that
  may hold it, in config order (suspected hung ones last), until one answers other than
  404 (remembered when its answer is that response); failures (unreachable, a 5xx, judged
  hung while asked) move on to the next; when all answered 404 the last backend's own 404
  is relayed, else the last failure.

A call waiting on a backend that the hung watchdog judges hung is cut and moves on (or
gets a 503): :meth:`ResponseRouting.waiting_on`. There is no shorter time limit of its own:
a store lookup on a live vLLM answers at once, a backend that does not is judged hung
within seconds (``health.hung_after_s``), and ``proxy.ttfb_timeout_s`` still bounds the
rest; a ``GET ?stream=true`` is never cut once its first events came back.

The path is read as the client sent it (``raw_path``, :func:`parse_path`) and the id is
forwarded percent-encoded (:func:`upstream_path`): ``/v1/responses/..`` or an id with
``%2F``, ``%3F`` or ``%23`` never reaches another backend route, a query or a fragment.
A backend's 429 without ``Retry-After`` gets the gateway's ``retry-after`` (the seconds
until that backend takes requests again: :func:`gateway.api.openai.render_backend_answer`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING
from urllib.parse import parse_qs, quote, unquote

from fastapi import FastAPI, Request
from starlette.responses import Response

from gateway import logs
from gateway.api.errors import (
    INVALID_REQUEST,
    SERVER_ERROR,
    Refusal,
    error_response,
    render,
    shutting_down_response,
)
from gateway.api.forms import TRUE_WORDS
from gateway.api.openai import (
    HungUp,
    Receive,
    Scope,
    Send,
    _relay,
    _render_answer,
    answered,
    log_refusal,
    render_backend_answer,
)
from gateway.api.parsing import (
    ClientGone,
    UploadCut,
    check_client_key,
    read_body_counted,
    sane_request_id,
)
from gateway.core.outcomes import BackendAnswer, refusal_error_type
from gateway.core.vocab import Cut, ErrorType
from gateway.flow.candidates import recovery_s
from gateway.flow.context import Answer, RequestContext, version_label
from gateway.flow.lease import RequestLease
from gateway.flow.responses import hung, is_hung
from gateway.flow.shaping import ratelimit_headers
from gateway.proxy.relay import ClientWatch, CutHandle, RelayResponse
from gateway.proxy.upstream import UpstreamRequest, forward_headers

if TYPE_CHECKING:
    from gateway.fleet.backend import Backend
    from gateway.wiring import Gateway

log = logging.getLogger("gateway.api")

PREFIX = "/v1/responses/"
_SEGMENT_SAFE = "!$&'()*,;=:@"  # RFC 3986 pchar, less "+" (yarl keeps "%2B")
# (method, route): the route is also the endpoint label of the metrics (never the id)
BY_ID_ROUTES = (
    ("GET", "/v1/responses/{response_id}"),
    ("DELETE", "/v1/responses/{response_id}"),
    ("POST", "/v1/responses/{response_id}/cancel"),
    ("GET", "/v1/responses/{response_id}/input_items"),
)

def _streams(query: bytes) -> bool:
    """Whether a ``GET`` asks for the stream (``?stream=true``)."""
    values = parse_qs(query.decode("latin-1")).get("stream")
    return values is not None and values[-1].strip().lower() in TRUE_WORDS


def parse_path(scope: Scope, method: str) -> tuple[str, str]:
    """The response id and the route (a :data:`BY_ID_ROUTES` label) of a by-id call, read
    from the path as the client sent it (``raw_path``: the decoded ``path`` turns ``%2F``
    into another route and ``%3F``/``%23`` into a query or a fragment). Raises a
    :class:`Refusal`: 404 (OpenAI's ``Invalid URL``) when no by-id route has that shape,
    400 on ``response_id`` for an id that is empty, ``.`` or ``..`` (a dot segment: any
    HTTP client or server on the way would resolve it to another route, RFC 3986 5.2.4)."""
    raw: bytes | None = scope.get("raw_path")
    path = raw.decode("latin-1") if raw is not None else quote(scope["path"], safe="/")
    raw_id, slash, action = path.removeprefix(PREFIX).partition("/")
    label = PREFIX + "{response_id}" + slash + action
    if not path.startswith(PREFIX) or (method, label) not in BY_ID_ROUTES:
        raise Refusal(404, f"Invalid URL ({method} {path})", INVALID_REQUEST, None)
    response_id = unquote(raw_id)
    if response_id in ("", ".", ".."):
        raise Refusal(
            400,
            f"Invalid 'response_id': '{response_id}' is not a response id.",
            INVALID_REQUEST,
            "invalid_value",
            param="response_id",
            retryable=False,
        )
    return response_id, label


def upstream_path(response_id: str, label: str) -> str:
    """The path a by-id call is sent to: ``label`` with the id percent-encoded as one path
    segment (``/``, ``?``, ``#``, ``%``, ``+``, spaces and non-ASCII encoded; ``.`` and
    ``..`` are refused before, :func:`parse_path`). The sub-delimiters, ``:`` and ``@``
    stay as they are (RFC 3986 3.3 ``pchar``): aiohttp's URL (yarl) would decode them
    anyway, so the path built here is the one on the wire."""
    return label.replace("{response_id}", quote(response_id, safe=_SEGMENT_SAFE))


async def by_id_response(
    gw: Gateway, route: str, scope: Scope, receive: Receive, lease: RequestLease
) -> Response:
    """Run one by-id call (see the module docstring) under ``lease``; the answer to send.
    ``route``: the framework route it came in on (the metrics' label until the path as
    sent is read)."""
    metrics = gw.metrics
    idh = gw.cfg.server.request_id_header
    started = time.perf_counter()
    id_key, _, priority_key = gw.header_keys
    authorization = declared = rid_value = prio_value = None
    for k, v in scope["headers"]:
        if k == b"authorization":
            authorization = v
        elif k == b"content-length":
            declared = v
        elif k == id_key:
            rid_value = v
        elif k == priority_key:
            prio_value = v
    rid = sane_request_id(rid_value)
    if logs.FIELDS_ON:  # on every log line of this call (JSON lines)
        logs.bind_request(rid)
    method: str = scope["method"]
    label = route
    if gw.shutting_down:
        answered(metrics, label, "", 503, started, error=ErrorType.ADMISSION_REFUSED)
        return shutting_down_response(rid, idh)
    ratelimit: list[tuple[str, str]] = []
    try:
        response_id, label = parse_path(scope, method)
        key = check_client_key(gw, authorization)
        # the entry layer (the key's requests per minute): a call by id costs no token
        client = key.name if key is not None else (scope.get("client") or ("anonymous",))[0]
        prio = gw.gate.priority(prio_value, key, gw.cfg.auth.anonymous_max_priority)
        verdict = gw.gate.check_entry(client, key, prio, rid)
        if verdict is not None:
            ratelimit = list(ratelimit_headers(verdict).items())
        body = await read_body_counted(gw, receive, declared)
        await gw.responses.recall(response_id)  # fleet mode: learned by another replica?
        held = gw.responses.holder(response_id)
        if held is not None and is_hung(held[0]):
            raise hung(response_id, held[0], recovery_s(gw.cfg.health))
        targets: list[Backend] = [held[0]] if held is not None else gw.responses.askable()
        if not targets:
            raise Refusal(
                503,
                "No backend is running to ask for this response.",
                SERVER_ERROR,
                "no_backend_available",
                retry_after_s=recovery_s(gw.cfg.health),
            )
    except Refusal as e:  # (the entry layer's 429 is the key's own limit: rate_limited)
        answered(metrics, label, "", e.status, started, error=refusal_error_type(e))
        log_refusal(e, label, rid, method)
        e.headers.extend(ratelimit)
        return render(e, rid, idh)
    except ClientGone:
        metrics.client_disconnects.labels(label).inc()
        answered(metrics, label, "", 499, started)
        return HungUp()
    except UploadCut:
        answered(metrics, label, "", 503, started, error=ErrorType.ADMISSION_REFUSED)
        return shutting_down_response(rid, idh)
    model = held[1] if held is not None else ""
    query: bytes = scope.get("query_string", b"")
    stream = method == "GET" and _streams(query)
    path = upstream_path(response_id, label) + ("?" + query.decode("latin-1") if query else "")
    cut = CutHandle()
    watch = ClientWatch(receive, cut)
    failure: Refusal | BackendAnswer | None = None
    not_found: Answer | None = None
    routing = gw.responses
    for backend in targets:
        ctx = RequestContext(
            endpoint=label,
            model=model,
            stream=stream,
            upstream=UpstreamRequest(
                method, path, forward_headers(scope["headers"], idh, rid, stream,
                                            private=(priority_key,)), body, stream
            ),
            request_id=rid,
            cut=cut,
            lease=lease,
            started=started,
            pinned=backend,
        )
        ctx.ratelimit = ratelimit
        routing.waiting_on(backend, cut)  # cut if it is judged hung meanwhile
        try:
            opened = await gw.pipeline.open(ctx)
        except Refusal as e:  # (a cut for a hung backend ends here: a 503)
            failure = e
            if is_hung(backend):
                wait = recovery_s(gw.cfg.health)
                failure = hung(response_id, backend, wait, known=held is not None)
            continue
        except BackendAnswer as e:  # (a 429 that said not when carries this backend's wait)
            failure = e
            continue
        except asyncio.CancelledError:
            watch.stop()
            if cut.reason is None:
                raise
            if cut.absorb() == Cut.CLIENT_GONE:
                metrics.client_disconnects.labels(label).inc()
                answered(metrics, label, model, 499, started, version_label(None, ctx.version))
                return HungUp()
            answered(metrics, label, model, 503, started, version_label(None, ctx.version),
                     ErrorType.ADMISSION_REFUSED)
            return shutting_down_response(rid, idh)
        finally:
            routing.answered_by(backend, cut)
        status = opened.resp.status
        if held is None and status == 404 and opened.framer is None:
            not_found = gw.pipeline.finish_body(ctx, opened)  # not there: ask the next
            continue
        if status < 400:
            if method == "DELETE":
                routing.forget(response_id)
            elif held is None:
                routing.found(response_id, opened, model)
        if opened.framer is not None:
            return _relay(gw, ctx, opened, watch)
        watch.stop()
        answer = gw.pipeline.finish_body(ctx, opened)
        answered(metrics, label, model, answer.status, started, answer.version)
        return _render_answer(answer, idh, rid, ratelimit)
    watch.stop()
    if not_found is not None and failure is None:
        answered(metrics, label, model, 404, started, not_found.version)
        return _render_answer(not_found, idh, rid, ratelimit)
    if isinstance(failure, BackendAnswer):
        answered(metrics, label, model, failure.status, started, failure.version)
        return render_backend_answer(failure, idh, rid, ratelimit)
    assert failure is not None
    answered(metrics, label, model, failure.status, started, error=refusal_error_type(failure))
    log_refusal(failure, label, rid, method)
    failure.headers.extend(ratelimit)
    return render(failure, rid, idh)


async def serve_by_id(gw: Gateway, label: str, scope: Scope, receive: Receive, send: Send) -> None:
    """Answer one by-id call under its request lease (closed before a non-stream answer
    goes out, at a stream's end, and on every other exit)."""
    started = time.perf_counter()
    async with gw.new_lease() as lease:
        try:
            response = await by_id_response(gw, label, scope, receive, lease)
        except Exception as e:
            log.exception("unexpected error on %s", scope["path"])
            response = error_response(
                500,
                f"Internal gateway error: {type(e).__name__}",
                SERVER_ERROR,
                "internal_error",
            )
            answered(gw.metrics, label, "", 500, started)
        if not isinstance(response, RelayResponse):
            lease.close()
        await response(scope, receive, send)


class _ById(Response):
    """The framework route's answer: :func:`serve_by_id` runs when the framework sends it."""

    def __init__(self, gw: Gateway, label: str) -> None:
        self.gw = gw
        self.label = label
        self.background = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await serve_by_id(self.gw, self.label, scope, receive, send)


def _route(label: str) -> Callable[[Request], Awaitable[Response]]:
    async def by_id(request: Request) -> Response:
        gw: Gateway = request.app.state.gateway
        return _ById(gw, label)  # the id is read from the path as sent (parse_path)

    return by_id


def install_routes(app: FastAPI) -> None:
    """Register the by-id routes on ``app``."""
    for method, route in BY_ID_ROUTES:
        app.add_api_route(
            route,
            _route(route),
            methods=[method],
            include_in_schema=False,
        )
