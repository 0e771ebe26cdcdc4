"""A rollout's calibration probes (issue 18): the ``rollout_probes`` control loop.

Every ``rollouts[].calibration.interval_s`` seconds (30 s by default) per running rollout,
one routable backend of each version answers the fixed calibration prompts
(``calibration.prompts``, temperature 0, ``calibration.seed``, ``calibration.max_tokens``:
:func:`gateway.fleet.calibration.collect_answers` through
:meth:`gateway.fleet.calibrator.Calibrator.answers`), the baseline's first, on the same
engine endpoint; each canary answer is scored against the baseline's answer to the same
prompt (:meth:`gateway.traffic.rollout.Rollout.observe_calibration`, the rollout's
measure). The baseline *version*'s answers of this round are the reference, not a
backend's first answers: a canary of another version is compared with what the version
known to be good answers now. A prompt the canary did not answer counts as a failed probe;
a round where either side cannot answer at all (no routable backend of the version, a
transport error) is skipped and logged. A measure that does not fit the answers (``cosine``
on a model that answers text, a text measure on embedding vectors) rolls the rollout back
at its first round, with that reason (:meth:`gateway.flow.rollouts.Rollouts.misfit`):
calibration is a must, and it would never be measured. The probes go straight to the
backends, outside admission, like every calibration, but each round counts in its
backends' requests in flight while it runs (:meth:`RolloutProbes._answers`): a round is a
load the rollout's own comparison must see. One round is the prompts one after another on
ONE backend of each version, so it weighs on a small canary pool (one server) as much as on
the whole baseline pool. In ``benchmarks/rollout_e2e.py`` (a round due every 0.1 s; the 3
default prompts, each a 30 ms prefill and 3 decode steps of 4 ms, on each side, one after
the other: a round about 0.25 s; three baseline servers, one canary) that is the canary's
server answering probes about 40 % of the time and each baseline server about 13 %;
uncounted, the canary's requests met more load than their stratum said and looked slower
(a good canary rolled back at step 0 on TTFT P50 x1.07, p = 0.003).
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable, Sequence

import httpx

from gateway.fleet.backend import Backend
from gateway.fleet.calibration import Answers
from gateway.fleet.calibrator import Calibrator
from gateway.fleet.fleet import Fleet
from gateway.flow.candidates import candidates
from gateway.flow.rollouts import RolloutRun, Rollouts

log = logging.getLogger("gateway.rollouts")

PROBE_TICK_S = 0.1
"""Seconds between two checks of the ``rollout_probes`` loop for a rollout whose round is
due (a round itself is every ``calibration.interval_s``)."""


class RolloutProbes:
    """The calibration rounds of every running rollout (module docstring). ``clock``:
    monotonic seconds."""

    def __init__(self, rollouts: Rollouts, fleet: Fleet, calibrator: Calibrator,
                 clock: Callable[[], float]) -> None:
        self.rollouts = rollouts
        self.fleet = fleet
        self.calibrator = calibrator
        self.clock = clock
        self._rng = random.Random()

    async def round(self) -> None:
        """The loop's body: one calibration round for each running rollout that is due."""
        for run in list(self.rollouts.runs.values()):
            cal = run.cfg.calibration
            now = self.clock()
            if not run.running or cal.measure == "off" or now < run.next_probe_at:
                continue
            run.next_probe_at = now + cal.interval_s
            await self.probe(run)

    def pick(self, model: str, version: str) -> Backend | None:
        """A routable backend of ``model`` at ``version`` (random among them), or None."""
        cands = [b for b in candidates(self.fleet, model, (), self.clock(), version)
                 if b.config.model_version == version]
        return self._rng.choice(cands) if cands else None

    async def _answers(self, backend: Backend, model: str, only: str | None = None
                       ) -> Answers:
        """The calibration answers of ``backend``, counted in its requests in flight while
        the round runs (:meth:`gateway.fleet.backend.Backend.calibration_round`: one sequence; the
        prompts are asked one after another), so that a request sent there meanwhile sees
        the load it meets: the router weighs it, and the rollout compares that request's
        latencies in the right load stratum (:mod:`gateway.traffic.rollout_strata`). A
        round loads a version's pool unevenly: the canary's one server answers as many
        probes as the whole baseline pool, and uncounted they made a good canary look
        slower at "matched" load (module docstring). The round also counts as one request
        waiting for its first token (:attr:`gateway.fleet.backend.Backend.prefill_load`):
        its prompts are prefilled one after another."""
        backend.calibration_round(1)
        try:
            return await self.calibrator.answers(backend, model, only=only)
        finally:
            backend.calibration_round(-1)

    async def probe(self, run: RolloutRun) -> int:
        """One round for ``run``: returns the canary probes scored (0 when skipped)."""
        model = run.cfg.model
        base = self.pick(model, run.cfg.baseline)
        can = self.pick(model, run.cfg.canary)
        if base is None or can is None:
            log.info("rollout of %s: calibration round skipped: no routable backend of %s",
                     model, run.cfg.baseline if base is None else run.cfg.canary)
            return 0
        try:
            ref = await self._answers(base, model)
            if ref.unserved or not ref.answers:
                log.info("rollout of %s: calibration round skipped: %s answered none (%s)",
                         model, base.id, ref.detail)
                return 0
            got = await self._answers(can, model, only=ref.endpoint)
        except (httpx.HTTPError, ValueError) as e:
            log.warning("rollout of %s: calibration round skipped: %s",
                        model, str(e) or type(e).__name__)
            return 0
        scored = 0
        for prompt, want in ref.answers.items():
            answer = got.answers.get(prompt)
            if not _scorable(want):
                continue
            if answer is None or not _scorable(answer):
                run.rollout.record_probe(False)
            else:
                try:
                    matched = run.rollout.observe_calibration(want, answer)  # type: ignore[arg-type]
                except TypeError as e:  # the measure does not fit the model's answers
                    self.rollouts.misfit(model, f"calibration cannot be measured: {e} "
                                                f"(calibration.measure "
                                                f"{run.cfg.calibration.measure!r})")
                    return scored
                if not matched:
                    log.info("rollout of %s: calibration probe failed on %s: %r vs %r",
                             model, can.id, str(answer)[:80], str(want)[:80])
            scored += 1
        return scored


def _scorable(v: object) -> bool:
    """An answer :func:`gateway.traffic.calibration_match.probe_matches` takes: text, or a
    vector of numbers."""
    return isinstance(v, str) or (isinstance(v, Sequence) and all(
        isinstance(x, int | float) for x in v))
