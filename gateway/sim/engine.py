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
  (no chunked prefill).
* Paged KV cache of ``kv_cache_tokens // block_size`` blocks. A running request holds
  ``ceil((prompt + generated + 1) / block_size)`` blocks; growth that does not fit
  preempts the most recently admitted request (recompute mode: it returns to the
  front of the waiting queue and re-prefills prompt + generated tokens later), and
  ``num_preemptions`` counts it.
* Prefix cache. Full prompt blocks carry chained hashes (hash of parent hash + block
  tokens, salted by ``cache_salt`` such as a LoRA name). Blocks whose reference count
  drops to zero stay cached in an LRU of free blocks and are evicted only when a fresh
  block is needed. A lookup may hit at most ``prompt_tokens - 1`` tokens (vLLM always
  recomputes the last prompt token), rounded down to whole blocks. Counters are in
  tokens, as vLLM's ``vllm:prefix_cache_queries`` / ``vllm:prefix_cache_hits``.
  Only prompt blocks are hashed; generated-token blocks are private.
* KV usage (0-1) is ``used_blocks / total_blocks``; cached-but-free blocks count as
  free, as in vLLM's ``vllm:kv_cache_usage_perc``.

Per-request latencies follow vLLM's definitions (``vllm/v1/metrics/stats.py``):
queue time = first scheduled - arrival; TTFT = first token - arrival; prefill time =
first token - first scheduled; decode time = last token - first token; e2e = finish -
arrival; ITL = gap between consecutive tokens of one request.
"""

from __future__ import annotations

import math
import zlib
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from gateway.config import EngineParams as EngineParams  # declared with the config schema

FinishReason = Literal["stop", "length", "abort"]
FINISH_REASONS: tuple[str, ...] = ("stop", "length", "abort", "error", "repetition")


@dataclass(frozen=True)
class EngineRequest:
    """A generation request as the engine sees it.

    ``prompt_token_ids`` drive the prefix-cache hashes and the prompt length (tokens).
    The request ends after ``max_tokens`` tokens (finish "length") or, when
    ``eos_after`` is set and not above ``max_tokens``, after ``eos_after`` tokens, the
    last being EOS (finish "stop"). ``cache_salt`` separates prefix-cache namespaces
    (e.g. a LoRA adapter name).
    """

    request_id: str
    prompt_token_ids: Sequence[int]
    max_tokens: int
    eos_after: int | None = None
    cache_salt: str = ""

    @property
    def num_prompt_tokens(self) -> int:
        """Prompt length in tokens."""
        return len(self.prompt_token_ids)

    @property
    def target_tokens(self) -> int:
        """Number of tokens this request will generate if not aborted."""
        if self.eos_after is not None and self.eos_after <= self.max_tokens:
            return max(1, self.eos_after)
        return self.max_tokens

    @property
    def natural_finish(self) -> FinishReason:
        """Finish reason when the request runs to completion."""
        if self.eos_after is not None and self.eos_after <= self.max_tokens:
            return "stop"
        return "length"


@dataclass(frozen=True)
class EngineEvent:
    """Something that happened to a request at ``time`` (seconds).

    ``new_token`` is true when the request emitted its token number ``num_tokens``
    (1-based count of tokens so far). ``finish_reason`` is set on the request's last
    event ("stop", "length", or "abort" for an engine-side abort).
    """

    request_id: str
    time: float
    num_tokens: int
    new_token: bool
    finish_reason: str | None = None


@dataclass(frozen=True)
class RequestMetrics:
    """Latency observations (seconds) and sizes (tokens) of one finished request.

    Definitions follow vLLM's ``RequestStateStats`` / ``FinishedRequestStats``.
    """

    request_id: str
    finish_reason: str
    prompt_tokens: int
    generation_tokens: int
    cached_tokens: int
    max_tokens: int
    num_preemptions: int
    queue_time_s: float
    ttft_s: float | None
    prefill_time_s: float
    decode_time_s: float
    inference_time_s: float
    e2e_s: float
    itl_s: tuple[float, ...]


@dataclass(frozen=True)
class EngineStats:
    """Snapshot of gauges (now) and cumulative counters (since start) of one engine."""

    time: float
    num_running: int
    num_waiting: int
    kv_usage: float
    num_blocks: int
    used_blocks: int
    cached_free_blocks: int
    prompt_tokens_total: int
    prompt_tokens_cached_total: int
    generation_tokens_total: int
    prefix_cache_queries_total: int
    prefix_cache_hits_total: int
    num_preemptions_total: int
    request_success_total: dict[str, int]
    num_client_aborts_total: int
    steps_total: int
    busy_time_s: float


@dataclass(eq=False)
class _Seq:
    """Mutable state of one request inside the engine (compared by identity)."""

    req: EngineRequest
    arrival: float
    block_hashes: list[int]
    target: int = 0  # tokens to generate (max_tokens clipped to the context)
    finish: str = "length"
    state: Literal["waiting", "running", "done"] = "waiting"
    generated: int = 0
    hashed_blocks: list[int] = field(default_factory=list)  # hashes held (ref-counted)
    private_blocks: int = 0
    cached_tokens: int = 0
    first_scheduled: float | None = None
    first_token: float | None = None
    last_token: float | None = None
    num_preemptions: int = 0
    prompt_counted: bool = False
    itl: list[float] = field(default_factory=list)

    @property
    def held_blocks(self) -> int:
        return len(self.hashed_blocks) + self.private_blocks


def _salt_hash(salt: str) -> int:
    return zlib.crc32(salt.encode("utf-8"))


def block_hashes(token_ids: Sequence[int], block_size: int, salt: str = "") -> list[int]:
    """Chained hashes of the full ``block_size``-token blocks of ``token_ids``.

    Each hash covers its parent hash and the block's tokens (vLLM's
    ``hash_block_tokens``), so equal hashes mean equal prefixes. Deterministic across
    processes (integer-tuple hashing does not depend on ``PYTHONHASHSEED``).
    """
    parent = _salt_hash(salt)
    out: list[int] = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash((parent, tuple(token_ids[start : start + block_size])))
        out.append(parent)
    return out


class _BlockPool:
    """Counts KV blocks; keeps ref counts of hashed blocks and an LRU of free cached ones."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.used = 0  # blocks held by requests (hashed or private)
        self.refs: dict[int, int] = {}  # hash -> ref count (> 0), blocks in use
        self.cached_free: OrderedDict[int, None] = OrderedDict()  # LRU: first = oldest

    @property
    def free(self) -> int:
        """Blocks not held by any request (cached-free blocks count as free)."""
        return self.num_blocks - self.used

    def lookup(self, hashes: Sequence[int], max_blocks: int) -> int:
        """Number of leading ``hashes`` present in the cache, at most ``max_blocks``."""
        n = 0
        for h in hashes[:max_blocks]:
            if h in self.refs or h in self.cached_free:
                n += 1
            else:
                break
        return n

    def can_allocate(self, hit_hashes: Sequence[int], new_blocks: int) -> bool:
        """Whether ``new_blocks`` fresh blocks fit once ``hit_hashes`` are reused."""
        revived = sum(1 for h in hit_hashes if h in self.cached_free)
        return new_blocks + revived <= self.free

    def take_hit(self, h: int) -> None:
        if h in self.cached_free:
            del self.cached_free[h]
            self.used += 1
        self.refs[h] = self.refs.get(h, 0) + 1

    def allocate_fresh(self, n: int) -> None:
        """Take ``n`` fresh blocks, evicting the least recently freed cached blocks."""
        for _ in range(n):
            if self.num_blocks - self.used - len(self.cached_free) <= 0:
                self.cached_free.popitem(last=False)
            self.used += 1

    def register(self, h: int) -> bool:
        """Give a just-computed fresh block the hash ``h``; False if ``h`` already cached."""
        if h in self.refs or h in self.cached_free:
            return False
        self.refs[h] = 1
        return True

    def release_hashed(self, h: int) -> None:
        n = self.refs[h] - 1
        if n:
            self.refs[h] = n
        else:
            del self.refs[h]
            self.cached_free[h] = None
            self.used -= 1

    def release_private(self, n: int) -> None:
        self.used -= n

    def reset(self) -> None:
        self.cached_free.clear()


class Engine:
    """Discrete-event model of one vLLM engine; see the module docstring.

    Drive it with ``submit`` / ``abort`` and by calling ``advance(now)`` whenever
    ``now >= next_event_time()``. All times are seconds on the caller's clock and must
    not go backwards. The same inputs always give the same events.
    """

    def __init__(self, params: EngineParams | None = None) -> None:
        self.params = params or EngineParams()
        self._pool = _BlockPool(self.params.num_blocks)
        self._waiting: deque[_Seq] = deque()
        self._running: list[_Seq] = []  # admission order
        self._by_id: dict[str, _Seq] = {}
        self._now = 0.0
        self._step_end: float | None = None
        self._step_start = 0.0
        self._step_batch: list[_Seq] = []
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
        # Step-time multiplier set by a GPU model (>= 1 while the GPU is thermally
        # throttled or power capped: :func:`gateway.sim.thermal.step_time_factor`).
        self.slowdown = 1.0

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
        seq = _Seq(req=request, arrival=now, block_hashes=hashes)
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

    def _free(self, seq: _Seq) -> None:
        # vLLM frees in reverse so that a chain's tail is evicted first.
        for h in reversed(seq.hashed_blocks):
            self._pool.release_hashed(h)
        self._pool.release_private(seq.private_blocks)
        seq.hashed_blocks = []
        seq.private_blocks = 0

    def _grow(self, seq: _Seq) -> bool:
        need = self._blocks_for(seq.req.num_prompt_tokens + seq.generated + 1) - seq.held_blocks
        if need <= 0:
            return True
        if need > self._pool.free:
            return False
        self._pool.allocate_fresh(need)
        seq.private_blocks += need
        return True

    def _preempt(self, seq: _Seq) -> None:
        self._running.remove(seq)
        self._free(seq)
        seq.state = "waiting"
        seq.num_preemptions += 1
        self._preemptions += 1
        self._waiting.appendleft(seq)

    def _try_admit(self, seq: _Seq) -> int | None:
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
        if not self._running:
            self._step_end = None
            self._step_batch = []
            return
        duration = (p.decode_time_s(len(self._running)) + prefill_s) * self.slowdown
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

    def _finish(self, seq: _Seq, t: float, reason: str) -> None:
        seq.state = "done"
        self._by_id.pop(seq.req.request_id, None)
        self._success[reason] = self._success.get(reason, 0) + 1
        sched = seq.first_scheduled if seq.first_scheduled is not None else t
        first = seq.first_token
        last = seq.last_token if seq.last_token is not None else t
        self._finished.append(
            RequestMetrics(
                request_id=seq.req.request_id,
                finish_reason=reason,
                prompt_tokens=seq.req.num_prompt_tokens,
                generation_tokens=seq.generated,
                cached_tokens=seq.cached_tokens,
                max_tokens=seq.req.max_tokens,
                num_preemptions=seq.num_preemptions,
                queue_time_s=sched - seq.arrival,
                ttft_s=None if first is None else first - seq.arrival,
                prefill_time_s=(first if first is not None else t) - sched,
                decode_time_s=0.0 if first is None else last - first,
                inference_time_s=last - sched,
                e2e_s=t - seq.arrival,
                itl_s=tuple(seq.itl),
            )
        )
