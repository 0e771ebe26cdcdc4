"""The gateway drives GPU clock caps and power limits through each backend's agent (issue 21).

Every GPU telemetry round (:meth:`gateway.fleet.gpu_monitor.GpuMonitor.round`), with
``thermal.clocks.enabled``, :class:`ClockDriver` runs the pure
:class:`gateway.routing.clocks.ClockController` and then, for domains whose clock caps sit
at their floor, :class:`gateway.routing.power_limits.PowerLimitController` over the backends
that have a ``gpu_control_url`` (``llm-gateway agent --control-token``, or the simulator's
``gpu.control_token``; the endpoint is :mod:`gateway.core.gpu_control`), and sends each change
to every GPU of the backend (``POST`` / ``DELETE {gpu_control_url}/control/gpus/{i}/clocks``
and ``.../power-limit``, bearer token from the environment variable
``thermal.clocks.agent_token_env``). Each round also reads ``GET {gpu_control_url}/control``
(the GPUs, their clock and power-limit ranges), which is the contact that keeps the agent
from reverting the caps (``revert_after_s``, 60 s). The first read of an agent adopts the
caps and limits it reports as set (a replica taking over from another, or a restarted
gateway, moves on from them instead of jumping back to full clock).

Every change is logged, counted (``gateway_clock_caps_total{backend, reason}``,
``gateway_power_limits_total{backend, reason}``), kept in ``gateway_clock_cap_mhz{backend}``
/ ``gateway_power_limit_w{backend}`` (0: none) and shown in ``/admin/backends``
(``gpu.clock_cap``, ``gpu.power_cap``). A failed call is counted
(``gateway_clock_control_errors_total``), logged once per change of state with a hint for a
refused token (:mod:`gateway.fleet.control_failures`), and the backend is forgotten, so the
next round reads it again; values sent are within the GPU's reported range; a GPU whose
driver refuses a power limit (the agent's 503) is left without one and counts as limited
(nothing more to do there: shedding may start).

Fleet mode (:mod:`gateway.coord.clock_lease`): only the replica holding the clock lease
drives (:meth:`ClockDriver.share`); the others touch no agent (so a lost lease or a dead
store leaves no GPU capped: the agents revert 60 s after the last holder's contact) and
read the holder's published state for shedding and ``/admin/backends``.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import httpx

from gateway.config import ThermalConfig
from gateway.fleet.agent_calls import read_gpus, set_each
from gateway.fleet.backend import Backend
from gateway.fleet.control_failures import ControlFailures, in_range
from gateway.metrics import GatewayMetrics
from gateway.routing.clocks import CapChange, ClockController, GpuView, PowerShedGate
from gateway.routing.power_limits import LimitChange, LimitView, PowerLimitController
from gateway.routing.thermal import ThermalTracker, ThermalView

log = logging.getLogger("gateway.fleet.clocks")

PeerState = Mapping[str, Mapping[str, Any]]


@dataclass(slots=True)
class _Agent:
    """What the gateway knows of one backend's control endpoint (MHz, W)."""

    gpus: tuple[int, ...] = ()
    min_mhz: float = 0.0
    max_mhz: float = 0.0
    min_w: float = 0.0
    max_w: float = 0.0
    reason: str | None = None  # the binding cap's reason, None while uncapped
    limit_reason: str | None = None  # "power" while a power limit is set
    limits_refused: bool = False  # the GPU's driver refused a power limit (503)
    tracker: ThermalTracker | None = None  # the backend's GPU telemetry


class ClockDriver:
    """Clock caps and power limits of the fleet's GPUs, sent through their agents (module
    docstring). ``client``: the control-plane HTTP client (called per round); ``token``: the
    agents' bearer token; ``clock``: monotonic seconds."""

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
        self.limits = PowerLimitController(cfg.clocks)
        self.gate = PowerShedGate(cfg.power_shed_levels, cfg.clocks.power_shed_release)
        self._agents: dict[str, _Agent] = {}
        self.failures = ControlFailures(cfg.clocks.agent_token_env)  # logged once per state
        self._answered: dict[str, float] = {}  # backend -> its agent's last answer (s)
        self._holds: Callable[[], bool] | None = None
        self._peer: Callable[[], PeerState | None] = lambda: None
        metrics.clock_control_owner.set(1)

    def share(self, holds: Callable[[], bool], peer: Callable[[], PeerState | None]) -> None:
        """Fleet mode: drive only while ``holds()`` (this replica holds the clock lease);
        otherwise answer from ``peer()``, the holder's :meth:`snapshot` (None: no fresh one:
        nobody drives, so nothing more can be lowered and shedding applies as without
        clocks)."""
        self._holds, self._peer = holds, peer
        self.metrics.clock_control_owner.set(0)

    @property
    def driving(self) -> bool:
        """Whether this replica drives the caps now (always, outside fleet mode)."""
        return self._holds is None or self._holds()

    @property
    def _headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"}

    # ---- what shedding, cooldowns and /admin/backends read -------------------------------------
    def _peer_entries(self, backend_ids: Sequence[str]) -> list[Mapping[str, Any]] | None:
        state = self._peer()
        if state is None:
            return None
        return [state[b] for b in backend_ids if b in state]

    def summary(self, backend_id: str) -> dict[str, Any] | None:
        """``/admin/backends``' view of one backend's clock cap: ``{"max_mhz", "reason"}``
        (None max: uncapped), or None when the backend has no control endpoint (or, on a
        replica that does not drive, the holder publishes none for it)."""
        e = self.entry(backend_id)
        return None if e is None else {"max_mhz": e["max_mhz"], "reason": e["reason"]}

    def power_summary(self, backend_id: str) -> dict[str, Any] | None:
        """``/admin/backends``' view of one backend's power limit: ``{"limit_w", "reason"}``
        (per GPU, W; None: the GPU's default), or None as :meth:`summary`."""
        e = self.entry(backend_id)
        return None if e is None else {"limit_w": e["limit_w"], "reason": e["limit_reason"]}

    def entry(self, backend_id: str) -> Mapping[str, Any] | None:
        """One backend's entry of :meth:`snapshot` (this replica's, or the holder's)."""
        if not self.driving:
            state = self._peer()
            return None if state is None else state.get(backend_id)
        a = self._agents.get(backend_id)
        if a is None:  # an agent not answering now: spent once out of reach
            if backend_id not in self._answered:
                return None
            gone = self._out_of_reach(backend_id)
            return {"max_mhz": None, "reason": None, "limit_w": None, "limit_reason": None,
                    "floor": gone, "exhausted": gone}  # fmt: skip
        return {
            "max_mhz": self.controller.cap_mhz(backend_id),
            "reason": a.reason,
            "limit_w": self.limits.limit_w(backend_id),
            "limit_reason": a.limit_reason,
            "floor": self.controller.exhausted("", [backend_id]),
            "exhausted": self._exhausted_one(backend_id),
        }

    def snapshot(self) -> dict[str, Mapping[str, Any]]:
        """Every driven backend's cap, limit and whether each lever is spent (published to
        the other replicas in fleet mode)."""
        out: dict[str, Mapping[str, Any]] = {}
        for b in self._answered:
            e = self.entry(b)
            if e is not None:
                out[b] = e
        return out

    def _exhausted_one(self, b: str) -> bool:
        if not self.controller.exhausted("", [b]):
            return False
        a = self._agents[b]
        if not self.cfg.clocks.power_limits or a.limits_refused:
            return True
        if not self.limits.exhausted([b], self.clock()):
            return False
        # and the GPUs' telemetry shows the limit (DCGM_FI_DEV_POWER_MGMT_LIMIT): the draw
        # read with it is the draw under it (an exporter without the field: the time alone)
        limit = self.limits.limit_w(b)
        seen = a.tracker.latest if a.tracker is not None else None
        if limit is None or seen is None or seen.power_limit_w is None:
            return True
        return seen.power_limit_w <= limit * max(1, len(a.gpus)) + 1.0

    def _out_of_reach(self, b: str) -> bool:
        """Nothing to lower on ``b``: it has no control endpoint, or its agent has not
        answered for ``thermal.stale_after_s`` (as its telemetry would count stale; a
        moment's failure does not start shedding)."""
        ok_at = self._answered.get(b)
        return ok_at is None or self.clock() - ok_at >= self.cfg.stale_after_s

    def clocks_exhausted(self, backend_ids: Sequence[str]) -> bool:
        """Whether every one of these backends is capped at the clock floor (or out of
        reach: :meth:`_out_of_reach`): only then is a hot one sent to cooldown."""
        if not self.driving:
            entries = self._peer_entries(backend_ids)
            return entries is None or all(e["floor"] for e in entries)
        return all(
            self.controller.exhausted("", [b]) if b in self._agents else self._out_of_reach(b)
            for b in backend_ids
        )

    def exhausted(self, backend_ids: Sequence[str]) -> bool:
        """Whether both levers are spent on every one of these backends (clock caps at
        their floor and power limits set, or out of reach): only then may power shedding
        start."""
        if not self.driving:
            entries = self._peer_entries(backend_ids)
            return entries is None or all(e["exhausted"] for e in entries)
        return all(
            self._exhausted_one(b) if b in self._agents else self._out_of_reach(b)
            for b in backend_ids
        )

    # ---- the round ----------------------------------------------------------------------------
    async def step(self, backends: Sequence[Backend], view: ThermalView) -> None:
        """One round: read every agent (contact), decide, send the changes."""
        if not self.driving:
            self.metrics.clock_control_owner.set(0)
            if self._agents:
                log.info("GPU clock control: another replica drives the caps now")
                for gone in list(self._agents):
                    self._drop(gone)
            self._answered.clear()
            return
        self.metrics.clock_control_owner.set(1)
        ctl = [b for b in backends if b.config.gpu_control_url is not None]
        for gone in set(self._agents) - {b.id for b in ctl}:
            self._drop(gone)
        now = self.clock()
        ids = {b.id for b in ctl}
        self._answered = {b: t for b, t in self._answered.items() if b in ids}
        for b in ctl:  # a new one has its grace from now
            self._answered.setdefault(b.id, now)
        await asyncio.gather(*(self._read(b) for b in ctl))
        now = self.clock()
        gpus: list[GpuView] = []
        views: list[LimitView] = []
        members: dict[str, list[str]] = {}
        for b in ctl:
            a = self._agents.get(b.id)
            if a is None or not a.gpus:
                continue
            st = view.status(b.id, now)
            load = b.load
            domain = b.config.power_domain
            gpus.append(
                GpuView(
                    b.id,
                    domain,
                    a.max_mhz,
                    st.temp_c,
                    load.running if load is not None else 0.0,
                    load.waiting if load is not None else 0.0,
                    st.power_w,
                )
            )
            if domain is not None:
                members.setdefault(domain, []).append(b.id)
                if not a.limits_refused:
                    views.append(LimitView(b.id, domain, len(a.gpus), a.min_w, a.max_w, st.power_w))
        hold = self.limits.holding(members)
        changes = self.controller.decide(now, gpus, view.domains, hold)
        limit_changes: list[LimitChange] = []
        if self.cfg.clocks.power_limits:
            floor = {d: self.controller.exhausted(d, ids) for d, ids in members.items()}
            limit_changes = self.limits.decide(now, views, view.domains, floor)
        by_id = {b.id: b for b in ctl}
        await asyncio.gather(
            *(self._send(by_id[c.backend_id], c) for c in changes),
            *(self._send_limit(by_id[c.backend_id], c) for c in limit_changes),
        )

    def _url(self, b: Backend) -> str:
        return str(b.config.gpu_control_url).rstrip("/")

    async def _read(self, b: Backend) -> None:
        try:
            g = await read_gpus(
                self.client(),
                self._url(b),
                self._headers,
                self.cfg.scrape_timeout_s,
                b.config.gpu_indices,
            )
        except (httpx.HTTPError, ValueError) as e:
            self._failed(b, "read", e)
            return
        self._answered[b.id] = self.clock()
        self.failures.answered(b.id, "read")
        a = self._agents.get(b.id)
        if a is None:  # first contact since this replica drives: adopt what is set
            a = self._agents[b.id] = _Agent()
            if g.locked_mhz is not None:
                self.controller.adopt(b.id, g.locked_mhz / g.max_mhz, g.max_mhz)
                a.reason = "power"
            if g.limit_w is not None:
                self.limits.adopt(b.id, g.limit_w)
                a.limit_reason = "power"
            if g.locked_mhz is not None or g.limit_w is not None:
                log.info(
                    "backend %s: GPU control taken over with clocks capped at %s, power limit %s",
                    b.id,
                    "none" if g.locked_mhz is None else f"{g.locked_mhz:.0f} MHz",
                    "default" if g.limit_w is None else f"{g.limit_w:.0f} W",
                )
        a.gpus, a.min_mhz, a.max_mhz = g.indices, g.min_mhz, g.max_mhz
        a.min_w, a.max_w = g.min_w, g.max_w
        a.tracker = b.thermal

    async def _send(self, b: Backend, change: CapChange) -> None:
        a = self._agents[b.id]
        mhz = change.max_mhz
        body = None if mhz is None else {"max_mhz": in_range(mhz, a.min_mhz, a.max_mhz)}
        try:
            await set_each(self.client(), self._url(b), self._headers, a.gpus, "clocks", body)
        except httpx.HTTPError as e:
            self._failed(b, "set", e)
            return
        self.failures.answered(b.id, "set")
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

    async def _send_limit(self, b: Backend, change: LimitChange) -> None:
        a = self._agents.get(b.id)
        if a is None:  # its clock call failed this round: read again next round
            return
        w = change.watts
        body = None if w is None else {"watts": in_range(w, a.min_w, a.max_w)}
        try:
            await set_each(self.client(), self._url(b), self._headers, a.gpus, "power-limit", body)
        except httpx.HTTPError as e:
            if isinstance(e, httpx.HTTPStatusError) and e.response.status_code == 503 and w:
                # the GPU's driver refuses power limits (no permission): no lever here
                self.metrics.clock_control_errors.labels(b.id).inc()
                why = e.response.text[:200]
                log.warning("backend %s: power limit refused by the GPU's driver: %s", b.id, why)
                a.limits_refused = True
                self.limits.forget(b.id)
                return
            self._failed(b, "power limit", e)
            return
        self.failures.answered(b.id, "power limit")
        a.limit_reason = None if change.watts is None else change.reason
        self.metrics.power_limits.labels(b.id, change.reason).inc()
        self.metrics.power_limit_w.labels(b.id).set(change.watts or 0.0)
        if change.watts is None:
            log.info("backend %s: GPU power limit cleared (back to the default)", b.id)
        else:
            log.warning(
                "backend %s: GPU power limit set to %.0f W per GPU (clocks at their floor, "
                "domain %s still over its budget mark; was %s)",
                b.id,
                change.watts,
                b.config.power_domain,
                "default" if change.previous_w is None else f"{change.previous_w:.0f} W",
            )

    def _failed(self, b: Backend, what: str, e: Exception) -> None:
        self.metrics.clock_control_errors.labels(b.id).inc()
        self.failures.failed(b.id, what, e)
        self._drop(b.id)

    def _drop(self, backend_id: str) -> None:
        """Forget a backend's agent and caps (read again, and adopted, at the next round)."""
        self._agents.pop(backend_id, None)
        self.controller.forget(backend_id)
        self.limits.forget(backend_id)
        for gauge in (self.metrics.clock_cap_mhz, self.metrics.power_limit_w):
            try:
                gauge.remove(backend_id)
            except KeyError:
                pass


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
