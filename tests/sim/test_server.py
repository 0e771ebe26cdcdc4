"""The simulator through real HTTP, with the real openai SDK as the client."""

from __future__ import annotations

import math
import time

import httpx
import openai
import pytest

from gateway.sim import SimConfig, SimServerThread
from tests.sim.conftest import MODEL

USER = [{"role": "user", "content": "hello world"}]


def metric(text: str, name: str, **labels: str) -> float:
    """Value of one sample in a Prometheus text page (0 if absent)."""
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        if all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_models_have_vllm_fields(client: openai.OpenAI, http: httpx.Client) -> None:
    ids = [m.id for m in client.models.list()]
    assert ids == [MODEL, "sim-lora"]
    data = http.get("/v1/models").json()["data"]
    base, lora = data
    assert base["owned_by"] == "vllm" and base["object"] == "model"
    assert base["root"] == MODEL and base["parent"] is None
    assert base["max_model_len"] == 4096
    assert base["permission"][0]["object"] == "model_permission"
    assert lora["parent"] == MODEL and lora["root"] == "/adapters/sim-lora"


def test_chat_non_stream(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model=MODEL, messages=USER, max_tokens=5, extra_body={"ignore_eos": True}
    )
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    assert r.choices[0].finish_reason == "length"
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content
    assert r.usage is not None
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (11, 5, 16)
    again = client.chat.completions.create(
        model=MODEL, messages=USER, max_tokens=5, extra_body={"ignore_eos": True}
    )
    assert again.choices[0].message.content == r.choices[0].message.content  # deterministic
    other = client.chat.completions.create(
        model=MODEL, messages=USER, max_tokens=5, seed=1, extra_body={"ignore_eos": True}
    )
    assert other.choices[0].message.content != r.choices[0].message.content


def test_chat_stream_without_and_with_usage(client: openai.OpenAI) -> None:
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=USER,
            max_tokens=4,
            stream=True,
            extra_body={"ignore_eos": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.usage is None for c in chunks)
    assert all(c.choices for c in chunks)
    assert chunks[-1].choices[0].finish_reason == "length"
    assert len(chunks) == 1 + 4
    text = "".join(c.choices[0].delta.content or "" for c in chunks)

    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=USER,
            max_tokens=4,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (11, 4)
    assert all(c.usage is None for c in chunks[:-1])
    assert "".join(c.choices[0].delta.content or "" for c in chunks[:-1]) == text


def test_stream_framing_is_lf_data_lines(http: httpx.Client) -> None:
    body = {"model": MODEL, "messages": USER, "max_tokens": 2, "stream": True, "ignore_eos": True}
    with http.stream("POST", "/v1/chat/completions", json=body) as r:
        raw = b"".join(r.iter_raw())
        assert r.headers["content-type"].startswith("text/event-stream")
        assert "connection" not in r.headers and "x-accel-buffering" not in r.headers
    assert b"\r" not in raw
    events = raw.split(b"\n\n")
    assert events[-1] == b"" and events[-2] == b"data: [DONE]"
    assert all(e.startswith(b"data: {") for e in events[:-2])


def test_completions(client: openai.OpenAI) -> None:
    r = client.completions.create(
        model=MODEL, prompt="hello world", max_tokens=3, extra_body={"ignore_eos": True}
    )
    assert r.object == "text_completion" and r.choices[0].finish_reason == "length"
    assert r.usage is not None and (r.usage.prompt_tokens, r.usage.completion_tokens) == (3, 3)
    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt="hello world",
            max_tokens=3,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    assert "".join(c.choices[0].text for c in chunks[:-1]) == r.choices[0].text
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 3
    two = client.completions.create(
        model=MODEL,
        prompt=["hello world", "hello"],
        max_tokens=2,
        n=2,
        extra_body={"ignore_eos": True},
    )
    assert [c.index for c in two.choices] == [0, 1, 2, 3]
    assert two.usage is not None and two.usage.completion_tokens == 8


def test_natural_stop_without_ignore_eos(client: openai.OpenAI) -> None:
    reasons = set()
    for i in range(6):
        r = client.completions.create(model=MODEL, prompt=f"question {i}", max_tokens=40)
        choice = r.choices[0]
        reasons.add(choice.finish_reason)
        assert r.usage is not None
        if choice.finish_reason == "stop":
            assert r.usage.completion_tokens < 40
        else:
            assert r.usage.completion_tokens == 40
    assert "stop" in reasons


def test_embeddings_base64_and_float(client: openai.OpenAI, http: httpx.Client) -> None:
    r = client.embeddings.create(model=MODEL, input="hello world")  # SDK sends base64
    vec = r.data[0].embedding
    assert len(vec) == 64 and math.isclose(sum(v * v for v in vec), 1.0, rel_tol=1e-5)
    assert r.usage.prompt_tokens == 3
    f = client.embeddings.create(model=MODEL, input="hello world", encoding_format="float")
    assert f.data[0].embedding == pytest.approx(vec)
    raw = http.post("/v1/embeddings", json={"model": MODEL, "input": "hello world"}).json()
    assert raw["object"] == "list" and raw["id"].startswith("embd-")
    assert raw["data"][0]["object"] == "embedding"
    many = client.embeddings.create(model=MODEL, input=["a", "b", "hello world"])
    assert [d.index for d in many.data] == [0, 1, 2]
    assert many.data[2].embedding == pytest.approx(vec)
    ids = client.embeddings.create(model=MODEL, input=[[1, 2, 3], [4, 5]])
    assert ids.usage.prompt_tokens == 5


def test_errors_have_vllm_shape(client: openai.OpenAI, http: httpx.Client) -> None:
    with pytest.raises(openai.NotFoundError) as nf:
        client.chat.completions.create(model="nope", messages=USER)
    assert nf.value.status_code == 404
    body = http.post("/v1/chat/completions", json={"model": "nope", "messages": USER}).json()
    assert body == {
        "error": {
            "message": f"The model `nope` does not exist. Valid aliases: {MODEL}.",
            "type": "NotFoundError",
            "param": "model",
            "code": 404,
        }
    }
    r = http.post("/v1/chat/completions", json={"model": MODEL})
    assert r.status_code == 400 and r.json()["error"]["param"] == "body.messages"
    r = http.post(
        "/v1/chat/completions", content=b"{bad", headers={"content-type": "application/json"}
    )
    assert r.status_code == 400 and r.json()["error"]["type"] == "Bad Request"
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=USER, max_tokens=10**6)


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/chat/completions",
         '{"model": "%s", "messages": [{"role": "user", "content": "\\ud800"}]}'),
        ("/v1/chat/completions",
         '{"model": "%s", "stream": true, "messages": [{"role": "user", "content": "a\\udc00"}]}'),
        ("/v1/completions", '{"model": "%s", "prompt": ["ok", "\\ud800"]}'),
        ("/v1/embeddings", '{"model": "%s", "input": "\\ud800"}'),
        ("/tokenize", '{"model": "%s", "prompt": "\\ud800"}'),
    ],
)
def test_lone_surrogate_is_a_400_not_a_crash(http: httpx.Client, path: str, body: str) -> None:
    """JSON may escape a lone UTF-16 surrogate, which no tokenizer can encode: a 400 in
    vLLM's error shape, never a 500."""
    r = http.post(path, content=(body % MODEL).encode(),
                  headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["type"] == "BadRequestError"
    assert "Unicode" in r.json()["error"]["message"]


def test_x_request_id_echo(http: httpx.Client) -> None:
    r = http.post(
        "/v1/completions",
        json={"model": MODEL, "prompt": "hi", "max_tokens": 1},
        headers={"x-request-id": "abc-123"},
    )
    assert r.headers["x-request-id"] == "abc-123" and r.json()["id"] == "cmpl-abc-123"
    assert len(http.get("/health").headers["x-request-id"]) == 32


def test_metrics_present_and_changing(client: openai.OpenAI, http: httpx.Client) -> None:
    page = http.get("/metrics")
    assert page.headers["content-type"].startswith("text/plain")
    names = [
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:prefix_cache_queries_total",
        "vllm:prefix_cache_hits_total",
        "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total",
        "vllm:request_success_total",
        "vllm:num_preemptions_total",
        "vllm:time_to_first_token_seconds_bucket",
        "vllm:inter_token_latency_seconds_bucket",
        "vllm:e2e_request_latency_seconds_bucket",
        "vllm:request_queue_time_seconds_bucket",
        "vllm:cache_config_info",
    ]
    for name in names:
        assert f"\n{name}{{" in page.text, name
    assert f'engine="0",model_name="{MODEL}"' in page.text
    before = page.text
    long_prompt = " ".join(["hello world"] * 40)
    for _ in range(2):
        client.completions.create(
            model=MODEL, prompt=long_prompt, max_tokens=3, extra_body={"ignore_eos": True}
        )
    after = http.get("/metrics").text
    for name in (
        "vllm:generation_tokens_total",
        "vllm:prompt_tokens_total",
        "vllm:prefix_cache_hits_total",
        "vllm:e2e_request_latency_seconds_count",
        "vllm:time_to_first_token_seconds_count",
    ):
        assert metric(after, name) > metric(before, name), name
    ok = metric(after, "vllm:request_success_total", finished_reason="length")
    assert ok - metric(before, "vllm:request_success_total", finished_reason="length") == 2


def test_rate_limit_fault_carries_retry_after(client: openai.OpenAI, faults: httpx.Client) -> None:
    cfg = faults.patch("/sim/faults", json={"rate_limit_rate": 1.0, "retry_after_s": 2}).json()
    assert cfg["rate_limit_rate"] == 1.0 and faults.get("/sim/faults").json() == cfg
    r = faults.post("/v1/chat/completions", json={"model": MODEL, "messages": USER})
    assert r.status_code == 429
    assert r.headers["retry-after"] == "2" and r.headers["retry-after-ms"] == "2000"
    assert r.json()["error"]["code"] == 429
    with pytest.raises(openai.RateLimitError):
        client.chat.completions.create(model=MODEL, messages=USER)


def test_error_fault_5xx(client: openai.OpenAI, faults: httpx.Client) -> None:
    faults.put("/sim/faults", json={"error_rate": 1.0, "error_status": 503})
    with pytest.raises(openai.InternalServerError) as exc:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=2)
    assert exc.value.status_code == 503
    assert faults.get("/sim/stats").json()["faults_injected"]["error"] >= 1
    faults.put("/sim/faults", json={"error_rate": 0.5, "seed": 3})
    codes = [
        faults.post(
            "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 1}
        ).status_code
        for _ in range(20)
    ]
    assert set(codes) == {200, 500}
    faults.put("/sim/faults", json={"error_rate": 0.5, "seed": 3})
    again = [
        faults.post(
            "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 1}
        ).status_code
        for _ in range(20)
    ]
    assert again == codes  # same seed, same dice


def test_drop_mid_stream_makes_sdk_raise(client: openai.OpenAI, faults: httpx.Client) -> None:
    faults.patch("/sim/faults", json={"drop_after_chunks": 2})
    got = []
    with pytest.raises((httpx.HTTPError, openai.APIError)):
        for chunk in client.chat.completions.create(
            model=MODEL,
            messages=USER,
            max_tokens=20,
            stream=True,
            extra_body={"ignore_eos": True},
        ):
            got.append(chunk)
    assert len(got) == 2
    with pytest.raises(openai.APIConnectionError):
        client.completions.create(model=MODEL, prompt="hi", max_tokens=2)
    deadline = time.monotonic() + 2
    while faults.get("/sim/stats").json()["engine"]["running"] and time.monotonic() < deadline:
        time.sleep(0.02)
    assert faults.get("/sim/stats").json()["engine"]["running"] == 0


def test_hang_and_added_latency(client: openai.OpenAI, faults: httpx.Client) -> None:
    faults.patch("/sim/faults", json={"hang": True})
    t0 = time.monotonic()
    with pytest.raises(openai.APITimeoutError):
        client.with_options(timeout=0.5).chat.completions.create(model=MODEL, messages=USER)
    assert time.monotonic() - t0 >= 0.5
    deadline = time.monotonic() + 2
    while faults.get("/sim/stats").json()["open_requests"] and time.monotonic() < deadline:
        time.sleep(0.02)
    assert faults.get("/sim/stats").json()["open_requests"] == 0  # gave up with the client
    faults.put("/sim/faults", json={"added_latency_s": 0.3})
    t0 = time.monotonic()
    client.completions.create(model=MODEL, prompt="hi", max_tokens=1)
    assert time.monotonic() - t0 >= 0.3


def test_unhealthy(faults: httpx.Client) -> None:
    assert faults.get("/health").status_code == 200
    faults.patch("/sim/faults", json={"unhealthy": True})
    assert faults.get("/health").status_code == 503
    assert faults.patch("/sim/faults", json={"error_rate": 7}).status_code == 400


def test_disconnect_aborts_request(http: httpx.Client) -> None:
    before = http.get("/sim/stats").json()["aborted"]
    body = {"model": MODEL, "prompt": "x", "max_tokens": 3000, "ignore_eos": True, "stream": True}
    with (
        httpx.Client(base_url=str(http.base_url)) as c,
        c.stream("POST", "/v1/completions", json=body) as r,
    ):
        lines = r.iter_lines()
        for _ in range(3):
            next(lines)
        assert "vllm:num_requests_running{" in http.get("/metrics").text
        assert metric(http.get("/metrics").text, "vllm:num_requests_running") == 1
    t0 = time.monotonic()
    while metric(http.get("/metrics").text, "vllm:num_requests_running") != 0:
        # 3000 tokens take tens of seconds; 3 s leaves room for a loaded machine
        assert time.monotonic() - t0 < 3.0, "running did not drop within 3 s"
        time.sleep(0.01)
    stats = http.get("/sim/stats").json()
    assert stats["aborted"] == before + 1 and stats["open_requests"] == 0


def test_non_stream_disconnect_aborts(http: httpx.Client) -> None:
    body = {"model": MODEL, "prompt": "x", "max_tokens": 3000, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(str(http.base_url) + "/v1/completions", json=body, timeout=0.3)
    t0 = time.monotonic()
    while metric(http.get("/metrics").text, "vllm:num_requests_running") != 0:
        assert time.monotonic() - t0 < 3.0, "running did not drop within 3 s"
        time.sleep(0.01)


def test_reset_prefix_cache_sleep_wake(client: openai.OpenAI, http: httpx.Client) -> None:
    assert http.post("/reset_prefix_cache").json() == {"success": True}
    assert http.get("/is_sleeping").json() == {"is_sleeping": False}
    assert http.post("/sleep").json() == {"status": "sleeping", "level": 1}
    assert http.get("/is_sleeping").json() == {"is_sleeping": True}
    page = http.get("/metrics").text
    assert metric(page, "vllm:engine_sleep_state", sleep_state="awake") == 0
    with pytest.raises(openai.InternalServerError) as exc:
        client.chat.completions.create(model=MODEL, messages=USER, max_tokens=2)
    assert exc.value.status_code == 503
    assert http.post("/wake_up").json() == {"status": "awake", "tags": None}
    assert http.get("/is_sleeping").json() == {"is_sleeping": False}
    client.chat.completions.create(model=MODEL, messages=USER, max_tokens=2)


def test_sleep_aborts_running_streams(http: httpx.Client) -> None:
    body = {"model": MODEL, "prompt": "x", "max_tokens": 3000, "ignore_eos": True, "stream": True}
    with (
        httpx.Client(base_url=str(http.base_url)) as c,
        c.stream("POST", "/v1/completions", json=body) as r,
    ):
        lines = r.iter_lines()
        next(lines)
        http.post("/sleep")
        rest = [ln for ln in lines if ln]
    http.post("/wake_up")
    assert rest[-1] == "data: [DONE]" and '"finish_reason":"abort"' in rest[-2]


def test_tokenize_detokenize(http: httpx.Client) -> None:
    r = http.post("/tokenize", json={"model": MODEL, "prompt": "hello world"}).json()
    assert r["count"] == 3 and r["max_model_len"] == 4096 and r["token_strs"] is None
    chat = http.post("/tokenize", json={"model": MODEL, "messages": USER}).json()
    assert chat["count"] == 11
    text = http.post("/detokenize", json={"model": MODEL, "tokens": r["tokens"]}).json()
    assert text == {"prompt": "<|begin_of_text|>hello world"}


def test_other_vllm_routes(http: httpx.Client) -> None:
    assert http.get("/ping").status_code == 200
    assert http.get("/version").json() == {"version": "0.32.0"}
    assert http.get("/load").json() == {"server_load": 0}
    assert http.get("/v1/nothing").json() == {"detail": "Not Found"}


def test_stats_record_what_the_backend_got(http: httpx.Client) -> None:
    http.delete("/sim/stats")
    body = {
        "model": "sim-lora",
        "prompt": "hi",
        "max_tokens": 1,
        "top_k": 5,
        "guided_json": {"type": "object"},
    }
    assert http.post("/v1/completions", json=body).json()["model"] == "sim-lora"
    stats = http.get("/sim/stats").json()
    assert stats["requests_by_path"]["/v1/completions"] == 1
    assert stats["recent_requests"][-1]["body"] == body


def test_api_key_like_vllm() -> None:
    with SimServerThread(SimConfig(api_key="sekret")) as url:
        denied = httpx.get(url + "/v1/models")
        assert denied.status_code == 401 and denied.json() == {"error": "Unauthorized"}
        assert (
            httpx.get(url + "/v1/models", headers={"Authorization": "Bearer x"}).status_code == 401
        )
        for path in ("/health", "/ping", "/metrics", "/version"):
            assert httpx.get(url + path).status_code == 200, path
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0).models.list()
        ok = openai.OpenAI(base_url=url + "/v1", api_key="sekret", max_retries=0)
        assert [m.id for m in ok.models.list()] == ["demo-model"]


async def test_run_sim_server_in_current_loop() -> None:
    from gateway.sim import run_sim_server

    async with run_sim_server(SimConfig(model="m2"), port=0) as url:
        assert not url.endswith(":0")
        async with httpx.AsyncClient(base_url=url) as c:
            r = await c.post(
                "/v1/chat/completions",
                json={"model": "m2", "messages": USER, "max_tokens": 2, "stream": True},
            )
            assert r.text.endswith("data: [DONE]\n\n")
