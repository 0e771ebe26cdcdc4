"""``llm-gateway agent``: a GPU host's sidecar serving DCGM exporter names from NVML.

Where NVIDIA's dcgm-exporter is not deployed, run this beside each vLLM server and point the
backend's ``gpu_metrics_url`` at it (``http://<host>:9400/metrics``). It reads NVML through
pynvml (the ``nvidia-ml-py`` package) at each scrape and serves, one line per GPU with
dcgm-exporter's labels (``gpu``, ``UUID``, ``device``, ``modelName``, ``Hostname``):

================================  ==========================================  ==========
name                              NVML source                                 unit
================================  ==========================================  ==========
``DCGM_FI_DEV_GPU_TEMP``          ``nvmlDeviceGetTemperature`` (GPU sensor)    °C
``DCGM_FI_DEV_POWER_USAGE``       ``nvmlDeviceGetPowerUsage``                  W (NVML mW)
``DCGM_FI_DEV_POWER_MGMT_LIMIT``  ``nvmlDeviceGetPowerManagementLimit``        W (NVML mW)
``DCGM_FI_DEV_SM_CLOCK``          ``nvmlDeviceGetClockInfo`` (SM)              MHz
``DCGM_FI_DEV_XID_ERRORS``        last Xid code from NVML's Xid events (0)     code
``DCGM_FI_DEV_ECC_DBE_VOL_TOTAL``  ``nvmlDeviceGetTotalEccErrors`` (volatile,  count
                                  uncorrected)
``DCGM_FI_DEV_GPU_UTIL``          ``nvmlDeviceGetUtilizationRates`` (``.gpu``) %
``DCGM_FI_DEV_FB_USED``           ``nvmlDeviceGetMemoryInfo`` (``.used``)      MiB (NVML B)
``DCGM_FI_DEV_FB_FREE``           ``nvmlDeviceGetMemoryInfo`` (``.free``)      MiB (NVML B)
================================  ==========================================  ==========

A field a GPU does not support (ECC on consumer GPUs, for instance) is left out for that GPU.
All are exposed as gauges (prometheus-client would append ``_total`` to a counter's name,
and the names must be dcgm-exporter's). On a host without NVIDIA GPUs (no driver, no NVML
library, or zero devices) :func:`run_agent` raises :class:`NoGpuError` and the command exits
with a clear message and status 4.

Control (issue 21): with a token (``--control-token`` or ``LLM_GATEWAY_AGENT_TOKEN``) the
agent also serves the GPU control endpoint of :mod:`gateway.core.gpu_control` on the same
port: the gateway sets and clears a GPU's locked SM clock range and power limit through it
(:mod:`gateway.agent_control`: ``nvmlDeviceSetGpuLockedClocks`` /
``nvmlDeviceResetGpuLockedClocks`` bounded by ``nvmlDeviceGetSupportedGraphicsClocks``,
``nvmlDeviceSetPowerManagementLimit`` bounded by
``nvmlDeviceGetPowerManagementLimitConstraints``; setting them needs root or
``nvidia-smi -acp UNRESTRICTED``, and a refusal answers 503). Everything it set is reverted
when the agent stops and when the gateway has not been heard for ``--revert-after`` seconds
(60), so a GPU is never left capped by accident. Without a token there is no control
endpoint (404), as before.
"""

from __future__ import annotations

import logging
import socket
import sys
import threading
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any

import pynvml
from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from gateway.agent_control import ControlledAgent
from gateway.core.gpu_control import DEFAULT_REVERT_AFTER_S

log = logging.getLogger("gateway.agent")

DEFAULT_PORT = 9400  # dcgm-exporter's port
EXIT_NO_GPU = 4

_HELP = {
    "DCGM_FI_DEV_GPU_TEMP": "GPU temperature (in C).",
    "DCGM_FI_DEV_POWER_USAGE": "Power draw (in W).",
    "DCGM_FI_DEV_POWER_MGMT_LIMIT": "Power management limit (in W).",
    "DCGM_FI_DEV_SM_CLOCK": "SM clock frequency (in MHz).",
    "DCGM_FI_DEV_XID_ERRORS": "Value of the last XID error encountered.",
    "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL": "Total number of double-bit volatile ECC errors.",
    "DCGM_FI_DEV_GPU_UTIL": "GPU utilization (in %).",
    "DCGM_FI_DEV_FB_USED": "Framebuffer memory used (in MiB).",
    "DCGM_FI_DEV_FB_FREE": "Framebuffer memory free (in MiB).",
}
_MIB = 1024 * 1024
_LABELS = ["gpu", "UUID", "device", "modelName", "Hostname"]


class NoGpuError(RuntimeError):
    """NVML is unavailable or sees no GPU on this host."""


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class NvmlReader:
    """Reads every GPU of the host through NVML; :meth:`read` is one scrape.

    Xid errors arrive as NVML events; each :meth:`read` drains the pending ones and keeps
    the last code per GPU (dcgm-exporter's ``DCGM_FI_DEV_XID_ERRORS`` semantics).
    """

    def __init__(self) -> None:
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as e:
            raise NoGpuError(f"NVML is not available ({e}; no NVIDIA driver on this host?)") from e
        try:
            count = pynvml.nvmlDeviceGetCount()
        except pynvml.NVMLError as e:
            pynvml.nvmlShutdown()
            raise NoGpuError(f"NVML cannot count GPUs ({e})") from e
        if count == 0:
            pynvml.nvmlShutdown()
            raise NoGpuError("NVML sees no NVIDIA GPU on this host")
        self.handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
        self.uuids = [_text(pynvml.nvmlDeviceGetUUID(h)) for h in self.handles]
        self.names = [_text(pynvml.nvmlDeviceGetName(h)) for h in self.handles]
        self.last_xid = [0] * count
        self._lock = threading.Lock()
        self._events: Any = None
        try:
            self._events = pynvml.nvmlEventSetCreate()
            for h in self.handles:
                pynvml.nvmlDeviceRegisterEvents(
                    h, pynvml.nvmlEventTypeXidCriticalError, self._events
                )
        except pynvml.NVMLError as e:
            log.warning("Xid events unavailable (%s): DCGM_FI_DEV_XID_ERRORS stays 0", e)
            self._free_events()

    def _free_events(self) -> None:
        if self._events is not None:
            try:
                pynvml.nvmlEventSetFree(self._events)
            except pynvml.NVMLError:
                pass
            self._events = None

    def close(self) -> None:
        self._free_events()
        try:
            pynvml.nvmlShutdown()
        except pynvml.NVMLError:
            pass

    def _drain_xids(self) -> None:
        if self._events is None:
            return
        for _ in range(1000):  # bounded: never spin if the driver keeps answering
            try:
                data = pynvml.nvmlEventSetWait_v2(self._events, 0)
            except pynvml.NVMLError_Timeout:
                return
            except pynvml.NVMLError as e:
                log.warning("reading Xid events failed: %s", e)
                return
            try:
                index = pynvml.nvmlDeviceGetIndex(data.device)
            except pynvml.NVMLError:
                continue
            if 0 <= index < len(self.last_xid):
                self.last_xid[index] = int(data.eventData)
                log.warning("GPU %d: Xid %d", index, data.eventData)

    @staticmethod
    def _field(fn: Callable[[], float]) -> float | None:
        try:
            return float(fn())
        except pynvml.NVMLError:  # not supported on this GPU, or a transient failure
            return None

    @staticmethod
    def _memory(h: Any) -> tuple[float | None, float | None]:
        """``(used, free)`` framebuffer bytes of GPU ``h`` (None, None: unavailable)."""
        try:
            mem = pynvml.nvmlDeviceGetMemoryInfo(h)
        except pynvml.NVMLError:
            return None, None
        return float(mem.used), float(mem.free)

    def read(self) -> list[dict[str, float | None]]:
        """One reading per GPU, in index order: DCGM name -> value (None: unavailable)."""
        with self._lock:
            self._drain_xids()
            out = []
            for i, h in enumerate(self.handles):
                f = self._field
                power_mw = f(partial(pynvml.nvmlDeviceGetPowerUsage, h))
                limit_mw = f(partial(pynvml.nvmlDeviceGetPowerManagementLimit, h))
                util = f(partial(lambda h: pynvml.nvmlDeviceGetUtilizationRates(h).gpu, h))
                used_b, free_b = self._memory(h)
                out.append(
                    {
                        "DCGM_FI_DEV_GPU_TEMP": f(
                            partial(
                                pynvml.nvmlDeviceGetTemperature, h, pynvml.NVML_TEMPERATURE_GPU
                            )
                        ),
                        "DCGM_FI_DEV_POWER_USAGE": None if power_mw is None else power_mw / 1000,
                        "DCGM_FI_DEV_POWER_MGMT_LIMIT": (
                            None if limit_mw is None else limit_mw / 1000
                        ),
                        "DCGM_FI_DEV_SM_CLOCK": f(
                            partial(pynvml.nvmlDeviceGetClockInfo, h, pynvml.NVML_CLOCK_SM)
                        ),
                        "DCGM_FI_DEV_XID_ERRORS": float(self.last_xid[i]),
                        "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL": f(
                            partial(
                                pynvml.nvmlDeviceGetTotalEccErrors,
                                h,
                                pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
                                pynvml.NVML_VOLATILE_ECC,
                            )
                        ),
                        "DCGM_FI_DEV_GPU_UTIL": util,
                        "DCGM_FI_DEV_FB_USED": None if used_b is None else used_b / _MIB,
                        "DCGM_FI_DEV_FB_FREE": None if free_b is None else free_b / _MIB,
                    }
                )
            return out


class DcgmCollector(Collector):
    """Serves :meth:`NvmlReader.read` under dcgm-exporter's names and labels."""

    def __init__(self, reader: NvmlReader, hostname: str) -> None:
        self.reader = reader
        self.hostname = hostname

    def collect(self) -> Iterator[Metric]:
        families = {
            name: GaugeMetricFamily(name, text, labels=_LABELS) for name, text in _HELP.items()
        }
        for i, gpu in enumerate(self.reader.read()):
            labels = [
                str(i),
                self.reader.uuids[i],
                f"nvidia{i}",
                self.reader.names[i],
                self.hostname,
            ]
            for name, value in gpu.items():
                if value is not None:
                    families[name].add_metric(labels, value)
        yield from families.values()


def build_registry(reader: NvmlReader, hostname: str | None = None) -> CollectorRegistry:
    """A registry holding only the DCGM families of ``reader``'s GPUs."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(DcgmCollector(reader, hostname or socket.gethostname()))
    return registry


def start_agent(
    host: str,
    port: int,
    control_token: str | None = None,
    revert_after_s: float = DEFAULT_REVERT_AFTER_S,
) -> tuple[Any, threading.Thread, NvmlReader]:
    """Open NVML and serve ``/metrics`` on ``host:port`` in a background thread (and, with
    ``control_token``, the control endpoint: a :class:`ControlledAgent`).

    Returns ``(server, thread, reader)``; stop with ``server.shutdown()`` then
    ``reader.close()``. Raises :class:`NoGpuError` on a host without NVIDIA GPUs.
    """
    reader = NvmlReader()
    try:
        if control_token:
            agent = ControlledAgent(
                reader.handles, build_registry(reader), host, port, control_token, revert_after_s
            )
            return agent, agent.thread, reader
        server, thread = start_http_server(port, addr=host, registry=build_registry(reader))
    except BaseException:
        reader.close()
        raise
    return server, thread, reader


def run_agent(
    host: str,
    port: int,
    control_token: str | None = None,
    revert_after_s: float = DEFAULT_REVERT_AFTER_S,
) -> int:
    """Serve until interrupted; the exit status (``EXIT_NO_GPU`` without GPUs)."""
    try:
        server, thread, reader = start_agent(host, port, control_token, revert_after_s)
    except NoGpuError as e:
        print(
            f"llm-gateway agent: {e}. It reads NVIDIA GPUs through NVML; run it on a GPU "
            "host, or use dcgm-exporter.",
            file=sys.stderr,
        )
        return EXIT_NO_GPU
    log.info(
        "serving DCGM metrics of %d GPU(s) on http://%s:%d/metrics%s",
        len(reader.handles),
        host,
        server.server_address[1],
        f" and GPU control (reverted after {revert_after_s:g} s without contact)"
        if control_token
        else "",
    )
    try:
        thread.join()
    except KeyboardInterrupt:
        pass
    finally:
        server.shutdown()
        reader.close()
    return 0
