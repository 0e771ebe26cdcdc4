"""Fuzzed backends (issue 20): arbitrary SSE bytes in a stream, arbitrary non-stream answers
(status, headers, body), arbitrary Prometheus expositions at ``/metrics`` and arbitrary
``/v1/models`` answers, from scripted backends (:mod:`tests.fuzz.backend_rig`). The client
gets the backend's answer relayed, or a clear OpenAI-shaped error of the gateway's own (a
502 / 503 / 504 for a backend's failure; never a 500 the backend did not send, never a
traceback); afterwards nothing is held, the probe, scrape and models loops still run, and
once the backends answer well again both are routable and serve."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from tests.fuzz.backend_rig import BackendRig
from tests.fuzz.budget import examples
from tests.fuzz.oracle import assert_settled, check_answer, no_slot_held
from tests.fuzz.strategies import JSON, TEXT
from tests.support.scripted import chunk_obj, wait_for

SEPS = st.sampled_from([b"\n\n", b"\r\n\r\n", b"\r\r", b"\n", b""])


def _data(obj: object) -> bytes:
    return json.dumps(obj).encode()


CHUNKS = st.builds(
    lambda content, finish, extra: {**chunk_obj(content=content, finish=finish), **extra},
    TEXT | st.none(), st.sampled_from([None, "stop", "length"]) | TEXT,
    st.dictionaries(st.sampled_from(["usage", "choices", "id", "model", "object", "error"]),
                    JSON, max_size=2))
EVENTS = st.one_of(
    st.tuples(st.just(b"data: "), CHUNKS.map(_data), SEPS),
    st.tuples(st.just(b"data: "), JSON.map(_data), SEPS),
    st.tuples(st.sampled_from([b"data: ", b"data:", b"event: error\ndata: ", b": ", b"id: 1\n"
                               b"data: ", b"retry: x\ndata: "]),
              st.sampled_from([b"[DONE]", b"{", b"", b'{"error": {"message": "x", "code": 500}}',
                               b'{"error": 1}', b'{"object": "error", "code": "x"}',
                               b'"\\ud800"']), SEPS),
    st.tuples(st.just(b""), st.binary(max_size=40), SEPS),
).map(b"".join)

STATUSES = st.sampled_from([200, 200, 201, 204, 400, 404, 422, 429, 500, 502, 503, 504])
HEADERS = st.lists(st.tuples(
    st.sampled_from(["retry-after", "retry-after-ms", "x-ratelimit-remaining-requests",
                     "x-should-retry", "content-encoding", "x-request-id", "x-a"]),
    st.sampled_from(["0", "-1", "nan", "inf", "1e400", "0.05", "", "abc", "gzip", "\u00e9"])
), max_size=2)
BODIES = st.one_of(
    JSON.map(_data),
    st.builds(lambda extra: _data({**json.loads(_data(chunk_obj("x"))), **extra}),
              st.dictionaries(st.sampled_from(["usage", "choices", "id", "model", "error",
                                                "data"]), JSON, max_size=2)),
    st.binary(max_size=60),
    st.sampled_from([b"", b"{", b"null", b"[]", b'{"usage": {"prompt_tokens": 1e400}}',
                     b'{"usage": {"prompt_tokens": -5, "completion_tokens": "x"}}',
                     b"\xff\xfe", b'{"error": {"message": "\\ud800"}}']),
)
CTYPES = st.sampled_from(["application/json", "text/plain", "text/event-stream", "",
                          "application/json; charset=latin-1"])
ENDPOINTS = st.sampled_from([("/v1/chat/completions", {"messages": [{"role": "user",
                                                                       "content": "hi"}]}),
                             ("/v1/completions", {"prompt": "hi"}),
                             ("/v1/embeddings", {"input": "hi"})])


@pytest.fixture(scope="module")
def rig() -> Iterator[BackendRig]:
    r = BackendRig()
    try:
        yield r
    finally:
        r.stop()


def ask(rig: BackendRig, endpoint: str, body: dict[str, object]) -> None:
    """One request; the oracle on its answer (a backend failure may be the gateway's 502 /
    503 / 504); no slot left held."""
    with rig.http.stream("POST", rig.url + endpoint, json={"model": "m1", **body}) as r:
        data = b"".join(r.iter_raw())  # as sent: a relayed content-encoding is not decoded
        status, headers = r.status_code, dict(r.headers)
    check_answer(status, headers, data, backend_side=True, relayed=rig.relayed)
    no_slot_held(rig.http, rig.url)


@given(events=st.lists(EVENTS, max_size=6), end=st.sampled_from(["end", "fin", "rst"]),
       done=st.booleans(), completions=st.booleans())
@examples(50)
# a stream cut after text holding a lone surrogate, continued on the other backend: the
# continuation's body and its stitched events are re-encoded (gateway/core/wire_json.py)
@example(events=[b"data: " + _data(chunk_obj(role="assistant", content="")) + b"\n\n",
                 b"data: " + _data(chunk_obj(content="\ud800")) + b"\n\n"],
         end="fin", done=False, completions=False)
def test_stream_bytes(rig: BackendRig, events: list[bytes], end: str, done: bool,
                      completions: bool) -> None:
    rig.answers.reset()
    rig.answers.stream = events + ([b"data: [DONE]\n\n"] if done else [])
    rig.answers.end = end  # type: ignore[assignment]
    endpoint, body = (("/v1/completions", {"prompt": "hi"}) if completions else
                      ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}))
    ask(rig, endpoint, {**body, "stream": True, "max_tokens": 4})


@given(status=STATUSES, headers=HEADERS, body=BODIES, ctype=CTYPES, case=ENDPOINTS)
@examples(50)
@example(status=200, headers=[("content-encoding", "gzip")], body=b"{}",  # relayed as sent
         ctype="application/json", case=("/v1/embeddings", {"input": "hi"}))
def test_answers(rig: BackendRig, status: int, headers: list[tuple[str, str]], body: bytes,
                 ctype: str, case: tuple[str, dict[str, object]]) -> None:
    rig.answers.reset()
    a = rig.answers
    a.status, a.headers, a.body, a.ctype = status, headers, body, ctype
    ask(rig, case[0], {**case[1], "max_tokens": 4})


METRIC_NAMES = st.sampled_from([
    b"vllm:num_requests_running", b"vllm:num_requests_waiting", b"vllm:kv_cache_usage_perc",
    b"vllm:gpu_cache_usage_perc", b"vllm:prefix_cache_queries_total",
    b"vllm:prefix_cache_hits_total", b"process_start_time_seconds",
    b"vllm:num_preemptions_total", b"vllm:time_to_first_token_seconds_bucket", b"x"])
METRIC_VALUES = st.sampled_from([b"0", b"1", b"-1", b"NaN", b"+Inf", b"-Inf", b"1e400",
                                 b"1e308", b"0x10", b"", b"1 2 3", b"99999999999999999999"]) | \
    st.floats().map(lambda f: repr(f).encode())
LABELS = st.sampled_from([b"", b'{engine="0"}', b'{engine="1",model_name="m1"}', b"{",
                          b'{le="+Inf"}', b'{engine="\\"}', b'{model_name="\xff"}'])
EXPOSITIONS = st.lists(st.one_of(
    st.tuples(METRIC_NAMES, LABELS, st.just(b" "), METRIC_VALUES).map(b"".join),
    st.sampled_from([b"# TYPE vllm:num_requests_running gauge", b"# HELP x \xff", b"#",
                     b"vllm:num_requests_running", b"\x00", b" " * 3]),
    st.binary(max_size=30),
), max_size=8).map(lambda lines: b"\n".join(lines) + b"\n")
MODELS = st.one_of(
    JSON.map(_data),
    st.builds(lambda data: _data({"object": "list", "data": data}),
              st.lists(st.one_of(JSON, st.fixed_dictionaries({"id": JSON | TEXT}),
                                 st.fixed_dictionaries({"id": st.just("m1"),
                                                        "max_model_len": JSON})), max_size=3)),
    st.binary(max_size=40),
)


def scraped_after(rig: BackendRig, path: str) -> None:
    """Wait until each backend has answered a request for ``path`` that arrived after now
    (so with the example's answer)."""
    seen = [sum(1 for r in b.requests if r.path == path) for b in rig.backends]

    def answered() -> bool:
        for b, n in zip(rig.backends, seen, strict=True):
            asked = [r for r in b.requests if r.path == path]
            if len(asked) <= n or asked[n].finished_at is None:
                return False
        return True

    assert wait_for(answered, 20, interval=0.005), path


@given(metrics=EXPOSITIONS, status=st.sampled_from([200, 200, 200, 500, 404]),
       models=MODELS, models_status=st.sampled_from([200, 200, 200, 401, 500]))
@examples(20)
def test_control_plane(rig: BackendRig, metrics: bytes, status: int, models: bytes,
                       models_status: int) -> None:
    """Whatever ``/metrics`` and ``/v1/models`` say, the gateway's own pages answer and a
    request gets an answer by the oracle (a model no backend lists: the gateway's 404)."""
    rig.answers.reset()
    a = rig.answers
    a.metrics, a.metrics_status, a.models, a.models_status = metrics, status, models, models_status
    scraped_after(rig, "/metrics")
    scraped_after(rig, "/v1/models")
    for path in ("/admin/backends", "/metrics", "/v1/models", "/ready/fleet", "/status.json"):
        r = rig.http.get(rig.url + path)
        check_answer(r.status_code, dict(r.headers), r.content, backend_side=True)
    ask(rig, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                      "max_tokens": 4})


def test_settled_after_backends(rig: BackendRig) -> None:
    """Once the backends answer well again: both routable, loops running, served."""
    rig.answers.reset()
    scraped_after(rig, "/v1/models")
    assert_settled(rig.http, rig.url, rig.plain)
    # the fuzzed answers were met: both backends answered data-plane requests
    assert all(len(b.data_requests) >= 20 for b in rig.backends), \
        [len(b.data_requests) for b in rig.backends]


def test_gateway_models_page(rig: BackendRig) -> None:
    """(a plain check that the healthy rig lists ``m1``: the control-plane test's
    ``/v1/models`` answers are not all errors because the rig is broken)."""
    rig.answers.reset()
    r = httpx.get(rig.url + "/v1/models", timeout=20)
    assert r.status_code == 200 and "m1" in r.text, r.text
