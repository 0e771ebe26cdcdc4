"""One upstream attempt's I/O: send, then read what must be read before the client may see
anything (a non-stream's whole body, a stream's first complete events).

Raises :class:`gateway.proxy.upstream.UpstreamFailure` for every way an attempt fails; the
response is closed on any failure. Decisions about the outcome (retry, breaker, metrics)
are the caller's (:mod:`gateway.flow.pipeline`).
"""

from __future__ import annotations

import asyncio
import time

import aiohttp

from gateway.config import ProxyConfig
from gateway.core.vocab import FailureKind
from gateway.fleet.backend import Backend
from gateway.flow.context import Opened, RequestContext
from gateway.proxy.sse import EventFramer, has_event
from gateway.proxy.upstream import (
    Transport,
    UpstreamFailure,
    UpstreamResponse,
    response_headers,
)

EVENT_STREAM = "text/event-stream"


# Routes whose every 2xx is a JSON object (OpenAI's API reference; vLLM's own routes)
JSON_ROUTES = frozenset(
    {"/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses"}
)
UTF8_BOM = b"\xef\xbb\xbf"
"""A UTF-8 byte order mark: JSON text may carry one (RFC 8259 section 8.1 lets a parser
ignore it; Python's ``json.loads`` on bytes and the SDKs do), so it is skipped, not refused."""


def is_json_answer(endpoint: str, status: int, resp: UpstreamResponse, body: bytes) -> bool:
    """False for a 2xx that cannot be the answer it claims to be: on a JSON route any 2xx
    (a 204 included), elsewhere a 200 with a JSON ``content-type``, whose body is empty or
    does not start (after a UTF-8 BOM and whitespace) with ``{`` or ``[`` (an HTML page from
    a proxy in front of vLLM, an empty body, bytes that are not UTF-8). A compressed body is
    not looked into (its bytes are not JSON text) and other content types on other routes
    (an audio transcription's ``text/plain``, a 204) are taken as they are.

    Only the first bytes are looked at, never the whole body parsed (the hot path): a body
    that starts as JSON but is cut short (truncated, not valid JSON) passes and reaches the
    client as the backend sent it, a documented limit. Reports: docs/wire-reports.md
    ("status")."""
    headers = resp.headers
    coding = headers.get("content-encoding")
    if coding is not None and coding.strip().lower() not in ("", "identity"):
        return True
    if endpoint not in JSON_ROUTES and (status != 200 or "json" not in headers.get(
        "content-type", ""
    )):
        return True
    head = body[:64]
    if head.startswith(UTF8_BOM):
        head = head[3:]
    return head.lstrip()[:1] in (b"{", b"[")


async def send_attempt(
    transport: Transport,
    backend: Backend,
    ctx: RequestContext,
    proxy: ProxyConfig,
    id_header: str,
) -> Opened:
    """Run one attempt of ``ctx`` on ``backend`` with the gateway's key for it (its
    :attr:`Opened.sent_at` is ``time.perf_counter()`` at the send).

    One timer covers it: ``proxy.ttfb_timeout_s`` until the response (for streams: its
    first event) arrives, then ``proxy.idle_timeout_s`` re-armed at every chunk of a body.
    A 429, a 5xx, and a 401/403 from a backend whose key the probes found refused
    (``config_error``) are failures carrying the backend's answer (``status``, ``body``,
    ``headers``; the body of any answer >= 400 read up to ``proxy.max_error_body_bytes``,
    the rest dropped: :func:`_read_body`); a 2xx that is not the JSON it must be
    (:func:`is_json_answer`) is a ``bad_answer`` failure (retried elsewhere, never the
    client's answer); every other answer is :class:`Opened`.
    """
    resp: UpstreamResponse | None = None
    waiting_first_byte = True
    sent_at = time.perf_counter()
    load = backend.in_flight  # its load as this attempt meets it (a canary's comparison)
    prefill = backend.prefill_load  # the prefills ahead of it, this one's included; at
    # its answer, the larger with those that came after it (Opened.prefill_load)
    try:
        async with asyncio.timeout(proxy.ttfb_timeout_s) as timer:
            resp = await transport.send(backend, ctx.upstream, backend.api_key)
            status = resp.status
            if ctx.stream and status == 200 and resp.content_type == EVENT_STREAM:
                framer = EventFramer()
                first = await _first_events(backend, resp, framer)
                return Opened(backend, resp, first, framer, sent_at, load,
                              max(prefill, backend.prefill_load))
            waiting_first_byte = False
            limit = proxy.max_error_body_bytes if status >= 400 else None
            body = await _read_body(resp, timer, proxy.idle_timeout_s, limit)
            if 200 <= status < 300 and not is_json_answer(ctx.endpoint, status, resp, body):
                resp.release()
                raise UpstreamFailure(
                    backend,
                    FailureKind.BAD_ANSWER,
                    f"backend answered {status} without a JSON body ({len(body)} bytes, "
                    f"content-type {resp.headers.get('content-type')!r})",
                )
            # 401/403: the gateway's own key is wrong only when the probes found this
            # backend refusing it (``config_error``); then another backend may be set up
            # right. Otherwise it is about this request (case BUG-06): passed through
            # unchanged, like every 4xx, and never a breaker failure.
            if (
                status == 429
                or status >= 500
                or (status in (401, 403) and backend.config_error is not None)
            ):
                kind = (
                    FailureKind.RATE_LIMITED
                    if status == 429
                    else FailureKind.STATUS
                    if status >= 500
                    else FailureKind.AUTH
                )
                resp.release()  # read whole (or closed, cut short): the connection may serve again
                raise UpstreamFailure(
                    backend,
                    kind,
                    f"backend answered {status}",
                    status,
                    body,
                    response_headers(resp, id_header),
                )
            return Opened(backend, resp, body, None, sent_at, load,
                          max(prefill, backend.prefill_load))
    except TimeoutError:
        if resp is not None:
            resp.close()
        if waiting_first_byte:
            raise UpstreamFailure(
                backend,
                FailureKind.TTFB_TIMEOUT,
                f"no answer within {proxy.ttfb_timeout_s:g} s (ttfb_timeout_s)",
            ) from None
        raise UpstreamFailure(
            backend,
            FailureKind.IDLE_TIMEOUT,
            f"response body stalled for {proxy.idle_timeout_s:g} s (idle_timeout_s)",
        ) from None
    except (aiohttp.ClientError, ConnectionError) as e:
        if resp is not None:
            resp.close()
        raise UpstreamFailure(
            backend, FailureKind.DISCONNECTED, f"connection broke in the response: {e!r}"
        ) from None
    except BaseException:
        if resp is not None:
            resp.close()
        raise


async def _read_body(
    resp: UpstreamResponse, timer: asyncio.Timeout, idle_s: float, limit: int | None = None
) -> bytes:
    """The whole body; ``idle_s`` bounds each silence (re-arms ``timer``), not the total.

    ``limit`` (bytes; ``proxy.max_error_body_bytes`` for an error answer, None: no bound):
    past it, reading stops, the response is closed (the rest is never read, the connection
    not reused) and the first ``limit`` bytes are returned: the answer keeps its status and
    headers, its body is cut short."""
    loop = asyncio.get_running_loop()
    timer.reschedule(loop.time() + idle_s)
    content = resp.content
    parts: list[bytes] = []
    size = 0
    while chunk := await content.readany():
        parts.append(chunk)
        size += len(chunk)
        if limit is not None and size > limit:
            resp.close()
            return b"".join(parts)[:limit]
        timer.reschedule(loop.time() + idle_s)
    return parts[0] if len(parts) == 1 else b"".join(parts)


async def _first_events(backend: Backend, resp: UpstreamResponse, framer: EventFramer) -> bytes:
    """Read until at least one complete event with a field is in (comments alone, such as
    ``: ping``, do not commit the stream: a failure after them may still be retried),
    under the caller's TTFB timer."""
    content = resp.content
    got: list[bytes] = []
    while True:
        chunk = await content.readany()
        if not chunk:
            raise UpstreamFailure(
                backend, FailureKind.DISCONNECTED, "stream ended before its first event"
            )
        out = framer.feed(chunk)
        if out:
            got.append(out)
            if has_event(out):
                return out if len(got) == 1 else b"".join(got)
