"""The lifecycle drill's stream checks (``benchmarks/drill_streams.py``) are not vacuous: a
stream a simulated backend serves whole passes, and each way a stitched stream can go wrong
(text twice, text missing, a second role delta or ``finish_reason``, a usage that does not
add up, a second ``id``, a cut) is reported, so the drill's "0 not whole" means something."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.sim import SimConfig, SimServerThread
from gateway.sim.engine import EngineParams

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from drill_streams import MODEL, StreamView, prompt_of, reference

MAX_TOKENS = 40


@pytest.fixture(scope="module")
def served() -> Iterator[bytes]:
    """The raw body of one greedy ``ignore_eos`` chat stream with usage, as the drill asks
    it, from a simulated backend (uninterrupted)."""
    engine = EngineParams(itl_base_s=0.001, itl_per_seq_s=0.0)
    with SimServerThread(SimConfig(model=MODEL, engine=engine, seed=5)) as url:
        body = {"model": MODEL, "messages": [{"role": "user", "content": prompt_of(MAX_TOKENS)}],
                "max_tokens": MAX_TOKENS, "ignore_eos": True, "temperature": 0,
                "stream": True, "stream_options": {"include_usage": True}}
        r = httpx.post(url + "/v1/chat/completions", json=body, timeout=30)
        r.raise_for_status()
        yield r.content


def _view(raw: bytes, edit: Callable[[list[dict[str, Any]]], None] | None = None) -> StreamView:
    view = StreamView()
    view.feed(raw)
    if edit is not None:
        chunks = view.chunks
        edit(chunks)
        view.events = [json.dumps(c).encode() for c in chunks] + [b"[DONE]"]
    return view


def _check(view: StreamView) -> str | None:
    return view.not_whole(MODEL, prompt_of(MAX_TOKENS), MAX_TOKENS)


def test_an_uninterrupted_stream_is_whole(served: bytes) -> None:
    view = _view(served)
    assert view.cut() is None
    assert _check(view) is None
    text, _ = reference(MODEL, prompt_of(MAX_TOKENS), MAX_TOKENS)
    assert len(text) > MAX_TOKENS  # words, one token each


def _content_indices(chunks: list[dict[str, Any]]) -> list[int]:
    return [i for i, c in enumerate(chunks)
            if c.get("choices") and c["choices"][0]["delta"].get("content")]


def _duplicate_text(chunks: list[dict[str, Any]]) -> None:
    i = _content_indices(chunks)[5]
    chunks.insert(i + 1, json.loads(json.dumps(chunks[i])))


def _drop_text(chunks: list[dict[str, Any]]) -> None:
    del chunks[_content_indices(chunks)[5]]


def _second_role(chunks: list[dict[str, Any]]) -> None:
    chunks.insert(3, json.loads(json.dumps(chunks[0])))


def _second_finish(chunks: list[dict[str, Any]]) -> None:
    chunks[_content_indices(chunks)[5]]["choices"][0]["finish_reason"] = "length"


def _usage_off(chunks: list[dict[str, Any]]) -> None:
    chunks[-1]["usage"]["completion_tokens"] -= 3


def _second_id(chunks: list[dict[str, Any]]) -> None:
    for c in chunks[10:]:
        c["id"] = "chatcmpl-other"


@pytest.mark.parametrize(("edit", "says"), [
    (_duplicate_text, "text differs"), (_drop_text, "text differs"),
    (_second_role, "2 role deltas"), (_second_finish, "finish_reason"),
    (_usage_off, "usage"), (_second_id, "2 values of id"),
])
def test_each_flaw_of_a_stitched_stream_is_reported(
    served: bytes, edit: Callable[[list[dict[str, Any]]], None], says: str
) -> None:
    problem = _check(_view(served, edit))
    assert problem is not None and says in problem, problem


def test_a_stream_without_its_done_or_with_an_error_event_is_cut(served: bytes) -> None:
    head = served[: served.index(b"data: [DONE]")]
    assert "without a final [DONE]" in str(_view(head).cut())
    err = b'data: {"error": {"message": "broke", "type": "server_error", "code": "x"}}\n\n'
    assert "error event" in str(_view(head + err + b"data: [DONE]\n\n").cut())
