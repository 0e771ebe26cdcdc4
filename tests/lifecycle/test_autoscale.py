"""Autoscaling signals end to end: the real gateway under uvicorn, one simulated vLLM with
two sequences at once, the openai SDK sending a burst of streams, and what an autoscaler
reads: ``GET /autoscale`` (KEDA's metrics-api scaler) and ``/metrics`` (its Prometheus
scaler).

Checked: under the burst the desired count exceeds the current one, said by the paradigm
that asked (fast: vLLM's running + waiting over the per-replica target); after the burst
the count falls back only once the scale-down cooldown has passed since the last decision
that asked for more; ``?model=`` is the flat answer KEDA reads, an unknown model is a 404 in
the OpenAI error shape, and with ``autoscale.enabled: false`` the endpoint says so.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.lifecycle.support import MODEL, Sim, metric, metric_samples, sdk, sdk_kwargs, wait_for
from tests.support.servers import GatewayThread, gateway_config

COOLDOWN_S = 3.0  # autoscale.scale_down_cooldown_s of the test
INTERVAL_S = 0.2  # autoscale.interval_s
STREAMS = 8  # concurrent streams of the burst, on a backend of 2 sequences
TOKENS = 30  # per stream (ITL 0.03 s: ~1 s alone, the burst queues ~4 s on 2 sequences)


@pytest.fixture
def one_backend() -> Iterator[tuple[GatewayThread, Sim]]:
    sim = Sim("a", itl_s=0.03, max_num_seqs=2)
    cfg = gateway_config(
        [{"id": "a", "url": sim.url, "max_num_seqs": 2}],
        admission={"in_flight_per_seq": 4},  # the queue forms on the backend, as vLLM's
        slo={"ttft_s": 60},  # no shedding: every stream of the burst is served
        # no forecaster: the ahead paradigm (which would keep asking for the burst's rate
        # seen again after a cold start) has no input; fast and fine decide alone
        forecast={"enabled": False},
        autoscale={"interval_s": INTERVAL_S, "scale_down_cooldown_s": COOLDOWN_S,
                   "max_replicas": 8},
    )
    gw = GatewayThread(cfg)
    gw.start()
    yield gw, sim
    gw.stop()
    sim.stop()


def answer(gw: GatewayThread, model: str = MODEL) -> dict[str, Any]:
    r = httpx.get(gw.url + "/autoscale", params={"model": model}, timeout=5)
    assert r.status_code == 200, r.text
    return r.json()  # type: ignore[no-any-return]


def burst(url: str, n: int) -> tuple[list[threading.Thread], list[str]]:
    """``n`` streaming chats at once through the SDK; returns the threads and a list that
    collects failures."""
    failures: list[str] = []

    def one() -> None:
        try:
            chunks = list(sdk(url).chat.completions.create(**sdk_kwargs(TOKENS, True)))
            if not chunks or chunks[-1].choices[0].finish_reason != "length":
                failures.append("stream did not finish")
        except Exception as e:
            failures.append(f"{type(e).__name__}: {e}")

    threads = [threading.Thread(target=one, daemon=True) for _ in range(n)]
    for t in threads:
        t.start()
    return threads, failures


def test_a_burst_raises_desired_replicas_and_the_cooldown_holds_the_fall(one_backend) -> None:
    gw, sim = one_backend
    assert wait_for(lambda: answer(gw)["desired_replicas"] == 1, 10), answer(gw)
    idle = answer(gw)
    assert idle["current_replicas"] == 1 and idle["ready_replicas"] == 1
    assert idle["min_replicas"] == 1 and idle["max_replicas"] == 8
    assert idle["decided_by"] == "local" and idle["inputs"] == "local"

    threads, failures = burst(gw.url, STREAMS)
    seen: list[dict[str, Any]] = []

    def raised() -> bool:
        seen.append(answer(gw))
        return seen[-1]["desired_replicas"] > 1

    assert wait_for(raised, 15), seen[-3:]
    during = seen[-1]
    assert during["desired_replicas"] > during["current_replicas"] == 1
    assert during["reason"] == "fast", during  # queue depth said so, at once
    assert during["paradigms"]["fast"] == during["desired_replicas"]
    m = metric_samples(gw.url)
    assert metric(m, "gateway_autoscale_desired_replicas", model=MODEL) > 1
    assert (metric(m, "gateway_replicas", model=MODEL, state="desired")
            > metric(m, "gateway_replicas", model=MODEL, state="current") == 1)
    assert metric(m, "gateway_replicas", model=MODEL, state="ready") == 1
    assert metric(m, "gateway_autoscale_signal", model=MODEL, paradigm="fast") > 1

    for t in threads:
        t.join(60)
    assert not failures, failures
    assert sim.chat_requests() >= STREAMS  # the backend served the burst itself

    # After the burst: recommended drops with the queue, desired only after the cooldown
    history: list[dict[str, Any]] = []

    def fell() -> bool:
        history.append(answer(gw))
        return history[-1]["desired_replicas"] == 1

    assert wait_for(fell, COOLDOWN_S + 20, interval=0.05), history[-1]
    asked_more = [a["at"] for a in seen + history if a["recommended_replicas"] > 1]
    assert asked_more, "no decision asked for more than one replica"
    held = [a for a in history if a["recommended_replicas"] < a["desired_replicas"] > 1]
    assert held and all(a["reason"] == "scale-down cooldown" for a in held), history[-5:]
    # the fall came a whole cooldown after the last decision seen asking for more
    assert history[-1]["at"] - max(asked_more) >= COOLDOWN_S - 1e-3, (
        history[-1]["at"], max(asked_more))
    assert metric(metric_samples(gw.url), "gateway_autoscale_desired_replicas",
                  model=MODEL) == 1


def test_the_flat_answer_and_the_errors(one_backend) -> None:
    gw, _ = one_backend
    assert wait_for(lambda: httpx.get(gw.url + "/autoscale", params={"model": MODEL},
                                      timeout=5).status_code == 200, 10)
    whole = httpx.get(gw.url + "/autoscale", timeout=5).json()
    assert set(whole["models"]) == {MODEL}
    assert whole["decided_by"] == "local" and whole["inputs"] == "local"
    flat = answer(gw)
    assert flat["model"] == MODEL
    assert isinstance(flat["desired_replicas"], int)  # KEDA's valueLocation
    assert set(flat["paradigms"]) == {"fast", "fine", "ahead"}
    assert flat["cold_start_measured"] is False  # found at start: the configured one
    assert flat["cold_start_s"] == gw.cfg.autoscale.cold_start_s

    r = httpx.get(gw.url + "/autoscale", params={"model": "org/no-such.model"}, timeout=5)
    assert r.status_code == 404
    err = r.json()["error"]
    assert err["code"] == "model_not_found" and err["param"] == "model"
    assert set(err) == {"message", "type", "param", "code"}


def test_autoscale_disabled_says_so() -> None:
    sim = Sim("a")
    cfg = gateway_config([{"id": "a", "url": sim.url}], autoscale={"enabled": False})
    try:
        with GatewayThread(cfg) as gw:
            r = httpx.get(gw.url + "/autoscale", timeout=5)
            assert r.status_code == 404
            assert r.json()["error"]["code"] == "autoscale_disabled"
            assert "autoscale.enabled" in r.json()["error"]["message"]
            names = {n for n, _ in metric_samples(gw.url)}
            assert not any(n.startswith("gateway_autoscale_") for n in names)
    finally:
        sim.stop()
