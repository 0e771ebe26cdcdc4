"""Lifecycle transitions and health rules (pure)."""

from __future__ import annotations

import pytest

from gateway.config import BackendConfig, HealthConfig
from gateway.core.vocab import BackendState
from gateway.fleet.backend import Backend
from gateway.fleet.lifecycle import (
    LEGAL,
    IllegalTransition,
    after_probe,
    apply_transition,
)

S = BackendState
CFG = HealthConfig(fail_threshold=3, recover_threshold=2)


def backend(state: BackendState = S.COLD) -> Backend:
    b = Backend(config=BackendConfig(id="a", url="http://h:1"))
    b.state = state
    return b


def test_every_illegal_transition_raises():
    for frm in S:
        for to in S:
            b = backend(frm)
            if to in LEGAL[frm]:
                t = apply_transition(b, to, "test", 1.0)
                assert b.state is to and b.history[-1] is t and t.reason == "test"
            else:
                with pytest.raises(IllegalTransition):
                    apply_transition(b, to, "test", 1.0)
                assert b.state is frm


def test_history_keeps_last_20():
    b = backend(S.WARM)
    for i in range(15):
        apply_transition(b, S.DRAINING, f"d{i}", i)
        apply_transition(b, S.WARM, f"u{i}", i)
    assert len(b.history) == 20 and b.history[-1].reason == "u14"


def test_cold_backend_starts_warming_on_first_ok_probe():
    b = backend(S.COLD)
    d = after_probe(b, True, CFG)
    assert d is not None and d.to is S.WARMING


def test_fail_threshold_then_recover_threshold():
    b = backend(S.WARM)
    assert after_probe(b, False, CFG) is None
    assert after_probe(b, False, CFG) is None
    d = after_probe(b, False, CFG)
    assert d is not None and (d.to, d.reason) == (S.UNHEALTHY, "probe_failed")
    b.state = S.UNHEALTHY
    assert after_probe(b, True, CFG) is None
    assert after_probe(b, False, CFG) is None  # a flap resets the count
    assert after_probe(b, True, CFG) is None
    d = after_probe(b, True, CFG)
    assert d is not None and d.to is S.WARMING


def test_cold_backend_stays_cold_when_failing():
    b = backend(S.COLD)
    for _ in range(5):
        assert after_probe(b, False, CFG) is None


@pytest.mark.parametrize("reason", ["breaker_open", "warmup_failed", "engine_stalled"])
def test_passive_unhealthy_needs_recover_threshold_probes_too(reason):
    """A backend made unhealthy by real traffic (its /health still passing all along) comes
    back only after ``recover_threshold`` passing probes counted from that moment, not at
    the next one (no flapping between unhealthy and warming every probe)."""
    b = backend(S.WARM)
    for _ in range(5):
        assert after_probe(b, True, CFG) is None
    apply_transition(b, S.UNHEALTHY, reason, 0.0)
    assert after_probe(b, True, CFG) is None
    d = after_probe(b, True, CFG)
    assert d is not None and d.to is S.WARMING
