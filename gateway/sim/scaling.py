"""The autoscaled fleet in simulated time (pure, deterministic): replicas come and go as an
autoscaling policy (:mod:`gateway.sim.scaling_policies`) asks, and the run measures what
that costs and what it serves: ``<L, W, S, C>`` (issue 16).

**Replicas** are :class:`gateway.sim.batch.BatchEngine` s (:data:`FLEET_ENGINE`: a
70B-class model on one H100, one GPU per replica). A replica asked for takes a cold start,
uniform in ``cold_start_s`` (``[60, 90]`` s by default, from the run's seeded stream: every
policy draws the same sequence) before it is ready; a replica removed stops taking
requests and leaves once its requests are done (drain); a replica still starting is
cancelled at once. GPU time runs from the ask to the leaving (cold start and drain
included). No thermal physics: every replica runs at full clock.

**Routing** among the ready replicas: the gateway's own ``least_request`` policy
(:func:`gateway.routing.policies.build_policy`: fewest requests in flight, ties in turn,
and the slow-start ramp of ``lifecycle.slow_start_s``, 30 s, so a replica that has just
become ready is not handed every arrival at once); each replica is a routing candidate
with the gateway's in-flight count. No ready replica: the request is rejected (it misses
the SLO).

**The orchestrator** (the same for every policy) acts on each decision at once: desired
above the replicas that exist (ready + starting), ask for the difference; below, cancel
starting replicas first (the latest asked first), then drain ready ones (fewest in flight
first).

**What a policy sees** every tick of its own period (:class:`ScalingView`): ready /
starting counts; ``running`` and ``waiting`` summed over the ready replicas and their mean
KV-cache use (vLLM's gauges); the P99 TTFT of the first tokens of the last
``autoscale.ttft_window_s`` (each seen when it happens: ``BatchEngine.on_first_token``);
and the arrival-rate forecast of a :class:`gateway.traffic.forecast.HoltWinters` fed one
count per simulated second: ``forecast().level`` for the rate now, ``window(cold start,
autoscale.lead_s)`` for the ahead window (its rate and high), the cold start being the mean
of those measured so far in the run (``autoscale.cold_start_s`` before the first).
**The gateway has run for ``history_days`` days** (3) before the run: the forecaster is
trained on that many earlier days of the same trace kind (the same :class:`TraceSpec`,
other seeds; arrival counts only), as a gateway in service would have been.

**Measured** (:class:`ScalingResult`): L, the P50 scale-up lag
(:class:`gateway.autoscale.LagTracker` fed every decision and every replica's readiness:
the decision that asked -> the moment one more replica is ready, whatever the policy's
period); W, the idle GPU share (allocated GPU-seconds with no request running,
cold starts and drains included, over all allocated GPU-seconds: one request of a batch
makes a replica busy, so also ``slot_share``, the batch slots used); S, the share of
arrived requests with TTFT <= ``slo.ttft_s`` and mean ITL <= ``slo.itl_s`` (rejected and
unfinished ones miss); C, the cost per million output tokens (GPU-hours x ``gpu_hour_usd`` / output
tokens of the completed requests x 1e6); GPU-hours, mean / max replicas, P99 TTFT; a time
series every ``record_every_s`` (60 s) of the replicas allocated, ready, desired and the
arrival rate.
"""

from __future__ import annotations

import copy
import heapq
import math
import random
import statistics
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from gateway.autoscale import LagTracker, ahead_window
from gateway.config import RoutingConfig, RoutingPolicy, TelemetryConfig
from gateway.core.samples import LoadSample
from gateway.routing.policies import Policy, build_policy
from gateway.sim.batch import BatchEngine, SimRequest
from gateway.sim.scaling_policies import ScalingPolicy, ScalingView, TraceFacts
from gateway.sim.scaling_spec import (
    DEFAULT_GPU_HOUR_USD,
    ScalingResult,
    ScalingSeries,
    ScalingSpec,
    replica_capacity_rps,
    trace_facts,
    train_forecaster,
)
from gateway.sim.workload import Arrival, TraceSpec, generate
from gateway.traffic.forecast import HoltWinters

__all__ = [  # the autoscaling simulator's entry point: its parts are re-exported here
    "DEFAULT_GPU_HOUR_USD",
    "ScalingResult",
    "ScalingSeries",
    "ScalingSpec",
    "replica_capacity_rps",
    "run_policies",
    "simulate_scaling",
    "trace_facts",
    "train_forecaster",
]


def _quantile(sorted_vals: Sequence[float], q: float) -> float:
    if not sorted_vals:
        return math.nan
    k = min(len(sorted_vals) - 1, max(0, math.ceil(q * len(sorted_vals)) - 1))
    return sorted_vals[k]


@dataclass(eq=False, slots=True)
class _Replica:
    """One replica: its engine, when it was asked for and is (or was) ready (s), its
    state (``starting``, ``ready``, ``draining``, ``gone``) and when it left. Also a
    routing candidate (:class:`gateway.routing.policy.Candidate`): ``in_flight`` (the
    gateway's count), ``warm_since`` (the slow-start ramp's start; None: past it)."""

    engine: BatchEngine
    asked_at: float
    ready_at: float
    index: int
    state: str = "starting"
    left_at: float = -1.0
    in_flight: int = 0
    warm_since: float | None = None
    load: LoadSample | None = None

    @property
    def id(self) -> str:
        return f"r{self.index}"

    @property
    def capacity(self) -> int | None:
        return self.engine.params.max_num_seqs

    @property
    def recent_failures(self) -> int:
        return 0


class _Run:
    """The event loop's state for one policy (see :func:`simulate_scaling`)."""

    def __init__(
        self,
        spec: ScalingSpec,
        policy: ScalingPolicy,
        forecaster: HoltWinters | None,
        duration_s: float,
    ) -> None:
        self.spec = spec
        self.policy = policy
        self.hw = forecaster
        self.duration = duration_s
        self.rng = random.Random(spec.seed)
        self.now = 0.0
        self.router: Policy = build_policy(
            RoutingConfig(policy=RoutingPolicy.LEAST_REQUEST, session_max_entries=1),
            spec.lifecycle,
            TelemetryConfig().stale_after_s,
            lambda: self.now,
            rng=random.Random(spec.seed + 1),
        )
        self.replicas: list[_Replica] = []
        self.ready: list[int] = []  # indices of ready replicas, in index order
        self.engine_heap: list[tuple[float, int, int]] = []  # (time, version, replica)
        self.version: list[int] = []
        self.ready_heap: list[tuple[float, int]] = []  # (ready time, replica)
        self.cold_starts: list[float] = []
        self.first_tokens: deque[tuple[float, float]] = deque()  # (at, ttft)
        self.lag = LagTracker()
        self.lags: list[float] = []
        self.desired = 0
        self.max_alloc = 0
        self.asked = 0
        # request outcomes
        self.arrived = self.completed = self.rejected = self.good = 0
        self.tokens_out = 0
        self.ttfts: list[float] = []
        self.arrivals_since_record = 0
        self.arrivals_this_second = 0
        self.series = ScalingSeries()

    # -- replicas
    def allocated(self) -> int:
        return sum(1 for r in self.replicas if r.state != "gone")

    def add(self, now: float, ready_at: float) -> None:
        e = BatchEngine(self.spec.engine)
        win = self.first_tokens
        e.on_first_token = lambda req: win.append((req.first_token_at, req.ttft_s))
        i = len(self.replicas)
        self.replicas.append(_Replica(e, now, ready_at, i))
        self.version.append(0)
        if ready_at <= now:  # ready from the start: past its slow start
            self.replicas[i].state = "ready"
            self.ready.append(i)
        else:
            heapq.heappush(self.ready_heap, (ready_at, i))
        self.max_alloc = max(self.max_alloc, self.allocated())

    def ask(self, now: float) -> None:
        lo, hi = self.spec.cold_start_s
        self.asked += 1
        self.add(now, now + self.rng.uniform(lo, hi))

    def leave(self, i: int, now: float) -> None:
        r = self.replicas[i]
        r.state, r.left_at = "gone", now

    def became_ready(self, i: int, now: float) -> None:
        r = self.replicas[i]
        if r.state != "starting":
            return  # cancelled meanwhile
        r.state = "ready"
        r.warm_since = now
        self.cold_starts.append(now - r.asked_at)
        self.ready.append(i)
        self.ready.sort()
        # the lag ends now, not at the policy's next decision (up to period_s later: 30 s
        # for keda, 2 s for kpa), so that L is the same measurement for every policy
        self.lags.extend(self.lag.observe(now, self.desired, len(self.ready)))

    def orchestrate(self, now: float, desired: int) -> None:
        """Act on ``desired`` (see the module docstring)."""
        starting = [i for i, r in enumerate(self.replicas) if r.state == "starting"]
        existing = len(self.ready) + len(starting)
        if desired > existing:
            for _ in range(desired - existing):
                self.ask(now)
            return
        excess = existing - desired
        for i in sorted(starting, key=lambda i: -self.replicas[i].asked_at)[:excess]:
            self.leave(i, now)
            excess -= 1
        if excess <= 0:
            return
        by_load = sorted(self.ready, key=lambda i: (self.replicas[i].in_flight, i))
        for i in by_load[:excess]:
            self.ready.remove(i)
            if self.replicas[i].in_flight == 0:
                self.leave(i, now)
            else:
                self.replicas[i].state = "draining"

    # -- engines
    def reschedule(self, i: int) -> None:
        self.version[i] += 1
        t = self.replicas[i].engine.next_event_time()
        if t is not None:
            heapq.heappush(self.engine_heap, (t, self.version[i], i))

    def account(self, i: int, done: list[SimRequest], now: float) -> None:
        slo = self.spec.slo
        r = self.replicas[i]
        r.in_flight -= len(done)
        for req in done:
            self.completed += 1
            self.tokens_out += req.output_tokens
            ttft = req.ttft_s
            self.ttfts.append(ttft)
            if ttft <= slo.ttft_s and req.tpot_s <= slo.itl_s:
                self.good += 1
        if r.state == "draining" and r.in_flight == 0:
            self.leave(i, now)

    def advance_all(self, now: float) -> None:
        for i, r in enumerate(self.replicas):
            if r.state in ("ready", "draining"):
                self.account(i, r.engine.advance(now), now)
                self.reschedule(i)

    # -- the autoscaler's view
    def view(self, now: float) -> ScalingView:
        cfg = self.spec.autoscale
        self.advance_all(now)
        win = self.first_tokens
        while win and win[0][0] < now - cfg.ttft_window_s:
            win.popleft()
        recent = sorted(ttft for at, ttft in win if at >= now - cfg.ttft_window_s)
        engines = [self.replicas[i].engine for i in self.ready]
        rate = ahead = high = None
        if self.hw is not None and self.hw.ticks > 0:
            rate = self.hw.forecast().level
            cold = statistics.fmean(self.cold_starts) if self.cold_starts else cfg.cold_start_s
            w = self.hw.window(*ahead_window(cold, cfg))
            ahead, high = w.rate, w.high
        return ScalingView(
            now=now,
            ready=len(engines),
            starting=sum(1 for r in self.replicas if r.state == "starting"),
            running=sum(e.num_running for e in engines),
            waiting=sum(e.num_waiting for e in engines),
            kv_cache_usage=statistics.fmean(e.kv_usage() for e in engines) if engines else 0.0,
            ttft_p99_s=_quantile(recent, 0.99) if recent else None,
            rate_rps=rate,
            ahead_rps=ahead,
            ahead_high_rps=high,
            slots=self.spec.engine.max_num_seqs,
        )

    def decide(self, now: float) -> None:
        v = self.view(now)
        desired = self.policy.decide(now, v)
        if now < self.spec.warmup_s:
            return  # the policy has seen it; the fleet keeps its start
        self.desired = desired
        self.lags.extend(self.lag.observe(now, desired, v.ready))
        self.orchestrate(now, desired)

    def route(self, now: float, a: Arrival) -> None:
        self.arrived += 1
        self.arrivals_this_second += 1
        self.arrivals_since_record += 1
        if not self.ready:
            self.rejected += 1
            return
        self.now = now
        chosen = self.router.pick([self.replicas[i] for i in self.ready])
        assert chosen is not None
        best = chosen.index
        req = SimRequest(a.t, a.prompt_tokens, a.output_tokens, backend=best)
        chosen.in_flight += 1
        self.account(best, chosen.engine.submit(req, now), now)
        self.reschedule(best)

    def record(self, now: float) -> None:
        s = self.series
        s.t.append(now)
        s.allocated.append(self.allocated())
        s.ready.append(len(self.ready))
        s.desired.append(self.desired)
        s.arrival_rps.append(self.arrivals_since_record / self.spec.record_every_s)
        self.arrivals_since_record = 0


def simulate_scaling(
    spec: ScalingSpec,
    policy: ScalingPolicy,
    trace: Iterable[Arrival],
    duration_s: float,
    facts: TraceFacts,
    forecaster: HoltWinters | None = None,
    progress: Callable[[float], None] | None = None,
) -> ScalingResult:
    """Run ``policy`` over ``trace`` for ``duration_s`` simulated seconds.

    ``facts``: the trace's rates for the policy's start (:func:`trace_facts`);
    ``forecaster``: trained on earlier days (:func:`train_forecaster`), used and changed
    here (pass a copy to reuse it); None: an untrained one. Requests unfinished at the end
    and arrivals after it count as missed / are ignored. ``progress``: called with the
    simulated time every simulated hour."""
    hw = forecaster if forecaster is not None else HoltWinters()
    run = _Run(spec, policy, hw, duration_s)
    for _ in range(policy.initial(facts)):
        run.add(0.0, 0.0)
    run.desired = len(run.ready)
    it = iter(trace)
    nxt = next(it, None)
    inf = math.inf
    t_sec = 1.0
    t_pol = 0.0
    t_rec = spec.record_every_s
    t_prog = 3600.0
    sec = 0
    while True:
        t_arr = nxt.t if nxt is not None and nxt.t < duration_s else inf
        t_eng = run.engine_heap[0][0] if run.engine_heap else inf
        t_rdy = run.ready_heap[0][0] if run.ready_heap else inf
        t_tick = min(t_sec, t_pol, t_rec)
        now = min(t_arr, t_eng, t_rdy, t_tick)
        if now > duration_s:
            break
        if t_eng == now:
            _, ver, i = heapq.heappop(run.engine_heap)
            if ver == run.version[i]:
                run.account(i, run.replicas[i].engine.advance(now), now)
                run.reschedule(i)
            continue
        if t_rdy == now:
            _, i = heapq.heappop(run.ready_heap)
            run.became_ready(i, now)
            continue
        if t_tick == now:
            if t_sec == now:  # the second [now - 1, now) has ended: one count to the forecaster
                hw.observe(sec, run.arrivals_this_second)
                run.arrivals_this_second = 0
                sec += 1
                t_sec += 1.0
            if t_pol == now:
                run.decide(now)
                t_pol += policy.period_s
            if t_rec == now:
                run.record(now)
                t_rec += spec.record_every_s
            if progress is not None and now >= t_prog:
                progress(now)
                t_prog += 3600.0
            continue
        assert nxt is not None
        run.route(now, nxt)
        nxt = next(it, None)
    return _result(run, policy.name, duration_s)


def _result(run: _Run, name: str, duration_s: float) -> ScalingResult:
    end = duration_s
    run.advance_all(end)
    alloc_s = busy_s = slots_s = 0.0
    for r in run.replicas:
        stop = r.left_at if r.state == "gone" else end
        alloc_s += max(0.0, stop - r.asked_at)
        busy_s += r.engine.busy_s
        slots_s += r.engine.occupancy_s
    gpu_hours = alloc_s / 3600.0
    ttfts = sorted(run.ttfts)
    spec = run.spec
    return ScalingResult(
        policy=name,
        duration_s=duration_s,
        arrived=run.arrived,
        completed=run.completed,
        rejected=run.rejected,
        good=run.good,
        slo_attainment=run.good / run.arrived if run.arrived else 1.0,
        lag_p50_s=statistics.median(run.lags) if run.lags else None,
        lags=len(run.lags),
        idle_share=max(0.0, 1.0 - busy_s / alloc_s) if alloc_s > 0 else 0.0,
        gpu_hours=gpu_hours,
        cost_per_mtok_usd=(
            gpu_hours * spec.gpu_hour_usd / run.tokens_out * 1e6 if run.tokens_out else None
        ),
        mean_replicas=alloc_s / duration_s if duration_s > 0 else 0.0,
        max_replicas=run.max_alloc,
        ttft_p50_s=_quantile(ttfts, 0.50),
        ttft_p99_s=_quantile(ttfts, 0.99),
        output_tokens=run.tokens_out,
        replicas_asked=run.asked,
        slot_share=min(1.0, slots_s / alloc_s) if alloc_s > 0 else 0.0,
        series=run.series,
    )


def run_policies(
    spec: ScalingSpec,
    trace: TraceSpec,
    policies: Sequence[ScalingPolicy],
    progress: Callable[[str, ScalingResult, float], None] | None = None,
) -> list[ScalingResult]:
    """Run each policy on the same generated ``trace`` (materialised once), each with a
    copy of one forecaster trained on ``spec.history_days`` earlier days. ``progress``
    gets each result with the seconds its run took."""
    arrivals = list(generate(trace))
    facts = trace_facts(arrivals, trace.duration_s, replica_capacity_rps(spec, trace))
    trained = train_forecaster(trace, spec.history_days)
    out = []
    for p in policies:
        t0 = time.perf_counter()
        r = simulate_scaling(spec, p, arrivals, trace.duration_s, facts, copy.deepcopy(trained))
        if progress is not None:
            progress(p.name, r, time.perf_counter() - t0)
        out.append(r)
    return out
