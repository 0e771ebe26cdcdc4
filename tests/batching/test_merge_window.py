"""The embeddings merge window (Nagle's algorithm with a window, see gateway.flow.batching) in
the real gateway, with the predictive batcher's defaults: at low load each request goes
upstream alone and at once; under load a backend never has more than ``merge_window``
embeddings requests in flight, the rest merge, every client gets its own vector, and
nothing stays counted once the load is gone. Also: a merged completions request takes one
place per prompt (flow control counts sequences), so it never exceeds the backend's
capacity."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import openai

from tests.batching.conftest import MODEL
from tests.batching.test_flow import samples
from tests.batching.test_merging import concurrently, direct, normalised, upstream_count
from tests.support.scripted import wait_for

PREDICTIVE = {"batcher": {"enabled": True}}


def sdk(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=30)


@contextlib.contextmanager
def peak_of(read: Callable[[], int], period_s: float) -> Iterator[list[int]]:
    """Samples ``read()`` every ``period_s`` in a thread while the block runs; yields a
    one-item list that holds the highest value seen."""
    peak = [0]
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], read())
            time.sleep(period_s)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        yield peak
    finally:
        stop.set()
        watcher.join()


def engine_sequences(sim_url: str) -> int:
    """Sequences the simulated engine holds now (running + waiting)."""
    st = httpx.get(sim_url + "/sim/stats").json()["engine"]
    return int(st["running"] + st["waiting"])


def test_low_load_embeddings_go_alone_and_at_once(sim, batching_gateway) -> None:
    s = sim(request_overhead_s=0.005)
    gw = batching_gateway([("a", s.url, 16)], **PREDICTIVE)
    client = sdk(gw.url)
    before = upstream_count(s, "/v1/embeddings")
    for i in range(6):
        r = client.embeddings.create(model=MODEL, input=f"one at a time {i}")
        assert len(r.data) == 1
    assert upstream_count(s, "/v1/embeddings") - before == 6  # nothing held to merge
    wait = samples(gw.url, "gateway_batch_wait_seconds_sum")[(("bucket", "normal"),)]
    # held for the wait budget (10 ms) they would have waited >= 60 ms in all
    assert wait < 0.03


def test_under_load_the_window_bounds_upstream_and_the_rest_merge(sim, batching_gateway) -> None:
    # a serial API-server frontend of 20 ms per request + 1 ms per input: one backend
    # takes about 50 unmerged requests/s
    s = sim(request_overhead_s=0.02, input_overhead_s=0.001)
    gw = batching_gateway([("a", s.url, 256)], **PREDICTIVE)
    window = gw.cfg.batcher.merge_window
    client = sdk(gw.url)
    before = upstream_count(s, "/v1/embeddings")
    texts = [f"text {i}" for i in range(24 * 5)]

    def worker(w: int) -> list[tuple[str, list[float]]]:
        out = []
        for j in range(5):
            text = texts[w * 5 + j]
            r = client.embeddings.create(model=MODEL, input=text, encoding_format="float")
            assert [d.index for d in r.data] == [0]
            out.append((text, r.data[0].embedding))
        return out

    backend = gw.gateway.fleet.backends[0]  # the gateway's own count of what is upstream
    with peak_of(lambda: backend.in_flight, 0.0005) as peak:
        got = [pair for chunk in concurrently(worker, 24) for pair in chunk]
    upstream = upstream_count(s, "/v1/embeddings") - before
    assert len(got) == 120
    assert peak[0] <= window  # never more than the window upstream at once
    assert upstream <= 120 / 3  # most requests rode in a merged one
    # each client got its own text's vector (spot check against the backend alone)
    for text, vec in got[::17]:
        alone = direct(s, "/v1/embeddings", {"model": MODEL, "input": text,
                                              "encoding_format": "float"}).json()
        assert alone["data"][0]["embedding"] == vec
    # nothing left counted: the window and the merged-sequence correction are back at 0
    disp = gw.gateway.batching
    assert disp is not None
    assert wait_for(lambda: not disp.merge_flight and not backend.in_flight, 5, 0.01), (
        disp.merge_flight, backend.in_flight)
    assert backend.pooled_extra == 0
    assert not disp.pending


def test_merged_completions_take_a_place_per_prompt(sim, batching_gateway) -> None:
    s = sim(max_num_seqs=4)
    cfg: dict[str, Any] = {
        "batcher": {"enabled": True, "predictive": False,
                    "normal": {"max_batch_size": 8, "max_wait_ms": 1500}},
    }
    gw = batching_gateway([("a", s.url, 4)], **cfg)  # 4 places
    client = sdk(gw.url)
    prompts = [[[21 + i] * 3] for i in range(8)]
    params = {"max_tokens": 20, "temperature": 0.0}
    before = upstream_count(s, "/v1/completions")

    def call(i: int) -> bytes:
        raw = client.completions.with_raw_response.create(
            model=MODEL, prompt=prompts[i], extra_body={"ignore_eos": True}, **params
        )
        return raw.http_response.content

    with peak_of(lambda: engine_sequences(s.url), 0.005) as peak:
        bodies = concurrently(call, 8)
    upstream = upstream_count(s, "/v1/completions") - before
    assert 2 <= upstream < 8  # merged, but at most 4 prompts at a time
    assert peak[0] <= 4  # the backend never held more sequences than its capacity
    for i, body in enumerate(bodies):
        alone = direct(s, "/v1/completions", {"model": MODEL, "prompt": prompts[i],
                                               "ignore_eos": True, **params})
        assert normalised(body) == normalised(alone.content)


def test_a_merged_request_slower_than_the_queue_timeout_still_answers(
    sim, batching_gateway
) -> None:
    """The queue timeout (admission.max_queue_wait_s) bounds the wait in the gateway's
    queue, not the time a merged request then spends upstream: its members get their
    answers, not a 429 (the review found 429s after 10 s for merged requests that
    completed)."""
    s = sim()
    httpx.patch(s.url + "/sim/faults", json={"added_latency_s": 1.5})
    # the 4 requests go out together (a barrier) and fill the batch; the wait budget only
    # has to cover a slow thread start, and stays below the queue timeout, which stays
    # below the upstream latency
    cfg: dict[str, Any] = {
        "batcher": {"enabled": True, "predictive": False,
                    "normal": {"max_batch_size": 4, "max_wait_ms": 800}},
        "admission": {"max_queue_wait_s": 1.2},
    }
    gw = batching_gateway([("a", s.url, 16)], **cfg)
    client = sdk(gw.url)
    embeddings = client.embeddings  # (the SDK's lazy resource, before the barrier)
    before = upstream_count(s, "/v1/embeddings")
    start = threading.Barrier(4, timeout=10)

    def call(i: int) -> int:
        start.wait()
        return embeddings.create(model=MODEL, input=f"slow {i}").data[0].index

    got = concurrently(call, 4)
    assert got == [0, 0, 0, 0]
    assert upstream_count(s, "/v1/embeddings") - before == 1  # they did ride together


def test_list_prompts_take_a_place_each(sim, batching_gateway) -> None:
    s = sim(max_num_seqs=4)
    cfg: dict[str, Any] = {
        "batcher": {"enabled": True, "predictive": False,
                    "normal": {"max_batch_size": 8, "max_wait_ms": 300}},
    }
    gw = batching_gateway([("a", s.url, 4)], **cfg)
    client = sdk(gw.url)
    with peak_of(lambda: engine_sequences(s.url), 0.005) as peak:
        outs = concurrently(
            lambda i: len(client.completions.create(
                model=MODEL, prompt=[[30 + i] * 3, [40 + i] * 3], max_tokens=15,
                extra_body={"ignore_eos": True}).choices), 6)
    assert outs == [2] * 6
    assert peak[0] <= 4  # 12 prompts, never more than the backend's 4 sequences at once


def test_embeddings_that_cannot_merge_are_not_held_by_the_window(
    sim, batching_gateway
) -> None:
    """The window is per merge key: requests that differ (here each its own ``user``) can
    never merge, so none waits for another's answer."""
    s = sim(request_overhead_s=0.0, input_overhead_s=0.0)
    httpx.patch(s.url + "/sim/faults", json={"added_latency_s": 0.3})
    gw = batching_gateway([("a", s.url, 64)], **PREDICTIVE)
    client = sdk(gw.url)
    t0 = time.monotonic()
    concurrently(
        lambda i: client.embeddings.create(model=MODEL, input="x", user=f"user-{i}"), 12
    )
    # 12 at once, each alone upstream: about one 0.3 s answer, not 12 of them in a row
    # (3.6 s when the window held them one at a time)
    assert time.monotonic() - t0 < 1.8


def test_merged_members_keep_the_backend_headers(sim, batching_gateway) -> None:
    """A member's answer carries the headers an answer sent alone through the gateway does
    (the backend's, as the gateway forwards them), with its own request id."""
    s = sim()
    cfg: dict[str, Any] = {
        "batcher": {"enabled": True, "predictive": False,
                    "normal": {"max_batch_size": 4, "max_wait_ms": 1500}},
    }
    gw = batching_gateway([("a", s.url, 16)], **cfg)
    before = upstream_count(s, "/v1/embeddings")

    def call(i: int) -> httpx.Response:
        return httpx.post(gw.url + "/v1/embeddings", json={"model": MODEL, "input": f"h {i}"},
                          headers={"x-request-id": f"member-{i}"}, timeout=30)

    merged = concurrently(call, 4)
    assert upstream_count(s, "/v1/embeddings") - before == 1
    alone = call(9)  # alone in its batch (after the 1.5 s wait): sent unmerged
    assert upstream_count(s, "/v1/embeddings") - before == 2
    expected = {k.lower() for k in alone.headers}
    assert {"content-type", "vary"} <= expected  # the simulator's, as vLLM's FastAPI
    for i, r in enumerate(merged):
        assert r.status_code == 200
        assert expected <= {k.lower() for k in r.headers}
        assert r.headers["x-request-id"] == f"member-{i}"
        assert int(r.headers["content-length"]) == len(r.content)


def test_a_request_needing_many_places_is_not_starved_by_small_ones(
    sim, batching_gateway
) -> None:
    """One backend of 8 places, kept full by 16 closed-loop chat clients (one place each).
    A completions request of 9 prompts needs the whole backend (more than its capacity:
    only an idle backend takes it). Once it has waited its wait budget, the backend is
    kept for it: the small requests stop taking the places that free, it drains, and the
    big request is served, long before the queue timeout (it got 429 "No capacity freed
    within 10 s" when every freed place went to the small requests behind it)."""
    s = sim(max_num_seqs=8)
    gw = batching_gateway([("a", s.url, 8)], **PREDICTIVE)
    client = sdk(gw.url)
    stop = threading.Event()
    served = [0]

    def chat() -> None:
        c = sdk(gw.url)
        while not stop.is_set():
            c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                      max_tokens=20, extra_body={"ignore_eos": True})
            served[0] += 1

    threads = [threading.Thread(target=chat, daemon=True) for _ in range(16)]
    for t in threads:
        t.start()
    backend = gw.gateway.fleet.backends[0]
    disp = gw.gateway.batching
    assert disp is not None
    try:
        # the backend is full, requests wait in the gateway's queue, the clients loop
        loaded = wait_for(lambda: backend.in_flight >= 8 and disp.core.queued >= 1
                          and served[0] >= 16, 10, 0.01)
        assert loaded, (backend.in_flight, disp.core.queued, served[0])
        t0 = time.monotonic()
        r = client.completions.create(model=MODEL, prompt=[[50 + i] * 3 for i in range(9)],
                                      max_tokens=5, extra_body={"ignore_eos": True})
        took = time.monotonic() - t0
        assert len(r.choices) == 9
        assert took < 5.0, took  # the queue timeout is 10 s
        before = served[0]
        # the small requests flow again afterwards
        assert wait_for(lambda: served[0] > before, 5), (before, served[0])
    finally:
        stop.set()
        for t in threads:
            t.join(30)
