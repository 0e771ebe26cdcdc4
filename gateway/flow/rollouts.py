"""Canary rollouts in the running gateway (issue 18): which version serves each request of a
model under rollout, what each finished request says about its version, the decisions and
their consequences. The decisions themselves are the pure state machine's
(:mod:`gateway.traffic.rollout`); the calibration probes are
:mod:`gateway.flow.rollout_probes`'; the admin API is :mod:`gateway.api.rollouts`.

* **Assignment** (:meth:`Rollouts.assign`, at the edge, before admission): a request for a
  model with a rollout gets a version (:meth:`gateway.traffic.rollout.Rollout.assign`:
  sticky by the session header's key, else a capped random draw; the first steps only for
  the targeted client keys / the low priority class) as ``ctx.version``; from then on only
  backends of that ``model_version`` are its candidates (:func:`gateway.flow.candidates
  .candidates`: its attempts, retries, continuations and the batcher's placement). When
  none of them is routable, the other version's serve it (it is not refused: availability
  first), counted in ``gateway_rollout_fallbacks_total`` and observed on the version that
  served it. A model without a rollout is untouched (one dict lookup).
* **Observing** (:meth:`Rollouts.observe`): a finished request on its serving backend's
  version: TTFT (seconds from the attempt's send to the first event of a stream, to the
  whole answer of a non-stream: the backend's own, the gateway's queue excluded, which both
  versions share) at the backend's requests in flight when it was sent and its prefill
  load (``Opened.prefill_load``), ITL (a stream's mean time between the events after its
  first, seconds) at the larger of that load and the backend's requests in flight when the
  stream ended (a request that arrived meanwhile and was prefilled stalled this stream's
  decode, and is still in flight at its end),
  error (a 5xx, an in-band 5xx error, a stream cut by the backend or the gateway; a 4xx is
  the client's and a client hanging up is not the version's: not errors).
* **Deciding** (:meth:`Rollouts.round`, the ``rollouts`` control loop every
  :data:`TICK_S`, and every assignment): before each round the versions' routable
  capacity is handed to the state machine (:meth:`Rollouts.capacity`), which holds a
  passed step while the next one does not fit it
  (:mod:`gateway.traffic.rollout_capacity`: ``held`` in ``/admin/rollouts``, one decision
  ``hold`` with reason ``capacity``) and moves on once a reload adds canary backends (warm)
  or moves baseline ones to the canary's ``model_version``; each decision is counted
  (``gateway_rollout_decisions_total{model,decision,reason}``), the step exported
  (``gateway_rollout_step{model}``) and logged in one line. A rollout that ended stays in
  the table with its last routing: **rolled back**, every request of the model goes to the
  baseline; **promoted**, to the canary, until another rollout of the model replaces it.
  A rollback of a rollout that came from the config also returns the config to the
  snapshot before the one that started it (``on_config_rollback``, wired by the app to
  :meth:`gateway.reloading.Reloader.rollback`); the failed rollout stays the model's
  (every request to its baseline) and its canary is not started again by a config
  (:mod:`gateway.flow.rollout_ledger`, which keeps every ended rollout for the admin view).
"""

from __future__ import annotations

import logging
import random
import time
import uuid
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import asdict
from typing import Any

from gateway.config_rollouts import RolloutConfig, version_problem
from gateway.fleet.backend import Backend
from gateway.fleet.fleet import Fleet
from gateway.flow.context import RequestContext
from gateway.flow.rollout_ledger import Ended, Ledger, identity_of, why_not_started
from gateway.flow.rollout_run import Origin, RolloutRun, plan_of, reason_label
from gateway.metrics import GatewayMetrics
from gateway.traffic.rollout import Rollout
from gateway.traffic.rollout_capacity import PoolCapacity, pool_capacity

log = logging.getLogger("gateway.rollouts")

TICK_S = 0.25
"""Seconds between two rounds of the ``rollouts`` loop (decisions are also made on each
assignment): a pure computation per running rollout, cheap at any rate; it bounds how late
a decision is made when the model's traffic stops."""



class Rollouts:
    """Every model's rollout (module docstring). ``clock``: monotonic seconds (the state
    machine's); ``wall``: Unix seconds (for the admin view)."""

    def __init__(self, metrics: GatewayMetrics, fleet: Fleet,
                 clock: Callable[[], float] = time.monotonic,
                 wall: Callable[[], float] = time.time) -> None:
        self.metrics = metrics
        self.fleet = fleet
        self.clock = clock
        self.wall = wall
        self.runs: dict[str, RolloutRun] = {}
        self.ledger = Ledger()  # the ended rollouts (gateway.flow.rollout_ledger)
        # set by the app: return the config to the version before ``config_version``
        # (None: the one before the running one), ``reason`` for the log
        # and the failed rollout's ledger record (JSON: recorded with the config returned)
        self.on_config_rollback: Callable[[int | None, str, dict[str, Any]],
                                          Awaitable[None]] | None = None
        self._config_rollbacks: list[tuple[int | None, str, dict[str, Any]]] = []

    # ---- starting and stopping ----------------------------------------------------------
    def version_problem(self, cfg: RolloutConfig) -> str | None:
        """Why ``cfg``'s versions cannot be served by the running fleet (naming the field),
        or None: each must be the ``model_version`` of a backend of the model."""
        return version_problem(cfg, (b.config.model_version for b in self.fleet.backends
                                     if _serves(b, cfg.model)))

    def start(self, cfg: RolloutConfig, origin: Origin,
              config_version: int | None = None) -> RolloutRun:
        """Start a rollout of ``cfg`` (replacing an ended one of the model; the caller
        refuses when one is running). An ``admin`` start is the operator's explicit ask:
        it lifts the blocks of its identity (:mod:`gateway.flow.rollout_ledger`)."""
        now = self.clock()
        if origin == "admin":
            self.ledger.clear(self.wall(), "POST /admin/rollouts", cfg.model,
                              identity_of(cfg.model, cfg.baseline, cfg.canary))
        rid = uuid.uuid4().hex[:12]
        run = RolloutRun(cfg, Rollout(plan_of(cfg, rid), now, random.Random()), origin,
                         config_version, self.wall())
        run.rollout.capacity = self.capacity(cfg)
        self.runs[cfg.model] = run
        self.metrics.rollout_step.labels(cfg.model).set(0)
        log.info("rollout %s of %s: started (%s) from %s to %s, steps %s", rid, cfg.model,
                 origin, cfg.baseline, cfg.canary, cfg.steps)
        return run

    def abort(self, model: str, reason: str, blocks: bool = True) -> RolloutRun | None:
        """An operator's rollback of ``model``'s running rollout (every request to the
        baseline from now on); None when none runs. The config is not returned.
        ``blocks``: whether its identity is blocked from config starts (False: stopped
        because its config entry went or changed, :meth:`sync`)."""
        run = self.runs.get(model)
        if run is None or not run.running:
            return None
        run.stopped_by_config = not blocks
        run.rollout.rollback(self.clock(), reason)
        self._handle(run)
        return run

    def misfit(self, model: str, reason: str) -> None:
        """Roll ``model``'s running rollout back because its calibration cannot be measured
        (``reason``: why; :mod:`gateway.flow.rollout_probes`): counted with reason
        ``calibration``."""
        run = self.runs.get(model)
        if run is None or not run.running:
            return
        run.rollout.rollback(self.clock(), reason, metric="calibration")
        self._handle(run)

    def clear(self, model: str) -> tuple[RolloutRun | None, list[str]]:
        """Forget ``model``'s ended rollout (its last routing: every request to the baseline
        after a rollback, to the canary after a promotion): the model is routed as without
        a rollout again, and the model's blocks are lifted (the operator's explicit ask: a
        config entry of the model starts at the next apply; :mod:`gateway.flow
        .rollout_ledger`). Returns it (None: none) and the ids of the ended rollouts
        whose blocks were lifted.
        Raises ``ValueError`` while it runs (abort it first)."""
        run = self.runs.get(model)
        if run is not None and run.running:
            raise ValueError(f"the rollout of {model} is running: abort it first")
        lifted = self.ledger.clear(self.wall(), "DELETE /admin/rollouts", model)
        if lifted:
            log.info("rollout of %s: the blocks of rollouts %s lifted by the operator: a "
                     "config entry of the model starts at the next apply", model, lifted)
        if run is None:
            return None, lifted
        del self.runs[model]
        self.metrics.rollout_step.remove(model)
        log.info("rollout %s of %s: cleared (%s): the model is routed as without a rollout",
                 run.rollout.plan.rollout_id, model, run.rollout.status)
        return run, lifted

    def sync(self, configs: Sequence[RolloutConfig],
             config_version: int | None) -> list[dict[str, Any]]:
        """The config's ``rollouts:`` (at start and at every apply of a config, changed or
        not): a rollout of the config whose entry is gone or changed is stopped (rolled
        back, reason ``operator``, not blocking); an entry is started (``config_version``:
        the config version that starts it) unless the model's rollout is that entry
        already (running, or promoted), one started by the admin API runs, or its
        identity is blocked by a failure (:mod:`gateway.flow.rollout_ledger`). Returns one
        item per entry: ``model``, ``baseline``, ``canary``, ``started``, ``code``
        (``started``, ``running``, ``rolled_back``, ``promoted``, ``admin_running``) and
        ``reason`` (what to do to start it)."""
        wanted = {c.model: c for c in configs}
        for model, run in list(self.runs.items()):
            if run.origin == "config" and wanted.get(model) != run.cfg:
                self.abort(model, "operator: the rollout's config entry was removed or "
                                  "changed", blocks=False)
        report: list[dict[str, Any]] = []
        for model, c in wanted.items():
            code, reason = why_not_started(self.runs.get(model), c, self.ledger)
            if code is None:
                run = self.start(c, "config", config_version)
                code, reason = "started", f"rollout {run.rollout.plan.rollout_id} started"
            elif code != "running":
                log.warning("rollout of %s from %s to %s: the config's entry not started: "
                            "%s", model, c.baseline, c.canary, reason)
            report.append({"model": model, "baseline": c.baseline, "canary": c.canary,
                           "started": code == "started", "code": code, "reason": reason})
        return report

    # ---- the request path ---------------------------------------------------------------
    def assign(self, ctx: RequestContext, client_key: str | None) -> None:
        """Set ``ctx.version`` when ``ctx.model`` has a rollout (module docstring)."""
        run = self.runs.get(ctx.model)
        if run is None:
            return
        side = run.rollout.assign(ctx.session_key, client_key, ctx.priority, self.clock())
        ctx.version = run.cfg.canary if side == "canary" else run.cfg.baseline
        ctx.fallback_version = run.cfg.baseline if side == "canary" else run.cfg.canary
        if len(run.rollout.history) > run.handled:
            self._handle(run)

    def observe(self, ctx: RequestContext, backend: Backend | None, error: bool,
                ttft_s: float | None = None, itl_s: float | None = None,
                load: int = 0, itl_load: int | None = None, prefill_load: int = 0,
                streamed: bool = True) -> None:
        """A finished request that was assigned a version (``ctx.version``): observed on
        the version of ``backend``, the one that served it (None: none did, the assigned
        one), and counted as a fallback when that is not the assigned one (the share per
        version is ``gateway_requests_total``'s ``version`` label, counted at the edge).
        ``load`` / ``itl_load``: the backend's requests in flight the TTFT / the ITL met,
        ``prefill_load``: its requests before their first token at the send, this one
        included; ``streamed`` False: ``ttft_s`` is the whole answer's time
        (:meth:`gateway.traffic.rollout.Rollout.observe`)."""
        run = self.runs.get(ctx.model)
        if run is None or ctx.version is None:
            return
        served = backend.config.model_version if backend is not None else ctx.version
        for bid in ctx.tried:  # attempts that failed before (a retry hides no canary error)
            failed = self.fleet.get(bid) if backend is None or bid != backend.id else None
            was = run.side(failed.config.model_version) if failed is not None else None
            if was is not None:
                run.rollout.observe(was, None, None, True)
        side = run.side(served)
        if side is None or served is None:
            return
        if served != ctx.version:
            self.metrics.rollout_fallbacks.labels(ctx.model, ctx.version).inc()
            run.fallbacks[ctx.version] = run.fallbacks.get(ctx.version, 0) + 1
        run.rollout.observe(side, None if error else ttft_s, None if error else itl_s, error,
                            load, itl_load, prefill_load, streamed)

    def observe_failure(self, ctx: RequestContext, status: int) -> None:
        """A request with a version that ended without a backend's answer to relay as
        served (a refusal, a backend's own error answer): an error when ``status`` is a
        5xx, observed on the last backend it went to."""
        if ctx.version is None or status < 500:
            return
        backend = self.fleet.get(ctx.tried[-1]) if ctx.tried else None
        self.observe(ctx, backend, True)

    # ---- deciding -----------------------------------------------------------------------
    async def round(self) -> None:
        """The ``rollouts`` loop's body: decide every running rollout that is due, then
        return the config for each rollout from the config that rolled back."""
        now = self.clock()
        for run in list(self.runs.values()):
            if run.running:
                run.rollout.capacity = self.capacity(run.cfg)
                run.rollout.tick(now)
            if len(run.rollout.history) > run.handled:
                self._handle(run)
        while self._config_rollbacks and self.on_config_rollback is not None:
            version, reason, failed = self._config_rollbacks.pop(0)
            await self.on_config_rollback(version, reason, failed)

    def capacity(self, cfg: RolloutConfig) -> PoolCapacity:
        """The routable capacity of ``cfg``'s two versions now
        (:func:`gateway.traffic.rollout_capacity.pool_capacity` over the model's routable
        backends: warm, breaker not open), refreshed before every round's decisions."""
        return pool_capacity(((b.config.model_version, b.config.max_num_seqs)
                              for b in self.fleet.backends
                              if b.routable and _serves(b, cfg.model)),
                             cfg.baseline, cfg.canary)

    def running_versions(self) -> dict[str, tuple[str, str]]:
        """``(baseline, canary)`` of each model whose rollout runs now: what maintenance
        reads (:meth:`gateway.fleet.maintenance.Maintenance.use_rollouts`) so a cycle never
        takes out the last routable backend of either version (read-only: the runs stay
        this object's)."""
        return {m: (r.cfg.baseline, r.cfg.canary) for m, r in self.runs.items() if r.running}

    def _handle(self, run: RolloutRun) -> None:
        """Count, export and log the decisions not handled yet."""
        model = run.cfg.model
        m = self.metrics
        r = run.rollout
        for rec in r.history[run.handled:]:
            label = reason_label(rec)
            m.rollout_decisions.labels(model, rec.outcome, label).inc()
            level = logging.WARNING if rec.outcome in ("rolled_back", "hold") else logging.INFO
            log.log(level, "rollout %s of %s: step %d (canary %.0f%%) %s [%s]: %s; canary "
                    "served %.2f%% of the rollout's requests so far", r.plan.rollout_id,
                    model, rec.step, rec.share * 100, rec.outcome, label, rec.reason,
                    r.canary_share_served * 100)
            if rec.outcome not in ("rolled_back", "promoted"):
                continue
            ended = Ended(r.plan.rollout_id, model, run.cfg.baseline, run.cfg.canary,
                          run.origin, run.config_version, rec.outcome, rec.reason, label,
                          rec.step, run.started_unix,
                          round(self.wall() - (self.clock() - rec.at), 3),
                          blocks=rec.outcome == "rolled_back" and not run.stopped_by_config)
            self.ledger.add(ended)
            if (rec.outcome == "rolled_back" and label != "operator"
                    and run.origin == "config"):
                self._config_rollbacks.append((run.config_version, rec.reason,
                                               asdict(ended)))
        run.handled = len(r.history)
        self._export_step(run)

    def _export_step(self, run: RolloutRun) -> None:
        """``gateway_rollout_step{model}``: the step running, the number of steps once
        promoted, -1 once rolled back."""
        r = run.rollout
        step = {"running": r.step, "promoted": len(r.plan.steps), "rolled_back": -1}
        self.metrics.rollout_step.labels(run.cfg.model).set(step[r.status])

    # ---- kept with the config snapshots --------------------------------------------------
    def state(self) -> dict[str, dict[str, Any]]:
        """Every rollout's state by model (JSON-ready; kept with each config snapshot,
        :mod:`gateway.reload_state`): its config, id, origin, the config version that
        started it, when it started (Unix seconds), its fallbacks and the state machine's
        :meth:`gateway.traffic.rollout.Rollout.state`."""
        now = self.clock()
        return {model: {"config": run.cfg.model_dump(mode="json"),
                        "id": run.rollout.plan.rollout_id, "origin": run.origin,
                        "config_version": run.config_version,
                        "started_unix": run.started_unix, "fallbacks": dict(run.fallbacks),
                        "machine": run.rollout.state(now)}
                for model, run in self.runs.items()}

    def restore(self, states: Mapping[str, Mapping[str, Any]]) -> list[str]:
        """Take up the rollouts of ``states`` (:meth:`state`, from a kept snapshot) where
        they belong: a model's rollout is restored when none runs here (none known, or the
        one known has ended without blocking its identity: promoted, or stopped because
        its config entry went), or when the one running is the same config entry that has
        not decided anything yet (the one :meth:`sync` just started for it at a
        rollback). A rollout that ended blocking (a failure, an abort) stays: every request
        of its model to its baseline; a kept *running* rollout whose identity is blocked
        is not taken up (:mod:`gateway.flow.rollout_ledger`). One whose versions the fleet
        no longer serves, or that does not parse, is skipped (logged). Returns the models
        restored."""
        now = self.clock()
        out: list[str] = []
        for model, st in states.items():
            have = self.runs.get(model)
            try:
                cfg = RolloutConfig.model_validate(st["config"])
                if st["origin"] not in ("config", "admin"):
                    raise ValueError(f"origin {st['origin']!r}")
                if have is not None and have.running and (
                        have.cfg != cfg or have.rollout.history or have.rollout.prior):
                    continue
                if have is not None and self.ledger.blocks_run(have.rollout.plan.rollout_id):
                    continue  # a failure's routing stays: every request to its baseline
                blocked = self.ledger.blocking(identity_of(model, cfg.baseline, cfg.canary))
                if blocked is not None and st["machine"].get("status") == "running":
                    log.warning("rollout %s of %s not restored: its canary %s rolled back "
                                "in rollout %s (%s)", st["id"], model, cfg.canary,
                                blocked.id, blocked.reason)
                    continue
                if self.version_problem(cfg) is not None:
                    log.warning("rollout of %s not restored: %s", model,
                                self.version_problem(cfg))
                    continue
                run = RolloutRun(cfg, Rollout(plan_of(cfg, str(st["id"])), now,
                                              random.Random()),
                                 st["origin"], st.get("config_version"),
                                 float(st["started_unix"]),
                                 {str(k): int(v) for k, v in (st.get("fallbacks") or {}).items()})
                run.rollout.resume(st["machine"], now)
                run.rollout.capacity = self.capacity(cfg)
            except (KeyError, TypeError, ValueError) as e:
                log.warning("rollout of %s not restored: its kept state is not one (%s)",
                            model, e)
                continue
            self.runs[model] = run
            self._export_step(run)
            r = run.rollout
            log.info("rollout %s of %s: restored (%s) at step %d, %s", r.plan.rollout_id,
                     model, run.origin, r.step, r.status)
            out.append(model)
        return out

    # ---- the admin view -----------------------------------------------------------------
    def view(self) -> list[dict[str, object]]:
        """``GET /admin/rollouts``: each rollout's snapshot (times in Unix seconds), where it
        came from and its fallbacks."""
        now, wall = self.clock(), self.wall()
        out: list[dict[str, object]] = []
        for run in self.runs.values():
            snap = run.rollout.snapshot(now)
            for rec in snap["history"]:  # type: ignore[attr-defined]
                rec["at_unix"] = round(wall - (now - rec["at"]), 3)
            snap.update({"id": run.rollout.plan.rollout_id, "origin": run.origin,
                         "config_version": run.config_version,
                         "started_unix": run.started_unix, "fallbacks": dict(run.fallbacks),
                         "config": run.cfg.model_dump(mode="json")})
            out.append(snap)
        return out


def _serves(b: Backend, model: str) -> bool:
    """Whether ``b`` serves (or, without a configured list, may serve) ``model``."""
    configured: Iterable[str] | None = b.config.models
    return model in b.models or configured is None or model in configured
