"""``llm-gateway agent``'s GPU control (issue 21): NVML behind the control endpoint.

:class:`NvmlActuator` sets and clears a GPU's locked SM clock range and power limit through
pynvml (``nvmlDeviceSetGpuLockedClocks`` / ``nvmlDeviceResetGpuLockedClocks``, bounded by
``nvmlDeviceGetSupportedGraphicsClocks`` at the highest memory clock;
``nvmlDeviceSetPowerManagementLimit``, bounded by
``nvmlDeviceGetPowerManagementLimitConstraints``, default
``nvmlDeviceGetPowerManagementDefaultLimit``; NVML speaks MHz and mW). :class:`ControlledAgent`
serves ``/metrics`` (the DCGM registry of :mod:`gateway.agent`) and the endpoint of
:mod:`gateway.core.gpu_control` on one port, with the watchdog that reverts every cap after
``revert_after_s`` without contact from the gateway, and reverts them when it stops.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

import pynvml
from prometheus_client import CollectorRegistry, make_wsgi_app

from gateway.core.gpu_control import ActuatorError, ControlService, GpuLimits

log = logging.getLogger("gateway.agent")


class NvmlActuator:
    """The control endpoint's :class:`gateway.core.gpu_control.GpuActuator` over NVML: the
    GPUs of ``handles`` (NVML device handles, in index order); a driver refusal raises
    ``ActuatorError``."""

    def __init__(self, handles: Sequence[Any]) -> None:
        self.handles = list(handles)
        self._limits: dict[int, GpuLimits] = {}

    @property
    def count(self) -> int:
        return len(self.handles)

    def limits(self, index: int) -> GpuLimits:
        """Supported SM clocks at the highest memory clock (MHz) and the power-limit
        constraints and default (W; NVML answers mW), read once."""
        lim = self._limits.get(index)
        if lim is None:
            h = self.handles[index]
            try:
                mem = max(pynvml.nvmlDeviceGetSupportedMemoryClocks(h))
                clocks = pynvml.nvmlDeviceGetSupportedGraphicsClocks(h, mem)
                lo_mw, hi_mw = pynvml.nvmlDeviceGetPowerManagementLimitConstraints(h)
                default_mw = pynvml.nvmlDeviceGetPowerManagementDefaultLimit(h)
            except pynvml.NVMLError as e:
                raise ActuatorError(str(e)) from e
            lim = GpuLimits(
                float(min(clocks)),
                float(max(clocks)),
                lo_mw / 1000,
                hi_mw / 1000,
                default_mw / 1000,
            )
            self._limits[index] = lim
        return lim

    def lock_clocks(self, index: int, min_mhz: float, max_mhz: float) -> None:
        self._call(pynvml.nvmlDeviceSetGpuLockedClocks, index, round(min_mhz), round(max_mhz))

    def reset_clocks(self, index: int) -> None:
        self._call(pynvml.nvmlDeviceResetGpuLockedClocks, index)

    def set_power_limit(self, index: int, watts: float) -> None:
        self._call(pynvml.nvmlDeviceSetPowerManagementLimit, index, round(watts * 1000))

    def power_limit_w(self, index: int) -> float:
        try:
            return float(pynvml.nvmlDeviceGetPowerManagementLimit(self.handles[index])) / 1000
        except pynvml.NVMLError as e:
            raise ActuatorError(str(e)) from e

    def _call(self, fn: Callable[..., Any], index: int, *args: Any) -> None:
        try:
            fn(self.handles[index], *args)
        except pynvml.NVMLError as e:
            raise ActuatorError(str(e)) from e


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _Quiet(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        log.debug(format, *args)


class ControlledAgent:
    """``/metrics`` and the control endpoint on one port (WSGI, a thread per request), and
    the watchdog thread that reverts every cap after ``revert_after_s`` without contact."""

    def __init__(
        self,
        handles: Sequence[Any],
        registry: CollectorRegistry,
        host: str,
        port: int,
        token: str,
        revert_after_s: float,
    ) -> None:
        actuator = NvmlActuator(handles)
        self.service = ControlService(actuator, token, time.monotonic(), revert_after_s)
        self._lock = threading.Lock()
        self._metrics = make_wsgi_app(registry)
        self.server = make_server(host, port, self._app, _Server, handler_class=_Quiet)
        self.server_address = self.server.server_address
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._watchdog = threading.Thread(target=self._watch, daemon=True)
        self.thread.start()
        self._watchdog.start()

    def _app(self, environ: dict[str, Any], start: Callable[..., Any]) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "")
        if not path.startswith("/control"):
            return self._metrics(environ, start)  # type: ignore[no-any-return]
        auth = environ.get("HTTP_AUTHORIZATION", "")
        token = auth[7:] if auth.lower().startswith("bearer ") else None
        size = int(environ.get("CONTENT_LENGTH") or 0)
        body = environ["wsgi.input"].read(size) if size > 0 else b""
        with self._lock:
            status, answer = self.service.handle(
                environ["REQUEST_METHOD"], path, token, body, time.monotonic()
            )
        if status == 200 and environ["REQUEST_METHOD"] != "GET":
            log.info("control %s %s -> %s", environ["REQUEST_METHOD"], path, answer["gpus"])
        data = json.dumps(answer).encode()
        start(f"{status} {_REASONS.get(status, 'Error')}", [("Content-Type", "application/json")])
        return [data]

    def _watch(self) -> None:
        while not self._stop.wait(min(1.0, self.service.revert_after_s / 4)):
            with self._lock:
                if self.service.tick(time.monotonic()):
                    log.warning(
                        "no contact from the gateway for %.0f s: GPU clocks and power limits "
                        "reverted",
                        self.service.revert_after_s,
                    )

    def shutdown(self) -> None:
        """Stop serving and revert every cap this agent set."""
        self._stop.set()
        self.server.shutdown()
        self.server.server_close()
        with self._lock:
            self.service.revert_all()


_REASONS = {200: "OK", 400: "Bad Request", 401: "Unauthorized", 404: "Not Found"}
_REASONS |= {405: "Method Not Allowed", 503: "Service Unavailable"}
