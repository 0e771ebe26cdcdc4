"""Fleet simulator: N simulated backends (engine + GPU) in simulated time, one routing policy.

``llm-gateway sim-fleet`` and ``benchmarks/thermal.py`` run it. Everything is pure and
deterministic: a discrete-event loop over simulated seconds (no asyncio, no sleeps, no wall
clock), so a simulated day of 16 backends takes minutes on one core, and the same spec,
trace and seed give the same numbers.

Each backend is a :class:`gateway.sim.batch.BatchEngine` (continuous batching at request
granularity, the cost model of :class:`gateway.sim.engine.EngineParams`) on one
:class:`gateway.sim.thermal.GpuThermal` in its rack (ambient, ``R_th``). Every
``physics_dt_s`` (1 s) each GPU integrates the power its engine's utilisation drew, and its
SM clock (thermal throttling, power capping) sets the engine's speed for the next second.
A power domain (a rack) whose summed draw exceeds its budget is a *power-cap event*: the
facility caps it (every GPU in it is limited to ``budget / members`` W for
``facility_cap_hold_s``, so clocks drop), as the rack-level power capping TAPAS counts as
power throttling.

Policies (:data:`POLICIES`, the ``routing.policy`` values), each the routing package's own
implementation (:func:`gateway.routing.policies.build_policy`), driven by
:class:`SimulatedGateway` over :class:`gateway.fleet.backend.Backend` records:

* ``round_robin``: every backend in turn, blind to load and heat;
* ``least_request``: fewest requests in flight (the gateway's own count, exact), ties in
  turn: Envoy's ``LEAST_REQUEST`` / what most LLM routers do;
* ``load_thermal``: the gateway's own policy and thermal machinery, not a copy: load
  samples scraped every ``load_scrape_s`` (0.5 s, as ``telemetry.scrape_interval_s``) into
  :class:`gateway.core.samples.LoadSample`, GPU telemetry every ``gpu_scrape_s`` (2 s, as
  ``thermal.scrape_interval_s``; temperatures read as whole °C like DCGM) into
  :class:`gateway.routing.thermal.ThermalTracker`; per request the live gateway's default
  admission, its resource layer first (the queue wait a new request would meet on the
  least-loaded backend, :meth:`gateway.traffic.capacity.ServiceModel.predicted_wait` over
  the service rate each backend's :class:`~gateway.traffic.capacity.ServiceModel` learns
  from the load scrapes, shed at ``admission.shed_levels`` x ``slo.ttft_s``:
  :class:`gateway.config.AdmissionConfig` defaults, 4 s for the simulator's
  normal-priority requests), then :func:`gateway.traffic.admission.shed` on
  :func:`gateway.routing.thermal.power_pressure` (power admission),
  :func:`gateway.routing.thermal.choose` (tiers, trend, power caps,
  domain budgets) as the thermal hook of :class:`gateway.routing.policy.LoadThermalPolicy`
  (load score + penalties, slow start); and the thermal cooldown: a backend that
  :func:`gateway.routing.cooldown.cooldown_due` names drains when
  :func:`gateway.fleet.lifecycle.may_take_out` allows (through
  :func:`gateway.fleet.lifecycle.apply_transition`), rests until
  :func:`gateway.routing.cooldown.rest_over` (below ``resume_c`` and at least
  ``cooldown_s``, or ``max_cooldown_s``), then returns warm through the slow-start ramp.

The simple policies stand for a plain router in front of the same fleet: no queue-wait or
power admission, GPU telemetry or cooldowns (the live gateway runs those whatever its
``routing.policy``). Not modelled: the gateway's own scheduler queue (``max_in_flight``,
``max_queue_wait_s``) and entry rate limits (none by default).

Modules: :mod:`gateway.sim.fleet_spec` (:class:`FleetSpec`: racks, engine, periods),
:mod:`gateway.sim.fleet_gateway` (:class:`SimulatedGateway`), :mod:`gateway.sim.fleet_result`
(:class:`PolicyResult`), this one (the event loop :func:`simulate`; the public names of all).

Reported per policy (:class:`PolicyResult`): max GPU temperature, GPU-seconds above
``hot_c``, thermal-throttling events (entries into throttling, summed over GPUs) and
throttled GPU-seconds, peak draw per domain (highest mean over ``record_every_s`` = 60 s,
what provisioning and breakers see; the 1-s peak is kept too but saturates at nameplate),
power-cap events, goodput (requests meeting the TTFT and mean-ITL SLOs, per second of the
run; rejected and unfinished requests do not count), SLO attainment (of all arrivals, and
of the requests served), P50/P99 TTFT of the served, cooldowns, requests refused (for power
and for load apart).
"""

from __future__ import annotations

import heapq
import math
from array import array
from collections.abc import Callable, Iterable

from gateway.sim.batch import BatchEngine, SimRequest
from gateway.sim.fleet_gateway import (
    CLOCKS,
    POLICIES,
    SIM_POLICIES,
    FleetView,
    SimulatedGateway,
    routing_policy,
)
from gateway.sim.fleet_result import PolicyResult, Series, quantile
from gateway.sim.fleet_spec import FLEET_ENGINE, FleetSpec, RackSpec, capacity_rps
from gateway.sim.thermal import Cooling, GpuThermal, prefill_time_factor, step_time_factor
from gateway.sim.thermal import utilisation as power_utilisation
from gateway.sim.workload import Arrival

__all__ = [  # the simulator's entry point: its parts are re-exported here
    "CLOCKS",
    "FLEET_ENGINE",
    "POLICIES",
    "SIM_POLICIES",
    "FleetSpec",
    "PolicyResult",
    "RackSpec",
    "Series",
    "SimulatedGateway",
    "capacity_rps",
    "simulate",
]


# ---- the loop ---------------------------------------------------------------------------------
def simulate(
    spec: FleetSpec,
    policy_name: str,
    trace: Iterable[Arrival],
    duration_s: float,
    progress: Callable[[float], None] | None = None,
) -> PolicyResult:
    """Run one policy over ``trace`` for ``duration_s`` simulated seconds.

    Requests still in flight at the end are not counted (neither good nor bad); arrivals
    after ``duration_s`` are ignored. ``progress`` (optional) gets the simulated time now
    and then (every simulated 10 minutes).
    """
    racks = spec.rack_of()
    n = len(racks)
    clocks = spec.thermal.clocks if policy_name == CLOCKS else None
    if clocks is not None and not clocks.enabled:
        clocks = clocks.model_copy(update={"enabled": True})
    gateway = SimulatedGateway(spec, routing_policy(policy_name), clocks)
    engines = [BatchEngine(spec.engine) for _ in range(n)]
    gpus = [
        GpuThermal(
            spec.gpu,
            Cooling(spec.racks[r].ambient_c, spec.racks[r].r_th_k_per_w),
            hot_c=spec.thermal.hot_c,
        )
        for r in racks
    ]
    view = FleetView(engines, gpus)
    members: list[list[int]] = [[] for _ in spec.racks]
    for i, r in enumerate(racks):
        members[r].append(i)
    names = [r.name for r in spec.racks]
    budgets = [r.budget_w for r in spec.racks]
    cap_until = [-1.0] * len(spec.racks)
    cap_events = 0
    capped_s = 0.0
    peak = [0.0] * len(spec.racks)  # highest 1-s draw (W)
    window = [0.0] * len(spec.racks)  # energy (J) since the last record
    window_start = 0.0
    peak_window = [0.0] * len(spec.racks)  # highest mean draw over a record window (W)
    max_temp = [0.0] * len(spec.racks)
    series = Series(max_temp_c={nm: [] for nm in names}, draw_w={nm: [] for nm in names})

    ttfts = array("d")
    tpots = array("d")
    good = 0
    completed = 0
    rejected = 0
    arrived = 0
    slo_ttft, slo_itl = spec.slo.ttft_s, spec.slo.itl_s
    util_sum = 0.0
    util_n = 0

    version = [0] * n
    heap: list[tuple[float, int, int]] = []  # (time, version, backend)

    def reschedule(i: int) -> None:
        version[i] += 1
        t = engines[i].next_event_time()
        if t is not None:
            heapq.heappush(heap, (t, version[i], i))

    def account(i: int, done: list[SimRequest]) -> None:
        nonlocal good, completed
        for req in done:
            gateway.finished(i)
            completed += 1
            ttft = req.ttft_s
            tpot = req.tpot_s
            ttfts.append(ttft)
            tpots.append(tpot)
            if ttft <= slo_ttft and tpot <= slo_itl:
                good += 1

    last_busy = [0.0] * n
    last_occ = [0.0] * n

    def physics(now: float) -> None:
        nonlocal cap_events, capped_s, util_sum, util_n
        dt = spec.physics_dt_s
        for i in range(n):
            e = engines[i]
            account(i, e.advance(now))
            busy = e.busy_s - last_busy[i]
            occ = e.occupancy_s - last_occ[i]
            last_busy[i], last_occ[i] = e.busy_s, e.occupancy_s
            g = gpus[i]
            u = power_utilisation(busy / dt, occ / busy if busy > 0 else 0.0, g.spec.busy_floor)
            util_sum += u
            util_n += 1
            g.advance(now, u)
        for d, idx in enumerate(members):
            draw = 0.0
            hottest = 0.0
            for i in idx:
                draw += gpus[i].power_w
                hottest = max(hottest, gpus[i].temp_c)
            peak[d] = max(peak[d], draw)
            window[d] += draw * dt
            max_temp[d] = max(max_temp[d], hottest)
            capped = cap_until[d] > now
            if capped:
                capped_s += dt
            elif cap_until[d] >= 0:  # a cap just expired: lift it
                cap_until[d] = -1.0
                for i in idx:
                    gpus[i].power_limit_w = gpus[i].spec.tdp_w
                    gpus[i].advance(now, gpus[i].util)  # re-evaluate the clock
            if draw > budgets[d] and not capped:
                cap_events += 1
                cap_until[d] = now + spec.facility_cap_hold_s
                for i in idx:
                    gpus[i].power_limit_w = budgets[d] / len(idx)
                    gpus[i].advance(now, gpus[i].util)
        for i in range(n):
            g = gpus[i]
            clock = 1.0 / step_time_factor(g.clock, g.spec.clock_bound_share)
            engines[i].prefill_clock = 1.0 / prefill_time_factor(g.clock, g.spec)
            if clock != engines[i].clock:
                engines[i].clock = clock
                reschedule(i)

    def record(now: float) -> None:
        nonlocal window_start
        span = now - window_start
        series.t.append(now)
        for d, idx in enumerate(members):
            series.max_temp_c[names[d]].append(max(gpus[i].temp_c for i in idx))
            mean = window[d] / span if span > 0 else sum(gpus[i].power_w for i in idx)
            series.draw_w[names[d]].append(mean)
            if span > 0:
                peak_window[d] = max(peak_window[d], mean)
            window[d] = 0.0
        window_start = now

    it = iter(trace)
    nxt = next(it, None)
    t_phys = spec.physics_dt_s
    t_load = 0.0
    t_gpu = 0.0
    t_ctl = 0.0
    t_rec = 0.0
    t_prog = 600.0
    inf = math.inf
    while True:
        t_arr = nxt.t if nxt is not None and nxt.t < duration_s else inf
        t_eng = heap[0][0] if heap else inf
        t_tick = min(t_phys, t_load, t_gpu, t_ctl, t_rec)
        now = min(t_arr, t_eng, t_tick)
        if now > duration_s:
            break
        if t_eng == now:
            _, ver, i = heapq.heappop(heap)
            if ver == version[i]:
                account(i, engines[i].advance(now))
                reschedule(i)
            continue
        if t_tick == now:
            if t_phys == now:
                physics(now)
                t_phys += spec.physics_dt_s
            if t_load == now:
                gateway.scrape_load(now, view)
                t_load += spec.load_scrape_s
            if t_gpu == now:
                gateway.scrape_gpus(now, view)
                for i, mhz in gateway.pending_caps:  # what the agents do on the gateway's word
                    g = gpus[i]
                    if mhz is None:
                        g.reset_clocks()
                    else:
                        g.lock_clocks(g.spec.min_sm_clock_mhz, mhz)
                    g.advance(now, g.util)  # the new clock from now on
                gateway.pending_caps.clear()
                t_gpu += spec.gpu_scrape_s
            if t_ctl == now:
                gateway.control(now)
                t_ctl += spec.lifecycle.check_interval_s
            if t_rec == now:
                record(now)
                t_rec += spec.record_every_s
            if progress is not None and now >= t_prog:
                progress(now)
                t_prog += 600.0
            continue
        # an arrival
        assert nxt is not None
        arrived += 1
        req = SimRequest(nxt.t, nxt.prompt_tokens, nxt.output_tokens)
        nxt = next(it, None)
        chosen = gateway.pick(now, req)
        if chosen is None:
            req.rejected = True
            rejected += 1
            continue
        req.backend = chosen
        gateway.dispatched(chosen)
        account(chosen, engines[chosen].submit(req, now))
        reschedule(chosen)

    ttft_sorted = sorted(ttfts)
    tpot_sorted = sorted(tpots)
    return PolicyResult(
        policy=policy_name,
        duration_s=duration_s,
        arrived=arrived,
        completed=completed,
        rejected=rejected,
        rejected_power=gateway.refused_power,
        rejected_load=gateway.refused_load,
        good=good,
        goodput_rps=good / duration_s if duration_s > 0 else 0.0,
        slo_attainment=good / arrived if arrived else 1.0,
        ttft_p50_s=quantile(ttft_sorted, 0.50),
        ttft_p99_s=quantile(ttft_sorted, 0.99),
        tpot_p50_s=quantile(tpot_sorted, 0.50),
        max_temp_c=max(max_temp),
        time_above_hot_s=sum(g.time_above_s for g in gpus),
        throttle_events=sum(g.throttle_events for g in gpus),
        throttle_time_s=sum(g.throttle_time_s for g in gpus),
        peak_domain_w=dict(zip(names, peak_window, strict=True)),
        peak_domain_instant_w=dict(zip(names, peak, strict=True)),
        domain_budget_w=dict(zip(names, budgets, strict=True)),
        power_cap_events=cap_events,
        power_capped_s=capped_s,
        cooldowns=gateway.cooldowns,
        cooldowns_completed=gateway.returned,
        clock_caps_set=gateway.caps_set,
        clock_caps_released=gateway.caps_released,
        energy_kwh=sum(g.energy_j for g in gpus) / 3.6e6,
        output_tokens=sum(e.tokens_out for e in engines),
        mean_utilisation=util_sum / util_n if util_n else 0.0,
        max_temp_by_domain_c=dict(zip(names, max_temp, strict=True)),
        series=series,
    )
