"""Issue 13's wire-contract kinds against REAL vLLM servers (CPU build, tiny random model).

Two vLLM servers of the same model (``a`` plain, ``b`` with ``--api-key``), both with the
Responses API store on (``VLLM_ENABLE_RESPONSES_API_STORE=1``, set in ``conftest.py``), behind
one gateway with ``round_robin`` routing, so that a request routed without regard to where
its state lives lands on the other backend half the time. Checked here: the Responses API's
follow-ups and by-id calls reach the backend that holds the response, the Responses API's
usage (``input_tokens`` / ``output_tokens``) is counted, and vLLM's own error answers reach
the client as vLLM sent them.
"""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.realvllm.conftest import BACKEND_KEY
from tests.support.scripted import wait_for
from tests.support.servers import GatewayThread, gateway_config

pytestmark = pytest.mark.realvllm

MODEL = "tiny-llama"


@pytest.fixture(scope="module")
def pair(real_vllm):
    a, b = real_vllm["a"], real_vllm["b"]
    cfg = gateway_config(
        [{"id": "vllm-a", "url": a.url, "max_num_seqs": 16},
         {"id": "vllm-b", "url": b.url, "max_num_seqs": 16, "api_key": BACKEND_KEY}],
        routing={"policy": "round_robin"},
    )
    gw = GatewayThread(cfg)
    gw.start()
    gw.wait_ready(timeout=30, routable=2)
    yield gw, a, b
    gw.stop()


@pytest.fixture
def client(pair):
    gw, _, _ = pair
    return openai.OpenAI(base_url=gw.url + "/v1", api_key="none", max_retries=0)


def test_responses_follow_ups_reach_the_backend_that_holds_the_response(client):
    ids = [client.responses.create(model=MODEL, input="hi", max_output_tokens=3).id
           for _ in range(6)]
    for rid in ids:
        follow = client.responses.create(
            model=MODEL, input="and then?", max_output_tokens=3, previous_response_id=rid)
        assert follow.previous_response_id == rid
        assert client.responses.retrieve(rid).id == rid
        assert client.responses.retrieve(follow.id).id == follow.id


def test_streamed_response_is_remembered_for_its_follow_up(client):
    for _ in range(4):
        events = list(client.responses.create(model=MODEL, input="hi", max_output_tokens=3,
                                              stream=True))
        assert events[0].type == "response.created", events[0]
        assert events[-1].type == "response.completed", events[-1]
        rid = events[0].response.id
        follow = client.responses.create(
            model=MODEL, input="more", max_output_tokens=3, previous_response_id=rid)
        assert follow.previous_response_id == rid


def test_responses_usage_is_counted(pair, client):
    gw, _, _ = pair
    tokens = gw.gateway.metrics.tokens
    before = (tokens.labels(MODEL, "prompt")._value.get(),
              tokens.labels(MODEL, "completion")._value.get())
    r = client.responses.create(model=MODEL, input="count me", max_output_tokens=4)
    assert r.usage is not None and r.usage.output_tokens > 0
    assert wait_for(lambda: (
        tokens.labels(MODEL, "prompt")._value.get() - before[0] == r.usage.input_tokens
        and tokens.labels(MODEL, "completion")._value.get() - before[1]
        == r.usage.output_tokens), timeout=10)


@pytest.mark.parametrize("stream", [False, True])
def test_vllm_error_answer_reaches_client_as_sent(pair, stream):
    """vLLM's own 400 (``max_tokens`` beyond ``max_model_len``) and 404 (an unknown
    ``previous_response_id``): the same status, body and content type through the gateway
    as straight from vLLM."""
    gw, a, _ = pair
    bodies = [
        ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                                  "max_tokens": 100000, "stream": stream}),
        ("/v1/responses", {"model": MODEL, "input": "x", "max_output_tokens": 3,
                           "previous_response_id": "resp_does_not_exist", "stream": stream}),
    ]
    for path, body in bodies:
        direct = httpx.post(a.url + path, json=body, timeout=30)
        via = httpx.post(gw.url + path, json=body, timeout=30)
        assert direct.status_code >= 400, (path, direct.text)
        assert (via.status_code, via.content) == (direct.status_code, direct.content), path
        assert via.headers["content-type"] == direct.headers["content-type"]
