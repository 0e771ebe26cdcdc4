"""Mid-stream continuation, the flow's side (issue 17): a chat / completions stream whose
backend failed after events reached the client goes on on another backend.

:class:`StreamContinuer` is the :class:`gateway.proxy.relay.Resumer` of one stream: the
relay feeds its :attr:`transcript` everything the client is sent and, on a failure, awaits
:meth:`StreamContinuer.resume`. That asks :func:`gateway.proxy.continuation.continuable`
(the request as the gateway sent it, the client's ``x-gateway-continuation`` header, the
continuations used against ``proxy.max_continuations``); when ok it records the failed
attempt (a breaker failure, as a broken stream is), spends one retry from the retry budget
and opens a new attempt through :meth:`gateway.flow.pipeline.Pipeline.reopen` (another
backend of the model, never one this request tried) with
:func:`gateway.proxy.continuation.continuation_body` as its body. Lease rules are the
pipeline's (docs/architecture.md section 3): the failed attempt is ended and its response
handed over (the relay closed it) before the new attempt starts; the last one is ended by
:meth:`gateway.flow.pipeline.Pipeline.stream_done`.

Before the body is built, where the last event with text carried several token ids, a
backend of the model says (``POST /detokenize``, :func:`detokenize`) whether those ids end
inside a UTF-8 sequence; the ids that do are held back, so a completions continuation's
prompt ends on a whole character and the produced count is the tokens whose text the
client has (:func:`gateway.proxy.continuation.seam_ids`).

Each continuation is counted in ``gateway_stream_continuations_total{reason,outcome}``
(``reason``: the stream error code; ``outcome``: ``continued``, ``closed``,
``no_backend`` (none untried, or every try failed), ``no_budget`` (the retry budget is
spent), ``shutdown``, or the verdict's reason) and logged with both backends.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, NamedTuple

import aiohttp

from gateway.core.wire_json import utf8_json
from gateway.flow.candidates import candidates
from gateway.flow.context import Opened, RequestContext
from gateway.proxy.continuation import (
    ENDPOINTS,
    HEADER,
    continuable,
    continuation_body,
    partial_tail,
    seam_drops,
    seam_ids,
    with_token_ids,
)
from gateway.proxy.relay import Resumed, StreamOutcome
from gateway.proxy.sse import EventFramer
from gateway.proxy.stitch import Stitcher, closing_events
from gateway.proxy.transcript import StreamTranscript
from gateway.proxy.upstream import UpstreamFailure, UpstreamRequest

if TYPE_CHECKING:
    from gateway.flow.pipeline import Pipeline

log = logging.getLogger("gateway.flow.continuing")

DETOKENIZE_MAX_BYTES = 1 << 20
"""Largest ``/detokenize`` answer read (bytes): a few tokens' text is far less."""


class FirstAttempt(NamedTuple):
    """A continuable stream's first attempt: the JSON ``body`` it is sent, and ``hide_ids``:
    the client did not ask for vLLM's token ids itself (``return_token_ids: true``), so the
    relay hides those the gateway asked for
    (:func:`gateway.proxy.continuation.hide_token_ids`)."""

    body: dict[str, Any]
    hide_ids: bool


def first_request(
    endpoint: str,
    stream: bool,
    body: bytes,
    headers: Mapping[str, str],
    max_continuations: int,
) -> FirstAttempt | None:
    """A continuable stream's first attempt (``body``: the bytes the gateway would send; the
    attempt's body is :func:`gateway.proxy.continuation.with_token_ids` of it), or None
    when continuation is off for it: not a stream, not chat / completions,
    ``max_continuations`` 0, the forwarded ``headers`` say ``x-gateway-continuation: off``,
    or a body that is not a JSON object.

    Both endpoints ask for the token ids: completions continue from them; chat continues
    from the text, but counts the tokens produced by them (the continuation's budget and
    the client's usage) and its prompt tokens by ``prompt_token_ids`` (the continuation's
    prompt re-tokenizes the text, which may count otherwise). Without ids the count is the
    token events, a lower bound: vLLM sends several tokens in one event when its output lags
    (``--stream-interval`` > 1, or a busy server), and the continuation then generated more
    than ``max_tokens`` in all and reported the wrong usage (measured with two real vLLM
    servers, one SIGKILLed, ``tests/realvllm/test_continuation_real_vllm.py``)."""
    if not stream or endpoint not in ENDPOINTS or max_continuations <= 0:
        return None
    if headers.get(HEADER, "").strip().lower() == "off":
        return None
    try:
        request = json.loads(body)
    except ValueError:
        return None
    if not isinstance(request, dict):
        return None
    return FirstAttempt(with_token_ids(endpoint, request),
                        request.get("return_token_ids") is not True)


async def detokenize(
    p: Pipeline, ctx: RequestContext, model: str, ids: list[int]
) -> str | None:
    """The text of token ``ids`` as a backend of ``model`` that ``ctx`` has not tried decodes
    them (vLLM's ``POST /detokenize``: ``{"model", "tokens"}`` in, ``{"prompt": text}``
    out; the simulator serves it too), within ``health.timeout_s`` seconds; None when no
    such backend is routable or it gave no such answer (any error, status or timeout)."""
    backends = candidates(p.fleet, ctx.model, ctx.tried, p.clock(), ctx.version,
                          ctx.fallback_version)
    if not backends:
        return None
    b = backends[0]
    body = json.dumps({"model": model, "tokens": ids}).encode()
    req = UpstreamRequest("POST", "/detokenize", {
        "content-type": "application/json", "accept-encoding": "identity",
        p.id_header: ctx.request_id}, body, False)
    try:
        async with asyncio.timeout(p.cfg.health.timeout_s):
            resp = await p.transport.send(b, req, b.api_key)
            try:
                data = b""
                while chunk := await resp.content.readany():
                    data += chunk
                    if len(data) > DETOKENIZE_MAX_BYTES:
                        return None
            finally:
                resp.release()
        if resp.status != 200:
            return None
        text = json.loads(data).get("prompt")
    except (UpstreamFailure, TimeoutError, aiohttp.ClientError, ValueError, AttributeError):
        return None
    return text if isinstance(text, str) else None


class StreamContinuer:
    """The continuations of one stream (module docstring). ``request``: the JSON body the
    gateway sent the first attempt (:func:`gateway.proxy.continuation.with_token_ids`);
    ``opened``: the first attempt's accepted start; ``hide_ids``: the client did not ask
    for token ids (the relay hides them, :attr:`hide_ids`)."""

    def __init__(
        self, pipeline: Pipeline, ctx: RequestContext, opened: Opened, request: dict[str, Any],
        hide_ids: bool = True,
    ) -> None:
        self.pipeline = pipeline
        self.hide_ids = hide_ids
        self.ctx = ctx
        self.request = request
        self.current = opened
        self.first = opened  # the attempt whose events the client got first (its TTFT)
        self.transcript = StreamTranscript(ctx.endpoint)
        self.used = 0  # continuations sent
        self.recorded = False  # the current attempt's end is already recorded
        self.stitcher: Stitcher | None = None
        self.closed = False  # the stream was closed by closing events (no error seen)

    async def resume(self, code: str) -> Resumed | bytes | None:
        """The relay's stream failed with ``code`` (:class:`gateway.proxy.relay.Resumer`)."""
        ctx, p = self.ctx, self.pipeline
        m = p.accounting.metrics.stream_continuations
        verdict = continuable(
            ctx.endpoint, self.request, self.transcript, headers=ctx.upstream.headers,
            used=self.used, max_continuations=p.cfg.proxy.max_continuations,
        )
        if verdict.closes:  # the client gets its end; the attempt still broke
            m.labels(code, "closed").inc()
            p.stream_failed(ctx, self.current, code)
            self.recorded = self.closed = True
            return closing_events(ctx.endpoint, self.request, self.transcript, verdict)
        if not verdict.ok:
            m.labels(code, str(verdict.reason)).inc()
            log.info("stream not continued (%s): %s failed (%s) after %d events [request %s]",
                     verdict.reason, self.current.backend.id, code, self.transcript.events,
                     ctx.request_id)
            return None
        failed = self.current.backend
        p.stream_failed(ctx, self.current, code)  # ends it: a new attempt may start
        self.recorded = True
        await self._settle_seam()
        body = continuation_body(ctx.endpoint, self.request, self.transcript)
        ctx.upstream.body = utf8_json(body)
        why = "no_backend"  # every try failed (each recorded by the pipeline)
        while self.used < p.cfg.proxy.max_continuations:
            self.used += 1
            try:
                opened = await p.reopen(ctx, code)
            except UpstreamFailure:
                continue  # recorded by the pipeline; another backend may take it
            if isinstance(opened, str):
                why = opened
                break
            assert opened.framer is not None
            self.current, self.recorded = opened, False
            self.stitcher = Stitcher(ctx.endpoint, self.request, self.transcript)
            m.labels(code, "continued").inc()
            log.info(
                "stream continued: %s failed (%s) after %d events; continued on %s "
                "[request %s]", failed.id, code, self.transcript.events, opened.backend.id,
                ctx.request_id,
            )
            return Resumed(
                opened.resp, opened.data, opened.framer, self.stitcher, opened.backend.heard,
                p.accounting.metrics.stream_children(ctx.model, opened.backend.id)[1],
            )
        m.labels(code, why).inc()
        log.info("stream not continued (%s): %s failed (%s) after %d events [request %s]",
                 why, failed.id, code, self.transcript.events, ctx.request_id)
        return None

    async def _settle_seam(self) -> None:
        """Hold back the trailing settled ids that end inside a UTF-8 sequence, asking a
        backend of the model this request has not tried to decode them
        (:func:`gateway.proxy.continuation.seam_ids`); nothing when no check is needed or
        no backend answers it (then the continuation goes on as the ids say)."""
        t = self.transcript
        ids = seam_ids(t)
        model = self.request.get("model")
        if ids is None or not isinstance(model, str):
            return
        for k in range(seam_drops(t) + 1):
            text = await detokenize(self.pipeline, self.ctx, model, ids[: len(ids) - k])
            if text is None:
                return
            if not partial_tail(text):
                t.unsettle(k)
                return

    def done(self, outcome: str, framer: EventFramer, first_sent_at: float | None) -> None:
        """The relay's ``on_done``: the stream's end, recorded by
        :meth:`gateway.flow.pipeline.Pipeline.stream_done` on the last attempt, with the
        usage the client was given (prompt tokens once, completion tokens summed)."""
        usage = framer.usage()
        st = self.stitcher
        if st is not None:
            prompt = self.transcript.prompt_tokens()
            if prompt is None and usage is not None:
                prompt = max(0, usage[0] - st.prior)
            usage = None if prompt is None else (prompt, st.prior + st.own_tokens())
        if self.closed:
            outcome = StreamOutcome.OK  # the client saw a whole stream
        self.pipeline.stream_done(
            self.ctx, self.current, outcome, framer, first_sent_at,
            usage=usage, continued=self.used > 0, recorded=self.recorded,
            first_backend=self.first.backend,
        )
