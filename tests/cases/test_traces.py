"""OpenTelemetry spans of real requests (issue 19, logs and traces): the gateway in a
thread in front of scripted backends, the openai SDK as client, spans collected with the
SDK's in-memory exporter (:func:`gateway.tracing.install`), and one trace exported over
OTLP/HTTP to a local receiver (:func:`gateway.tracing.configure`)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import openai
import pytest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from gateway import tracing
from gateway.config import OtelConfig
from tests.support.scripted import Conn, Received, completion_obj, default_script, wait_for

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"
MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    """Tracing on for the test, every ended span kept in memory."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing.install(provider)
    yield exporter
    tracing.install(None)


def request_trace(exporter: InMemorySpanExporter) -> tuple[ReadableSpan, list[ReadableSpan]]:
    """The one request span (waited for: it ends after the answer is written) and its
    children, in start order."""
    assert wait_for(lambda: any(s.name.startswith("POST ")
                                for s in exporter.get_finished_spans()), 10)
    got = exporter.get_finished_spans()
    (request,) = [s for s in got if s.name.startswith("POST ")]
    assert request.context is not None
    children = sorted((s for s in got if s.parent is not None
                       and s.parent.span_id == request.context.span_id),
                      key=lambda s: s.start_time or 0)
    return request, children


def ids(traceparent: str) -> tuple[str, str]:
    """A W3C ``traceparent``'s trace id and parent span id (hex)."""
    version, trace_id, span_id, _flags = traceparent.split("-")
    assert version == "00"
    return trace_id, span_id


def client(gw: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0, timeout=10)


def test_a_stream_has_admission_queue_attempt_and_relay_spans_in_the_callers_trace(
    backends, gateway, spans
):
    """A streamed chat completion with the batcher on and an incoming ``traceparent``: one
    SERVER span, the caller's child (its trace id kept), with children admission, queue,
    attempt (backend, attempt 1, opened) and relay (outcome ok); the backend received a
    ``traceparent`` of the same trace naming the attempt span."""
    a = backends()
    gw = gateway({"a": a}, batcher={"enabled": True})
    stream = client(gw).chat.completions.create(
        model="m1", messages=MESSAGES, stream=True,
        extra_headers={"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01"},
    )
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == "ok"
    request, children = request_trace(spans)
    assert request.context is not None and request.parent is not None
    assert f"{request.context.trace_id:032x}" == TRACE_ID
    assert f"{request.parent.span_id:016x}" == PARENT_ID
    assert request.name == "POST /v1/chat/completions"
    assert request.attributes is not None
    assert request.attributes["http.response.status_code"] == 200
    assert request.attributes["gen_ai.request.model"] == "m1"
    assert [s.name for s in children] == ["admission", "queue", "attempt", "relay"]
    attempt, relay = children[2], children[3]
    assert attempt.attributes is not None and relay.attributes is not None
    assert attempt.attributes["gateway.backend"] == "a"
    assert attempt.attributes["gateway.attempt"] == 1
    assert attempt.attributes["gateway.outcome"] == "opened"
    assert relay.attributes["gateway.outcome"] == "ok"
    assert relay.attributes["gateway.stream"] is True
    (sent,) = a.data_requests
    assert attempt.context is not None
    assert ids(sent.headers["traceparent"]) == (TRACE_ID, f"{attempt.context.span_id:016x}")


def test_a_retried_request_has_two_attempt_spans(backends, gateway, spans):
    """The first attempt gets a 500, the retry (on the other backend) the answer: two
    attempt spans, numbered 1 and 2, on two backends, the first ``status`` / 500, the
    second ``opened``; each upstream request carried its own attempt's traceparent."""
    first = threading.Event()

    async def fails_once(req: Received, conn: Conn) -> None:
        if req.path.startswith("/v1/chat") and not first.is_set():
            first.set()
            await conn.send_json(500, {"error": {"message": "boom", "type": "x"}})
            return
        if req.path.startswith("/v1/chat"):
            await conn.send_json(200, completion_obj("ok"))
            return
        await default_script(req, conn)

    a, b = backends(fails_once), backends(fails_once)
    gw = gateway({"a": a, "b": b})
    answer = client(gw).chat.completions.create(model="m1", messages=MESSAGES)
    assert answer.choices[0].message.content == "ok"
    request, children = request_trace(spans)
    attempts = [s for s in children if s.name == "attempt"]
    assert len(attempts) == 2
    first_span, second = (s.attributes or {} for s in attempts)
    assert (first_span["gateway.attempt"], second["gateway.attempt"]) == (1, 2)
    assert {first_span["gateway.backend"], second["gateway.backend"]} == {"a", "b"}
    assert first_span["gateway.outcome"] == "status"
    assert first_span["http.response.status_code"] == 500
    assert second["gateway.outcome"] == "opened"
    assert [s.name for s in children][-1] == "relay"
    sent = {ids(r.headers["traceparent"]) for r in a.data_requests + b.data_requests}
    assert request.context is not None
    assert sent == {(f"{request.context.trace_id:032x}", f"{s.context.span_id:016x}")
                    for s in attempts if s.context is not None}


def test_spans_are_exported_over_otlp_http_when_an_endpoint_is_configured(backends,
                                                                          gateway):
    """``server.otel.endpoint``'s path: :func:`gateway.tracing.configure` sends the spans
    to ``<endpoint>/v1/traces`` as OTLP protobuf (a local receiver records the POSTs)."""
    posts: list[tuple[str, str, bytes]] = []

    class Receiver(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers["content-length"]))
            posts.append((self.path, self.headers["content-type"], body))
            self.send_response(200)
            self.send_header("content-length", "0")
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    collector = ThreadingHTTPServer(("127.0.0.1", 0), Receiver)
    threading.Thread(target=collector.serve_forever, daemon=True).start()
    try:
        endpoint = f"http://127.0.0.1:{collector.server_address[1]}"
        assert tracing.configure(OtelConfig(endpoint=endpoint, service_name="gw-test"))
        ended = InMemorySpanExporter()  # to know when the request span has ended
        assert tracing._PROVIDER is not None
        tracing._PROVIDER.add_span_processor(SimpleSpanProcessor(ended))
        gw = gateway({"a": backends()})
        client(gw).chat.completions.create(model="m1", messages=MESSAGES)
        request_trace(ended)  # the client may have its answer before the span ends
        tracing.shutdown()  # flushes the batch
    finally:
        tracing.install(None)
        collector.shutdown()
    assert posts, "no OTLP export arrived"
    assert {(path, ctype) for path, ctype, _ in posts} == {("/v1/traces",
                                                           "application/x-protobuf")}
    body = b"".join(body for _, _, body in posts)  # one batch, or more
    assert b"gw-test" in body and b"POST /v1/chat/completions" in body and b"attempt" in body


def test_without_tracing_no_span_and_the_callers_traceparent_passes_as_before(backends,
                                                                             gateway):
    """Tracing off (the default): no trace is made, and a client's ``traceparent`` goes
    upstream unchanged, as it did before tracing existed."""
    assert tracing.TRACER is None
    a = backends()
    gw = gateway({"a": a})
    header = f"00-{TRACE_ID}-{PARENT_ID}-01"
    client(gw).chat.completions.create(model="m1", messages=MESSAGES,
                                       extra_headers={"traceparent": header})
    (sent,) = a.data_requests
    assert sent.headers["traceparent"] == header
