"""Canary rollouts' config and the pure parts of their wiring (issue 18): the ``rollouts:``
section's validation (each problem naming its field), the plan it maps to, the metric
reason of a decision, and the candidates of a request assigned a version (with the
fallback to the other version when none of its own is routable)."""

from __future__ import annotations

import random
import re
from typing import Any

import pytest

from gateway.config import BackendConfig, ConfigError, load_config
from gateway.config_rollouts import RolloutConfig
from gateway.core.vocab import BackendState, Prio
from gateway.fleet.backend import Backend
from gateway.flow.candidates import candidates
from gateway.flow.rollouts import plan_of, reason_label
from gateway.traffic.rollout import Rollout

BACKENDS = [
    {"id": "a", "url": "http://h:1", "models": ["m"], "model_version": "v1"},
    {"id": "b", "url": "http://h:2", "models": ["m"], "model_version": "v2"},
    {"id": "c", "url": "http://h:3", "models": ["other"], "model_version": "v3"},
]


def cfg(**rollout: Any) -> Any:
    return load_config(None, backends=BACKENDS,
                       rollouts=[{"model": "m", "baseline": "v1", "canary": "v2", **rollout}])


def test_a_valid_rollout_with_its_defaults() -> None:
    r = cfg().rollouts[0]
    assert r.steps == [0.01, 0.05, 0.25, 0.5, 1.0]
    assert (r.min_step_s, r.min_step_requests, r.max_step_s) == (300.0, 100, 3600.0)
    assert r.calibration.measure == "exact" and r.on_insufficient == "rollback"


@pytest.mark.parametrize(("rollout", "field"), [
    ({"canary": "v3"}, "rollouts.0.canary: no backend of model 'm' has model_version 'v3'"),
    ({"baseline": "v9"}, "rollouts.0.baseline: no backend of model 'm'"),
    ({"steps": [0.5, 0.2, 1.0]}, "rollouts.0.steps"),
    ({"steps": [0.5, 0.9]}, "rollouts.0.steps"),
    ({"min_step_requests": 0}, "rollouts.0.min_step_requests"),
    ({"min_samples": 5}, "rollouts.0.min_samples"),
    ({"canary": "v1"}, "rollouts.0.canary: must differ from baseline"),
    ({"max_step_s": 10, "min_step_s": 20}, "rollouts.0.max_step_s: 10 must be >= min_step_s"),
    ({"targeting": {"steps": 2}}, "rollouts.0.targeting.steps: needs targeting.client_keys"),
    ({"targeting": {"steps": 5, "low_priority": True}},
     "rollouts.0.targeting.steps: 5 must be below"),
    ({"canary": "***"}, "rollouts.0.canary: not a model version"),
    ({"baseline": " v1"}, "rollouts.0.baseline: not a model version"),
    ({"calibration": {"measure": "bleu"}}, "rollouts.0.calibration.measure"),
    ({"stepz": [1.0]}, "rollouts.0.stepz: unknown field"),
    ({"gates": {"p50_tolerance": -0.1}}, "rollouts.0.gates.p50_tolerance"),
    ({"gates": {"p99_tolerance": "nan"}}, "rollouts.0.gates.p99_tolerance"),
    ({"gates": {"error_rate_gate": 1.5}}, "rollouts.0.gates.error_rate_gate"),
    ({"gates": {"alpha": 0}}, "rollouts.0.gates.alpha"),
    ({"gates": {"alpha": 1}}, "rollouts.0.gates.alpha"),
    ({"gates": {"p50_tolerance": True}}, "rollouts.0.gates.p50_tolerance"),
    ({"gates": {"p99_tolerance": "0.5"}}, "rollouts.0.gates.p99_tolerance"),
    ({"gates": {"p50": 0.2}}, "rollouts.0.gates.p50: unknown field"),
    # numbers and flags as given, never converted (a trial's "min_step_requests": true
    # started a rollout with 1), and finite (1e400 parses as inf: its own field named)
    ({"min_step_requests": True}, "rollouts.0.min_step_requests"),
    ({"min_step_requests": "30"}, "rollouts.0.min_step_requests"),
    ({"steps": ["0.5", "1.0"]}, "rollouts.0.steps.0"),
    ({"steps": [0.5, True]}, "rollouts.0.steps.1"),
    ({"min_step_s": float("inf")}, "rollouts.0.min_step_s"),
    ({"min_samples": 30.5}, "rollouts.0.min_samples"),
    ({"min_requests": "100"}, "rollouts.0.min_requests"),
    ({"recheck_s": "10"}, "rollouts.0.recheck_s"),
    ({"capacity_slack": "2"}, "rollouts.0.capacity_slack"),
    ({"calibration": {"min_probes": "5"}}, "rollouts.0.calibration.min_probes"),
    ({"calibration": {"interval_s": float("nan")}}, "rollouts.0.calibration.interval_s"),
    ({"targeting": {"low_priority": "yes", "steps": 1}}, "rollouts.0.targeting.low_priority"),
    ({"targeting": {"client_keys": ["nobody"], "steps": 1}},
     "rollouts.0.targeting.client_keys: ['nobody'] not in auth.client_keys"),
])
def test_bad_rollouts_are_refused_naming_the_field(rollout: dict[str, Any], field: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(field)):
        cfg(**rollout)


@pytest.mark.parametrize("version", ["***", "", " ", "v1 ", "-v1", "v1.", "a/b", "é", "v" * 64])
def test_a_model_version_is_a_kubernetes_label_value(version: str) -> None:
    """``model_version`` is a metric label value, part of URLs and logs: at most 63
    characters, alphanumerics with ``-``, ``_``, ``.`` inside (Kubernetes' label values)."""
    bad = [{**BACKENDS[0], "model_version": version}]
    with pytest.raises(ConfigError, match=re.escape("backends.0.model_version: not a model "
                                                    "version")):
        load_config(None, backends=bad)


def test_model_versions_of_the_label_value_rules_are_taken() -> None:
    for version in ("v1", "2025-06", "Llama-3.1_8B.rc2", "a", "v" * 63):
        b = BackendConfig(id="a", url="http://h:1", model_version=version)
        assert b.model_version == version
        assert RolloutConfig(model="m", baseline=version, canary="x").baseline == version


def test_one_rollout_per_model() -> None:
    r = {"model": "m", "baseline": "v1", "canary": "v2"}
    with pytest.raises(ConfigError, match=r"rollouts\.1\.model: a second rollout for model 'm'"):
        load_config(None, backends=BACKENDS, rollouts=[r, r])


def test_the_plan_a_config_maps_to() -> None:
    r = RolloutConfig(model="m", baseline="v1", canary="v2", steps=[0.5, 1.0], min_samples=20,
                      min_requests=40, recheck_s=0.5,
                      targeting={"client_keys": ["batch"], "low_priority": True, "steps": 1},
                      calibration={"measure": "off"})
    p = plan_of(r, "id1")
    assert p.steps == (0.5, 1.0) and p.recheck_s == 0.5 and p.rollout_id == "id1"
    assert p.target_keys == frozenset({"batch"}) and p.target_priorities == {Prio.LOW}
    assert p.targeted_steps == 1
    assert (p.thresholds.min_samples, p.thresholds.min_requests) == (20, 40)
    assert p.thresholds.min_calibration_probes == 0  # off: calibration passes unprobed
    on = plan_of(RolloutConfig(model="m", baseline="v1", canary="v2",
                               calibration={"measure": "token_overlap", "min_probes": 6}), "x")
    assert on.calibration == "token_overlap" and on.thresholds.min_calibration_probes == 6
    assert (on.thresholds.p50_tolerance, on.thresholds.p99_tolerance,
            on.thresholds.error_rate_gate, on.thresholds.alpha) == (0.10, 0.20, 0.005, 0.01)
    gated = plan_of(RolloutConfig(model="m", baseline="v1", canary="v2", gates={
        "p50_tolerance": 1.5, "p99_tolerance": 2, "error_rate_gate": 0.02, "alpha": 0.001}), "y")
    assert (gated.thresholds.p50_tolerance, gated.thresholds.p99_tolerance,
            gated.thresholds.error_rate_gate, gated.thresholds.alpha) == (1.5, 2.0, 0.02, 0.001)


def _decided(canary_ttft: float, probes_failed: int = 0, **gates: float) -> Rollout:
    r = RolloutConfig(model="m", baseline="v1", canary="v2", steps=[0.5, 1.0], min_step_s=0,
                      min_step_requests=40, min_requests=40, min_samples=20, recheck_s=0.01,
                      calibration={"min_probes": 10}, gates=gates)
    rollout = Rollout(plan_of(r, "x"), 0.0, random.Random(1))
    rng = random.Random(2)
    for i in range(10):
        rollout.record_probe(i >= probes_failed)
    for i in range(400):  # a request every 0.05 s until the first decision
        side = rollout.assign(None, None, Prio.NORMAL, i * 0.05)
        base = rng.lognormvariate(-1.4, 0.2)
        rollout.observe(side, base * (canary_ttft if side == "canary" else 1.0), 0.03, False)
        if rollout.tick(i * 0.05) is not None or rollout.history:
            break
    return rollout


def test_reason_labels_of_decisions() -> None:
    slow = _decided(2.0)
    assert slow.status == "rolled_back" and reason_label(slow.history[-1]) == "ttft"
    drifted = _decided(1.0, probes_failed=3)
    assert reason_label(drifted.history[-1]) == "calibration"
    good = _decided(1.0)
    assert good.history[-1].outcome == "pass" and reason_label(good.history[-1]) == "ok"
    good.rollback(2.0, "operator: aborted")
    assert reason_label(good.history[-1]) == "operator"


def test_a_rollouts_gates_decide_what_is_a_regression() -> None:
    """The same x2 canary: rolled back under the default gates, passed under a release
    allowed to be up to x3 slower (``gates.p50_tolerance`` 2, ``p99_tolerance`` 2.5)."""
    assert _decided(2.0).status == "rolled_back"
    allowed = _decided(2.0, p50_tolerance=2.0, p99_tolerance=2.5)
    assert allowed.history[-1].outcome == "pass", allowed.history[-1]


def _backend(i: str, version: str | None, state: BackendState = BackendState.WARM) -> Backend:
    b = Backend(config=BackendConfig(id=i, url=f"http://h:{ord(i)}", models=["m"],
                                     model_version=version))
    b.models = ("m",)
    b.state = state
    return b


def test_candidates_of_a_version_and_the_fallback() -> None:
    fleet = [_backend("a", "v1"), _backend("b", "v2"), _backend("c", "v2")]
    assert [b.id for b in candidates(fleet, "m", (), 0.0)] == ["a", "b", "c"]  # no version
    assert [b.id for b in candidates(fleet, "m", (), 0.0, "v2")] == ["b", "c"]
    assert [b.id for b in candidates(fleet, "m", ("b",), 0.0, "v2")] == ["c"]  # a retry
    assert [b.id for b in candidates(fleet, "m", (), 0.0, "v1")] == ["a"]
    # no routable backend of v1: the other version serves rather than none
    fleet[0].state = BackendState.UNHEALTHY
    assert [b.id for b in candidates(fleet, "m", (), 0.0, "v1")] == ["b", "c"]
