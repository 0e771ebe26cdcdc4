"""Maintenance that costs no capacity the load needs: may the others carry the load if a
backend leaves for a cycle? (pure: ``gateway.fleet.lifecycle.can_carry_without``)."""

from __future__ import annotations

from gateway.config import BackendConfig
from gateway.core.samples import LoadSample
from gateway.core.vocab import BackendState
from gateway.fleet.backend import Backend
from gateway.fleet.lifecycle import can_carry_without
from gateway.traffic.capacity import EngineSample

S = BackendState


def backend(i: int, service_rate: float | None, completion_rps: float = 0.0,
            in_system: float = 0.0) -> Backend:
    """A warm backend whose service model learned ``service_rate`` requests/s at
    concurrency 16 and now completes ``completion_rps``."""
    b = Backend(config=BackendConfig(id=f"b{i}", url=f"http://h:{8000 + i}"))
    b.state, b.models = S.WARM, ("m",)
    svc = b.service
    if service_rate is not None:
        svc.plateau, svc.service_s = 16.0, 16.0 / service_rate
    svc.completion_rate = completion_rps
    b.load = LoadSample(0.0, min(in_system, 16.0), 0.1, 0.0, 0)
    if in_system > 16:
        b.load = LoadSample(in_system - 16, 16.0, 0.1, 0.0, 0)
    return b


def check(fleet: list[Backend], demand: float | None = None) -> str | None:
    return can_carry_without(fleet[0], fleet, {} if demand is None else {"m": demand},
                             target_utilization=0.8)


def test_idle_fleet_always_passes():
    assert check([backend(0, None), backend(1, None)]) is None


def test_two_backends_at_60_percent_cannot_lose_one():
    # each serves 10 req/s at most; 12 req/s demand: one alone would be at 120%
    fleet = [backend(0, 10, 6, 8), backend(1, 10, 6, 8)]
    why = check(fleet)
    assert why is not None and "120%" in why
    # at 35% of the fleet (7 req/s) the other one runs at 70%: it may go
    fleet = [backend(0, 10, 3.5, 4), backend(1, 10, 3.5, 4)]
    assert check(fleet) is None


def test_forecast_above_the_measured_rate_defers():
    fleet = [backend(0, 10, 2, 2), backend(1, 10, 2, 2)]
    assert check(fleet) is None
    assert check(fleet, demand=9.0) is not None  # a burst is forecast: 9 > 0.8 x 10


def test_an_unknown_capacity_counts_as_the_known_mean_and_all_unknown_defers_under_load():
    fleet = [backend(0, 10, 2, 2), backend(1, None, 2, 2), backend(2, None, 0, 0)]
    assert check(fleet) is None  # others: 2 x 10 (the mean of the known) vs 4 req/s
    fleet = [backend(0, None, 2, 2), backend(1, None, 2, 2)]
    assert "not known" in (check(fleet) or "")


def test_a_backlog_that_would_miss_the_slo_on_the_others_defers():
    # a low rate but 40 requests in the system: on one backend of 16 slots at 4 req/s the
    # 25 beyond its slots wait 6 s
    fleet = [backend(0, 4, 0.5, 20), backend(1, 4, 0.5, 20)]
    assert check(fleet) is not None


def test_the_last_warm_backend_never_goes():
    fleet = [backend(0, 10, 1, 1), backend(1, 10, 1, 1)]
    fleet[1].state = S.UNHEALTHY
    assert "no other warm" in (check(fleet) or "")


def test_learned_from_scrapes_end_to_end():
    b0, b1 = backend(0, None), backend(1, None)
    for b in (b0, b1):  # 16 running, 8 queued, 8 finished a second for 20 s
        for k in range(41):
            t = k * 0.5
            b.service.observe(EngineSample(t, 8, 16, 8 * t))
    assert b0.service.service_rate is not None and abs(b0.service.service_rate - 8) < 0.5
    assert check([b0, b1]) is not None  # 16 req/s on one backend of 8


def test_a_never_saturated_fleet_is_judged_by_what_it_ran_unless_configured():
    """Two backends at a light load, never saturated (at most 2 at once, 1.5 on average,
    12 req/s each): evidence says each can do about 16 req/s, so one cannot carry 24 and
    the cycle waits; with ``max_num_seqs: 16`` configured each can do 128 and it runs."""
    def pair(configured: int | None) -> list[Backend]:
        out = []
        for i in range(2):
            b = backend(i, None)
            b.service.configured = configured
            for k in range(41):
                t = k * 0.5
                b.service.observe(EngineSample(t, 0, 1 + k % 2, 12 * t))
            out.append(b)
        return out

    b0, b1 = pair(None)
    assert b0.service.concurrency == 2 and b0.service.ceiling == 2
    assert check([b0, b1]) is not None
    assert check(pair(16)) is None


def test_a_dead_backends_last_load_is_no_demand():
    fleet = [backend(0, 10, 1, 1), backend(1, 10, 1, 1), backend(2, 10, 9, 30)]
    fleet[2].state = S.UNHEALTHY  # died overloaded; its last scrape stays
    assert check(fleet) is None


def test_a_load_that_just_rose_counts_before_its_averages_catch_up():
    """The completion rate and the forecast are averages; 16 requests running on
    backends whose requests take 0.4 s (40 req/s at 16 at once) mean about 40 req/s now,
    whatever they say: the other one alone would be at 100%."""
    fleet = [backend(0, 40, 1, 8), backend(1, 40, 1, 8)]
    assert check(fleet, demand=2.0) is not None
    fleet = [backend(0, 40, 1, 2), backend(1, 40, 1, 2)]
    assert check(fleet, demand=2.0) is None  # 10 req/s running: the other carries it
