"""Tracing off needs nothing (issue 19): without the ``otel`` extra the gateway imports and
runs, and :func:`gateway.tracing.configure` without a collector, or without the SDK,
leaves tracing off (a warning for the latter) instead of failing."""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import pytest

from gateway import tracing
from gateway.config import ConfigError, OtelConfig, load_config

ROOT = Path(__file__).resolve().parents[2]


def test_without_the_sdk_the_gateway_imports_and_serves_no_spans() -> None:
    """The ``otel`` extra missing (its packages made unimportable in a fresh interpreter;
    FastAPI and redis-py import OpenTelemetry pieces themselves, guarded): the app and the
    CLI import, and a configured collector leaves tracing off."""
    code = (
        "import sys\n"
        "sys.modules['opentelemetry.sdk'] = None\n"
        "sys.modules['opentelemetry.exporter'] = None\n"
        "import gateway.app, gateway.cli\n"
        "from gateway import tracing\n"
        "from gateway.config import ConfigError, OtelConfig, load_config\n"
        "print(tracing.configure(OtelConfig(endpoint='http://127.0.0.1:4318')), "
        "tracing.TRACER)\n"
    )
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "False None"


def test_no_endpoint_no_environment_no_tracing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_ENDPOINT", raising=False)
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", raising=False)
    assert tracing.configure(OtelConfig()) is False
    assert tracing.TRACER is None
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:4318")
    assert tracing.configure(OtelConfig(enabled=False)) is False
    assert tracing.TRACER is None


def test_without_the_sdk_a_configured_endpoint_warns_and_stays_off(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setitem(sys.modules, "opentelemetry.sdk.trace", None)  # import fails
    with caplog.at_level(logging.WARNING, "gateway.tracing"):
        assert tracing.configure(OtelConfig(endpoint="http://127.0.0.1:4318")) is False
    assert tracing.TRACER is None
    assert "pip install 'llm-gateway[otel]'" in caplog.text
    assert "opentelemetry.sdk.trace" in caplog.text


@pytest.mark.parametrize(("server", "field"), [
    ({"otel": {"sample_ratio": 1.5}}, "server.otel.sample_ratio"),
    ({"otel": {"endpoint": "collector:4318"}}, "server.otel.endpoint"),
    ({"log_format": "xml"}, "server.log_format"),
])
def test_bad_fields_are_named(server: dict[str, object], field: str) -> None:
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        load_config(None, backends=[{"id": "a", "url": "http://127.0.0.1:1"}], server=server)
