"""The simulated engine's records (pure): a request in (:class:`EngineRequest`), what
happens to it out (:class:`EngineEvent`), its metrics once finished
(:class:`RequestMetrics`), the engine's snapshot (:class:`EngineStats`), and the engine's
mutable per-request state (:class:`Seq`).

Per-request latencies follow vLLM's definitions (``vllm/v1/metrics/stats.py``):
queue time = first scheduled - arrival; TTFT = first token - arrival; prefill time =
first token - first scheduled; decode time = last token - first token; e2e = finish -
arrival; ITL = gap between consecutive tokens of one request.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

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
class Seq:
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
        """KV blocks this request holds (hashed prompt blocks and private ones)."""
        return len(self.hashed_blocks) + self.private_blocks

    def metrics(self, t: float, reason: str) -> RequestMetrics:
        """The request's metrics as it finishes at ``t`` (seconds) with ``reason``, per
        vLLM's definitions (see the module docstring)."""
        sched = self.first_scheduled if self.first_scheduled is not None else t
        first = self.first_token
        last = self.last_token if self.last_token is not None else t
        return RequestMetrics(
            request_id=self.req.request_id,
            finish_reason=reason,
            prompt_tokens=self.req.num_prompt_tokens,
            generation_tokens=self.generated,
            cached_tokens=self.cached_tokens,
            max_tokens=self.req.max_tokens,
            num_preemptions=self.num_preemptions,
            queue_time_s=sched - self.arrival,
            ttft_s=None if first is None else first - self.arrival,
            prefill_time_s=(first if first is not None else t) - sched,
            decode_time_s=0.0 if first is None else last - first,
            inference_time_s=last - sched,
            e2e_s=t - self.arrival,
            itl_s=tuple(self.itl),
        )
