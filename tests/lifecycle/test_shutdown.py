"""Graceful shutdown of the gateway process (case BUG-21's last point: "gateway
self-shutdown (SIGTERM) follows the same rule"): ``llm-gateway serve -c <yaml>`` runs as a
real subprocess in front of a simulated vLLM; on SIGTERM ``/ready`` answers 503 at once, new
requests get 503 with ``retry-after``, in-flight streams finish within
``server.graceful_shutdown_s`` (or, past it, end with an error event then ``[DONE]``), and
the process exits 0."""

from __future__ import annotations

import os
import signal
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import yaml

from tests.lifecycle.support import Background, chat_body, sdk_kwargs, stream_chat
from tests.support.gateway_process import ServeProcess
from tests.support.scripted import read_json_answer, wait_for


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class GatewayProcess(ServeProcess):
    """``llm-gateway serve -c <tmp yaml>`` in front of ``backend_url``; its log goes to a
    file."""

    def __init__(self, tmp: Path, backend_url: str, grace_s: float,
                 extra: dict[str, Any] | None = None) -> None:
        port = free_port()
        cfg: dict[str, Any] = {
            "server": {"host": "127.0.0.1", "port": port, "graceful_shutdown_s": grace_s},
            "health": {"interval_s": 0.2, "timeout_s": 1.0},
            "telemetry": {"scrape_interval_s": 0.2},
            # warm-up runs (shapes 1 and 2) with 2 tokens each: at 0.1 s per token the
            # default 8 cost 1.6 s of every start
            "lifecycle": {"warmup_batch_shapes": [1, 2], "warmup_max_tokens": 2,
                          "short": {"every_s": 0},
                          "medium": {"every_s": 0, "every_requests": 0},
                          "long": {"every_s": 0}},
            "calibration": {"enabled": False},
            "backends": [{"id": "a", "url": backend_url}],
        }
        for section, fields in (extra or {}).items():
            if section == "backends":
                cfg["backends"][0].update(fields)
            elif section == "more_backends":
                cfg["backends"] += fields
            else:
                cfg[section] = {**cfg.get(section, {}), **fields}
        path = tmp / "gateway.yaml"
        path.write_text(yaml.safe_dump(cfg))
        super().__init__(path, port, tmp / "gateway.log", tmp)


@pytest.fixture
def gateway_process(tmp_path: Path) -> Iterator[Any]:
    made: list[GatewayProcess] = []

    def make(backend_url: str, grace_s: float, **extra: Any) -> GatewayProcess:
        g = GatewayProcess(tmp_path, backend_url, grace_s, extra)
        made.append(g)
        g.wait_ready()
        return g

    yield make
    for g in made:
        g.stop()


def start_stream(url: str, tokens: int) -> tuple[Background, float]:
    """Start a stream in the background; return it once its first event arrived."""
    first = threading.Event()
    bg = Background(lambda: stream_chat(url, chat_body(tokens, stream=True),
                                        on_first_event=first.set))
    assert first.wait(10), "no first event"
    return bg, time.monotonic()


def test_BUG_21_sigterm_stops_taking_requests_and_lets_streams_finish(sims, gateway_process):
    """SIGTERM while a ~3 s stream is in flight, ``graceful_shutdown_s`` 10: ``/ready`` is 503
    within 2 s (at once, but the process must first be scheduled to handle the signal on a
    loaded machine); a new chat request (SDK, no retries) gets a 503 OpenAI error
    ``gateway_shutting_down`` with ``retry-after``; the stream finishes normally (every token,
    ``[DONE]``, no error event); the process exits 0 after the stream ended and well within
    the grace period."""
    a = sims("A", itl_s=0.06)
    gw = gateway_process(a.url, 10.0)
    stream, _ = start_stream(gw.url, 50)

    with httpx.Client(timeout=2) as poll:
        gw.proc.send_signal(signal.SIGTERM)
        t_sig = time.monotonic()
        ready = poll.get(gw.url + "/ready")
        ready_after = time.monotonic() - t_sig
        while ready.status_code == 200 and time.monotonic() - t_sig < 2.0:
            ready = poll.get(gw.url + "/ready")
            ready_after = time.monotonic() - t_sig
    assert ready.status_code == 503 and ready_after < 2.0, (ready.status_code, ready_after)
    assert ready.json()["status"] == "shutting_down"

    client = openai.OpenAI(base_url=gw.url + "/v1", api_key="none", max_retries=0)
    with pytest.raises(openai.InternalServerError) as exc:
        client.chat.completions.create(**sdk_kwargs(4))
    assert exc.value.status_code == 503
    assert float(exc.value.response.headers["retry-after"]) > 0
    assert exc.value.response.json()["error"]["code"] == "gateway_shutting_down"
    assert gw.proc.poll() is None  # still serving its stream

    r = stream.result(20)
    assert r.problem() is None and not r.errors, (r.problem(), r.events[-3:])
    assert r.finish_reason == "length" and len(r.content) > 0
    rc = gw.proc.wait(timeout=15)
    exited = time.monotonic()
    assert rc == 0, gw.log.read_text()[-2000:]
    assert r.ended - 0.2 <= exited and exited - t_sig < 10.0, (r.ended - t_sig, exited - t_sig)
    assert r.ended > t_sig + 1.0  # the stream really ran on after the signal


def test_BUG_21_sigterm_grace_expiry_ends_streams_with_error_event(sims, gateway_process):
    """SIGTERM with ``graceful_shutdown_s`` 1 while a ~6 s stream is in flight: at the end of
    the grace period the stream ends with one OpenAI-shaped error event (code
    ``gateway_shutdown``) then ``[DONE]`` (never a silent cut), and the process exits 0
    soon after."""
    a = sims("A", itl_s=0.1)
    gw = gateway_process(a.url, 1.0)
    stream, _ = start_stream(gw.url, 60)
    os.kill(gw.proc.pid, signal.SIGTERM)
    t_sig = time.monotonic()
    r = stream.result(20)
    assert r.problem() is None, (r.problem(), r.events[-3:])  # error event, then [DONE]
    assert len(r.errors) == 1 and r.errors[0]["code"] == "gateway_shutdown", r.events[-3:]
    assert r.content and r.finish_reason is None
    assert 0.8 <= r.ended - t_sig <= 3.0, r.ended - t_sig
    rc = gw.proc.wait(timeout=10)
    assert rc == 0, gw.log.read_text()[-2000:]
    assert time.monotonic() - t_sig < 6.0


@pytest.mark.parametrize("queue", ["admission", "batcher"])
def test_sigterm_answers_queued_requests_in_openai_shape(sims, gateway_process, queue):
    """A hung backend holds 2 requests; 8 more wait in the gateway's queue (the admission
    scheduler's ``max_in_flight`` 2, or the batcher's flow control with ``max_num_seqs``
    2). SIGTERM with ``graceful_shutdown_s`` 1: at the end of the grace period the queued
    ones get 503 ``gateway_shutting_down`` (never sent, another instance may take them) and
    the two in flight are ended with the same answer; every client gets one OpenAI-shaped
    answer (uvicorn's plain-text 500 went to the queued ones once, long after the grace
    period), and the process exits 0."""
    a = sims("A")
    if queue == "admission":
        extra: dict[str, Any] = {"admission": {"max_in_flight": 2, "max_queue_wait_s": 60}}
    else:
        extra = {"batcher": {"enabled": True}, "backends": {"max_num_seqs": 2},
                 "admission": {"max_queue_wait_s": 60}}
    gw = gateway_process(a.url, 1.0, **extra)
    httpx.patch(a.url + "/sim/faults", json={"hang": True}).raise_for_status()
    answers: list[httpx.Response | Exception] = []

    def call() -> None:
        try:
            answers.append(httpx.post(gw.url + "/v1/chat/completions",
                                      json=chat_body(4), timeout=30))
        except httpx.HTTPError as e:
            answers.append(e)

    threads = [threading.Thread(target=call) for _ in range(10)]
    for t in threads:
        t.start()
    # two reached the backend and hang there
    assert wait_for(lambda: a.stats()["open_requests"] >= 2, 10), a.stats()
    time.sleep(0.5)  # the other 8 are queued in the gateway
    os.kill(gw.proc.pid, signal.SIGTERM)
    t_sig = time.monotonic()
    for t in threads:
        t.join(20)
    took = time.monotonic() - t_sig
    assert len(answers) == 10
    for r in answers:
        assert isinstance(r, httpx.Response), r
        assert r.status_code == 503, (r.status_code, r.text[:200])
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"}
        assert err["code"] == "gateway_shutting_down" and "retry-after" in r.headers
    assert took < 5.0, took  # grace 1 s, then at once
    assert gw.proc.wait(timeout=10) == 0, gw.log.read_text()[-2000:]


def test_sigterm_lets_a_request_in_retry_backoff_finish(sims, gateway_process):
    """A answers every request with 500, B answers; backoff before a retry up to 3 s.
    SIGTERM while requests wait in that backoff (``graceful_shutdown_s`` 10): they are
    still owed an answer, so the grace period waits for them, and their retries on B
    answer 200 (they got A's 500 at once when only backend-held requests were counted)."""
    a, b = sims("A"), sims("B")
    gw = gateway_process(a.url, 10.0, retry={"backoff_base_s": 3.0, "backoff_max_s": 3.0},
                         more_backends=[{"id": "b", "url": b.url}])
    httpx.patch(a.url + "/sim/faults", json={"error_rate": 1.0}).raise_for_status()
    answers: list[int] = []
    # Clients are made before the threads start (making one costs CPU: on a loaded machine
    # a request still on its way at SIGTERM rightly got 503), and SIGTERM waits until all 6
    # reached a backend, while those that met A wait out their backoff.
    clients = [httpx.Client(timeout=30) for _ in range(6)]

    def call(client: httpx.Client) -> None:
        with client:
            answers.append(client.post(gw.url + "/v1/chat/completions",
                                       json=chat_body(4)).status_code)

    threads = [threading.Thread(target=call, args=(c,)) for c in clients]
    for t in threads:
        t.start()
    # distinct request ids: a retry on B must not stand for a request still on its way
    assert wait_for(lambda: bool(a.recent_ids()) and len(a.recent_ids() | b.recent_ids()) >= 6,
                    10, 0.01), (a.recent_ids(), b.recent_ids())
    os.kill(gw.proc.pid, signal.SIGTERM)
    for t in threads:
        t.join(20)
    assert answers == [200] * 6, answers
    assert gw.proc.wait(timeout=10) == 0, gw.log.read_text()[-2000:]


def test_sigterm_answers_a_request_still_uploading_its_body(sims, gateway_process):
    """A client sends the headers and 10 of 1000 body bytes, then nothing. SIGTERM with
    ``graceful_shutdown_s`` 1: when the grace period ends it gets 503
    ``gateway_shutting_down`` in OpenAI shape (it got uvicorn's plain-text 500 when
    uvicorn's own timeout cancelled it), and the process exits 0."""
    a = sims("A")
    gw = gateway_process(a.url, 1.0)
    with socket.create_connection(("127.0.0.1", gw.port), timeout=10) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n"
                  b"content-type: application/json\r\ncontent-length: 1000\r\n\r\n"
                  b'{"model": ')
        time.sleep(0.3)
        os.kill(gw.proc.pid, signal.SIGTERM)
        t_sig = time.monotonic()
        data = read_json_answer(s)
    took = time.monotonic() - t_sig
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 503"), data[:300]
    assert b"gateway_shutting_down" in body and b'"param"' in body, body[:300]
    assert took < 4.0, took
    assert gw.proc.wait(timeout=10) == 0, gw.log.read_text()[-2000:]
