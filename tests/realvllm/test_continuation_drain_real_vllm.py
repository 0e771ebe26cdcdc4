"""A drain deadline on a REAL vLLM server: its open streams go on on the other (issue 17).

Issue 17's must-hold on real vLLM (CPU build, tiny random-weight model): a drain with a 2 s
deadline while 8 long streams run ends with 0 cut, all complete. The session's servers ``a``
and ``b`` (``b`` with ``--api-key``) serve the model behind a gateway; eight streaming
requests at temperature 0 (four chat, four completions; ``ignore_eos``, long enough to be
open well past the deadline) are pinned on ``a`` (``b`` drained while they start, then
undrained), then ``a`` is drained with ``deadline_s: 2``. Each client reads one whole stream
with the real ``openai`` SDK: no error event, one ``id``, one ``finish_reason``
(``length``), exactly ``max_tokens`` tokens in the final usage, whose prompt tokens are the
original prompt's (counted once). Random weights make the text gibberish: the text's
exactness is the SIGKILL test's subject (tests/realvllm/test_continuation_real_vllm.py);
here the count of tokens the client received must equal ``max_tokens``, and the client sees
none of the token ids the gateway asked vLLM for (it did not ask for them).
"""

from __future__ import annotations

import time
from typing import Any

import openai
import pytest

from tests.lifecycle.support import admin, metric, metric_samples, pin_on_a, post_admin
from tests.realvllm.conftest import BACKEND_KEY
from tests.support.scripted import wait_for
from tests.support.servers import GatewayThread, gateway_config

pytestmark = pytest.mark.realvllm

MODEL = "tiny-llama"
STREAMS = 8
TOKENS = 1500  # of a's and b's 4096 positions (tests/realvllm/servers.py): ~6 s for 8
DEADLINE_S = 2.0
USAGE: Any = {"include_usage": True}


def _read(stream: Any, chat: bool, seen: list[int], i: int) -> dict[str, Any]:
    """Read an SDK stream to its end; ``seen.append(i)`` once its first content arrived."""
    ids, finishes, usages, tokens, extra = set(), [], [], 0, set()
    for chunk in stream:
        ids.add(chunk.id)
        extra |= {k for k, v in (chunk.model_extra or {}).items() if v is not None}
        if chunk.usage is not None:
            usages.append(chunk.usage)
        for ch in chunk.choices:
            extra |= {k for k, v in (ch.model_extra or {}).items() if v is not None}
            piece = ch.delta.content if chat else ch.text
            if piece:
                tokens += 1  # at most one token per event without continuous batching merges
                if i not in seen:
                    seen.append(i)
            if ch.finish_reason is not None:
                finishes.append(ch.finish_reason)
    return {"ids": ids, "finishes": finishes, "usages": usages, "events_with_text": tokens,
            "extra": extra}


def test_drain_deadline_on_real_vllm_continues_eight_long_streams(real_vllm) -> None:
    a, b = real_vllm["a"], real_vllm["b"]
    cfg = gateway_config(
        [{"id": "a", "url": a.url, "max_num_seqs": 16},
         {"id": "b", "url": b.url, "max_num_seqs": 16, "api_key": BACKEND_KEY}],
        breaker={"consecutive_failures": 100},
    )
    gw = GatewayThread(cfg)
    gw.start()
    try:
        gw.wait_ready(timeout=30, routable=2)
        client = openai.OpenAI(base_url=gw.url + "/v1", api_key="none", max_retries=0,
                               timeout=120)
        seen: list[int] = []
        prompts: dict[int, int] = {}

        def one(i: int) -> dict[str, Any]:
            chat = i % 2 == 0
            extra = {"ignore_eos": True}
            if chat:
                s = client.chat.completions.create(
                    model=MODEL, messages=[{"role": "user", "content": f"story {i}"}],
                    max_tokens=TOKENS, temperature=0, seed=i, stream=True,
                    stream_options=USAGE, extra_body=extra)
            else:
                s = client.completions.create(
                    model=MODEL, prompt=f"Once upon a time {i}", max_tokens=TOKENS,
                    temperature=0, seed=i, stream=True, stream_options=USAGE,
                    extra_body=extra)
            return {"chat": chat, **_read(s, chat, seen, i)}

        # the uninterrupted prompt token counts, straight from a (one short request each)
        for i in range(STREAMS):
            direct = openai.OpenAI(base_url=a.url + "/v1", api_key="none", max_retries=0)
            if i % 2 == 0:
                r: Any = direct.chat.completions.create(
                    model=MODEL, messages=[{"role": "user", "content": f"story {i}"}],
                    max_tokens=1)
            else:
                r = direct.completions.create(model=MODEL, prompt=f"Once upon a time {i}",
                                              max_tokens=1)
            prompts[i] = r.usage.prompt_tokens

        t0 = time.monotonic()
        running = pin_on_a(gw.url, [lambda i=i: one(i) for i in range(STREAMS)], STREAMS)
        t1 = time.monotonic()
        assert wait_for(lambda: len(seen) == STREAMS, 60), seen
        t2 = time.monotonic()
        assert post_admin(gw.url, "a", "drain", {"deadline_s": DEADLINE_S}).status_code == 202
        drain_at = time.monotonic()
        results = [r.result(timeout=180) for r in running]
        ended = time.monotonic()

        for i, res in enumerate(results):  # an error event would have raised
            assert len(res["ids"]) == 1, res["ids"]
            assert res["finishes"] == ["length"], res["finishes"]
            assert len(res["usages"]) == 1, res["usages"]
            # the token ids the gateway asked vLLM for are not the client's (null, as vLLM
            # sends them unasked)
            assert not res["extra"] & {"token_ids", "prompt_token_ids", "prompt_text"}, (
                res["extra"])
            u = res["usages"][0]
            assert u.completion_tokens == TOKENS and u.prompt_tokens == prompts[i], (i, u)
        m = metric_samples(gw.url)
        continued = metric(m, "gateway_stream_continuations_total", reason="drain_deadline",
                           outcome="continued")
        timings = {"pinned_s": t1 - t0, "streaming_s": t2 - t0, "drain_s": drain_at - t0,
                   "ended_s": ended - t0}
        assert continued == STREAMS, (continued, timings)
        assert admin(gw.url, "a")["in_flight"] == 0
        assert post_admin(gw.url, "a", "undrain").status_code == 200
    finally:
        gw.stop()
