"""The fleet simulator's gateway runs the live gateway's resource-layer admission: it sheds
by the predicted queue wait (learned service rate, scraped queue) for ``load_thermal`` and
``clocks``, never for the baselines, and counts those refusals apart from power's."""

from __future__ import annotations

import dataclasses

from gateway.config import AdmissionConfig, RoutingPolicy
from gateway.sim.batch import BatchEngine, SimRequest
from gateway.sim.fleet import CLOCKS, FleetSpec, RackSpec, simulate
from gateway.sim.fleet_cli import FLEET_THERMAL, FLEET_WEIGHTS
from gateway.sim.fleet_gateway import FleetView, SimulatedGateway
from gateway.sim.thermal import Cooling, GpuThermal
from gateway.sim.workload import Arrival

# Two backends in one rack with a budget no load reaches: no power refusals, no heat.
SPEC = FleetSpec(
    racks=(RackSpec("r", 2, 22.0, 0.07, 100_000.0),),
    thermal=FLEET_THERMAL,
    weights=FLEET_WEIGHTS,
)


def overload(rps: float = 40.0, seconds: float = 60.0) -> list[Arrival]:
    """Short requests (200 prompt / 100 output tokens: about 4 s at a full batch of 32, so
    about 16 req/s for the two backends) arriving evenly at ``rps``."""
    n = round(rps * seconds)
    return [Arrival(k / rps, 200, 100) for k in range(n)]


def test_gateway_policies_shed_by_predicted_wait_and_baselines_do_not() -> None:
    lt = simulate(SPEC, "load_thermal", overload(), 120.0)
    ck = simulate(SPEC, CLOCKS, overload(), 120.0)
    lr = simulate(SPEC, "least_request", overload(), 120.0)
    for r in (lt, ck):
        assert r.rejected_load > 0 and r.rejected_power == 0
        assert r.rejected == r.rejected_load
        # shed at a predicted wait of 2 x the 2 s SLO (from the first ~15 s, once the
        # service rate is learned): the queue stops growing, unlike least_request's
        assert r.ttft_p99_s < 15.0 < 30.0 < lr.ttft_p50_s
        assert r.good > 2 * lr.good
    assert lr.rejected == lr.rejected_load == lr.rejected_power == 0
    off = dataclasses.replace(SPEC, admission=AdmissionConfig(enabled=False))
    assert simulate(off, "load_thermal", overload(), 120.0).rejected_load == 0


def test_load_refused_reads_the_scraped_queue_over_the_learned_rate() -> None:
    gw = SimulatedGateway(SPEC, RoutingPolicy.LOAD_THERMAL)
    engines = [BatchEngine(SPEC.engine) for _ in range(2)]
    gpus = [GpuThermal(SPEC.gpu, Cooling(22.0, 0.07), hot_c=FLEET_THERMAL.hot_c) for _ in engines]
    view = FleetView(engines, gpus)
    for e in engines:  # 32 running and 8 waiting on each: a short queue
        for _ in range(40):
            e.submit(SimRequest(0.0, 200, 100), 0.0)
    t = 0.0
    while t < 20.0:  # scrapes every 0.5 s teach the service model; keep the queue short
        for e in engines:
            e.advance(t)
            while e.num_waiting < 8:
                e.submit(SimRequest(t, 200, 100), t)
        gw.scrape_load(t, view)
        t += SPEC.load_scrape_s
    service = gw.backends[0].service
    assert service.service_rate is not None
    assert service.predicted_wait(8, 32) < 4.0  # (8 + 1) / ~8 req/s: about 1 s
    assert not gw.load_refused(t)
    assert gw.pick(t, SimRequest(t, 200, 100)) is not None
    for e in engines:  # a queue of 100 on each: (100 + 1) / ~8 req/s, over 4 s
        for _ in range(100):
            e.submit(SimRequest(t, 200, 100), t)
    gw.scrape_load(t, view)
    assert service.predicted_wait(engines[0].num_waiting, 32) > 4.0
    assert gw.pick(t, SimRequest(t, 200, 100)) is None
    assert (gw.refused_load, gw.refused_power) == (1, 0)
