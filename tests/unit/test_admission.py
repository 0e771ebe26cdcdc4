"""Admission decisions (pure, times as arguments): request cost estimates, saturation
shedding and its Retry-After, degraded mode (``gateway.traffic.admission``); the gate's
limiter table (``gateway.flow.admission``)."""

from __future__ import annotations

import math

import pytest

from gateway.core.vocab import Prio
from gateway.traffic.admission import (
    DegradedMode,
    Saturation,
    as_count,
    completion_budget,
    estimate_tokens,
    pool_wait,
    shed,
    shed_retry_after,
    wait_level,
)


def test_estimate_tokens():
    """The prompt's estimate (gateway.traffic.estimate) plus the completion budget."""
    assert estimate_tokens(100, 50, 256) == 150
    assert estimate_tokens(100, None, 256) == 356


def test_completion_budget_reads_fields_as_vllm_does():
    """vLLM's pydantic reads ``"3000"`` and ``3000.0`` as 3000, and its chat endpoint
    prefers ``max_completion_tokens``: the budget is the larger field, times ``n``, never
    negative (a negative estimate would credit the token bucket)."""
    assert completion_budget({}) is None
    assert completion_budget({"max_tokens": "3000"}) == 3000
    assert completion_budget({"max_tokens": 3000.0}) == 3000
    assert completion_budget({"max_tokens": 1, "max_completion_tokens": 3000}) == 3000
    assert completion_budget({"max_tokens": -5000, "max_completion_tokens": 3000}) == 3000
    assert completion_budget({"max_tokens": -5000}) == 0
    assert completion_budget({"max_output_tokens": 700}) == 700  # the Responses API
    assert completion_budget({"max_tokens": 100, "n": 4}) == 100  # per sequence
    assert completion_budget({"max_tokens": True}) is None
    assert completion_budget({"max_tokens": "many"}) is None
    assert as_count(2.5) is None and as_count(float("nan")) is None and as_count([1]) is None
    assert estimate_tokens(100, 0, 256) == 100 and estimate_tokens(100, -50, 256) == 100
    assert estimate_tokens(100, 500, 256, sequences=8) == 100 + 4000  # 8 prompts
    assert estimate_tokens(100, None, 256, sequences=8) == 100 + 8 * 256  # n 8, no budget
    assert estimate_tokens(100, None, 256, sequences=0) == 100  # embeddings generate nothing


def test_pool_wait_is_the_least_loaded_backends_wait_over_the_slo():
    assert pool_wait([6.0, 1.5, math.inf]) == 1.5  # the router picks the least loaded
    assert pool_wait([]) == 0.0
    assert wait_level(3.0, slo_ttft_s=2.0).level == pytest.approx(1.5)
    assert wait_level(0.0, 2.0).level == 0.0


def test_shed_retry_after_is_the_excess_wait_over_the_class_bound():
    # 10 s predicted, high shed from 4 x 2 s = 8 s: come back in 2 s
    assert shed_retry_after(10.0, 4.0, 2.0) == pytest.approx(2.0)
    assert shed_retry_after(8.2, 4.0, 2.0) == 1.0  # at least 1 s
    assert shed_retry_after(500.0, 1.0, 2.0) == 60.0  # at most 60 s


def test_shed_low_first_high_last():
    levels = (2.0, 1.5, 1.0)
    assert [shed(p, Saturation(1.2), levels) for p in Prio] == [False, False, True]
    assert [shed(p, Saturation(1.6), levels) for p in Prio] == [False, True, True]
    assert [shed(p, Saturation(2.0), levels) for p in Prio] == [True, True, True]


def test_degraded_mode_enters_after_sustained_overload_and_lifts_step_by_step():
    d = DegradedMode(enter_after_s=10, step_s=30)
    t = 0.0
    while t < 9:
        assert d.update(True, t) == 0
        t += 1
    assert d.update(True, 10.0) == 1
    assert d.max_tokens_cap(512) == 512
    assert d.update(True, 20.0) == 2 and d.max_tokens_cap(512) == 256
    assert d.update(False, 21.0) == 2  # back under SLO: lifts one level per step_s
    assert d.update(False, 50.0) == 2
    assert d.update(False, 51.0) == 1
    assert d.update(True, 52.0) == 1  # overload again: the calm clock restarts
    assert d.update(False, 53.0) == 1
    assert d.update(False, 83.0) == 0
    assert d.max_tokens_cap(512) is None


def test_degraded_mode_level_is_capped():
    d = DegradedMode(enter_after_s=1, step_s=1, max_level=3)
    for t in range(100):
        d.update(True, float(t))
    assert d.level == 3 and d.max_tokens_cap(512) == 128


def test_gate_forgets_clients_whose_limits_are_full_again():
    """Per-client limiters (``default_rpm``, keyed by client IP without keys) are dropped
    once their buckets are full again, so a stream of one-off clients cannot grow the
    table without bound; a client still being limited keeps its limiter."""
    from gateway.config import load_config
    from gateway.fleet.fleet import Fleet
    from gateway.flow.admission import AdmissionGate
    from gateway.flow.key_limits import LIMITER_SWEEP_MIN
    from gateway.metrics import GatewayMetrics

    now = [0.0]
    cfg = load_config(None, admission={"default_rpm": 60})
    gate = AdmissionGate(cfg, Fleet(cfg.backends), GatewayMetrics(), clock=lambda: now[0])
    busy = gate.keys.limiter("busy", None)
    assert busy is not None
    for _ in range(60):
        busy.check(1, now[0])  # used up: a minute to refill
    for i in range(10 * LIMITER_SWEEP_MIN):
        now[0] += 0.001
        lim = gate.keys.limiter(f"10.0.{i // 256}.{i % 256}", None)
        assert lim is not None
        lim.check(1, now[0])  # one request each: full again a second later
    assert len(gate.keys.limiters) <= 2 * LIMITER_SWEEP_MIN + 1
    assert gate.keys.limiters.get("busy") is busy


def test_gate_settles_a_charge_once_with_the_reported_usage():
    """The key's charge is admission's estimate until the answer reports its usage, then
    that usage (once: a second report changes nothing); no report leaves the estimate. A
    limiter dropped as full while its request ran is taken back to be settled."""
    import asyncio

    from gateway.config import load_config
    from gateway.fleet.fleet import Fleet
    from gateway.flow.admission import AdmissionGate
    from gateway.flow.lease import RequestLease
    from gateway.metrics import GatewayMetrics

    now = [0.0]
    cfg = load_config(None, admission={"default_tpm": 1000})
    gate = AdmissionGate(cfg, Fleet(cfg.backends), GatewayMetrics(), clock=lambda: now[0])

    def admit(tokens: int):
        charge = asyncio.run(
            gate.admit("m", "10.0.0.1", None, Prio.NORMAL, tokens, tokens, "r", RequestLease())
        )
        assert charge is not None
        return charge

    charge = admit(800)
    assert charge.verdict.remaining_tokens == 200
    assert charge.settle(None) is None  # not reported: the estimate stands
    settled = charge.settle((3, 1))
    assert settled is not None and settled.remaining_tokens == 996
    assert charge.settle((3, 1)) is None and charge.settle((500, 500)) is None  # once
    late = admit(500)
    assert gate.keys.limiters.pop("10.0.0.1") is late.limiter  # (as a sweep drops it)
    after = late.settle((10, 0))
    assert after is not None and after.remaining_tokens == 986
    assert gate.keys.limiters["10.0.0.1"] is late.limiter
