"""The autoscaling fleet simulator (gateway.sim.scaling): cold starts, drains, GPU time,
the policies' figures, and ``sim-fleet --autoscale``. Short simulated traces (minutes);
each test runs in well under a second or two of CPU."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field

import pytest

from gateway.config import AutoscaleConfig
from gateway.sim.fleet_cli import main
from gateway.sim.scaling import (
    ScalingSpec,
    replica_capacity_rps,
    run_policies,
    simulate_scaling,
    trace_facts,
)
from gateway.sim.scaling_cli import autoscale_trace, build_policies
from gateway.sim.scaling_policies import POLICY_NAMES, ScalingView, TraceFacts, build_policy
from gateway.sim.workload import Arrival, TraceSpec

FACTS = TraceFacts(mean_rps=1.0, peak_minute_rps=1.0, capacity_rps=0.78)


@dataclass
class Scripted:
    """A policy that asks for what its script says (``(from_s, replicas)`` steps): an
    input to the orchestrator under test, not a stand-in for it."""

    steps: list[tuple[float, int]]
    start: int = 1
    period_s: float = 10.0
    name: str = "scripted"
    seen: list[ScalingView] = field(default_factory=list)

    def initial(self, facts: TraceFacts) -> int:
        return self.start

    def decide(self, now: float, view: ScalingView) -> int:
        self.seen.append(view)
        want = self.start
        for t, n in self.steps:
            if now >= t:
                want = n
        return want


def _steady(
    rate: float, until: float, seed: int = 3, prompt: int = 500, out: int = 100
) -> list[Arrival]:
    rng = random.Random(seed)
    t = 0.0
    xs: list[Arrival] = []
    while True:
        t += rng.expovariate(rate)
        if t >= until:
            return xs
        xs.append(Arrival(t, prompt, out))


def test_a_cold_start_delays_readiness_by_the_configured_time() -> None:
    spec = ScalingSpec(cold_start_s=(30.0, 30.0), warmup_s=0.0, history_days=0)
    policy = Scripted(steps=[(60.0, 2)])
    r = simulate_scaling(spec, policy, [], 300.0, FACTS)
    assert r.replicas_asked == 1 and r.lags == 1
    assert r.lag_p50_s == pytest.approx(30.0)  # asked at 60 s, ready at 90 s
    ready = {round(v.now): v.ready for v in policy.seen}
    starting = {round(v.now): v.starting for v in policy.seen}
    assert ready[80] == 1 and starting[80] == 1
    assert ready[90] == 2 and starting[90] == 0


def test_gpu_time_counts_cold_starts_and_an_idle_replica_leaves_at_once() -> None:
    spec = ScalingSpec(cold_start_s=(50.0, 50.0), warmup_s=0.0, history_days=0)
    policy = Scripted(steps=[(100.0, 2), (300.0, 1)])
    r = simulate_scaling(spec, policy, [], 600.0, FACTS)
    # one replica all along, one from its ask (100 s, cold start included) to 300 s
    assert r.gpu_hours == pytest.approx((600.0 + 200.0) / 3600.0)
    assert r.idle_share == pytest.approx(1.0)  # no request: every GPU-second idle
    assert r.mean_replicas == pytest.approx(800.0 / 600.0)
    assert r.max_replicas == 2


def test_a_drained_replica_finishes_its_requests_and_is_paid_until_then() -> None:
    spec = ScalingSpec(cold_start_s=(20.0, 20.0), warmup_s=0.0, history_days=0)
    trace = _steady(1.2, 300.0, prompt=1000, out=800)
    policy = Scripted(steps=[(10.0, 2), (200.0, 1)])
    r = simulate_scaling(spec, policy, trace, 900.0, FACTS)
    assert r.rejected == 0
    assert r.completed == r.arrived == len(trace)  # the drained one finished its own
    # the second replica ran from 10 s past 200 s (its requests last ~30 s at 800 tokens)
    assert r.gpu_hours > (900.0 + 190.0) / 3600.0
    assert r.gpu_hours < (900.0 + 190.0 + 120.0) / 3600.0
    assert 0.0 < r.idle_share < 1.0


def test_a_replica_cancelled_while_starting_is_paid_for_its_start_only() -> None:
    spec = ScalingSpec(cold_start_s=(60.0, 60.0), warmup_s=0.0, history_days=0)
    policy = Scripted(steps=[(100.0, 3), (130.0, 1)])
    r = simulate_scaling(spec, policy, [], 400.0, FACTS)
    assert r.replicas_asked == 2 and r.lags == 0
    assert r.gpu_hours == pytest.approx((400.0 + 2 * 30.0) / 3600.0)


def test_no_ready_replica_rejects_and_misses() -> None:
    spec = ScalingSpec(cold_start_s=(60.0, 60.0), warmup_s=0.0, history_days=0)
    policy = Scripted(steps=[], start=0)
    r = simulate_scaling(spec, policy, _steady(1.0, 100.0), 120.0, FACTS)
    assert r.rejected == r.arrived > 0 and r.slo_attainment == 0.0 and r.completed == 0


@pytest.fixture(scope="module")
def day_slice() -> tuple[ScalingSpec, TraceSpec, list]:
    """Every policy over the same 20 simulated minutes sized for a peak of 4 replicas."""
    spec = ScalingSpec(history_days=1, record_every_s=10.0, warmup_s=120.0)
    trace = autoscale_trace(4, 1.0, 1200.0, seed=5, start_hour=14.0)
    return spec, trace, run_policies(spec, trace, build_policies(list(POLICY_NAMES), spec))


def test_each_policy_runs_and_its_figures_are_consistent(day_slice: tuple) -> None:
    spec, _trace, results = day_slice
    assert [r.policy for r in results] == list(POLICY_NAMES)
    arrived = {r.arrived for r in results}
    assert len(arrived) == 1 and arrived.pop() > 500  # the same trace for all
    for r in results:
        assert 0.0 <= r.slo_attainment <= 1.0 and 0.0 <= r.idle_share <= 1.0
        assert r.good <= r.completed <= r.arrived
        # GPU-hours = the integral of the replicas allocated (sampled every 10 s)
        s = r.series
        integral = sum(s.allocated) * spec.record_every_s / 3600.0
        assert r.gpu_hours == pytest.approx(integral, rel=0.05)
        assert r.mean_replicas == pytest.approx(r.gpu_hours * 3600.0 / r.duration_s)
        assert r.max_replicas >= max(s.allocated)
        assert r.cost_per_mtok_usd == pytest.approx(
            r.gpu_hours * spec.gpu_hour_usd / r.output_tokens * 1e6
        )
        d = r.as_dict()
        assert {"L", "W", "S", "C"} <= d.keys()


def test_static_policies_never_change(day_slice: tuple) -> None:
    _, _, results = day_slice
    for r in results:
        if r.policy.startswith("static"):
            assert r.replicas_asked == 0 and r.lag_p50_s is None
            assert len(set(r.series.allocated)) == 1
            assert len(set(r.series.desired)) == 1


def test_the_peak_sized_fleet_is_sized_from_the_traces_highest_minute() -> None:
    arrivals = [Arrival(float(i) / 10.0, 10, 10) for i in range(600)]  # 10/s for 60 s
    arrivals += [Arrival(60.0 + i, 10, 10) for i in range(60)]  # then 1/s
    facts = trace_facts(arrivals, 120.0, 2.0)
    assert facts.peak_minute_rps == pytest.approx(10.0)
    assert facts.mean_rps == pytest.approx(660 / 120.0)
    p = build_policy("static-peak", AutoscaleConfig(), 2.0)
    assert p.initial(facts) == 5
    assert build_policy("static-mean", AutoscaleConfig(), 2.0).initial(facts) == 3


def _first_ask_after(policy_name: str, step_at: float) -> float:
    """When ``policy_name`` first asks for more than its start after a load step."""
    spec = ScalingSpec(history_days=0, warmup_s=60.0, record_every_s=1.0)
    low = _steady(0.6, step_at, seed=11, prompt=2000, out=800)
    high = [
        Arrival(step_at + a.t, a.prompt_tokens, a.output_tokens)
        for a in _steady(4.0, 600.0, seed=12, prompt=2000, out=800)
    ]
    cap = replica_capacity_rps(spec, TraceSpec())
    facts = TraceFacts(0.6, 0.6, cap, 0.6)
    policy = build_policy(policy_name, spec.autoscale, spec.slo.ttft_s, initial_replicas=2)
    r = simulate_scaling(spec, policy, low + high, step_at + 600.0, facts)
    for t, d in zip(r.series.t, r.series.desired, strict=True):
        if t > step_at and d > 2:
            return t
    return float("inf")


def test_ours_scales_up_on_a_load_step_before_keda_does() -> None:
    ours = _first_ask_after("ours", 300.0)
    keda = _first_ask_after("keda", 300.0)
    assert ours < 300.0 + 60.0
    assert ours < keda


def test_cli_autoscale_all_json(capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(
        [
            "--autoscale",
            "all",
            "--duration",
            "600",
            "--history-days",
            "0",
            "--backends",
            "3",
            "--json",
        ]
    )
    assert rc == 0
    body = json.loads(capsys.readouterr().out)
    assert [r["policy"] for r in body["results"]] == list(POLICY_NAMES)
    for r in body["results"]:
        assert {"L", "W", "S", "C", "gpu_hours"} <= r.keys()
        assert 0.0 <= r["S"] <= 1.0 and 0.0 <= r["W"] <= 1.0
    assert body["scenario"]["duration_s"] == 600.0


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--autoscale", "nope"], "unknown autoscaling policy 'nope'"),
        (["--autoscale", "all", "--cold-start", "90,60"], "--cold-start needs 0 <= MIN <= MAX"),
        (["--autoscale", "ours", "--cold-start", "sixty"], "--cold-start wants MIN,MAX"),
        (["--autoscale", "keda,ours,keda", "--duration", "60"], "policy 'keda' given twice"),
    ],
)
def test_cli_bad_autoscale_flags_exit_2_with_one_line(
    flags: list[str], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(flags) == 2
    err = capsys.readouterr().err
    assert says in err and err.count("\n") == 1


@pytest.mark.timeout(20)
@pytest.mark.parametrize(
    "flags",
    [
        ["--autoscale", "ours", "--duration", "nan"],
        ["--autoscale", "ours", "--duration", "600", "--load", "inf"],
        ["--autoscale", "ours", "--duration", "600", "--start-hour", "nan"],
        ["--autoscale", "ours", "--duration", "600", "--gpu-hour-usd", "nan"],
        ["--duration", "nan"],
        ["--duration", "60", "--ambient", "nan,25"],
    ],
)
def test_cli_a_number_that_is_not_finite_exits_2_naming_its_flag(
    flags: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    # float() takes "nan" and "inf": a run of nan or inf simulated seconds never ended
    with pytest.raises(SystemExit) as e:
        main(flags)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {flags[-2]}" in err and "finite" in err


def test_the_scale_up_lag_ends_when_the_replica_is_ready_not_at_the_next_decision() -> None:
    # a policy deciding every 30 s (as keda) must not have its lag rounded up to its period
    spec = ScalingSpec(cold_start_s=(45.0, 45.0), warmup_s=0.0, history_days=0)
    policy = Scripted(steps=[(60.0, 2)], period_s=30.0)
    r = simulate_scaling(spec, policy, [], 300.0, FACTS)
    assert r.lags == 1
    assert r.lag_p50_s == pytest.approx(45.0)  # asked at 60 s, ready at 105 s (not 120 s)


def _view(now: float, ready: int, starting: int, waiting: int) -> ScalingView:
    return ScalingView(now, ready, starting, 0, waiting, 0.0, None, None, None, None, 32)


def test_keda_is_the_hpa_syncing_every_15_s_on_a_gauge_scraped_every_30_s() -> None:
    # KEDA's pollingInterval governs only 0 <-> 1; the HPA syncs every 15 s and reads the
    # summed gauge as Prometheus last scraped it (every 30 s)
    p = build_policy("keda", AutoscaleConfig(), 2.0)
    assert p.period_s == 15.0
    # a queue of 100 at the scrape: ceil(100 / 5) = 20, the scale-up limit max(2 x 1, 1 + 4)
    assert p.decide(0.0, _view(0.0, 1, 0, 100)) == 5
    # 15 s on, the same scrape (the gauge reads 0 now, unscraped): the next step, 2 x 5
    assert p.decide(15.0, _view(15.0, 1, 4, 0)) == 10
    # the next scrape sees the queue gone: 300 s of stabilization hold the 10
    assert p.decide(30.0, _view(30.0, 1, 9, 0)) == 10
    t = 30.0
    while t < 330.0:
        t += 15.0
        got = p.decide(t, _view(t, 10, 0, 0))
    assert got == 1  # the recommendations of 20 have left the window: down to min 1


def test_slot_share_shows_the_batch_a_busy_replica_leaves_empty() -> None:
    # one replica, one request at a time: busy (W near 0) yet 1 of its 32 slots used
    spec = ScalingSpec(warmup_s=0.0, history_days=0)
    trace = [Arrival(float(t), 100, 400) for t in range(0, 600, 20)]
    r = simulate_scaling(spec, Scripted(steps=[]), trace, 600.0, FACTS)
    slots = spec.engine.max_num_seqs
    assert r.idle_share < 0.5
    assert r.slot_share == pytest.approx((1.0 - r.idle_share) / slots, rel=0.05)
