"""``ModelAutoscaler.hold`` (fleet mode: another replica's answer counted in this one's
stabilization window), with an injected clock."""

from __future__ import annotations

from gateway.autoscale import ModelAutoscaler, ModelSignals
from gateway.config import AutoscaleConfig

IDLE = ModelSignals(ready=1, slots=16)


def scaler() -> ModelAutoscaler:
    return ModelAutoscaler(AutoscaleConfig(scale_down_cooldown_s=60, min_replicas=1), 2.0,
                           1, 64)


def test_a_held_answer_stands_for_the_cooldown_then_goes() -> None:
    a = scaler()
    a.hold(100.0, 5)  # the leader answered 5 at t=100; this replica has seen nothing else
    d = a.decide(101.0, IDLE)
    assert (d.desired, d.reason) == (5, "scale-down cooldown")
    assert a.decide(159.0, IDLE).desired == 5
    assert a.decide(161.0, IDLE).desired == 1  # 60 s after the held answer: it falls


def test_held_answers_keep_the_window_in_time_order() -> None:
    a = scaler()
    a.decide(100.0, IDLE)
    a.hold(90.0, 4)  # an answer older than this replica's last decision
    a.hold(95.0, 3)
    assert a.decide(149.0, IDLE).desired == 4
    assert a.decide(152.0, IDLE).desired == 3  # the 4 of t=90 left first, then the 3
    assert a.decide(156.0, IDLE).desired == 1
