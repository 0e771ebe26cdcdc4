"""The fine paradigm settles before it asks again (gateway.autoscale, injected clock): a P99
TTFT window measured before the last step took effect does not multiply the fleet again."""

from __future__ import annotations

from gateway.autoscale import ModelAutoscaler, ModelSignals
from gateway.config import AutoscaleConfig


def _scaler() -> ModelAutoscaler:
    cfg = AutoscaleConfig(scale_down_cooldown_s=0.0, ttft_window_s=30.0, fine_max_step=2.0)
    return ModelAutoscaler(cfg, ttft_target_s=2.0, min_replicas=1, max_replicas=64)


def test_fine_asks_once_then_waits_for_its_replicas_and_a_full_window() -> None:
    a = _scaler()
    slow = 4.0  # P99 TTFT twice the target
    first = a.decide(0.0, ModelSignals(ready=4, ttft_p99_s=slow))
    assert (first.fine, first.desired) == (8, 8)
    # the 4 asked for are warming; the same slow window asks for no more than exist
    held = a.decide(5.0, ModelSignals(ready=4, warming=4, ttft_p99_s=slow))
    assert held.fine == 8 and held.desired == 8
    # they are ready: the window still holds first tokens from before (not 16)
    stale = a.decide(70.0, ModelSignals(ready=8, ttft_p99_s=slow))
    assert stale.fine == 8 and stale.desired == 8
    assert a.decide(95.0, ModelSignals(ready=8, ttft_p99_s=slow)).desired == 8
    # a full window after the last became ready, a slow P99 is the new fleet's own
    again = a.decide(100.0, ModelSignals(ready=8, ttft_p99_s=slow))
    assert again.fine == 16 and again.desired == 16


def test_fine_without_warming_replicas_acts_at_once() -> None:
    a = _scaler()
    d = a.decide(0.0, ModelSignals(ready=3, ttft_p99_s=3.0))
    assert d.fine == 5 and d.reason == "fine"  # ceil(3 x 3.0 / 2.0)
