"""What the status page remembers (``GET /status``): each served model's last hour per
minute and the recent incidents, read from the owners' own reports.

:class:`StatusRecorder` adds nothing to the request path. Its ``status`` loop
(``status.tick_s``) reads what the owners already keep into two
:class:`~gateway.traffic.status_rollup.MinuteRollup`: the last hour per minute
(``rollup``) and the "now" window (``status.now_s``) per tick (``recent``; P99 TTFT now is
the accounting's own, exact window):

* requests and those that failed, per model: the deltas of ``gateway_requests_total``
  and of ``gateway_request_errors_total`` without the client's own doing
  (:data:`~gateway.core.vocab.CLIENT_CAUSED`: its key's rate limit, its hang-ups), the
  same failures the alert GatewayErrorRatioHigh counts: a backend's 5xx, a timeout, a
  broken stream, the gateway's fast-fail answers while no backend can take the model
  (``no_backend``), a backend's own 429, admission's shedding (only models a backend of
  the fleet serves, so a client's made-up model names cannot grow it);
* first tokens: the samples :class:`~gateway.flow.accounting.Accounting` keeps per model
  newer than the last read;
* inter-token gaps: the deltas of the ``gateway_itl_seconds`` histogram's buckets
  (``GatewayMetrics.itl``, when the metrics have it; each gap counted at its bucket's
  upper bound);
* incidents: breaker trips (deltas of ``gateway_breaker_trips_total``, by backend and
  reason), config rollbacks (``gateway_config_reloads_total{source="rollback",
  outcome="applied"}``) and canary rollbacks (each rollout's decision history).

Backend transitions to ``draining`` and ``unhealthy`` come through the fleet state's
transition listener (:meth:`on_transition`, registered by :mod:`gateway.wiring`) with
their exact time.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from gateway.config import StatusConfig
from gateway.core.vocab import CLIENT_CAUSED, BackendState
from gateway.fleet.backend import Backend
from gateway.fleet.fleet import Fleet
from gateway.fleet.records import Transition
from gateway.flow.accounting import Accounting
from gateway.flow.rollouts import Rollouts
from gateway.metrics import GatewayMetrics
from gateway.traffic.incidents import IncidentLog
from gateway.traffic.status_rollup import MinuteRollup

HOUR_S = 3600.0
"""The longer window of the status page: the last hour."""

ITL_ATTRIBUTE = "itl"
"""The attribute of :class:`~gateway.metrics.GatewayMetrics` holding the
``gateway_itl_seconds{model,backend}`` histogram (absent: ITL is not judged)."""


def _totals(metric: Any, suffix: str) -> list[tuple[dict[str, str], float]]:
    """``(labels, value)`` of every sample of a prometheus_client metric whose name ends
    in ``suffix`` (``_total``, ``_bucket``)."""
    out = []
    for family in metric.collect():
        for s in family.samples:
            if s.name.endswith(suffix):
                out.append((s.labels, s.value))
    return out


class StatusRecorder:
    """The status page's memory (module docstring). ``clock``: monotonic seconds (the
    accounting's clock); ``wall``: Unix seconds (incident times)."""

    def __init__(
        self,
        cfg: StatusConfig,
        fleet: Fleet,
        accounting: Accounting,
        metrics: GatewayMetrics,
        clock: Callable[[], float],
        wall: Callable[[], float],
        rollouts: Rollouts | None = None,
    ) -> None:
        self.cfg = cfg
        self.fleet = fleet
        self.accounting = accounting
        self.metrics = metrics
        self.clock = clock
        self.wall = wall
        self.rollouts = rollouts
        self.rollup = MinuteRollup(HOUR_S, 60.0)  # the last hour, per minute
        # the "now" window (status.now_s), per tick: its ITL P99 and 5xx share
        self.recent = MinuteRollup(max(cfg.now_s, cfg.tick_s), cfg.tick_s)
        self.incidents = IncidentLog(cfg.incidents)
        self._ttft_read: dict[str, float] = {}  # model -> time of the newest sample read
        self._requests: dict[str, float] = {}  # model -> requests total read
        self._failed: dict[str, float] = {}  # model -> failures total read
        self._trips: dict[tuple[str, str], float] = {}  # (backend, reason) -> total read
        self._rollbacks = 0.0
        self._itl: dict[tuple[str, str], float] = {}  # (model, le) -> cumulative read
        self._decisions: dict[str, int] = {}  # model + rollout id -> decisions read

    def served_models(self) -> set[str]:
        """Every model some backend of the fleet lists."""
        return {m for b in self.fleet.backends for m in b.models}

    # ---- the fleet state's listener ------------------------------------------------------
    def on_transition(self, backend: Backend, t: Transition) -> None:
        """A backend moved: a drain or an unhealthy backend is an incident."""
        if t.to_state is BackendState.DRAINING:
            self.incidents.record(t.at, "drain", backend.id, t.reason)
        elif t.to_state is BackendState.UNHEALTHY:
            self.incidents.record(t.at, "unhealthy", backend.id, t.reason)

    # ---- the loop ------------------------------------------------------------------------
    async def round(self) -> None:
        """The ``status`` loop's body: :meth:`tick`."""
        self.tick()

    def tick(self) -> None:
        """Read every source once (module docstring)."""
        now, wall = self.clock(), self.wall()
        served = self.served_models()
        self._read_requests(now, served)
        self._read_ttft(now, served)
        self._read_itl(now, served)
        self._read_trips(wall)
        self._read_rollbacks(wall)
        self._read_rollouts(now, wall)

    def _read_requests(self, now: float, served: set[str]) -> None:
        requests = self._sums(self.metrics.requests, served)
        failed = self._sums(self.metrics.request_errors, served,
                            lambda labels: labels.get("error_type", "") not in CLIENT_CAUSED)
        for model in served:
            new = int(requests.get(model, 0.0) - self._requests.get(model, 0.0))
            new_failed = int(failed.get(model, 0.0) - self._failed.get(model, 0.0))
            for rollup in (self.rollup, self.recent):
                rollup.add_requests(model, now, new, new_failed)
        self._requests.update(requests)
        self._failed.update(failed)

    @staticmethod
    def _sums(metric: Any, served: set[str],
              keep: Callable[[dict[str, str]], bool] = lambda _: True) -> dict[str, float]:
        """Per served model, the sum of ``metric``'s ``_total`` samples whose labels
        ``keep`` accepts."""
        out: dict[str, float] = {}
        for labels, value in _totals(metric, "_total"):
            model = labels.get("model", "")
            if model in served and keep(labels):
                out[model] = out.get(model, 0.0) + value
        return out

    def _read_ttft(self, now: float, served: set[str]) -> None:
        for model, window in list(self.accounting.model_ttft.items()):
            if model not in served:
                continue
            after = self._ttft_read.get(model, -math.inf)
            fresh = [v for at, v in window if at > after]
            if fresh:
                self.rollup.add_ttft(model, now, fresh)
                self._ttft_read[model] = window[-1][0]

    def _read_itl(self, now: float, served: set[str]) -> None:
        histogram = getattr(self.metrics, ITL_ATTRIBUTE, None)
        if histogram is None:
            return
        cumulative: dict[tuple[str, str], float] = {}
        for labels, value in _totals(histogram, "_bucket"):
            key = (labels.get("model", ""), labels.get("le", ""))
            cumulative[key] = cumulative.get(key, 0.0) + value
        for model in served:
            bounds = sorted((float(le), le) for m, le in cumulative if m == model)
            below = 0.0  # the delta of the bucket before (cumulative counts)
            last_finite = 0.0
            for bound, le in bounds:
                delta = cumulative[(model, le)] - self._itl.get((model, le), 0.0)
                in_bucket = int(delta - below)
                below = delta
                value = bound if math.isfinite(bound) else last_finite
                if math.isfinite(bound):
                    last_finite = bound
                if in_bucket > 0:
                    self.rollup.add_itl(model, now, value, in_bucket)
                    self.recent.add_itl(model, now, value, in_bucket)
        self._itl.update(cumulative)

    def _read_trips(self, wall: float) -> None:
        for labels, value in _totals(self.metrics.breaker_trips, "_total"):
            key = (labels.get("backend", ""), labels.get("reason", ""))
            new = int(value - self._trips.get(key, 0.0))
            for _ in range(min(new, self.cfg.incidents)):  # no more than are kept
                self.incidents.record(wall, "breaker_trip", key[0], key[1] or "opened")
            self._trips[key] = value

    def _read_rollbacks(self, wall: float) -> None:
        total = sum(v for labels, v in _totals(self.metrics.config_reloads, "_total")
                    if labels.get("source") == "rollback" and labels.get("outcome") == "applied")
        for _ in range(min(int(total - self._rollbacks), self.cfg.incidents)):
            self.incidents.record(wall, "config_rollback", "config",
                                  "config returned to a kept version")
        self._rollbacks = total

    def _read_rollouts(self, now: float, wall: float) -> None:
        if self.rollouts is None:
            return
        for model, run in self.rollouts.runs.items():
            r = run.rollout
            rid = f"{model}\x00{r.plan.rollout_id}"
            for rec in r.history[self._decisions.get(rid, 0):]:
                if rec.outcome == "rolled_back":
                    self.incidents.record(wall - (now - rec.at), "rollout_rollback", model,
                                          rec.reason)
            self._decisions[rid] = len(r.history)
