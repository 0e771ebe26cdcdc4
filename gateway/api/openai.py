"""The OpenAI-compatible surface: ``/v1/chat/completions``, ``/v1/completions``,
``/v1/embeddings``, the audio uploads, ``/v1/models`` and pass-through of vLLM routes that
carry a ``model``.

The raw body is read once and forwarded byte for byte: only ``model`` and ``stream`` (and
the presence of the endpoint's required field) are looked at, so unknown fields such as
``top_k``, ``guided_json``, ``tools`` or ``stream_options`` survive (a multipart form:
:mod:`gateway.api.forms`; a Responses follow-up's backend: :mod:`gateway.flow.responses`).
Errors are OpenAI-shaped with the status OpenAI would use (see :mod:`gateway.api.errors`).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Awaitable, Callable, MutableMapping
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from starlette.responses import Response
from uvicorn.protocols.utils import get_client_addr, get_path_with_query_string

from gateway import logs, tracing
from gateway.api import models
from gateway.api.errors import (
    SERVER_ERROR,
    Refusal,
    encoded_headers,
    error_response,
    render,
    retry_after_headers,
    shutting_down_response,
)
from gateway.api.forms import FORM_ROUTES, form_payload, is_form
from gateway.api.parsing import (
    ClientGone,
    UploadCut,
    check_client_key,
    check_content_encoding,
    check_model,
    check_payload,
    model_label,
    parse_object,
    read_body_counted,
    sane_request_id,
)
from gateway.core.outcomes import BackendAnswer, refusal_error_type, status_error_type
from gateway.core.vocab import Cut, ErrorType
from gateway.core.wire_json import utf8_json
from gateway.flow.context import (
    NOTHING_GENERATED,
    Answer,
    Opened,
    RequestContext,
    version_label,
)
from gateway.flow.continuing import StreamContinuer, first_request
from gateway.flow.lease import RequestLease
from gateway.flow.merging import EMBEDDINGS, engine_requests, merge_key, part_of, route_key
from gateway.flow.responses import RESPONSES
from gateway.flow.shaping import cap_max_tokens, key_limits_for, ratelimit_headers
from gateway.proxy.inband import stream_kind
from gateway.proxy.relay import ClientWatch, CutHandle, RelayResponse, StreamOutcome
from gateway.proxy.sse import EventFramer
from gateway.proxy.upstream import UpstreamRequest, forward_headers, response_headers
from gateway.traffic.admission import completion_budget, estimate_tokens
from gateway.traffic.estimate import GENERATES_NOTHING, prompt_tokens

if TYPE_CHECKING:
    from gateway.flow.rollouts import Rollouts
    from gateway.metrics import GatewayMetrics
    from gateway.wiring import Gateway

log = logging.getLogger("gateway.api")
access_log = logging.getLogger("uvicorn.access")  # the request lines (server.access_log)

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]

MODEL_ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings")
SERVED_ROUTES = (*MODEL_ROUTES, *FORM_ROUTES)  # always served: JSON and multipart routes

def _gateway(request: Request) -> Gateway:
    gw: Gateway = request.app.state.gateway  # starlette's State holds untyped attributes
    return gw


def log_refusal(e: Refusal, endpoint: str, request_id: str, method: str = "POST") -> None:
    """Log an error the gateway answered itself on ``method`` ``endpoint``, with the request
    id (client mistakes at INFO, a too-large body, auth and capacity problems at WARNING)."""
    level = logging.INFO if e.status in (400, 404, 405) else logging.WARNING
    log.log(
        level,
        "%s %s: %d %s: %s [request %s]",
        method,
        endpoint,
        e.status,
        e.code,
        e.message,
        request_id,
    )


class HungUp(Response):
    """The answer to a request whose client hung up before any byte of the answer: status
    499 (nginx's "client closed request", the status ``gateway_requests_total`` counts it
    under). Nothing reaches the client, and uvicorn neither writes nor logs an answer to a
    closed connection, so the request's line (``server.access_log``) is logged here, on
    uvicorn's access logger in its own form (client address, method, path with query,
    HTTP version, status; with the request id and backend as fields in JSON lines,
    :mod:`gateway.logs`), like every other request's."""

    def __init__(self) -> None:
        super().__init__(status_code=499)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if access_log.isEnabledFor(logging.INFO):
            access_log.info(
                '%s - "%s %s HTTP/%s" %d',
                get_client_addr(scope),  # type: ignore[arg-type]  # an HTTP scope
                scope["method"],
                get_path_with_query_string(scope),  # type: ignore[arg-type]
                scope.get("http_version", "1.1"),
                self.status_code,
            )
        await super().__call__(scope, receive, send)


def answered(
    metrics: GatewayMetrics,
    endpoint: str,
    model: str,
    status: int,
    started: float,
    version: str = "",
    error: ErrorType | None = None,
) -> None:
    """Record one client request answered without a stream: its ``status`` (and
    ``version``: :func:`gateway.flow.context.version_label`, "" before the request has a
    context) in ``gateway_requests_total`` and its latency since ``started``
    (``time.perf_counter()`` seconds at arrival) in both latency histograms, the answer
    being ready now (its first byte and its end go out together). A 499 (the client hung
    up: no byte reached it) has a duration but no time to first byte. ``model`` is "" when
    not known yet. An error is counted in ``gateway_request_errors_total`` as ``error``,
    or when None as its status says (:func:`gateway.core.outcomes.status_error_type`)."""
    metrics.count_request(endpoint, model, status, version)
    if error is None:
        error = status_error_type(status)
    if error is not None:
        metrics.count_error(model, error)
    elapsed = time.perf_counter() - started
    metrics.observe_latency(endpoint, model, None if status == 499 else elapsed, elapsed)


async def model_response(
    gw: Gateway,
    scope: Scope,
    receive: Receive,
    lease: RequestLease,
    trace: tracing.RequestTrace | None = None,
) -> Response:
    """Run one model request (stream or not) through the flow; the answer to send.

    ``lease`` owns what the request holds (:func:`serve` gives it back); ``trace``: its
    spans when tracing is on (:mod:`gateway.tracing`). Works on the raw
    ASGI ``scope``/``receive`` (no framework request object), because it is the data path:
    see :class:`gateway.app.GatewayApp`. Every typed outcome of the flow (a refusal, a
    backend's own error, a merged share, an opened answer) is rendered here.
    """
    cfg = gw.cfg
    metrics = gw.metrics
    endpoint: str = scope["path"]
    idh = cfg.server.request_id_header
    started = time.perf_counter()
    # one pass over the headers for what the gateway reads
    id_key, session_key_name, priority_key = gw.header_keys
    authorization = declared = rid_value = session = prio_value = encoding = ctype = None
    for k, v in scope["headers"]:
        if k == b"authorization":
            authorization = v
        elif k == b"content-length":
            declared = v
        elif k == b"content-type":
            ctype = v
        elif k == b"content-encoding":
            encoding = v
        elif k == id_key:
            rid_value = v
        elif k == session_key_name:
            session = v
        elif k == priority_key:
            prio_value = v
    rid = sane_request_id(rid_value)
    if logs.FIELDS_ON:  # on every log line of this request (JSON lines)
        logs.bind_request(rid)
    if trace is not None:
        trace.span.set_attribute("gateway.request_id", rid)
    if gw.shutting_down:
        answered(metrics, endpoint, "", 503, started, error=ErrorType.ADMISSION_REFUSED)
        return shutting_down_response(rid, idh)
    payload: dict[str, Any] | None = None
    try:
        key = check_client_key(gw, authorization)
        check_content_encoding(encoding)
        body = await read_body_counted(gw, receive, declared)
        # a form (audio uploads) is read for its fields and forwarded as it came
        form = endpoint in FORM_ROUTES or (endpoint not in MODEL_ROUTES and is_form(ctype))
        if form:
            payload = form_payload(body, ctype, endpoint)
            model: str = payload["model"]
        else:
            payload = parse_object(body)
            model = check_payload(payload, endpoint, cfg.proxy.max_n)
        await check_model(gw, model)
        # a follow-up goes where its previous response lives (gateway.flow.responses)
        previous = payload.get("previous_response_id") if endpoint == RESPONSES else None
        if isinstance(previous, str):
            await gw.responses.recall(previous)  # fleet mode: learned by another replica?
        pinned = gw.responses.follow_up(previous) if isinstance(previous, str) else None
    except Refusal as e:  # counted under the body's model when a backend serves it
        answered(metrics, endpoint, model_label(gw, payload), e.status, started,
                 error=refusal_error_type(e))
        log_refusal(e, endpoint, rid)
        return render(e, rid, idh)
    except ClientGone:
        metrics.client_disconnects.labels(endpoint).inc()
        answered(metrics, endpoint, "", 499, started)
        return HungUp()
    except UploadCut:
        answered(metrics, endpoint, "", 503, started, error=ErrorType.ADMISSION_REFUSED)
        return shutting_down_response(rid, idh)
    stream = payload.get("stream") is True
    if trace is not None:
        trace.span.set_attribute("gen_ai.request.model", model)
    cut = CutHandle()
    watch = ClientWatch(receive, cut)
    gate = gw.gate
    prio = gate.priority(prio_value, key, gw.cfg.auth.anonymous_max_priority)
    if gw.forecasts is not None:
        gw.forecasts.arrive(model, prio)
    seqs = engine_requests(endpoint, payload)  # prompts x n (embeddings: inputs)
    query = scope.get("query_string", b"")
    ctx = RequestContext(
        endpoint=endpoint,
        model=model,
        stream=stream,
        upstream=UpstreamRequest(
            scope["method"],
            endpoint + ("?" + query.decode("latin-1") if query else ""),
            forward_headers(scope["headers"], idh, rid, stream, private=(priority_key,)),
            body,
            stream,
        ),
        request_id=rid,
        cut=cut,
        lease=lease,
        session_key=session.decode("latin-1") if session is not None else None,
        started=started,
        priority=prio,
        pinned=pinned,
        trace=trace,
    )
    if seqs > 1:
        if endpoint == EMBEDDINGS:
            ctx.pooled_extra = seqs - 1
        else:
            ctx.places = seqs
    rollouts = gw.rollouts
    if rollouts is not None and rollouts.runs and pinned is None:
        # a model under a canary rollout: its version, before admission
        rollouts.assign(ctx, key.name if key is not None else None)
    try:
        if gate.enabled:
            # admission: entry (key limits), resource (saturation), scheduler (slot or queue)
            prompt = prompt_tokens(payload, gate.media_costs)  # read from the parsed body
            if form:  # its fields were read; the audio file is one media item
                prompt += gate.media_costs.audio
            est = estimate_tokens(
                prompt,
                completion_budget(payload),
                cfg.admission.default_max_tokens,
                0 if endpoint in GENERATES_NOTHING else seqs,
            )
            client = key.name if key is not None else (scope.get("client") or ("anonymous",))[0]
            admitting = gate.admit(model, client, key, prio, est, prompt, rid, lease)
            charge = await (
                admitting if trace is None else trace.timed("admission", admitting)
            )
            if charge is not None:  # settled with the answer's usage (ctx.settle)
                ctx.charge = charge
                ctx.ratelimit = list(ratelimit_headers(charge.verdict).items())
            cap = gate.max_tokens_cap()
            if cap is not None and not form and (capped := cap_max_tokens(payload, cap)):
                ctx.upstream.body = capped
        batching = gw.batching
        bound = None
        if batching is not None:
            if batching.merge and not stream and ctx.version is None:
                up = ctx.upstream
                mkey = merge_key(endpoint, payload, route_key(up.path, up.headers, idh))
                if mkey is not None:
                    ctx.merge_key, ctx.merge_part = mkey, part_of(endpoint, payload)
            # wait in the batcher's bucket; it binds a backend with room, or answers (a
            # merged request's share)
            acquiring = batching.acquire(ctx)
            got = await (acquiring if trace is None else trace.timed("queue", acquiring))
            if isinstance(got, Answer):
                watch.stop()
                answered(metrics, endpoint, model, got.status, started, got.version)
                return _render_answer(got, idh, rid, ctx.ratelimit)
            bound = got
        up = ctx.upstream
        resumable = first_request(
            endpoint, stream, up.body, up.headers, cfg.proxy.max_continuations
        )
        if resumable is not None:  # token ids asked for
            up.body = utf8_json(resumable.body)
        opened = await gw.pipeline.open(ctx, bound)
        if endpoint == RESPONSES:
            gw.responses.learn(opened, model)
    except Refusal as e:  # (admission's own carry the key's limits; later ones get them here)
        watch.stop()
        ctx.settle(NOTHING_GENERATED)  # no backend served it: the key pays no tokens
        answered(metrics, endpoint, model, e.status, started, version_label(None, ctx.version),
                 refusal_error_type(e))
        if rollouts is not None and ctx.version is not None:
            rollouts.observe_failure(ctx, e.status)
        log_refusal(e, endpoint, rid)
        e.headers.extend(ctx.ratelimit)
        return render(e, rid, idh)
    except BackendAnswer as e:
        watch.stop()
        ctx.settle(NOTHING_GENERATED)  # a backend's 429/5xx generated nothing
        answered(metrics, endpoint, model, e.status, started, e.version)
        if rollouts is not None and ctx.version is not None:
            rollouts.observe_failure(ctx, e.status)
        return render_backend_answer(e, idh, rid, ctx.ratelimit)
    except asyncio.CancelledError:
        watch.stop()
        if ctx.cut.reason is None:
            raise
        if ctx.cut.absorb() == Cut.CLIENT_GONE:
            metrics.client_disconnects.labels(endpoint).inc()
            answered(metrics, endpoint, model, 499, started, version_label(None, ctx.version))
            return HungUp()
        answered(metrics, endpoint, model, 503, started, version_label(None, ctx.version),
                 ErrorType.ADMISSION_REFUSED)
        return shutting_down_response(rid, idh)
    if opened.framer is not None:  # the stream's end observes it (Pipeline.stream_done)
        resumer = None
        if resumable is not None:
            resumer = StreamContinuer(gw.pipeline, ctx, opened, resumable.body,
                                      resumable.hide_ids)
        return _relay(gw, ctx, opened, watch, resumer)
    watch.stop()
    answer = gw.pipeline.finish_body(ctx, opened)
    answered(metrics, endpoint, model, answer.status, started, answer.version)
    if rollouts is not None and ctx.version is not None:  # TTFT: the whole answer's time
        ttft = time.perf_counter() - opened.sent_at if answer.status < 400 else None
        rollouts.observe(ctx, opened.backend, answer.status >= 500, ttft, load=opened.load,
                         prefill_load=opened.prefill_load, streamed=False)
    return _render_answer(answer, idh, rid, ctx.ratelimit)


def render_backend_answer(
    e: BackendAnswer, idh: str, rid: str, ratelimit: list[tuple[str, str]] | None = None
) -> Response:
    """A backend's own error answer that ended a request no backend took (a 429 or a 5xx,
    :meth:`gateway.flow.pipeline.Pipeline.open`), relayed as sent (:func:`_render_answer`),
    plus the gateway's ``retry-after`` / ``retry-after-ms`` (seconds, milliseconds) when it
    is a 429 that said not when (``e.retry_after_s`` set: case BUG-05)."""
    headers = e.headers
    if e.retry_after_s is not None:
        headers = [*headers, *encoded_headers(retry_after_headers(e.retry_after_s).items())]
    return _render_answer(Answer(e.status, e.body, headers), idh, rid, ratelimit)


def _render_answer(
    answer: Answer, idh: str, rid: str, ratelimit: list[tuple[str, str]] | None = None
) -> Response:
    """A finished non-stream answer: its headers, the request id ``rid`` in header ``idh``,
    the key's ``ratelimit`` headers where the answer has none of their family
    (:func:`key_limits_for`) and the body's length."""
    r = Response(answer.body, status_code=answer.status)
    r.raw_headers = [
        *answer.headers,
        (idh.encode(), rid.encode()),
        *key_limits_for(answer.headers, ratelimit or ()),
        (b"content-length", str(len(answer.body)).encode()),
    ]
    return r


def _relay(
    gw: Gateway,
    ctx: RequestContext,
    opened: Opened,
    watch: ClientWatch,
    resumer: StreamContinuer | None = None,
) -> RelayResponse:
    """The streaming answer: the backend's headers, the request id and the key's rate-limit
    headers (:func:`key_limits_for`); its end is recorded and the lease closed by
    :meth:`Pipeline.stream_done` (through ``resumer``, a stream that may be continued on
    another backend: :mod:`gateway.flow.continuing`)."""
    idh = gw.cfg.server.request_id_header
    headers = response_headers(opened.resp, idh.lower())
    headers.extend(key_limits_for(headers, ctx.ratelimit))
    headers.append((idh.encode(), ctx.request_id.encode()))
    assert opened.framer is not None
    on_done: Callable[[str, EventFramer, float | None], None] = (
        resumer.done if resumer is not None else functools.partial(
            gw.pipeline.stream_done, ctx, opened))
    if gw.rollouts is not None and ctx.version is not None:
        on_done = _observed(gw.rollouts, ctx, opened, on_done)
    return RelayResponse(
        opened.resp,
        headers,
        opened.data,
        opened.framer,
        watch,
        ctx.cut,
        gw.cfg.proxy.idle_timeout_s,
        on_done,
        kind=stream_kind(ctx.endpoint),
        heard=opened.backend.heard,
        resumer=resumer,
        itl=gw.metrics.stream_children(ctx.model, opened.backend.id)[1],
    )


def _observed(
    rollouts: Rollouts,
    ctx: RequestContext,
    opened: Opened,
    on_done: Callable[[str, EventFramer, float | None], None],
) -> Callable[[str, EventFramer, float | None], None]:
    """``on_done`` of a stream under a canary rollout, which also observes it on its
    version (:meth:`gateway.flow.rollouts.Rollouts.observe`): TTFT from the attempt's send
    to the first events sent (seconds), ITL the mean time between the events after them
    (``[DONE]`` not counted; none for a continued stream, whose events came from two
    backends), an error unless it ended ``ok``, the client gone (not observed), or with an
    in-band 4xx (the request's fault: counted, without latencies). The TTFT is compared at
    the backend's requests in flight at the send, the ITL at the larger of that and those
    in flight when the stream ended (what its decode met)."""
    framer0 = opened.framer
    first_events = opened.data.count(b"\n\n")

    def done(outcome: str, framer: EventFramer, first_sent_at: float | None) -> None:
        ended = time.perf_counter()  # the last event was relayed
        ended_load = opened.backend.in_flight  # what its decode met (Rollout.observe)
        on_done(outcome, framer, first_sent_at)
        if outcome == StreamOutcome.CLIENT_GONE:
            return
        client_error = False  # an in-band 4xx: the request's fault, and no latency sample
        if outcome == StreamOutcome.IN_BAND_ERROR:
            error = framer.error is None or framer.error.status >= 500
            client_error = not error
        else:
            error = outcome != StreamOutcome.OK
        ttft = itl = None
        if first_sent_at is not None and not client_error:
            ttft = first_sent_at - opened.sent_at
            gaps = framer.events - first_events - int(framer.saw_done)
            if framer is framer0 and gaps > 0:
                itl = (ended - first_sent_at) / gaps
        backend = opened.backend if framer is framer0 else None
        rollouts.observe(ctx, backend, error, ttft, itl, load=opened.load,
                         itl_load=max(opened.load, ended_load),
                         prefill_load=opened.prefill_load)

    return done


async def serve(gw: Gateway, scope: Scope, receive: Receive, send: Send) -> None:
    """Answer one model request on the raw ASGI interface, under its request lease: the
    lease is closed before a non-stream answer goes out, at a stream's end, and on every
    other exit (an error, the client gone, cancellation) when this returns."""
    started = time.perf_counter()
    trace = None if tracing.TRACER is None else tracing.start_request(
        scope["method"], scope["path"], scope["headers"])
    async with gw.new_lease() as lease:
        try:
            response = await model_response(gw, scope, receive, lease, trace)
        except Exception as e:
            log.exception("unexpected error on %s", scope["path"])
            response = error_response(
                500,
                f"Internal gateway error: {type(e).__name__}",
                SERVER_ERROR,
                "internal_error",
            )
            answered(gw.metrics, scope["path"], "", 500, started)
        if not isinstance(response, RelayResponse):
            lease.close()  # counts final before the client sees its answer
        if trace is None:
            await response(scope, receive, send)
        else:
            await _traced(trace, response, scope, receive, send)


async def _traced(trace: tracing.RequestTrace, response: Response, scope: Scope,
                  receive: Receive, send: Send) -> None:
    """Send ``response`` under ``trace``: a relay span when a backend's answer is relayed
    (a stream: until its end), then the request span ended with the status."""
    relay = trace.relay(isinstance(response, RelayResponse)) if trace.backend else None
    try:
        await response(scope, receive, send)
    finally:
        if relay is not None:
            trace.end_relay(relay)
        trace.end(response.status_code)


class _Served(Response):
    """The framework route's answer: :func:`serve` runs when the framework sends it."""

    def __init__(self, gw: Gateway) -> None:
        self.gw = gw
        self.background = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await serve(self.gw, scope, receive, send)


async def proxy(request: Request) -> Response:
    """The framework route for model requests (the same code as the ASGI fast path)."""
    return _Served(_gateway(request))


def install_routes(app_router: FastAPI, passthrough: list[str]) -> None:
    """Register the OpenAI routes and the vLLM pass-through routes on ``app``.

    Routes go straight on the app (no included routers): one less dispatch layer per
    request on the hot path."""
    for path in (*SERVED_ROUTES, *passthrough):
        app_router.add_api_route(path, proxy, methods=["POST"], include_in_schema=False)
    models.install_routes(app_router)
