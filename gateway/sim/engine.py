"""A pure, deterministic model of one vLLM engine (scheduler + KV cache + prefix cache).

No asyncio, no I/O, no wall clock: every method takes the current time ``now`` in
seconds (any monotonic origin) so that a fleet simulator can drive many engines
faster than real time, and the asyncio server can drive one in real time.

What is modelled, after vLLM v1's scheduler (``vllm/v1/core/sched/scheduler.py``) and
KV-cache manager (``vllm/v1/core/kv_cache_manager.py``, ``block_pool.py``):

* Continuous batching. One engine *step* runs every running request; each running
  request emits exactly one token per step. Waiting requests are admitted FCFS at the
  start of a step while ``running < max_num_seqs`` and enough KV blocks are free for
  ``prompt + 1`` tokens (head-of-line blocking: the first request that does not fit
  stops admission, as in vLLM's FCFS policy).
* Step duration (seconds), a linear cost model of the kind fitted to vLLM by
  simulators such as Vidur (Agrawal et al., MLSys 2024)::

      step = (itl_base_s + itl_per_seq_s * batch_size
              + sum over requests admitted in this step of
                (prefill_base_s + prefill_per_token_s * uncached_prompt_tokens)) / speed

  so inter-token latency grows with the batch and a prefill stalls the whole batch
  (no chunked prefill). A build's step-time factors (``ReleaseConfig``, issue 18: a
  slower release) multiply it: ``ttft_factor`` a step that admits a request (its
  prefill, which ends with its first token), ``itl_factor`` a decode-only step; an
  unloaded request's TTFT and ITL are thus exactly those factors times the default's.
* Paged KV cache and prefix cache: :mod:`gateway.sim.kv_cache` (blocks, chained prompt
  hashes, LRU of cached free blocks). Growth that does not fit preempts the most recently
  admitted request (recompute mode: it returns to the front of the waiting queue and
  re-prefills prompt + generated tokens later), and ``num_preemptions`` counts it.

Its inputs, outputs and per-request state, with vLLM's latency definitions:
:mod:`gateway.sim.engine_types`.
"""

from __future__ import annotations

import math
from collections import deque

from gateway.config import EngineParams as EngineParams  # declared with the config schema
from gateway.sim.engine_types import (
    FINISH_REASONS,
    EngineEvent,
    EngineRequest,
    EngineStats,
    RequestMetrics,
    Seq,
)
from gateway.sim.kv_cache import BlockPool, block_hashes


class Engine:
    """Discrete-event model of one vLLM engine; see the module docstring.

    Drive it with ``submit`` / ``abort`` and by calling ``advance(now)`` whenever
    ``now >= next_event_time()``. All times are seconds on the caller's clock and must
    not go backwards. The same inputs always give the same events.
    """

    def __init__(
        self,
        params: EngineParams | None = None,
        *,
        ttft_factor: float = 1.0,
        itl_factor: float = 1.0,
    ) -> None:
        """``ttft_factor`` / ``itl_factor`` (> 0, 1: the default build) multiply the
        duration of a step that prefills / of a decode-only step (see the module doc)."""
        if not (ttft_factor > 0 and itl_factor > 0):
            raise ValueError("ttft_factor and itl_factor must be > 0")
        self.params = params or EngineParams()
        self.ttft_factor = ttft_factor
        self.itl_factor = itl_factor
        self._pool = BlockPool(self.params.num_blocks)
        self._waiting: deque[Seq] = deque()
        self._running: list[Seq] = []  # admission order
        self._by_id: dict[str, Seq] = {}
        self._now = 0.0
        self._step_end: float | None = None
        self._step_start = 0.0
        self._step_batch: list[Seq] = []
        self._pending_start: float | None = None
        self._finished: deque[RequestMetrics] = deque(maxlen=self.params.max_pending_metrics)
        # counters
        self._prompt_tokens = 0
        self._prompt_cached = 0
        self._gen_tokens = 0
        self._pc_queries = 0
        self._pc_hits = 0
        self._preemptions = 0
        self._success: dict[str, int] = dict.fromkeys(FINISH_REASONS, 0)
        self._client_aborts = 0
        self._steps = 0
        self._busy = 0.0
        # Step-time multipliers set by a GPU model (>= 1 while the SM clock is below its
        # maximum: throttled, power capped or locked lower): decode steps
        # (:func:`gateway.sim.thermal.step_time_factor`) and prefill
        # (:func:`gateway.sim.thermal.prefill_time_factor`).
        self.slowdown = 1.0
        self.prefill_slowdown = 1.0

    # ------------------------------------------------------------------ inputs
    def submit(self, request: EngineRequest, now: float) -> None:
        """Queue ``request`` (arrival at ``now`` seconds) at the back of the waiting queue.

        Raises ``ValueError`` for a duplicate id, ``max_tokens < 1``, or a prompt that
        does not leave room for one output token within ``max_model_len``; a larger
        ``max_tokens`` is clipped to the room left (finish "length"), as vLLM does.
        """
        now = self._clock(now)
        if request.request_id in self._by_id:
            raise ValueError(f"duplicate request id {request.request_id!r}")
        if request.max_tokens < 1:
            raise ValueError("max_tokens must be >= 1")
        if request.num_prompt_tokens + 1 > self.params.max_model_len:
            raise ValueError(
                f"prompt of {request.num_prompt_tokens} tokens leaves no room in "
                f"max_model_len {self.params.max_model_len}"
            )
        hashes = (
            block_hashes(request.prompt_token_ids, self.params.block_size, request.cache_salt)
            if self.params.enable_prefix_caching
            else []
        )
        seq = Seq(req=request, arrival=now, block_hashes=hashes)
        room = self.params.max_model_len - request.num_prompt_tokens
        seq.target = min(request.target_tokens, room)  # vLLM clips max_tokens to the context
        seq.finish = request.natural_finish if request.target_tokens <= room else "length"
        self._by_id[request.request_id] = seq
        self._waiting.append(seq)
        if self._step_end is None and self._pending_start is None:
            self._pending_start = now

    def abort(self, request_id: str, now: float) -> bool:
        """Drop a request because its client went away (no event, no success count).

        Frees its KV blocks at once. Returns False when the id is unknown or finished.
        """
        now = self._clock(now)
        seq = self._by_id.pop(request_id, None)
        if seq is None:
            return False
        if seq.state == "running":
            self._running.remove(seq)
            self._free(seq)
        else:
            self._waiting.remove(seq)
        seq.state = "done"
        self._client_aborts += 1
        return True

    def abort_all(self, now: float) -> list[EngineEvent]:
        """Abort every request on the engine side (as vLLM's ``/sleep`` does).

        Each gets a final event with finish_reason "abort" and counts in
        ``request_success_total{finished_reason="abort"}``, like vLLM.
        """
        now = self._clock(now)
        events: list[EngineEvent] = []
        for seq in [*self._running, *self._waiting]:
            if seq.state == "running":
                self._free(seq)
            self._finish(seq, now, "abort")
            events.append(EngineEvent(seq.req.request_id, now, seq.generated, False, "abort"))
        self._running.clear()
        self._waiting.clear()
        return events

    def reset_prefix_cache(self) -> bool:
        """Forget cached prefix blocks, as vLLM's ``POST /reset_prefix_cache``.

        Like vLLM, refuses (returns False) while any block is held by a request.
        """
        if self._pool.used:
            return False
        self._pool.reset()
        return True

    # ----------------------------------------------------------------- driving
    def next_event_time(self) -> float | None:
        """Seconds at which ``advance`` has work to do, or None when idle."""
        if self._step_end is not None:
            return self._step_end
        return self._pending_start

    def advance(self, now: float) -> list[EngineEvent]:
        """Run every step that ends at or before ``now``; return their events in order."""
        now = self._clock(now)
        events: list[EngineEvent] = []
        while True:
            if self._step_end is not None:
                if self._step_end > now:
                    break
                t = self._step_end
                self._complete_step(t, events)
                self._schedule(t)
            elif self._pending_start is not None and self._pending_start <= now:
                t = self._pending_start
                self._pending_start = None
                self._schedule(t)
                if self._step_end is None:
                    break
            else:
                break
        return events

    def run_until_idle(self, now: float, limit_s: float = 1e9) -> list[EngineEvent]:
        """Advance through every pending step (virtual time), for tests and batch runs."""
        events: list[EngineEvent] = []
        t = self.next_event_time()
        while t is not None and t <= now + limit_s:
            events.extend(self.advance(t))
            t = self.next_event_time()
        return events

    # ----------------------------------------------------------------- outputs
    def stats(self) -> EngineStats:
        """Current gauges and cumulative counters."""
        pool = self._pool
        return EngineStats(
            time=self._now,
            num_running=len(self._running),
            num_waiting=len(self._waiting),
            kv_usage=pool.used / pool.num_blocks if pool.num_blocks else 0.0,
            num_blocks=pool.num_blocks,
            used_blocks=pool.used,
            cached_free_blocks=len(pool.cached_free),
            prompt_tokens_total=self._prompt_tokens,
            prompt_tokens_cached_total=self._prompt_cached,
            generation_tokens_total=self._gen_tokens,
            prefix_cache_queries_total=self._pc_queries,
            prefix_cache_hits_total=self._pc_hits,
            num_preemptions_total=self._preemptions,
            request_success_total=dict(self._success),
            num_client_aborts_total=self._client_aborts,
            steps_total=self._steps,
            busy_time_s=self._busy,
        )

    def busy_time_until(self, now: float) -> float:
        """Seconds the engine has been busy up to ``now``, the elapsed part of a step still
        running included and the part still ahead of ``now`` excluded (``busy_time_s``
        counts a step's whole duration when it starts): what a GPU utilisation sampler
        (DCGM's share of time a kernel ran) sees at ``now``."""
        busy = self._busy
        if self._step_end is not None:
            busy -= max(0.0, self._step_end - max(now, self._step_start))
        return busy

    def step_batch(self) -> int:
        """Sequences in the step running now (0: no step running)."""
        return len(self._step_batch) if self._step_end is not None else 0

    def drain_finished(self) -> list[RequestMetrics]:
        """Return and forget the metrics of requests finished since the last call.

        At most ``params.max_pending_metrics`` are kept between calls (oldest dropped).
        """
        out = list(self._finished)
        self._finished.clear()
        return out

    def has_request(self, request_id: str) -> bool:
        """Whether ``request_id`` is waiting or running."""
        return request_id in self._by_id

    @property
    def num_running(self) -> int:
        """Requests in the running batch."""
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        """Requests in the waiting queue (including preempted ones)."""
        return len(self._waiting)

    # ---------------------------------------------------------------- internals
    def _clock(self, now: float) -> float:
        if now > self._now:
            self._now = now
        return self._now

    def _blocks_for(self, tokens: int) -> int:
        return math.ceil(tokens / self.params.block_size)

    def _free(self, seq: Seq) -> None:
        # vLLM frees in reverse so that a chain's tail is evicted first.
        for h in reversed(seq.hashed_blocks):
            self._pool.release_hashed(h)
        self._pool.release_private(seq.private_blocks)
        seq.hashed_blocks = []
        seq.private_blocks = 0

    def _grow(self, seq: Seq) -> bool:
        need = self._blocks_for(seq.req.num_prompt_tokens + seq.generated + 1) - seq.held_blocks
        if need <= 0:
            return True
        if need > self._pool.free:
            return False
        self._pool.allocate_fresh(need)
        seq.private_blocks += need
        return True

    def _preempt(self, seq: Seq) -> None:
        self._running.remove(seq)
        self._free(seq)
        seq.state = "waiting"
        seq.num_preemptions += 1
        self._preemptions += 1
        self._waiting.appendleft(seq)

    def _try_admit(self, seq: Seq) -> int | None:
        """Allocate blocks for ``seq``; return its uncached tokens to prefill, or None."""
        p = self.params
        prompt = seq.req.num_prompt_tokens
        total = prompt + seq.generated  # recompute after preemption
        max_hit_blocks = (prompt - 1) // p.block_size if p.enable_prefix_caching else 0
        hits = self._pool.lookup(seq.block_hashes, max_hit_blocks)
        hit_hashes = seq.block_hashes[:hits]
        need = self._blocks_for(total + 1) - hits
        if not self._pool.can_allocate(hit_hashes, need):
            return None
        for h in hit_hashes:
            self._pool.take_hit(h)
        self._pool.allocate_fresh(need)
        hashed = list(hit_hashes)
        private = need
        # Fresh full prompt blocks become cached once computed (registered at admission).
        for h in seq.block_hashes[hits:]:
            if self._pool.register(h):
                hashed.append(h)
                private -= 1
            else:
                break  # an identical block is already cached: keep ours private
        seq.hashed_blocks = hashed
        seq.private_blocks = private
        hit_tokens = hits * p.block_size
        if p.enable_prefix_caching:
            self._pc_queries += prompt
            self._pc_hits += hit_tokens
        if not seq.prompt_counted:
            seq.prompt_counted = True
            seq.cached_tokens = hit_tokens
            self._prompt_tokens += prompt
            self._prompt_cached += hit_tokens
        return total - hit_tokens

    def _schedule(self, t: float) -> None:
        p = self.params
        # 1. Room for one more token for every running request; preempt from the tail.
        i = 0
        while i < len(self._running):
            seq = self._running[i]
            while not self._grow(seq):
                victim = self._running[-1]
                self._preempt(victim)
                if victim is seq:
                    break
            else:
                i += 1
        # 2. Admit waiting requests FCFS.
        prefill_s = 0.0
        admitted = False
        while self._waiting and len(self._running) < p.max_num_seqs:
            seq = self._waiting[0]
            uncached = self._try_admit(seq)
            if uncached is None:
                break
            self._waiting.popleft()
            seq.state = "running"
            if seq.first_scheduled is None:
                seq.first_scheduled = t
            self._running.append(seq)
            prefill_s += p.prefill_time_s(uncached)
            admitted = True
        if not self._running:
            self._step_end = None
            self._step_batch = []
            return
        build = self.ttft_factor if admitted else self.itl_factor
        decode_s = p.decode_time_s(len(self._running)) * self.slowdown
        duration = (decode_s + prefill_s * self.prefill_slowdown) * build
        self._step_start = t
        self._step_end = t + duration
        self._step_batch = list(self._running)
        self._steps += 1
        self._busy += duration

    def _complete_step(self, t: float, events: list[EngineEvent]) -> None:
        self._step_end = None
        for seq in self._step_batch:
            if seq.state != "running":
                continue  # aborted or preempted during the step
            seq.generated += 1
            self._gen_tokens += 1
            if seq.first_token is None:
                seq.first_token = t
            elif seq.last_token is not None:
                seq.itl.append(t - seq.last_token)
            seq.last_token = t
            done = seq.generated >= seq.target
            reason = seq.finish if done else None
            events.append(EngineEvent(seq.req.request_id, t, seq.generated, True, reason))
            if done:
                self._running.remove(seq)
                self._free(seq)
                self._finish(seq, t, reason or "length")
        self._step_batch = []

    def _finish(self, seq: Seq, t: float, reason: str) -> None:
        seq.state = "done"
        self._by_id.pop(seq.req.request_id, None)
        self._success[reason] = self._success.get(reason, 0) + 1
        self._finished.append(seq.metrics(t, reason))
