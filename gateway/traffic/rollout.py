"""One model's canary rollout: baseline version -> canary version in steps (pure: no I/O;
the clock and the random source are injected).

Issue 18, "Model versions and rollouts". A :class:`Rollout` moves a share of one model's
traffic to the canary through ``plan.steps`` (default 1 %, 5 %, 25 %, 50 %, 100 %). A step
lasts at least ``min_step_s`` seconds and ``min_step_requests`` canary requests; then
:mod:`gateway.traffic.rollout_stats` compares the canary with the baseline on that step's
window (TTFT, ITL, error rate; calibration over every canary probe of the rollout, since
the canary's answers to fixed prompts do not depend on its share):

* ``pass``: the next step, with a fresh window (the last step passed: ``promoted``);
* ``fail``: ``rolled_back``, with the failing metric's reason;
* ``insufficient`` (some metric still lacks its sample) or ``inconclusive`` (some metric's
  observed effect is over its gate but not significant: a step passes only on evidence,
  :mod:`gateway.traffic.rollout_stats`): checked again every ``recheck_s`` on the growing
  window until ``max_step_s``; then, by default (``on_insufficient="rollback"``, for
  both), ``rolled_back`` with reason ``insufficient ...`` / ``inconclusive ...`` (the
  record's ``cause`` ``inconclusive``): a canary that cannot be verified does not keep its
  traffic indefinitely, the baseline is the version known to be good, and the reason says
  that no regression was proven. ``"hold"`` keeps the step (and its growing window) until
  the comparison decides, for models whose traffic is too thin for any bound on time.

**A step is decided once.** Its comparison counts at the first look, once the step is due,
in which every metric has its sample (none ``insufficient``): pass or fail, and that is the
step's verdict (an ``inconclusive`` look decides nothing: the step looks again, on more
samples, while an effect over a gate is unproven: each time on twice the canary's sample, at
a share of the step's alpha that halves, :meth:`Thresholds.at_look`). A metric that fails
while another still waits for samples (ITL, which only streams give, or a load stratum not
yet matched) is shown in ``/admin/rollouts`` but not acted on: re-testing a growing sample
every ``recheck_s`` and acting on the first significant look is optional stopping
("peeking"), whose false-positive rate exceeds the nominal alpha with every look (Armitage,
McPherson & Rowe 1969; Johari et al. 2017, "Peeking at A/B tests"). Past ``max_step_s`` a
failing metric is acted on whatever the others lack (the step is over). With
``on_insufficient="hold"`` the looks go on past ``max_step_s`` on a growing window.

Calibration is also checked on its own at every :meth:`tick`, due or not: past the minimum
of probes, more than 2 % failing rolls back at once (wrong answers are not a regression to
weigh against a sample size; a drifted canary would keep its share to ``min_step_requests``).

**Capacity** (:mod:`gateway.traffic.rollout_capacity`): a step that passed moves on only
when the next step fits the versions' capacity (``capacity``, set by the caller from the
routable backends; None: unknown, never held): else the rollout holds at the step it
passed (``held``: the reason; one ``hold`` record with ``cause="capacity"``), keeps its
share, its calibration check and nothing else (the step was decided), and moves on at the
first :meth:`Rollout.tick` at which the next step fits.

At the last step (share 1.0) the baseline serves nothing: its side is the previous step's
window, latencies shown, not gated (:func:`gateway.traffic.rollout_stats.shown_not_gated`).

**Assignment** (:meth:`Rollout.assign`): a request with a session key is hashed (BLAKE2b,
salted with the model and the rollout id) to a point in [0, 1) and goes to the canary when
the point is below the share, so a session on the canary stays there as the share grows
(and a session on the baseline moves at most once). Without a session key it is random
(the injected ``random.Random``), capped so that in a step the canary never takes more than
``share x requests + min_step_requests`` of the step's requests: what a bad canary serves
before its first comparison is bounded by the first step's share plus the step's minimum
sample (the issue's must-hold; a heavy sticky session is not cut off, stickiness wins).
During the first ``targeted_steps`` steps only targeted requests (a client key in
``target_keys`` or a priority in ``target_priorities``, e.g. the low class) may go to the
canary; later steps apply to everyone.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence
from typing import Any

from gateway.core.vocab import Prio
from gateway.traffic import rollout_view
from gateway.traffic.calibration_match import probe_matches
from gateway.traffic.rollout_capacity import PoolCapacity, step_hold
from gateway.traffic.rollout_plan import (
    DEFAULT_STEPS,
    RolloutPlan,
    Status,
    StepOutcome,
    StepRecord,
    Version,
    unit_hash,
)
from gateway.traffic.rollout_state import parse_state
from gateway.traffic.rollout_stats import (
    Comparison,
    MetricResult,
    combine,
    compare_calibration,
    compare_errors,
    shown_not_gated,
)
from gateway.traffic.rollout_strata import (
    compare_latency_matched,
    load_stratum,
    ttft_stratum,
)
from gateway.traffic.rollout_window import Side

__all__ = ["DEFAULT_STEPS", "Rollout", "RolloutPlan", "Status", "StepOutcome", "StepRecord",
           "Version", "unit_hash"]

class Rollout:
    """The state machine of one model's rollout (module docstring). Call :meth:`assign`
    for each request of the model, :meth:`observe` when it ends, :meth:`observe_calibration`
    for each calibration probe answered by the canary; :meth:`tick` (also run by
    :meth:`assign`) decides the step when it is due."""

    def __init__(self, plan: RolloutPlan, now: float, rng: random.Random) -> None:
        self.plan = plan
        self.started_at = now
        self.status: Status = "running"
        self.step = 0
        self.step_started_at = now
        self.history: list[StepRecord] = []
        self.last_comparison: Comparison | None = None
        self.served: dict[Version, int] = {"baseline": 0, "canary": 0}
        self.share_before_rollback: float | None = None
        self.probes = 0
        self.probe_failures = 0
        self.looks = 0  # comparisons made by tick, every step (diagnostics)
        self._rng = rng
        self._salt = f"{plan.model}\x00{plan.rollout_id}"
        self._holding = False
        self._last_check: float | None = None
        self.decisive_looks = 0  # this step's looks whose verdict counted (alpha spent)
        self._decisive_at_n = 0  # canary requests at the last of them
        self._reference: Side | None = None
        self.prior: list[dict[str, object]] = []  # decisions before a resume (JSON)
        # the versions' routable capacity, set by the caller (None: unknown, never held)
        self.capacity: PoolCapacity | None = None
        self.held: str | None = None  # why a passed step waits for the next one's capacity
        self._held_cmp: Comparison | None = None
        self._new_window()

    def _new_window(self) -> None:
        size = self.plan.max_window_samples
        self._window: dict[Version, Side] = {"baseline": Side(size, self._rng),
                                             "canary": Side(size, self._rng)}
        self._step_assigned: dict[Version, int] = {"baseline": 0, "canary": 0}

    @property
    def share(self) -> float:
        """The canary's share now: the step's while running, 1.0 once promoted, 0.0 once
        rolled back."""
        if self.status == "promoted":
            return 1.0
        if self.status == "rolled_back":
            return 0.0
        return self.plan.steps[self.step]

    def targeted(self, client_key: str | None, priority: Prio) -> bool:
        """Whether a request may go to the canary at the current step (always, past the
        targeted steps)."""
        if self.step >= self.plan.targeted_steps:
            return True
        return client_key in self.plan.target_keys or priority in self.plan.target_priorities

    def assign(
        self, session_key: str | None, client_key: str | None, priority: Prio, now: float
    ) -> Version:
        """Which version serves this request (module docstring, "Assignment"); runs
        :meth:`tick` first, so a due step is decided before the request is placed."""
        self.tick(now)
        version = self._choose(session_key, client_key, priority)
        self.served[version] += 1
        self._step_assigned[version] += 1
        return version

    def _choose(self, session_key: str | None, client_key: str | None,
                priority: Prio) -> Version:
        if self.status != "running":
            return "canary" if self.status == "promoted" else "baseline"
        if not self.targeted(client_key, priority):
            return "baseline"
        share = self.plan.steps[self.step]
        if session_key is not None:
            return "canary" if unit_hash(self._salt, session_key) < share else "baseline"
        total = self._step_assigned["baseline"] + self._step_assigned["canary"]
        cap = share * total + self.plan.min_step_requests
        if self._step_assigned["canary"] >= cap:
            return "baseline"
        return "canary" if self._rng.random() < share else "baseline"

    def observe(self, version: Version, ttft_s: float | None, itl_s: float | None,
                error: bool, load: int = 0, itl_load: int | None = None,
                prefill_load: int = 0, streamed: bool = True) -> None:
        """One finished request of ``version``: its TTFT (``streamed`` False: the whole
        answer's time) and mean ITL in seconds (None when it has none), whether it failed,
        and its backend's requests in flight when it was sent (``load``; 0: unknown) and
        requests before their first token that its own met (``prefill_load``, this one
        included; 0: unknown), whose stratum its TTFT is compared in
        (:func:`gateway.traffic.rollout_strata.ttft_stratum`); its ITL's stratum is
        ``itl_load`` (the load its decode met: the larger of ``load`` and the requests in
        flight when the stream ended; None: ``load``), since a prefill admitted while it
        decoded stalls every step of it (vLLM without chunked prefill), and a one-server
        canary pool meets all its arrivals. Ignored once the rollout has ended."""
        if self.status != "running":
            return
        side = self._window[version]
        side.requests += 1
        side.errors += int(error)
        if ttft_s is not None and math.isfinite(ttft_s):
            side.ttft.add(ttft_s, ttft_stratum(load, prefill_load, streamed))
        if itl_s is not None and math.isfinite(itl_s):
            side.itl.add(itl_s, load_stratum(load if itl_load is None else itl_load))

    def observe_calibration(self, reference: str | Sequence[float],
                            answer: str | Sequence[float]) -> bool:
        """One calibration probe answered by the canary, against the baseline version's
        answer to the same prompt (text, or an embedding vector for ``cosine``): scored by
        the plan's measure, counted; returns whether it matched."""
        matched = probe_matches(self.plan.calibration, reference, answer,
                                self.plan.thresholds)
        self.record_probe(matched)
        return matched

    def record_probe(self, matched: bool) -> None:
        """Count one canary calibration probe already scored (ignored once ended)."""
        if self.status != "running":
            return
        self.probes += 1
        self.probe_failures += int(not matched)

    def compare(self) -> Comparison:
        """The current window's comparison (the reference baseline window when this one's
        baseline served fewer than ``min_requests``: the last step), each test at
        ``alpha / steps`` of the plan's thresholds (:meth:`Thresholds.per_step`), spent
        over the step's decisive looks (:meth:`Thresholds.at_look`)."""
        th = self.plan.thresholds.per_step(len(self.plan.steps)).at_look(self.decisive_looks)
        base, can = self._baseline(), self._window["canary"]
        ttft = compare_latency_matched("ttft", base.ttft.pairs, can.ttft.pairs, th)
        itl = compare_latency_matched("itl", base.itl.pairs, can.itl.pairs, th, base.requests)
        if base is self._reference:  # the last step: shown, not gated (module docstring)
            ttft, itl = shown_not_gated(ttft), shown_not_gated(itl)
        return combine([compare_calibration(self.probes, self.probe_failures, th), ttft, itl,
                        compare_errors(base.errors, base.requests, can.errors, can.requests, th)])

    def _baseline(self) -> Side:
        """The baseline side of the comparison: the window's, or the reference (the last
        passed step's) while the window's served fewer than ``min_requests``."""
        base = self._window["baseline"]
        if base.requests < self.plan.thresholds.min_requests and self._reference is not None:
            return self._reference
        return base

    def _settled(self, cmp: Comparison) -> Comparison | None:
        """``cmp`` as a pass (None: it is not one). At the last step against the fixed
        reference baseline (which serves nothing, so cannot grow) ``inconclusive`` passes:
        waiting cannot resolve a gate read off a fixed sample (a P99 low by chance stays
        low), and the canary passed the step before against a live baseline."""
        if cmp.decision == "pass":
            return cmp
        if (cmp.decision == "inconclusive" and self.step == len(self.plan.steps) - 1
                and self._baseline() is self._reference):
            return Comparison("pass", "inconclusive against the previous step's fixed "
                              f"baseline, passed (it cannot grow): {cmp.reason}", cmp.metrics)
        return None

    def tick(self, now: float) -> StepRecord | None:
        """Decide the current step if it is due (module docstring); returns the record of
        a decision made now, else None."""
        if self.status != "running":
            return None
        p = self.plan
        cal = compare_calibration(self.probes, self.probe_failures, p.thresholds)
        if cal.decision == "fail":  # wrong answers: not one request more than the rule needs
            cmp = combine([cal])
            self.last_comparison = cmp
            return self._roll_back(now, cmp.reason, cmp)
        if self._held_cmp is not None:  # the step passed: waiting for the next one's room
            if self._next_hold() is not None:
                return None
            return self._advance(now, self._held_cmp)
        elapsed = now - self.step_started_at
        due = (elapsed >= p.min_step_s
               and self._window["canary"].requests >= p.min_step_requests)
        timed_out = elapsed >= p.max_step_s
        if not (due or timed_out):
            return None
        if self._last_check is not None and now - self._last_check < p.recheck_s:
            return None
        canary_n = self._window["canary"].requests
        final = timed_out and not self._holding  # the first look past max_step_s
        if self.decisive_looks and canary_n < 2 * self._decisive_at_n and not final:
            return None  # a later decisive look waits for twice the sample (at_look)
        self._last_check = now
        self.looks += 1
        cmp = self.compare()
        self.last_comparison = cmp
        complete = all(m.decision != "insufficient" for m in cmp.metrics)
        if complete or timed_out:  # this look's verdict counts: its share of alpha is spent
            self.decisive_looks, self._decisive_at_n = self.decisive_looks + 1, canary_n
        if cmp.decision == "fail" and (complete or timed_out):  # decided once (docstring)
            return self._roll_back(now, cmp.reason, cmp)
        passed = self._settled(cmp)
        if passed is not None and due:
            held = self._next_hold()
            if held is None:
                return self._advance(now, passed)
            self.held, self._held_cmp = held, passed
            return self._record(now, "hold", held, passed, cause="capacity")
        if not timed_out:
            return None
        why = "inconclusive" if cmp.decision == "inconclusive" else "insufficient"
        short = cmp.reason if cmp.decision in ("insufficient", "inconclusive") else (
            f"{self._window['canary'].requests} canary requests, "
            f"{p.min_step_requests} needed")
        cause = "inconclusive" if why == "inconclusive" else ""  # the metric's reason label
        if p.on_insufficient == "rollback":
            return self._roll_back(now, f"{why} after {p.max_step_s:g} s: {short}", cmp,
                                   cause)
        if self._holding:
            return None
        self._holding = True
        return self._record(now, "hold", f"holding past {p.max_step_s:g} s: {short}", cmp,
                            cause)

    def rollback(self, now: float, reason: str, metric: str | None = None
                 ) -> StepRecord | None:
        """An operator's rollback, or (``metric``) one for a metric that cannot be
        measured, recorded as that metric's failure (None when the rollout has already
        ended)."""
        if self.status != "running":
            return None
        cmp = combine([MetricResult(metric, "fail", reason)]) if metric else None
        return self._roll_back(now, reason, cmp)

    def _next_hold(self) -> str | None:
        """Why the next step does not fit the capacity (None: it does, or this is the
        last step, or the capacity is unknown)."""
        if self.capacity is None or self.step == len(self.plan.steps) - 1:
            return None
        return step_hold(self.plan.steps[self.step + 1], self.capacity, self.plan.canary,
                         self.plan.capacity_slack)

    def _record(self, now: float, outcome: StepOutcome, reason: str,
                cmp: Comparison | None, cause: str = "") -> StepRecord:
        rec = StepRecord(now, self.step, self.plan.steps[self.step], outcome, reason, cmp,
                         cause)
        self.history.append(rec)
        return rec

    def _roll_back(self, now: float, reason: str, cmp: Comparison | None,
                   cause: str = "") -> StepRecord:
        rec = self._record(now, "rolled_back", reason, cmp, cause)
        self.share_before_rollback = self.canary_share_served
        self.status = "rolled_back"
        return rec

    def _advance(self, now: float, cmp: Comparison) -> StepRecord:
        if self.step == len(self.plan.steps) - 1:
            rec = self._record(now, "promoted", cmp.reason, cmp)
            self.status = "promoted"
            return rec
        rec = self._record(now, "pass", cmp.reason, cmp)
        if self._window["baseline"].requests >= self.plan.thresholds.min_requests:
            self._reference = self._window["baseline"]
        self.step += 1
        self._fresh_step(now)
        return rec

    def _fresh_step(self, started_at: float) -> None:
        """The current step (re)starts at ``started_at``: no hold, no look yet, a new
        window."""
        self.step_started_at = started_at
        self._holding = False
        self._last_check = None
        self.decisive_looks = self._decisive_at_n = 0
        self.held = self._held_cmp = None
        self._new_window()

    @property
    def canary_share_served(self) -> float:
        """The canary's share of the requests assigned since the start (0.0 before any)."""
        total = self.served["baseline"] + self.served["canary"]
        return self.served["canary"] / total if total else 0.0

    def snapshot(self, now: float) -> dict[str, object]:
        """``/admin/rollouts``' view of this rollout (JSON-ready;
        :func:`gateway.traffic.rollout_view.snapshot`)."""
        return rollout_view.snapshot(self, now)

    def state(self, now: float) -> dict[str, Any]:
        """What a resume needs (JSON-ready; :func:`gateway.traffic.rollout_view.state`)."""
        return rollout_view.state(self, now)

    def resume(self, state: Mapping[str, Any], now: float) -> None:
        """Take up a rollout from :meth:`state` (a restart, a config rollback): an ended one
        keeps its routing (all to the baseline, or all to the canary); a running one goes
        on at its step, with the step's time so far counted (``step_age_s``) but a new
        window of samples (the old samples are not kept: a step decides on what it sees
        after the resume). Its decisions so far are shown before new ones. Raises
        ``KeyError`` / ``ValueError`` / ``TypeError`` for a state that is not one."""
        r = parse_state(state, len(self.plan.steps), now)
        self.status, self.step, self.step_started_at = r.status, r.step, r.step_started_at
        self.served, self.share_before_rollback = r.served, r.share_before_rollback
        self.probes, self.probe_failures = r.probes, r.probe_failures
        self.prior, self.history = r.prior, []
        self._reference = None
        self._fresh_step(r.step_started_at)
