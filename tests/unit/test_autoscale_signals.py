"""The autoscaling signals' parts with an injected clock: cold starts by stage
(:mod:`gateway.fleet.cold_start`), the replica counts and gauges a model's signals are built
from (:mod:`gateway.flow.autoscaling`), and fleet mode's combined inputs and decision
records (:func:`gateway.autoscale.combine_inputs`, :meth:`Decision.from_dict`)."""

from __future__ import annotations

from gateway.autoscale import ArrivalInputs, Decision, combine_inputs
from gateway.config import BackendConfig, load_config
from gateway.core.samples import LoadSample
from gateway.core.vocab import BackendState
from gateway.fleet.cold_start import ColdStarts
from gateway.fleet.fleet import Fleet
from gateway.fleet.state import FleetState
from gateway.flow.accounting import Accounting
from gateway.flow.autoscaling import AutoscaleSignals
from gateway.metrics import GatewayMetrics

S = BackendState


class Clock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def build(**autoscale: object) -> tuple[Fleet, FleetState, ColdStarts, GatewayMetrics, Clock,
                                        AutoscaleSignals]:
    cfg = load_config(
        None,
        backends=[{"id": "a", "url": "http://h:1", "models": ["m"], "max_num_seqs": 8}],
        autoscale=autoscale,
    )
    clock = Clock()
    fleet = Fleet.from_config(cfg, clock)
    metrics = GatewayMetrics()
    state = FleetState(fleet, metrics, 3, clock, clock)
    cold = ColdStarts(fleet, state, metrics, clock)
    acc = Accounting(metrics, clock, lambda b, now: 1.0)
    signals = AutoscaleSignals(cfg, fleet, metrics, acc, None, cold, clock, clock)
    return fleet, state, cold, metrics, clock, signals


def samples(metrics: GatewayMetrics, suffix: str) -> dict[tuple[str, str], float]:
    return {(s.labels["model"], s.labels["stage"]): s.value
            for s in metrics.cold_start.collect()[0].samples if s.name.endswith(suffix)}


def test_a_discovered_backend_s_cold_start_by_stage_and_the_mean_of_those_after_start():
    fleet, state, cold, metrics, clock, _ = build()
    a = fleet.get("a")
    assert a is not None
    clock.t = 1004.0
    state.transition(a, S.WARMING, "probe_ok")
    state.transition(a, S.WARM, "ready")
    assert samples(metrics, "_sum")[("m", "total")] == 4.0  # observed, found at start
    assert cold.mean_s("m") is None  # ... but not a cold start the gateway saw begin

    b = fleet.add(BackendConfig(id="b", url="http://h:2", models=["m"]))  # discovery, t=1004
    clock.t = 1034.0
    state.transition(b, S.WARMING, "probe_ok")  # server up, model loaded: 30 s
    clock.t = 1039.0  # warm-up: 5 s
    state.transition(b, S.WARM, "ready")
    got = samples(metrics, "_sum")
    assert (got[("m", "load")], got[("m", "warmup")], got[("m", "total")]) == (
        4.0 + 30.0, 0.0 + 5.0, 4.0 + 35.0)  # a's (4 s, no warm-up) and b's
    assert cold.mean_s("m") == 35.0

    # a restart: cold at 1100, a failed warm-up in between, warm at 1160
    state.transition(b, S.DRAINING, "admin_drain")
    clock.t = 1100.0
    state.transition(b, S.COLD, "restarted")
    clock.t = 1150.0
    state.transition(b, S.WARMING, "probe_ok")
    state.transition(b, S.UNHEALTHY, "probe_failed")
    clock.t = 1155.0
    state.transition(b, S.WARMING, "probe_recovered")
    clock.t = 1160.0
    state.transition(b, S.WARM, "ready")
    assert cold.mean_s("m") == (35.0 + 60.0) / 2
    assert samples(metrics, "_count")[("m", "load")] == 3
    # back from draining without a cold start: nothing observed
    state.transition(b, S.DRAINING, "admin_drain")
    state.transition(b, S.WARM, "undrained")
    assert samples(metrics, "_count")[("m", "total")] == 3


def test_signals_count_ready_and_warming_and_read_the_ready_backends_gauges():
    fleet, state, _, _, clock, signals = build(default_slots=32)
    a = fleet.get("a")
    assert a is not None
    state.transition(a, S.WARMING, "probe_ok")
    state.transition(a, S.WARM, "ready")
    a.scraped(LoadSample(3, 5, 0.5, clock.t, 0), clock.t)
    for i, to in enumerate((S.COLD, S.WARMING, S.DRAINING, S.UNHEALTHY)):
        b = fleet.add(BackendConfig(id=f"b{i}", url=f"http://h:{10 + i}", models=["m"]))
        b.scraped(LoadSample(100, 100, 1.0, clock.t, 0), clock.t)  # not ready: not read
        if to is not S.COLD:
            state.transition(b, S.WARMING, "probe_ok")
        if to is S.DRAINING:
            state.transition(b, S.WARM, "ready")
        if to is not S.WARMING and to is not S.COLD:
            state.transition(b, to, "test")
    s = signals.signals("m", ArrivalInputs(1.0, 2.0, 3.0, 0.4, 25))
    assert (s.ready, s.warming, s.current) == (1, 2, 3)  # draining / unhealthy: neither
    assert (s.running, s.waiting, s.kv_cache_usage) == (5, 3, 0.5)
    assert s.slots == 8  # the ready backend's configured max_num_seqs
    assert (s.rate_rps, s.ahead_rps, s.ahead_high_rps, s.ttft_p99_s) == (1.0, 2.0, 3.0, 0.4)
    none = signals.signals("x", ArrivalInputs())
    assert (none.ready, none.slots) == (0, 32)  # no backend: autoscale.default_slots


async def test_a_model_whose_backends_left_is_forgotten_unless_configured():
    fleet, _state, _, metrics, clock, signals = build(
        models={"kept": {"min_replicas": 2, "max_replicas": 4}}, scale_down_cooldown_s=0)
    await signals.round()
    assert set(signals.answers) == {"m", "kept"}
    assert signals.answers["kept"].decision.desired == 2  # no backend: its min_replicas
    assert metrics.autoscale_desired.labels("m")._value.get() == 1
    fleet.remove("a")
    clock.t += 1
    await signals.round()
    assert set(signals.answers) == {"kept"}
    names = {s.labels.get("model") for f in metrics.registry.collect()
             if f.name.startswith("gateway_autoscale") or f.name == "gateway_replicas"
             for s in f.samples}
    assert "m" not in names and "kept" in names


def test_fleet_inputs_combine_and_decisions_round_trip():
    a = ArrivalInputs(1.0, 2.0, 3.0, 0.5, 30)
    b = ArrivalInputs(0.5, None, 1.0, None, 4)  # too few first tokens for a P99
    c = combine_inputs([a, b])
    assert (c.rate_rps, c.ahead_rps, c.ahead_high_rps, c.ttft_p99_s, c.ttft_samples) == (
        1.5, 2.0, 4.0, 0.5, 34)
    assert combine_inputs([ArrivalInputs()]) == ArrivalInputs()
    assert ArrivalInputs.from_dict(a.as_dict()) == a
    assert ArrivalInputs.from_dict({"rate_rps": "x", "ttft_samples": True}) == ArrivalInputs()
    d = Decision(12.5, 3, 2, 1, 1, 0, 3, 1, 2, 1, "fast", 0.25)
    assert Decision.from_dict(d.as_dict()) == d
