"""The gateway's decisions over the simulated fleet (:class:`SimulatedGateway`): the routing
package's policies, and with ``load_thermal`` the gateway's resource-layer admission (shed
by predicted queue wait, on by default in the live gateway), GPU telemetry, power admission
and thermal cooldowns, on :class:`gateway.fleet.backend.Backend` records; with ``clocks``
(:data:`CLOCKS`) the same plus the clock controller (:mod:`gateway.routing.clocks`, issue 21:
clock caps before shedding and instead of cooldowns). Pure, simulated time;
:func:`gateway.sim.fleet.simulate` drives it."""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from typing import Any

from gateway.config import BackendConfig, ClockControlConfig, RoutingConfig, RoutingPolicy
from gateway.core.samples import GpuSample, LoadSample
from gateway.core.vocab import BackendState, Prio
from gateway.fleet.backend import Backend
from gateway.fleet.lifecycle import apply_transition, may_take_out
from gateway.routing.clocks import ClockController, GpuView, PowerShedGate
from gateway.routing.cooldown import cooldown_due, rest_over
from gateway.routing.policies import Policy, build_policy
from gateway.routing.policy import C, estimated_load
from gateway.routing.thermal import (
    UNMONITORED,
    DomainStatus,
    ThermalChoice,
    ThermalStatus,
    ThermalTracker,
    choose,
    domain_statuses,
    power_pressure,
)
from gateway.sim.batch import BatchEngine, SimRequest
from gateway.sim.fleet_spec import FleetSpec
from gateway.sim.thermal import GpuThermal
from gateway.traffic.admission import Saturation, pool_wait, shed, wait_level

POLICIES: tuple[str, ...] = tuple(
    p.value
    for p in (RoutingPolicy.ROUND_ROBIN, RoutingPolicy.LEAST_REQUEST, RoutingPolicy.LOAD_THERMAL)
)
"""The ``routing.policy`` values the simulator runs, in the order it reports them."""

CLOCKS = "clocks"
"""The simulator's name for ``load_thermal`` with clock control on (``thermal.clocks``)."""

SIM_POLICIES: tuple[str, ...] = (*POLICIES, CLOCKS)
"""Every policy name :func:`gateway.sim.fleet.simulate` accepts."""


class FleetView:
    """What the gateway's telemetry reads of the simulated fleet (read-only by convention):
    each backend's engine and GPU, by backend index."""

    def __init__(self, engines: list[BatchEngine], gpus: list[GpuThermal]) -> None:
        self.engines = engines
        self.gpus = gpus


class SimulatedGateway:
    """The gateway's decisions over the simulated fleet, with one routing policy.

    Every backend is a :class:`gateway.fleet.backend.Backend` (the routing package's
    :class:`~gateway.routing.policy.Candidate`) whose in-flight count, load samples (every
    ``load_scrape_s``) and state the loop keeps; the policy is the routing package's own,
    built by :func:`gateway.routing.policies.build_policy` from the policy's name (a
    ``routing.policy`` value). With ``load_thermal`` the gateway's thermal machinery runs
    too (GPU telemetry, :func:`gateway.routing.thermal.choose` as the policy's thermal hook,
    power admission, thermal cooldowns by :mod:`gateway.routing.cooldown`), and so does
    the live gateway's resource-layer admission (:meth:`load_refused`, with
    ``spec.admission``: the gateway's defaults unless set); the simple policies stand for a
    plain router in front of the same fleet, without any of it.

    The loop drives: ``pick`` (backend index, or None to reject), ``dispatched`` /
    ``finished`` (in-flight bookkeeping), ``scrape_load`` / ``scrape_gpus`` (telemetry
    ticks), ``control`` (lifecycle tick); ``cooldowns`` taken and ``returned`` from them
    are counted, and so are requests refused for load (``refused_load``) and for power
    (``refused_power``).
    """

    def __init__(
        self,
        spec: FleetSpec,
        policy: RoutingPolicy,
        clocks: ClockControlConfig | None = None,
    ) -> None:
        self.spec = spec
        self.cfg = spec.thermal
        self.thermal_aware = policy is RoutingPolicy.LOAD_THERMAL
        racks = spec.rack_of()
        self.backends = [
            Backend(
                config=BackendConfig(
                    id=f"b{i}",
                    url=f"http://sim-b{i}:8000",  # type: ignore[arg-type]  # pydantic coerces str to its URL type
                    models=["sim"],
                    max_num_seqs=spec.engine.max_num_seqs,
                    power_domain=spec.racks[r].name,
                ),
                state=BackendState.WARM,
                models=("sim",),
            )
            for i, r in enumerate(racks)
        ]
        self._index = {b.id: i for i, b in enumerate(self.backends)}
        self.budgets = {r.name: r.budget_w for r in spec.racks}
        self.now = 0.0
        self.policy: Policy = build_policy(
            RoutingConfig(policy=policy, weights=spec.weights, session_max_entries=1),
            spec.lifecycle,
            spec.telemetry.stale_after_s,
            lambda: self.now,
            thermal=self._thermal_choice if self.thermal_aware else None,
            rng=random.Random(spec.seed),
        )
        # Keep only the samples the trend window needs (the slope scans them all).
        keep = math.ceil(self.cfg.trend_window_s / spec.gpu_scrape_s) + 4
        self.trackers = [ThermalTracker(self.cfg, max_samples=keep) for _ in self.backends]
        self.statuses: dict[str, ThermalStatus] = {}
        self.domains: dict[str, DomainStatus] = {}
        self._routable = list(self.backends)
        self._rest_since: dict[int, float] = {}
        self._choice: ThermalChoice[Any] | None = None
        self._shed_level: float | None = None
        self.cooldowns = 0
        self.returned = 0
        self.admission = spec.admission
        self.refused_load = 0  # resource layer: predicted queue wait over the SLO
        self.refused_power = 0  # power layer: domains' draw over thermal.power_shed_levels
        # Clock control (``clocks``): the controller, the caps to apply (backend index ->
        # MHz, None: release) and the counts of caps set and released.
        self.clocks = (
            ClockController(clocks, self.cfg.hot_c)
            if clocks is not None and self.thermal_aware
            else None
        )
        self._gate = (
            PowerShedGate(self.cfg.power_shed_levels, clocks.power_shed_release)
            if clocks is not None
            else None
        )
        self.pending_caps: list[tuple[int, float | None]] = []
        self.caps_set = 0
        self.caps_released = 0
        self._members: dict[str, list[str]] = {}
        for b in self.backends:
            if b.config.power_domain is not None:
                self._members.setdefault(b.config.power_domain, []).append(b.id)

    # -- request path
    def pick(self, now: float, req: SimRequest) -> int | None:
        """The backend index for ``req`` arriving at ``now``, or None (rejected)."""
        self.now = now
        cands = self._routable
        if not cands:
            return None
        if self.thermal_aware:
            if self.load_refused(now):
                self.refused_load += 1
                return None
            if self._choice is None:
                self._refresh_choice()
            if self._shed_level is not None and shed(
                Prio.NORMAL, Saturation(self._shed_level), self.cfg.power_shed_levels
            ):
                self.refused_power += 1
                return None
        b = self.policy.pick(cands)
        return None if b is None else self._index[b.id]

    def load_refused(self, now: float) -> bool:
        """The live gateway's resource layer (``saturation`` in :mod:`gateway.flow.admission`,
        checked before the power layer): the queue wait a new request would
        meet on the least-loaded routable backend (:func:`pool_wait`), each backend's from
        its last load scrape corrected by in-flight changes since (:func:`estimated_load`)
        over the service rate its :class:`gateway.traffic.capacity.ServiceModel` learned
        from the scrapes (:meth:`~gateway.traffic.capacity.ServiceModel.predicted_wait`),
        in units of ``slo.ttft_s`` (:func:`wait_level`); True when a normal-priority
        request (all the simulator's) is shed at it (``admission.shed_levels``, default 2:
        a predicted wait of 4 s with the 2 s SLO). Always False with admission disabled."""
        a = self.admission
        if not a.enabled:
            return False
        stale = self.spec.telemetry.stale_after_s
        waits = []
        for b in self._routable:
            waiting, running, _kv = estimated_load(b, now, stale)
            waits.append(b.service.predicted_wait(waiting, running))
        level = wait_level(pool_wait(waits), self.spec.slo.ttft_s)
        return shed(Prio.NORMAL, level, a.shed_levels)

    def _thermal_choice(self, candidates: Sequence[C], now: float) -> ThermalChoice[C]:
        """The policy's thermal hook: :func:`choose` over the current telemetry, cached."""
        if self._choice is None or candidates is not self._routable:
            self._refresh_choice()
        assert self._choice is not None and candidates is self._routable
        return self._choice

    def _refresh_choice(self) -> None:
        """Call the gateway's :func:`choose` and :func:`power_pressure` for the current
        candidates and telemetry. Both are pure functions of inputs that change only when
        GPU telemetry arrives (every ``gpu_scrape_s``) or a backend changes state, so the
        simulator calls them once per change instead of once per request: same answers,
        a fraction of the cost (the load score, which changes with every request, is
        still computed by the policy per request)."""
        cands = self._routable
        statuses = self.statuses
        if statuses:
            self._choice = choose(cands, lambda b: statuses[b.id], self.domains, self.cfg)
        else:
            self._choice = ThermalChoice(list(cands))
        self._shed_level = (
            power_pressure((b.config.power_domain for b in cands), self.domains)
            if self.domains
            else None
        )
        if self._gate is not None and self.clocks is not None and self._shed_level is not None:
            names = {b.config.power_domain for b in cands if b.config.power_domain is not None}
            exhausted = all(self.clocks.exhausted(d, self._members.get(d, ())) for d in names)
            self._shed_level = self._gate.level(self._shed_level, exhausted)

    def dispatched(self, i: int) -> None:
        """A request went to backend ``i``."""
        b = self.backends[i]
        b.take(1, 0)
        b.count_served()

    def finished(self, i: int) -> None:
        """A request on backend ``i`` finished."""
        self.backends[i].give_back(1, 0)

    # -- telemetry
    def scrape_load(self, now: float, view: FleetView) -> None:
        """Load telemetry tick: each engine's queue, batch, KV use and completions
        (``vllm:request_success_total``, which the service model learns from) as a
        LoadSample."""
        for b, e in zip(self.backends, view.engines, strict=True):
            b.scraped(
                LoadSample(
                    float(e.num_waiting),
                    float(e.num_running),
                    e.kv_usage(),
                    now,
                    b.in_flight,
                    finished_total=float(e.finished),
                ),
                now,
            )

    def scrape_gpus(self, now: float, view: FleetView) -> None:
        """GPU telemetry tick (``load_thermal`` only; the simple policies read none)."""
        if not self.thermal_aware:
            return
        for tr, g in zip(self.trackers, view.gpus, strict=True):
            tr.observe(
                GpuSample(
                    at=now,
                    temp_c=float(round(g.temp_c)),  # DCGM reports whole °C
                    power_w=round(g.power_w, 1),
                    power_limit_w=g.power_limit_w,
                    sm_clock_mhz=round(g.sm_clock_mhz),
                )
            )
        self.statuses = {
            b.id: tr.status(now, b.config.power_domain)
            for b, tr in zip(self.backends, self.trackers, strict=True)
        }
        self.domains = domain_statuses(self.statuses.values(), self.budgets, self.cfg)
        self._choice = None
        if self.clocks is not None:
            self._control_clocks(now, view)

    def _control_clocks(self, now: float, view: FleetView) -> None:
        """One step of the clock controller over this telemetry round; the caps it sets or
        releases go to ``pending_caps`` (the loop applies them, as an agent would)."""
        assert self.clocks is not None
        gpus = [
            GpuView(
                backend_id=b.id,
                domain=b.config.power_domain,
                max_mhz=g.spec.max_sm_clock_mhz,
                temp_c=self.statuses[b.id].temp_c,
                running=b.load.running if b.load is not None else 0.0,
                waiting=b.load.waiting if b.load is not None else 0.0,
                power_w=self.statuses[b.id].power_w,
            )
            for b, g in zip(self.backends, view.gpus, strict=True)
        ]
        for ch in self.clocks.decide(now, gpus, self.domains):
            self.pending_caps.append((self._index[ch.backend_id], ch.max_mhz))
            if ch.max_mhz is None:
                self.caps_released += 1
            else:
                self.caps_set += 1

    # -- lifecycle: thermal cooldown
    def control(self, now: float) -> None:
        """Lifecycle tick: hot backends drain and rest, rested ones return warm (the
        gateway's :mod:`gateway.routing.cooldown` decisions, the lifecycle's staggering
        and transitions); nothing to do for the simple policies."""
        if not self.thermal_aware:
            return
        self.now = now
        changed = False
        for i, b in enumerate(self.backends):
            if b.state is BackendState.WARM:
                st = self.statuses.get(b.id, UNMONITORED)
                capped_out = self.clocks is None or self.clocks.exhausted("", (b.id,))
                if (
                    capped_out
                    and cooldown_due(b.state, st, self.cfg)
                    and may_take_out(b, self.backends, self.spec.lifecycle)
                ):
                    apply_transition(b, BackendState.DRAINING, "cooldown_thermal", now)
                    self.cooldowns += 1
                    changed = True
            elif b.state is BackendState.DRAINING:
                if b.in_flight == 0:
                    apply_transition(b, BackendState.COOLDOWN, "drained", now)
                    self._rest_since[i] = now
            elif b.state is BackendState.COOLDOWN and rest_over(
                self.trackers[i], now - self._rest_since[i], now, self.cfg
            ):
                apply_transition(b, BackendState.WARM, "cooldown_done", now)
                self.returned += 1
                b.ramp_from(now)
                changed = True
        if changed:
            self._routable = [b for b in self.backends if b.state is BackendState.WARM]
            self._choice = None


def routing_policy(name: str) -> RoutingPolicy:
    """The :class:`RoutingPolicy` a policy's name denotes (see :data:`SIM_POLICIES`;
    ``clocks`` routes as ``load_thermal``); raises ValueError for any other name."""
    if name == CLOCKS:
        return RoutingPolicy.LOAD_THERMAL
    try:
        return RoutingPolicy(name)
    except ValueError:
        raise ValueError(
            f"unknown policy {name!r}; choose from {', '.join(SIM_POLICIES)}"
        ) from None
