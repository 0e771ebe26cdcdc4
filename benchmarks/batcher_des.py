"""Discrete-event simulation of a gateway in front of a simulated vLLM fleet, for
``benchmarks/batcher.py``: the same pure code the gateway runs (the batcher of
:mod:`gateway.traffic.batcher`, the forecaster of :mod:`gateway.traffic.forecast`) drives
the same pure engine model the simulated vLLM servers run (:mod:`gateway.sim.engine`:
continuous batching, paged KV cache, prefill stalls), in virtual time. No network and no
wall clock, so the policy comparison is exact and repeatable on a busy 2-core machine; the
gateway's own CPU cost is measured separately, through real HTTP, by ``batcher.py``.

Modes: ``off`` (FIFO without the batcher: every request goes to the least-loaded backend
on arrival and waits in vLLM's FCFS queue), ``admission`` (the gateway without the batcher:
the admission scheduler of :mod:`gateway.traffic.scheduler`, with the gateway's defaults,
lets the fleet's ``max_num_seqs`` be in flight, queues the rest by priority and refuses a
request whose predicted wait exceeds the queue timeout), ``fixed`` (the batcher
without forecast dispatch: a bucket goes when full or when its oldest request waited
``max_wait_ms``), and
``predictive`` (the batcher as configured by default: forecast dispatch, SLO-slack cap).
Both batcher modes bind requests at dispatch to a backend with room (in flight below
``max_num_seqs``), high priority first, and merge embeddings into one upstream request
(one place per upstream request; the gateway's embeddings merge window, which paces merged
requests to a backend's API-server frontend, is not modelled here: the engine model has no
frontend cost, and embeddings' throughput is measured through real HTTP by ``batcher.py``);
requests still queued after ``queue_timeout_s`` are refused (a 429).

Times are seconds, rates requests/s.
"""

from __future__ import annotations

import heapq
import math
import random
from collections import deque
from dataclasses import dataclass, field

from gateway.core.vocab import Prio
from gateway.sim.engine import Engine, EngineParams
from gateway.sim.engine_types import EngineRequest
from gateway.traffic.batcher import Batcher, BucketSettings, Item, RateView
from gateway.traffic.forecast import ForecastParams, HoltWinters
from gateway.traffic.scheduler import Scheduler

BUCKET_SETTINGS = [  # the gateway's defaults (config.BatcherConfig)
    BucketSettings(4, 0.002),
    BucketSettings(16, 0.010),
    BucketSettings(64, 0.050),
]


@dataclass(slots=True)
class Req:
    """One client request of the trace."""

    rid: int
    at: float
    prio: int
    kind: str  # "chat" or "emb"
    prompt: int  # tokens
    max_tokens: int
    first_token: float | None = None
    rejected: bool = False


@dataclass
class Workload:
    name: str
    rate_of: object  # callable t -> requests/s
    season_s: float | None = None


def bursty(mean: float) -> Workload:
    """Every 20 s a 4 s burst at 3x the base rate; the mean is ``mean``."""
    base = mean / (0.8 + 0.2 * 3)
    return Workload("bursty", lambda t: base * (3.0 if (t % 20.0) < 4.0 else 1.0))


def diurnal(mean: float, period: float = 120.0) -> Workload:
    """A compressed day: ``mean * (1 + 0.6 sin(2 pi t / period))``."""
    return Workload(
        "diurnal", lambda t: mean * (1 + 0.6 * math.sin(2 * math.pi * t / period)), period
    )


def make_trace(w: Workload, duration: float, seed: int, emb_share: float = 0.25) -> list[Req]:
    """Poisson arrivals with the workload's rate (thinning: Lewis & Shedler 1979)."""
    rng = random.Random(seed)
    peak = max(w.rate_of(t / 10.0) for t in range(int(duration * 10)))  # type: ignore[operator]
    out: list[Req] = []
    t = 0.0
    while True:
        t += rng.expovariate(peak)
        if t >= duration:
            return out
        if rng.random() > w.rate_of(t) / peak:  # type: ignore[operator]
            continue
        if rng.random() < emb_share:
            out.append(Req(len(out), t, 1, "emb", rng.randint(32, 128), 1))
        else:
            prio = rng.choices((0, 1, 2), (0.2, 0.5, 0.3))[0]
            out.append(Req(len(out), t, prio, "chat", rng.randint(64, 512), rng.randint(16, 128)))


def counts_per_second(trace: list[Req], duration: float) -> list[int]:
    c = [0] * math.ceil(duration)
    for r in trace:
        c[int(r.at)] += 1
    return c


def forecast_mape(counts: list[int], season_s: float | None, horizon: int = 30) -> dict[str, float]:
    """MAPE (%) of the forecaster (default parameters; the season, if any, in 24 bins) and
    of the naive last-value forecast of the mean rate over the next ``horizon`` seconds."""
    params = ForecastParams(horizon_s=horizon)
    if season_s is not None:
        params = ForecastParams(horizon_s=horizon, season_s=season_s, season_bins=24)
    hw = HoltWinters(params)
    ours = naive = 0.0
    n = 0
    for t, y in enumerate(counts):
        hw.observe(t, y)
        if horizon <= t < len(counts) - horizon:
            actual = sum(counts[t + 1 : t + horizon + 1]) / horizon
            if actual > 0:
                ours += abs(actual - hw.forecast().rate) / actual
                naive += abs(actual - y) / actual
                n += 1
    return {"forecast_mape_pct": 100 * ours / n, "naive_mape_pct": 100 * naive / n}


@dataclass
class Fleet:
    n: int
    params: EngineParams
    engines: list[Engine] = field(init=False)
    in_flight: list[int] = field(init=False)

    def __post_init__(self) -> None:
        self.engines = [Engine(self.params) for _ in range(self.n)]
        self.in_flight = [0] * self.n
        self._rr = 0

    def least_loaded(self, allowed: list[int]) -> int | None:
        if not allowed:
            return None
        low = min(self.in_flight[i] for i in allowed)
        ties = [i for i in allowed if self.in_flight[i] == low]
        self._rr += 1
        return ties[self._rr % len(ties)]


def simulate(
    trace: list[Req],
    mode: str,
    backends: int = 4,
    params: EngineParams | None = None,
    season_s: float | None = None,
    queue_timeout_s: float = 10.0,
    slo_ttft_s: float = 2.0,
    until: float | None = None,
) -> dict[str, object]:
    """Run one trace through one mode; per-request first-token times are filled in."""
    params = params or EngineParams()
    fleet = Fleet(backends, params)
    cap = params.max_num_seqs
    batcher = (
        Batcher(BUCKET_SETTINGS, 1024, predictive=(mode == "predictive"))
        if mode in ("fixed", "predictive")
        else None
    )
    sched = (  # the gateway's defaults: in_flight_per_seq 1.0, max_queue_wait_s 10 s
        Scheduler(cap * backends, 1024, max_wait_s=queue_timeout_s)
        if mode == "admission"
        else None
    )
    granted: dict[int, float] = {}
    # the batcher modes read service and arrival rates as the gateway does: from the
    # admission scheduler, which then bounds nothing (gateway.flow.admission with batcher.enabled)
    tracker = Scheduler(None, 1024) if batcher is not None else None
    fparams = (
        ForecastParams(season_s=season_s, season_bins=24) if season_s else ForecastParams()
    )
    forecasters = [HoltWinters(fparams) for _ in range(3)]
    arrivals_now = [0, 0, 0]
    # engine request id -> (client requests, backend, unit id); unit id -> outstanding count
    units: dict[int, list[Req]] = {}
    units_first: dict[int, Req] = {}
    unit_left: dict[int, int] = {}
    unit_backend: dict[int, int] = {}
    eng_to_unit: dict[str, int] = {}
    upstream = {"emb_units": 0, "emb_clients": 0}
    recent_ttft: deque[tuple[float, float]] = deque()
    next_unit = 0
    seq = 0

    def submit(unit: list[Req], b: int, now: float) -> None:
        nonlocal next_unit
        uid = next_unit
        next_unit += 1
        units[uid] = unit
        units_first[uid] = unit[0]
        unit_left[uid] = len(unit)
        unit_backend[uid] = b
        fleet.in_flight[b] += 1  # a place per upstream request (as the gateway counts)
        if unit[0].kind == "emb":
            upstream["emb_units"] += 1
            upstream["emb_clients"] += len(unit)
        for r in unit:
            eid = f"{r.rid}"
            eng_to_unit[eid] = uid
            # random token ids: no prefix-cache luck
            toks = [(r.rid * 7919 + k * 104729) % 50_000 + 5 for k in range(r.prompt)]
            fleet.engines[b].submit(EngineRequest(eid, toks, r.max_tokens), now)

    def bind_factory(now: float):  # type: ignore[no-untyped-def]
        def bind(unit: list[Item]) -> int:
            room = [i for i in range(backends) if fleet.in_flight[i] < cap]
            b = fleet.least_loaded(room)
            if b is None:
                return 0
            submit([it.handle for it in unit], b, now)
            return len(unit)

        return bind

    def pump(now: float) -> None:
        assert batcher is not None
        while batcher.dispatch(now, bind_factory(now)):
            pass

    deadlines: list[tuple[float, int, Item]] = []
    queued_items: dict[int, Item] = {}
    i = 0
    now = 0.0
    next_tick = 1.0
    while True:
        nxt = [trace[i].at] if i < len(trace) else []
        for e in fleet.engines:
            t = e.next_event_time()
            if t is not None:
                nxt.append(t)
        if batcher is not None:
            due = batcher.next_due_at()
            if due is not None:
                nxt.append(max(due, now))
        if deadlines:
            nxt.append(deadlines[0][0])
        if not nxt:
            break
        now = min(nxt)
        if until is not None and now > until:
            break
        while next_tick <= now:  # forecaster ticks (1 s)
            for p in range(3):
                forecasters[p].observe(next_tick, arrivals_now[p])
                if batcher is not None:
                    f = forecasters[p].forecast()
                    batcher.set_rate(p, RateView(f.rate, f.low, f.high))
                arrivals_now[p] = 0
            while recent_ttft and recent_ttft[0][0] < next_tick - 30:
                recent_ttft.popleft()
            if batcher is not None and len(recent_ttft) >= 20:
                vals = sorted(v for _, v in recent_ttft)
                batcher.set_slack(slo_ttft_s - vals[int(0.99 * (len(vals) - 1))])
            next_tick += 1.0
        for b, e in enumerate(fleet.engines):
            t = e.next_event_time()
            if t is None or t > now:
                continue
            for ev in e.advance(now):
                uid = eng_to_unit[ev.request_id]
                r = next(x for x in units[uid] if f"{x.rid}" == ev.request_id)
                if ev.new_token and ev.num_tokens == 1:
                    r.first_token = ev.time
                    recent_ttft.append((ev.time, ev.time - r.at))
                if ev.finish_reason is not None:
                    unit_left[uid] -= 1
                    if unit_left[uid] == 0:
                        size = len(units[uid])
                        fleet.in_flight[unit_backend[uid]] -= 1
                        del units[uid], unit_left[uid], unit_backend[uid]
                        if tracker is not None:
                            for _ in range(size):
                                tracker.release(now)
                        if sched is not None:
                            first = units_first.pop(uid)
                            waiter = sched.release(now, now - granted.pop(first.rid, now),
                                                   prio=Prio(first.prio))
                            if waiter is not None:
                                granted[waiter.rid] = now  # type: ignore[attr-defined]
                                b = fleet.least_loaded(list(range(backends)))
                                submit([waiter], b, now)  # type: ignore[list-item,arg-type]
                    del eng_to_unit[ev.request_id]
        while i < len(trace) and trace[i].at <= now:
            r = trace[i]
            i += 1
            arrivals_now[r.prio] += 1
            if sched is not None:
                verdict = sched.offer(Prio(r.prio), now)
                if verdict.action == "run":
                    b = fleet.least_loaded(list(range(backends)))
                    granted[r.rid] = now
                    submit([r], b, r.at)  # type: ignore[arg-type]
                elif verdict.action == "queue":
                    sched.enqueue(Prio(r.prio), r)
                    seq += 1
                    heapq.heappush(deadlines, (r.at + queue_timeout_s, seq, r))  # type: ignore[arg-type]
                else:
                    evicted = sched.evict_lowest(Prio(r.prio))
                    if evicted is None:
                        r.rejected = True
                    else:
                        evicted.rejected = True  # type: ignore[attr-defined]
                        sched.enqueue(Prio(r.prio), r)
            elif batcher is None:
                b = fleet.least_loaded(list(range(backends)))
                assert b is not None
                submit([r], b, r.at)
            else:
                assert tracker is not None
                tracker.offer(Prio(r.prio), now)
                if batcher.blocked:  # the predicted-wait refusal of gateway.flow.batching
                    left = tracker.service_rate(now) - tracker.rate_above(Prio(r.prio), now)
                    if left > 0 and (batcher.queued_ahead(r.prio) + 1) / left > queue_timeout_s:
                        r.rejected = True
                        tracker.release(now)
                        continue
                if not batcher.admits(r.prio):
                    full = batcher.queued >= batcher.max_queued
                    evicted = batcher.evict_lowest(r.prio) if full else None
                    if evicted is None:
                        r.rejected = True
                        continue
                    evicted.handle.rejected = True
                item = Item(r.prio, "m", r.at, "emb" if r.kind == "emb" else None, r)
                batcher.enqueue(item)
                queued_items[r.rid] = item
                seq += 1
                heapq.heappush(deadlines, (r.at + queue_timeout_s, seq, item))
                pump(now)
        if sched is not None:
            while deadlines and deadlines[0][0] <= now:
                _, _, req = heapq.heappop(deadlines)
                before = sched.queued
                sched.cancel(Prio(req.prio), req)  # type: ignore[attr-defined]
                if sched.queued < before:
                    req.rejected = True  # type: ignore[attr-defined]
        if batcher is not None:
            pump(now)  # a freed slot, a bucket's wait ending
            while deadlines and deadlines[0][0] <= now:
                _, _, item = heapq.heappop(deadlines)
                if batcher.cancel(item):
                    item.handle.rejected = True
    return summarise(trace, upstream, slo_ttft_s)


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    v = sorted(values)
    return v[max(0, min(len(v) - 1, math.ceil(q * len(v)) - 1))]


def summarise(trace: list[Req], upstream: dict[str, int], slo: float) -> dict[str, object]:
    duration = max(r.at for r in trace) if trace else 1.0
    out: dict[str, object] = {}
    for p, name in enumerate(("high", "normal", "low")):
        ttft = [r.first_token - r.at for r in trace if r.kind == "chat" and r.prio == p
                and r.first_token is not None]
        out[f"ttft_p50_{name}_s"] = pct(ttft, 0.5)
        out[f"ttft_p99_{name}_s"] = pct(ttft, 0.99)
    emb = [r.first_token - r.at for r in trace if r.kind == "emb" and r.first_token is not None]
    out["emb_latency_p50_s"] = pct(emb, 0.5)
    good = sum(1 for r in trace if r.first_token is not None and r.first_token - r.at <= slo)
    out["goodput_rps"] = good / duration
    out["offered_rps"] = len(trace) / duration
    out["rejected_pct"] = 100.0 * sum(r.rejected for r in trace) / max(1, len(trace))
    out["unfinished_pct"] = 100.0 * sum(
        r.first_token is None and not r.rejected for r in trace
    ) / max(1, len(trace))
    out["emb_upstream_per_client"] = (
        upstream["emb_units"] / upstream["emb_clients"] if upstream["emb_clients"] else None
    )
    return out


def capacity(backends: int, params: EngineParams, seed: int = 1, duration: float = 60.0) -> float:
    """Requests/s the fleet completes under sustained overload (FIFO), from the second half
    of a run offered far more than it can take."""
    trace = make_trace(Workload("flat", lambda t: 150.0 * backends / 4), duration, seed)
    simulate(trace, "off", backends, params, until=duration)
    done = [r for r in trace if r.first_token is not None]
    # completions are not recorded; the first-token rate in the window is the service rate
    lo, hi = duration / 2, duration
    served = [r for r in done if lo <= r.first_token < hi]  # type: ignore[operator]
    return len(served) / (hi - lo)
