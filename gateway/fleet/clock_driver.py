"""The gateway drives GPU clock caps through each backend's agent (issue 21).

Every GPU telemetry round (:meth:`gateway.fleet.gpu_monitor.GpuMonitor.round`), with
``thermal.clocks.enabled``, :class:`ClockDriver` runs the pure
:class:`gateway.routing.clocks.ClockController` over the backends that have a
``gpu_control_url`` (``llm-gateway agent --control-token``, or the simulator's
``gpu.control_token``; the endpoint is :mod:`gateway.core.gpu_control`) and sends each cap
it sets or releases to every GPU of the backend (``POST`` / ``DELETE
{gpu_control_url}/control/gpus/{i}/clocks``, bearer token from the environment variable
``thermal.clocks.agent_token_env``). Each round also reads ``GET {gpu_control_url}/control``
(the GPUs, their supported clock range), which is the contact that keeps the agent from
reverting the caps (``revert_after_s``, 60 s). Every cap and release is logged, counted
(``gateway_clock_caps_total{backend, reason}``), kept in ``gateway_clock_cap_mhz{backend}``
(0: uncapped) and shown in ``/admin/backends`` (``gpu.clock_cap``). A failed call is counted
(``gateway_clock_control_errors_total``) and the backend's cap is forgotten, so the next
round sends it again.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import httpx

from gateway.config import ThermalConfig
from gateway.fleet.backend import Backend
from gateway.metrics import GatewayMetrics
from gateway.routing.clocks import CapChange, ClockController, GpuView, PowerShedGate
from gateway.routing.thermal import ThermalView

log = logging.getLogger("gateway.fleet.clocks")


@dataclass(slots=True)
class _Agent:
    """What the gateway knows of one backend's control endpoint."""

    gpus: tuple[int, ...] = ()
    max_mhz: float = 0.0
    reason: str | None = None  # the binding cap's reason, None while uncapped


class ClockDriver:
    """Clock caps of the fleet's GPUs, sent through their agents (module docstring).

    ``client``: the control-plane HTTP client (called per round); ``token``: the agents'
    bearer token; ``clock``: monotonic seconds."""

    def __init__(
        self,
        cfg: ThermalConfig,
        metrics: GatewayMetrics,
        client: Callable[[], httpx.AsyncClient],
        token: str,
        clock: Callable[[], float],
    ) -> None:
        self.cfg = cfg
        self.metrics = metrics
        self.client = client
        self.token = token
        self.clock = clock
        self.controller = ClockController(cfg.clocks, cfg.hot_c)
        self.gate = PowerShedGate(cfg.power_shed_levels, cfg.clocks.power_shed_release)
        self._agents: dict[str, _Agent] = {}

    @property
    def _headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"}

    def summary(self, backend_id: str) -> dict[str, Any] | None:
        """``/admin/backends``' view of one backend's cap: ``{"max_mhz", "reason"}`` (None
        max: uncapped), or None when the backend has no control endpoint."""
        a = self._agents.get(backend_id)
        if a is None:
            return None
        return {"max_mhz": self.controller.cap_mhz(backend_id), "reason": a.reason}

    def exhausted(self, backend_ids: Sequence[str]) -> bool:
        """Whether every one of these backends is capped at the floor (a backend without a
        control endpoint counts as exhausted: nothing more to lower there)."""
        ids = [b for b in backend_ids if b in self._agents]
        return self.controller.exhausted("", ids)

    async def step(self, backends: Sequence[Backend], view: ThermalView) -> None:
        """One round: read every agent (contact), decide, send the changes."""
        ctl = [b for b in backends if b.config.gpu_control_url is not None]
        for gone in set(self._agents) - {b.id for b in ctl}:
            self._agents.pop(gone)
            self.controller.forget(gone)
        await asyncio.gather(*(self._read(b) for b in ctl))
        now = self.clock()
        gpus = []
        for b in ctl:
            a = self._agents.get(b.id)
            if a is None or not a.gpus:
                continue
            st = view.status(b.id, now)
            load = b.load
            gpus.append(
                GpuView(
                    b.id,
                    b.config.power_domain,
                    a.max_mhz,
                    st.temp_c,
                    load.running if load is not None else 0.0,
                    load.waiting if load is not None else 0.0,
                    st.power_w,
                )
            )
        changes = self.controller.decide(now, gpus, view.domains)
        by_id = {b.id: b for b in ctl}
        await asyncio.gather(*(self._send(by_id[c.backend_id], c) for c in changes))

    def _url(self, b: Backend) -> str:
        return str(b.config.gpu_control_url).rstrip("/")

    async def _read(self, b: Backend) -> None:
        try:
            r = await self.client().get(
                f"{self._url(b)}/control", headers=self._headers, timeout=self.cfg.scrape_timeout_s
            )
            r.raise_for_status()
            gpus = r.json()["gpus"]
            wanted = b.config.gpu_indices
            idx = tuple(g["index"] for g in gpus if wanted is None or g["index"] in wanted)
            top = min(float(g["supported_clocks_mhz"][1]) for g in gpus if g["index"] in idx)
        except (httpx.HTTPError, ValueError, KeyError, TypeError) as e:
            self._failed(b, "read", e)
            return
        a = self._agents.setdefault(b.id, _Agent())
        a.gpus, a.max_mhz = idx, top

    async def _send(self, b: Backend, change: CapChange) -> None:
        a = self._agents[b.id]
        try:
            for i in a.gpus:
                url = f"{self._url(b)}/control/gpus/{i}/clocks"
                if change.max_mhz is None:
                    r = await self.client().delete(url, headers=self._headers)
                else:
                    r = await self.client().post(
                        url, json={"max_mhz": round(change.max_mhz)}, headers=self._headers
                    )
                r.raise_for_status()
        except httpx.HTTPError as e:
            self._failed(b, "set", e)
            return
        a.reason = None if change.max_mhz is None else change.reason
        self.metrics.clock_caps.labels(b.id, change.reason).inc()
        self.metrics.clock_cap_mhz.labels(b.id).set(change.max_mhz or 0.0)
        if change.max_mhz is None:
            log.info("backend %s: GPU clock cap released", b.id)
        else:
            log.info(
                "backend %s: GPU SM clocks capped at %.0f MHz (%s; was %s)",
                b.id,
                change.max_mhz,
                change.reason,
                "uncapped" if change.previous_mhz is None else f"{change.previous_mhz:.0f} MHz",
            )

    def _failed(self, b: Backend, what: str, e: Exception) -> None:
        self.metrics.clock_control_errors.labels(b.id).inc()
        log.warning("backend %s: GPU control %s failed: %s: %s", b.id, what, type(e).__name__, e)
        self._agents.pop(b.id, None)
        self.controller.forget(b.id)


def clock_driver(
    cfg: ThermalConfig,
    metrics: GatewayMetrics,
    client: Callable[[], httpx.AsyncClient],
    clock: Callable[[], float],
) -> ClockDriver | None:
    """The driver when ``thermal.clocks.enabled``, else None. Without the token in
    ``thermal.clocks.agent_token_env`` it logs why and returns None (no caps, shedding as
    before)."""
    if not (cfg.enabled and cfg.clocks.enabled):
        return None
    token = os.environ.get(cfg.clocks.agent_token_env, "")
    if not token:
        log.error(
            "thermal.clocks is enabled but %s is not set: no clock caps",
            cfg.clocks.agent_token_env,
        )
        return None
    return ClockDriver(cfg, metrics, client, token, clock)
