"""The kill drill's verdicts (``tests/support/continuation_drill.py``): each stream's client
view against the same request answered uninterrupted (whole, usage, text), and the
signature of vLLM's prompt leak (vllm-project/vllm#48853). Shared by
``tests/realvllm/test_continuation_real_vllm.py`` and ``benchmarks/real_vllm_continuation.py``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import httpx

from tests.support.continuation_drill import MODEL, StreamResult


@dataclass
class Summary:
    """The drill's figures: per kind, streams and those whose text equals the reference's
    (``exact``); streams whose client view was whole (``[DONE]`` once and last, no error
    event, one id, one ``finish_reason``: ``whole``); usage right (``usage_right``: one
    usage, prompt tokens as the reference's, completion tokens as the reference's and as
    many as the client received)."""

    streams: dict[str, int] = field(default_factory=dict)
    exact: dict[str, int] = field(default_factory=dict)
    whole: int = 0
    usage_right: int = 0
    mismatched: list[str] = field(default_factory=list)

    def share(self, kind: str) -> float:
        """Exact share of ``kind``'s streams (0-1)."""
        n = self.streams.get(kind, 0)
        return self.exact.get(kind, 0) / n if n else 0.0


def whole(r: StreamResult) -> bool:
    """The client saw one whole stream (see :class:`Summary`)."""
    return (r.error is None and r.ends_with_done() and not r.error_events()
            and len(r.ids) == 1 and len(r.finishes) == 1)


def usage_right(r: StreamResult, ref: StreamResult) -> bool:
    """One usage; prompt tokens and completion tokens as the reference's, completion tokens
    equal to the tokens the client received (its token ids when it got them)."""
    if len(r.usages) != 1 or len(ref.usages) != 1:
        return False
    u, want = r.usages[0], ref.usages[0]
    received = len(r.token_ids) if r.token_ids is not None else r.request.max_tokens
    return (u.get("prompt_tokens") == want.get("prompt_tokens")
            and u.get("completion_tokens") == want.get("completion_tokens") == received
            and u.get("total_tokens") == want.get("total_tokens"))


def summarize(results: list[StreamResult], refs: list[StreamResult]) -> Summary:
    """Compare each result with the reference of the same request."""
    by_key = {r.request.key: r for r in refs}
    s = Summary()
    for r in results:
        kind, ref = r.request.kind, by_key[r.request.key]
        s.streams[kind] = s.streams.get(kind, 0) + 1
        if r.text == ref.text:
            s.exact[kind] = s.exact.get(kind, 0) + 1
        else:
            s.mismatched.append(r.request.key)
        s.whole += whole(r)
        s.usage_right += usage_right(r, ref)
    return s


def leaks_prompt(r: StreamResult, ref: StreamResult, prompt_text: str, width: int = 12) -> bool:
    """``r``'s text, from where it leaves the reference's, has a piece of its prompt's text
    (``prompt_text``: vLLM's ``/detokenize`` of the prompt's ids; any ``width`` characters
    of it that the reference's text has not): the signature of vLLM's detokenizer streaming
    the prompt back when a token-id prompt ends inside a UTF-8 sequence
    (vllm-project/vllm#48853)."""
    after = r.text[first_difference(r.text, ref.text):]
    for j in range(0, max(1, len(prompt_text) - width + 1), 2):
        piece = prompt_text[j:j + width]
        if len(piece) == width and piece in after and piece not in ref.text:
            return True
    return False


def first_difference(a: str, b: str) -> int:
    """The first index where ``a`` and ``b`` differ (``min(len)`` when one is a prefix)."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return min(len(a), len(b))


def leaked_streams(vllm_url: str, results: list[StreamResult], refs: list[StreamResult]
                   ) -> list[str]:
    """Keys of the streams that differ from their reference with :func:`leaks_prompt`'s
    signature (the prompt's text from vLLM's ``/detokenize`` at ``vllm_url`` of the prompt
    ids the stream reported)."""
    by_key = {r.request.key: r for r in refs}
    out = []
    for r in results:
        ref = by_key[r.request.key]
        if r.text == ref.text or not r.prompt_ids:
            continue
        prompt = httpx.post(vllm_url + "/detokenize",
                            json={"model": MODEL, "tokens": r.prompt_ids}, timeout=30)
        if leaks_prompt(r, ref, prompt.json()["prompt"]):
            out.append(r.request.key)
    return out


def continuation_counts(metrics: Any) -> dict[str, float]:
    """``gateway_stream_continuations_total`` summed by outcome (``metrics``: the gateway's
    :class:`gateway.metrics.GatewayMetrics`)."""
    out: dict[str, float] = {}
    for metric in metrics.stream_continuations.collect():
        for s in metric.samples:
            if s.name.endswith("_total"):
                out[s.labels["outcome"]] = out.get(s.labels["outcome"], 0) + s.value
    return out
