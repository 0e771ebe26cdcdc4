"""The batcher in the real gateway: no wait at low load, flow control (a backend never gets
more than its capacity; the rest waits in the gateway), priority order when a place frees,
and the admission layer's 429 with Retry-After when the queue timeout passes."""

from __future__ import annotations

import threading
from typing import Any

import httpx
import openai
from prometheus_client.parser import text_string_to_metric_families

from tests.batching.conftest import MODEL
from tests.support.scripted import wait_for

PREDICTIVE = {"batcher": {"enabled": True}}


def sdk(url: str, priority: str | None = None) -> openai.OpenAI:
    headers = {"x-priority": priority} if priority else None
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=30,
                         default_headers=headers)


def samples(url: str, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    out = {}
    for fam in text_string_to_metric_families(httpx.get(url + "/metrics").text):
        for s in fam.samples:
            if s.name == name:
                out[tuple(sorted(s.labels.items()))] = s.value
    return out


def engine(sim_url: str) -> dict[str, Any]:
    return httpx.get(sim_url + "/sim/stats").json()["engine"]  # type: ignore[no-any-return]


HOLD_TOKENS = 500
"""The holder stream's length: 500 tokens of 10 ms, about 5 s, ample time (on a slow or
loaded machine too) for the requests under test to reach the gateway's queue before the
holder gives its backend place back."""


def long_stream(url: str, done: list[str]) -> threading.Thread:
    """A streaming request holding its backend for about 5 s (``HOLD_TOKENS`` tokens of
    10 ms)."""

    def run() -> None:
        stream = sdk(url).chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "long"}], max_tokens=HOLD_TOKENS,
            stream=True, extra_body={"ignore_eos": True})
        for _ in stream:
            pass
        done.append("long")

    t = threading.Thread(target=run)
    t.start()
    return t


def wait_running(sim_url: str, n: int) -> None:
    """Wait until the simulated engine runs ``n`` sequences."""
    assert wait_for(lambda: engine(sim_url)["running"] >= n, timeout=10, interval=0.01), (
        engine(sim_url))


def wait_queued(url: str, bucket: str) -> None:
    """Wait until a request waits in the gateway's queue for ``bucket``."""
    def queued() -> bool:
        return samples(url, "gateway_queue_depth").get((("bucket", bucket),), 0) >= 1

    assert wait_for(queued, timeout=10, interval=0.01), f"no {bucket} request queued"


def test_low_load_requests_are_dispatched_at_once(sim, batching_gateway) -> None:
    s = sim()
    gw = batching_gateway([("a", s.url, 16)], **PREDICTIVE)
    client = sdk(gw.url)
    for _ in range(5):
        client.completions.create(model=MODEL, prompt="hi", max_tokens=1)
    reasons = samples(gw.url, "gateway_batch_dispatches_total")
    assert reasons == {(("bucket", "normal"), ("reason", "forecast")): 5.0}


def test_flow_control_and_priority_order(sim, batching_gateway) -> None:
    s = sim()
    gw = batching_gateway([("a", s.url, 1)], **PREDICTIVE,  # the gateway lets 1 in at a time
                          auth={"anonymous_max_priority": "high"})
    done: list[str] = []
    holder = long_stream(gw.url, done)
    wait_running(s.url, 1)

    def short(prio: str) -> None:
        # 20 tokens (about 0.2 s on the backend): each answer ends well after the one served
        # before it, so the order of ``done`` is the order the backend served them in, not
        # the order the client threads happened to run in.
        sdk(gw.url, prio).completions.create(model=MODEL, prompt=prio, max_tokens=20,
                                             extra_body={"ignore_eos": True})
        done.append(prio)

    low = threading.Thread(target=short, args=("low",))
    low.start()
    wait_queued(gw.url, "low")  # low waits first ...
    high = threading.Thread(target=short, args=("high",))
    high.start()
    wait_queued(gw.url, "high")
    st = engine(s.url)
    assert (st["running"], st["waiting"]) == (1, 0)  # nothing piled on the backend
    assert samples(gw.url, "gateway_queue_depth")[(("bucket", "low"),)] == 1
    for t in (holder, low, high):
        t.join(20)
    assert done == ["long", "high", "low"]  # ... yet high goes first when the place frees


def test_queue_timeout_answers_429_with_retry_after(sim, batching_gateway) -> None:
    s = sim()
    gw = batching_gateway([("a", s.url, 1)], admission={"max_queue_wait_s": 0.3},
                          **PREDICTIVE)
    done: list[str] = []
    holder = long_stream(gw.url, done)
    wait_running(s.url, 1)
    r = httpx.post(gw.url + "/v1/completions",
                   json={"model": MODEL, "prompt": "hi", "max_tokens": 1}, timeout=10)
    assert r.status_code == 429
    assert float(r.headers["retry-after"]) >= 1
    assert r.json()["error"]["code"] == "rate_limit_exceeded"
    holder.join(20)
    assert done == ["long"]
    rejected = samples(gw.url, "gateway_admission_rejections_total")
    assert rejected[(("layer", "scheduler"), ("priority", "normal"))] == 1.0
