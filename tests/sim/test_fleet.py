"""The fleet simulator (simulated time): engine model, traces, policies, determinism."""

from __future__ import annotations

import dataclasses
import itertools
import json
import sys
from pathlib import Path

import pytest

from gateway.config import RoutingPolicy
from gateway.routing.policies import LeastRequestPolicy, RoundRobinPolicy
from gateway.routing.policy import LoadThermalPolicy
from gateway.sim.batch import BatchEngine, SimRequest
from gateway.sim.engine import Engine, EngineParams
from gateway.sim.engine_types import EngineRequest
from gateway.sim.fleet import (
    POLICIES,
    FleetSpec,
    PolicyResult,
    RackSpec,
    SimulatedGateway,
    simulate,
)
from gateway.sim.fleet_cli import FLEET_THERMAL, FLEET_WEIGHTS, main, trace_for_load, uneven_racks
from gateway.sim.fleet_report import ratios, to_json
from gateway.sim.workload import Arrival, TraceSpec, generate, read_csv

TEN_MIN = 600.0


def small_spec(**kw: object) -> FleetSpec:
    """4 backends in 2 racks: rack-a 22 °C / 0.070 K/W, rack-b 32 °C / 0.085 K/W."""
    return FleetSpec(racks=uneven_racks(4, 2), thermal=FLEET_THERMAL, weights=FLEET_WEIGHTS, **kw)  # type: ignore[arg-type]


def small_run(policy: str, seed: int = 3, load: float = 0.6) -> PolicyResult:
    spec = small_spec(seed=seed)
    ts = trace_for_load(spec, load, TEN_MIN, seed, start_hour=15.0)
    return simulate(spec, policy, generate(ts), TEN_MIN)


@pytest.fixture(scope="module")
def runs() -> dict[str, PolicyResult]:
    return {p: small_run(p) for p in ("round_robin", "least_request", "load_thermal")}


def test_batch_engine_matches_the_token_engine_for_one_request() -> None:
    params = EngineParams()
    tok = Engine(params)
    tok.submit(EngineRequest("a", list(range(100)), max_tokens=20), 0.0)
    tok.run_until_idle(0.0)
    (m,) = tok.drain_finished()
    fluid = BatchEngine(params)
    req = SimRequest(0.0, 100, 20)
    fluid.submit(req, 0.0)
    done = fluid.advance(100.0)
    assert done == [req]
    assert req.ttft_s == pytest.approx(m.ttft_s, rel=0.05)
    assert req.finished_at == pytest.approx(m.e2e_s, rel=0.05)


def test_batch_engine_batches_and_queues() -> None:
    params = EngineParams(max_num_seqs=2)
    e = BatchEngine(params)
    reqs = [SimRequest(0.0, 10, 100) for _ in range(3)]
    for r in reqs:
        e.submit(r, 0.0)
    assert (e.num_running, e.num_waiting) == (2, 1)
    done = e.advance(1000.0)
    assert [r.finished_at > 0 for r in done] == [True] * 3
    assert reqs[2].admitted_at == pytest.approx(reqs[0].finished_at)  # waited for a slot
    # two in a batch: each step is slower than alone, so ITL grows with the batch
    assert reqs[0].tpot_s == pytest.approx(params.decode_time_s(2), rel=0.05)
    e.clock = 0.5  # a throttled GPU: half the speed
    r = SimRequest(1000.0, 10, 100)
    e.submit(r, 1000.0)
    e.advance(2000.0)
    assert r.tpot_s == pytest.approx(2 * params.decode_time_s(1), rel=0.05)


def test_trace_is_deterministic_diurnal_and_bursty() -> None:
    spec = TraceSpec(duration_s=3600.0, mean_rps=5.0, seed=4, start_hour=15.5)
    a, b = list(generate(spec)), list(generate(spec))
    assert a == b and len(a) > 1000
    assert all(x.t <= y.t for x, y in itertools.pairwise(a))
    other = list(generate(dataclasses.replace(spec, seed=5)))
    assert other != a
    assert spec.diurnal(0.5 * 3600) > spec.diurnal(12 * 3600)  # 16:00 busier than 03:30


def test_csv_trace_reader(tmp_path: Path) -> None:
    p = tmp_path / "trace.csv"
    p.write_text("arrival_s,prompt_tokens,output_tokens\n12.5,100,20\n10.0,50,10\n\n11,0,5\n")
    rows = read_csv(p)
    assert rows == [Arrival(0.0, 50, 10), Arrival(1.0, 1, 5), Arrival(2.5, 100, 20)]
    azure = tmp_path / "azure.csv"
    azure.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n0,10,3\n")
    assert read_csv(azure) == [Arrival(0.0, 10, 3)]
    bad = tmp_path / "bad.csv"
    bad.write_text("time,prompt_tokens\n1,2\n")
    with pytest.raises(ValueError, match="output_tokens"):
        read_csv(bad)
    bad.write_text("time,prompt_tokens,output_tokens\n1,2,x\n")
    with pytest.raises(ValueError, match=r"bad.csv:2"):
        read_csv(bad)
    r = simulate(small_spec(), "load_thermal", rows, 60.0)
    assert (r.arrived, r.completed, r.rejected) == (3, 3, 0)


def test_same_seed_same_result_other_seed_differs() -> None:
    a = small_run("load_thermal", seed=3, load=0.6)
    b = small_run("load_thermal", seed=3, load=0.6)
    c = small_run("load_thermal", seed=4, load=0.6)
    assert a.as_dict(with_series=True) == b.as_dict(with_series=True)
    assert a.as_dict() != c.as_dict()


def test_round_robin_heats_the_badly_cooled_rack_more_than_load_thermal(
    runs: dict[str, PolicyResult],
) -> None:
    rr, gw = runs["round_robin"], runs["load_thermal"]
    assert rr.arrived == gw.arrived > 1000
    assert rr.max_temp_by_domain_c["rack-b"] > gw.max_temp_by_domain_c["rack-b"] + 1.0
    assert rr.max_temp_by_domain_c["rack-b"] > rr.max_temp_by_domain_c["rack-a"] + 10.0
    assert rr.max_temp_c > gw.max_temp_c + 1.0
    assert gw.goodput_rps >= 0.98 * runs["least_request"].goodput_rps


def test_load_thermal_cools_a_failing_rack_down_and_brings_it_back() -> None:
    """A rack at 45 °C inlet with poor airflow: the gateway drains its hot GPUs, rests them below
    the resume temperature, and returns them (lifecycle transitions of the real Backend)."""
    racks = (
        RackSpec("good", 3, 22.0, 0.07, 3 * 700.0),
        RackSpec("failing", 1, 45.0, 0.1, 700.0),
    )
    spec = FleetSpec(racks=racks, thermal=FLEET_THERMAL, weights=FLEET_WEIGHTS)
    ts = trace_for_load(spec, 0.8, 1200.0, 1, start_hour=15.0)
    gw = simulate(spec, "load_thermal", generate(ts), 1200.0)
    rr = simulate(spec, "round_robin", generate(ts), 1200.0)
    # both touch the throttling threshold (the hardware holds every GPU under it); the
    # gateway's GPU spends a fraction of the time above hot_c
    assert gw.max_temp_by_domain_c["failing"] < rr.max_temp_by_domain_c["failing"] + 0.5
    assert rr.time_above_hot_s > 2 * gw.time_above_hot_s
    assert rr.throttle_time_s > 2 * gw.throttle_time_s
    assert gw.cooldowns >= 1 and gw.cooldowns_completed >= 1
    assert gw.goodput_rps > rr.goodput_rps


@pytest.mark.parametrize(
    ("name", "kind", "thermal"),
    [
        ("round_robin", RoundRobinPolicy, False),
        ("least_request", LeastRequestPolicy, False),
        ("load_thermal", LoadThermalPolicy, True),
    ],
)
def test_the_simulator_runs_the_routing_packages_policies(
    name: str, kind: type, thermal: bool
) -> None:
    """Each simulated policy is the routing package's own object (the `routing.policy`
    values, in report order), with the gateway's thermal machinery for load_thermal only."""
    gw = SimulatedGateway(small_spec(), RoutingPolicy(name))
    assert type(gw.policy) is kind
    assert gw.thermal_aware is thermal
    assert POLICIES == ("round_robin", "least_request", "load_thermal")
    with pytest.raises(ValueError, match="unknown policy 'ours'"):
        simulate(small_spec(), "ours", [], 1.0)


def test_report_json_and_ratios(runs: dict[str, PolicyResult]) -> None:
    body = json.loads(to_json(list(runs.values())))
    assert [r["policy"] for r in body["results"]] == list(POLICIES)
    assert set(body["ratios"]["load_thermal"]) == {"round_robin", "least_request"}
    r = ratios(runs["load_thermal"], runs["round_robin"])
    assert r["max_temp_c"] == pytest.approx(
        1 - runs["load_thermal"].max_temp_c / runs["round_robin"].max_temp_c
    )


def test_cli_json_and_plot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    png = tmp_path / "fleet.png"
    args = ["--backends", "2", "--racks", "2", "--duration", "120", "--json"]
    assert main([*args, "--policies", "least_request,load_thermal", "--plot", str(png)]) == 0
    body = json.loads(capsys.readouterr().out)
    assert [r["policy"] for r in body["results"]] == ["least_request", "load_thermal"]
    assert png.stat().st_size > 10_000 and png.read_bytes()[:4] == b"\x89PNG"
    assert main([*args, "--policies", "nope"]) == 2


def test_plot_without_matplotlib_fails_clearly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    png = tmp_path / "x.png"
    assert main(["--duration", "10", "--plot", str(png)]) == 2
    assert "--plot needs matplotlib" in capsys.readouterr().err
    assert not png.exists()
