"""The two case tests that wait out production defaults, run concurrently.

BUG-12's production-defaults test (a ~17 s stream and a 17 s silent non-stream, longer
than the 15 s timeouts of the report) and BUG-15's silence test (16 s before the first
chunk, past sse-starlette's 15 s ping) each have to wait longer than a 15 s default, and
nothing in one touches the other: each has its own scripted backend and gateway. Run one
after the other they cost ~33 s of the suite; :class:`DefaultWaits` starts both scenarios
together when the first of their tests asks (the ``default_waits`` session fixture of
``tests/cases/conftest.py``), so together they take ~17 s. Each scenario only records
what its client and gateway saw (:class:`Bug12Seen`, :class:`Bug15Seen`); the assertions
stay in the tests.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from tests.support.scripted import ScriptedBackend
from tests.support.servers import GatewayThread, gateway_config


@dataclass
class Bug12Seen:
    """BUG-12 with production defaults: the gateway's ``proxy.ttfb_timeout_s`` (seconds),
    the stream's content chunks and duration (s), the non-stream's content and duration (s),
    and the gateway's ``gateway_stream_errors_total`` summed over labels afterwards."""

    ttfb_timeout_s: float
    texts: list[str]
    took: float
    content: str
    took_plain: float
    stream_errors: float


@dataclass
class Bug15Seen:
    """BUG-15 silence: the gateway's raw event-stream bytes and the openai SDK's content of
    the same script, read concurrently."""

    raw: bytes
    sdk: str


def _serve(script: Any) -> tuple[ScriptedBackend, GatewayThread]:
    """A scripted backend and a gateway with the production default proxy timeouts in
    front of it (as the ``backends`` / ``gateway`` fixtures make them)."""
    a = ScriptedBackend(script)
    a.start()
    gw = GatewayThread(gateway_config([{"id": "a", "url": a.url}]))
    try:
        gw.start()
        gw.wait_ready(routable=1)
    except BaseException:
        gw.stop()
        a.stop()
        raise
    return a, gw


def bug12_production_defaults() -> Bug12Seen:
    """A stream of 17 chunks 1 s apart and a non-stream answered after 17 s of silence,
    concurrently through the openai SDK (``test_timeouts.py``'s scripts and clients)."""
    from tests.cases.test_timeouts import counter_total, long_script, sdk_complete, sdk_stream

    a, gw = _serve(long_script(17, 1.0, 17.0))
    try:
        with ThreadPoolExecutor(2) as ex:
            f_stream = ex.submit(sdk_stream, gw.url)
            f_plain = ex.submit(sdk_complete, gw.url)
            texts, took = f_stream.result(timeout=60)
            content, took_plain = f_plain.result(timeout=60)
        return Bug12Seen(gw.cfg.proxy.ttfb_timeout_s, texts, took, content, took_plain,
                         counter_total(gw.gateway.metrics.stream_errors))
    finally:
        gw.stop()
        a.stop()


def bug15_silence() -> Bug15Seen:
    """16 s of silence before the first chunk; the raw capture and the SDK read the same
    script concurrently (``test_sse_relay.py``'s script and clients)."""
    from tests.cases.test_sse_relay import capture, framing_script, sdk_content

    a, gw = _serve(framing_script(b"\n\n", 64, silence_s=16.0))
    try:
        with ThreadPoolExecutor(2) as ex:
            f_raw, f_sdk = ex.submit(capture, gw.url), ex.submit(sdk_content, gw.url)
            _, raw = f_raw.result(timeout=60)
            sdk = f_sdk.result(timeout=60)
        return Bug15Seen(raw, sdk)
    finally:
        gw.stop()
        a.stop()


SCENARIOS: dict[str, tuple[str, Callable[[], Any]]] = {
    "bug12": ("test_timeouts.py::test_BUG_12_production_defaults_long_stream_and_silent_non_stream",
              bug12_production_defaults),
    "bug15": ("test_sse_relay.py::test_BUG_15_silence_gets_no_data_pings", bug15_silence),
}
"""Scenario name -> (the end of its test's node id, the scenario)."""


class DefaultWaits:
    """Runs the :data:`SCENARIOS` in threads: :meth:`start` those named (each once),
    :meth:`result` waits for one (starting it if it was not)."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(len(SCENARIOS), thread_name_prefix="default-wait")
        self._futures: dict[str, Future[Any]] = {}

    def start(self, names: list[str]) -> None:
        for name in names:
            if name not in self._futures:
                self._futures[name] = self._pool.submit(SCENARIOS[name][1])

    def result(self, name: str, timeout: float = 120) -> Any:
        self.start([name])
        return self._futures[name].result(timeout)

    def close(self) -> None:
        self._pool.shutdown(wait=True)
