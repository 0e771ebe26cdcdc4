"""A drain deadline no longer cuts streams: they go on on another backend (issue 17).

Issue 17's must-hold, on the simulator: a drain with a 2 s deadline while 8 long streams
run ends with 0 cut and all complete. Eight streaming chat requests at temperature 0 (200
tokens, ``ignore_eos``: about 4 s each on A) are pinned on A (B drained while they start,
then undrained), then A is drained with ``deadline_s: 2``. At the deadline the relay closes
each stream's upstream response (:attr:`gateway.proxy.relay.CutHandle.divert`) and the
stream goes on on B: every client reads one whole stream, the same text and usage as an
uninterrupted run on B, one ``finish_reason``, ``[DONE]``, no error event. A counts as
drained right after the deadline, its breaker counts no failure (a drain is the gateway's
doing), and ``gateway_stream_continuations_total{reason="drain_deadline",
outcome="continued"}`` is 8.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from tests.lifecycle.support import (
    Sim,
    StreamResult,
    admin,
    chat_body,
    metric,
    metric_samples,
    pin_on_a,
    post_admin,
    stream_chat,
    wait_state,
)
from tests.support.scripted import wait_for
from tests.support.servers import GatewayThread

STREAMS = 8
TOKENS = 200  # A decodes 50 tokens/s: each stream would need ~4 s on A alone
DEADLINE_S = 2.0


def _whole(r: StreamResult) -> tuple[str, str | None, Any]:
    """A stream's text, finish reason and final usage (asserting it is well formed)."""
    assert r.problem() is None, r.problem()
    assert not r.errors, r.errors
    assert r.events[-1] == "[DONE]" and r.done_count == 1, r.events[-3:]
    ids = {c["id"] for c in r.chunks}
    assert len(ids) == 1, ids
    finishes = [ch["finish_reason"] for c in r.chunks for ch in c.get("choices", [])
                if ch.get("finish_reason")]
    assert finishes == ["length"], finishes
    usages = [c["usage"] for c in r.chunks if c.get("usage")]
    return r.content, r.finish_reason, usages[-1] if usages else None


def test_drain_deadline_continues_eight_long_streams_on_another_backend(
    sims: Callable[..., Sim], lc_gateway: Callable[..., GatewayThread]
) -> None:
    a, b = sims("A", itl_s=0.02), sims("B", itl_s=0.005)
    gw = lc_gateway({"a": a.url, "b": b.url})
    url = gw.url
    body = chat_body(TOKENS, stream=True, temperature=0, seed=3, ignore_eos=True,
                     stream_options={"include_usage": True})
    reference = _whole(stream_chat(b.url, body))  # uninterrupted, straight to B
    assert reference[2] is not None and reference[2]["completion_tokens"] == TOKENS

    first: list[int] = []
    calls = [lambda i=i: stream_chat(url, body, f"drain-{i}",
                                     on_first_event=lambda i=i: first.append(i))
             for i in range(STREAMS)]
    running = pin_on_a(url, calls, STREAMS)
    assert wait_for(lambda: len(first) == STREAMS, 10), first
    assert post_admin(url, "a", "drain", {"deadline_s": DEADLINE_S}).status_code == 202
    drain_at = time.monotonic()
    results: list[StreamResult] = [r.result() for r in running]

    for r in results:
        assert _whole(r) == reference  # one whole stream: text, finish_reason, usage
    # every stream was still open on A at the deadline, and went on on B
    b_ids = b.recent_ids()
    assert {f"drain-{i}" for i in range(STREAMS)} <= b_ids
    assert min(r.ended for r in results) - drain_at >= DEADLINE_S - 0.5
    a_state = wait_state(url, "a", "draining", drained=True, timeout=3)
    assert a_state["in_flight"] == 0
    assert wait_for(lambda: a.stats()["aborted"] == STREAMS, 3), a.stats()["aborted"]
    m = metric_samples(url)
    assert metric(m, "gateway_stream_continuations_total", reason="drain_deadline",
                  outcome="continued") == STREAMS
    assert not metric(m, "gateway_stream_errors_total", backend="a", code="drain_deadline")
    assert admin(url, "a")["breaker"]["consecutive_failures"] == 0
