"""What one backend can serve: its concurrency and service rate, learned from its scrapes (pure).

vLLM runs at most ``max_num_seqs`` requests at once (fewer when its KV cache is short) and
queues the rest FCFS (``vllm:num_requests_waiting``). A queue inside vLLM is how vLLM
works, not an overload: what matters to a client is how long a new request would wait
before its prefill starts. That wait follows from two figures the gateway can learn from
every backend's ``/metrics`` without being told:

* **concurrency** ``c`` (sequences it runs at once): ``backends[].max_num_seqs`` when
  configured (the server's total: per-engine value times its data-parallel size); else the
  plateau of ``vllm:num_requests_running`` while requests wait (when a queue exists the
  engine runs all it can, so the running count *is* its concurrency then, including a
  KV-cache limit), never below what it just ran; else the most it was seen running;
* **service time** ``S`` (seconds a request holds a sequence slot): by Little's law on the
  running set, ``S = mean(running) / completion rate`` over a window (corrected for the
  requests cut by the window's edges), the completions
  counted by ``vllm:request_success_total`` (all finish reasons: an aborted request frees
  its slot too). Kept as an EWMA across windows, so an idle spell keeps the last value.

A step of vLLM takes longer the more sequences it holds (barely on a GPU, where decode is
memory-bound; nearly in proportion on a CPU), so the service time is also fitted against
the batch size, ``S(n) = a + b n`` (:meth:`ServiceModel.service_at`), and read at the
batch the question is about. The **service rate** at full concurrency is
``mu = c / S(c)`` requests per second (Little's law again; in saturation it equals the
measured completion rate), and the **predicted
queue wait** of one more request is the work ahead of it over that rate:
``(waiting + 1) / mu`` seconds while a queue exists (an M/D/c-style fluid estimate: the
queue drains at ``mu``; Kleinrock, *Queueing Systems* vol. 1, 2.1 and 3.5); without a queue
it is 0, whatever the batch. The admission
gate sheds by that wait against the TTFT SLO (:func:`gateway.traffic.admission.wait_level`)
and the lifecycle asks whether the other backends' ``mu`` can carry the load before a cycle
takes one out (:func:`gateway.fleet.lifecycle.can_carry_without`).

Everything here is a pure function of the samples passed in (monotonic seconds); the
controller owns one :class:`ServiceModel` per backend and is the only writer.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

PLATEAU_SAMPLES = 64  # scrapes with a queue the concurrency is the most of
BIN_HALF_LIFE_S = 600.0  # how fast old (batch size, completions) evidence fades
MAX_BIN_INTERVAL_S = 5.0  # a longer gap between two scrapes is not booked
MIN_BIN_COMPLETIONS = 8.0  # completions a batch size needs before it is fitted


@dataclass(frozen=True, slots=True)
class EngineSample:
    """One scrape's figures for the service model.

    ``at``: monotonic seconds; ``waiting``/``running``: request counts; ``finished``: the
    ``vllm:request_success_total`` counter summed over finish reasons (None when the backend
    does not export it)."""

    at: float
    waiting: float
    running: float
    finished: float | None = None


class ServiceModel:
    """Concurrency and service rate of one backend, learned from :class:`EngineSample` s.

    ``configured``: ``max_num_seqs`` from the config (None: learn it). ``window_s``: the
    span (seconds) over which the completion rate and mean running count are taken;
    ``min_completions``: completions a window needs before it updates the service time;
    ``alpha``: the EWMA weight of a new window's service time.
    """

    def __init__(
        self,
        configured: int | None = None,
        window_s: float = 15.0,
        min_completions: int = 4,
        alpha: float = 0.3,
    ) -> None:
        self.configured = configured
        self.window_s = window_s
        self.min_completions = min_completions
        self.alpha = alpha
        self._samples: deque[EngineSample] = deque()
        self.plateau: float | None = None  # running count seen while requests waited
        self._saturated: deque[float] = deque(maxlen=PLATEAU_SAMPLES)
        self.max_running = 0.0  # the most it was ever seen running
        self.service_s: float | None = None  # EWMA of the time a request holds a slot
        # batch size k (running, rounded, over one scrape interval) -> [completions,
        # seconds] seen at it, decayed with a BIN_HALF_LIFE_S half-life: how the service
        # time grows with the batch (see service_at)
        self._bins: dict[int, list[float]] = {}
        self.completion_rate = 0.0  # completions per second over the last window

    # ---- learning -------------------------------------------------------------------------
    def observe(self, s: EngineSample) -> None:
        """Add one scrape. A counter that went down (a restarted server) starts afresh."""
        q = self._samples
        if q and (s.at <= q[-1].at):
            return
        if (
            q
            and s.finished is not None
            and q[-1].finished is not None
            and s.finished < q[-1].finished
        ):
            q.clear()
            self._bins.clear()
        if q:
            self._bin(q[-1], s)
        q.append(s)
        while len(q) > 2 and q[1].at <= s.at - self.window_s:
            q.popleft()
        self.max_running = max(self.max_running, s.running)
        if s.waiting >= 1 and s.running >= 1:
            # a queue exists: the engine runs all it can now (max_num_seqs, or what the
            # KV cache allows). The most of the last PLATEAU_SAMPLES such scrapes: one taken
            # between a finish and the next admission reads one short, and a KV limit that
            # lasts lowers it
            self._saturated.append(s.running)
            self.plateau = max(self._saturated)
        self._update_service()

    def _update_service(self) -> None:
        q = self._samples
        first, last = q[0], q[-1]
        span = last.at - first.at
        if span <= 0 or first.finished is None or last.finished is None:
            return
        done = last.finished - first.finished
        self.completion_rate = done / span
        if done < self.min_completions:
            return
        busy = _time_mean_running(q) * span  # request-seconds of running in the window
        # Little's law on a finite window: the requests running at its start ran part of
        # their time before it, those running at its end part after it; with uniform
        # residuals each counts for half a request (busy = S x (done + (R_end - R_start)/2))
        served = done + (last.running - first.running) / 2
        if busy <= 0 or served < self.min_completions / 2:
            return
        s = busy / served
        a = self.alpha
        self.service_s = s if self.service_s is None else (1 - a) * self.service_s + a * s

    def _bin(self, prev: EngineSample, s: EngineSample) -> None:
        """Book one scrape interval's completions under its batch size."""
        dt = s.at - prev.at
        if prev.finished is None or s.finished is None or not 0 < dt <= MAX_BIN_INTERVAL_S:
            return
        # the batch at the interval's start: the interval's completions come from it (its
        # mean or end would book them under the smaller batch they leave behind)
        k = round(prev.running)
        if k < 1:
            return
        keep = 0.5 ** (dt / BIN_HALF_LIFE_S)
        for acc in self._bins.values():
            acc[0] *= keep
            acc[1] *= keep
        acc = self._bins.setdefault(k, [0.0, 0.0])
        acc[0] += max(0.0, s.finished - prev.finished)
        acc[1] += dt

    def service_at(self, n: float) -> float | None:
        """The service time (seconds) a request would have at a batch of ``n`` running
        requests. A step of vLLM takes longer the more sequences it holds (decode is
        memory-bound on a GPU, so barely; on a CPU, nearly in proportion), so the service
        time is fitted as ``S(n) = a + b n`` and read at ``n``: every scrape interval books
        its completions and seconds under its batch size ``k`` (the running count at its
        start), Little's
        law gives ``S(k) = k x seconds / completions`` per batch size, and a least-squares
        line weighted by completions goes through them (slope never below 0; through the
        origin when the intercept would be negative). Needs 3 batch sizes with at least
        :data:`MIN_BIN_COMPLETIONS` completions each, spread over 2 or more; without them
        the EWMA :attr:`service_s`. None before any service time is known.

        Checked on a simulated engine (0.5 s scrapes, Poisson arrivals, services shorter
        than a scrape interval): the capacity it implies is 10% under the truth at 60%
        load for a CPU-like ``S(n) = 0.1 + 0.02 n``, within 2% at 90%, and 25% under for a
        GPU-like flat one: an error toward deferring maintenance, never toward taking out
        capacity the load needs."""
        fit = self._fit()
        if fit is None:
            return self.service_s
        a, b = fit
        return max(a + b * n, 1e-6)

    def _fit(self) -> tuple[float, float] | None:
        pts = [
            (float(k), k * secs / done, done)
            for k, (done, secs) in self._bins.items()
            if done >= MIN_BIN_COMPLETIONS
        ]
        if len(pts) < 3:
            return None
        xs = [p[0] for p in pts]
        if max(xs) - min(xs) < 2:
            return None
        w = sum(p[2] for p in pts)
        mx = sum(p[0] * p[2] for p in pts) / w
        my = sum(p[1] * p[2] for p in pts) / w
        sxx = sum(p[2] * (p[0] - mx) ** 2 for p in pts)
        sxy = sum(p[2] * (p[0] - mx) * (p[1] - my) for p in pts)
        b = max(0.0, sxy / sxx) if sxx > 0 else 0.0
        a = my - b * mx
        if a < 0:  # all of it grows with the batch: a line through the origin
            a = 0.0
            b = sum(p[2] * p[0] * p[1] for p in pts) / sum(p[2] * p[0] ** 2 for p in pts)
        return a, b

    # ---- what admission and the lifecycle read --------------------------------------------
    @property
    def concurrency(self) -> float | None:
        """Sequences it runs at once: configured, else the larger of the learned plateau
        and the most it ran within the last window (a plateau read in a passing moment,
        say a chunked-prefill ramp, never caps what it was just seen doing); None before it
        ran anything."""
        if self.configured:
            return float(self.configured)
        recent = max((s.running for s in self._samples), default=0.0)
        best = max(self.plateau or 0.0, recent)
        return best if best >= 1 else None

    @property
    def ceiling(self) -> float | None:
        """Sequences it can run at once, for capacity planning (may the others carry the
        load while one is out?): configured, else the larger of the plateau and the most it
        was ever seen running. Evidence only: a backend never seen saturated is judged by
        what it did, not by what vLLM might allow (set ``backends[].max_num_seqs`` to plan
        with the real bound); None before it ran anything."""
        if self.configured:
            return float(self.configured)
        best = max(self.plateau or 0.0, self.max_running)
        return best if best >= 1 else None

    @property
    def capacity_rps(self) -> float | None:
        """Requests per second it could serve at :attr:`ceiling`, ``ceiling / S(ceiling)``
        (:meth:`service_at`; None until a service time and a ceiling are known)."""
        c = self.ceiling
        if c is None:
            return None
        s = self.service_at(c)
        return None if not s else c / s

    @property
    def service_rate(self) -> float | None:
        """Requests per second at its known concurrency, ``c / S`` with the service time
        measured now (:attr:`service_s`; None until learned): what its queue drains at
        while it is full, for the admission gate's predicted wait."""
        c = self.concurrency
        if c is None or not self.service_s:
            return None
        return c / self.service_s

    def predicted_wait(self, waiting: float, running: float) -> float:
        """Seconds a new request would wait in this backend's queue before it runs, given
        its (corrected) ``waiting`` and ``running`` counts: with a queue the engine is full,
        so the request is ``waiting + 1``-th in line and the line moves at the service rate
        ``mu`` (:attr:`service_rate`): ``(waiting + 1) / mu``. 0 without a queue (vLLM
        admits it at its next step; a configured ``max_num_seqs`` already turns the
        gateway's arrivals beyond it into ``waiting``, :func:`gateway.routing.policy.
        estimated_load`) and while nothing is learned (no evidence of overload is no
        overload; a backend that stopped is the liveness watchdog's to judge,
        :mod:`gateway.fleet.liveness`)."""
        if waiting <= 0:
            return 0.0
        mu = self.service_rate
        if mu is None:
            return 0.0
        return (waiting + 1) / mu


def _time_mean_running(q: deque[EngineSample]) -> float:
    """Time-weighted mean of the running count over the samples (trapezoids)."""
    total = 0.0
    span = 0.0
    prev: EngineSample | None = None
    for s in q:
        if prev is not None:
            dt = s.at - prev.at
            total += dt * (prev.running + s.running) / 2
            span += dt
        prev = s
    return total / span if span > 0 else q[-1].running
