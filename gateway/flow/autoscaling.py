"""The ``autoscale`` control loop: each model's :class:`gateway.autoscale.ModelSignals` built
from the fleet and this gateway's own view, fed to :class:`gateway.autoscale.Autoscaler`,
and the answer exported (``gateway_autoscale_*``, ``gateway_replicas``, ``GET /autoscale``).

**Which models**: every model some backend lists (``Backend.models``, any state), plus
every model named in ``autoscale.models``. A model named there keeps being decided when no
backend serves it (zero replicas: its desired count falls to its ``min_replicas`` once the
scale-down cooldown has passed), so an autoscaler that scaled it to nothing still reads a
number; any other model is forgotten when its last backend leaves (its series removed,
``/autoscale?model=`` 404).

**Replica counts** (:class:`gateway.core.vocab.BackendState`): ``ready`` = ``warm`` (in
rotation, takes requests); ``warming`` = ``cold`` or ``warming`` (it exists and will serve:
discovery found it, its server starts, its model loads, warm-up runs). ``draining``,
``cooldown`` and ``unhealthy`` count as neither: a draining replica is leaving (or in a
maintenance cycle), one in cooldown or unhealthy serves nothing now, and counting them as
capacity on the way would hold a scale-up back.

**Per model, from the ready backends' latest scrape** (:class:`gateway.core.samples.LoadSample`):
``running`` / ``waiting`` summed, ``kv_cache_usage`` their mean. A ready backend without a
sample fresher than ``telemetry.stale_after_s`` (its ``/metrics`` lacks vLLM's gauges, or
its scrapes fail) counts the requests this gateway has in flight there as running (what
the gateway knows of its load; neither nothing nor a sample that no longer says anything),
and adds nothing to the KV-cache mean. ``slots``: a replica's
``max_num_seqs`` as configured, else what its :class:`gateway.traffic.capacity.ServiceModel`
learned (``ceiling``), else ``autoscale.default_slots``; the mean over the ready backends
(all of the model's when none is ready).

**This gateway's arrivals** (:class:`gateway.autoscale.ArrivalInputs`): P99 TTFT of the
model's streams over ``autoscale.ttft_window_s`` (:meth:`Accounting.model_p99_ttft`);
``rate_rps`` = the model's Holt-Winters level, ``ahead_rps`` / ``ahead_high_rps`` = its
forecast over :func:`gateway.autoscale.ahead_window` of the model's measured cold start
(:class:`gateway.fleet.cold_start.ColdStarts`, else ``autoscale.cold_start_s``). With
``forecast.enabled: false`` (and no batcher) there is no forecaster: the ahead paradigm and
the warm pool have no input and say 0; fast and fine still decide.

**Fleet mode** (:mod:`gateway.coord.autoscale`, through :class:`SharedView`): the inputs
are the live replicas' combined (:func:`gateway.autoscale.combine_inputs`) while the store
answers, and the leader's decision is served while fresh; otherwise this replica decides
on its own inputs. It always decides too, so its stabilization window is warm when it has
to answer alone, and it holds the answers of the fleet's record in that window
(:meth:`gateway.autoscale.ModelAutoscaler.hold`, each record once): when it becomes the
leader, or answers alone while the store is down, its answer does not fall before the
fleet's scale-down cooldown has passed.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol

from gateway.autoscale import (
    ArrivalInputs,
    Autoscaler,
    Decision,
    LagTracker,
    ModelSignals,
    ahead_window,
)
from gateway.config import GatewayConfig
from gateway.core.vocab import BackendState
from gateway.fleet.backend import Backend
from gateway.fleet.cold_start import ColdStarts
from gateway.fleet.fleet import Fleet
from gateway.flow.accounting import Accounting
from gateway.flow.forecasts import ArrivalForecasts
from gateway.metrics import GatewayMetrics

S = BackendState
WARMING_STATES = frozenset({S.COLD, S.WARMING})
LOCAL = "local"


class SharedView(Protocol):
    """Fleet mode's side of the loop (:class:`gateway.coord.autoscale.SharedAutoscale`)."""

    @property
    def replica_id(self) -> str: ...

    def fleet_inputs(self) -> dict[str, ArrivalInputs] | None:
        """The live replicas' inputs combined, per model; None when not fresh (store
        down)."""
        ...

    def leader(self) -> tuple[str, float, dict[str, Decision]] | None:
        """``(leader id, decided at (unix s), decisions)`` of another replica while fresh;
        None when this replica leads or none is fresh."""
        ...

    def recent(self) -> tuple[float, dict[str, Decision]] | None:
        """``(age s, decisions)`` of the last fresh record another replica wrote, whoever
        leads now; None when there is none."""
        ...


@dataclass(frozen=True, slots=True)
class Answer:
    """One model's answer as served: ``decision``, who made it (``decided_by``: a replica
    id, or ``local`` outside fleet mode), when (``decided_at``, unix seconds), whether the
    arrival inputs were the fleet's or this replica's (``inputs``), the cold start the
    ahead paradigm used (``cold_start_s``, ``measured``), the model's bounds, and the
    arrival inputs this replica decided on (``arrivals``; fleet mode: the fleet's when
    ``inputs`` is ``fleet``)."""

    decision: Decision
    decided_by: str
    decided_at: float
    inputs: str
    cold_start_s: float
    measured: bool
    min_replicas: int
    max_replicas: int
    arrivals: ArrivalInputs

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready (``GET /autoscale``): the decision's fields (``at`` as unix seconds)
        and the rest."""
        out = self.decision.as_dict()
        out["at"] = round(self.decided_at, 3)
        out.update(
            min_replicas=self.min_replicas,
            max_replicas=self.max_replicas,
            cold_start_s=round(self.cold_start_s, 3),
            cold_start_measured=self.measured,
            decided_by=self.decided_by,
            inputs=self.inputs,
            arrivals=self.arrivals.as_dict(),
        )
        return out


def replica_slots(b: Backend, default: int) -> int:
    """``b``'s sequences at once: configured ``max_num_seqs``, else learned (``ceiling``),
    else ``default``."""
    if b.config.max_num_seqs:
        return b.config.max_num_seqs
    learned = b.service.ceiling
    return max(1, math.ceil(learned)) if learned else default


class AutoscaleSignals:
    """The loop's owner: builds the signals, decides (:meth:`round`), exports, and keeps
    the answers :mod:`gateway.api.autoscale` serves (:attr:`answers`). ``clock``: monotonic
    seconds; ``wall``: unix seconds."""

    def __init__(
        self,
        cfg: GatewayConfig,
        fleet: Fleet,
        metrics: GatewayMetrics,
        accounting: Accounting,
        forecasts: ArrivalForecasts | None,
        cold_starts: ColdStarts,
        clock: Callable[[], float],
        wall: Callable[[], float],
    ) -> None:
        self.cfg = cfg.autoscale
        self.stale_after_s = cfg.telemetry.stale_after_s
        self.fleet = fleet
        self.metrics = metrics
        self.accounting = accounting
        self.forecasts = forecasts
        self.cold_starts = cold_starts
        self.clock = clock
        self.wall = wall
        self.autoscaler = Autoscaler(cfg.autoscale, cfg.slo.ttft_s)
        self.lags: dict[str, LagTracker] = {}
        self.shared: SharedView | None = None
        self.answers: dict[str, Answer] = {}  # as served since the last round
        self.own: dict[str, Decision] = {}  # this replica's own last decisions
        self.own_at = 0.0  # when (unix s)
        self.rounds = 0
        self._held: dict[str, float] = {}  # model -> decided-at (unix s) of the last held

    def share(self, view: SharedView) -> None:
        """Fleet mode: combine inputs and serve the leader's decision through ``view``."""
        self.shared = view

    # ---- inputs -----------------------------------------------------------------------
    def models(self) -> set[str]:
        """The models decided for (module docstring)."""
        return self.fleet.known_models() | set(self.cfg.models)

    def cold_start(self, model: str) -> tuple[float, bool]:
        """``(seconds, measured)``: the model's recent measured cold start, else the
        configured one."""
        measured = self.cold_starts.mean_s(model)
        return (measured, True) if measured is not None else (self.cfg.cold_start_s, False)

    def local_inputs(self) -> dict[str, ArrivalInputs]:
        """This gateway's arrival inputs per model (module docstring)."""
        out: dict[str, ArrivalInputs] = {}
        series = self.forecasts.models.series if self.forecasts is not None else {}
        for model in self.models():
            p99, samples = self.accounting.model_p99_ttft(model, self.cfg.ttft_window_s)
            rate = ahead = high = None
            hw = series.get(model)
            if hw is not None and hw.level is not None:
                rate = hw.forecast().level
                f = hw.window(*ahead_window(self.cold_start(model)[0], self.cfg))
                ahead, high = f.rate, f.high
            out[model] = ArrivalInputs(rate, ahead, high, p99, samples)
        return out

    def signals(self, model: str, inputs: ArrivalInputs) -> ModelSignals:
        """``model``'s signals: the backends' gauges (module docstring) and ``inputs``."""
        backends = [b for b in self.fleet.backends if model in b.models]
        ready = [b for b in backends if b.state is S.WARM]
        warming = sum(1 for b in backends if b.state in WARMING_STATES)
        sized = ready or backends
        slots = (
            round(sum(replica_slots(b, self.cfg.default_slots) for b in sized) / len(sized))
            if sized
            else self.cfg.default_slots
        )
        now = self.clock()
        loads = [
            b.load for b in ready
            if b.load is not None and now - b.load.scraped_at <= self.stale_after_s
        ]
        unseen = sum(
            b.in_flight for b in ready
            if b.load is None or now - b.load.scraped_at > self.stale_after_s
        )
        return ModelSignals(
            ready=len(ready),
            warming=warming,
            slots=max(1, slots),
            running=sum(x.running for x in loads) + unseen,
            waiting=sum(x.waiting for x in loads),
            kv_cache_usage=sum(x.kv_cache_usage for x in loads) / len(loads) if loads else 0.0,
            ttft_p99_s=inputs.ttft_p99_s,
            rate_rps=inputs.rate_rps,
            ahead_rps=inputs.ahead_rps,
            ahead_high_rps=inputs.ahead_high_rps,
        )

    # ---- the round ----------------------------------------------------------------------
    async def round(self) -> None:
        """One decision for every model; exports and keeps the answers."""
        now, wall = self.clock(), self.wall()
        local = self.local_inputs()
        shared = self.shared
        fleet = shared.fleet_inputs() if shared is not None else None
        source = "fleet" if fleet is not None else LOCAL
        inputs = {m: (fleet or {}).get(m, local[m]) for m in local}
        signals = {m: self.signals(m, i) for m, i in inputs.items()}
        if shared is not None:
            self._hold_fleet(shared, now, wall, signals.keys())
        own = self.autoscaler.decide(now, signals)
        self.own, self.own_at = own, wall
        me = shared.replica_id if shared is not None else LOCAL
        leader = shared.leader() if shared is not None else None
        answers: dict[str, Answer] = {}
        for model, decision in own.items():
            by, at, source_m = me, wall, source
            if leader is not None and model in leader[2]:
                by, at, decision, source_m = leader[0], leader[1], leader[2][model], "fleet"
            seconds, measured = self.cold_start(model)
            lim = self.cfg.limits(model)
            answers[model] = Answer(
                decision, by, at, source_m, seconds, measured, lim.min_replicas,
                lim.max_replicas, inputs[model],
            )
            self._export(model, decision, signals[model], now)
        for gone in self.answers.keys() - answers.keys():
            self._forget(gone)
        self.answers = answers
        self.rounds += 1

    def _hold_fleet(
        self, shared: SharedView, now: float, wall: float, models: Iterable[str]
    ) -> None:
        """Hold the answers of the fleet's last record (another replica's ``desired``: its
        whole window's, which a replica that just started has not seen) in this replica's
        stabilization windows, each decision once (module docstring). A handover can so
        hold a count for up to one more cooldown, never less than the fleet's."""
        rec = shared.recent()
        if rec is None:
            return
        age, decisions = rec
        for model in models:
            d = decisions.get(model)
            if d is None or self._held.get(model) == d.at:
                continue
            self._held[model] = d.at
            self.autoscaler.model(model).hold(now - age, d.desired)

    def _export(self, model: str, d: Decision, s: ModelSignals, now: float) -> None:
        m = self.metrics
        m.autoscale_desired.labels(model).set(d.desired)
        for state, value in (
            ("desired", d.desired), ("current", s.current), ("ready", s.ready),
            ("warming", s.warming),
        ):
            m.replicas_by_state.labels(model, state).set(value)
        for paradigm, value in (
            ("fast", d.fast), ("fine", d.fine), ("ahead", d.ahead), ("warm_pool", d.warm_pool),
        ):
            m.autoscale_signal.labels(model, paradigm).set(value)
        lag = self.lags.setdefault(model, LagTracker())
        for seconds in lag.observe(now, d.desired, s.ready):
            m.autoscale_lag.labels(model).observe(seconds)

    def _forget(self, model: str) -> None:
        self.metrics.forget_model(model)
        self.accounting.forget_model(model)
        self.cold_starts.forget_model(model)
        self.lags.pop(model, None)
        self._held.pop(model, None)

    # ---- what GET /autoscale serves -----------------------------------------------------
    def summary(self) -> dict[str, Any]:
        """Every model's answer and who decided (``decided_by``: the leader's id when every
        model's answer is the leader's, else this replica's) on which ``inputs`` (``fleet``,
        ``local``, or ``mixed`` when models differ: one the leader had not decided yet)."""
        answers = self.answers
        by = {a.decided_by for a in answers.values()}
        inputs = {a.inputs for a in answers.values()}
        me = self.shared.replica_id if self.shared is not None else LOCAL
        return {
            "decided_by": by.pop() if len(by) == 1 else me,
            "inputs": inputs.pop() if len(inputs) == 1 else ("mixed" if inputs else LOCAL),
            "interval_s": self.cfg.interval_s,
            "models": {m: a.as_dict() for m, a in sorted(answers.items())},
        }
