"""A fast, request-granular model of one vLLM engine for the fleet simulator (pure).

:class:`gateway.sim.engine.Engine` steps token by token: exact, but a 24-hour run of 16
backends would be some 70 million steps. :class:`BatchEngine` keeps the same cost model
(:class:`gateway.sim.engine.EngineParams`: ``itl_base_s``, ``itl_per_seq_s``,
``prefill_*``, ``max_num_seqs``, ``speed``) and moves from event to event (an admission,
a first token, a completion) instead of from step to step:

* continuous batching as a fluid: while ``n`` requests run, each gains
  ``clock / decode_time_s(n)`` tokens per second, where ``clock`` (<= 1) is the slowdown
  a slower SM clock imposes on a decode step (:func:`gateway.sim.thermal.step_time_factor`,
  set from outside);
* a request admitted (FCFS, while fewer than ``max_num_seqs`` run and its prompt plus its
  output fit in the free KV-cache tokens) stalls the whole batch for its prefill
  (``prefill_time_s(prompt) / prefill_clock``, no chunked prefill, as the token-level engine;
  ``prefill_clock`` <= 1 is the prefill slowdown of a slower SM clock, set from outside:
  :func:`gateway.sim.thermal.prefill_time_factor`);
* its first token comes one token of progress after admission and the prefill, its last
  ``output_tokens`` later; TTFT and the mean inter-token latency (TPOT) follow.

Simplifications (documented, on purpose): KV space is reserved for the whole request at
admission, so there is no preemption; no prefix cache. Progress is tracked with one
virtual counter ``V`` (tokens produced per running sequence since start), so an event
costs O(log n) whatever the batch size.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from gateway.sim.engine import EngineParams

_EPS = 1e-9


@dataclass(slots=True, eq=False)
class SimRequest:
    """One request through the fleet: sizes in tokens, times in seconds (sim clock).

    Filled in as it goes: ``backend`` (index), ``admitted_at``, ``first_token_at``,
    ``finished_at``; ``rejected`` when admission refused it.
    """

    arrival: float
    prompt_tokens: int
    output_tokens: int
    backend: int = -1
    admitted_at: float = -1.0
    first_token_at: float = -1.0
    finished_at: float = -1.0
    rejected: bool = False
    v_start: float = 0.0

    @property
    def ttft_s(self) -> float:
        """Time to first token (s); -1 before it."""
        return self.first_token_at - self.arrival if self.first_token_at >= 0 else -1.0

    @property
    def tpot_s(self) -> float:
        """Mean inter-token latency (s) over the request's decode; 0 for one token."""
        if self.output_tokens <= 1 or self.finished_at < 0:
            return 0.0
        return (self.finished_at - self.first_token_at) / (self.output_tokens - 1)


class BatchEngine:
    """Event-driven fluid model of one engine (see the module docstring).

    Call :meth:`advance` with non-decreasing times; it returns the requests finished up
    to then. :meth:`next_event_time` says when the next completion or admission happens
    if nothing changes (None when idle). ``on_first_token`` (None by default): called
    with a request when the engine, advancing, passes its first token (its
    ``first_token_at`` set), so a watcher of TTFT (the autoscaling simulator's window of
    first tokens) sees it when it happens rather than at completion.
    """

    def __init__(self, params: EngineParams) -> None:
        self.params = params
        self.clock = 1.0  # step-time slowdown divisor: rate = clock / decode_time_s(n)
        self.prefill_clock = 1.0  # prefill slowdown divisor: stall = prefill_time_s / this
        self.t = 0.0
        self.v = 0.0
        self.stall_until = 0.0
        self.waiting: deque[SimRequest] = deque()
        self._done: list[tuple[float, int, SimRequest]] = []  # (finish V, seq, req)
        self._first: list[tuple[float, int, SimRequest]] = []  # (first-token V, seq, req)
        self._seq = itertools.count()
        self.kv_reserved = 0
        self._prompt_running = 0
        self._vstart_running = 0.0
        # cumulative
        self.busy_s = 0.0
        self.occupancy_s = 0.0  # integral of running / max_num_seqs over busy time
        self.tokens_out = 0
        self.finished = 0  # requests completed (vLLM's ``vllm:request_success_total``)
        self.on_first_token: Callable[[SimRequest], None] | None = None

    # ------------------------------------------------------------------ state
    @property
    def num_running(self) -> int:
        return len(self._done)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def in_flight(self) -> int:
        """Requests on this engine, running or waiting."""
        return len(self._done) + len(self.waiting)

    def kv_usage(self) -> float:
        """KV-cache tokens held (prompts plus tokens generated so far) over capacity, 0-1."""
        n = len(self._done)
        used = self._prompt_running + n * self.v - self._vstart_running
        return min(1.0, max(0.0, used / self.params.kv_cache_tokens))

    def rate(self) -> float:
        """Tokens per second per running sequence now (0 when idle)."""
        n = len(self._done)
        if not n:
            return 0.0
        return self.clock / self.params.decode_time_s(n)

    # ----------------------------------------------------------------- inputs
    def submit(self, req: SimRequest, now: float) -> list[SimRequest]:
        """Queue ``req`` at ``now``; returns requests that finished before ``now``."""
        out = self.advance(now)
        self.waiting.append(req)
        self._admit(self.t)
        return out

    def next_event_time(self) -> float | None:
        """Time of the next completion if nothing changes, or None when idle."""
        if not self._done:
            return None
        r = self.rate()
        start = max(self.t, self.stall_until)
        return start + max(0.0, self._done[0][0] - self.v) / r

    # ---------------------------------------------------------------- driving
    def advance(self, now: float) -> list[SimRequest]:
        """Move to ``now``; return the requests finished meanwhile (in finish order)."""
        finished: list[SimRequest] = []
        done = self._done
        while True:
            if done and done[0][0] <= self.v + _EPS:  # completions due now
                while done and done[0][0] <= self.v + _EPS:
                    _, _, req = heapq.heappop(done)
                    self._release(req, self.t)
                    finished.append(req)
                self._admit(self.t)
                continue
            if self.t >= now:
                break
            n = len(done)
            if not n:
                self.t = now
                break
            r = self.clock / self.params.decode_time_s(n)
            start = max(self.t, self.stall_until)
            t_done = start + max(0.0, done[0][0] - self.v) / r
            end = min(now, t_done)
            span = end - self.t
            self.busy_s += span
            self.occupancy_s += span * n / self.params.max_num_seqs
            v_end = self.v + max(0.0, end - start) * r
            if end == t_done:
                v_end = max(v_end, done[0][0])  # land exactly on the completion
            first = self._first
            while first and first[0][0] <= v_end + _EPS:
                fv, _, req = heapq.heappop(first)
                seen = req.first_token_at >= 0
                req.first_token_at = start + max(0.0, fv - self.v) / r
                if not seen and self.on_first_token is not None:
                    self.on_first_token(req)
            self.v = v_end
            self.t = end
        return finished

    # -------------------------------------------------------------- internals
    def _release(self, req: SimRequest, t: float) -> None:
        req.finished_at = t
        if req.first_token_at < 0:
            req.first_token_at = t
            if self.on_first_token is not None:
                self.on_first_token(req)
        self.kv_reserved -= req.prompt_tokens + req.output_tokens
        self._prompt_running -= req.prompt_tokens
        self._vstart_running -= req.v_start
        self.tokens_out += req.output_tokens
        self.finished += 1

    def _admit(self, t: float) -> None:
        p = self.params
        cap = p.kv_cache_tokens
        while self.waiting and len(self._done) < p.max_num_seqs:
            req = self.waiting[0]
            need = req.prompt_tokens + req.output_tokens
            if self._done and self.kv_reserved + need > cap:
                break  # FCFS head-of-line blocking, as vLLM
            self.waiting.popleft()
            req.admitted_at = t
            stall = p.prefill_time_s(req.prompt_tokens) / self.prefill_clock
            self.stall_until = max(self.stall_until, t) + stall
            req.v_start = self.v
            k = next(self._seq)
            heapq.heappush(self._first, (self.v + 1.0, k, req))
            heapq.heappush(self._done, (self.v + max(1, req.output_tokens), k, req))
            self.kv_reserved += need
            self._prompt_running += req.prompt_tokens
            self._vstart_running += self.v
