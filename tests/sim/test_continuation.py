"""The simulator speaks what mid-stream continuation needs (issue 17), over real HTTP.

A generation cut after ``k`` tokens and sent again as "original prompt + what was
generated" (completions: token ids from ``return_token_ids``; chat: the generated text
as a final assistant message with ``continue_final_message: true`` and
``add_generation_prompt: false``) must produce exactly the rest of the uninterrupted
generation, stop at the same place and count the rest as its completion tokens. Also:
vLLM's ``prompt_token_ids``/``token_ids`` fields, token-id prompts (single and batch),
vLLM's refusals, and the ``drop_after_tokens`` fault that cuts a stream at a chosen token.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from gateway.sim import EngineParams, SimConfig, SimServerThread
from gateway.sim import text as tx

MODEL = "sim-model"
SEED = 11
USER = [{"role": "user", "content": "tell me about the gateway"}]


@pytest.fixture(scope="module")
def sim() -> Iterator[SimServerThread]:
    """A fast simulator whose natural stops (EOS) fall within 6-40 tokens."""
    server = SimServerThread(
        SimConfig(
            model=MODEL,
            seed=7,
            stop_length_min=6,
            stop_length_max=40,
            engine=EngineParams(speed=20.0),
        )
    )
    server.start()
    yield server
    server.stop()


@pytest.fixture
def http(sim: SimServerThread) -> Iterator[httpx.Client]:
    """httpx on the simulator; puts the default faults back after the test."""
    with httpx.Client(base_url=sim.url or "", timeout=20) as c:
        yield c
        c.put("/sim/faults", json={})


@pytest.fixture
def client(sim: SimServerThread) -> Iterator[openai.OpenAI]:
    """The real openai SDK on the simulator (no retries)."""
    c = openai.OpenAI(base_url=f"{sim.url}/v1", api_key="unused", max_retries=0, timeout=20)
    yield c
    c.close()


def _events(resp: httpx.Response) -> list[dict[str, Any]]:
    """The JSON events of an SSE body; asserts it ends with ``[DONE]``."""
    lines = [ln for ln in resp.text.split("\n\n") if ln]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(ln.removeprefix("data: ")) for ln in lines[:-1]]


def _stream(http: httpx.Client, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    resp = http.post(
        path, json={**body, "stream": True, "stream_options": {"include_usage": True}}
    )
    assert resp.status_code == 200, resp.text
    return _events(resp)


def _completion_body(prompt: Any, max_tokens: int, **extra: Any) -> dict[str, Any]:
    return {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "seed": SEED,
        "return_token_ids": True,
        **extra,
    }


def _completion(http: httpx.Client, prompt: Any, max_tokens: int) -> dict[str, Any]:
    """Stream a completion; return its prompt ids, token ids, text, finish and usage."""
    events = _stream(http, "/v1/completions", _completion_body(prompt, max_tokens))
    choices = [e["choices"][0] for e in events if e["choices"]]
    return {
        "prompt_ids": choices[0]["prompt_token_ids"],
        "ids": [t for c in choices for t in c["token_ids"]],
        "text": "".join(c["text"] for c in choices),
        "finish": choices[-1]["finish_reason"],
        "usage": events[-1]["usage"],
    }


def test_completion_continued_from_token_ids_gives_the_rest_exactly(http: httpx.Client) -> None:
    whole = _completion(http, "the story of a stream", 200)
    assert whole["finish"] == "stop"  # a natural stop, within 6-40 tokens
    ids = whole["ids"]
    assert ids[-1] == 1 and whole["usage"]["completion_tokens"] == len(ids)  # EOS id last
    words = len(ids) - 1
    assert whole["prompt_ids"] and whole["usage"]["prompt_tokens"] == len(whole["prompt_ids"])
    for k in (1, 2, words // 2, words - 1, words):
        prefix = whole["prompt_ids"] + ids[:k]
        rest = _completion(http, prefix, 200 - k)
        assert rest["prompt_ids"] == prefix
        assert ids[:k] + rest["ids"] == ids, k
        assert rest["finish"] == "stop" and rest["usage"]["completion_tokens"] == len(ids) - k
        head = http.post("/detokenize", json={"tokens": ids[:k]}).json()["prompt"]
        assert head + rest["text"] == whole["text"], k


def test_completion_cut_by_length_continues_with_the_reduced_max_tokens(
    http: httpx.Client,
) -> None:
    whole = _completion(http, "ids", 5)  # EOS comes after 6 tokens or more: "length"
    assert whole["finish"] == "length" and len(whole["ids"]) == 5
    rest = _completion(http, whole["prompt_ids"] + whole["ids"][:3], 2)
    assert whole["ids"][:3] + rest["ids"] == whole["ids"] and rest["finish"] == "length"


def test_token_id_prompts_single_and_batch(http: httpx.Client) -> None:
    text = http.post("/v1/completions", json=_completion_body("hello world", 8)).json()
    ids = text["choices"][0]["prompt_token_ids"]
    same = http.post("/v1/completions", json=_completion_body(ids, 8)).json()
    assert same["choices"][0]["text"] == text["choices"][0]["text"]
    assert same["usage"]["prompt_tokens"] == len(ids)
    # A batch of token-id prompts, each a continuation of a different generation.
    a = _completion(http, "first prompt", 30)
    b = _completion(http, "second prompt here", 30)
    batch = http.post(
        "/v1/completions",
        json=_completion_body(
            [a["prompt_ids"] + a["ids"][:2], b["prompt_ids"] + b["ids"][:3]], 27
        ),
    ).json()
    got = sorted(batch["choices"], key=lambda c: c["index"])
    assert a["ids"][:2] + got[0]["token_ids"] == a["ids"]
    assert b["ids"][:3] + got[1]["token_ids"] == b["ids"]
    assert [c["prompt_token_ids"] for c in got] == [
        a["prompt_ids"] + a["ids"][:2],
        b["prompt_ids"] + b["ids"][:3],
    ]


def _chat_stream(client: openai.OpenAI, messages: list[Any], max_tokens: int,
                 **extra: Any) -> tuple[str, str | None, Any]:
    """Stream a chat with the SDK; return (text, finish_reason, usage)."""
    text, finish, usage = "", None, None
    for chunk in client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=max_tokens,
        temperature=0,
        seed=SEED,
        stream=True,
        stream_options={"include_usage": True},
        extra_body=extra,
    ):
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            text += c.delta.content or ""
            finish = c.finish_reason or finish
    return text, finish, usage


def test_chat_continue_final_message_continues_exactly(client: openai.OpenAI) -> None:
    whole, finish, usage = _chat_stream(client, USER, 200)
    assert finish == "stop" and usage is not None
    words = whole.split(" ")
    for k in (1, 3, len(words) - 1, len(words)):
        prefix = " ".join(words[:k])
        rest, rest_finish, rest_usage = _chat_stream(
            client,
            [*USER, {"role": "assistant", "content": prefix}],
            200 - k,
            continue_final_message=True,
            add_generation_prompt=False,
        )
        assert prefix + rest == whole, k
        assert rest_finish == "stop" and rest_usage is not None
        # the continuation's prompt is the original prompt plus the k generated tokens
        assert rest_usage.prompt_tokens == usage.prompt_tokens + k
        assert rest_usage.completion_tokens == usage.completion_tokens - k


def test_chat_prompt_token_ids_match_tokenize_with_continue_final_message(
    http: httpx.Client,
) -> None:
    msgs = [*USER, {"role": "assistant", "content": "the gateway"}]
    body = {"messages": msgs, "continue_final_message": True, "add_generation_prompt": False}
    tokenized = http.post("/tokenize", json=body).json()["tokens"]
    plain = http.post("/tokenize", json={"messages": USER}).json()["tokens"]
    assert tokenized[: len(plain)] == plain and len(tokenized) == len(plain) + 2
    out = http.post(
        "/v1/chat/completions",
        json={**body, "model": MODEL, "max_tokens": 3, "return_token_ids": True},
    ).json()
    assert out["prompt_token_ids"] == tokenized
    assert out["choices"][0]["message"]["role"] == "assistant"


def test_return_token_ids_in_chat_stream_and_answers(http: httpx.Client) -> None:
    body = {"model": MODEL, "messages": USER, "max_tokens": 6, "seed": SEED}
    plain = _stream(http, "/v1/chat/completions", body)
    assert plain[0]["prompt_token_ids"] is None
    assert all(c.get("token_ids") is None for e in plain for c in e["choices"])
    events = _stream(http, "/v1/chat/completions", {**body, "return_token_ids": True})
    assert events[-1]["choices"] == []  # the usage chunk
    events = events[:-1]
    prompt_ids = http.post("/tokenize", json={"messages": USER}).json()["tokens"]
    assert events[0]["prompt_token_ids"] == prompt_ids  # the role chunk
    assert "token_ids" not in events[0]["choices"][0]
    assert all("prompt_token_ids" not in e for e in events[1:])
    ids: list[int] = []
    for e in events[1:]:
        (choice,) = e["choices"]
        got = http.post("/detokenize", json={"tokens": choice["token_ids"]}).json()["prompt"]
        assert got == choice["delta"]["content"]
        ids += choice["token_ids"]
    assert len(ids) == 6
    answer = http.post("/v1/chat/completions", json={**body, "return_token_ids": True}).json()
    assert answer["prompt_token_ids"] == prompt_ids
    assert answer["choices"][0]["token_ids"] == ids
    off = http.post("/v1/chat/completions", json=body).json()
    assert off["prompt_token_ids"] is None and off["choices"][0]["token_ids"] is None


def test_return_token_ids_in_completion_stream(http: httpx.Client) -> None:
    events = _stream(http, "/v1/completions", _completion_body("hi there", 4))
    firsts = [e["choices"][0]["prompt_token_ids"] for e in events if e["choices"]]
    assert firsts[0] == http.post("/tokenize", json={"prompt": "hi there"}).json()["tokens"]
    assert all(p is None for p in firsts[1:])
    assert [len(e["choices"][0]["token_ids"]) for e in events if e["choices"]] == [1] * 4


def test_continue_final_message_refusals(http: httpx.Client) -> None:
    msgs = [*USER, {"role": "assistant", "content": "the"}]
    both = http.post(
        "/v1/chat/completions",
        json={"model": MODEL, "messages": msgs, "continue_final_message": True,
              "add_generation_prompt": True},
    )
    assert both.status_code == 400
    err = both.json()["error"]
    assert err["type"] == "Bad Request" and err["code"] == 400
    assert "Cannot set both `continue_final_message` and `add_generation_prompt` to True" in (
        err["message"]
    )
    default = http.post(
        "/v1/chat/completions",
        json={"model": MODEL, "messages": msgs, "continue_final_message": True},
    )
    assert default.status_code == 400
    assert default.json()["error"]["type"] == "BadRequestError"
    assert "not compatible" in default.json()["error"]["message"]
    tok = http.post("/tokenize", json={"messages": msgs, "continue_final_message": True,
                                        "add_generation_prompt": True})
    assert tok.status_code == 400
    # vLLM does not check the final message's role: a final user message is continued.
    body = {"messages": USER, "continue_final_message": True, "add_generation_prompt": False}
    user = http.post("/v1/chat/completions",
                     json={**body, "model": MODEL, "max_tokens": 2, "return_token_ids": True})
    assert user.status_code == 200
    assert user.json()["choices"][0]["message"]["role"] == "user"  # the final message's
    assert user.json()["prompt_token_ids"] == http.post("/tokenize", json=body).json()["tokens"]


def test_continuation_point_is_a_function_of_the_context() -> None:
    """Pure: appending the token generated from a context keeps its continuation point."""
    prompt = tx.tokenize("a fresh prompt")
    key, done = tx.continuation_point(SEED, prompt)
    assert (key, done) == (tx.prompt_key(prompt), 0)
    context = list(prompt)
    for k in range(12):
        assert tx.continuation_point(SEED, context) == (key, k)
        context.append(tx.generated_token_id(SEED, key, 0, k))
    assert tx.continuation_point(SEED + 1, context) == (tx.prompt_key(context), 0)


def test_drop_after_tokens_cuts_at_the_chosen_token_and_the_rest_continues(
    http: httpx.Client,
) -> None:
    whole = _completion(http, "a long answer", 12)
    for n in (1, 4):
        http.patch("/sim/faults", json={"drop_after_tokens": n})
        raw = b""
        with pytest.raises(httpx.HTTPError):  # the connection is cut, no chunked end
            with http.stream(
                "POST", "/v1/completions", json={**_completion_body("a long answer", 12),
                                                 "stream": True}
            ) as resp:
                for part in resp.iter_bytes():
                    raw += part
        assert b"[DONE]" not in raw
        events = [json.loads(x.removeprefix(b"data: ")) for x in raw.split(b"\n\n") if x]
        got = [t for e in events for t in e["choices"][0]["token_ids"]]
        assert got == whole["ids"][:n]
        http.put("/sim/faults", json={})
        rest = _completion(http, whole["prompt_ids"] + got, 12 - n)
        assert got + rest["ids"] == whole["ids"]
