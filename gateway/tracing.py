"""OpenTelemetry spans of a request (optional: the ``otel`` extra).

When tracing is on (:func:`configure`: ``server.otel`` or ``OTEL_EXPORTER_OTLP_ENDPOINT``
set, and ``opentelemetry-sdk`` importable), each model request gets one trace::

    POST /v1/chat/completions   (SERVER; the incoming traceparent's child when one came)
    |- admission                (entry limits, saturation, the scheduler's queue)
    |- queue                    (the predictive batcher's bucket, when batching is on)
    |- attempt                  (CLIENT, one per upstream attempt: backend, attempt number,
    |                            outcome; its traceparent is sent to the backend)
    `- relay                    (writing the answer to the client; a stream's whole relay)

The request path holds a :class:`RequestTrace` (``RequestContext.trace``) only when
:data:`TRACER` is set; otherwise every hook is one ``is None`` check (measured in the
README, "Logs and traces"). Nothing here imports OpenTelemetry unless :func:`configure`
or :func:`install` runs, so a gateway without the extra neither fails nor pays for it.
Span names and attributes follow the OpenTelemetry semantic conventions for HTTP
(``http.request.method``, ``url.path``, ``http.response.status_code``, ``error.type``);
the gateway's own are under ``gateway.*``.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SpanExporter
    from opentelemetry.trace import Span, Tracer

    from gateway.config import OtelConfig

log = logging.getLogger("gateway.tracing")

TRACER: Tracer | None = None
"""The gateway's tracer while tracing is on; None (the default) when off."""
_PROVIDER: TracerProvider | None = None
_PROPAGATOR: Any = None  # W3C Trace Context (TraceContextTextMapPropagator), once installed
_T = TypeVar("_T")
_TRACE_HEADERS = (b"traceparent", b"tracestate")


EXPORT_LOGGERS = (
    "opentelemetry.exporter.otlp.proto.http.trace_exporter",  # each failed export, retry
    "opentelemetry.sdk._shared_internal",  # the batch processor: export raised, queue full
)
"""The OpenTelemetry loggers that write a line per export while the collector is down."""


class OncePerInterval(logging.Filter):
    """Lets one record through per ``interval_s`` seconds (default 60; ``clock``:
    monotonic seconds) and drops the others, counting them: the next line let through
    says how many were not shown. On the OTLP exporter's loggers (:data:`EXPORT_LOGGERS`),
    a collector that is down costs one line a minute instead of one per export and retry.
    """

    def __init__(self, interval_s: float = 60.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self.interval_s = interval_s
        self._clock = clock
        self._last: float | None = None
        self.suppressed = 0

    def filter(self, record: logging.LogRecord) -> bool:
        now = self._clock()
        if self._last is not None and now - self._last < self.interval_s:
            self.suppressed += 1
            return False
        if self.suppressed:
            record.msg = (f"{record.getMessage()} ({self.suppressed} similar lines in the "
                          f"last {now - (self._last or 0.0):.0f} s not shown)")
            record.args = ()
            self.suppressed = 0
        self._last = now
        return True


def quiet_export_logs(interval_s: float = 60.0) -> None:
    """Put one :class:`OncePerInterval` on each of :data:`EXPORT_LOGGERS` (once per
    process: a second call changes nothing)."""
    for name in EXPORT_LOGGERS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, OncePerInterval) for f in logger.filters):
            logger.addFilter(OncePerInterval(interval_s))


def configure(cfg: OtelConfig, exporter: SpanExporter | None = None) -> bool:
    """Turn tracing on for this process when ``cfg`` (``server.otel``) or the
    ``OTEL_EXPORTER_OTLP_ENDPOINT`` / ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` environment
    names a collector (or ``exporter`` is given): an SDK ``TracerProvider`` (resource
    ``service.name``, sampler ``ParentBased(TraceIdRatioBased(sample_ratio))``) exporting
    through a ``BatchSpanProcessor`` to OTLP/HTTP (``endpoint`` + ``/v1/traces``), its
    failure lines at most one a minute (:func:`quiet_export_logs`); ``service.version``
    is the installed package's (:func:`gateway.signals.gateway_version`). Returns
    whether tracing is on; logs a warning and stays off when the SDK or the OTLP exporter
    is not installed."""
    env = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or os.environ.get(
        "OTEL_EXPORTER_OTLP_ENDPOINT"
    )
    if not cfg.enabled or (exporter is None and not cfg.endpoint and not env):
        return False
    try:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

        if exporter is None:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
                OTLPSpanExporter,
            )

            url = cfg.endpoint.rstrip("/") + "/v1/traces" if cfg.endpoint else None
            exporter = OTLPSpanExporter(endpoint=url)  # None: the environment's URL
    except ImportError as e:
        log.warning("tracing is configured but %s is not installed: no spans "
                    "(pip install 'llm-gateway[otel]')", e.name)
        return False
    from gateway.signals import gateway_version

    quiet_export_logs()
    provider = TracerProvider(
        resource=Resource.create({"service.name": cfg.service_name,
                                  "service.version": gateway_version()}),
        sampler=ParentBased(TraceIdRatioBased(cfg.sample_ratio)),
    )
    provider.add_span_processor(BatchSpanProcessor(exporter))
    install(provider)
    log.info("tracing on: spans exported over OTLP (%s)",
             cfg.endpoint or env or type(exporter).__name__)
    return True


def install(provider: TracerProvider | None) -> None:
    """Use ``provider``'s tracer for the gateway's spans (None: tracing off). Process-wide,
    not OpenTelemetry's global provider (which can be set once only): tests install
    an SDK provider with an in-memory exporter."""
    global TRACER, _PROVIDER, _PROPAGATOR
    if provider is not None:
        from opentelemetry.trace.propagation.tracecontext import (
            TraceContextTextMapPropagator,
        )

        _PROPAGATOR = TraceContextTextMapPropagator()
    _PROVIDER = provider
    TRACER = provider.get_tracer("llm-gateway") if provider is not None else None


def shutdown() -> None:
    """Flush and stop the installed provider (spans still batched are exported)."""
    provider = _PROVIDER
    install(None)
    if provider is not None:
        provider.shutdown()


class RequestTrace:
    """The spans of one request. ``span``: the request's SERVER span, a child of the
    incoming ``traceparent`` when there is one; ``outcome``: a stream's end
    (``Pipeline.stream_done`` sets it) for the relay span; ``backend``: the latest
    attempt's backend id."""

    __slots__ = ("backend", "context", "outcome", "span", "tracer")

    def __init__(self, tracer: Tracer, method: str, path: str,
                 headers: Iterable[tuple[bytes, bytes]]) -> None:
        from opentelemetry.trace import SpanKind, set_span_in_context

        carrier = {k.decode("latin-1"): v.decode("latin-1")
                   for k, v in headers if k in _TRACE_HEADERS}
        parent = _PROPAGATOR.extract(carrier) if carrier else None
        self.tracer = tracer
        self.span: Span = tracer.start_span(
            f"{method} {path}", context=parent, kind=SpanKind.SERVER,
            attributes={"http.request.method": method, "url.path": path},
        )
        self.context: Context = set_span_in_context(self.span, parent)
        self.outcome: str | None = None
        self.backend: str | None = None

    def child(self, name: str, attributes: dict[str, Any] | None = None) -> Span:
        """A span under the request span, started now (the caller ends it)."""
        return self.tracer.start_span(name, context=self.context, attributes=attributes)

    async def timed(self, name: str, step: Awaitable[_T]) -> _T:
        """Await ``step`` inside a child span ``name`` (admission, queue); an exception
        is recorded on the span (``error.type``) and raised."""
        span = self.child(name)
        try:
            return await step
        except BaseException as e:
            span.set_attribute("error.type", type(e).__name__)
            raise
        finally:
            span.end()

    def attempt(self, backend: str, number: int, headers: dict[str, str]) -> Span:
        """Start attempt ``number`` (1, 2, ...) on ``backend`` as a CLIENT span and put
        its ``traceparent`` (and ``tracestate``) into ``headers``, the upstream request's
        (W3C Trace Context; vLLM continues the trace from it)."""
        from opentelemetry.trace import SpanKind, set_span_in_context

        self.backend = backend
        span = self.tracer.start_span(
            "attempt", context=self.context, kind=SpanKind.CLIENT,
            attributes={"gateway.backend": backend, "gateway.attempt": number},
        )
        _PROPAGATOR.inject(headers, set_span_in_context(span))
        return span

    def relay(self, stream: bool) -> Span:
        """Start the relay span (the answer written to the client)."""
        return self.child("relay", {"gateway.backend": self.backend or "",
                                    "gateway.stream": stream})

    def end_relay(self, span: Span) -> None:
        """End the relay span with the stream's outcome when known."""
        if self.outcome is not None:
            span.set_attribute("gateway.outcome", str(self.outcome))
            if self.outcome != "ok":
                span.set_attribute("error.type", str(self.outcome))
        span.end()

    def end(self, status: int) -> None:
        """End the request span with the answer's HTTP ``status`` (an error from 500)."""
        from opentelemetry.trace import StatusCode

        span = self.span
        span.set_attribute("http.response.status_code", status)
        if status >= 500:
            span.set_status(StatusCode.ERROR)
            span.set_attribute("error.type", str(status))
        span.end()


def end_attempt(span: Span, outcome: str, status: int | None = None) -> None:
    """End an attempt span: ``outcome`` (``opened``, or the failure kind / cut reason),
    the backend's HTTP ``status`` when it answered."""
    span.set_attribute("gateway.outcome", str(outcome))
    if status is not None:
        span.set_attribute("http.response.status_code", status)
    if outcome != "opened":
        span.set_attribute("error.type", str(outcome))
    span.end()


def start_request(method: str, path: str,
                  headers: Iterable[tuple[bytes, bytes]]) -> RequestTrace | None:
    """A request's trace when tracing is on (:data:`TRACER`), else None. The request
    path adds ``gateway.request_id`` and ``gen_ai.request.model`` once it knows them."""
    tracer = TRACER
    return None if tracer is None else RequestTrace(tracer, method, path, headers)
