"""Pure engine tests: explicit virtual times, no I/O."""

from __future__ import annotations

import math

import pytest

from gateway.sim.engine import Engine, EngineParams
from gateway.sim.engine_types import EngineEvent, EngineRequest
from gateway.sim.kv_cache import block_hashes

# Round numbers so expected times can be written down.
P = EngineParams(
    max_num_seqs=4,
    kv_cache_tokens=4096,
    block_size=16,
    prefill_base_s=0.005,
    prefill_per_token_s=0.0001,
    itl_base_s=0.010,
    itl_per_seq_s=0.001,
    max_model_len=1024,
)


def req(rid: str, prompt: int | list[int], max_tokens: int = 4, **kw: object) -> EngineRequest:
    ids = list(range(1000, 1000 + prompt)) if isinstance(prompt, int) else prompt
    return EngineRequest(rid, ids, max_tokens, **kw)  # type: ignore[arg-type]


def run(engine: Engine, now: float = 0.0) -> list[EngineEvent]:
    return engine.run_until_idle(now)


def token_times(events: list[EngineEvent], rid: str) -> list[float]:
    return [e.time for e in events if e.request_id == rid and e.new_token]


def test_single_request_timing_and_finish() -> None:
    e = Engine(P)
    e.submit(req("a", 32, max_tokens=3), 0.0)
    assert e.next_event_time() == 0.0
    ev = run(e)
    times = token_times(ev, "a")
    first = 0.010 + 0.001 + 0.005 + 0.0001 * 32  # decode(1) + prefill(32)
    assert times[0] == pytest.approx(first)
    assert times[1] - times[0] == pytest.approx(0.011)
    assert times[2] - times[1] == pytest.approx(0.011)
    assert [x.finish_reason for x in ev] == [None, None, "length"]
    assert e.next_event_time() is None
    s = e.stats()
    assert (s.num_running, s.num_waiting, s.generation_tokens_total) == (0, 0, 3)
    assert s.prompt_tokens_total == 32
    assert s.request_success_total["length"] == 1
    (m,) = e.drain_finished()
    assert m.ttft_s == pytest.approx(first)
    assert m.queue_time_s == 0.0
    assert m.e2e_s == pytest.approx(times[-1])
    assert m.itl_s == pytest.approx((0.011, 0.011))
    assert m.decode_time_s == pytest.approx(0.022)
    assert e.drain_finished() == []


def test_requests_submitted_together_are_batched() -> None:
    e = Engine(P)
    for rid in "abc":
        e.submit(req(rid, 16, max_tokens=2), 0.0)
    first = e.advance(0.0)
    assert first == []  # the step just started
    assert e.num_running == 3
    ev = run(e)
    ta, tb, tc = (token_times(ev, r) for r in "abc")
    assert ta == tb == tc  # one token per running request per step
    assert ta[1] - ta[0] == pytest.approx(0.010 + 0.003)


def test_waiting_queue_when_max_num_seqs_reached() -> None:
    e = Engine(P)  # max_num_seqs=4
    for i in range(6):
        e.submit(req(f"r{i}", 16, max_tokens=2), 0.0)
    e.advance(0.0)
    assert (e.num_running, e.num_waiting) == (4, 2)
    ev = run(e)
    assert e.num_running == e.num_waiting == 0
    last_of_first = max(token_times(ev, "r0"))
    # FCFS: the waiting ones start only once the first batch freed its slots.
    assert min(token_times(ev, "r4")) > last_of_first
    metrics = {m.request_id: m for m in e.drain_finished()}
    assert metrics["r0"].queue_time_s == 0.0
    assert metrics["r4"].queue_time_s == pytest.approx(last_of_first)


def test_itl_grows_with_batch_size() -> None:
    def itl(batch: int) -> float:
        e = Engine(P)
        for i in range(batch):
            e.submit(req(f"r{i}", 8, max_tokens=5), 0.0)
        ev = run(e)
        t = token_times(ev, "r0")
        return t[-1] - t[-2]

    one, four = itl(1), itl(4)
    assert one == pytest.approx(0.011)
    assert four == pytest.approx(0.014)
    assert four - one == pytest.approx(3 * P.itl_per_seq_s)


def test_speed_multiplier_scales_step_time() -> None:
    fast = Engine(EngineParams(**{**P.__dict__, "speed": 2.0}))
    fast.submit(req("a", 8, max_tokens=3), 0.0)
    t = token_times(run(fast), "a")
    assert t[2] - t[1] == pytest.approx(0.011 / 2)


def test_kv_blocks_grow_with_generated_tokens_and_are_freed() -> None:
    e = Engine(P)  # 4096 tokens / 16 = 256 blocks
    e.submit(req("a", 31, max_tokens=4), 0.0)
    e.advance(0.0)
    s = e.stats()
    assert s.used_blocks == math.ceil((31 + 1) / 16) == 2
    assert s.kv_usage == pytest.approx(2 / 256)
    e.advance(e.next_event_time() or 0)  # token 1 out; step 2 needs room for 33 tokens
    assert e.stats().used_blocks == 3
    run(e)
    s = e.stats()
    assert s.used_blocks == 0 and s.kv_usage == 0.0
    assert s.cached_free_blocks == 1  # the one full prompt block stays cached


def test_kv_capacity_limits_admission() -> None:
    small = EngineParams(**{**P.__dict__, "kv_cache_tokens": 128, "max_model_len": 64})
    e = Engine(small)  # 8 blocks; each 40-token prompt needs ceil(41/16) = 3
    for i in range(3):  # distinct salts: no prefix sharing
        e.submit(req(f"r{i}", 40, max_tokens=2, cache_salt=str(i)), 0.0)
    e.advance(0.0)
    assert (e.num_running, e.num_waiting) == (2, 1)
    assert e.stats().kv_usage == pytest.approx(6 / 8)
    run(e)
    assert e.stats().request_success_total["length"] == 3


def test_shared_prefix_needs_fewer_blocks() -> None:
    small = EngineParams(**{**P.__dict__, "kv_cache_tokens": 128, "max_model_len": 64})
    e = Engine(small)  # same prompt: later ones reuse the first's 2 full blocks
    for i in range(3):
        e.submit(req(f"r{i}", 40, max_tokens=2), 0.0)
    e.advance(0.0)
    assert (e.num_running, e.num_waiting) == (3, 0)
    assert e.stats().used_blocks == 3 + 1 + 1
    assert e.stats().prefix_cache_hits_total == 2 * 32


def test_preemption_when_kv_runs_out() -> None:
    small = EngineParams(**{**P.__dict__, "kv_cache_tokens": 128, "max_model_len": 96})
    e = Engine(small)
    e.submit(req("a", 40, max_tokens=30, cache_salt="a"), 0.0)
    e.submit(req("b", 40, max_tokens=30, cache_salt="b"), 0.0)
    ev = run(e)
    s = e.stats()
    assert s.num_preemptions_total >= 1
    assert s.generation_tokens_total == 60
    assert s.request_success_total["length"] == 2
    assert len(token_times(ev, "a")) == len(token_times(ev, "b")) == 30
    assert any(m.num_preemptions for m in e.drain_finished())
    assert s.used_blocks == 0


def test_prefix_cache_hits_in_tokens() -> None:
    e = Engine(P)
    prompt = list(range(64))
    e.submit(req("a", prompt, max_tokens=1), 0.0)
    run(e)
    e.submit(req("b", prompt, max_tokens=1), 1.0)
    run(e, 1.0)
    s = e.stats()
    assert s.prefix_cache_queries_total == 128
    # At most prompt-1 tokens can hit, in whole blocks: (64-1)//16 = 3 blocks.
    assert s.prefix_cache_hits_total == 48
    assert s.prompt_tokens_total == 128  # cached tokens still count as prompt tokens
    assert s.prompt_tokens_cached_total == 48
    a, b = e.drain_finished()
    assert b.ttft_s is not None and a.ttft_s is not None
    assert a.ttft_s - b.ttft_s == pytest.approx(48 * P.prefill_per_token_s)


def test_prefix_cache_salt_and_partial_prefix() -> None:
    e = Engine(P)
    base = list(range(48))
    e.submit(req("a", [*base, 1, 2, 3], max_tokens=1), 0.0)
    run(e)
    e.submit(req("b", [*base[:32], 9, 9, 9, 9, *base[36:]], max_tokens=1), 1.0)
    run(e, 1.0)
    assert e.stats().prefix_cache_hits_total == 32  # two shared blocks, then divergence
    e.submit(req("c", [*base, 1, 2, 3], max_tokens=1, cache_salt="lora-x"), 2.0)
    run(e, 2.0)
    assert e.stats().prefix_cache_hits_total == 32  # another namespace: no hit


def test_reset_prefix_cache() -> None:
    e = Engine(P)
    prompt = list(range(64))
    e.submit(req("a", prompt, max_tokens=50), 0.0)
    e.advance(0.0)
    assert e.reset_prefix_cache() is False  # like vLLM: refused while blocks are held
    run(e)
    assert e.reset_prefix_cache() is True
    assert e.stats().cached_free_blocks == 0
    e.submit(req("b", prompt, max_tokens=1), 10.0)
    run(e, 10.0)
    assert e.stats().prefix_cache_hits_total == 0


def test_lru_eviction_of_cached_blocks() -> None:
    tiny = EngineParams(**{**P.__dict__, "kv_cache_tokens": 128, "max_model_len": 64})
    e = Engine(tiny)  # 8 blocks
    t = 0.0
    for i in range(6):  # each leaves 2 cached blocks behind; only 8 fit
        e.submit(req(f"p{i}", [i] * 40, max_tokens=1), t)
        run(e, t)
        t += 1.0
    assert e.stats().cached_free_blocks <= 8
    e.submit(req("again-old", [0] * 40, max_tokens=1), t)  # evicted long ago
    e.submit(req("again-new", [5] * 40, max_tokens=1), t)  # still cached
    hits_before = e.stats().prefix_cache_hits_total
    run(e, t)
    assert e.stats().prefix_cache_hits_total - hits_before == 32


def test_abort_running_and_waiting() -> None:
    e = Engine(EngineParams(**{**P.__dict__, "max_num_seqs": 1}))
    e.submit(req("a", 16, max_tokens=100), 0.0)
    e.submit(req("b", 16, max_tokens=100), 0.0)
    e.advance(0.0)
    e.advance(0.05)
    assert (e.num_running, e.num_waiting) == (1, 1)
    assert e.abort("b", 0.05) is True  # waiting
    assert e.abort("a", 0.05) is True  # running
    assert e.abort("a", 0.05) is False
    s = e.stats()
    assert (s.num_running, s.num_waiting, s.used_blocks) == (0, 0, 0)
    assert s.num_client_aborts_total == 2
    assert sum(s.request_success_total.values()) == 0  # client aborts are not counted
    assert [x for x in run(e, 0.05) if x.request_id in ("a", "b")] == []


def test_abort_all_counts_engine_aborts() -> None:
    e = Engine(P)
    e.submit(req("a", 16, max_tokens=100), 0.0)
    e.advance(0.0)
    e.advance(0.1)
    ev = e.abort_all(0.1)
    assert [(x.request_id, x.finish_reason) for x in ev] == [("a", "abort")]
    assert e.stats().request_success_total["abort"] == 1
    assert e.drain_finished()[0].finish_reason == "abort"


def test_stop_before_max_tokens_versus_length() -> None:
    e = Engine(P)
    e.submit(req("stop", 8, max_tokens=10, eos_after=5), 0.0)
    e.submit(req("len", 8, max_tokens=10, eos_after=20), 0.0)
    ev = run(e)
    assert len(token_times(ev, "stop")) == 5
    assert len(token_times(ev, "len")) == 10
    final = {x.request_id: x.finish_reason for x in ev if x.finish_reason}
    assert final == {"stop": "stop", "len": "length"}


def test_deterministic() -> None:
    def trace() -> list[EngineEvent]:
        e = Engine(P)
        out: list[EngineEvent] = []
        for i in range(10):
            e.submit(req(f"r{i}", 10 + 7 * i, max_tokens=3 + i, eos_after=2 + i % 4), i * 0.003)
            out += e.advance(i * 0.003)
        return out + run(e, 0.03)

    assert trace() == trace()


def test_max_tokens_clipped_to_context() -> None:
    e = Engine(P)  # max_model_len 1024
    e.submit(req("a", 1000, max_tokens=500), 0.0)
    ev = run(e)
    assert len(token_times(ev, "a")) == 24 and ev[-1].finish_reason == "length"


def test_validation() -> None:
    e = Engine(P)
    with pytest.raises(ValueError):
        e.submit(req("x", 1024, max_tokens=1), 0.0)
    e.submit(req("y", 8), 0.0)
    with pytest.raises(ValueError):
        e.submit(req("y", 8), 0.0)
    with pytest.raises(ValueError):
        EngineParams(kv_cache_tokens=100, max_model_len=4096)


def test_block_hashes_chain() -> None:
    a = block_hashes(list(range(40)), 16)
    b = block_hashes([*range(16), 99, *range(17, 40)], 16)
    assert len(a) == 2 and a[0] == b[0] and a[1] != b[1]
    assert block_hashes(list(range(40)), 16, salt="x")[0] != a[0]


def test_random_load_keeps_invariants() -> None:
    """Seeded random arrivals, shared prefixes and aborts on a small KV cache."""
    import random

    rng = random.Random(1234)
    params = EngineParams(**{**P.__dict__, "kv_cache_tokens": 512, "max_model_len": 256})
    e = Engine(params)
    prefixes = [[rng.randrange(5000) for _ in range(48)] for _ in range(4)]
    t, submitted, aborted = 0.0, {}, set()
    for i in range(300):
        t += rng.expovariate(200.0)
        e.advance(t)
        prompt = rng.choice(prefixes)[: rng.randrange(1, 48)] + [i] * rng.randrange(0, 60)
        max_tokens = rng.randrange(1, 200)
        e.submit(req(f"r{i}", prompt, max_tokens=max_tokens), t)
        submitted[f"r{i}"] = min(max_tokens, 256 - len(prompt))
        if rng.random() < 0.1:
            victim = f"r{rng.randrange(i + 1)}"
            if e.abort(victim, t):
                aborted.add(victim)
        s = e.stats()
        assert 0 <= s.used_blocks <= s.num_blocks
        assert s.used_blocks + s.cached_free_blocks <= s.num_blocks
        assert s.num_running <= params.max_num_seqs
    run(e, t)
    s = e.stats()
    assert (s.num_running, s.num_waiting, s.used_blocks) == (0, 0, 0)
    done = {m.request_id: m for m in e.drain_finished()}
    assert set(done) == set(submitted) - aborted  # nothing stalls, nothing is lost
    for rid, m in done.items():
        assert m.generation_tokens == submitted[rid] and m.finish_reason == "length"
    assert s.prefix_cache_hits_total > 0 and s.num_preemptions_total > 0


def test_a_builds_factors_multiply_prefill_steps_and_decode_only_steps() -> None:
    """``ReleaseConfig.ttft_factor`` / ``itl_factor`` (issue 18): a lone request's TTFT and
    ITL are exactly the factors times the default build's; a step that prefills a late
    arrival takes ``ttft_factor``, so the running stream's token in it comes late too."""

    def lone(**factors: float) -> tuple[float, tuple[float, ...]]:
        e = Engine(P, **factors)
        e.submit(req("a", 100, max_tokens=4), 0.0)
        run(e)
        (m,) = e.drain_finished()
        assert m.ttft_s is not None
        return m.ttft_s, m.itl_s

    ttft, itl = lone()
    assert ttft == pytest.approx(0.011 + 0.005 + 0.01)  # decode(1) + prefill(100)
    slow_ttft, same_itl = lone(ttft_factor=2.0)
    assert slow_ttft == pytest.approx(2 * ttft) and same_itl == pytest.approx(itl)
    same_ttft, slow_itl = lone(itl_factor=3.0)
    assert same_ttft == pytest.approx(ttft)
    assert slow_itl == pytest.approx(tuple(3 * x for x in itl))

    e = Engine(P, ttft_factor=2.0)
    e.submit(req("a", 100, max_tokens=3), 0.0)
    events = e.advance(0.0)  # a's prefill step: it ends at 2 * ttft
    e.submit(req("b", list(range(5000, 5100)), max_tokens=1), 2 * ttft)  # joins a's next step
    events += run(e, 2 * ttft)
    a = token_times(events, "a")
    mixed = (0.012 + 0.015) * 2  # decode(2) + prefill(100, no prefix shared): prefills
    assert a[1] - a[0] == pytest.approx(mixed)
    assert a[2] - a[1] == pytest.approx(0.011)  # decode-only again: the default's
    with pytest.raises(ValueError, match="factor"):
        Engine(P, itl_factor=0.0)
