"""Calibration runs: does a backend still answer as it did? (the I/O and its verdicts;
scoring is :mod:`gateway.fleet.calibration`'s).

The first time a backend is warm its answers to the calibration prompts become its
baseline (unless a baseline file gives one for the model: :func:`load_baselines`); after
each cooldown :meth:`Calibrator.calibrate` compares its answers with it, on the same
engine endpoint. Drift (similarity below ``calibration.threshold``) makes it
``unhealthy`` (``calibration_drift``), marks it as needing calibration before it is warm
again, and runs the restart hook.

In fleet mode every replica compares a backend against the same baseline: a baseline taken
here is offered through :class:`gateway.fleet.sharing.SharedBaselines` and the fleet's (the
first one offered) is the one kept (:meth:`Calibrator.share`).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import httpx

from gateway.config import CalibrationConfig, ConfigError
from gateway.core.vocab import BackendState
from gateway.fleet.backend import Backend
from gateway.fleet.calibration import Answers, collect_answers, compare
from gateway.fleet.clients import ControlClients
from gateway.fleet.hooks import BackendHooks
from gateway.fleet.probes import ProbeEndpoints
from gateway.fleet.sharing import LOCAL, Baseline, SharedBaselines
from gateway.fleet.state import FleetState
from gateway.fleet.unserved import report_unserved
from gateway.metrics import GatewayMetrics

S = BackendState
log = logging.getLogger("gateway.fleet")


class Calibrator:
    """Calibration of the backends under ``cfg`` (the baseline file is read here:
    ``ConfigError`` when it is unreadable or not ``{model: {prompt: answer}}``)."""

    def __init__(
        self,
        cfg: CalibrationConfig,
        state: FleetState,
        clients: ControlClients,
        endpoints: ProbeEndpoints,
        hooks: BackendHooks,
        metrics: GatewayMetrics,
    ) -> None:
        self.cfg = cfg
        self.state = state
        self.clients = clients
        self.endpoints = endpoints
        self.hooks = hooks
        self.metrics = metrics
        self.baselines = load_baselines(cfg.baseline_file)
        self.shared: SharedBaselines = LOCAL

    def share(self, shared: SharedBaselines) -> None:
        """Keep the fleet's baselines (offered to and read from ``shared``: fleet mode)."""
        self.shared = shared

    async def _keep(self, backend: Backend, baseline: Baseline) -> None:
        """``backend``'s own answers become its baseline: the fleet's, when another replica
        offered one first."""
        answers, endpoint = await self.shared.offer_baseline(backend, baseline)
        backend.baseline_taken(answers, endpoint if answers is not None else None)

    def restore_baseline(self, backend: Backend, answers: dict[str, object],
                         endpoint: str | None) -> None:
        """Give ``backend`` a kept baseline back (a config snapshot's:
        :mod:`gateway.reload_state`): compared against it from the next calibration."""
        backend.baseline_taken(answers, endpoint)
        log.info("backend %s: calibration baseline restored from a config snapshot",
                 backend.id)

    def unserved(self, backend: Backend, model: str, check: str, detail: str) -> None:
        """:func:`gateway.fleet.unserved.report_unserved` with this calibrator's parts."""
        report_unserved(self.metrics, self.endpoints, backend, model, check, detail)

    async def take_baseline(self, backend: Backend, model: str) -> None:
        """Give ``backend`` its baseline for ``model`` when calibration is on and it has
        none: the baseline file's, else its own answers now (a failure is noted; an
        unserved endpoint reported; no baseline then)."""
        if not self.cfg.enabled or backend.calibration_baseline is not None:
            return
        baseline = self.baselines.get(model)
        endpoint = None
        if baseline is None:
            try:
                got = await self.answers(backend, model)
            except (httpx.HTTPError, ValueError) as e:
                backend.note_error(f"calibration baseline: {e}")
            else:
                if got.unserved:
                    self.unserved(backend, model, "calibration", got.detail)
                else:
                    await self._keep(backend, (got.answers, got.endpoint))
                    return
        backend.baseline_taken(baseline, endpoint if baseline is not None else None)

    async def answers(self, backend: Backend, model: str, only: str | None = None) -> Answers:
        """The calibration prompts' answers from ``backend`` for ``model``, on the engine
        endpoint it serves (``only``: that endpoint alone). Raises ``httpx.HTTPError`` and
        ``ValueError`` (see :func:`gateway.fleet.calibration.collect_answers`)."""
        c = self.cfg
        return await collect_answers(
            self.clients.work,
            backend,
            model,
            c.prompts,
            c.max_tokens,
            c.seed,
            backend.api_key,
            self.endpoints,
            only,
        )

    async def calibrate(self, backend: Backend) -> bool:
        """Compare the backend's answers with its baseline; False (and ``unhealthy``,
        reason ``calibration_drift``, plus the restart hook) below the threshold."""
        c = self.cfg
        if not c.enabled or not backend.models:
            return True
        model = backend.models[0]
        own = backend.calibration_baseline
        baseline = own or self.baselines.get(model)
        only = backend.calibration_endpoint if own else None  # compared on its endpoint
        try:
            got = await self.answers(backend, model, only)
            if got.unserved and only is not None:
                # the baseline's endpoint is no longer served: no comparison is possible; a
                # new baseline on the endpoint served now
                log.warning(
                    "backend %s: calibration baseline endpoint %s is no longer served (%s); "
                    "taking a new baseline",
                    backend.id,
                    only,
                    got.detail,
                )
                backend.baseline_taken(None, None)
                baseline = self.baselines.get(model)
                got = await self.answers(backend, model)
        except (httpx.HTTPError, ValueError) as e:
            backend.note_error(f"calibration: {e}")
            if backend.state is S.COOLDOWN:
                self.state.transition(backend, S.UNHEALTHY, "calibration_failed")
            return False
        if got.unserved:  # skipped: no drift verdict without answers
            self.unserved(backend, model, "calibration", got.detail)
            return True
        answers = got.answers
        if baseline is None:
            await self._keep(backend, (answers, got.endpoint))
            return True
        result = compare(baseline, answers)
        backend.calibrated(result.similarity)
        self.metrics.calibration_score.labels(backend.id).set(result.similarity)
        self.metrics.calibration_score_ratio.labels(backend.id).set(result.similarity)
        log.info(
            "backend %s: calibration exact-match %.2f similarity %.3f",
            backend.id,
            result.exact_match,
            result.similarity,
        )
        if result.similarity >= c.threshold:
            backend.set_needs_calibration(False)
            return True
        backend.note_error(
            f"calibration drift: similarity {result.similarity:.3f} < {c.threshold} "
            f"(exact match {result.exact_match:.2f})"
        )
        backend.set_needs_calibration(True)
        if backend.state in (S.COOLDOWN, S.WARM, S.WARMING, S.DRAINING):
            self.state.transition(backend, S.UNHEALTHY, "calibration_drift")
        await self.hooks.run_restart_hook(backend)
        return False


def load_baselines(path: str | None) -> dict[str, dict[str, object]]:
    """Calibration baselines from a JSON file ``{model: {prompt: answer}}`` (or none)."""
    if path is None:
        return {}
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"calibration.baseline_file {path}: {e}") from e
    if not isinstance(data, dict):
        raise ConfigError(
            f"calibration.baseline_file {path}: expected {{model: {{prompt: answer}}}}"
        )
    return data
