"""The ``rollouts:`` config section (issue 18): canary rollouts of a model's new version,
validated here (pydantic, each problem naming its field) and run by
:mod:`gateway.flow.rollouts` over the pure state machine :mod:`gateway.traffic.rollout`.

The same model is the body of ``POST /admin/rollouts``. A version no backend of the model
carries is refused: in the config by :func:`check_versions` (against ``backends:``; with
dynamic discovery the backends are not known before they are found, so the admin API checks
the running fleet instead), and at ``POST /admin/rollouts`` against the running fleet.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterable, Sequence
from typing import Annotated, Any, Literal, Protocol

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_core import InitErrorDetails, PydanticCustomError

DEFAULT_STEPS: tuple[float, ...] = (0.01, 0.05, 0.25, 0.5, 1.0)
"""The canary's share of the model's traffic at each step: the issue's default (the same as
:data:`gateway.traffic.rollout.DEFAULT_STEPS`, which layer 0 may not import)."""


MODEL_VERSION_PATTERN = re.compile(r"[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?")
"""What a ``model_version`` may be (a backend's, a rollout's ``baseline`` / ``canary``):
Kubernetes' rule for a label value (kubernetes.io, "Labels and Selectors", syntax and
character set), empty excepted: at most :data:`MODEL_VERSION_MAX` characters, ASCII letters,
digits, ``-``, ``_`` and ``.``, beginning and ending with a letter or digit. A version is a
label of ``gateway_requests_total`` and part of URLs and log lines, and is often a pod
label already; ``2025-06``, ``v1.2``, ``Llama-3.1_8B-rc2`` are versions, ``***``, a space or
a path are not."""
MODEL_VERSION_MAX = 63
"""The longest ``model_version`` (characters): a Kubernetes label value's limit."""


def _model_version(v: str) -> str:
    if len(v) > MODEL_VERSION_MAX or MODEL_VERSION_PATTERN.fullmatch(v) is None:
        raise PydanticCustomError(
            "model_version", f"not a model version: at most {MODEL_VERSION_MAX} characters, "
            "ASCII letters, digits, '-', '_' and '.', beginning and ending with a letter or "
            "digit (a Kubernetes label value)")
    return v


ModelVersion = Annotated[str, AfterValidator(_model_version)]
"""A ``model_version`` (:data:`MODEL_VERSION_PATTERN`), validated wherever one is given."""


def field_error(loc: tuple[str | int, ...], message: str, value: Any) -> ValidationError:
    """A validation error of the field at ``loc`` (relative to the model being validated)
    for a model validator to raise: pydantic then reports it at that field (its ``loc``
    nested under the model's own), where a ``ValueError`` would name only the model
    (pydantic-core supports a ``ValidationError`` raised in a validator:
    pydantic/pydantic-core#510; ``ValidationError.from_exception_data``)."""
    return ValidationError.from_exception_data("RolloutConfig", [InitErrorDetails(
        type=PydanticCustomError("value_error", message), loc=loc, input=value)])


StrictShare = Annotated[float, Field(strict=True, allow_inf_nan=False)]
"""A step's canary share as given: a JSON or YAML number (``true`` or ``"0.5"`` is refused,
not converted: a user's trial saw ``"min_step_requests": true`` start a rollout with 1)."""


class RolloutTargeting(BaseModel):
    """Who may meet the canary during the first ``steps`` steps (0: everyone from the start):
    requests of the client keys named in ``client_keys`` (``auth.client_keys[].name``) and,
    with ``low_priority``, requests of the low priority class. Non-critical traffic first:
    a bad canary then costs only those requests until the targeted steps pass."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    client_keys: list[str] = Field(
        default_factory=list, description="client key names (auth.client_keys[].name)")
    low_priority: bool = Field(False, strict=True, description="the low priority class")
    steps: int = Field(
        0, ge=0, strict=True, description="how many of the first steps are targeted (0: "
        "none); the last step is always for everyone")


class RolloutCalibration(BaseModel):
    """The rollout's calibration probes: every ``interval_s`` seconds one routable backend
    of each version answers the fixed calibration prompts (``calibration.prompts``,
    greedy, ``calibration.seed``); the baseline's answers are the reference and each canary
    answer is scored by ``measure`` (:mod:`gateway.traffic.calibration_match`: ``exact``
    text, ``token_overlap`` F1 >= 0.8, ``cosine`` >= 0.99 for embedding models). More than
    2 % of the canary's probes failing fails the step whatever the latencies say (the
    issue's rule); a step is not compared before ``min_probes`` probes (default 10: with
    10, one drifted answer already fails). ``measure: off``: no probes, calibration passes
    (a version change that is meant to answer differently: new weights)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    measure: Literal["exact", "token_overlap", "cosine", "off"] = Field(
        "exact", description="how a canary answer is matched against the baseline's")
    interval_s: float = Field(
        30.0, gt=0, strict=True, allow_inf_nan=False, description="seconds between probe "
        "rounds (each round: every prompt once on one backend of each version)")
    min_probes: int = Field(10, ge=1, strict=True, description="canary probes needed before "
                            "a step is compared (Thresholds.min_calibration_probes)")


class RolloutGates(BaseModel):
    """What a step's comparison calls a regression (the defaults, and why each:
    :class:`gateway.traffic.rollout_stats.Thresholds`): the canary's TTFT / ITL P50 over
    the baseline's by more than ``p50_tolerance`` (ratio - 1) or its P99 by more than
    ``p99_tolerance``, or its error rate over the baseline's by ``error_rate_gate``
    (fraction of requests), each with a significant one-sided test at ``alpha`` (the
    chance of rolling a good canary back over the whole rollout: Bonferroni over the steps
    and the three tests). Wider tolerances for a release that is allowed to be slower
    (a larger model behind the same name); a smaller ``alpha`` for fewer false rollbacks at
    the cost of later detection (``benchmarks/rollout.py`` prints both)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    p50_tolerance: float = Field(
        0.10, ge=0, allow_inf_nan=False, strict=True,
        description="allowed P50 slowdown of TTFT and ITL (0.10: x1.1)")
    p99_tolerance: float = Field(
        0.20, ge=0, allow_inf_nan=False, strict=True,
        description="allowed P99 slowdown of TTFT and ITL (0.20: x1.2)")
    error_rate_gate: float = Field(
        0.005, ge=0, le=1, allow_inf_nan=False, strict=True,
        description="allowed error-rate excess (fraction of requests: 0.005 = 0.5 points)")
    alpha: float = Field(
        0.01, gt=0, le=0.5, allow_inf_nan=False, strict=True,
        description="false-rollback level of the whole rollout (split over steps and tests; "
        "at most 0.5)")


class RolloutConfig(BaseModel):
    """One canary rollout: the traffic of ``model`` (the name clients ask for) moves from
    the backends whose ``model_version`` is ``baseline`` to those whose ``model_version`` is
    ``canary`` in ``steps`` (canary shares, fractions of the model's traffic, strictly
    increasing, ending at 1.0; default 1 %, 5 %, 25 %, 50 %, 100 %). A step lasts at least
    ``min_step_s`` seconds (300: several calibration rounds, and time for a cold prefix
    cache to warm) and ``min_step_requests`` canary requests (100: the error-rate test's
    minimum sample), then canary and baseline are compared on the step's window (TTFT,
    ITL, error rate, calibration; docs/architecture.md, "Canary rollouts: the
    statistics"): pass, the next step; fail, rollback to the baseline. A step still without
    enough samples after ``max_step_s`` (3600 s) rolls back (``on_insufficient:
    rollback``, the default: a canary that cannot be verified does not keep its traffic)
    or holds (``hold``); a due step whose comparison is insufficient is compared again
    every ``recheck_s`` (10 s). ``min_samples`` (30) and ``min_requests`` (100): what each
    version's side of a step's window needs before its latencies and its error rate are
    compared (fewer: smaller steps at the cost of a weaker test; see
    :class:`gateway.traffic.rollout_stats.Thresholds`). A step that passed moves on only
    when the next step fits the versions' routable capacity within ``capacity_slack``
    (1.25), else it holds until a reload adds canary capacity
    (:mod:`gateway.traffic.rollout_capacity`). ``gates``: the regression thresholds
    (:class:`RolloutGates`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str = Field(min_length=1, description="the model name clients ask for")
    baseline: ModelVersion = Field(description="the model_version known to be good")
    canary: ModelVersion = Field(description="the model_version being rolled out")
    steps: list[StrictShare] = Field(default_factory=lambda: list(DEFAULT_STEPS),
                               description="canary shares per step, ending at 1.0")
    min_step_s: float = Field(300.0, ge=0, strict=True, allow_inf_nan=False,
                              description="seconds a step lasts at least")
    min_step_requests: int = Field(100, ge=1, strict=True,
                                   description="canary requests a step needs at least")
    max_step_s: float = Field(3600.0, gt=0, strict=True, allow_inf_nan=False,
                              description="seconds after which a step still insufficient "
                              "is decided by on_insufficient")
    on_insufficient: Literal["rollback", "hold"] = Field(
        "rollback", description="what a step still insufficient at max_step_s does")
    recheck_s: float = Field(10.0, gt=0, strict=True, allow_inf_nan=False,
                             description="seconds between comparisons of a step that is due "
                             "but still insufficient")
    min_samples: int = Field(
        30, ge=20, strict=True, description="TTFT / ITL samples each version needs in a "
        "step's window before they are compared (Thresholds.min_samples; at least 20, "
        "where the normal approximation of the Mann-Whitney U statistic that the test "
        "uses holds: scipy's mannwhitneyu documentation)")
    min_requests: int = Field(
        100, ge=20, strict=True, description="requests each version needs in a step's "
        "window before the error rates are compared (Thresholds.min_requests)")
    capacity_slack: float = Field(
        1.25, ge=1, allow_inf_nan=False, strict=True, description="how far above the "
        "model's mean load per unit of capacity a step may run the canary's servers: a "
        "step of share s moves on only when s <= capacity_slack x the canary's share of "
        "the two versions' routable capacity (the last step: capacity_slack x the canary's "
        "capacity >= the baseline's), else it holds (gateway.traffic.rollout_capacity)")
    targeting: RolloutTargeting = Field(default_factory=RolloutTargeting)
    calibration: RolloutCalibration = Field(default_factory=RolloutCalibration)
    gates: RolloutGates = Field(default_factory=RolloutGates)

    @field_validator("steps")
    @classmethod
    def _steps(cls, v: list[float]) -> list[float]:
        if not v or any(not (0.0 < x <= 1.0) for x in v) or v[-1] != 1.0 or any(
            b <= a for a, b in itertools.pairwise(v)
        ):
            raise ValueError("steps must be strictly increasing shares in (0, 1] ending at "
                             "1.0 (e.g. [0.01, 0.05, 0.25, 0.5, 1.0])")
        return v

    @model_validator(mode="after")
    def _consistent(self) -> RolloutConfig:
        if self.baseline == self.canary:
            raise field_error(("canary",), f"must differ from baseline (both "
                              f"{self.canary!r})", self.canary)
        if self.max_step_s < self.min_step_s:
            raise field_error(("max_step_s",), f"{self.max_step_s:g} must be >= min_step_s "
                              f"({self.min_step_s:g})", self.max_step_s)
        t = self.targeting
        if t.steps >= len(self.steps):
            raise field_error(("targeting", "steps"), f"{t.steps} must be below the number "
                              f"of steps ({len(self.steps)}): the last step is for everyone",
                              t.steps)
        if t.steps and not (t.client_keys or t.low_priority):
            raise field_error(("targeting", "steps"), "needs targeting.client_keys or "
                              "targeting.low_priority", t.steps)
        return self


class VersionedBackend(Protocol):
    """What :func:`check_versions` reads of a backend's config."""

    @property
    def models(self) -> list[str] | None: ...

    @property
    def model_version(self) -> str | None: ...


def version_problem(r: RolloutConfig, versions: Iterable[str | None]) -> str | None:
    """Why ``r`` cannot run over backends of its model carrying ``versions``
    (``model_version`` values, one per backend of the model, None for an unversioned one),
    naming the field (``model`` when no backend serves the model at all); None when both
    versions are there."""
    listed = list(versions)
    if not listed:
        return f"model: no backend serves model {r.model!r}"
    have = {v for v in listed if v is not None}
    for field, version in (("baseline", r.baseline), ("canary", r.canary)):
        if version not in have:
            return (f"{field}: no backend of model {r.model!r} has model_version "
                    f"{version!r} (versions there: {sorted(have) or 'none'})")
    return None


def key_problem(r: RolloutConfig, names: Iterable[str]) -> str | None:
    """Why ``r``'s targeting names a client key that is not configured (the field named; a
    typo would otherwise target nobody), or None."""
    known = set(names)
    unknown = [k for k in r.targeting.client_keys if k not in known]
    if unknown:
        return (f"targeting.client_keys: {unknown} not in auth.client_keys (names: "
                f"{sorted(known) or 'none'})")
    return None


def check_versions(rollouts: Sequence[RolloutConfig],
                   backends: Sequence[VersionedBackend]) -> None:
    """Validate ``rollouts:`` against ``backends:``: one rollout per model, and each
    version carried by some backend listing the model (a backend without ``models`` may
    serve any model: its version counts). Raises ``ValueError`` naming ``rollouts.<i>``."""
    seen: set[str] = set()
    for i, r in enumerate(rollouts):
        if r.model in seen:
            raise ValueError(f"rollouts.{i}.model: a second rollout for model {r.model!r}")
        seen.add(r.model)
        versions = [b.model_version for b in backends if b.models is None or r.model in b.models]
        problem = version_problem(r, versions)
        if problem is not None:
            raise ValueError(f"rollouts.{i}.{problem}")
