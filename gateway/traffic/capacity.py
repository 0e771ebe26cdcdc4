"""What one backend can serve: its concurrency and service rate, learned from its scrapes (pure).

vLLM runs at most ``max_num_seqs`` requests at once (fewer when its KV cache is short) and
queues the rest FCFS (``vllm:num_requests_waiting``). A queue inside vLLM is how vLLM
works, not an overload: what matters to a client is how long a new request would wait
before its prefill starts. That wait follows from two figures the gateway can learn from
every backend's ``/metrics`` without being told:

* **concurrency** ``c`` (sequences it runs at once): ``backends[].max_num_seqs`` when
  configured; else the plateau of ``vllm:num_requests_running`` while requests wait (when
  a queue exists the engine runs all it can, so the running count *is* its concurrency
  then, including a KV-cache limit); else the most it was ever seen running (a lower bound);
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
``max(0, waiting + running + 1 - c) / mu`` seconds (an M/D/c-style fluid estimate: the
queue drains at ``mu``; Kleinrock, *Queueing Systems* vol. 1, 2.1 and 3.5). The admission
gate sheds by that wait against the TTFT SLO (:func:`gateway.traffic.admission.wait_level`)
and the lifecycle asks whether the other backends' ``mu`` can carry the load before a cycle
takes one out (:func:`gateway.fleet.lifecycle.can_carry_without`).

Everything here is a pure function of the samples passed in (monotonic seconds); the
controller owns one :class:`ServiceModel` per backend and is the only writer.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

# vLLM's default ``--max-num-seqs`` (EngineArgs; vLLM docs, "Engine Arguments"): the bound a
# server never seen saturated is assumed to have for capacity planning
VLLM_DEFAULT_MAX_NUM_SEQS = 256
MAX_POINTS = 180  # (batch, service time) points kept: 15 min at one per 5 s


@dataclass(frozen=True, slots=True)
class EngineSample:
    """One scrape's figures for the service model.

    ``at``: monotonic seconds; ``waiting``/``running``: request counts; ``finished``: the
    ``vllm:request_success_total`` counter summed over finish reasons (None when the backend
    does not export it); ``kv_max_concurrency``: ``kv_cache_max_concurrency`` of
    ``vllm:cache_config_info`` (requests of full model length the KV cache holds; None when
    absent)."""

    at: float
    waiting: float
    running: float
    finished: float | None = None
    kv_max_concurrency: float | None = None


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
        self.max_running = 0.0  # the most it was ever seen running
        self.service_s: float | None = None  # EWMA of the time a request holds a slot
        # (mean running, service time) of past windows, one every window_s / 3: how the
        # service time grows with the batch (see service_at)
        self._points: deque[tuple[float, float]] = deque(maxlen=MAX_POINTS)
        self._point_at = -math.inf
        self.completion_rate = 0.0  # completions per second over the last window
        self.kv_max_concurrency: float | None = None

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
        q.append(s)
        while len(q) > 2 and q[1].at <= s.at - self.window_s:
            q.popleft()
        if s.kv_max_concurrency is not None and s.kv_max_concurrency > 0:
            self.kv_max_concurrency = s.kv_max_concurrency
        self.max_running = max(self.max_running, s.running)
        if s.waiting >= 1 and s.running >= 1:
            # a queue exists: the engine runs all it can now (max_num_seqs, or what the
            # KV cache allows); follow it both ways (a KV limit can lower it)
            self.plateau = s.running if self.plateau is None else max(
                s.running, 0.8 * self.plateau + 0.2 * s.running
            )
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
        if last.at - self._point_at >= self.window_s / 3:
            self._point_at = last.at
            self._points.append((busy / span, s))

    def service_at(self, n: float) -> float | None:
        """The service time (seconds) a request would have at a batch of ``n`` running
        requests. A step of vLLM takes longer the more sequences it holds (decode is
        memory-bound on a GPU, so barely; on a CPU, nearly in proportion), so the service
        time is fitted as ``S(n) = a + b n`` (least squares over the windows seen, slope
        never below 0, Little's law at each point; through the origin when the intercept
        would be negative) and read at ``n``. Without enough spread in the batch sizes seen
        to fit a slope (under 6 windows, or batches within 20% of one another, at least
        1 request apart), the EWMA :attr:`service_s`. None before any service time is
        known."""
        fit = self._fit()
        if fit is None:
            return self.service_s
        a, b = fit
        return max(a + b * n, 1e-6)

    def _fit(self) -> tuple[float, float] | None:
        pts = self._points
        if len(pts) < 6:
            return None
        xs = [p[0] for p in pts]
        lo, hi = min(xs), max(xs)
        if hi - lo < max(1.0, 0.2 * hi):
            return None
        n = len(pts)
        mx = sum(xs) / n
        my = sum(p[1] for p in pts) / n
        sxx = sum((x - mx) ** 2 for x in xs)
        sxy = sum((x - mx) * (p[1] - my) for x, p in zip(xs, pts, strict=True))
        b = max(0.0, sxy / sxx) if sxx > 0 else 0.0
        a = my - b * mx
        if a < 0:  # all of it grows with the batch: through the origin
            b, a = sum(p[1] * x for x, p in zip(xs, pts, strict=True)) / sum(
                x * x for x in xs
            ), 0.0
        return a, b

    # ---- what admission and the lifecycle read --------------------------------------------
    @property
    def concurrency(self) -> float | None:
        """Sequences it runs at once: configured, else the learned plateau, else the most
        seen running (None before it ran anything)."""
        if self.configured:
            return float(self.configured)
        if self.plateau is not None:
            return max(1.0, self.plateau)
        return self.max_running if self.max_running >= 1 else None

    @property
    def ceiling(self) -> float:
        """Sequences it can run at once, for capacity planning (the lifecycle asking whether
        the others can carry the load): the known :attr:`concurrency` when configured or
        learned from a plateau; else, never saturated, vLLM's own bound as far as it tells
        it (``kv_cache_max_concurrency``) or vLLM's default ``max_num_seqs``
        (:data:`VLLM_DEFAULT_MAX_NUM_SEQS`), never below what it was seen running. Optimistic
        only while no load has filled it, and the first queue teaches the real value."""
        if self.configured:
            return float(self.configured)
        if self.plateau is not None:
            return max(1.0, self.plateau)
        assumed = self.kv_max_concurrency or VLLM_DEFAULT_MAX_NUM_SEQS
        return max(self.max_running, min(assumed, VLLM_DEFAULT_MAX_NUM_SEQS))

    @property
    def capacity_rps(self) -> float | None:
        """Requests per second it could serve at :attr:`ceiling`, ``ceiling / S(ceiling)``
        (:meth:`service_at`; None until a service time is learned)."""
        c = self.ceiling
        s = self.service_at(c)
        return None if not s else c / s

    @property
    def service_rate(self) -> float | None:
        """Requests per second at its known concurrency, ``c / S(c)`` (None until
        learned)."""
        c = self.concurrency
        if c is None:
            return None
        s = self.service_at(c)
        return None if not s else c / s

    def predicted_wait(self, waiting: float, running: float) -> float:
        """Seconds a new request would wait in this backend's queue before it runs, given
        its (corrected) ``waiting`` and ``running`` counts: ``max(0, waiting + running + 1
        - c) / mu``. 0 when it would run at once or nothing is learned yet (no evidence of
        overload is no overload); ``inf`` when requests wait and it finishes none."""
        c = self.concurrency
        if waiting <= 0 and (c is None or running + 1 <= c):
            return 0.0
        ahead = waiting + 1 if c is None else max(0.0, waiting + running + 1 - c)
        if ahead <= 0:
            return 0.0
        mu = self.service_rate
        if mu is None:
            if self.service_s is None and self.completion_rate <= 0 and self._stuck():
                return math.inf
            return 0.0
        return ahead / mu

    def _stuck(self) -> bool:
        """Requests waited through a whole window and none finished (counters known)."""
        q = self._samples
        if len(q) < 2 or q[0].finished is None or q[-1].finished is None:
            return False
        return (
            q[-1].at - q[0].at >= self.window_s * 0.9
            and q[-1].finished == q[0].finished
            and all(s.waiting >= 1 for s in q)
        )


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
