"""The status page's recorder reads the owners' own reports: the request and error
counters (failures: every error type but the client's own doing), the accounting's first
tokens, the ITL histogram (the contract's ``gateway_itl_seconds``), the breaker-trip and
config-rollback counters and the fleet state's transitions (injected clocks, real metrics
registry)."""

from __future__ import annotations

import asyncio

import pytest

from gateway.config import StatusConfig
from gateway.config_rollouts import RolloutConfig
from gateway.core.vocab import CLIENT_CAUSED, BackendState, ErrorType
from gateway.fleet.fleet import Fleet
from gateway.fleet.records import Transition
from gateway.flow.accounting import Accounting
from gateway.flow.rollouts import Rollouts
from gateway.flow.status import StatusRecorder
from gateway.metrics import GatewayMetrics
from gateway.signals import ITL_BUCKETS
from tests.support.servers import gateway_config


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def recorder() -> tuple[StatusRecorder, GatewayMetrics, Accounting, Fleet, Clock]:
    cfg = gateway_config([{"id": "a", "url": "http://127.0.0.1:9", "models": ["m1"]}])
    clock = Clock()
    fleet = Fleet.from_config(cfg, clock)
    metrics = GatewayMetrics()
    acc = Accounting(metrics, clock, lambda b, now: 1.0)
    rec = StatusRecorder(StatusConfig(), fleet, acc, metrics, clock, lambda: clock.t + 5e8)
    return rec, metrics, acc, fleet, clock


def test_requests_failures_and_first_tokens_of_served_models_only() -> None:
    rec, metrics, acc, _, clock = recorder()
    for _ in range(8):
        metrics.count_request("/v1/chat/completions", "m1", 200, "")
    # each with its error type, as the request path counts them (api.openai.answered):
    # the service's failures count, the client's own doing (its key's limit, its
    # hang-up) does not
    for status, error, failed in ((503, ErrorType.UPSTREAM_5XX, True),
                                  (429, ErrorType.NO_BACKEND, True),
                                  (429, ErrorType.RATE_LIMITED, False),
                                  (499, ErrorType.CLIENT_DISCONNECT, False)):
        assert (error in CLIENT_CAUSED) is not failed
        metrics.count_request("/v1/chat/completions", "m1", status, "")
        metrics.count_error("m1", error)
    metrics.count_request("/v1/chat/completions", "made-up", 404, "")
    for i in range(25):
        acc.stream_started(0.2 if i else 3.0, "m1")
    asyncio.run(rec.round())
    clock.t += 10
    metrics.count_request("/v1/chat/completions", "m1", 200, "")
    asyncio.run(rec.round())  # read again: only what is new counts
    s = rec.rollup.summary("m1", clock.t, 3600)
    assert (s.requests, s.failed) == (13, 2)
    late = rec.recent.summary("m1", clock.t, 5)  # the "now" window, to the tick
    assert (late.requests, late.failed) == (1, 0)
    assert s.ttft_samples == 25
    assert s.ttft_p99_s == pytest.approx(3.0, rel=0.05)
    assert rec.rollup.models() == ["m1"]  # not the model no backend serves


def test_itl_histogram_buckets_become_samples() -> None:
    rec, metrics, _, _, clock = recorder()
    itl = metrics.itl  # the gateway's own ITL histogram (its buckets: ITL_BUCKETS)
    bounds = sorted(ITL_BUCKETS)
    for _ in range(50):
        itl.labels("m1", "a").observe(0.03)
    itl.labels("m1", "b").observe(0.5)  # 1 of 51 gaps slow: the P99
    rec.tick()
    s = rec.rollup.summary("m1", clock.t, 60)
    assert s.itl_samples == 51
    at = min(b for b in bounds if b >= 0.5)  # counted at its bucket's bound
    assert s.itl_p99_s == pytest.approx(at, rel=0.05)
    for _ in range(40):
        itl.labels("m1", "a").observe(0.03)
    clock.t += 120
    rec.tick()
    fresh = rec.rollup.summary("m1", clock.t, 60)
    at = min(b for b in bounds if b >= 0.03)
    assert fresh.itl_samples == 40 and fresh.itl_p99_s == pytest.approx(at, rel=0.05)
    # the "now" window (status.now_s, 300 s) per tick: both ticks in it
    assert rec.recent.summary("m1", clock.t, 300).itl_samples == 91


def test_incidents_from_trips_rollbacks_and_transitions() -> None:
    rec, metrics, _, fleet, clock = recorder()
    b = fleet.backends[0]
    metrics.breaker_trips.labels("a", "error_rate").inc()
    metrics.config_reloads.labels("rollback", "applied").inc()
    metrics.config_reloads.labels("admin", "applied").inc()  # not a rollback
    rec.on_transition(b, Transition(123.0, BackendState.WARM, BackendState.DRAINING, "admin"))
    rec.on_transition(b, Transition(124.0, BackendState.DRAINING, BackendState.COOLDOWN, "x"))
    rec.on_transition(b, Transition(125.0, BackendState.WARM, BackendState.UNHEALTHY,
                                    "breaker_open"))
    rec.tick()
    rec.tick()  # nothing new: nothing recorded twice
    got = [(i.kind, i.subject, i.detail) for i in rec.incidents.recent()]
    assert got == [
        ("config_rollback", "config", "config returned to a kept version"),
        ("breaker_trip", "a", "error_rate"),
        ("unhealthy", "a", "breaker_open"),
        ("drain", "a", "admin"),
    ]
    assert rec.incidents.recent()[-1].at == 123.0
    assert rec.incidents.recent()[0].at == clock.t + 5e8  # the tick's wall time


def test_a_canary_rollback_is_an_incident_at_its_own_time() -> None:
    rec, metrics, _, fleet, clock = recorder()
    rollouts = Rollouts(metrics, fleet, clock, lambda: clock.t + 5e8)
    rec.rollouts = rollouts
    rollouts.start(RolloutConfig(model="m1", baseline="v1", canary="v2"), "admin")
    rec.tick()
    clock.t += 30
    rollouts.abort("m1", "operator: canary looks wrong")
    decided = clock.t
    clock.t += 7  # read a tick later
    rec.tick()
    rec.tick()
    got = rec.incidents.recent()
    assert [(i.kind, i.subject) for i in got] == [("rollout_rollback", "m1")]
    assert "canary looks wrong" in got[0].detail
    assert got[0].at == pytest.approx(decided + 5e8)
