"""The fleet-state service (gateway.fleet.state) and the parts a Backend is built with
(gateway.fleet.fleet.Fleet): fake clocks, no network."""

from __future__ import annotations

import pytest

from gateway.config import load_config
from gateway.core.vocab import BackendState
from gateway.fleet.backend import Backend
from gateway.fleet.cold_start import ColdStarts
from gateway.fleet.fleet import Fleet
from gateway.fleet.lifecycle import IllegalTransition
from gateway.fleet.records import ControlRecord, Deferral, Transition
from gateway.fleet.state import FleetState
from gateway.metrics import GatewayMetrics

S = BackendState


class Clock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


class RecordingStore:
    """A store that keeps every commit and applies it only when ``apply`` is set (a store
    that keeps the records elsewhere)."""

    def __init__(self, apply: bool = True) -> None:
        self.apply = apply
        self.commits: list[tuple[str, ControlRecord, Transition | None]] = []

    def commit(self, backend: Backend, record: ControlRecord, moved: Transition | None) -> None:
        self.commits.append((backend.id, record, moved))
        if self.apply:
            backend.apply_control(record, moved)


def make(
    store: RecordingStore | None = None, **cfg: object
) -> tuple[FleetState, Fleet, Clock, GatewayMetrics]:
    c = load_config(
        None,
        backends=[
            {"id": "a", "url": "http://h:1", "api_key": "sk-a"},
            {"id": "b", "url": "http://h:2", "gpu_metrics_url": "http://h:9400/metrics"},
        ],
        **cfg,
    )
    clock = Clock()
    fleet = Fleet.from_config(c, clock)
    metrics = GatewayMetrics()
    state = FleetState(fleet, metrics, c.breaker.unhealthy_after_trips, clock, clock, store)
    return state, fleet, clock, metrics


def test_every_change_goes_through_the_store_and_nothing_else_writes():
    store = RecordingStore(apply=False)
    state, fleet, _clock, _ = make(store)
    a = fleet.get("a")
    assert a is not None
    before = a.control()
    state.transition(a, S.WARMING, "probe_ok")
    state.hold(a, "admin_drain", None)
    state.release_hold(a, restart_seen=True)
    state.set_drain_deadline(a, 5.0)
    state.mark_drained(a)
    state.maintenance_started(a, "short")
    state.maintenance_ended(a)
    state.set_deferral(a, Deferral("medium", 1.0, "busy"))
    state.auth_refused(a, "401", 401)
    # a store keeping records elsewhere: the backend is as it was, each change was handed on
    assert a.control() == before and not a.history
    assert len(store.commits) == 9
    assert store.commits[0][1].state is S.WARMING
    assert store.commits[0][2] is not None and store.commits[0][2].reason == "probe_ok"
    assert store.commits[1][1].hold == "admin_drain"
    assert store.commits[3][1].drain_deadline == 5.0
    assert store.commits[4][1].drained
    assert store.commits[5][1].maintenance == "short"
    assert store.commits[7][1].deferred == Deferral("medium", 1.0, "busy")
    assert store.commits[8][1].config_error == "401"
    assert all(m is None for _, _, m in store.commits[1:])


def test_transition_effects_and_listeners():
    store = RecordingStore()
    state, fleet, clock, metrics = make(store)
    a = fleet.get("a")
    assert a is not None
    seen: list[tuple[str, S, S]] = []
    cold_starts = ColdStarts(fleet, state, metrics, clock)  # the cold start's measurer
    state.listen(lambda b, t: seen.append((b.id, t.from_state, t.to_state)))
    assert a.first_seen == 1000.0  # the cold-start timer runs from when the fleet is built
    clock.t = 1003.0
    state.transition(a, S.WARMING, "probe_ok")
    a.breaker.on_failure()
    state.transition(a, S.WARM, "ready")
    assert a.warm_since == 1003.0 and a.first_seen is None and not a.drained
    assert a.breaker.consecutive == 0  # reset: it came back through warm-up
    cold_start = metrics.cold_start.collect()[0].samples
    assert any(s.name.endswith("_sum") and s.value == 3.0 and s.labels["stage"] == "total"
               for s in cold_start)
    assert cold_starts.mean_s("unknown") is None  # found at start: not a measured cold start
    state.transition(a, S.DRAINING, "admin_drain")
    state.set_drain_deadline(a, 2000.0)
    state.transition(a, S.COLD, "restarted")
    assert a.drain_deadline is None and a.first_seen == 1003.0
    assert [t.reason for t in a.history] == ["probe_ok", "ready", "admin_drain", "restarted"]
    assert seen == [
        ("a", S.COLD, S.WARMING),
        ("a", S.WARMING, S.WARM),
        ("a", S.WARM, S.DRAINING),
        ("a", S.DRAINING, S.COLD),
    ]
    state.transition(a, S.COLD, "again")  # already there: nothing happens
    assert len(a.history) == 4 and len(seen) == 4
    with pytest.raises(IllegalTransition):
        state.transition(a, S.DRAINING, "nope")


def test_a_fleet_found_warm_at_start_gets_no_slow_start():
    state, fleet, _, _ = make()
    a = fleet.get("a")
    assert a is not None
    with state.starting_up():
        state.transition(a, S.WARMING, "probe_ok")
        state.transition(a, S.WARM, "ready")
    assert a.warm_since is None


def test_unhealthy_restarts_the_passing_probe_count():
    state, fleet, _, _ = make()
    a = fleet.get("a")
    assert a is not None
    state.transition(a, S.WARMING, "probe_ok")
    a.count_probe(True)
    a.count_probe(True)
    state.transition(a, S.UNHEALTHY, "warmup_failed")
    assert a.consecutive_probe_successes == 0


def test_breaker_trips_make_a_serving_backend_unhealthy():
    state, fleet, _, _metrics = make(breaker={"unhealthy_after_trips": 2})
    a = fleet.get("a")
    assert a is not None
    state.transition(a, S.WARMING, "probe_ok")
    state.transition(a, S.WARM, "ready")
    a.breaker.trips = 1
    state.breaker_tripped(a)
    assert a.state is S.WARM
    a.breaker.trips = 2
    state.breaker_tripped(a)
    assert a.state is S.UNHEALTHY and a.history[-1].reason == "breaker_open"


def test_auth_refused_is_a_config_error_until_cleared():
    state, fleet, _, _ = make()
    a = fleet.get("a")
    assert a is not None
    state.auth_refused(a, "/v1/models answered 401", 401)
    assert a.config_error == "/v1/models answered 401" and a.state is S.COLD
    state.clear_config_error(a)
    assert a.config_error is None


def test_fleet_builds_each_backend_whole():
    _, fleet, _, _ = make(slo={"ttft_s": 1.5}, breaker={"consecutive_failures": 7})
    a, b = fleet.get("a"), fleet.get("b")
    assert a is not None and b is not None
    assert a.api_key == "sk-a" and b.api_key is None
    assert a.breaker.cfg.consecutive_failures == 7 and a.breaker.cfg.ttft_slo_s == 1.5
    assert a.breaker is not b.breaker
    # first due times spread over each period from when the fleet was built
    assert (a.cycles.next_short, b.cycles.next_short) == (1150.0, 1300.0)
    # GPU trackers only where GPU telemetry is configured
    assert a.thermal is None and a.gpu_health is None
    assert b.thermal is not None and b.gpu_health is not None
