"""The OTLP exporter while its collector is down (issue 19, finding 8): spans exported by
the real OTLP/HTTP exporter (:func:`gateway.tracing.configure`) to a port where nothing
listens, flushed three times: its failure lines come through once, not once per export
and retry; and the spans' resource names the installed package's version."""

from __future__ import annotations

import logging
from importlib import metadata

import pytest

from gateway import tracing
from gateway.config import OtelConfig
from tests.support.vllm import free_port

pytest.importorskip("opentelemetry.exporter.otlp.proto.http.trace_exporter")


def test_a_collector_down_costs_one_line_not_one_per_export(
        caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT", "0.2")  # seconds per export
    caplog.set_level(logging.INFO)
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    assert tracing.configure(OtelConfig(endpoint=url))
    provider = tracing._PROVIDER
    assert provider is not None and tracing.TRACER is not None
    try:
        assert provider.resource.attributes["service.version"] == metadata.version(
            "llm-gateway")
        for i in range(3):
            with tracing.TRACER.start_as_current_span(f"span {i}"):
                pass
            provider.force_flush(5_000)
        lines = [r for r in caplog.records if r.name.startswith("opentelemetry")]
        assert len(lines) == 1, [r.getMessage() for r in lines]
    finally:
        tracing.install(None)
        provider.shutdown()


def test_once_per_interval_says_how_many_lines_it_held_back() -> None:
    now = [0.0]
    limit = tracing.OncePerInterval(60.0, clock=lambda: now[0])

    def record(msg: str) -> logging.LogRecord:
        return logging.LogRecord("x", logging.WARNING, __file__, 1, msg, (), None)

    assert limit.filter(record("first"))
    now[0] = 30.0
    assert not limit.filter(record("again")) and not limit.filter(record("again"))
    now[0] = 61.0
    shown = record("later")
    assert limit.filter(shown)
    assert shown.getMessage() == "later (2 similar lines in the last 61 s not shown)"
